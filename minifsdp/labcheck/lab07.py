"""Checks of lab 07 (pipeline parallel): the learner's 1F1B, interleaved and zero-bubble plans,
and the executor that runs a plan on real ranks.

A plan is checked the way the library checks its own: ``minifsdp.pipeline.validate``
(every forward before its backward, every message received, no deadlock), then its
bubble on the paper timeline against the formula, then the activations each rank holds
at its peak. The executor runs on 2 ranks (CPU ranks where the machine has fewer GPUs)
and is held to one process's gradients and losses, and to 1F1B's memory below GPipe's.

Whose code ran: each check refuses the library's implementation of the exercise in any
form (``verdict.refuse_library`` statically, a ``Wire`` at run time, in this process for
the plans and inside the workers for the executor): ``make_plan`` and the schedule
functions it dispatches to, ``Plan`` objects, the library's executor and stage. A plan
the library made and the notebook kept (returned, or read from a notebook global) is
refused too. ``check.hint(name)`` gives the exercises' hints, one at a time. Read
``verdict.py`` first.
"""
from __future__ import annotations

import dis
from typing import Any, Callable

from .. import estimate as _estimate
from .. import pipeline as _pipeline
from ..pipeline import executor as _executor
from ..pipeline import schedules as _schedules
from .authorship import code_objects, learner_owned
from .verdict import CheckFailed, Hints, Wire, call, failed, figures, passed, require_own, watched

__all__ = ["one_f_one_b", "interleaved", "zero_bubble", "executor", "hint"]

SIZES = ((2, 1), (2, 4), (3, 5), (4, 4), (4, 8))  # (p, m), m < p included
SIZES_V = ((2, 2, 2), (2, 6, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3), (4, 8, 3))  # (p, m, v), p divides m

# The library's implementation of each exercise (refused statically and at run time).
_SCHEDULE_LIBRARY = (_schedules.make_plan, _schedules.gpipe, _schedules.one_f_one_b, _schedules.interleaved_1f1b,
                     _schedules._interleaved, _schedules.zero_bubble, _pipeline.Plan)
_EXECUTOR_LIBRARY = (_executor.PipelineSchedule, _executor.ScheduleFromPlan, _executor.ScheduleGPipe,
                     _executor.Schedule1F1B, _executor.ScheduleInterleaved1F1B,
                     _executor.ScheduleInterleavedZeroBubble, _pipeline.PipelineStage, _pipeline.PipelineParallel,
                     *_SCHEDULE_LIBRARY)

hint = Hints({
    "my_1f1b": [
        "1F1B frees activations early: a rank runs forwards only until a gradient could have come back to it, "
        "then pairs each forward with a backward, then finishes the backwards it still owes.",
        "Warm-up length: before rank r can run a backward, micro-batch 0 must pass the stages after r and its "
        "gradient come back. How many of rank r's forwards fit in that wait? Never more than m.",
        "Layout: the warm-up forwards; then, for each micro-batch not yet started, its forward and the backward "
        "of the oldest unfinished one; then the backwards left, oldest first.",
    ],
    "my_run_plan": [
        "Each action kind is one small step: receive into a fresh buffer, compute, or send. Keep, per "
        "micro-batch, what a later action needs: its input, its output, the gradient received for it.",
        "Autograd must reach the received activation: make it a leaf that requires grad, so that after the "
        "backward its .grad is the gradient to send upstream.",
        "The last rank's forward ends in the loss (keep a detached copy to return) and its backward starts from "
        "that loss; elsewhere backward starts from the output and the gradient received for it.",
        "At the end: wait for the sends, and make the step's gradient the batch's mean, not the sum over "
        "micro-batches. For memory, drop a micro-batch's tensors once its backward and SEND_B have run.",
    ],
    "my_interleaved": [
        "Write down, for rank r, the order of its v*m forwards and of its v*m backwards as two lists; then pace "
        "them as 1F1B does: a warm-up of forwards, one forward / one backward, a cool-down.",
        "Depth first: micro-batches go in rounds of p. A round runs on chunk 0, then the same round on chunk 1, "
        "and so on; then the next round. Backwards take the same rounds with the chunks from the last.",
        "Warm-up: the rank's forwards of the first round on its other chunks, plus the forwards that fit while "
        "the first gradient travels from the last rank back to rank r (there and back). Too short shows as a "
        "backward before its forward.",
    ],
    "my_zero_bubble": [
        "Take 1F1B's order with each B replaced by its I: the previous stage waits for I. Every W is still owed, "
        "and nobody waits for it: it can go wherever the rank would otherwise sit idle.",
        "Where does a rank idle in 1F1B? In the cool-down it waits for each gradient from downstream; the last "
        "rank never waits, and the more stages after a rank, the longer it waits.",
        "Keep W's in hand: rank r can run each W some I's late and the last ones at the very end. How many "
        "should rank r hold back, without holding more than p micro-batches at once?",
    ],
})


# ------------------------------------------------------------------ whose plan is it?
def _holds_library_data(value: Any, depth: int = 0) -> bool:
    """A plan, timeline or action the library made, alone or in a container (a few levels deep)."""
    if isinstance(value, (_pipeline.Plan, _pipeline.Timeline, _pipeline.Action)):
        return True
    if depth >= 3 or isinstance(value, (str, bytes)):
        return False
    if isinstance(value, dict):
        items = list(value.keys()) + list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        return False
    return any(_holds_library_data(v, depth + 1) for v in items[:64])


def _library_data_read(fn: Any) -> str | None:
    """The notebook global (read by ``fn`` or a helper of it) that holds plans the library made, if any."""
    seen: set[int] = set()
    todo = [getattr(fn, "__wrapped__", fn)]
    while todo:
        f = todo.pop()
        f = getattr(f, "__func__", f)
        code = getattr(f, "__code__", None)
        if code is None or id(f) in seen:
            continue
        seen.add(id(f))
        scope = getattr(f, "__globals__", {})
        names = {ins.argval for c in code_objects(code) for ins in dis.get_instructions(c)
                 if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str)}
        values = [(name, scope[name]) for name in sorted(names) if name in scope]
        values += [("a closure variable", c.cell_contents) for c in (f.__closure__ or ())
                   if not _empty_cell(c)]
        values += [("a default argument", d) for d in (f.__defaults__ or ())]
        for name, value in values:
            if _holds_library_data(value):
                return name
            if callable(value) and learner_owned(value):
                todo.append(value)
    return None


def _empty_cell(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return True
    return False


def _refuse(what: str, fn: Callable, library: tuple) -> None:
    """Not written yet, or the library's: one sentence either way."""
    require_own(what, library, fn)
    name = _library_data_read(fn)
    if name is not None:
        failed(what, f"your code reads {name}, which holds plans the library made: build the plan in your "
                     "function, without minifsdp's implementation of it")


def _plan(what: str, fn: Callable, p: int, m: int, v: int = 1) -> _pipeline.Plan:
    """The learner's plan for (p, m[, v]), run under a wire on the library's schedule makers."""
    order = call(what, watched(fn, *_SCHEDULE_LIBRARY), p, m, *((v,) if v > 1 else ()))
    if isinstance(order, _pipeline.Plan):
        failed(what, "it returned a Plan, an object of the library's: return a dict {rank: [action strings]} "
                     "that your code builds")
    if not isinstance(order, dict) or sorted(order) != list(range(p)):
        failed(what, f"for p={p}, m={m} it returned {type(order).__name__}"
                     f"{'' if not isinstance(order, dict) else ' with keys ' + str(sorted(order))}: "
                     f"return a dict {{rank: [actions]}} with ranks 0..{p - 1}")
    for r, acts in order.items():
        if not isinstance(acts, (list, tuple)):
            failed(what, f"p={p}, m={m}: rank {r}'s actions are a {type(acts).__name__}: return a list of strings "
                         "such as \"0F1\"")
        odd = next((a for a in acts if not isinstance(a, str)), None)
        if odd is not None:
            made = " (the library's type, as in a plan it made)" if isinstance(odd, _pipeline.Action) else ""
            failed(what, f"p={p}, m={m}: rank {r}'s actions include {type(odd).__name__} objects{made}: return a "
                         "list of strings such as \"0F1\" that your code builds")
    try:
        parsed = {r: [_pipeline.Action.parse(a) for a in acts] for r, acts in order.items()}
    except ValueError as err:
        failed(what, f"p={p}, m={m}: {err}")
    return _pipeline.Plan("yours", p, m, v, parsed)


def _validated(what: str, plan: _pipeline.Plan) -> _pipeline.Timeline:
    try:
        return _pipeline.validate(plan)
    except _pipeline.ScheduleError as err:
        failed(what, f"p={plan.p}, m={plan.m}{f', v={plan.v}' if plan.v > 1 else ''}: {err.problems[0]}")
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ 1F1B as data
def one_f_one_b(fn: Callable) -> None:
    """``fn(p, m)`` returns {rank: [actions]} for 1F1B; valid, formula bubble, at most p - r held."""
    what = "1F1B plan"
    _refuse(what, fn, _SCHEDULE_LIBRARY)
    for p, m in SIZES:
        plan = _plan(what, fn, p, m)
        if any(a.kind in ("I", "W") for acts in plan.order.values() for a in acts):
            failed(what, "1F1B runs whole backwards (B); I and W belong to the zero-bubble exercise")
        tl = _validated(what, plan)
        formula = _estimate.pipeline_bubble_fraction(p, m)
        if abs(tl.bubble - formula) > 1e-9:
            failed(what, f"p={p}, m={m}: bubble {tl.bubble:.1%} but (p-1)/(m+p-1) = {formula:.1%}: some rank waits "
                         "longer than it must (print validate(plan).table() to see where)")
        for r, held in tl.peak_activations.items():
            if held > min(m, p - r):
                failed(what, f"p={p}, m={m}: rank {r} holds {held:g} micro-batches at once, 1F1B at most "
                             f"p - r = {min(m, p - r)}: after the warm-up, each forward must be followed by "
                             "the backward of the oldest micro-batch in flight")
    tl = _validated(what, _plan(what, fn, 4, 8))
    passed(what, f"valid for {len(SIZES)} (p, m) pairs, m < p included; p=4, m=8: "
           + figures("bubble", f"{tl.bubble:.1%}", f"{_estimate.pipeline_bubble_fraction(4, 8):.1%}",
                     f"{_schedules.one_f_one_b(4, 8).bubble():.1%}")
           + f"; rank 0 holds {tl.peak_activations[0]:g} micro-batches (GPipe: 8)")


# ------------------------------------------------------------------ interleaved 1F1B
def interleaved(fn: Callable) -> None:
    """``fn(p, m, v)``: rank r runs stages r, r+p, ...; valid, bubble (p-1)/(v*m+p-1), memory within the library's."""
    what = "interleaved 1F1B plan"
    _refuse(what, fn, _SCHEDULE_LIBRARY)
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
        formula = _estimate.pipeline_bubble_fraction(p, m, v)
        if abs(tl.bubble - formula) > 1e-9:
            failed(what, f"p={p}, m={m}, v={v}: bubble {tl.bubble:.1%} but (p-1)/(v*m+p-1) = {formula:.1%}: some "
                         "rank waits longer than it must (too short a warm-up stalls on gradients, too long "
                         "holds forwards back); print validate(plan).table() to see where")
        library = _schedules.interleaved_1f1b(p, m, v).peak_activations()
        for r, held in tl.peak_activations.items():
            if held > library[r] + 1e-9:
                failed(what, f"p={p}, m={m}, v={v}: rank {r} holds {held:g} micro-batches' worth of its layers at "
                             f"once, the library's plan {library[r]:g}: go depth first (a round of p micro-batches "
                             "through every stage of the rank before the next round), and start backwards as soon "
                             "as the first gradient can be back")
    tl = _validated(what, _plan(what, fn, 4, 8, 2))
    lib = _schedules.interleaved_1f1b(4, 8, 2)
    passed(what, f"valid for {len(SIZES_V)} (p, m, v); p=4, m=8, v=2: "
           + figures("bubble", f"{tl.bubble:.1%}", f"{_estimate.pipeline_bubble_fraction(4, 8, 2):.1%}",
                     f"{lib.bubble():.1%}")
           + f" (1F1B {_schedules.one_f_one_b(4, 8).bubble():.1%}); rank 0 holds {tl.peak_activations[0]:g} "
             f"micro-batches' worth (library {lib.peak_activations()[0]:g})")


# ------------------------------------------------------------------ zero bubble
def zero_bubble(fn: Callable) -> None:
    """``fn(p, m)``: I/W split; valid; bubble below 1F1B's and, for m >= p, at ZB-H1's (p-1)/(3m+p-1);
    no rank above 1F1B's peak (p)."""
    what = "zero-bubble plan"
    _refuse(what, fn, _SCHEDULE_LIBRARY)
    best = None
    for p, m in SIZES:
        plan = _plan(what, fn, p, m)
        kinds = {a.kind for acts in plan.order.values() for a in acts}
        if "B" in kinds or not {"I", "W"} <= kinds:
            failed(what, "split every backward B into I (input gradient) and W (weight gradient): "
                         f"your plan has {sorted(kinds)}")
        tl = _validated(what, plan)
        base, target = _schedules.one_f_one_b(p, m).bubble(), (p - 1) / (3 * m + p - 1)
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
    passed(what, "valid, I/W split, memory within 1F1B's, on target for every m >= p; p=4, m=8: "
           + figures("bubble", f"{best:.1%}", f"{target:.1%} (p-1)/(3m+p-1)",
                     f"{_schedules.zero_bubble(4, 8).bubble():.1%}")
           + f" (1F1B {_schedules.one_f_one_b(4, 8).bubble():.1%})")


# ------------------------------------------------------------------ an executor
_M, _BATCH, _SEQ, _WORLD = 4, 16, 32, 2


def _run_executor(fn: Callable) -> dict[str, tuple]:
    """On each rank: the learner's executor runs 1F1B and GPipe (m = 4) on its part of gpt-tiny, under a wire."""
    import torch

    from .. import data, dist, models
    from ..memory import MemoryTracker

    rank, p = dist.rank(), dist.world_size()
    x, y = (t.to(dist.device()) for t in data.get_batch(0, _BATCH, _SEQ))
    out = {}
    for name in ("1f1b", "gpipe"):
        part = _pipeline.split_gpt(models.build_model("gpt-tiny", seed=0).to(dist.device()), p)[rank]
        actions = _schedules.make_plan(name, p, _M).with_comms().order[rank]
        tracker = MemoryTracker()
        tracker.track_model(part)
        with tracker, Wire(*_EXECUTOR_LIBRARY):
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
    from .verdict import run

    what = "pipeline executor"
    _refuse(what, fn, _EXECUTOR_LIBRARY)
    try:
        results = run(what, _run_executor, _WORLD, fn, timeout=90)
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
                want = ref_grads[n].grad
                err = ((g - want).norm() / want.norm()).item()
                if err > 1e-5:
                    scale = (torch.dot(g.flatten(), want.flatten()) / torch.dot(want.flatten(), want.flatten())).item()
                    if abs(scale - _M) < 1e-3 * _M:
                        failed(what, f"{name}: rank {rank}'s gradients are {_M} times one process's: each "
                                     f"micro-batch's loss is a mean over its own {_M}th of the batch, so the sum "
                                     f"of the {_M} backwards is {_M} times the batch's gradient")
                    failed(what, f"{name}: rank {rank}'s {n} differs from one process's gradient by {err:.1e} "
                                 "(relative): each micro-batch's backward must start from its own output "
                                 "and the gradient received for that same micro-batch")
                worst = max(worst, err)
            if rank == _WORLD - 1 and (len(losses) != _M
                                       or any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(losses, ref_losses))):
                failed(what, f"{name}: the last rank returned losses {losses}, one process gives {ref_losses} "
                             f"for the {_M} micro-batches in order")
    one, gp = results[0]["1f1b"][2], results[0]["gpipe"][2]
    if one >= 0.9 * gp:
        failed(what, f"rank 0's activations peak at {one / 2**20:.2f} MiB under 1F1B and {gp / 2**20:.2f} MiB under "
                     "GPipe: 1F1B holds 2 micro-batches, not 4, only if each B runs where the plan puts it and frees its "
                     "micro-batch's saved activations (no retain_graph, no graph kept alive after its backward)")
    passed(what, f"gradients equal one process's on {_WORLD} ranks (largest relative difference {worst:.1e}); "
           "rank 0 peak activations " + figures("1F1B", f"{one / 2**20:.2f}", f"< 0.9 x GPipe's {gp / 2**20:.2f}",
                                                 unit="MiB"))
