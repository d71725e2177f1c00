"""What every file of ``fsdp/`` may know about a unit: its state, how to find units, how to meet.

A *unit* is one ``FullyShardedDataParallel`` instance: a module whose own
parameters (not those of nested units) are flattened into one shard per rank.
The training step (``fully_sharded.py``) and the whole-model operations
between steps (``full_params.py``: clipping, full parameters;
``state_dict.py``: checkpoints) all walk the units of a model and read the same
few attributes. Those live here, in ``FSDPUnit``, so the files that need them
import this module instead of each other: imports in ``fsdp/`` run one way::

    api, flat_param, unit, strategy, params, wrap      (no FSDP class needed)
      -> full_params -> state_dict                     (between steps)
        -> fully_sharded                               (the class; delegates to both)

torch splits its FSDP1 the same way: ``_FSDPState`` and ``TrainingState`` in
``_common_utils.py``, unit traversal in ``_traversal_utils.py``.
Read ``fully_sharded.py`` first; come here for the attributes it sets.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as tdist
import torch.nn as nn

from .. import dist
from .api import FullOptimStateDictConfig, FullStateDictConfig, StateDictSettings, StateDictType

if TYPE_CHECKING:  # type hints only; flat_param.py is imported by fully_sharded.py
    from .flat_param import FlatParamHandle

__all__ = ["TrainingState", "FSDPUnit", "WRAPPED", "clean_name", "units", "all_ranks_enter", "ENTRY_TIMEOUT_S"]

WRAPPED = "_fsdp_wrapped_module"  # the attribute holding the wrapped module (torch's name)
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"  # minifsdp.checkpoint's wrapper (torch's name); stripped from keys
ENTRY_TIMEOUT_S = 60.0  # how long a rank waits for the others to enter a collective checkpoint function


class TrainingState(enum.Enum):
    """Where a unit is in the step (torch's ``TrainingState``): whole-model operations
    such as ``summon_full_params`` are only allowed while every unit is IDLE."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class FSDPUnit(nn.Module):
    """The state of one unit that files other than ``fully_sharded.py`` read.

    ``FullyShardedDataParallel`` is the only subclass; it sets every attribute in its
    constructor. Keeping the list here documents what ``full_params.py`` and
    ``state_dict.py`` rely on:

    * ``_handles``: the unit's ``FlatParamHandle`` s (one per requires_grad group);
    * ``_name``: the unit's path in the unwrapped model (``"blocks.0"``, ``"root"``);
    * ``_training_state``: a ``TrainingState``;
    * ``_shard_group`` / ``_replicate_group``: process groups (None = not used);
    * ``compute_device``: where the unsharded parameters live;
    * the state dict settings, changed only through ``_set_state_dict_settings``.
    """

    _handles: list[FlatParamHandle]
    _name: str
    _training_state: TrainingState
    _shard_group: Any
    _replicate_group: Any
    compute_device: torch.device

    def _init_state_dict_settings(self) -> None:
        # torch's defaults: FULL_STATE_DICT, full optimizer state dicts
        self._state_dict_settings = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                                      FullOptimStateDictConfig())

    def _set_state_dict_settings(self, settings: StateDictSettings) -> StateDictSettings:
        """Use ``settings`` for this unit's state dicts from now on; return the previous ones."""
        previous, self._state_dict_settings = self._state_dict_settings, settings
        return previous

    @property
    def state_dict_settings(self) -> StateDictSettings:
        return self._state_dict_settings


def clean_name(path: str) -> str:
    """The unwrapped model's name for a path: drop the wrappers' hops, FSDP's ``_fsdp_wrapped_module``
    and activation checkpointing's ``_checkpoint_wrapped_module`` (torch's ``clean_tensor_name`` too).

    >>> clean_name("_fsdp_wrapped_module.blocks.0._checkpoint_wrapped_module._fsdp_wrapped_module.ln_1.weight")
    'blocks.0.ln_1.weight'
    """
    return ".".join(p for p in path.split(".") if p and p not in (WRAPPED, CHECKPOINT_WRAPPED))


def units(module: nn.Module) -> Iterator[tuple[str, FSDPUnit]]:
    """Every unit at or below ``module``, parents before children, with its clean path.

    >>> [path for path, _ in units(FSDP(gpt, auto_wrap_policy=ModuleWrapPolicy({Block})))]  # doctest: +SKIP
    ['', 'blocks.0', 'blocks.1']
    """
    for path, m in module.named_modules():
        if isinstance(m, FSDPUnit):
            yield clean_name(path), m


def _group_ranks(unit: FSDPUnit) -> list[int]:
    ranks: set[int] = set()
    for g in (unit._shard_group, unit._replicate_group):
        if g is not None:
            ranks.update(tdist.get_process_group_ranks(g))
    return sorted(ranks) or [dist.rank()]


_entries: dict[str, int] = {}  # how often this process entered each function: the store key's round


def all_ranks_enter(what: str, unit: FSDPUnit) -> None:
    """Meet every rank of the unit's groups before the first collective, or fail naming the absent ones.

    A FULL state dict or ``summon_full_params`` all-gathers; one rank calling it alone
    would wait forever. The key-value store is cheap and never blocks without a deadline.
    """
    ranks = _group_ranks(unit)
    if len(ranks) == 1:
        return
    store = tdist.distributed_c10d._get_default_store()
    _entries[what] = _entries.get(what, 0) + 1
    base = f"minifsdp/{what}/{_entries[what]}"
    store.set(f"{base}/{dist.rank()}", "1")
    keys = [f"{base}/{r}" for r in ranks]
    deadline = time.monotonic() + ENTRY_TIMEOUT_S
    while not store.check(keys):
        if time.monotonic() > deadline:
            absent = [r for r, k in zip(ranks, keys) if not store.check([k])]
            raise RuntimeError(f"{what}() was called on rank {dist.rank()} but not on ranks {absent} within "
                               f"{ENTRY_TIMEOUT_S:.0f}s; it gathers shards with collectives, so call it on every "
                               "rank (keep the result on one rank instead, e.g. rank0_only=True)")
        time.sleep(0.005)
