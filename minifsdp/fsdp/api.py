"""The knobs of FullyShardedDataParallel: enums and small config classes.

Names, members and defaults mirror ``torch.distributed.fsdp.api`` so code
written for PyTorch's FSDP runs on minifsdp by changing the import:

    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, MixedPrecision
    model = FSDP(model, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))

Each option is explained where it is defined; the code that acts on it is in
``fully_sharded.py`` (strategies, prefetch, mixed precision, offload) and
``state_dict.py`` (state dict types).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# One definition, shared with DDP and ZeRO: the policy lives in the mixed_precision technique.
from ..mixed_precision.policy import MixedPrecision

__all__ = ["ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType",
           "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
           "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "LocalOptimStateDictConfig", "StateDictSettings"]


class ShardingStrategy(enum.Enum):
    """What each rank keeps between uses (ZeRO paper, Rajbhandari et al. 2020, section 5).

    With N ranks and a model of P parameters, per rank, in a training step:

    ===============  ==================  =====================  ==============================
    strategy         params at rest      params after forward   gradient sync
    ===============  ==================  =====================  ==============================
    FULL_SHARD       P/N  (ZeRO-3)       P/N (freed again)      reduce-scatter
    SHARD_GRAD_OP    P/N  (ZeRO-2-like)  P   (kept for bwd)     reduce-scatter
    NO_SHARD         P    (DDP)          P                      all-reduce
    HYBRID_SHARD     P/n inside a group of n, replicated across groups: reduce-scatter in
                     the group, then all-reduce the shard across groups
    ===============  ==================  =====================  ==============================

    FULL_SHARD all-gathers every unit twice (before forward and before
    backward): 3 x P bytes moved per step instead of DDP's 2 x P, for 1/N of
    the memory. SHARD_GRAD_OP skips the second all-gather and pays with
    keeping every unit unsharded from its forward until its backward.
    """

    FULL_SHARD = 1
    SHARD_GRAD_OP = 2
    NO_SHARD = 3
    HYBRID_SHARD = 4
    _HYBRID_SHARD_ZERO2 = 5  # HYBRID_SHARD without resharding after forward


class BackwardPrefetch(enum.Enum):
    """When to start all-gathering the *next* unit's parameters in backward.

    BACKWARD_PRE:  before the current unit's gradient computation, so the
                   gather overlaps it (more memory: two units unsharded at once).
    BACKWARD_POST: after the current unit's gradients are computed (its
                   parameters can be freed first: less memory, less overlap).
    None:          no prefetch; each unit gathers when its backward starts.
    """

    BACKWARD_PRE = 1
    BACKWARD_POST = 2


@dataclass
class CPUOffload:
    """``offload_params=True``: the shard and its gradient live in host memory.

    The optimizer then steps on the CPU; each unshard copies the shard to the
    compute device first, and the reduced gradient shard is copied back. On a
    CPU-only machine the compute device *is* the CPU: the plumbing runs (the
    shard and the unsharded buffer are distinct host tensors, the latter freed
    after use) but nothing moves between devices.
    """

    offload_params: bool = False


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns inside ``FSDP.state_dict_type(...)``.

    FULL_STATE_DICT:    the unwrapped model's keys and full tensors (gathered).
    SHARDED_STATE_DICT: the same keys; each value is this rank's piece of the
                        parameter (a ``FlatShard``): no communication.
    LOCAL_STATE_DICT:   the flat shards under their flat-parameter names.
    """

    FULL_STATE_DICT = 1
    LOCAL_STATE_DICT = 2
    SHARDED_STATE_DICT = 3


@dataclass
class StateDictConfig:
    """``offload_to_cpu``: put the returned tensors in host memory."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 returns the (full) dict, the others ``{}``."""

    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    pass


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    pass


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    """What ``FSDP.set_state_dict_type`` sets on every unit and returns (the previous settings)."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
