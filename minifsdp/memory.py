"""Live tensor memory over time, by category, on CPU and CUDA alike.

Layer 2 (recording): it knows no parallelism technique; a technique says what
its bytes are (``with tracker.category("comm"):``), the tracker counts them.
Why count storages ourselves: CUDA has an allocator counter
(``torch.cuda.memory_allocated``); the CPU has none, and process RSS only
grows. Every tensor views an *untyped storage*, the block the allocator handed
out. A ``TorchDispatchMode`` sees every aten op's outputs; a storage seen for
the first time is booked (bytes, device, category) with a weak reference whose
callback un-books it the instant the storage is freed. Views share their base's
storage, so it counts once. ``aten.resize_``/``set_`` pass the dispatcher
(output sizes are re-read); ``UntypedStorage.resize_`` (FSDP frees an unsharded
parameter but keeps the tensor: ``resize_(0)``, later ``resize_(n)``) does not,
so it is wrapped while a tracker is active. Ideas from
``torch.distributed._tools.mem_tracker.MemTracker``, our test cross-check.

Categories (constants below; any string works). A new storage gets the first
that applies: 1. the innermost ``with tracker.category(c):``; 2. ``optimizer``
inside any ``optimizer.step()``; 3. ``comm`` for new tensors from ``c10d``
collectives; 4. ``temporary`` inside the autograd engine (``backward()``);
5. ``activations`` otherwise. Re-labelling moves bytes exactly: ``track_model``
makes parameters ``parameters``, buffers ``other`` and each ``.grad``
``gradients`` once accumulated (and at every ``snapshot``); optimizer state
becomes ``optimizer`` after each step; ``register(obj, c)`` labels anything,
tensors made before tracking included. So "activations" is what forward made
and is still alive (mostly saved for backward); "temporary" backward's scratch.

Reading the numbers: ``live()`` is bytes alive now per category; ``peak_total``
the exact maximum of their sum (checked after every op), ``peak_by_category``
the breakdown then. ``samples`` (``trace.MemorySample``s, also pushed to the
active ``trace.Tracer``) is the curve: one per ``snapshot(label)``, one when
the total moved by ``sample_change`` x peak (or every ``sample_every`` ops),
and the peak at its own time, so the curve's top is exact. Books are per
device (``live(device="cpu")``, ``device_bytes()``); CUDA storages are rounded
up to 512 B blocks like the caching allocator's, to compare with
``cuda_allocated()``. Worked example::

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # 212 params
    opt = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker()
    tracker.track_model(model)              # parameters: 212 * 4 B = 848 B
    with tracker:
        model(torch.randn(32, 8)).square().mean().backward()  # gradients: 848 B
        opt.step()     # optimizer: exp_avg + exp_avg_sq = 2 * 848 B, + 4 fp32 steps = 1712 B
        tracker.snapshot("after step")      # {"parameters": 848, "gradients": 848, ...}
    print(tracker.summary())                # live and at-peak table in MiB

Blind spots: a kernel's internal scratch, storages made without an op (``register``
them), allocator caching. Allocations are seen only inside ``with tracker:``. A tool
that also wraps ``UntypedStorage.resize_`` (MemTracker) must be created inside it.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.optim import optimizer as optim_hooks
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                          is_traceable_wrapper_subclass_type)

from minifsdp import trace
from minifsdp.trace import MemorySample

PARAMETERS, GRADIENTS, OPTIMIZER = "parameters", "gradients", "optimizer"
ACTIVATIONS, TEMPORARY, COMM, OTHER = "activations", "temporary", "comm", "other"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARY, COMM, OTHER)
MiB = 1 << 20
_CUDA_BLOCK = 512  # CUDACachingAllocator rounds every block up to a multiple of 512 B
_COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class _Record(weakref.ref):
    """A weak reference to one storage, carrying what we booked for it."""

    __slots__ = ("key", "nbytes", "device", "category")

    def __new__(cls, storage: Any, callback: Any, *rest: Any) -> "_Record":
        return super().__new__(cls, storage, callback)

    def __init__(self, storage: Any, callback: Any, key: int, device: str, category: str):
        super().__init__(storage, callback)
        self.key, self.nbytes, self.device, self.category = key, 0, device, category


def _tensors(obj: Any, strict: bool = False) -> Iterator[torch.Tensor]:
    """Tensors in an op output or (``strict``) in modules/optimizers/containers."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple, set, dict)):
        for o in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors(o, strict)
    elif not strict or obj is None:
        return
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        yield from _tensors(list(obj.state.values()))
    else:
        raise TypeError(f"cannot register a {type(obj).__name__}")


def _storages(t: torch.Tensor) -> list[Any]:
    # A wrapper subclass (DTensor, FSDP2 params) owns no memory; its inner tensors do.
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        inner = (getattr(t, n) for n in t.__tensor_flatten__()[0])  # DTensor also names its mesh
        return [s for v in inner if isinstance(v, torch.Tensor) for s in _storages(v)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return []


# UntypedStorage.resize_ bypasses the dispatcher, so while any tracker is
# active it is wrapped, once for all of them (MemTracker does the same).
_active: list["MemoryTracker"] = []
_global_lock = threading.Lock()
_orig_resize: Any = None


def active_trackers() -> list["MemoryTracker"]:
    """The trackers now inside ``with tracker:``, oldest first (a copy). A technique labels
    its own buffers in each: ``for t in active_trackers(): t.register(buf, "unsharded_params")``."""
    with _global_lock:
        return list(_active)


def _resize_(storage: Any, size: int) -> Any:
    result = _orig_resize(storage, size)
    for tracker in list(_active):
        tracker._resized(storage)
    return result


class _Mode(TorchDispatchMode):
    tracker: "MemoryTracker"  # set right after construction

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # Let wrapper subclasses (DTensor) desugar first; their inner ops come back here.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.tracker._on_op(func, out)
        return out


class MemoryTracker:
    """Live storage bytes by (device, category); see the module docstring.
    ``device``: count only storages there ("cuda", "cuda:0", "cpu"; None: all).
    ``sample_change``/``sample_every``: when to sample; ``default_category``: rule 5."""

    def __init__(self, *, device: str | None = None, sample_change: float = 0.05,
                 sample_every: int | None = None, default_category: str = ACTIVATIONS):
        self.device_filter, self.default_category = device, default_category
        self.sample_change, self.sample_every = sample_change, sample_every
        self.samples: list[MemorySample] = []
        self._records: dict[int, _Record] = {}         # id(storage) -> record
        self._by_key: dict[tuple[str, str], int] = {}  # (device, category) -> bytes
        self._by_cat: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._by_dev: dict[str, int] = {}
        self._total = self.peak_total = 0
        self.peak_by_category: dict[str, int] = dict(self._by_cat)
        self.peak_by_device: dict[str, int] = {}
        self._peak_time, self._peak_sampled = 0.0, True
        self._last_sampled_total = self._ops_since_sample = 0
        self._stack: list[str] = []  # category() blocks
        self._in_optimizer = self._depth = 0
        self._mode: _Mode | None = None
        self._opt_hooks: list[Any] = []
        self._grad_hooks: dict[int, Any] = {}     # id(param) -> hook handle
        self._params: dict[int, weakref.ref] = {}  # id(param) -> param, for snapshot()
        self._lock = threading.RLock()  # CUDA backward runs hooks on another thread
        # (bytes, category) per block allocated since take_allocations(): new storages, resize_ growth
        self.allocations: list[tuple[int, str]] = []

    def __enter__(self) -> "MemoryTracker":
        global _orig_resize
        if self._depth == 0:
            with _global_lock:
                if not _active:
                    _orig_resize = torch.UntypedStorage.resize_
                    torch.UntypedStorage.resize_ = _resize_  # type: ignore[method-assign]
                _active.append(self)
            self._opt_hooks = [optim_hooks.register_optimizer_step_pre_hook(self._opt_pre),
                               optim_hooks.register_optimizer_step_post_hook(self._opt_post)]
            self._mode = _Mode()
            self._mode.tracker = self
            self._mode.__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth or self._mode is None:
            return
        self._mode.__exit__(*exc)
        self._mode = None
        for h in self._opt_hooks:
            h.remove()
        self._opt_hooks, self._in_optimizer = [], 0
        with _global_lock:
            _active.remove(self)
            if not _active:
                torch.UntypedStorage.resize_ = _orig_resize  # type: ignore[method-assign]
        self._sample("")  # flush a pending peak so the curve's top is exact

    @contextmanager
    def category(self, name: str) -> Iterator[None]:
        """New storages allocated in this block get category ``name``."""
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def register(self, obj: Any, category: str = OTHER) -> int:
        """Label (and track, if new) the storages of ``obj`` — tensors, modules,
        optimizers, nested containers — ``category``; returns their bytes."""
        done: dict[int, int] = {}
        with self._lock:
            for t in _tensors(obj, strict=True):
                for st in _storages(t):
                    if id(st) not in done:
                        done[id(st)] = self._see(st, category, relabel=True)
        return sum(done.values())

    def track_model(self, model: torch.nn.Module) -> None:
        """Parameters, their ``.grad`` (now and at each accumulation), buffers -> other."""
        tracker = weakref.ref(self)  # the hook must not keep the tracker alive

        def on_grad(p: torch.Tensor) -> None:
            tr = tracker()
            if tr is not None and tr._depth and p.grad is not None:
                tr.register(p.grad, GRADIENTS)
        for p in model.parameters():
            self.register(p, PARAMETERS)
            self.register(p.grad, GRADIENTS)
            if id(p) not in self._params:
                self._params[id(p)] = weakref.ref(p)
                if p.requires_grad:
                    self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(on_grad)
        self.register(list(model.buffers()), OTHER)

    def track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Label existing state; state made later is labelled by the step hooks."""
        self.register(optimizer, OPTIMIZER)

    def close(self) -> None:
        """Remove the gradient hooks ``track_model`` installed."""
        for h in self._grad_hooks.values():
            h.remove()
        self._grad_hooks.clear()

    def live(self, device: str | None = None) -> dict[str, int]:
        """Bytes alive now per category (all devices, or one device/type)."""
        out = dict.fromkeys(self._by_cat, 0)
        for (dev, cat), n in self._by_key.items():
            out[cat] += n if device is None or self._matches(dev, device) else 0
        return out

    def total(self, device: str | None = None) -> int:
        return self._total if device is None else sum(self.live(device).values())

    def device_bytes(self) -> dict[str, int]:
        """Bytes alive now per device, e.g. {"cuda:0": ..., "cpu": ...}."""
        return {d: n for d, n in self._by_dev.items() if n}

    def cuda_allocated(self, device: Any = None) -> int | None:
        """``torch.cuda.memory_allocated`` as a cross-check (None without CUDA)."""
        return torch.cuda.memory_allocated(device) if torch.cuda.is_available() else None

    def reset_peak(self) -> None:
        """Start a new peak window at the current total."""
        with self._lock:
            self.peak_total, self.peak_by_category = self._total, dict(self._by_cat)
            self.peak_by_device = dict(self._by_dev)
            self._peak_time, self._peak_sampled = time.perf_counter(), True

    def snapshot(self, label: str = "") -> dict[str, int]:
        """Re-read all sizes and params' ``.grad``, add a sample, return ``live()``."""
        with self._lock:
            params = [ref() for ref in self._params.values()]
            self.register([p.grad for p in params if p is not None], GRADIENTS)
            for rec in list(self._records.values()):
                st = rec()
                if st is not None:
                    self._see(st, rec.category, relabel=False)
            self._sample(label)
        return self.live()

    def take_allocations(self) -> list[tuple[int, str]]:
        """The (bytes, category) blocks allocated since the last call: what a step asked the allocator for."""
        with self._lock:
            taken, self.allocations = self.allocations, []
        return taken

    def report(self) -> dict[str, Any]:
        """Everything as plain, picklable data (a worker returns this)."""
        return dict(live=self.live(), device_bytes=self.device_bytes(), peak_total=self.peak_total,
                    peak_by_category=dict(self.peak_by_category),
                    peak_by_device=dict(self.peak_by_device), samples=list(self.samples))

    def summary(self, unit: str = "MiB") -> str:
        """A table (MiB, or "B"/"KiB"/"GiB"): live now and at the peak, per category."""
        div, peak = dict(B=1, KiB=1024, MiB=MiB, GiB=1024 * MiB)[unit], self.peak_by_category
        rows = [f"{'category':<14}{'live ' + unit:>11}{'at peak ' + unit:>13}"]
        for cat, n in self._by_cat.items():
            rows.append(f"{cat:<14}{n / div:>11.2f}{peak.get(cat, 0) / div:>13.2f}")
        rows.append(f"{'total':<14}{self._total / div:>11.2f}{self.peak_total / div:>13.2f}")
        devs = ", ".join(f"{d} {n / div:.2f}" for d, n in self.device_bytes().items())
        return "\n".join(rows + [f"live by device ({unit}): {devs or '-'}"])

    @staticmethod
    def _matches(dev: str, want: str) -> bool:
        return dev == want or dev.split(":")[0] == want

    def _account(self, device: str, category: str, delta: int) -> None:
        key = (device, category)
        self._by_key[key] = self._by_key.get(key, 0) + delta
        self._by_cat[category] = self._by_cat.get(category, 0) + delta
        self._by_dev[device] = self._by_dev.get(device, 0) + delta
        self._total += delta
        if delta > 0:
            if self._by_dev[device] > self.peak_by_device.get(device, 0):
                self.peak_by_device[device] = self._by_dev[device]
            if self._total > self.peak_total:
                self.peak_total, self.peak_by_category = self._total, dict(self._by_cat)
                self._peak_time, self._peak_sampled = time.perf_counter(), False

    def _see(self, st: Any, category: str, relabel: bool) -> int:
        """Book ``st`` (new: as ``category``; known: re-read size, relabel if asked)."""
        rec = self._records.get(id(st))
        if rec is None:
            dev = st.device
            if dev.type == "meta" or (self.device_filter is not None
                                      and not self._matches(str(dev), self.device_filter)):
                return 0
            rec = _Record(st, self._freed, id(st), str(dev), category)
            self._records[rec.key] = rec
        elif relabel and rec.category != category:
            self._account(rec.device, rec.category, -rec.nbytes)
            self._account(rec.device, category, rec.nbytes)
            rec.category = category
        n = st.nbytes()
        if n and rec.device.startswith("cuda"):
            n = -(-n // _CUDA_BLOCK) * _CUDA_BLOCK
        if n > rec.nbytes and not relabel:  # register() books what exists; ops and resize_ allocate
            self.allocations.append((n - rec.nbytes, rec.category))
        if n != rec.nbytes:
            delta, rec.nbytes = n - rec.nbytes, n
            self._account(rec.device, rec.category, delta)
        return n

    def _freed(self, rec: _Record) -> None:  # weakref callback: the storage is gone
        with self._lock:
            if self._records.get(rec.key) is rec:
                del self._records[rec.key]
                self._account(rec.device, rec.category, -rec.nbytes)

    def _resized(self, st: Any) -> None:
        with self._lock:
            rec = self._records.get(id(st))
            if rec is not None:
                self._see(st, rec.category, relabel=False)
                self._maybe_sample()

    def _opt_pre(self, *_: Any) -> None:  # global optimizer step hooks
        self._in_optimizer += 1

    def _opt_post(self, opt: Any, *_: Any) -> None:
        self._in_optimizer = max(0, self._in_optimizer - 1)
        self.register(opt, OPTIMIZER)

    def _category_now(self, func: Any) -> str:
        if self._stack:
            return self._stack[-1]
        if self._in_optimizer:
            return OPTIMIZER
        if func.namespace in _COMM_NAMESPACES:
            return COMM
        if torch._C._current_graph_task_id() != -1:  # inside the autograd engine
            return TEMPORARY
        return self.default_category

    def _on_op(self, func: Any, out: Any) -> None:
        category = self._category_now(func)
        with self._lock:
            for t in _tensors(out):
                for st in _storages(t):
                    self._see(st, category, relabel=False)
            self._ops_since_sample += 1
            self._maybe_sample()

    def _maybe_sample(self) -> None:
        due = self.sample_every is not None and self._ops_since_sample >= self.sample_every
        step = self.sample_change * max(self.peak_total, 1)
        if due or abs(self._total - self._last_sampled_total) > step:
            self._sample("")

    def _sample(self, label: str) -> None:
        if not self._peak_sampled and self.peak_total != self._total:
            self._emit(self._peak_time, self.peak_by_category, "peak")
        self._peak_sampled = True
        self._emit(time.perf_counter(), self._by_cat, label)
        self._last_sampled_total, self._ops_since_sample = self._total, 0

    def _emit(self, when: float, by_category: dict[str, int], label: str) -> None:
        self.samples.append(MemorySample(when, dict(by_category), label))
        tracer = trace.active_tracer()
        if tracer is not None:  # its own copy: the tracer's trace travels to the notebook
            tracer.trace.memory.append(MemorySample(when, dict(by_category), label))
