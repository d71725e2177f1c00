"""Per-rank timeline recording: compute spans, communication spans, memory samples.

Layer 2 (recording). It knows nothing about any parallelism technique; the
techniques open spans and the instrumented collectives in ``minifsdp.comm``
record themselves on whichever tracer is *active* in the process.

    tracer = Tracer(rank=0)
    with tracer:                                   # make it the active tracer
        with tracer.span("forward", step=3):       # a compute span
            y = model(x)
        comm.all_reduce(grad)                      # recorded as a comm span
    tracer.trace                                   # a picklable Trace

A ``Trace`` is plain data (lists of dataclasses), so a worker started by
``minifsdp.launch`` can return it to the notebook. ``to_chrome_trace`` turns a
list of traces (one per rank) into the Chrome trace-event JSON format that
opens in https://ui.perfetto.dev or chrome://tracing: one *process* per rank,
one *thread lane* for compute and one for communication.

Every span is also entered as ``torch.profiler.record_function``, so when a
learner runs ``torch.profiler`` around a step the same names appear there.

Times are ``time.perf_counter()`` seconds. On Linux that clock is
CLOCK_MONOTONIC, shared by all processes of one machine, so ranks launched on
one machine line up on a common axis. (Across machines the clocks differ; the
trace then shows each rank relative to its own start.)

Read first: ``launch.py`` (how ranks start); then this file; then ``comm.py``
(collectives that record themselves here) and ``memory.py`` (which appends
``MemorySample``s to ``Trace.memory``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

try:
    import resource as _resource
except ImportError:  # Windows: no getrusage
    _resource = None

COMPUTE = "compute"
COMM = "comm"


@dataclass
class Span:
    """One interval on a rank's timeline."""

    name: str          # "forward", "all_reduce", ...
    kind: str          # COMPUTE or COMM
    start: float       # perf_counter seconds
    end: float
    args: dict[str, Any] = field(default_factory=dict)  # e.g. {"bytes": 4096, "group_size": 2}
    cpu: float | None = None  # seconds the recording thread ran on a CPU inside it (tracer.span)
    faults: int | None = None  # the process's minor page faults inside it (tracer.span; phases.py)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class MemorySample:
    """Live bytes by category at one instant (see ``minifsdp.memory``)."""

    time: float
    bytes_by_category: dict[str, int]
    label: str = ""

    @property
    def total(self) -> int:
        return sum(self.bytes_by_category.values())


@dataclass
class Trace:
    """Everything one rank recorded. Plain data: picklable and JSON-able."""

    rank: int = 0
    spans: list[Span] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def comm_spans(self) -> list[Span]:
        return [s for s in self.spans if s.kind == COMM]

    def compute_spans(self) -> list[Span]:
        return [s for s in self.spans if s.kind == COMPUTE]

    def bytes_by_op(self, within: str | None = None) -> dict[str, int]:
        """Total bytes this rank moved, per collective name.

        ``within="step"`` counts only collectives that started inside a compute
        span named "step" (leaving out set-up traffic such as the initial
        parameter broadcast).
        """
        windows = [(s.start, s.end) for s in self.compute_spans() if s.name == within]
        totals: dict[str, int] = {}
        for s in self.comm_spans():
            if within is None or any(a <= s.start <= b for a, b in windows):
                totals[s.name] = totals.get(s.name, 0) + int(s.args.get("bytes", 0))
        return totals


def minor_faults() -> int | None:
    """Minor page faults of this process so far, all threads (None where getrusage does not exist):
    one per 4 KiB page touched for the first time since it was mapped."""
    if _resource is None:
        return None
    return _resource.getrusage(_resource.RUSAGE_SELF).ru_minflt


# --------------------------------------------------------------------------
# The active tracer: a per-process stack, so nested `with tracer:` works.
# --------------------------------------------------------------------------
_active: list["Tracer"] = []
_lock = threading.Lock()


def active_tracer() -> "Tracer | None":
    """The innermost tracer entered with ``with tracer:``, or None."""
    return _active[-1] if _active else None


class Tracer:
    """Collects spans and memory samples for one rank.

    Use it as a context manager to make it the active tracer; ``comm``
    collectives and ``memory.MemoryTracker`` then record onto it.
    """

    def __init__(self, rank: int | None = None, **meta: Any):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.trace = Trace(rank=rank, meta=dict(meta, pid=os.getpid()))

    # -- activation ---------------------------------------------------------
    def __enter__(self) -> "Tracer":
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _lock:
            _active.remove(self)

    # -- recording ----------------------------------------------------------
    @contextmanager
    def span(self, name: str, kind: str = COMPUTE, **args: Any) -> Iterator[Span]:
        """Time the body as a span; also visible in torch.profiler traces."""
        # thread_time: this thread's CPU seconds, so wall - cpu is the time it sat blocked (phases.py)
        record = Span(name=name, kind=kind, start=time.perf_counter(), end=0.0, args=args)
        cpu, faults = time.thread_time(), minor_faults()
        with torch.profiler.record_function(name):
            try:
                yield record
            finally:
                record.end, record.cpu = time.perf_counter(), time.thread_time() - cpu
                record.faults = None if faults is None else minor_faults() - faults
                self.trace.spans.append(record)

    def add_span(self, name: str, kind: str, start: float, end: float, **args: Any) -> Span:
        """Record a span whose times were measured elsewhere (e.g. async comm)."""
        record = Span(name=name, kind=kind, start=start, end=end, args=args)
        self.trace.spans.append(record)
        return record


@contextmanager
def span(name: str, kind: str = COMPUTE, **args: Any) -> Iterator[Span | None]:
    """``tracer.span`` on the active tracer; a no-op (but still a
    ``record_function``) when no tracer is active. Techniques call this, so
    they run the same with or without tracing."""
    tracer = active_tracer()
    if tracer is None:
        with torch.profiler.record_function(name):
            yield None
    else:
        with tracer.span(name, kind, **args) as s:
            yield s


# --------------------------------------------------------------------------
# Chrome trace export
# --------------------------------------------------------------------------
_LANE = {COMPUTE: 0, COMM: 1}


def to_chrome_trace(traces: list[Trace]) -> dict[str, Any]:
    """Chrome trace-event JSON: one process per rank, lanes for compute/comm.

    Times become microseconds from the earliest event of any rank.
    """
    starts = [s.start for t in traces for s in t.spans] + [m.time for t in traces for m in t.memory]
    t0 = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    for tr in traces:
        pid = tr.rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {tr.rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": tr.rank}})
        for kind, tid in _LANE.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": kind}})
        for s in tr.spans:
            events.append({
                "ph": "X", "name": s.name, "cat": s.kind, "pid": pid, "tid": _LANE.get(s.kind, 2),
                "ts": (s.start - t0) * 1e6, "dur": max(s.duration, 0.0) * 1e6,
                "args": {k: v for k, v in s.args.items() if isinstance(v, (int, float, str, bool))},
            })
        for m in tr.memory:
            events.append({
                "ph": "C", "name": "memory (bytes)", "pid": pid, "ts": (m.time - t0) * 1e6,
                "args": dict(m.bytes_by_category),
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(traces: list[Trace], path: str | os.PathLike) -> str:
    """Write ``to_chrome_trace(traces)`` to ``path``; returns the path."""
    with open(path, "w") as f:
        json.dump(to_chrome_trace(traces), f)
    return str(path)
