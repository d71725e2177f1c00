"""Checks of lab 07 (pipeline parallel): the learner's 1F1B, interleaved and zero-bubble plans,
their executor, and their measured bubble.

A plan is checked the way the library checks its own: ``minifsdp.pipeline.validate``
(every forward before its backward, every message received, no deadlock), then its
bubble on the paper timeline against the formula, then the activations each rank holds
at its peak. The measured-bubble exercise gets hand-made traces whose answer is
known exactly, with the spans a careless sum would count (a ``step`` span around
everything, the ``recv`` that waited). Read ``verdict.py`` first.
"""
from __future__ import annotations

from typing import Any, Callable

from .. import estimate, pipeline, trace
from .verdict import CheckFailed, call, failed, figures, is_library, passed, require_written

__all__ = ["one_f_one_b", "interleaved", "zero_bubble", "measured_bubble", "executor"]

SIZES = ((2, 1), (2, 4), (3, 5), (4, 4), (4, 8))  # (p, m), m < p included
SIZES_V = ((2, 2, 2), (2, 6, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (4, 8, 3))  # (p, m, v), p divides m


def _plan(what: str, fn: Callable, p: int, m: int, v: int = 1) -> pipeline.Plan:
    order = call(what, fn, p, m, *((v,) if v > 1 else ()))
    if isinstance(order, pipeline.Plan):
        order = order.order
    if not isinstance(order, dict) or sorted(order) != list(range(p)):
        failed(what, f"for p={p}, m={m} it returned {type(order).__name__}"
                     f"{'' if not isinstance(order, dict) else ' with keys ' + str(sorted(order))}: "
                     f"return a dict {{rank: [actions]}} with ranks 0..{p - 1}")
    try:
        parsed = {r: [a if isinstance(a, pipeline.Action) else pipeline.Action.parse(str(a)) for a in acts]
                  for r, acts in order.items()}
    except ValueError as err:
        failed(what, f"p={p}, m={m}: {err}")
    return pipeline.Plan("yours", p, m, v, parsed)


def _validated(what: str, plan: pipeline.Plan) -> pipeline.Timeline:
    try:
        return pipeline.validate(plan)
    except pipeline.ScheduleError as err:
        failed(what, f"p={plan.p}, m={plan.m}{f', v={plan.v}' if plan.v > 1 else ''}: {err.problems[0]}")
    raise AssertionError("unreachable")


def _library(what: str, fn: Any, *library: Any) -> None:
    if is_library(fn, *library):
        failed(what, "that is the library's schedule (minifsdp.pipeline): write the plan yourself")


# ------------------------------------------------------------------ 1F1B as data
def one_f_one_b(fn: Callable) -> None:
    """``fn(p, m)`` returns {rank: [actions]} for 1F1B; valid, formula bubble, at most p - r held."""
    what = "1F1B plan"
    require_written(what, fn)
    _library(what, fn, pipeline.one_f_one_b, pipeline.make_plan)
    for p, m in SIZES:
        plan = _plan(what, fn, p, m)
        if any(a.kind in ("I", "W") for acts in plan.order.values() for a in acts):
            failed(what, "1F1B runs whole backwards (B); I and W belong to the zero-bubble exercise")
        tl = _validated(what, plan)
        formula = estimate.pipeline_bubble_fraction(p, m)
        if abs(tl.bubble - formula) > 1e-9:
            failed(what, f"p={p}, m={m}: bubble {tl.bubble:.1%} but (p-1)/(m+p-1) = {formula:.1%}: some rank waits "
                         "longer than it must; compare your table with the library's")
        for r, held in tl.peak_activations.items():
            if held > min(m, p - r):
                failed(what, f"p={p}, m={m}: rank {r} holds {held:g} micro-batches at once, 1F1B at most "
                             f"p - r = {min(m, p - r)}: after the warm-up, each forward must be followed by "
                             "the backward of the oldest micro-batch in flight")
    tl = _validated(what, _plan(what, fn, 4, 8))
    passed(what, f"valid for {len(SIZES)} (p, m) pairs, m < p included; p=4, m=8: "
           + figures("bubble", f"{tl.bubble:.1%}", f"{estimate.pipeline_bubble_fraction(4, 8):.1%}",
                     f"{pipeline.one_f_one_b(4, 8).bubble():.1%}")
           + f"; rank 0 holds {tl.peak_activations[0]:g} micro-batches (GPipe: 8)")


# ------------------------------------------------------------------ interleaved 1F1B
def interleaved(fn: Callable) -> None:
    """``fn(p, m, v)``: rank r runs stages r, r+p, ...; valid, bubble (p-1)/(v*m+p-1), memory within the library's."""
    what = "interleaved 1F1B plan"
    require_written(what, fn)
    _library(what, fn, pipeline.interleaved_1f1b, pipeline.make_plan)
    for p, m, v in SIZES_V:
        plan = _plan(what, fn, p, m, v)
        if any(a.kind in ("I", "W") for acts in plan.order.values() for a in acts):
            failed(what, "interleaved 1F1B runs whole backwards (B); I and W belong to the zero-bubble exercise")
        for r, acts in plan.order.items():
            first = next((a for a in acts if a.kind == "B"), None)
            if first is not None and first.stage != r + (v - 1) * p:
                failed(what, f"p={p}, m={m}, v={v}: rank {r}'s first backward is {first}, but the first gradient to "
                             f"reach rank {r} is for its last stage, {r + (v - 1) * p}: backwards walk the chunks in "
                             "reverse")
        tl = _validated(what, plan)
        formula = estimate.pipeline_bubble_fraction(p, m, v)
        if abs(tl.bubble - formula) > 1e-9:
            failed(what, f"p={p}, m={m}, v={v}: bubble {tl.bubble:.1%} but (p-1)/(v*m+p-1) = {formula:.1%}: some "
                         "rank waits longer than it must (too short a warm-up stalls on gradients, too long "
                         "holds forwards back); compare your table with the library's")
        library = pipeline.interleaved_1f1b(p, m, v).peak_activations()
        for r, held in tl.peak_activations.items():
            if held > library[r] + 1e-9:
                failed(what, f"p={p}, m={m}, v={v}: rank {r} holds {held:g} micro-batches' worth of its layers at "
                             f"once, the library's plan {library[r]:g}: go depth first (a round of p micro-batches "
                             "through every stage of the rank before the next round), and start backwards as soon "
                             "as the first gradient can be back")
    tl = _validated(what, _plan(what, fn, 4, 8, 2))
    lib = pipeline.interleaved_1f1b(4, 8, 2)
    passed(what, f"valid for {len(SIZES_V)} (p, m, v); p=4, m=8, v=2: "
           + figures("bubble", f"{tl.bubble:.1%}", f"{estimate.pipeline_bubble_fraction(4, 8, 2):.1%}",
                     f"{lib.bubble():.1%}")
           + f" (1F1B {pipeline.one_f_one_b(4, 8).bubble():.1%}); rank 0 holds {tl.peak_activations[0]:g} "
             f"micro-batches' worth (library {lib.peak_activations()[0]:g})")


# ------------------------------------------------------------------ zero bubble
def zero_bubble(fn: Callable) -> None:
    """``fn(p, m)``: I/W split; valid; bubble below 1F1B's and, for m >= p, at ZB-H1's (p-1)/(3m+p-1);
    no rank above 1F1B's peak (p)."""
    what = "zero-bubble plan"
    require_written(what, fn)
    _library(what, fn, pipeline.zero_bubble, pipeline.make_plan)
    best = None
    for p, m in SIZES:
        plan = _plan(what, fn, p, m)
        kinds = {a.kind for acts in plan.order.values() for a in acts}
        if "B" in kinds or not {"I", "W"} <= kinds:
            failed(what, "split every backward B into I (input gradient) and W (weight gradient): "
                         f"your plan has {sorted(kinds)}")
        tl = _validated(what, plan)
        base, target = pipeline.one_f_one_b(p, m).bubble(), (p - 1) / (3 * m + p - 1)
        if tl.bubble >= base - 1e-9 and p > 1:
            failed(what, f"p={p}, m={m}: bubble {tl.bubble:.1%}, no better than 1F1B's {base:.1%}: nobody waits "
                         "for W, so move it to where the rank would idle")
        if m >= p and tl.bubble > target + 1e-9:
            failed(what, f"p={p}, m={m}: bubble {tl.bubble:.1%} (1F1B {base:.1%}), target (p-1)/(3m+p-1) = "
                         f"{target:.1%}: a W right after its I fills no idle slot; keep W's in hand for the "
                         "cool-down, where a rank waits for each I from downstream")
        if max(tl.peak_activations.values()) > min(m, p):
            r = max(tl.peak_activations, key=tl.peak_activations.get)
            failed(what, f"p={p}, m={m}: rank {r} holds {tl.peak_activations[r]:g} micro-batches (a micro-batch is "
                         f"freed by its W), more than 1F1B's most ({min(m, p)}): run W's sooner")
        if (p, m) == (4, 8):
            best = tl.bubble
    target = 3 / (3 * 8 + 3)
    passed(what, f"valid, I/W split, memory within 1F1B's, on target for every m >= p; p=4, m=8: "
           + figures("bubble", f"{best:.1%}", f"{target:.1%} (p-1)/(3m+p-1)", f"{pipeline.zero_bubble(4, 8).bubble():.1%}")
           + f" (1F1B {pipeline.one_f_one_b(4, 8).bubble():.1%})")


# ------------------------------------------------------------------ measured bubble
def _fake_traces() -> tuple[list[trace.Trace], float]:
    """Two ranks, times in seconds; the answer by hand: window 0..10 s on 2 ranks = 20, busy 4 + 6."""
    def span(name: str, start: float, end: float, kind: str = trace.COMPUTE, **args: Any) -> trace.Span:
        return trace.Span(name, kind, start, end, args)
    r0 = trace.Trace(rank=0, spans=[
        span("step", -1.0, 11.0),                                   # the trainer's span around everything
        span("forward", 0.0, 1.0, action="0F0"), span("forward", 1.0, 2.0, action="0F1"),
        span("recv", 2.0, 8.0, trace.COMM),                         # waiting is idle
        span("backward", 8.0, 10.0, action="0B0")])
    r1 = trace.Trace(rank=1, spans=[
        span("recv", 0.0, 1.0, trace.COMM),
        span("forward", 1.0, 2.0, action="1F0"), span("forward", 2.0, 3.0, action="1F1"),
        span("backward", 3.0, 5.0, action="1B0"), span("backward", 5.0, 7.0, action="1B1")])
    return [r0, r1], (20.0 - 10.0) / 20.0


def measured_bubble(fn: Callable) -> None:
    """``fn(traces)``: idle fraction of rank-time between the first and last pipeline compute span."""
    what = "measured bubble"
    require_written(what, fn)
    _library(what, fn, pipeline.measured_bubble)
    traces, want = _fake_traces()
    got = call(what, fn, traces)
    if not isinstance(got, (int, float)):
        failed(what, f"it returned {type(got).__name__}: return a fraction (a float between 0 and 1)")
    if abs(got - want) > 1e-9:
        hints = {  # what the usual slips give on these traces
            1 - 22.0 / 24.0: "the trainer's 'step' span is not pipeline work: count only forward / backward spans",
            1 - 17.0 / 20.0: "a rank waiting in recv is idle: communication spans are not work",
            1 - 10.0 / 10.0: "divide by the window times the number of ranks",
        }
        hint = next((h for v, h in hints.items() if abs(got - v) < 1e-6),
                    "busy = the sum of the forward/backward span durations of every rank; "
                    "total = (last end - first start) x ranks")
        failed(what, f"on two hand-made traces it gives {got:.3f}, the answer is {want:.3f}: {hint}")
    passed(what, figures("hand-made traces", f"{got:.3f}", f"{want:.3f}"))


# ------------------------------------------------------------------ an executor
_LIBRARY_RUNTIME = ("ScheduleFromPlan", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "forward_one_chunk",
                    "backward_one_chunk")
_M, _BATCH, _SEQ = 4, 16, 32


def _run_executor(fn: Callable) -> dict[str, tuple]:
    """On each of 2 ranks: the learner's executor runs 1F1B and GPipe (m = 4) on half of gpt-tiny."""
    import torch

    from .. import data, dist, models
    from ..memory import MemoryTracker

    rank, p = dist.rank(), dist.world_size()
    x, y = (t.to(dist.device()) for t in data.get_batch(0, _BATCH, _SEQ))
    out = {}
    for name in ("1f1b", "gpipe"):
        part = pipeline.split_gpt(models.build_model("gpt-tiny", seed=0).to(dist.device()), p)[rank]
        actions = pipeline.make_plan(name, p, _M).with_comms().order[rank]
        tracker = MemoryTracker()
        tracker.track_model(part)
        with tracker:
            losses = fn(part, actions, x, y, _M)
        grads = {n: None if q.grad is None else q.grad.cpu() for n, q in part.named_parameters()}
        out[name] = ([float(v) for v in losses or []], grads, tracker.peak_by_category["activations"])
        del part, tracker
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def executor(fn: Callable) -> None:
    """``fn(stage_module, actions, x, y, m)`` runs one rank's lowered plan: one-process gradients and
    losses, and 1F1B's activation memory below GPipe's."""
    import torch

    from .. import data, models
    from .verdict import run, uses

    what = "pipeline executor"
    require_written(what, fn)
    found = uses(fn, *_LIBRARY_RUNTIME)
    if found:
        failed(what, f"it calls {found[0]}, the library's runtime: run the actions yourself with comm.recv / "
                     "comm.isend, the stage's forward and backward")
    try:
        results = run(what, _run_executor, 2, fn, timeout=90)
    except CheckFailed as err:
        if "Expected parameter `tensor`" in str(err) or "'NoneType'" in str(err):
            failed(what, f"{str(err).split(': ', 1)[1]} - a send got None: is each received activation a leaf "
                         "that requires grad, so that backward leaves its gradient in .grad?")
        raise
    ref = models.build_model("gpt-tiny", seed=0)
    x, y = data.get_batch(0, _BATCH, _SEQ)
    models.lm_loss(ref(x), y).backward()
    with torch.no_grad():
        ref_losses = [models.lm_loss(ref(xc), yc).item() for xc, yc in zip(x.chunk(_M), y.chunk(_M))]
    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    for rank, res in enumerate(results):
        for name, (losses, grads, _) in res.items():
            for n, g in grads.items():
                if g is None:
                    failed(what, f"{name}: rank {rank}'s {n} has no gradient: does every B run backward, from "
                                 "the loss on the last rank and from the received gradient elsewhere?")
                err = ((g - ref_grads[n].grad).norm() / ref_grads[n].grad.norm()).item()
                if err > 1e-5:
                    failed(what, f"{name}: rank {rank}'s {n} differs from one process's gradient by {err:.1e} "
                                 "(relative): each micro-batch's backward must start from its own output "
                                 "and the gradient received for that same micro-batch")
                worst = max(worst, err)
            if rank == 1 and (len(losses) != _M or any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(losses, ref_losses))):
                failed(what, f"{name}: the last rank returned losses {losses}, one process gives {ref_losses} "
                             "for the 4 micro-batches in order")
    one, gp = results[0]["1f1b"][2], results[0]["gpipe"][2]
    if one >= 0.9 * gp:
        failed(what, f"rank 0's activations peak at {one / 2**20:.2f} MiB under 1F1B and {gp / 2**20:.2f} MiB under "
                     "GPipe: 1F1B holds 2 micro-batches, not 4, only if the executor lets go of a micro-batch's "
                     "input and output once its backward and SEND_B have run")
    passed(what, f"gradients equal one process's (largest relative difference {worst:.1e}); rank 0 peak "
           "activations " + figures("1F1B", f"{one / 2**20:.2f}", f"< GPipe's {gp / 2**20:.2f}", unit="MiB"))
