"""Instrumented collectives: ``torch.distributed`` calls that leave a record.

Layer 3 (communication). Every technique in minifsdp talks through these
functions, never through ``torch.distributed`` directly, so the active tracer
(``minifsdp.trace``) sees each call: op, bytes, group size, start and end.
Names and signatures are those of ``torch.distributed``; change
``dist.all_reduce`` to ``comm.all_reduce`` and nothing else.

What each collective does, with 2 ranks (rank 0 holds ``a``, rank 1 ``b``):

    all_reduce      r0 [1, 2]  r1 [3, 4]   ->  both [4, 6]          (sum)
    all_gather      r0 [1, 2]  r1 [3, 4]   ->  both [1, 2, 3, 4]    (concatenate)
    reduce_scatter  r0 [1, 2, 3, 4]  r1 [5, 6, 7, 8]
                                            ->  r0 [6, 8]  r1 [10, 12]
                                               (sum, then rank i keeps chunk i)
    broadcast       r0 [1, 2]  r1 [0, 0]   ->  both [1, 2]          (from src=0)
    all_to_all_single r0 [1, 2]  r1 [3, 4] ->  r0 [1, 3]  r1 [2, 4] (chunk j goes to rank j;
                                               split sizes make the chunks uneven: expert parallel)

    all_reduce == reduce_scatter followed by all_gather: the identity that
    ZeRO and FSDP are built on.

Bytes, two conventions (both recorded on every span):

* ``bytes`` — the *volume* of the collective in the ZeRO paper's units: an
  all-gather or reduce-scatter of an S-byte tensor moves S, an all-reduce 2S,
  a broadcast or send S, an all-to-all S (the input a rank hands over, its own chunk included).
  DDP costs 2·4Ψ bytes per step for Ψ fp32 parameters, ZeRO-3 3·4Ψ.
* ``ring_bytes`` — what one rank actually sends with a ring algorithm:
  ``(N-1)/N`` of the above (a rank never sends itself its own chunk). This is
  the number to divide by time for a link's bandwidth ("bus bandwidth" in
  nccl-tests). An all-to-all's is exact, uneven splits too: its input less the
  chunk the rank keeps for itself.

Uneven inputs are rejected with an error that names the fix (pad so every
rank holds the same number of elements — exactly what FSDP's flat parameters
do). Set ``comm.CHECK_ACROSS_RANKS = True`` (or env ``MINIFSDP_CHECK_COMM=1``)
to also compare shapes between ranks before each collective: slower, but a
mismatch becomes an error instead of a hang or garbage.

Labelling spans: ``with comm.annotate(unit="blocks.0"):`` adds ``unit`` to
the arguments of every span recorded for a call made inside the block. An
async call keeps the labels it was *called* with, even if ``wait()`` (which
records its span) runs after the block; nested blocks merge, inner wins::

    with comm.annotate(unit="blocks.0"):
        h = comm.all_gather_into_tensor(out, shard, async_op=True)
        with comm.annotate(phase="backward"):
            comm.all_reduce(g)             # span args: unit="blocks.0", phase="backward"
    h.wait()                               # span args: unit="blocks.0"
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as tdist
from torch.distributed import ProcessGroup, ReduceOp

from . import dist, trace

__all__ = ["all_reduce", "all_reduce_flat", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
           "reduce_scatter", "broadcast", "reduce", "all_to_all_single", "send", "recv", "isend", "irecv", "barrier",
           "Handle", "ReduceOp", "annotate", "annotations", "collective_bytes", "pad_to_multiple"]

CHECK_ACROSS_RANKS = os.environ.get("MINIFSDP_CHECK_COMM", "0") == "1"

# torch 2.13 renamed the single-tensor collectives (the old names now warn);
# older releases only have the old names. Looked up at each call, not bound at import, so a wrapper
# installed later (fake_gpu's device check) sees them too.
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(tdist, "all_gather_single", tdist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return getattr(tdist, "reduce_scatter_single", tdist.reduce_scatter_tensor)(*args, **kwargs)


# The labels of the open ``annotate`` blocks, outermost first. One list per
# process, not per thread: on CUDA the autograd engine runs backward hooks (and
# the collectives they start) on its own thread, inside the caller's block.
_annotations: list[dict[str, Any]] = []
# Span arguments comm fills in itself; an annotation must not overwrite them.
_RESERVED = frozenset({"bytes", "ring_bytes", "group_size", "dtype", "numel", "async_op", "src", "dst", "peer"})


@contextmanager
def annotate(**args: Any) -> Iterator[None]:
    """Add ``args`` to the span of every collective called inside the block (nesting merges).

    >>> with annotate(unit="blocks.0", phase="forward"):
    ...     annotations()
    {'unit': 'blocks.0', 'phase': 'forward'}
    >>> annotations()
    {}
    """
    taken = sorted(_RESERVED & set(args))
    if taken:
        raise ValueError(f"comm.annotate: {taken} are span arguments comm records itself; "
                         "choose other names (e.g. unit=..., phase=...)")
    _annotations.append(args)
    try:
        yield
    finally:
        _annotations.pop()


def annotations() -> dict[str, Any]:
    """The labels a collective called now gets: the open ``annotate`` blocks merged, inner wins."""
    merged: dict[str, Any] = {}
    for args in _annotations:
        merged.update(args)
    return merged


def collective_bytes(op: str, nbytes: int, group_size: int) -> dict[str, int]:
    """The two byte counts for one call; ``nbytes`` is the size of the *full* tensor.

    Full tensor: the all-gather output, the reduce-scatter input, the
    all-reduce / broadcast / send tensor.

    >>> collective_bytes("all_reduce", 1000, 4)
    {'bytes': 2000, 'ring_bytes': 1500}
    """
    n = group_size
    volume = 2 * nbytes if op == "all_reduce" else nbytes
    if op in ("send", "recv", "isend", "irecv"):
        ring = nbytes
    else:
        ring = volume * (n - 1) // n
    return {"bytes": volume, "ring_bytes": ring}


class Handle:
    """An async collective in flight. ``wait()`` blocks until done and records the span.

    The span runs from the call to the end of ``wait()``: on CPU/gloo there are
    no streams, so that is when the data is known to be there.
    """

    def __init__(self, work: Any, op: str, start: float, args: dict[str, Any],
                 tracer: trace.Tracer | None, device: torch.device = torch.device("cpu")):
        self._work, self._op, self._start, self._args, self._tracer = work, op, start, args, tracer
        self._device = device
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._tracer is not None and self._device.type == "cuda":
            # NCCL returns once the kernel is queued; to time the transfer, wait for it.
            torch.cuda.synchronize(self._device)
        self._done = True
        if self._tracer is not None:
            self._tracer.add_span(self._op, trace.COMM, self._start, time.perf_counter(), **self._args)

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


def _record(op: str, work: Any, start: float, nbytes: int, group: ProcessGroup | None,
            async_op: bool, tensor: torch.Tensor, ring_bytes: int | None = None, **extra: Any) -> Handle | None:
    size = dist.world_size(group)
    counts = collective_bytes(op, nbytes, size)
    if ring_bytes is not None:  # counted by the caller, where (N-1)/N is not exact (uneven all-to-all)
        counts["ring_bytes"] = ring_bytes
    args = dict(annotations(), **counts, group_size=size, dtype=str(tensor.dtype).replace("torch.", ""),
                numel=tensor.numel(), async_op=async_op, **extra)
    handle = Handle(work, op, start, args, trace.active_tracer(), tensor.device)
    if async_op:
        return handle
    handle.wait()
    return None


def _check_same_everywhere(what: str, numel: int, group: ProcessGroup | None) -> None:
    if not CHECK_ACROSS_RANKS or dist.world_size(group) == 1:
        return
    sizes = [None] * dist.world_size(group)
    tdist.all_gather_object(sizes, numel, group=group)
    if len(set(sizes)) > 1:
        raise ValueError(f"{what}: ranks hold different sizes {sizes}; every rank must pass "
                         "the same number of elements (pad with comm.pad_to_multiple)")


def pad_to_multiple(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Flatten ``t`` and zero-pad it to a multiple of ``multiple`` elements.

    >>> pad_to_multiple(torch.tensor([1., 2., 3.]), 2)
    tensor([1., 2., 3., 0.])
    """
    flat = t.reshape(-1)
    pad = (-flat.numel()) % multiple
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


# --------------------------------------------------------------------------
# The collectives (torch.distributed names and signatures)
# --------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
               group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Every rank ends with the reduction (default: sum) of all ranks' ``tensor``, in place."""
    dist.require_initialized("comm.all_reduce")
    _check_same_everywhere("all_reduce", tensor.numel(), group)
    start = time.perf_counter()
    work = tdist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _record("all_reduce", work, start, tensor.numel() * tensor.element_size(), group, async_op, tensor)


@torch.no_grad()
def all_reduce_flat(tensors: list[torch.Tensor], group: ProcessGroup | None = None, average: bool = False) -> None:
    """Sum (``average``: then divide by the group's size) many tensors in one all-reduce, in place.

    One call of the concatenated tensors instead of one per tensor (each collective has a fixed
    cost); the sums are copied back. r0 [[1], [2, 3]], r1 [[3], [4, 5]] -> both [[4], [6, 8]].
    """
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, ReduceOp.SUM, group=group)
    if average:
        flat /= dist.world_size(group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None = None,
                           async_op: bool = False) -> Handle | None:
    """``output`` (N x input's size) becomes the concatenation of every rank's ``input``, in rank order."""
    dist.require_initialized("comm.all_gather_into_tensor")
    n = dist.world_size(group)
    if output.numel() != input.numel() * n:
        raise ValueError(f"all_gather: output has {output.numel()} elements but input ({input.numel()}) x "
                         f"group size ({n}) = {input.numel() * n}; size the output N x input")
    _check_same_everywhere("all_gather", input.numel(), group)
    start = time.perf_counter()
    work = _all_gather_single(output, input, group=group, async_op=async_op)
    return _record("all_gather", work, start, output.numel() * output.element_size(), group, async_op, output)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                          group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Reduce every rank's ``input`` (N chunks); rank i receives chunk i of the result in ``output``."""
    dist.require_initialized("comm.reduce_scatter_tensor")
    n = dist.world_size(group)
    if input.numel() != output.numel() * n:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, not output ({output.numel()}) x "
                         f"group size ({n}) = {output.numel() * n}; pad the input to a multiple of "
                         "the group size (comm.pad_to_multiple)")
    _check_same_everywhere("reduce_scatter", input.numel(), group)
    start = time.perf_counter()
    work = _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return _record("reduce_scatter", work, start, input.numel() * input.element_size(), group, async_op, input)


def broadcast(tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None,
              async_op: bool = False) -> Handle | None:
    """Every rank's ``tensor`` becomes rank ``src``'s (``src`` is a global rank, as in torch)."""
    dist.require_initialized("comm.broadcast")
    _check_same_everywhere("broadcast", tensor.numel(), group)
    start = time.perf_counter()
    work = tdist.broadcast(tensor, src=src, group=group, async_op=async_op)
    return _record("broadcast", work, start, tensor.numel() * tensor.element_size(), group, async_op,
                   tensor, src=src)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp.RedOpType = ReduceOp.SUM,
           group: ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Rank ``dst`` (global) ends with the reduction of every rank's ``tensor``; elsewhere it is scratch.

    rank 0 holds [1, 2], rank 1 holds [3, 4]; reduce to dst=1  ->  rank 1 holds [4, 6]
    (FairScale's ZeRO-2 sends each gradient to its owner this way: volume S, the gradient's bytes.)
    """
    dist.require_initialized("comm.reduce")
    _check_same_everywhere("reduce", tensor.numel(), group)
    start = time.perf_counter()
    work = tdist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)
    return _record("reduce", work, start, tensor.numel() * tensor.element_size(), group, async_op,
                   tensor, dst=dst)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: ProcessGroup | None = None,
                      async_op: bool = False) -> Handle | None:
    """Chunk j of ``input`` (along dim 0) goes to rank j; ``output`` holds the chunks received, in rank order.

    rank 0 [1, 2], rank 1 [3, 4]  ->  rank 0 [1, 3], rank 1 [2, 4]. Without split sizes the chunks are equal;
    ``input_split_sizes[j]`` rows go to rank j and ``output_split_sizes[j]`` rows come from rank j (so each
    rank must first learn what its peers send it: expert parallel exchanges counts first). Bytes: the input
    (``bytes``) and the input less the chunk this rank keeps (``ring_bytes``: what leaves the rank).
    """
    dist.require_initialized("comm.all_to_all_single")
    n, me = dist.world_size(group), dist.rank(group)
    for name, t, sizes in (("input", input, input_split_sizes), ("output", output, output_split_sizes)):
        if sizes is None and (t.dim() == 0 or t.shape[0] % n):
            raise ValueError(f"all_to_all_single: dim 0 of the {name} {tuple(t.shape)} is not divisible by the group "
                             f"size {n}; pad it or pass {name}_split_sizes")
        if sizes is not None and (len(sizes) != n or sum(sizes) != t.shape[0]):
            raise ValueError(f"all_to_all_single: {name}_split_sizes {list(sizes)} must be {n} sizes summing to "
                             f"dim 0 of the {name} ({t.shape[0]})")
    row = input[0].numel() * input.element_size() if input.shape[0] else 0
    own = (input_split_sizes[me] if input_split_sizes is not None else input.shape[0] // n) * row
    start = time.perf_counter()
    work = tdist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                   async_op=async_op)
    nbytes = input.numel() * input.element_size()
    return _record("all_to_all", work, start, nbytes, group, async_op, input, ring_bytes=nbytes - own)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Blocking point-to-point send to global rank ``dst`` (``tag`` tells messages apart; gloo only)."""
    dist.require_initialized("comm.send")
    start = time.perf_counter()
    tdist.send(tensor, dst=dst, group=group, tag=tag)
    _record("send", None, start, tensor.numel() * tensor.element_size(), group, False, tensor, peer=dst)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Blocking receive from global rank ``src`` into ``tensor`` (of the send with the same ``tag``)."""
    dist.require_initialized("comm.recv")
    start = time.perf_counter()
    tdist.recv(tensor, src=src, group=group, tag=tag)
    _record("recv", None, start, tensor.numel() * tensor.element_size(), group, False, tensor, peer=src)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Handle:
    """Non-blocking send; call ``.wait()`` on the handle before reusing ``tensor``."""
    dist.require_initialized("comm.isend")
    start = time.perf_counter()
    work = tdist.isend(tensor, dst=dst, group=group, tag=tag)
    return _record("send", work, start, tensor.numel() * tensor.element_size(), group, True, tensor, peer=dst)


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, tag: int = 0) -> Handle:
    """Non-blocking receive; ``tensor`` holds the data after ``.wait()``."""
    dist.require_initialized("comm.irecv")
    start = time.perf_counter()
    work = tdist.irecv(tensor, src=src, group=group, tag=tag)
    return _record("recv", work, start, tensor.numel() * tensor.element_size(), group, True, tensor, peer=src)


def barrier(group: ProcessGroup | None = None) -> None:
    dist.require_initialized("comm.barrier")
    with trace.span("barrier", trace.COMM, **annotations(), bytes=0, ring_bytes=0,
                    group_size=dist.world_size(group)):
        tdist.barrier(group=group)


# --------------------------------------------------------------------------
# Conveniences that allocate the output (what a lesson usually wants)
# --------------------------------------------------------------------------
def all_gather(input: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Return the concatenation (along dim 0) of every rank's ``input``.

    rank 0 holds [1, 2], rank 1 holds [3, 4]  ->  both get [1, 2, 3, 4]
    """
    n = dist.world_size(group)
    output = input.new_empty((n * input.shape[0],) + tuple(input.shape[1:])) if input.dim() else input.new_empty(n)
    all_gather_into_tensor(output, input.contiguous(), group=group)
    return output


def reduce_scatter(input: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                   group: ProcessGroup | None = None) -> torch.Tensor:
    """Return this rank's chunk (along dim 0) of the reduction of every rank's ``input``.

    rank 0 holds [1, 2, 3, 4], rank 1 holds [5, 6, 7, 8]  ->  rank 0 gets [6, 8], rank 1 [10, 12]
    """
    n = dist.world_size(group)
    if input.dim() == 0 or input.shape[0] % n:
        raise ValueError(f"reduce_scatter: dim 0 of the input ({tuple(input.shape)}) must be divisible by the "
                         f"group size {n}; pad it first (comm.pad_to_multiple)")
    output = input.new_empty((input.shape[0] // n,) + tuple(input.shape[1:]))
    reduce_scatter_tensor(output, input.contiguous(), op=op, group=group)
    return output
