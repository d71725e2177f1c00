"""Where a training step's time goes: forward, backward, communication wait, optimizer, the rest; and
what each step asks of the allocator (minor page faults, bytes allocated by size class).

Layer 2 (recording): it reads a rank's ``trace.Trace`` and knows no technique. ``python -m
minifsdp.bench --phases`` prints it for both sides of a pair, so a gap between two implementations is
located, not guessed.

Time. Every compute span records the wall time and the *CPU time of its thread* (``Span.cpu``,
``time.thread_time``). A rank's main thread runs the model; while it sits in a collective's ``wait()``
(gloo's worker threads move the data, NCCL's kernels run on the GPU) or in a blocking collective it
is off the CPU. So one step splits exactly into::

    forward    CPU time inside "forward" spans          (less nested phase spans)
    backward   CPU time inside "backward" spans; for a schedule that runs both
               ("forward_backward": a pipeline's or tensor parallel's train_step)
               what is not inside its "forward" spans
    optimizer  CPU time inside the "optimizer" span     (the step, zero_grad, grads' last sync)
    rest       the step's other CPU time                (batch slicing, loss bookkeeping)
    comm wait  wall - CPU over the whole step           (blocked in wait() or a blocking collective)

Worked example: a DDP step of 100 ms wall whose main thread ran 88 ms: forward 30 ms, backward 45 ms
CPU (its span was 55 ms: 10 ms blocked on the last bucket's all-reduce), optimizer 12 ms, rest 1 ms:
``{"forward": .030, "backward": .045, "comm wait": .012, "optimizer": .012, "rest": .001}``, 100 ms.

The wait is what the thread did *not* run, the one measure that sees torch's C++ waits (DDP's Reducer)
as well as ours. Read it with two caveats: when ranks outnumber cores a runnable thread waits for a
core too (4 ranks on 2 cores), and on CUDA the main thread also blocks on kernels it synchronises with.

Memory traffic. ``trace.minor_faults()`` is the process's minor page faults so far (``getrusage``): a
fault per 4 KiB page the process touches for the first time, so a block the allocator maps and unmaps
every step (glibc serves blocks above its mmap threshold that way, PLATFORM-NOTES.md) costs
size/4 KiB faults every step, and a reused buffer none. ``size_classes`` bins what the memory tracker
saw allocated (``MemoryTracker.take_allocations``) by glibc's thresholds: below 128 KiB (the heap),
128 KiB - 32 MiB (mapped until glibc raises its threshold past them), 32 MiB and up (always mapped).

Read first: ``trace.py`` (spans), ``memory.py`` (the tracker's allocation log); used by ``train.py``
(faults and allocations per step) and ``bench.py`` (``--phases``).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from .trace import COMPUTE, Span, Trace

PHASES = ("forward", "backward", "comm wait", "optimizer", "rest")
# span name -> the phase its own (exclusive) CPU time counts in
PHASE_OF_SPAN = {"forward": "forward", "backward": "backward", "backward_input": "backward",
                 "backward_weight": "backward", "forward_backward": "backward", "optimizer": "optimizer"}
KiB, MiB = 1 << 10, 1 << 20
# glibc: blocks from its mmap threshold up are mapped (128 KiB at start, raised up to 32 MiB on 64-bit
# as large mapped blocks are freed: DEFAULT_MMAP_THRESHOLD_MAX); smaller ones come from the heap.
SIZE_CLASSES = ((128 * KiB, "< 128 KiB"), (32 * MiB, "128 KiB - 32 MiB"), (None, ">= 32 MiB"))


def size_class(nbytes: int) -> str:
    return next(name for limit, name in SIZE_CLASSES if limit is None or nbytes < limit)


def size_classes(allocations: Sequence[tuple[int, str]]) -> dict[str, int]:
    """Bytes allocated per size class: ``[(4096, "activations"), (1 << 20, "comm")]`` ->
    ``{"< 128 KiB": 4096, "128 KiB - 32 MiB": 1048576, ">= 32 MiB": 0}``."""
    out = {name: 0 for _, name in SIZE_CLASSES}
    for nbytes, _ in allocations:
        out[size_class(nbytes)] += nbytes
    return out


# --------------------------------------------------------------------------
# One step's phases from a trace
# --------------------------------------------------------------------------

def _exclusive(spans: list[Span]) -> list[tuple[Span, float]]:
    """Each phase span with its CPU seconds less those of phase spans nested inside it (spans of one
    thread nest properly: a pipeline's "forward" inside its "forward_backward")."""
    ordered = sorted(spans, key=lambda s: (s.start, -s.end))
    own = {id(s): s.cpu or 0.0 for s in ordered}
    stack: list[Span] = []
    for s in ordered:
        while stack and stack[-1].end <= s.start:
            stack.pop()
        if stack and s.end <= stack[-1].end:  # the innermost span around s pays it back
            own[id(stack[-1])] -= s.cpu or 0.0
        stack.append(s)
    return [(s, own[id(s)]) for s in ordered]


def _steps(tr: Trace) -> list[Span]:
    return sorted((s for s in tr.spans if s.kind == COMPUTE and s.name == "step"), key=lambda s: s.start)


def step_phases(tr: Trace) -> list[dict[str, float]]:
    """Per "step" span of a rank's trace, in order: seconds per phase, adding up to the step's wall time.
    Empty for a trace without CPU times (recorded before spans had them)."""
    steps = _steps(tr)
    if any(s.cpu is None for s in steps):
        return []
    rows = []
    for st in steps:
        inside = [s for s in tr.spans if s.kind == COMPUTE and s.name in PHASE_OF_SPAN
                  and st.start <= s.start and s.end <= st.end]
        row = dict.fromkeys(PHASES, 0.0)
        for s, own in _exclusive(inside):
            row[PHASE_OF_SPAN[s.name]] += own
        row["comm wait"] = st.duration - st.cpu
        row["rest"] = st.cpu - row["forward"] - row["backward"] - row["optimizer"]
        rows.append(row)
    return rows


def step_faults(tr: Trace) -> list[int | None]:
    """Minor page faults of each "step" span of a rank's trace, in order (the process's, all threads)."""
    return [s.faults for s in _steps(tr)]


def median_over_steps(per_rank: Sequence[Sequence[float]], warmup: int = 0,
                      combine: Callable[[Sequence[float]], float] = statistics.fmean) -> float:
    """The median over steps after ``warmup`` of ``combine`` (the mean; bench's step time: max) of the
    ranks' values for that step: ``[[10, 3, 5], [20, 5, 7]]``, warmup 1 -> median(4, 6) = 5."""
    steps = list(zip(*per_rank))
    return statistics.median(combine(values) for values in steps[warmup:] or steps)


def median_phases(per_rank: Sequence[Sequence[dict[str, float]]], warmup: int = 0) -> dict[str, float]:
    """``median_over_steps`` of each phase: ``per_rank`` holds each rank's ``step_phases`` (train's
    metrics["phases"]); {} if a rank has none."""
    if not per_rank or not all(per_rank):
        return {}
    return {p: median_over_steps([[row[p] for row in rows] for rows in per_rank], warmup) for p in PHASES}


def median_faults(faults_by_rank: Sequence[Sequence[int | None]], warmup: int = 0) -> float | None:
    """Minor page faults per step (``median_over_steps``); None without getrusage."""
    if not faults_by_rank or any(f is None for r in faults_by_rank for f in r):
        return None
    return median_over_steps(faults_by_rank, warmup)


def table(rows: list[dict[str, Any]]) -> str:
    """bench's --phases table: per world size and side, ms per phase (they add up to the step), page
    faults per step and MiB allocated per step by size class."""
    classes = [name for _, name in SIZE_CLASSES]
    lines = ["| world | side | step ms | " + " | ".join(f"{p} ms" for p in PHASES) + " | page faults / step | "
             + " | ".join(f"MiB alloc. {c}" for c in classes) + " |",
             "|" + "---|" * (4 + len(PHASES) + len(classes))]
    for r in rows:
        ph, alloc = r["phases"], r.get("allocated") or {}
        faults = "-" if r.get("faults") is None else f"{r['faults']:.0f}"
        lines.append(f"| {r['world_size']} | {r['side']} | {sum(ph.values()) * 1e3:.1f} | "
                     + " | ".join(f"{ph[p] * 1e3:.1f}" for p in PHASES) + f" | {faults} | "
                     + " | ".join("-" if c not in alloc else f"{alloc[c] / MiB:.2f}" for c in classes) + " |")
    return "\n".join(lines)
