"""The checks of lab 07 (minifsdp.labcheck.lab07) judge the learner's code.

Each check passes with the solution (solutions/src/07_pipeline_parallel.py, its
exercise cells exec'd as a notebook runs them), and fails with one sentence on
the blank lab, on typical mistakes (the solution with one small edit), and on
the library's own mechanism reached the ways a learner looking for a shortcut
would reach it: directly, through a notebook helper, an alias, a subclass, a name
built at run time (only the wire sees it), or a plan the library made and the
notebook kept.
"""
from __future__ import annotations

from typing import Callable

import pytest

from labcheck_helpers import fails, lab_tests, load, run_cell, shortcut_fails
from minifsdp import pipeline
from minifsdp.labcheck import lab07

L07 = "07_pipeline_parallel"

LONG_WARMUP = (("        w = min(p - 1 - r, m)\n        acts = [f\"{r}F{i}\" for i in range(w)]\n        for i",
                "        w = min(p - r, m)\n        acts = [f\"{r}F{i}\" for i in range(w)]\n        for i"),)
BACKWARD_FIRST = (("acts += [f\"{r}F{w + i}\", f\"{r}B{i}\"]", "acts += [f\"{r}B{i}\", f\"{r}F{w + i}\"]"),)
W_RIGHT_AFTER_I = (("acts += group + ([f\"{r}W{i - r}\"] if i >= r else [])", "acts += group + [f\"{r}W{i}\"]"),
                   ("acts += [f\"{r}W{i}\" for i in range(max(0, m - r), m)]", "pass"))
W_FORGOTTEN = (("acts += [f\"{r}W{i}\" for i in range(max(0, m - r), m)]", "pass"),)
NO_REVERSE = (("bwd = [f\"{r + (v - 1 - k) * p}B{i}\"", "bwd = [f\"{r + k * p}B{i}\""),)
BREADTH_FIRST = (("return j // p % v, j // (p * v) * p + j % p", "return j // m % v, j // (m * v) * m + j % m"),
                 ("w = min(v * m, (v - 1) * p + 2", "w = min(v * m, (v - 1) * m + 2"))
SHORT_WARMUP = (("w = min(v * m, (v - 1) * p + 2 * (p - 1 - r))", "w = min(v * m, p - 1 - r)"),)
NO_REQUIRES_GRAD = (("            inputs[i].requires_grad_()\n", ""),)
NO_LOSSES = (("                losses.append(out.detach())\n", ""),)
SUM_NOT_MEAN = (("        q.grad /= m\n", "        q.grad /= 1\n"),)
KEEPS_GRAPHS = (("outputs.pop(i).backward(grads.pop(i) if rank < p - 1 else None)",
                 "outputs[i].backward(grads.pop(i) if rank < p - 1 else None, retain_graph=True)"),)


CHECKS = [(lab07.one_f_one_b, ("my_1f1b",)), (lab07.executor, ("my_run_plan",)),
          (lab07.interleaved, ("my_interleaved",)), (lab07.zero_bubble, ("my_zero_bubble",))]
MISTAKES = (LONG_WARMUP, BACKWARD_FIRST, NO_REVERSE, BREADTH_FIRST, SHORT_WARMUP, W_RIGHT_AFTER_I, W_FORGOTTEN,
            NO_REQUIRES_GRAD, NO_LOSSES, SUM_NOT_MEAN, KEEPS_GRAPHS)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L07, CHECKS, MISTAKES, words=("yours", "target", "library"))


def shortcut(source: str, name: str) -> Callable:
    """A learner's shortcut, written in a notebook cell after the lab's exercises (exec'd as ``__main__``,
    so ``launch`` sends it to the workers by value)."""
    return run_cell(load(L07), source)[name]


KEPT_PLANS = """
    TABLE = {{(p, m): make_plan("{schedule}", p, m) for p in range(1, 5) for m in range(1, 9)}}
"""


# ------------------------------------------------------------------ exercise 1: 1F1B
def test_one_f_one_b_mistakes():
    fails(lab07.one_f_one_b, load(L07, edits=LONG_WARMUP)["my_1f1b"], words="1F1B at most p - r")
    fails(lab07.one_f_one_b, load(L07, edits=BACKWARD_FIRST)["my_1f1b"],
          words="a backward needs the activations its forward saved")
    fails(lab07.one_f_one_b, pipeline.one_f_one_b, words="library")


@pytest.mark.parametrize("source", [
    # the library's plan, directly
    """
    def my_1f1b(p, m):
        return {r: [str(a) for a in acts] for r, acts in make_plan("1f1b", p, m).order.items()}
    """,
    # through a notebook helper and an alias
    """
    from minifsdp.pipeline import one_f_one_b as textbook

    def helper(p, m):
        return textbook(p, m).order

    def my_1f1b(p, m):
        return {r: [f"{a.stage}{a.kind}{a.mb}" for a in acts] for r, acts in helper(p, m).items()}
    """,
    # a name built at run time: only the wire sees make_plan run
    """
    import importlib

    def my_1f1b(p, m):
        plan = getattr(importlib.import_module("minifsdp.pipeline"), "make_" + "plan")("1f1b", p, m)
        return {r: [str(a) for a in acts] for r, acts in plan.order.items()}
    """,
    # plans the library made before the check ran, kept in a notebook global
    KEPT_PLANS.format(schedule="1f1b") + """
    def my_1f1b(p, m):
        return {r: [str(a) for a in acts] for r, acts in TABLE[p, m].order.items()}
    """,
    # the same, found at run time, returned as the library's Plan
    KEPT_PLANS.format(schedule="1f1b") + """
    def my_1f1b(p, m):
        return globals()["TA" + "BLE"][p, m]
    """,
    # ... or as its actions
    KEPT_PLANS.format(schedule="1f1b") + """
    def my_1f1b(p, m):
        return globals()["TA" + "BLE"][p, m].order
    """,
], ids=["direct", "helper-alias", "runtime-name", "kept-plans", "returned-plan", "returned-actions"])
def test_one_f_one_b_library_shortcuts(source):
    shortcut_fails(lab07.one_f_one_b, shortcut(source, "my_1f1b"))


# ------------------------------------------------------------------ exercise 2: the executor
def test_executor_mistakes():
    fails(lab07.executor, load(L07, edits=NO_REQUIRES_GRAD)["my_run_plan"], words="requires grad")
    fails(lab07.executor, load(L07, edits=NO_LOSSES)["my_run_plan"], words="the last rank returned losses []")
    fails(lab07.executor, load(L07, edits=SUM_NOT_MEAN)["my_run_plan"], words="4 times one process's")
    fails(lab07.executor, load(L07, edits=KEEPS_GRAPHS)["my_run_plan"], words="frees its micro-batch's saved activations")


@pytest.mark.parametrize("source", [
    # the library's executor through a notebook helper
    """
    def library_step(stage_module, actions, x, y):
        rank, p = dist.rank(), dist.world_size()
        stage = PipelineStage(stage_module, rank, p, dist.device())
        losses = []
        ScheduleFromPlan([stage], {rank: list(actions)}, loss_fn=models.lm_loss).step(
            *((x,) if rank == 0 else ()), **({"target": y, "losses": losses} if rank == p - 1 else {}))
        return losses

    def my_run_plan(stage_module, actions, x, y, m):
        return library_step(stage_module, actions, x, y)
    """,
    # a subclass calling super().__init__
    """
    class MySchedule(ScheduleFromPlan):
        def __init__(self, stages, plan):
            super().__init__(stages, plan, loss_fn=models.lm_loss)

    def my_run_plan(stage_module, actions, x, y, m):
        rank, p = dist.rank(), dist.world_size()
        losses = []
        MySchedule([PipelineStage(stage_module, rank, p, dist.device())], {rank: list(actions)}).step(
            *((x,) if rank == 0 else ()), **({"target": y, "losses": losses} if rank == p - 1 else {}))
        return losses
    """,
    # names built at run time: only the wire inside the workers sees the library run
    """
    import importlib

    def my_run_plan(stage_module, actions, x, y, m):
        lib = importlib.import_module("minifsdp.pipeline")
        rank, p = dist.rank(), dist.world_size()
        stage = getattr(lib, "Pipeline" + "Stage")(stage_module, rank, p, dist.device())
        losses = []
        getattr(lib, "Schedule" + "FromPlan")([stage], {rank: list(actions)}, loss_fn=models.lm_loss).step(
            *((x,) if rank == 0 else ()), **({"target": y, "losses": losses} if rank == p - 1 else {}))
        return losses
    """,
], ids=["helper", "subclass", "runtime-names"])
def test_executor_library_shortcuts(source):
    message = shortcut_fails(lab07.executor, shortcut(source, "my_run_plan"))
    assert "Pipeline" in message or "Schedule" in message, message


# ------------------------------------------------------------------ exercise 3: interleaved
def test_interleaved_mistakes():
    fails(lab07.interleaved, load(L07, edits=NO_REVERSE)["my_interleaved"], words="walk the chunks in reverse")
    fails(lab07.interleaved, load(L07, edits=BREADTH_FIRST)["my_interleaved"], words="go depth first")
    fails(lab07.interleaved, load(L07, edits=SHORT_WARMUP)["my_interleaved"], words="before 2F0")
    fails(lab07.interleaved, pipeline.interleaved_1f1b, words="library")
    fails(lab07.interleaved, load(L07)["my_1f1b"], words="your code raised TypeError")


@pytest.mark.parametrize("source", [
    """
    def my_interleaved(p, m, v):
        return {r: [str(a) for a in acts] for r, acts in make_plan("interleaved", p, m, v).order.items()}
    """,
    # the library's private order, under another name
    """
    from minifsdp.pipeline.schedules import _interleaved as depth_first

    def my_interleaved(p, m, v):
        return {r: [str(a) for a in acts] for r, acts in depth_first(p, m, v, 2).items()}
    """,
    """
    import importlib

    def my_interleaved(p, m, v):
        order = getattr(importlib.import_module("minifsdp.pipeline.schedules"), "_inter" + "leaved")(p, m, v, 2)
        return {r: [str(a) for a in acts] for r, acts in order.items()}
    """,
], ids=["direct", "private-alias", "runtime-name"])
def test_interleaved_library_shortcuts(source):
    shortcut_fails(lab07.interleaved, shortcut(source, "my_interleaved"))


# ------------------------------------------------------------------ exercise 4: zero bubble
def test_zero_bubble_mistakes():
    fails(lab07.zero_bubble, load(L07, edits=W_RIGHT_AFTER_I)["my_zero_bubble"], words="fills no idle slot")
    fails(lab07.zero_bubble, load(L07, edits=W_FORGOTTEN)["my_zero_bubble"],
          words="never runs the weight-gradient backward")
    fails(lab07.zero_bubble, load(L07)["my_1f1b"], words="split every backward B into I")
    fails(lab07.zero_bubble, pipeline.zero_bubble, words="library")


@pytest.mark.parametrize("source", [
    # the library's table of schedules: a dict, so only the wire sees zero_bubble run
    """
    from minifsdp.pipeline import SCHEDULES

    def my_zero_bubble(p, m):
        return {r: [str(a) for a in acts] for r, acts in SCHEDULES["zero-bubble"](p, m).order.items()}
    """,
    """
    def plans(p, m):
        return make_plan("zero-bubble", p, m)

    def my_zero_bubble(p, m):
        return {r: [str(a) for a in acts] for r, acts in plans(p, m).order.items()}
    """,
    KEPT_PLANS.format(schedule="zero-bubble") + """
    def my_zero_bubble(p, m):
        return {r: [str(a) for a in acts] for r, acts in TABLE[p, m].order.items()}
    """,
], ids=["schedule-table", "helper", "kept-plans"])
def test_zero_bubble_library_shortcuts(source):
    shortcut_fails(lab07.zero_bubble, shortcut(source, "my_zero_bubble"))


# ------------------------------------------------------------------ hints
def test_hints_come_in_steps_and_never_give_the_code(capsys):
    for name in ("my_1f1b", "my_run_plan", "my_interleaved", "my_zero_bubble"):
        steps = lab07.hint.table[name]
        assert 2 <= len(steps) <= 4, name
        for _ in steps:
            lab07.hint(name)
        lab07.hint.again(name)
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines()), out
    for code in ("min(p - 1 - r", "requires_grad_()", "// p % v", "i - r", "2 * (p - 1 - r)"):
        assert code not in out, code


def test_measuring_helpers_are_not_public():
    public = {n for n in vars(lab07) if not n.startswith("_")}
    assert set(lab07.__all__) == {"one_f_one_b", "interleaved", "zero_bubble", "executor", "hint"}
    assert not {n for n in public if "measure" in n or "run" in n or "plan" in n}, public
