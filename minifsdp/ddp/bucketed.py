"""Bucketed gradient all-reduce overlapped with backward: what PyTorch's DDP does, and only that.

Layer 5 (techniques). Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020 (torch's ``Reducer``):
gradients are packed into *buckets* of ~``bucket_cap_mb`` in *reverse*
parameter order (the last layers' gradients are ready first in backward); as
soon as a bucket is full its all-reduce starts asynchronously while backward
keeps computing earlier layers; at the end of backward we wait for the handles
and copy the averaged gradients back.

Top to bottom:

1. ``bucket_assignment`` and ``Bucket`` - which gradients travel together, and
   the flat buffer they travel in;
2. ``BucketedDataParallel`` - the hooks that fill the buckets, launch each
   all-reduce as its bucket fills and wait at the end: the lesson.

Read first: ``naive.py`` (the same contract with one blocking all-reduce per
tensor). Next: ``distributed.py`` (torch's signature and options on this core).

Timeline spans (``minifsdp.trace``): ``ddp.backward`` from the first gradient
hook to the end of backward, ``ddp.wait`` for waiting and copying back; the
bucket all-reduces appear in the comm lane and start inside ``ddp.backward``
- that is the overlap.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist, trace
from .common import _check_same_model_everywhere, _weak_hook, broadcast_coalesced, require_trainable

__all__ = ["BucketedDataParallel", "Bucket", "bucket_assignment", "DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_MB"]


# --------------------------------------------------------------------------
# 1. Buckets: which gradients travel together
# --------------------------------------------------------------------------
DEFAULT_BUCKET_CAP_MB = 25.0   # torch's default
FIRST_BUCKET_MB = 1.0          # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, used with the default cap


def bucket_assignment(params: list[torch.Tensor], bucket_cap_mb: float,
                      first_bucket_mb: float | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of about ``bucket_cap_mb`` MiB, in REVERSE order.

    Reverse, because backward produces the last layer's gradients first: the
    first bucket fills (and its all-reduce starts) while earlier layers are
    still computing. The rule is torch's (``_compute_bucket_assignment_by_size``):
    add tensors until the bucket *reaches* the cap, then close it - so a
    bucket exceeds the cap by less than its last tensor. (Closing *before*
    the cap instead pushes the overflow into the last bucket, whose
    all-reduce cannot overlap anything.) ``first_bucket_mb`` caps the first bucket lower,
    so the network gets busy sooner (torch: 1 MiB when the cap is left at
    its default). Tensors of different dtype or device never share a bucket
    (a bucket is one flat tensor).

    Three fp32 tensors of 100, 200 and 300 elements (400, 800, 1200 bytes), cap 1000 bytes:
    reversed they are [2, 1, 0]; 1200 alone reaches the cap; 800 does not, 800 + 400 does:

    >>> ts = [torch.zeros(100), torch.zeros(200), torch.zeros(300)]
    >>> bucket_assignment(ts, bucket_cap_mb=1000 / 2**20)
    [[2], [1, 0]]
    >>> bucket_assignment(ts, bucket_cap_mb=2000 / 2**20)   # 1200 + 800 reaches 2000
    [[2, 1], [0]]
    """
    if bucket_cap_mb <= 0 or (first_bucket_mb is not None and first_bucket_mb <= 0):
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb} (first bucket: {first_bucket_mb}); "
                         "torch's default is 25")
    cap = int(bucket_cap_mb * 1024 * 1024)
    first_cap = min(cap, int(first_bucket_mb * 1024 * 1024)) if first_bucket_mb else cap
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}  # (dtype, device) -> (indices, bytes)
    closed_keys: set[tuple] = set()                  # keys whose first bucket is done
    for i in reversed(range(len(params))):
        key = (params[i].dtype, params[i].device)
        idx, size = open_.get(key, ([], 0))
        idx, size = idx + [i], size + params[i].numel() * params[i].element_size()
        if size >= (cap if key in closed_keys else first_cap):  # full: close it
            buckets.append(idx)
            closed_keys.add(key)
            idx, size = [], 0
        open_[key] = (idx, size)
    buckets.extend(idx for idx, _ in open_.values() if idx)
    return buckets


@dataclass
class Bucket:
    """One flat gradient buffer; ``views[k]`` is parameter ``params[k]``'s slice of it, shaped like it."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0                   # gradients still to come in this backward
    handle: comm.Handle | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


# --------------------------------------------------------------------------
# 2. The lesson: fill buckets, launch each all-reduce as its bucket fills, wait at the end
# --------------------------------------------------------------------------
class BucketedDataParallel(nn.Module):
    """Bucketed gradient all-reduce overlapped with backward: DDP's mechanism, nothing else.

    ``BucketedDataParallel(module, process_group=None, bucket_cap_mb=None)``:
    rank 0's parameters and buffers are broadcast at wrap time and its buffers
    again before every forward; ``bucket_cap_mb=None`` means torch's layout
    (25 MiB buckets, the first 1 MiB), see ``bucket_assignment``.

    How one backward goes (the timeline shows it):

    1. a post-accumulate-grad hook fires as each ``p.grad`` is final; the
       first one queues ``_finalize_backward`` to run when backward ends;
    2. each gradient is copied into its slot of the flat buffer, divided by N,
       as it arrives; when a bucket's last one arrives ``all_reduce(async_op=True)`` starts
       while backward goes on computing earlier layers. Buckets start strictly
       in index order, so every rank issues the collectives in the same order
       even if hooks fire in another;
    3. at the end of backward: wait for every handle, copy the averages back.

    Every parameter must get a gradient in every synchronised backward: a
    bucket missing one never fills, and the error names the parameter.
    ``DistributedDataParallel`` (``distributed.py``) adds torch's options on top.

    **no_sync() pitfall.** Like torch, whether a backward syncs is decided in
    ``forward`` (the flag is read there). So *both* forward and backward must
    be inside ``no_sync()``:

    * forward outside, backward inside -> that backward still all-reduces:
      the result is right (averaging is linear), but you pay 2·4Ψ bytes of
      communication for every micro-batch instead of once per step;
    * forward inside, backward outside -> that backward is NOT all-reduced.
      Harmless for the micro-batches before the last; but if the *last*
      forward ran inside ``no_sync()``, nothing is ever all-reduced and the
      ranks silently drift apart.

    ``state_dict()`` keys carry the ``module.`` prefix, as with torch DDP
    (``model.module.state_dict()`` gives the plain keys).

    ``_reduce_dtype`` (set by ``DistributedDataParallel(mixed_precision=...)``):
    the buckets hold that dtype, so the all-reduce moves half the bytes in
    bf16/fp16 (what torch's ``bf16_compress_hook`` does); the averages are cast
    back into the fp32 ``p.grad``.
    """

    _reduce_dtype: torch.dtype | None = None  # None: the parameters' dtype

    def __init__(self, module: nn.Module, process_group: ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None):
        super().__init__()
        dist.require_initialized(type(self).__name__)
        dist.require_module(module, type(self).__name__)
        dist.require_group(process_group, f"{type(self).__name__}'s process_group")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:  # before the wrap-time broadcast, not after it
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}; torch's default is 25 (or leave "
                             "it None)")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        require_trainable(named, type(self).__name__)
        self.module = module
        self.process_group = process_group
        self.forward_sync_buffers = True          # torch's name: broadcast buffers before each forward
        self.require_backward_grad_sync = True    # torch's name; no_sync() clears it
        self._world = dist.world_size(process_group)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        self._buffers_flat: dict[torch.device, torch.Tensor] = {}  # forward's buffer sync packs into it
        self._sync_module_states()
        self._build_buckets(bucket_cap_mb)
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(_weak_hook(self, "_grad_ready", i))
        self._armed = False            # set by forward: should the coming backward sync?
        self._reset_backward_state()

    def _sync_module_states(self) -> None:
        """Same model everywhere, then rank 0's values everywhere (parameters AND buffers)."""
        _check_same_model_everywhere(self._params, self.process_group, type(self).__name__)
        broadcast_coalesced(list(self.module.parameters()) + self._module_buffers, dist.global_rank(self.process_group, 0),
                            self.process_group)

    def _build_buckets(self, bucket_cap_mb: float | None) -> None:
        """Lay out the buckets (reverse order) and remember where each parameter's gradient goes."""
        first_mb = FIRST_BUCKET_MB if bucket_cap_mb is None else None
        layout = bucket_assignment(self._params, bucket_cap_mb or DEFAULT_BUCKET_CAP_MB, first_mb)
        self.buckets: list[Bucket] = []
        self._bucket_of = [0] * len(self._params)             # parameter i -> its bucket
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._views: list[torch.Tensor] = [None] * len(self._params)  # parameter i -> its slice of the bucket
        for b, indices in enumerate(layout):
            ps = [self._params[i] for i in indices]
            buffer = torch.zeros(sum(p.numel() for p in ps), dtype=self._reduce_dtype or ps[0].dtype,
                                 device=ps[0].device)
            views = [v.view_as(p) for v, p in zip(buffer.split([p.numel() for p in ps]), ps)]
            self.buckets.append(Bucket(b, [self._names[i] for i in indices], ps, buffer, views))
            for i, v in zip(indices, views):
                self._bucket_of[i], self._views[i] = b, v

    def _reset_backward_state(self) -> None:
        self._in_backward = False          # has the first hook of this backward run?
        self._backward_start = 0.0
        self._ready = [False] * len(self._params)
        self._next_bucket = 0              # buckets launch strictly in this order
        for bk in self.buckets:
            bk.pending, bk.handle = len(bk.params), None

    # -- forward ---------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.forward_sync_buffers and self._module_buffers and self._world > 1:
            broadcast_coalesced(self._module_buffers, dist.global_rank(self.process_group, 0), self.process_group,
                                reuse=self._buffers_flat)  # every step: one packed buffer, made once
        # torch DDP decides here, at forward time, whether the coming backward syncs (no_sync pitfall).
        self._armed = torch.is_grad_enabled() and self.require_backward_grad_sync
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: a forward inside arms no all-reduce for its backward, so gradients add up
        locally; the first backward whose forward ran outside all-reduces the accumulated sum (as torch's
        ``DistributedDataParallel.no_sync``: DDP decides in forward)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- backward: one hook per parameter -----------------------------------------
    @torch.no_grad()
    def _grad_ready(self, param: torch.Tensor, i: int) -> None:
        if not self._armed:
            return  # forward ran inside no_sync(): accumulate locally, no communication
        if not self._in_backward:  # first gradient of this backward
            self._in_backward, self._backward_start = True, time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        if self._ready[i]:
            self._abort()
            raise RuntimeError(f"{type(self).__name__}: parameter {self._names[i]!r} got its gradient twice in "
                               "one backward (reentrant checkpointing or a second backward through the same "
                               "graph?); use non-reentrant checkpointing (use_reentrant=False)")
        self._ready[i] = True
        self._pack_one(i)  # into its slot now: the copy overlaps the gradients still being computed
        bucket = self.buckets[self._bucket_of[i]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Start every complete bucket from ``_next_bucket`` on, stopping at the first incomplete one."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bk = self.buckets[self._next_bucket]
            self._pack(bk)
            bk.handle = comm.all_reduce(bk.buffer, group=self.process_group, async_op=True)
            self._next_bucket += 1

    def _pack_one(self, i: int) -> None:
        """Parameter i's gradient into its bucket slot, divided by N: the sum of the grad / N is the average
        (torch's Reducer also copies each gradient as it arrives, dividing first). One pass over memory."""
        p, view = self._params[i], self._views[i]
        torch.mul(p.grad, 1.0 / self._world, out=view) if p.grad is not None else view.zero_()

    def _pack(self, bk: Bucket) -> None:
        """Before the bucket's all-reduce: the slots of parameters whose gradient never came (a subclass's
        find_unused_parameters sends their bucket anyway); the others were packed as they arrived."""
        for p in bk.params:
            i = self._index[id(p)]
            if not self._ready[i]:
                self._pack_one(i)

    # -- backward: the end -----------------------------------------------------------
    @torch.no_grad()
    def _finalize_backward(self) -> None:
        """Runs once when autograd has finished the backward pass (queued by the first hook)."""
        tracer = trace.active_tracer()
        if tracer is not None:
            tracer.add_span("ddp.backward", trace.COMPUTE, self._backward_start, time.perf_counter())
        try:
            with trace.span("ddp.wait", buckets=len(self.buckets)):
                self._complete_buckets()
                for bk in self.buckets:
                    bk.handle.wait()
                self._copy_back()
        finally:
            self._reset_backward_state()

    def _complete_buckets(self) -> None:
        """Every parameter must have had its gradient: otherwise its bucket was never sent."""
        missing = [self._names[i] for i, r in enumerate(self._ready) if not r]
        if missing:
            self._abort()
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RuntimeError(f"{type(self).__name__}: parameter(s) {shown} received no gradient in this "
                               "backward, so their buckets could never be all-reduced; pass "
                               "find_unused_parameters=True to DistributedDataParallel (or make every "
                               "parameter take part in the loss, or set requires_grad=False on it)")

    def _copy_back(self) -> None:
        """Averaged bucket contents -> ``p.grad`` (one fused copy for the gradients that exist)."""
        dst, src = [], []
        for p, view in zip(self._params, self._views):
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)

    def _abort(self) -> None:
        """Before raising: let the collectives already started finish, then forget this backward,
        so that the wrapper still works after the error is fixed (a notebook keeps it)."""
        for bk in self.buckets:
            if bk.handle is not None:
                bk.handle.wait()
        self._reset_backward_state()
