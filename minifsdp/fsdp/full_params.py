"""Whole-model operations between steps: global gradient clipping and gathering full parameters.

Mirror ``FullyShardedDataParallel.clip_grad_norm_`` and
``FullyShardedDataParallel.summon_full_params`` of PyTorch FSDP (and
FairScale). Both are collectives: every rank must call them.

Why clipping needs care: each rank holds 1/N of the gradient, so a local
``torch.nn.utils.clip_grad_norm_`` would clip by the norm of a shard. The
global 2-norm is ``sqrt(sum over ranks of sum |g_shard|^2)``: one all-reduce
of one number.

Read ``fully_sharded.py`` first: its ``clip_grad_norm_`` and ``summon_full_params``
call these (``module_or_self`` lets the latter be called in torch's and FairScale's forms).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .. import comm, dist
from .unit import FSDPUnit, TrainingState, all_ranks_enter, units

__all__ = ["clip_grad_norm_", "summon_full_params", "module_or_self"]


@torch.no_grad()
def clip_grad_norm_(model: FSDPUnit, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip all gradients by their *global* norm (over every shard); return that norm.

    Each rank sums ``|g|^p`` over its gradient shards; one all-reduce over the
    shard group adds the shards up (padding is zero; replicas hold the same
    shard, so they are not counted twice). Same result as
    ``torch.nn.utils.clip_grad_norm_`` on the unwrapped model.
    """
    norm_type, inf = float(norm_type), float(norm_type) == math.inf
    flat = {id(p) for _, u in units(model) for h in u._handles for p in h.sharded_params}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dev = model.compute_device

    def local(gs: list[torch.Tensor]) -> torch.Tensor:  # sum of |g|^p over tensors (max |g| for p = inf)
        norms = torch.stack([g.float().norm(norm_type).to(dev) for g in gs] or [torch.zeros((), device=dev)])
        return norms.max() if inf else (norms ** norm_type).sum()
    total = local([p.grad for p in model.parameters() if p.grad is not None and id(p) in flat])
    if model._shard_group is not None:  # add up (or max over) the shards of every rank
        comm.all_reduce(total, op=comm.ReduceOp.MAX if inf else comm.ReduceOp.SUM, group=model._shard_group)
    # parameters of ignored modules are not sharded: their (local) gradients count once, here
    unsharded = local([p.grad for p in model.parameters() if p.grad is not None and id(p) not in flat])
    total = torch.maximum(total, unsharded) if inf else (total + unsharded) ** (1 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False) -> Iterator[None]:
    """Inside the block the original parameters are full ``nn.Parameter``s (gathered, full precision).

    With ``writeback`` (default) changes are copied back into each rank's
    shard on exit. ``rank0_only``: only rank 0 sees full parameters (others
    keep their shards; needs ``writeback=False``). ``with_grads``: the full
    gradients too, as ``.grad``. Collective: every rank must enter it.
    """
    if rank0_only and writeback:
        raise ValueError("summon_full_params(rank0_only=True) cannot write back (the other ranks hold no full "
                         "copy); pass writeback=False")
    expose = not rank0_only or dist.rank() == 0
    chosen = [u for _, u in units(module)]
    chosen = chosen if recurse else chosen[:1]
    busy = [u._name for u in chosen if u._training_state != TrainingState.IDLE]
    if busy:
        raise RuntimeError(f"summon_full_params() inside forward/backward of units {busy}; call it between steps")
    if chosen:
        all_ranks_enter("summon_full_params", chosen[0])  # an error, not a hang, if a rank is missing
    gathered = []
    for u in chosen:
        for h in u._handles:
            h.reshard()  # a kept (root) copy may be stale after optimizer.step()
            full = h.gather_full()
            grad = h.flat_param.grad if with_grads else None
            full_grad = h.gather_full(grad) if grad is not None else None  # collective: on every rank
            if not expose:
                continue
            full = full.cpu() if offload_to_cpu else full
            h.expose_params(full, full_grad.to(full.device) if full_grad is not None else None)
            gathered.append((h, full))
        if expose:
            for name in ("_flat_param", "_flat_param_frozen"):  # hide the shards meanwhile
                u._parameters.pop(name, None)
    try:
        yield
    finally:
        for h, full in gathered:
            if writeback:
                h.write_shard(full)
            h.hide_params()
        for u in chosen if expose else ():
            for h in u._handles:
                if h.orig_params is None:
                    u._parameters["_flat_param" if h.requires_grad else "_flat_param_frozen"] = h.flat_param


class module_or_self:
    """A method that is static on the class (torch: ``FSDP.summon_full_params(model)``) and
    bound on an instance (FairScale: ``model.summon_full_params()``)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, owner: type) -> Callable:
        if obj is None:
            return self.fn

        @functools.wraps(self.fn)
        def bound(*args: Any, **kwargs: Any) -> Any:
            if "module" in kwargs or (args and isinstance(args[0], nn.Module)):  # torch's form on an instance
                return self.fn(*args, **kwargs)
            return self.fn(obj, *args, **kwargs)
        return bound
