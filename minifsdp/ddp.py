"""Data parallel training from scratch: a naive version, then bucketed and overlapped DDP.

Layer 5 (techniques). Data parallelism keeps a full copy of the model on every
rank, gives each rank a different slice of the global batch, and averages the
gradients before the optimizer step, so every replica takes the same step:

    grad = (1/N) * sum over ranks of grad_r        (an all-reduce, then / N)

With equal slices, the mean of the per-rank mean losses is the mean loss of
the whole batch, so N ranks with B samples each compute exactly what one process computes on
N*B samples (up to float rounding). Cost: one all-reduce of every gradient
per step, 2Ψ bytes in the ZeRO paper's units (Ψ = gradient bytes).

Naive beside optimized, same contract (drop-in for ``torch.nn.parallel.DistributedDataParallel``):

1. ``NaiveDataParallel`` - picotron's ``DataParallelNaive`` idea: a hook on each
   parameter all-reduces its gradient the moment it is ready, one blocking
   collective per tensor. Easy to read; slow (many tiny messages, and backward
   stops while each one is on the wire).
2. ``bucket_assignment`` - which gradients travel together.
3. ``BucketedDataParallel`` - what PyTorch's DDP does, and only that (Li et
   al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
   Training", VLDB 2020): gradients are packed into *buckets* of
   ~``bucket_cap_mb`` in *reverse* parameter order (the last layers'
   gradients are ready first in backward); as soon as a bucket is full its
   all-reduce starts asynchronously while backward keeps computing earlier
   layers; at the end of backward we wait for the handles and copy the
   averaged gradients back.
4. ``DistributedDataParallel`` - the same with torch's signature and options
   (``find_unused_parameters``, ``gradient_as_bucket_view``, buffer and
   device arguments), after the divider at the end of the file.

Read first: ``comm.py`` (the collectives and their byte counts) and
``trace.py`` (the spans below); then this file top to bottom. Next:
``zero/`` (sharding the optimizer state of this data parallel training).

Usage, inside ``minifsdp.launch`` or under torchrun (a process group exists):

    >>> model = DistributedDataParallel(build_model("gpt-tiny"))   # rank 0's weights everywhere
    >>> loss = lm_loss(model(x_local), y_local)
    >>> loss.backward()                 # grads all-reduced, averaged, overlapped with backward
    >>> optimizer.step()                # identical step on every rank
    >>> with model.no_sync():           # gradient accumulation: no communication...
    ...     lm_loss(model(x0), y0).backward()
    >>> lm_loss(model(x1), y1).backward()   # ...until the last micro-batch

Timeline spans (``minifsdp.trace``): ``ddp.backward`` from the first gradient
hook to the end of backward, ``ddp.wait`` for waiting and copying back; the
bucket all-reduces appear in the comm lane and start inside ``ddp.backward``
- that is the overlap.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed import ProcessGroup

from . import comm, dist, trace
from .mixed_precision.policy import MixedPrecision

__all__ = ["NaiveDataParallel", "BucketedDataParallel", "DistributedDataParallel", "Bucket", "bucket_assignment",
           "broadcast_coalesced"]


# --------------------------------------------------------------------------
# Helpers shared by both wrappers
# --------------------------------------------------------------------------
def _group_src(group: ProcessGroup | None) -> int:
    """Global rank of the group's rank 0 (``broadcast`` takes a global rank, as in torch)."""
    return 0 if group is None else tdist.get_global_rank(group, 0)


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, group: ProcessGroup | None = None) -> None:
    """Make every rank's ``tensors`` equal to rank ``src``'s with ONE broadcast per device.

    Tensors of any dtype are viewed as raw bytes and packed into one uint8
    buffer (torch's ``_sync_module_states`` coalesces the same way): one large
    message instead of many small ones.

    >>> broadcast_coalesced([model.weight, model.bias])   # rank 1 now holds rank 0's values
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for group_tensors in by_device.values():
        as_bytes = [t.detach().reshape(-1).view(torch.uint8) for t in group_tensors]
        flat = torch.cat(as_bytes)
        comm.broadcast(flat, src=src, group=group)
        for t, chunk in zip(group_tensors, flat.split([b.numel() for b in as_bytes])):
            t.copy_(chunk.view(t.dtype).view_as(t))


def _weak_hook(owner: Any, method: str, *args: Any):
    """A gradient hook that calls ``owner.method(*args)`` while ``owner`` is alive.

    The hook lives on the parameter, which outlives a wrapper that a notebook
    replaces (``model = DistributedDataParallel(m)`` run twice): a strong
    reference would keep the old wrapper alive and all-reducing too.
    """
    ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            getattr(live, method)(param, *args)
    return hook


def _check_same_model_everywhere(params: list[torch.Tensor], group: ProcessGroup | None, who: str) -> None:
    """Fail loudly (on every rank) if ranks wrapped different models: else a later all-reduce hangs.

    One tiny all-reduce(MAX) of a shape signature and its negation gives max and min at once.
    """
    shapes_sig = sum((i + 1) * (p.numel() % 1_000_003) for i, p in enumerate(params))
    sig = torch.tensor([len(params), sum(p.numel() for p in params), shapes_sig], dtype=torch.float64)
    both = torch.cat([sig, -sig]).to(dist.device())
    comm.all_reduce(both, op=comm.ReduceOp.MAX, group=group)
    both = both.cpu()
    if not (torch.equal(both[:3], sig) and torch.equal(-both[3:], sig)):
        raise ValueError(f"{who}: ranks wrapped different models (parameter count/shapes differ); build the "
                         "same model on every rank before wrapping it")


# --------------------------------------------------------------------------
# 1. The naive version: one blocking all-reduce per gradient, from a hook
# --------------------------------------------------------------------------
class NaiveDataParallel(nn.Module):
    """Average each gradient across ranks the moment autograd has accumulated it.

    Choice made here (picotron's DataParallelNaive does the same): the sync
    happens by itself in a per-parameter ``register_post_accumulate_grad_hook``,
    so training code is the same as for torch DDP - no ``sync_gradients()``
    call to forget. Each hook does a *blocking* ``all_reduce`` of one tensor:
    backward waits for the network once per parameter. Compare with
    ``DistributedDataParallel`` below in the timeline.

    ``no_sync()`` is read when each hook runs (at *backward* time), unlike
    torch DDP which decides at forward time (see ``DistributedDataParallel``).

    >>> model = NaiveDataParallel(nn.Linear(4, 2))   # inside launch(fn, 2)
    >>> model(torch.randn(3, 4)).sum().backward()    # 2 all-reduces: weight, bias
    """

    def __init__(self, module: nn.Module, process_group: ProcessGroup | None = None):
        super().__init__()
        dist.require_initialized("NaiveDataParallel")
        self.module = module
        self.process_group = process_group
        self.require_backward_grad_sync = True
        self._world = dist.world_size(process_group)
        # Same starting point everywhere: rank 0's parameters and buffers, one tensor at a time.
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(t.data, src=_group_src(process_group), group=process_group)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_weak_hook(self, "_all_reduce_grad"))

    def _all_reduce_grad(self, param: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): keep accumulating locally
        with torch.no_grad():
            param.grad.div_(self._world)  # divide first (as torch does): sum of averages = average
            comm.all_reduce(param.grad, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the all-reduce for backward passes run inside; gradients accumulate locally."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)


# --------------------------------------------------------------------------
# 2. Buckets: which gradients travel together
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
# 3. The lesson: fill buckets, launch each all-reduce as its bucket fills, wait at the end
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
    2. when a bucket's last gradient arrives, its gradients are packed into
       the flat buffer, divided by N, and ``all_reduce(async_op=True)`` starts
       while backward goes on computing earlier layers. Buckets start strictly
       in index order, so every rank issues the collectives in the same order
       even if hooks fire in another;
    3. at the end of backward: wait for every handle, copy the averages back.

    Every parameter must get a gradient in every synchronised backward: a
    bucket missing one never fills, and the error names the parameter.
    ``DistributedDataParallel`` below adds torch's options on top.

    **no_sync() pitfall.** Like torch, whether a backward syncs is decided in
    ``forward`` (the flag is read there). So *both* forward and backward must
    be inside ``no_sync()``:

    * forward outside, backward inside -> that backward still all-reduces:
      the result is right (averaging is linear), but you pay 2Ψ of
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
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(self).__name__}: the module has no parameter that requires a gradient; "
                             "there is nothing to synchronise (do not wrap it)")
        self.module = module
        self.process_group = process_group
        self.forward_sync_buffers = True          # torch's name: broadcast buffers before each forward
        self.require_backward_grad_sync = True    # torch's name; no_sync() clears it
        self._world = dist.world_size(process_group)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        self._sync_module_states()
        self._build_buckets(bucket_cap_mb)
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(_weak_hook(self, "_grad_ready", i))
        self._armed = False            # set by forward: should the coming backward sync?
        self._reset_backward_state()

    def _sync_module_states(self) -> None:
        """Same model everywhere, then rank 0's values everywhere (parameters AND buffers)."""
        _check_same_model_everywhere(self._params, self.process_group, type(self).__name__)
        broadcast_coalesced(list(self.module.parameters()) + self._module_buffers, _group_src(self.process_group),
                            self.process_group)

    def _build_buckets(self, bucket_cap_mb: float | None) -> None:
        """Lay out the buckets (reverse order) and remember where each parameter's gradient goes."""
        first_mb = FIRST_BUCKET_MB if bucket_cap_mb is None else None
        layout = bucket_assignment(self._params, bucket_cap_mb or DEFAULT_BUCKET_CAP_MB, first_mb)
        self.buckets: list[Bucket] = []
        self._bucket_of = [0] * len(self._params)             # parameter i -> its bucket
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
            broadcast_coalesced(self._module_buffers, _group_src(self.process_group), self.process_group)
        # torch DDP decides here, at forward time, whether the coming backward syncs (no_sync pitfall).
        self._armed = torch.is_grad_enabled() and self.require_backward_grad_sync
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: forward AND backward inside skip the all-reduce; grads add up locally.

        >>> with model.no_sync():
        ...     for x, y in micro_batches[:-1]:
        ...         (lm_loss(model(x), y) / k).backward()
        >>> (lm_loss(model(x_last), y_last) / k).backward()   # one all-reduce of the sum
        """
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

    def _pack(self, bk: Bucket) -> None:
        """Gradients into the flat buffer, each divided by N: the sum of the grad / N is the average
        (torch's reducer divides first too). Copy and scale in one pass over memory."""
        for p, view in zip(bk.params, bk.views):
            torch.mul(p.grad, 1.0 / self._world, out=view) if p.grad is not None else view.zero_()

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


# ==========================================================================
# 4. torch compatibility: torch's signature and the options built on the core
# ==========================================================================
class DistributedDataParallel(BucketedDataParallel):
    """``BucketedDataParallel`` with the arguments of the installed ``torch.nn.parallel.DistributedDataParallel``.

    Same parameters, order and defaults (a positional argument lands in
    torch's slot, ``process_group`` included; tests/test_ddp.py compares the
    signatures). What each does here:

    * ``device_ids`` - ``None`` for CPU modules; ``[i]`` (or ``None``) for a module on ``cuda:i``.
      ``output_device``, ``dim`` - outputs are not moved (``dim`` must be 0).
    * ``broadcast_buffers`` (deprecated in torch 2.13, as here) / ``forward_sync_buffers`` -
      broadcast rank 0's buffers before every forward (e.g. BatchNorm stats). As in torch,
      ``broadcast_buffers=False`` also leaves the buffers out of the broadcast at wrap time;
      ``forward_sync_buffers=False`` does not.
    * ``init_sync=False`` - no shape check and no broadcast at wrap time (ranks must already agree).
    * ``bucket_cap_mb`` - see ``bucket_assignment``; ``None``: 25 MiB with a 1 MiB first bucket.
    * ``find_unused_parameters`` - parameters without a gradient are marked ready at the end of
      backward (their slot holds ``p.grad`` or zeros), and one small all-reduce of "used" flags
      tells which were unused on *every* rank: their ``.grad`` is left untouched (``None`` stays
      ``None``), as torch does. That flag all-reduce (4 bytes x 2 per parameter tensor) is the
      only traffic beyond 2Ψ. If only *some* ranks miss a gradient without this option, those
      ranks raise and the others wait in vain: under ``launch`` the error still surfaces.
    * ``gradient_as_bucket_view`` - ``p.grad`` *is* the bucket slice: no copy in or out, one
      gradient-sized buffer saved.
    * ``device_mesh`` - a 1-D mesh; its group is the process group.
    * ``static_graph``, ``batched_grad_copy`` - accepted; they change nothing here (there is no
      graph search to skip, and gradients are already copied in one pass per bucket).
      ``check_reduction`` - deprecated in torch; warns like torch.
    * ``mixed_precision`` - a ``minifsdp.mixed_precision.MixedPrecision`` whose ``reduce_dtype``
      (bf16/fp16) is the all-reduce's dtype: half the bytes, fp32 gradients for the optimizer.
      Compute in 16 bits with ``torch.autocast`` (``param_dtype``/``buffer_dtype`` raise: DDP
      keeps one fp32 copy of the model per rank, and casting it is autocast's job).
    * ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``,
      ``skip_all_reduce_unused_params``, ``bucket_cap_mb_list`` - raise ``NotImplementedError``
      saying why.
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list: list[int] | None = None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None):
        _reject_unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce,
                            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                            bucket_cap_mb_list=bucket_cap_mb_list)
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                          "Please avoid using it.", FutureWarning, stacklevel=2)
        process_group = _group_of(process_group, device_mesh)
        _check_devices(module, device_ids, output_device, dim)
        forward_sync, self._init_sync_buffers = _buffer_sync_flags(broadcast_buffers, forward_sync_buffers)
        self._init_sync = init_sync
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._reduce_dtype = _reduce_dtype_of(mixed_precision, gradient_as_bucket_view)
        super().__init__(module, process_group, bucket_cap_mb)
        self.forward_sync_buffers = forward_sync
        self.device_ids, self.output_device, self.dim = device_ids, output_device, dim
        self.static_graph = static_graph
        self._locally_used = [False] * len(self._params)   # since the last sync (find_unused only)
        self._globally_unused: set[int] = set()

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name for ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    def _sync_module_states(self) -> None:
        if not self._init_sync:
            return  # the user vouches that every rank already holds the same model
        _check_same_model_everywhere(self._params, self.process_group, type(self).__name__)
        buffers = self._module_buffers if self._init_sync_buffers else []
        broadcast_coalesced(list(self.module.parameters()) + buffers, _group_src(self.process_group),
                            self.process_group)

    # -- find_unused_parameters and gradient_as_bucket_view, on the core's hooks ------
    def _grad_ready(self, param: torch.Tensor, i: int) -> None:
        if self.find_unused_parameters:
            self._locally_used[i] = True
        if self.gradient_as_bucket_view and self._armed and not self._ready[i]:
            self._grad_into_view(param, self._views[i])
        super()._grad_ready(param, i)

    @staticmethod
    @torch.no_grad()
    def _grad_into_view(p: torch.Tensor, view: torch.Tensor) -> None:
        """gradient_as_bucket_view: make ``p.grad`` the bucket slice (after zero_grad(set_to_none) it is new)."""
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _pack(self, bk: Bucket) -> None:
        if not self.gradient_as_bucket_view:
            return super()._pack(bk)
        if self._world > 1:
            bk.buffer.mul_(1.0 / self._world)  # the gradients are already in the bucket

    def _complete_buckets(self) -> None:
        """With find_unused_parameters: send the incomplete buckets, then learn which were unused everywhere."""
        self._globally_unused = set()
        if not self.find_unused_parameters:
            return super()._complete_buckets()
        missing = [i for i, r in enumerate(self._ready) if not r]
        for i in missing:  # ready now: their slot holds p.grad (from no_sync steps) or zeros
            p, view = self._params[i], self._views[i]
            if self.gradient_as_bucket_view:
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)  # do not re-point p.grad yet: it may be unused everywhere
                elif p.grad is None:
                    view.zero_()
            self.buckets[self._bucket_of[i]].pending -= 1
        self._launch_ready_buckets()
        used = torch.tensor(self._locally_used, dtype=torch.int32, device=self._params[0].device)
        comm.all_reduce(used, group=self.process_group)  # how many ranks used each parameter
        self._globally_unused = {i for i, count in enumerate(used.tolist()) if count == 0}
        self._locally_used = [False] * len(self._params)

    def _copy_back(self) -> None:
        if not (self.find_unused_parameters or self.gradient_as_bucket_view):
            return super()._copy_back()
        dst, src = [], []
        for i, (p, view) in enumerate(zip(self._params, self._views)):
            if i in self._globally_unused:
                continue  # torch leaves the .grad of a parameter no rank used untouched
            if self.gradient_as_bucket_view or p.grad is None:
                p.grad = view if self.gradient_as_bucket_view else view.clone()
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)


_UNSUPPORTED = {
    "delay_all_reduce_named_params": "delaying chosen parameters' all-reduce to another parameter's hook",
    "param_to_hook_all_reduce": "delaying chosen parameters' all-reduce to another parameter's hook",
    "skip_all_reduce_unused_params": "skipping unused parameters' all-reduce (find_unused_parameters=True "
                                     "reduces them)",
    "bucket_cap_mb_list": "a size per bucket (bucket_cap_mb sets one size for all)",
}


def _reduce_dtype_of(mp: Any, gradient_as_bucket_view: bool) -> torch.dtype | None:
    """DDP's share of a precision policy: the dtype of the gradient all-reduce (one-line errors otherwise)."""
    if mp is None:
        return None
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mixed_precision must be a minifsdp.mixed_precision.MixedPrecision, got {type(mp).__name__}")
    if mp.param_dtype is not None or mp.buffer_dtype is not None:
        raise NotImplementedError("DistributedDataParallel's mixed_precision sets only reduce_dtype (the all-reduce's "
                                  "dtype); compute in 16 bits with torch.autocast (minifsdp.mixed_precision.autocast)")
    if gradient_as_bucket_view and mp.reduce_dtype is not None:
        raise ValueError("gradient_as_bucket_view=True makes p.grad the bucket, which would then be "
                         f"{mp.reduce_dtype}; drop one of the two")
    return mp.reduce_dtype


def _reject_unsupported(**given: Any) -> None:
    for name, value in given.items():
        if value not in (None, False):
            raise NotImplementedError(f"DistributedDataParallel({name}=...) is not implemented in minifsdp: "
                                      f"{_UNSUPPORTED[name]}; leave it at its default")


def _group_of(process_group: ProcessGroup | None, device_mesh: Any) -> ProcessGroup | None:
    """torch's rule: a 1-D ``device_mesh`` gives the group; not both."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("DistributedDataParallel: pass process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"DistributedDataParallel: only a 1-D device mesh is supported, got {device_mesh}; "
                           "pass device_mesh[dim_name] for the data-parallel dimension")
    return device_mesh.get_group(mesh_dim=0)


def _buffer_sync_flags(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.13's rule: ``(sync buffers before each forward, include buffers in the wrap-time broadcast)``."""
    if broadcast_buffers is not None:
        warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                      "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init."
                      if forward_sync_buffers is None else
                      "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` "
                      "is deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                      FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def _check_devices(module: nn.Module, device_ids: list | None, output_device: Any, dim: int) -> None:
    devices = {p.device for p in module.parameters() if p.requires_grad}
    if len(devices) > 1:
        raise ValueError(f"DistributedDataParallel: parameters live on several devices {sorted(map(str, devices))}; "
                         "move the whole module to one device (dist.device()) first")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu" and (device_ids or output_device is not None):
        raise ValueError(f"DistributedDataParallel: device_ids must be None for a module on the CPU (got "
                         f"device_ids={device_ids}, output_device={output_device}); pass device_ids=None")
    if device_ids:
        wanted = [torch.device(device.type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
        if wanted != [device]:
            raise ValueError(f"DistributedDataParallel: device_ids={device_ids} does not match the module's "
                             f"device {device}; pass device_ids=[{device.index}] or None")
    if dim != 0:
        raise ValueError(f"DistributedDataParallel: dim={dim} is not supported (no scatter of inputs here); "
                         "split the batch yourself and pass dim=0")
