"""Turning FullyShardedDataParallel's arguments into process groups and parameter lists.

Helpers for the constructor in ``fully_sharded.py``, kept apart so that file
reads as one training step:

* ``groups``: the (shard group, replicate group) pair behind each
  ``ShardingStrategy`` -- NO_SHARD is "shard groups of one rank, replicate
  across all", HYBRID_SHARD "shard inside a node, replicate across nodes"
  (``init_hybrid_groups``), FULL_SHARD / SHARD_GRAD_OP "shard across all";
* ``managed_params``: which parameters a unit flattens (not those of nested
  units or ignored modules), with the tied-weights-across-units check;
* ``materialize_meta``: deferred initialization -- a model built on the meta
  device gets real tensors (``param_init_fn``, or ``reset_parameters()``);
* the guard that catches an optimizer built before wrapping, and
  ``all_ranks_enter``, which turns "one rank called a collective alone" (a
  hang) into an error naming the absent ranks.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as tdist
import torch.nn as nn

from .. import dist
from .api import MixedPrecision, ShardingStrategy
from .flat_param import FLATTENED_MARK, RETIRED_MARK

__all__ = ["clean_name", "managed_params", "managed_buffers", "materialize_meta", "resolve_strategy", "resolve_mixed_precision",
           "groups", "init_hybrid_groups", "install_optimizer_check", "all_ranks_enter", "WRAPPED", "HYBRID",
           "ENTRY_TIMEOUT_S"]

WRAPPED = "_fsdp_wrapped_module"
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
ENTRY_TIMEOUT_S = 60.0  # how long a rank waits for the others to enter a collective checkpoint function
_entries: dict[str, int] = {}


def clean_name(path: str) -> str:
    """The unwrapped model's name for a path: drop the wrapper's ``_fsdp_wrapped_module`` hops.

    >>> clean_name("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.attn.qkv.weight")
    'blocks.0.attn.qkv.weight'
    """
    return ".".join(p for p in path.split(".") if p and p != WRAPPED)


def managed_params(module: nn.Module, ignored: set[nn.Module],
                   unit_cls: type) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """This unit's parameters: everything below ``module`` except nested units and ignored modules."""
    out: list[tuple[str, nn.Module, str, nn.Parameter]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for attr, p in m._parameters.items():
            if p is not None:
                if hasattr(p, FLATTENED_MARK):
                    raise ValueError(f"parameter {prefix + attr!r} is also used by FSDP unit "
                                     f"{getattr(p, FLATTENED_MARK)!r} (tied weights across units); wrap every "
                                     "module that uses it in one unit (e.g. keep it out of the wrap policy)")
                out.append((prefix + attr, m, attr, p))
        for name, child in m._modules.items():
            if child is not None and not isinstance(child, unit_cls) and child not in ignored:
                visit(child, f"{prefix}{name}.")
    visit(module, "")
    return out


def managed_buffers(module: nn.Module, ignored: set[nn.Module], device: torch.device) -> list[torch.Tensor]:
    """Buffers are not sharded (every rank keeps them whole); move them to the compute device."""
    out = []
    for m in module.modules():
        if m not in ignored:
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b = b.to(device)
                    out.append(b)
    return out


def materialize_meta(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None,
                     ignored_modules: Any, device: torch.device, unit_cls: type) -> None:
    """Give a module built on the meta device real tensors before it is flattened (torch FSDP1's contract).

    Nothing happens unless a parameter or buffer below ``module`` (outside units and
    ignored modules) is on the meta device. Then, visiting ``module`` and its
    descendants breadth-first:

    * with ``param_init_fn``: ``param_init_fn(m)`` is called on *every* visited
      module, which must materialize (e.g. ``m.to_empty(device=..., recurse=False)``)
      and initialize ``m``'s own tensors;
    * without: each module that owns tensors gets ``m.to_empty(device, recurse=False)``
      and ``m.reset_parameters()`` (what torch does; built-in layers have one).

    ``to_empty`` gives every module a tensor of its own, which silently unties
    weights (GPT's head and token embedding); a parameter two modules shared on
    the meta device is shared again afterwards (the first owner's values win).

        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())      # no memory, no init yet
        FSDP(model, param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False))
    """
    ignored = {m for root in (ignored_modules or ()) for m in root.modules()}
    modules, queue = [], collections.deque([module])
    while queue:  # breadth-first, stopping at nested units and ignored modules (as torch does)
        m = queue.popleft()
        modules.append(m)
        queue.extend(c for c in m.children() if not isinstance(c, unit_cls) and c not in ignored)
    owned = [(m, name, t) for m in modules for name, t in [*m._parameters.items(), *m._buffers.items()]
             if t is not None]
    if not any(t.is_meta for *_, t in owned):
        return
    first_owner: dict[int, tuple[nn.Module, str]] = {}
    ties = []  # (module, name, first module, first name) of parameters seen twice
    for m, name, t in owned:
        if id(t) in first_owner and name in m._parameters:
            ties.append((m, name, *first_owner[id(t)]))
        first_owner.setdefault(id(t), (m, name))
    names = {id(m): path for path, m in module.named_modules()}
    with torch.no_grad():
        for m in modules:
            if param_init_fn is not None:
                param_init_fn(m)
            elif any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()]):
                if not hasattr(m, "reset_parameters"):
                    raise ValueError(f"module {names[id(m)] or 'root'!r} ({type(m).__name__}) is on the meta device "
                                     "and has no reset_parameters() "
                                     "to initialize it; pass FSDP(..., param_init_fn=fn) where fn(module) materializes "
                                     "and initializes it, or build the model on a real device")
                m.to_empty(device=device, recurse=False)
                m.reset_parameters()
    for m, name, first, first_name in ties:
        m._parameters[name] = first._parameters[first_name]
    left = [f"{names[id(m)]}.{name}".lstrip(".") for m in modules for name, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None and t.is_meta]
    if left:
        raise ValueError(f"param_init_fn left {left[:4]} on the meta device; it must materialize every module it is "
                         "given, e.g. module.to_empty(device=..., recurse=False), then initialize it")


def resolve_strategy(strategy: ShardingStrategy, reshard_after_forward: bool | None) -> ShardingStrategy:
    """FairScale's ``reshard_after_forward`` picks between the ZeRO-3 and ZeRO-2-like variants."""
    if reshard_after_forward is None or strategy == ShardingStrategy.NO_SHARD:
        return strategy
    if strategy in HYBRID:
        return ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def resolve_mixed_precision(mp: MixedPrecision | bool | None) -> MixedPrecision | None:
    if mp is True:  # FairScale's shorthand, read as bf16 (see MixedPrecision)
        return MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    if mp is False or mp is None:
        return None
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mixed_precision must be a MixedPrecision, True or None, got {type(mp).__name__}")
    return mp


def groups(process_group: Any, strategy: ShardingStrategy) -> tuple[Any, Any]:
    """(shard group, replicate group) for a strategy. NO_SHARD = shard groups of one."""
    if strategy in HYBRID:
        if isinstance(process_group, tuple) and len(process_group) == 2:
            return process_group
        if process_group is not None:
            raise ValueError("HYBRID_SHARD takes process_group=(shard_group, replicate_group) or None "
                             "(then: shard inside each node, see init_hybrid_groups)")
        return init_hybrid_groups()
    if isinstance(process_group, tuple):
        raise ValueError(f"a (shard, replicate) group pair is for HYBRID_SHARD, not {strategy.name}")
    group = process_group if process_group is not None else tdist.group.WORLD
    return (None, group) if strategy == ShardingStrategy.NO_SHARD else (group, None)


_hybrid_cache: dict[tuple[int, int], tuple[Any, Any]] = {}


def init_hybrid_groups(shard_size: int | None = None) -> tuple[Any, Any]:
    """This rank's (shard group, replicate group) for HYBRID_SHARD. Collective: call on every rank.

    ``shard_size`` defaults to the ranks per node (torchrun's LOCAL_WORLD_SIZE).
    With 4 ranks and ``shard_size=2``: shard groups {0,1} {2,3}, replicate
    groups {0,2} {1,3}.
    """
    world = dist.world_size()
    shard_size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide the world size {world}")
    key = (id(tdist.distributed_c10d._get_default_group()), shard_size)  # a new world needs new groups
    if key not in _hybrid_cache:
        rank, mine = dist.rank(), [None, None]
        for start in range(0, world, shard_size):  # every rank creates every group, in the same order
            ranks = list(range(start, start + shard_size))
            g = tdist.new_group(ranks)
            mine[0] = g if rank in ranks else mine[0]
        for offset in range(shard_size):
            ranks = list(range(offset, world, shard_size))
            g = tdist.new_group(ranks)
            mine[1] = g if rank in ranks else mine[1]
        _hybrid_cache[key] = (mine[0], mine[1])
    return _hybrid_cache[key]


_optimizer_check_installed = False


def install_optimizer_check() -> None:
    global _optimizer_check_installed
    if not _optimizer_check_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_check_optimizer)
        _optimizer_check_installed = True


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer built *before* wrapping holds the original parameters, which FSDP emptied."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.numel() == 0 and getattr(p, RETIRED_MARK, False):
                raise RuntimeError(f"{type(optimizer).__name__} holds parameters that FullyShardedDataParallel "
                                   "flattened into shards (it was built before wrapping); build it after: "
                                   "optim = torch.optim.AdamW(fsdp_model.parameters())")


def _group_ranks(model: nn.Module) -> list[int]:
    ranks: set[int] = set()
    for g in (model._shard_group, model._replicate_group):
        if g is not None:
            ranks.update(tdist.get_process_group_ranks(g))
    return sorted(ranks) or [dist.rank()]


def all_ranks_enter(what: str, model: nn.Module) -> None:
    """Meet every rank of the model's groups before the first collective, or fail naming the absent ones."""
    ranks = _group_ranks(model)  # the key-value store is cheap and never blocks without a deadline
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
