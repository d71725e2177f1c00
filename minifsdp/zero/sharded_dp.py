"""ZeRO stage 2: gradients reduced to their owner only, the way FairScale's ``ShardedDataParallel`` does it.

Layer 5 (techniques). Mirrors ``fairscale.nn.data_parallel.ShardedDataParallel``;
the idea is stage 2 of ZeRO (Rajbhandari et al. 2020, section 5.2). It builds
on ``OSS`` (stage 1, ``oss.py``), which decides who owns each parameter.

With ZeRO-1 every rank still receives *every* averaged gradient (an
all-reduce), yet its optimizer reads only the gradients of the parameters it
owns. ZeRO-2 sends each gradient only where it is needed: as soon as backward
has produced a parameter's gradient, a ``reduce`` sums it onto the owner rank,
and every other rank drops its copy. After backward a rank holds the
gradients of its own shard, ≈ 1/N of them:

    backward produces grad(head)  ->  reduce(grad(head), dst=owner(head))
                                      non-owners: head.grad = None
    ...                               (one reduce per parameter, in backward order)
    OSS.step(): each owner steps its shard; broadcast parameters from owners

    >>> # inside minifsdp.launch(fn, N):
    >>> model, opt = wrap_zero(build_model("gpt-tiny"), stage=2, lr=1e-3)
    >>> lm_loss(model(x), y).backward()   # grads reduced to owners during backward
    >>> opt.step(); opt.zero_grad()

Bytes per step (comm's volume convention, P = bytes of the parameters the
OSS holds; ``estimate.comm_bytes_per_step(n_params, N, "zero2")`` computes
it): the reduces move P (each gradient once) and the parameter broadcasts P:
**2P**, the same as DDP's all-reduce, for 1/N of the gradient and optimizer
memory. With ``shard_gradients=False`` the wrapper all-reduces instead:
ZeRO-1, 3P. (The paper's ZeRO-2 is also 2P, as a reduce-scatter plus an
all-gather: the same volume, different collectives.)

Why ``reduce`` and not a flat reduce-scatter? OSS owns *whole* parameters
(greedy by size), so a rank's shard is not one contiguous slice of a flat
buffer; a per-parameter reduce sends each gradient straight to its owner with
no padding (FairScale's way; DeepSpeed's stage 2 instead flattens and splits
parameters at arbitrary boundaries, which ``minifsdp.fsdp`` shows).
Gradients are averaged, not summed: each rank divides by N before the reduce.

Rules, as for DDP: every rank runs the same backward (the reduces are issued
in autograd's order and must match across ranks); to accumulate gradients
over micro-batches, run all but the last backward inside ``no_sync()``, and
call ``zero_grad()`` between steps (a second synchronised backward would
reduce the owner's already-averaged gradient again).

Read first: ``oss.py`` (ZeRO-1, who owns which parameter); then this file.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist, trace
from ..mixed_precision.policy import MixedPrecision
from .oss import OSS

__all__ = ["ShardedDataParallel", "wrap_zero", "reduce"]


reduce = comm.reduce  # kept as zero.reduce for readers of the by-hand lab code


class ShardedDataParallel(nn.Module):
    """Wrap ``module`` so backward reduces each gradient to the rank whose ``OSS`` shard owns it.

    Arguments follow FairScale, positions and defaults too:
    ``ShardedDataParallel(module, sharded_optimizer, process_group=None,
    broadcast_buffers=True, sync_models_at_startup=True, reduce_buffer_size=2**23,
    auto_refresh_trainable=True, reduce_fp16=False, warn_on_trainable_params_changed=True)``.
    ``reduce_buffer_size`` (FairScale packs small gradients into buckets of
    that size), ``auto_refresh_trainable`` and ``warn_on_trainable_params_changed``
    are accepted and have no effect, except one: as in FairScale, a
    ``reduce_buffer_size`` > 0 switches ``reduce_fp16`` off (with a warning).
    ``reduce_fp16=True`` (with ``reduce_buffer_size=0``) sends each averaged
    gradient as fp16 (half the bytes) and the owner casts it back.
    Keyword-only extras: ``mixed_precision`` (a ``minifsdp.mixed_precision.MixedPrecision``:
    its ``reduce_dtype`` is the dtype gradients travel in, bf16 as well as fp16; compute
    in 16 bits with ``torch.autocast``), ``shard_gradients`` (False: all-reduce every gradient and keep it,
    i.e. ZeRO-1 with the same wrapper) and ``max_inflight_bytes``: at most
    this many bytes of gradients owned by other ranks wait for their reduce
    at any time (0: reduce each one synchronously), so during backward a
    rank holds at most its own shard + this + one gradient. At wrap time
    rank 0's parameters (and buffers) are broadcast so every rank starts
    from the same model.
    """

    def __init__(self, module: nn.Module, sharded_optimizer: OSS | list[OSS],
                 process_group: ProcessGroup | None = None, broadcast_buffers: bool = True,
                 sync_models_at_startup: bool = True, reduce_buffer_size: int = 2**23,
                 auto_refresh_trainable: bool = True, reduce_fp16: bool = False,
                 warn_on_trainable_params_changed: bool = True, *, shard_gradients: bool = True,
                 max_inflight_bytes: int = 2**22, mixed_precision: MixedPrecision | None = None):
        super().__init__()
        if reduce_fp16 and reduce_buffer_size > 0:  # FairScale does the same (its buckets stay fp32)
            warnings.warn("ShardedDataParallel: fp16 gradient reduction is not compatible with reduction buffers; "
                          "reduce_fp16 is deactivated (pass reduce_buffer_size=0 to reduce in fp16)", stacklevel=2)
            reduce_fp16 = False
        self.reduce_fp16 = reduce_fp16
        # the dtype gradients are reduced in: FairScale's reduce_fp16, or a policy's reduce_dtype
        self.reduce_dtype = torch.float16 if reduce_fp16 else _reduce_dtype_of(mixed_precision)
        # FairScale's trainability tracking: accepted, no effect here.
        del auto_refresh_trainable, warn_on_trainable_params_changed
        optimizers = sharded_optimizer if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
        if not optimizers or not all(isinstance(o, OSS) for o in optimizers):
            raise TypeError("ShardedDataParallel needs the OSS optimizer(s) that own the parameters: "
                            "opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=...)")
        self.module = module
        self.sharded_optimizers = list(optimizers)
        self.group = process_group if process_group is not None else optimizers[0].group
        self.rank, self.world_size = dist.rank(self.group), dist.world_size(self.group)
        self.shard_gradients, self.max_inflight_bytes = shard_gradients, max_inflight_bytes
        owner: dict[torch.Tensor, int] = {}
        for o in optimizers:
            owner.update(o.param_to_rank)
        self._owner = owner
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        missing = [n for n, p in trainable if p not in owner]
        if missing:
            raise ValueError(f"parameters {missing[:3]} of the module are in no OSS optimizer; build the OSS "
                             "from this module's parameters: OSS(module.parameters(), ...)")
        if any(o.world_size != self.world_size or o.rank != self.rank for o in optimizers):
            raise ValueError("the OSS and ShardedDataParallel use different process groups; pass the same "
                             "group to OSS(group=...) and ShardedDataParallel(process_group=...)")
        if self.world_size > 1:
            self._check_same_model_everywhere([p for _, p in trainable])
        if sync_models_at_startup and self.world_size > 1:
            self._broadcast_from_rank0(broadcast_buffers)
        self._in_flight: list[tuple[torch.Tensor, comm.Handle]] = []
        self._callback_queued = False
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in trainable]

    def _check_same_model_everywhere(self, params: list[torch.Tensor]) -> None:
        """One tiny all-reduce (max of n and -n) turns a mismatch into an error, not a hang."""
        sizes = torch.tensor([len(params), sum(p.numel() for p in params)], dtype=torch.float64,
                             device=dist.device())
        both = torch.cat([sizes, -sizes])
        comm.all_reduce(both, op=comm.ReduceOp.MAX, group=self.group)
        if not torch.equal(both[:2], -both[2:]):
            raise ValueError(f"ranks hold different models (parameter count/elements from {(-both[2:]).tolist()} "
                             f"to {both[:2].tolist()}); build the same model on every rank before wrapping")

    @torch.no_grad()
    def _broadcast_from_rank0(self, buffers: bool) -> None:
        src = dist.global_rank(self.group, 0)
        tensors = list(self.module.parameters()) + (list(self.module.buffers()) if buffers else [])
        for t in tensors:
            comm.broadcast(t.data, src, self.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with trace.span("forward"):
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep full local gradients and send nothing (accumulation)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- the gradient path ---------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Called by autograd once ``p.grad`` holds this backward's full gradient."""
        if not self._sync or self.world_size == 1:
            return
        if not self._callback_queued:  # run _finish once backward is over (DDP does the same)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        p.grad.div_(self.world_size)  # average, not sum
        if self.reduce_dtype is not None:  # scale first, then round: FairScale's order
            p.grad.data = p.grad.data.to(self.reduce_dtype)
        if self.shard_gradients:
            handle = reduce(p.grad, dist.global_rank(self.group, self._owner[p]), group=self.group, async_op=True)
        else:
            handle = comm.all_reduce(p.grad, group=self.group, async_op=True)
        self._in_flight.append((p, handle))
        # Free what has arrived; if too many bytes of other ranks' gradients are still
        # in flight, wait for the oldest. Without this bound, reduces queue up behind
        # each other (always so on CPU/gloo) and the peak during backward is ~P again.
        self._release(wait_until=self.max_inflight_bytes)

    def _inflight_foreign_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p, _ in self._in_flight
                   if self.shard_gradients and self._owner[p] != self.rank)

    def _release(self, wait_until: float) -> None:
        """Retire finished reduces (in issue order); wait while foreign bytes in flight > ``wait_until``."""
        while self._in_flight:
            p, handle = self._in_flight[0]
            if not handle.is_completed() and self._inflight_foreign_bytes() <= wait_until:
                break
            handle.wait()
            self._in_flight.pop(0)
            if self.shard_gradients and self._owner[p] != self.rank:
                p.grad = None  # not ours: the owner has the average now
            elif self.reduce_dtype is not None:
                p.grad.data = p.grad.data.to(p.dtype)

    def _finish(self) -> None:
        self._release(wait_until=-1)  # everything
        self._callback_queued = False


def _reduce_dtype_of(mp: MixedPrecision | None) -> torch.dtype | None:
    if mp is None:
        return None
    if mp.param_dtype is not None or mp.buffer_dtype is not None:
        raise NotImplementedError("ShardedDataParallel's mixed_precision sets only reduce_dtype (the dtype "
                                  "gradients travel in); compute in 16 bits with torch.autocast")
    return mp.reduce_dtype


def wrap_zero(model: nn.Module, stage: int, optim_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
              group: ProcessGroup | None = None, mixed_precision: MixedPrecision | None = None,
              **optim_kwargs: Any) -> tuple[ShardedDataParallel, OSS]:
    """``(model, optimizer)`` for ZeRO ``stage`` 1 or 2; train with the usual loop.

    >>> model, opt = wrap_zero(model, stage=2, lr=1e-3, weight_decay=0.1)
    >>> loss = lm_loss(model(x), y); loss.backward(); opt.step(); opt.zero_grad()

    Stage 1: gradients all-reduced (every rank keeps all of them), optimizer
    state sharded. Stage 2: gradients reduced to their owner, state sharded.
    """
    if stage not in (1, 2):
        raise ValueError(f"wrap_zero supports stage 1 or 2, got {stage!r}; for stage 3 use minifsdp.fsdp")
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen ones need no state, no broadcast
    optimizer = OSS(trainable, optim=optim_cls, group=group, **optim_kwargs)
    wrapped = ShardedDataParallel(model, optimizer, process_group=group, shard_gradients=(stage == 2),
                                  mixed_precision=mixed_precision)
    return wrapped, optimizer
