"""Counting torch's traffic: its collectives, seen by minifsdp's tracer in the same units.

Front layer (``minifsdp.torch_reference``). minifsdp's techniques send every collective
through ``minifsdp.comm``, which records it on the active tracer. PyTorch's do not,
but their Python code looks the collectives up as attributes of the
``torch.distributed`` module *at call time* (torch 2.13: ``dist.all_gather`` --
the list form, on CPU -- in ``fsdp/_flat_param.py``, ``dist.all_gather_single``
in ``fsdp/_fully_shard/_fsdp_collectives.py``, ``dist.reduce_scatter_single``
in ``fsdp/_runtime_utils.py``, ``dist.all_reduce`` for NO_SHARD / HYBRID_SHARD,
``dist.broadcast`` in ``optim/zero_redundancy_optimizer.py``,
``dist._broadcast_coalesced`` for DDP's buffers before each forward). ``count_collectives()``
swaps those attributes for recording wrappers while a torch strategy trains,
so the tracer sees torch's calls in the same units as minifsdp's
(``comm.collective_bytes``: an all-gather of an S-byte tensor moves S, an
all-reduce 2S). torch DDP's all-reduce is issued from C++ (the Reducer), out
of reach of such a patch: a DDP communication hook (``register_comm_hook``)
hands each bucket back to Python, where torch's own default ``allreduce_hook``
calls ``dist.all_reduce`` -- which the counter then sees. DTensor (torch-tp,
torch-fsdp+tp) talks through the *functional* collectives instead
(``torch.distributed._functional_collectives``: ``tensor/placement_types.py``'s
redistributions and ``tensor/parallel/loss.py``'s loss_parallel call
``funcol.all_reduce`` / ``all_gather_single`` / ``reduce_scatter_single`` as
module attributes, each returning a new tensor); those are swapped the same way.

    >>> with count_collectives():        # on every rank of a torch-fsdp run
    ...     loss = model(x).sum(); loss.backward()
    >>> trace.active_tracer().trace.bytes_by_op()
    {'all_gather': ..., 'reduce_scatter': ...}
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as tdist

from .. import comm, dist, trace

__all__ = ["count_collectives", "count_ddp_buckets"]


# --------------------------------------------------------------------------
# Counting: wrap torch.distributed's collectives while a torch strategy runs
# --------------------------------------------------------------------------

# torch.distributed attribute -> (op name in the trace, its parameters in order, the
# parameter holding the *full* tensor(s): all-gather output, reduce-scatter input).
# Old and new names both: torch 2.13's FSDP2 calls the new ``*_single`` names, FSDP1
# on CPU the list ``all_gather``, DDP's buffer sync ``_broadcast_coalesced`` (C++
# underneath, but looked up here). The old names forward to distributed_c10d's
# module globals, not to these attributes, so no call is counted twice.
_GATHER = ("output_tensor", "input_tensor", "group", "async_op")
_SCATTER = ("output", "input", "op", "group", "async_op")
_COUNTED: dict[str, tuple[str, tuple[str, ...], str]] = {
    "all_gather_single": ("all_gather", _GATHER, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", _GATHER, "output_tensor"),
    "_all_gather_base": ("all_gather", _GATHER, "output_tensor"),
    "all_gather": ("all_gather", ("tensor_list", "tensor", "group", "async_op"), "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", _SCATTER, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", _SCATTER, "input"),
    "_reduce_scatter_base": ("reduce_scatter", _SCATTER, "input"),
    "all_reduce": ("all_reduce", ("tensor", "op", "group", "async_op"), "tensor"),
    "broadcast": ("broadcast", ("tensor", "src", "group", "async_op"), "tensor"),
    "_broadcast_coalesced": ("broadcast", ("group", "tensors", "buffer_size", "src"), "tensors"),
}


# torch.distributed._functional_collectives attribute -> the same triple; "return": the full
# tensor is the result (a functional all-gather returns its output). Only the functions that
# call torch.ops._c10d_functional themselves: all_gather_tensor and all_gather_inplace call
# all_gather_single through the module's globals -- the swapped attribute -- so counting them
# too would count twice. ``group`` is a ProcessGroup, a name, a DeviceMesh or (mesh, dim).
_FUNCOL_COUNTED: dict[str, tuple[str, tuple[str, ...], str]] = {
    "all_reduce": ("all_reduce", ("self", "reduceOp", "group", "tag"), "self"),
    "all_gather_single": ("all_gather", ("self", "gather_dim", "group", "tag"), "return"),
    "reduce_scatter_single": ("reduce_scatter", ("self", "reduceOp", "scatter_dim", "group", "tag"), "self"),
    "broadcast": ("broadcast", ("self", "src", "group", "tag"), "self"),
}


def _funcol_group_size(group: Any) -> int:
    from torch.distributed import _functional_collectives as funcol

    return tdist.distributed_c10d._get_group_size_by_name(funcol._resolve_group(group))  # as funcol sizes it


def _recording(name: str, original: Callable[..., Any], table: dict = _COUNTED,
               group_size: Callable[[Any], int] = dist.world_size) -> Callable[..., Any]:
    op, params, full = table[name]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        work = original(*args, **kwargs)
        tracer = trace.active_tracer()
        if tracer is not None:
            bound = {**dict(zip(params, args)), **kwargs, "return": work}
            tensors = bound[full] if isinstance(bound[full], (list, tuple)) else [bound[full]]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            size = group_size(bound.get("group", bound.get("process_group")))
            # Recorded when the call returns. An async_op call has then only been
            # *issued*: its bytes are right, its span covers the issue, not the
            # transfer (torch keeps the Work and waits on it in its own code).
            tracer.add_span(op, trace.COMM, start, time.perf_counter(), **comm.collective_bytes(op, nbytes, size),
                            group_size=size, dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                            numel=sum(t.numel() for t in tensors), async_op=bool(bound.get("async_op", False)),
                            source="torch")
        return work

    return wrapper


def _recording_p2p(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.distributed.pipelining``'s ``_batch_p2p(ops)``, recording one span per send or receive.

    torch's pipeline runtime issues every transfer through that one function, as
    a list of ``P2POp(isend | irecv, tensor, peer)``; ``minifsdp.comm`` records
    its own ``send`` / ``recv`` the same way (the tensor's bytes, once per side).
    """
    @functools.wraps(original)
    def wrapper(p2p_ops: list, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        works = original(p2p_ops, *args, **kwargs)
        tracer = trace.active_tracer()
        for p in p2p_ops if tracer is not None else ():
            op = "send" if p.op is tdist.isend else "recv"
            nbytes = p.tensor.numel() * p.tensor.element_size()
            tracer.add_span(op, trace.COMM, start, time.perf_counter(), **comm.collective_bytes(op, nbytes, 2),
                            group_size=2, dtype=str(p.tensor.dtype).replace("torch.", ""), numel=p.tensor.numel(),
                            async_op=True, source="torch")
        return works

    return wrapper


@contextlib.contextmanager
def count_collectives(pipelining: bool = False) -> Iterator[None]:
    """Inside: each torch.distributed collective called by Python code leaves a comm span on the active tracer.

    Undone on exit, exceptions included. minifsdp's own strategies must not run
    inside (``comm`` calls ``torch.distributed`` too and would be counted twice).
    The functional collectives (DTensor's) are swapped as well, and with
    ``pipelining`` the point-to-point transfers of ``torch.distributed.pipelining``
    (opt-in: importing it costs ~2 s a process).
    """
    from torch.distributed import _functional_collectives as funcol

    saved = [(tdist, name, getattr(tdist, name), _recording(name, getattr(tdist, name)))
             for name in _COUNTED if hasattr(tdist, name)]
    saved += [(funcol, name, getattr(funcol, name), _recording(name, getattr(funcol, name), _FUNCOL_COUNTED,
                                                                _funcol_group_size))
              for name in _FUNCOL_COUNTED]
    if pipelining:
        from torch.distributed.pipelining import schedules

        saved.append((schedules, "_batch_p2p", schedules._batch_p2p, _recording_p2p(schedules._batch_p2p)))
    try:
        for module, name, _, wrapper in saved:
            setattr(module, name, wrapper)
        yield
    finally:
        for module, name, original, _ in saved:
            setattr(module, name, original)


def count_ddp_buckets(ddp_model: torch.nn.parallel.DistributedDataParallel, precision: str = "fp32") -> None:
    """Route DDP's bucket all-reduce through Python, where ``count_collectives`` sees it.

    torch's ``allreduce_hook`` does what the C++ default does (divide by N,
    all-reduce, return the future); the difference is one Python call per
    bucket. With ``precision`` bf16/fp16,
    torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` instead: each bucket
    cast to 16 bits, divided by N, all-reduced (also through ``dist.all_reduce``,
    so still counted), cast back -- minifsdp.ddp's ``reduce_dtype``.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"bf16": _bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}.get(
        precision, default_hooks.allreduce_hook)
    ddp_model.register_comm_hook(state=None, hook=hook)


def _bf16_compress_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations: none here
    """torch's ``bf16_compress_hook``, under another name: ``register_comm_hook`` refuses that name
    unless CUDA 11+ and NCCL 2.10 are present, but gloo all-reduces bf16 on CPU (PLATFORM-NOTES)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)
