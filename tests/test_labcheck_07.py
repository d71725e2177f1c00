"""The checks of lab 07 (minifsdp.labcheck.lab07) judge the learner's code.

Each check passes with the solution (solutions/src/07_pipeline_parallel.py, its
exercise cells exec'd as a notebook runs them), and fails with one sentence on
the blank lab, on the library's own function, and on two typical mistakes each
(the solution with one small edit).
"""
from __future__ import annotations

from labcheck_helpers import fails, lab_tests, load
from minifsdp import pipeline
from minifsdp.labcheck import lab07

L07 = "07_pipeline_parallel"

COUNTS_STEP_SPAN = (("if s.name in PIPELINE_WORK]", "if s.kind == \"compute\"]"),)
ONE_RANK_WINDOW = (("min(s.start for s in work)) * len(traces)", "min(s.start for s in work))"),)
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


CHECKS = [(lab07.measured_bubble, ("my_measured_bubble",)), (lab07.one_f_one_b, ("my_1f1b",)),
          (lab07.interleaved, ("my_interleaved",)), (lab07.zero_bubble, ("my_zero_bubble",)),
          (lab07.executor, ("my_run_plan",))]
MISTAKES = (COUNTS_STEP_SPAN, ONE_RANK_WINDOW, LONG_WARMUP, BACKWARD_FIRST, NO_REVERSE, BREADTH_FIRST,
            SHORT_WARMUP, W_RIGHT_AFTER_I, W_FORGOTTEN, NO_REQUIRES_GRAD, NO_LOSSES)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L07, CHECKS, MISTAKES, words=("yours", "target", "library"))


def test_measured_bubble_mistakes():
    fails(lab07.measured_bubble, load(L07, edits=COUNTS_STEP_SPAN)["my_measured_bubble"], words="'step' span")
    fails(lab07.measured_bubble, load(L07, edits=ONE_RANK_WINDOW)["my_measured_bubble"],
          words="times the number of ranks")
    fails(lab07.measured_bubble, pipeline.measured_bubble, words="library")


def test_one_f_one_b_mistakes():
    fails(lab07.one_f_one_b, load(L07, edits=LONG_WARMUP)["my_1f1b"], words="1F1B at most p - r")
    fails(lab07.one_f_one_b, load(L07, edits=BACKWARD_FIRST)["my_1f1b"],
          words="a backward needs the activations its forward saved")
    fails(lab07.one_f_one_b, pipeline.one_f_one_b, words="library")


def test_interleaved_mistakes():
    fails(lab07.interleaved, load(L07, edits=NO_REVERSE)["my_interleaved"], words="walk the chunks in reverse")
    fails(lab07.interleaved, load(L07, edits=BREADTH_FIRST)["my_interleaved"], words="go depth first")
    fails(lab07.interleaved, load(L07, edits=SHORT_WARMUP)["my_interleaved"], words="before 2F0")
    fails(lab07.interleaved, pipeline.interleaved_1f1b, words="library")
    fails(lab07.interleaved, load(L07)["my_1f1b"], words="your code raised TypeError")


def test_zero_bubble_mistakes():
    fails(lab07.zero_bubble, load(L07, edits=W_RIGHT_AFTER_I)["my_zero_bubble"], words="fills no idle slot")
    fails(lab07.zero_bubble, load(L07, edits=W_FORGOTTEN)["my_zero_bubble"],
          words="never runs the weight-gradient backward")
    fails(lab07.zero_bubble, load(L07)["my_1f1b"], words="split every backward B into I")


def test_executor_mistakes():
    fails(lab07.executor, load(L07, edits=NO_REQUIRES_GRAD)["my_run_plan"], words="requires grad")
    fails(lab07.executor, load(L07, edits=NO_LOSSES)["my_run_plan"], words="the last rank returned losses []")

    def uses_library(stage_module, actions, x, y, m):
        return pipeline.ScheduleFromPlan([stage_module], actions, None).step(x)
    fails(lab07.executor, uses_library, words="library's runtime")
