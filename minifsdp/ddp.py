"""Data parallel training from scratch: a naive version, then bucketed and overlapped DDP.

Layer 5 (techniques). Data parallelism keeps a full copy of the model on every
rank, gives each rank a different slice of the global batch, and averages the
gradients before the optimizer step, so every replica takes the same step:

    grad = (1/N) * sum over ranks of grad_r        (an all-reduce, then / N)

With equal slices, the mean of the per-rank mean losses is the mean loss of
the whole batch, so N ranks with B samples each compute exactly what one process computes on
N*B samples (up to float rounding). Cost: one all-reduce of every gradient
per step, 2Ψ bytes in the ZeRO paper's units (Ψ = gradient bytes).

Two wrappers, same contract (drop-in for ``torch.nn.parallel.DistributedDataParallel``):

* ``NaiveDataParallel`` - picotron's ``DataParallelNaive`` idea: a hook on each
  parameter all-reduces its gradient the moment it is ready, one blocking
  collective per tensor. Easy to read; slow (many tiny messages, and backward
  stops while each one is on the wire).
* ``DistributedDataParallel`` - what PyTorch's DDP does (Li et al., "PyTorch
  Distributed: Experiences on Accelerating Data Parallel Training", VLDB
  2020): gradients are packed into *buckets* of ~``bucket_cap_mb`` in
  *reverse* parameter order (the last layers' gradients are ready first in
  backward); as soon as a bucket is full its all-reduce starts
  asynchronously while backward keeps computing earlier layers; at the end
  of backward we wait for the handles and copy the averaged gradients back.

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
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as tdist
import torch.nn as nn
from torch.distributed import ProcessGroup

from . import comm, dist, trace

__all__ = ["NaiveDataParallel", "DistributedDataParallel", "Bucket", "bucket_assignment",
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
    all-reduce cannot overlap anything: measured 12 % slower than torch at 4
    ranks for gpt-small.) ``first_bucket_mb`` caps the first bucket lower,
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
# 3. DistributedDataParallel: bucketed, asynchronous, overlapped with backward
# --------------------------------------------------------------------------
class DistributedDataParallel(nn.Module):
    """Bucketed gradient all-reduce overlapped with backward; mirrors ``torch.nn.parallel.DistributedDataParallel``.

    Arguments as in torch (positional order too, up to ``find_unused_parameters``):

    * ``device_ids`` - ``None`` for CPU modules; ``[i]`` (or ``None``) for a module on ``cuda:i``.
    * ``output_device``, ``dim`` - accepted for compatibility; outputs are not moved (``dim`` must be 0).
    * ``broadcast_buffers`` - broadcast rank 0's buffers before every forward (e.g. BatchNorm stats).
    * ``bucket_cap_mb`` - bucket size in MiB (see ``bucket_assignment``). ``None`` (the default)
      means 25 MiB with a 1 MiB first bucket, as torch; an explicit value is used for every
      bucket, as torch. (torch 2.13 starts with ONE bucket and, after the first step, rebuilds
      them in the order gradients arrived; we start with reverse parameter order, which is that
      order for a model whose layers run in definition order: for gpt-small both give buckets
      of 2757120, 28391424 and 12424704 bytes.)
    * ``find_unused_parameters`` - see below. ``gradient_as_bucket_view`` - ``p.grad`` *is* the
      bucket slice: no copy in or out, one gradient-sized buffer saved.

    How one backward goes (the timeline shows it):

    1. a post-accumulate-grad hook fires as each ``p.grad`` is final; the
       first one queues ``_finalize_backward`` to run when backward ends;
    2. when a bucket's last gradient arrives, its gradients are packed into
       the flat buffer, divided by N and ``all_reduce(async_op=True)`` starts.
       Buckets start strictly in index order, so every rank issues the
       collectives in the same order even if hooks fire in another;
    3. at the end of backward: wait for every handle, copy the averages back.

    **Unused parameters.** A parameter that gets no gradient leaves its
    bucket incomplete, and that bucket (and all after it) would never be
    sent. With ``find_unused_parameters=False`` we raise at the end of
    backward, naming the parameters. With ``True`` they are marked ready
    at the end of backward (their slot holds ``p.grad`` or zeros), and one
    extra small all-reduce of "used" flags tells which were unused on *every*
    rank: their ``.grad`` is left untouched (``None`` stays ``None``), as torch does.
    (That flag all-reduce is the only traffic beyond 2Ψ: 4 bytes x 2 per parameter tensor.)
    If only *some* ranks miss a gradient without ``find_unused_parameters``, those ranks
    raise and the others wait in vain: under ``launch`` the error still surfaces.

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
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False, *,
                 gradient_as_bucket_view: bool = False):
        super().__init__()
        dist.require_initialized("DistributedDataParallel")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter that requires a gradient; "
                             "there is nothing to synchronise (do not wrap it)")
        self._check_devices(named, device_ids, dim)
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True   # torch's name; no_sync() clears it
        self._world = dist.world_size(process_group)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())

        # Same model everywhere, then rank 0's values everywhere (parameters AND buffers).
        _check_same_model_everywhere(self._params, process_group, "DistributedDataParallel")
        broadcast_coalesced(list(module.parameters()) + self._module_buffers, _group_src(process_group),
                            process_group)

        # Lay out the buckets (reverse order) and remember where each parameter lives.
        self.buckets: list[Bucket] = []
        self._bucket_of: list[int] = [0] * len(self._params)
        first_mb = FIRST_BUCKET_MB if bucket_cap_mb is None else None
        layout = bucket_assignment(self._params, bucket_cap_mb or DEFAULT_BUCKET_CAP_MB, first_mb)
        for b, indices in enumerate(layout):
            ps = [self._params[i] for i in indices]
            buffer = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            views = [v.view_as(p) for v, p in zip(buffer.split([p.numel() for p in ps]), ps)]
            self.buckets.append(Bucket(b, [self._names[i] for i in indices], ps, buffer, views))
            for i in indices:
                self._bucket_of[i] = b
        self._views = [None] * len(self._params)  # parameter i's slice of its bucket
        for bk, indices in zip(self.buckets, layout):
            for i, v in zip(indices, bk.views):
                self._views[i] = v
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(_weak_hook(self, "_grad_ready", i))

        self._armed = False            # set by forward: should the coming backward sync?
        self._locally_used = [False] * len(self._params)   # since the last sync (find_unused only)
        self._reset_backward_state()

    @staticmethod
    def _check_devices(named: list, device_ids: list | None, dim: int) -> None:
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"DistributedDataParallel: parameters live on several devices {sorted(map(str, devices))}; "
                             "move the whole module to one device (dist.device()) first")
        device = devices.pop()
        if device_ids is not None:
            if device.type == "cpu":
                raise ValueError("DistributedDataParallel: device_ids must be None for a module on the CPU "
                                 f"(got {device_ids}); pass device_ids=None")
            wanted = [torch.device(device.type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
            if wanted != [device]:
                raise ValueError(f"DistributedDataParallel: device_ids={device_ids} does not match the module's "
                                 f"device {device}; pass device_ids=[{device.index}] or None")
        if dim != 0:
            raise ValueError(f"DistributedDataParallel: dim={dim} is not supported (no scatter of inputs here); "
                             "split the batch yourself and pass dim=0")

    # -- per-backward state ---------------------------------------------------
    def _reset_backward_state(self) -> None:
        self._in_backward = False          # has the first hook of this backward run?
        self._backward_start = 0.0
        self._ready = [False] * len(self._params)
        self._next_bucket = 0              # buckets launch strictly in this order
        for bk in self.buckets:
            bk.pending, bk.handle = len(bk.params), None

    def _abort(self) -> None:
        """Before raising: let the collectives already started finish, then forget this backward,
        so that the wrapper still works after the error is fixed (a notebook keeps it)."""
        for bk in self.buckets:
            if bk.handle is not None:
                bk.handle.wait()
        self._reset_backward_state()

    # -- forward ---------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._module_buffers and self._world > 1:
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

    # -- backward: hooks ---------------------------------------------------------
    @torch.no_grad()
    def _grad_ready(self, param: torch.Tensor, i: int) -> None:
        if self.find_unused_parameters:
            self._locally_used[i] = True
        if not self._armed:
            return  # forward ran inside no_sync(): accumulate locally, no communication
        if not self._in_backward:  # first gradient of this backward
            self._in_backward, self._backward_start = True, time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        if self._ready[i]:
            self._abort()
            raise RuntimeError(f"DistributedDataParallel: parameter {self._names[i]!r} got its gradient twice in "
                               "one backward (reentrant checkpointing or a second backward through the same "
                               "graph?); use non-reentrant checkpointing (use_reentrant=False)")
        self._ready[i] = True
        bucket = self.buckets[self._bucket_of[i]]
        if self.gradient_as_bucket_view:
            self._grad_into_view(param, self._views[i])
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    @staticmethod
    def _grad_into_view(p: torch.Tensor, view: torch.Tensor) -> None:
        """gradient_as_bucket_view: make ``p.grad`` the bucket slice (after zero_grad(set_to_none) it is new)."""
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _launch_ready_buckets(self) -> None:
        """Start every complete bucket from ``_next_bucket`` on, stopping at the first incomplete one."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bk = self.buckets[self._next_bucket]
            scale = 1.0 / self._world  # average = sum of (grad / N), as torch's reducer does it
            if self.gradient_as_bucket_view:
                if self._world > 1:
                    bk.buffer.mul_(scale)   # the gradients are already in the bucket
            else:
                for p, view in zip(bk.params, bk.views):  # copy in AND scale: one pass over memory
                    torch.mul(p.grad, scale, out=view) if p.grad is not None else view.zero_()
            bk.handle = comm.all_reduce(bk.buffer, group=self.process_group, async_op=True)
            self._next_bucket += 1

    # -- backward: the end ---------------------------------------------------------
    @torch.no_grad()
    def _finalize_backward(self) -> None:
        """Runs once when autograd has finished the backward pass (queued by the first hook)."""
        tracer = trace.active_tracer()
        if tracer is not None:
            tracer.add_span("ddp.backward", trace.COMPUTE, self._backward_start, time.perf_counter())
        try:
            with trace.span("ddp.wait", buckets=len(self.buckets)):
                globally_unused = self._complete_buckets()
                for bk in self.buckets:
                    bk.handle.wait()
                self._copy_back(globally_unused)
            self._locally_used = [False] * len(self._params)
        finally:
            self._reset_backward_state()

    def _complete_buckets(self) -> set[int]:
        """Deal with parameters that got no gradient; return those unused on every rank."""
        missing = [i for i, r in enumerate(self._ready) if not r]
        if missing and not self.find_unused_parameters:
            self._abort()
            names = [self._names[i] for i in missing]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise RuntimeError(f"DistributedDataParallel: parameter(s) {shown} received no gradient in this "
                               "backward, so their buckets could never be all-reduced; pass "
                               "find_unused_parameters=True to DistributedDataParallel (or make every "
                               "parameter take part in the loss, or set requires_grad=False on it)")
        if not self.find_unused_parameters:
            return set()
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
        return {i for i, count in enumerate(used.tolist()) if count == 0}

    def _copy_back(self, globally_unused: set[int]) -> None:
        """Averaged bucket contents -> ``p.grad`` (one fused copy when all grads exist)."""
        dst, src = [], []
        for i, (p, view) in enumerate(zip(self._params, self._views)):
            if i in globally_unused:
                continue  # torch leaves the .grad of a parameter no rank used untouched
            if self.gradient_as_bucket_view or p.grad is None:
                p.grad = view if self.gradient_as_bucket_view else view.clone()
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)
