"""From FullyShardedDataParallel's arguments to a sharding strategy and its process groups.

Every strategy is a pair of process groups (torch FSDP1 keeps the same pair:
``process_group`` and ``_inter_node_pg``):

===============  =========================  ==========================
strategy         shard group                replicate group
===============  =========================  ==========================
FULL_SHARD       ``process_group`` (all)    none
SHARD_GRAD_OP    ``process_group`` (all)    none
NO_SHARD         none (groups of one)       ``process_group`` (all)
HYBRID_SHARD     the ranks of one node      the same local rank on every node
===============  =========================  ==========================

A gradient is reduce-scattered inside the shard group, then all-reduced
across the replicate group (``flat_param.FlatParamHandle.reduce_grad``).

The groups come from ``minifsdp.mesh.DeviceMesh``. ``device_mesh=`` names them
as torch's FSDP1 does: a minifsdp mesh gives its ``dp`` group, or for
HYBRID_SHARD its ``(dp_shard, dp_replicate)`` groups (``DeviceMesh(dp=4,
dp_shard=2)``); a torch ``DeviceMesh`` gives its only group, or for
HYBRID_SHARD the groups of its 2-D (replicate, shard) mesh, dims 1 and 0.

HYBRID_SHARD without a process group does what torch does
(``_init_utils._init_process_group_state_for_hybrid_shard``): the node size is
the number of devices of the compute device's type on this machine,
``torch.cuda.device_count()`` on CUDA, ``torch.cpu.device_count()`` (which is 1)
on CPU, so on CPU the default shard groups hold one rank each: nothing is
sharded, as with torch. Pass ``process_group=init_hybrid_groups(shard_size)``
to choose. One difference: torch refuses HYBRID_SHARD without a group when
units are wrapped by hand (each might build its own groups); here every unit
gets the same cached pair, so that works. Read ``fully_sharded.py`` first; this
file is its constructor's helper.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

from .. import dist
from ..mesh import DeviceMesh
from ..mixed_precision.policy import from_fairscale, resolve
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["HYBRID", "resolve_strategy", "resolve_mixed_precision", "resolve_offload", "groups", "mesh_groups",
           "devices_per_node", "init_hybrid_groups"]

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def check_arguments(module: Any, sharding_strategy: Any, backward_prefetch: Any, auto_wrap_policy: Any,
                    device_id: Any) -> None:
    """FullyShardedDataParallel's arguments, checked before any group is built or collective runs: one line
    naming the fix where torch would fail deep inside, or silently ignore a string that names no member."""
    dist.require_module(module, "FullyShardedDataParallel")
    _check_member(sharding_strategy, ShardingStrategy, "sharding_strategy")
    _check_member(backward_prefetch, BackwardPrefetch, "backward_prefetch")
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(f"auto_wrap_policy must be a policy (module, recurse, nonwrapped_numel) -> bool, got "
                        f"{type(auto_wrap_policy).__name__}; for a set of classes pass ModuleWrapPolicy({{Block}})")
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device_id={device_id!r} is a CUDA device and CUDA is not available here; leave "
                         "device_id=None (FSDP then computes on dist.device())")


def _check_member(value: Any, enum_cls: type, name: str) -> None:
    if value is None or isinstance(value, enum_cls):
        return
    members = [m for m in enum_cls.__members__ if not m.startswith("_")]
    hint = (f"{enum_cls.__name__}.{value}" if value in members
            else "one of " + ", ".join(f"{enum_cls.__name__}.{m}" for m in members))
    raise TypeError(f"{name} takes a {enum_cls.__name__} member, got {value!r}; pass {hint}")


def resolve_strategy(strategy: ShardingStrategy, reshard_after_forward: bool | None) -> ShardingStrategy:
    """FairScale's ``reshard_after_forward`` picks between the ZeRO-3 and ZeRO-2-like variants."""
    if reshard_after_forward is None or strategy == ShardingStrategy.NO_SHARD:
        return strategy
    if strategy in HYBRID:
        return ShardingStrategy.HYBRID_SHARD if reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def resolve_mixed_precision(mp: MixedPrecision | bool | None, fp32_reduce_scatter: bool = False,
                            compute_dtype: torch.dtype | None = None,
                            buffer_dtype: torch.dtype | None = None) -> MixedPrecision | None:
    """torch's ``MixedPrecision``, or FairScale's flags with FairScale's meaning (``mixed_precision.from_fairscale``):
    ``mixed_precision=True`` is fp16 compute and fp16 reduction unless ``fp32_reduce_scatter``."""
    fairscale = fp32_reduce_scatter or compute_dtype is not None or buffer_dtype is not None
    if isinstance(mp, MixedPrecision):
        if fairscale:
            raise ValueError("pass either mixed_precision=MixedPrecision(...) (torch) or FairScale's flags "
                             "(mixed_precision=True, fp32_reduce_scatter, compute_dtype, buffer_dtype), not both")
        return mp
    if mp is None or isinstance(mp, bool):
        return from_fairscale(bool(mp), fp32_reduce_scatter, compute_dtype, buffer_dtype)
    return resolve(mp)  # raises the one-line TypeError


def resolve_offload(cpu_offload: CPUOffload | bool | None, move_params_to_cpu: bool = False,
                    move_grads_to_cpu: bool | None = None) -> CPUOffload:
    """torch's ``CPUOffload``, or FairScale's booleans: ``cpu_offload=True`` / ``move_params_to_cpu=True``
    keep the fp32 shard in host memory; its gradient follows it there (FairScale's ``move_grads_to_cpu``
    defaults to the same value, and the optimizer steps where both live)."""
    offload = cpu_offload.offload_params if isinstance(cpu_offload, CPUOffload) else bool(cpu_offload)
    offload = offload or move_params_to_cpu
    if move_grads_to_cpu is not None and move_grads_to_cpu != offload:
        raise ValueError(f"move_grads_to_cpu={move_grads_to_cpu} with parameters {'' if offload else 'not '}"
                         "offloaded: minifsdp keeps a gradient shard next to its parameter shard; drop "
                         "move_grads_to_cpu (it follows cpu_offload)")
    return CPUOffload(offload_params=offload)


def groups(process_group: Any, strategy: ShardingStrategy, device: torch.device,
           device_mesh: Any = None) -> tuple[Any, Any]:
    """(shard group, replicate group) for a strategy; ``device`` is the compute device (HYBRID's default)."""
    if device_mesh is not None:
        if process_group is not None:  # torch FSDP1 refuses both as well
            raise ValueError("pass process_group or device_mesh to FullyShardedDataParallel, not both")
        process_group = mesh_groups(device_mesh, strategy)
    if strategy in HYBRID:
        if isinstance(process_group, tuple) and len(process_group) == 2:
            return process_group
        if process_group is not None:
            raise ValueError("HYBRID_SHARD takes process_group=(shard_group, replicate_group) or None "
                             "(then: shard inside each node, see init_hybrid_groups)")
        return init_hybrid_groups(devices_per_node(device))
    if isinstance(process_group, tuple):
        raise ValueError(f"a (shard, replicate) group pair is for HYBRID_SHARD, not {strategy.name}; pass one group, "
                         "or sharding_strategy=ShardingStrategy.HYBRID_SHARD")
    group = process_group if process_group is not None else tdist.group.WORLD
    return (None, group) if strategy == ShardingStrategy.NO_SHARD else (group, None)


def mesh_groups(mesh: Any, strategy: ShardingStrategy) -> Any:
    """``process_group`` from a ``device_mesh``: one group, or HYBRID's (shard, replicate) pair."""
    hybrid = strategy in HYBRID
    if isinstance(mesh, DeviceMesh):  # the dp groups; HYBRID: dp split as dp_replicate x dp_shard
        return (mesh.get_group("dp_shard"), mesh.get_group("dp_replicate")) if hybrid else mesh.get_group("dp")
    ndim = getattr(mesh, "ndim", None)  # torch.distributed.device_mesh.DeviceMesh
    if ndim != (2 if hybrid else 1):
        raise ValueError(f"device_mesh={mesh!r}: {strategy.name} takes a minifsdp.mesh.DeviceMesh or a "
                         f"{'2-D (replicate, shard)' if hybrid else '1-D'} torch DeviceMesh")
    return (mesh.get_group(1), mesh.get_group(0)) if hybrid else mesh.get_group(0)


def devices_per_node(device: torch.device) -> int:
    """torch's node size for HYBRID_SHARD: ``torch.<device type>.device_count()``.

    >>> devices_per_node(torch.device("cpu"))   # torch.cpu.device_count(): one CPU "device"
    1
    """
    return getattr(torch, torch.device(device).type).device_count()


_hybrid_cache: dict[tuple[int, int], DeviceMesh] = {}


def init_hybrid_groups(shard_size: int | None = None) -> tuple[Any, Any]:
    """This rank's (shard group, replicate group) for HYBRID_SHARD. Collective: call on every rank.

    Shard groups are ``shard_size`` consecutive ranks (a node), replicate groups
    the ranks with the same position in each (torch's intra-/inter-node groups):
    the ``dp_shard`` and ``dp_replicate`` groups of ``DeviceMesh(dp=world, dp_shard=shard_size)``.
    With 4 ranks and ``shard_size=2``: shard {0,1} {2,3}, replicate {0,2} {1,3}.
    ``shard_size`` defaults to ``devices_per_node(dist.device())``, as torch's HYBRID_SHARD.
    Every unit of a model gets the same pair (the mesh is cached per world and size).
    """
    world = dist.world_size()
    shard_size = shard_size or devices_per_node(dist.device())
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide the world size {world}: pass "
                         "process_group=init_hybrid_groups(shard_size) with the ranks per node")
    key = (id(tdist.distributed_c10d._get_default_group()), shard_size)  # a new world needs new groups
    if key not in _hybrid_cache:  # every rank builds every group of the mesh, in the same order
        _hybrid_cache[key] = DeviceMesh(dp=world, dp_shard=shard_size)
    return mesh_groups(_hybrid_cache[key], ShardingStrategy.HYBRID_SHARD)
