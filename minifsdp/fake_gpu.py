"""Would this worker hand a CPU tensor to NCCL? Find out on a CPU-only machine.

Layer 1 (runtime), next to ``dist`` and ``launch``. On a GPU VM every tensor a
worker passes to a collective must be on ``dist.device()`` (``cuda:LOCAL_RANK``):
NCCL rejects CPU tensors. On a laptop ``dist.device()`` is ``cpu``, so a worker
that forgets ``device=dist.device()`` runs fine there and fails only on the VM.

Under a **pretend GPU** the forgotten device shows on the CPU too.
``MINIFSDP_FAKE_GPU=N`` in the environment makes this CPU machine a VM with N
GPUs: ``dist.gpu_count()`` is N, so ``launch``, ``dist.available_ranks`` and
``dist.lab_world_size`` decide as they would there (a launch of more ranks than
N runs CPU ranks and says so; ``backend="nccl"`` refuses it), and every launch
of at most N ranks runs its workers as GPU ranks, with:

* ``dist.device()`` returning ``FAKE_GPU``: one particular ``torch.device("cpu")``
  object, told apart from every other ``cpu`` by identity. It prints and compares
  as ``cpu``, so everything else (memory tracking by device name, ``.type``
  checks) behaves exactly as on the CPU;
* every tensor the worker puts "on the GPU" remembered (by its storage): made
  with ``device=dist.device()``, moved with ``.to(dist.device())``, or computed,
  by any op forward *or backward*, from such a tensor — exactly the tensors that
  would be CUDA tensors on a GPU machine, where an op's output lives with its
  inputs and a factory without ``device=`` makes a CPU tensor. As on a GPU,
  ``.to(dist.device())`` returns a copy (the original stays "on the CPU") and
  ``.cpu()`` / ``.to("cpu")`` return an unmarked copy;
* every ``torch.distributed`` collective and point-to-point call (``comm`` goes
  through them) checking that each tensor it gets is remembered, else raising
  ``DeviceDisciplineError`` naming the call, the tensor and the fix.

Why this is sound for what it checks: a tensor is remembered only if it would
be on the GPU, and every tensor reaching a Python-level collective is checked,
so a run that passes would not have handed a CPU tensor to NCCL through those
calls. What it does not see: collectives called by torch's own code (its
FSDP and DDP, which the labs run beside ours for comparison, derive their
buffers' device from the module's parameters, ``p.device``, and the C++ DDP
reducer communicates by itself). It is lenient where CUDA is strict (an op
mixing a GPU and a CPU tensor, which CUDA rejects unless the CPU one is a 0-d
scalar, gives a remembered output), and strict where it cannot know: a
factory given ``device=t.device`` of a remembered ``t`` (a fresh ``cpu``
object) makes an unremembered tensor, so it can raise a false alarm, never
miss a CPU tensor. Use ``dist.device()``, ``t.new_*`` or ``torch.*_like(t)``.

    >>> import os; os.environ["MINIFSDP_FAKE_GPU"] = "2"      # doctest: +SKIP
    >>> launch(lambda: comm.all_reduce(torch.ones(3)), 2)      # doctest: +SKIP
    WorkerError: ranks 0-1 failed: DeviceDisciplineError: all_reduce got a tensor on the CPU ...
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as tdist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import dist

FAKE_GPU = torch.device("cpu")  # compared by identity: `device is FAKE_GPU`
ENV = "MINIFSDP_FAKE_GPU"
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "send", "recv",
                "isend", "irecv", "all_to_all_single", "all_to_all", "gather", "scatter")


class DeviceDisciplineError(RuntimeError):
    """A worker passed a tensor that would be on the CPU, on a GPU machine, to a collective."""


def count() -> int:
    """The pretend GPU count (``MINIFSDP_FAKE_GPU=N``, N >= 1), or 0 when there is no pretend GPU."""
    value = os.environ.get(ENV, "")
    return int(value) if value.isdigit() else 0


def enabled() -> bool:
    return count() > 0


class _Marks:
    """Storages that would live on the GPU (weak: a freed storage is forgotten)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def _storage(self, t: torch.Tensor) -> Any:
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None

    def add(self, t: torch.Tensor) -> None:
        st = self._storage(t)
        if st is not None and id(st) not in self._refs:
            key = id(st)
            self._refs[key] = weakref.ref(st, lambda _, key=key: self._refs.pop(key, None))

    def discard(self, t: torch.Tensor) -> None:
        st = self._storage(t)
        if st is not None:
            self._refs.pop(id(st), None)

    def __contains__(self, t: torch.Tensor) -> bool:
        st = self._storage(t)
        return st is not None and (st.size() == 0 or id(st) in self._refs)


_marks = _Marks()


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _is_fake(device: Any) -> bool:
    return device is FAKE_GPU


def _to_cpu(func: Any, args: tuple, kwargs: dict) -> bool:
    """``t.cpu()`` or ``t.to("cpu")`` (not to the pretend GPU): a copy that lives on the CPU."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return target is not None and not _is_fake(target) and torch.device(target).type == "cpu"
    return False


class _FunctionMode(TorchFunctionMode):
    """Marks what is created on, or moved to, the pretend GPU; unmarks ``.cpu()`` copies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and (any(_is_fake(a) for a in args[1:]) or _is_fake(kwargs.get("device"))):
            if args[0] not in _marks and out.untyped_storage() is args[0].untyped_storage():
                out = out.clone()  # a copy, as x.to("cuda") is; x itself stays on the CPU
            _marks.add(out)
            return out
        if _to_cpu(func, args, kwargs):
            if isinstance(out, torch.Tensor) and out in _marks:  # on a GPU this is a copy, on the CPU
                out = out.clone()
                _marks.discard(out)
            return out
        if _is_fake(kwargs.get("device")):
            for t in _tensors(out):
                _marks.add(t)
        return out


class _DispatchMode(TorchDispatchMode):
    """Every aten op, forward and backward: an output computed from a GPU tensor is on the GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(t in _marks for t in _tensors((args, kwargs))):
            for t in _tensors(out):
                _marks.add(t)
        return out


def _describe(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor"


_PASS_THROUGH = ("minifsdp/fake_gpu.py", "minifsdp/torch_reference/counting.py")  # wrappers that only count or check


def _called_by_torch() -> bool:
    """Whether the code calling the collective (past counting wrappers) is torch's own."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(_PASS_THROUGH):
        frame = frame.f_back
    return frame is not None and "/torch/" in frame.f_code.co_filename.replace("\\", "/")


def _checked(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _called_by_torch():  # torch's own FSDP/DDP place their buffers from the module's device: not ours
            return fn(*args, **kwargs)
        for t in _tensors((args, kwargs)):
            if t not in _marks:
                raise DeviceDisciplineError(
                    f"{name} got {_describe(t)} on the CPU: on a GPU machine NCCL rejects it. Make it with "
                    "device=dist.device() or move it with .to(dist.device()) (models: model.to(dist.device()); "
                    "batches: x.to(dist.device()))")
        return fn(*args, **kwargs)
    wrapper._minifsdp_checked = True  # type: ignore[attr-defined]
    return wrapper


def _module_to(original: Any) -> Any:
    """``Module.to(dist.device())`` re-parses the device (a new object), so it is recognised here."""
    @functools.wraps(original)
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if any(_is_fake(a) for a in args) or _is_fake(kwargs.get("device")):
            for t in [*self.parameters(), *self.buffers()]:
                if t not in _marks:
                    t.data = t.data.clone()  # moved: a copy, as on a GPU
                    _marks.add(t)
        return out
    return to


@contextlib.contextmanager
def pretend_gpu() -> Iterator[None]:
    """Run the body as if on a GPU: ``dist.device()`` is ``FAKE_GPU`` and collectives check their tensors."""
    patched = {n: getattr(tdist, n) for n in _COLLECTIVES if hasattr(tdist, n)}
    previous = dist._device_override
    dist._device_override = FAKE_GPU
    for n, fn in patched.items():
        if not getattr(fn, "_minifsdp_checked", False):
            setattr(tdist, n, _checked(n, fn))
    module_to = torch.nn.Module.to
    torch.nn.Module.to = _module_to(module_to)  # type: ignore[method-assign]
    try:
        with _FunctionMode(), _DispatchMode():
            yield
    finally:
        torch.nn.Module.to = module_to  # type: ignore[method-assign]
        for n, fn in patched.items():
            setattr(tdist, n, fn)
        dist._device_override = previous
