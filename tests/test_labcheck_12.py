"""The checks of lab 12 (the capstone): pass on the solution, fail in words on the blank lab and on mistakes.

The learner's functions come from the notebook source itself (solutions/src/12_capstone.py), executed into a
fresh ``__main__`` namespace (so ``launch`` sends them to the workers by value): as the solution, as the blank
lab, or as the solution with a small edit (a typical mistake). Exercise 1 is priced with a made-up
calibration (no measuring here: the check's target is the planner's, whatever the calibration says); exercise
3's "runs" are loss lists with a known answer. Exercise 2 runs for real on 2 ranks, rank 1 killed (SIGKILL)
while it saves; its library shortcut (``minifsdp.save_resume``'s atomic write) must be refused.
"""

from __future__ import annotations

import json

import pytest

from labcheck_helpers import (edits_apply, fails, hints_come_one_at_a_time, load,
                              mistakes_match, run_cell, shortcut_fails)
from minifsdp.labcheck import lab12
from minifsdp.step_time import OPS, Calibration

STEM = "12_capstone"
CANDIDATES = {"ddp": dict(dp=2), "zero1": dict(dp=2, zero_stage=1), "zero2": dict(dp=2, zero_stage=2),
              "fsdp": dict(dp=2, zero_stage=3), "tp": dict(tp=2), "pp": dict(pp=2, micro_batches=2)}
MODEL, B, T, CAP = "gpt-mini", 8, 32, 36 * 2**20
CAL = Calibration(compute={2: {"matmul_flops": {"fp32": [[64, 2e9], [512, 2e10]]}, "elementwise_bytes_per_s": 2e9,
                               "optimizer_s_per_param": 1e-8}},
                  collectives={op: {2: {"alpha_s": 1e-4, "beta_s_per_byte": 2e-9, "points": []}} for op in OPS})
RUN_A = {"losses": [5.63, 4.84, 4.35, 4.23]}
RUN_C = {"losses": [4.35, 4.23], "first_step": 2}


def ns12(*edits: tuple[str, str], blank: bool = False) -> dict:
    edits_apply(STEM, edits)
    return load(STEM, blank=blank, edits=edits)


def ex1(ns: dict) -> tuple:
    return ns["choose_layout"], CANDIDATES, MODEL, B, T, CAP, CAL


def ex2(ns: dict) -> tuple:
    return ns["save"], ns["load_latest"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    """Run folders as the trainer leaves them (metrics.json), A uninterrupted, C resumed at step 2."""
    root = tmp_path_factory.mktemp("runs")
    for name, metrics in (("A", RUN_A), ("C", RUN_C)):
        (root / name).mkdir()
        (root / name / "metrics.json").write_text(json.dumps(metrics))
    return str(root / "A"), str(root / "C")


def ex3(ns: dict, runs: tuple[str, str]) -> tuple:
    return ns["first_divergence"], *runs


@pytest.fixture(scope="module")
def sol() -> dict:
    return ns12()


def test_checks_pass_on_the_solution(sol, runs, capsys):
    lab12.choose_layout(*ex1(sol))
    lab12.atomic_save(*ex2(sol))
    lab12.resume_exact(*ex3(sol, runs))
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 3, out
    for words in ("4 caps, one with nothing fitting", "yours 3, target 3", "yours None, target None"):
        assert words in out, out


def test_checks_fail_on_the_blank_lab(runs):
    blank = ns12(blank=True)
    fails(lab12.choose_layout, *ex1(blank), words="not written yet")
    fails(lab12.atomic_save, *ex2(blank), words="not written yet")
    fails(lab12.resume_exact, *ex3(blank, runs), words="not written yet")


def test_hints_come_one_at_a_time(capsys):
    hints_come_one_at_a_time(lab12.hint, ("choose_layout", "save", "load_latest", "first_divergence"), capsys)


# ------------------------------------------------------------------------------------ exercise 1
FASTEST = "    name = min(fitting, key=lambda name: fitting[name].time.step_s)"
LAYOUT_MISTAKES = [
    (((FASTEST, "    name = min(fitting, key=lambda name: fitting[name].total_memory)"),), "predicted faster"),
    ((("fitting = {name: p for name, p in plans.items() if p.fits(cap_bytes)}", "fitting = plans"),),
     "above the cap"),
    ((("        except ValueError:                  # a layout this model cannot take\n            continue\n",
       "        except ZeroDivisionError:\n            continue\n"),), "skip a candidate the planner refuses"),
    ((("        raise ValueError(f\"no layout fits under", "        return None, (f\"no layout fits under"),),
     "raise a ValueError"),
    ((("the smallest peak is {smallest}'s \"", "the smallest peak is \""),), "name the smallest peak"),
    ((("    return name, fitting[name]\n", "    return name\n"),), "return a pair"),
]


@pytest.mark.parametrize("edits, words", LAYOUT_MISTAKES)
def test_choose_layout_mistakes(edits, words):
    fails(lab12.choose_layout, *ex1(ns12(*edits)), words=words)


# ------------------------------------------------------------------------------------ exercise 2 (2 ranks)
NO_BARRIER = (("    comm.barrier()                                          # every rank's file is written\n", ""),)
IN_PLACE = (("    tmp = final + \".tmp\"\n", "    tmp = final\n"),
            ("        os.replace(tmp, final)                              # the one step that makes step_N exist\n",
             ""))
LISTING = (("    with open(os.path.join(root, \"latest\")) as f:\n        name = f.read().strip()\n",
            "    name = max((d for d in os.listdir(root) if d.startswith(\"step_\")),\n"
            "               key=lambda d: int(d.removeprefix(\"step_\").removesuffix(\".tmp\")))\n"),)
PRUNE_ALL = (("        for old in done[:-keep]:", "        for old in done[:-1]:"),)
SAVE_MISTAKES = [(NO_BARRIER, "every rank ha"), (IN_PLACE, "step_4 exists"), (LISTING, "trust the pointer"),
                 (PRUNE_ALL, "keep the newest 2")]


@pytest.mark.parametrize("edits, words", SAVE_MISTAKES[:1])
def test_atomic_save_mistakes(edits, words):
    fails(lab12.atomic_save, *ex2(ns12(*edits)), words=words)


def test_the_other_save_mistakes_still_match_the_solution():
    """Each costs launches: their verdicts were seen once (see the list); here they must still apply."""
    mistakes_match(STEM, *(edits for edits, _ in SAVE_MISTAKES))


LIBRARY_LATEST = """
from minifsdp.save_resume import _write_atomic as write_pointer


def save(state, root, step, keep=2):
    final = os.path.join(root, f"step_{step}")
    os.makedirs(final + ".tmp", exist_ok=True)
    torch.save(state, os.path.join(final + ".tmp", f"rank{dist.rank()}.pt"))
    comm.barrier()
    if dist.rank() == 0:
        os.replace(final + ".tmp", final)
        write_pointer(os.path.join(root, "latest"), f"step_{step}")   # the library's atomic write
    comm.barrier()
"""


HIDDEN_COMMIT = """
def save(state, root, step, keep=2):
    import importlib
    library = importlib.import_module("minifsdp." + "save_resume")
    final = os.path.join(root, f"step_{step}")
    os.makedirs(final + ".tmp", exist_ok=True)
    torch.save(state, os.path.join(final + ".tmp", f"rank{dist.rank()}.pt"))
    comm.barrier()
    if dist.rank() == 0:
        getattr(library, "_com" + "mit")(final + ".tmp", final, root, step)   # only the wire sees it
    comm.barrier()
"""


def test_atomic_save_library_shortcut():
    message = shortcut_fails(lab12.atomic_save, *ex2(run_cell(ns12(), LIBRARY_LATEST)))    # refused statically
    assert "_write_atomic" in message, message
    message = shortcut_fails(lab12.atomic_save, *ex2(run_cell(ns12(), HIDDEN_COMMIT)))     # the wire, on rank 0
    assert "_commit" in message, message


# ------------------------------------------------------------------------------------ exercise 3
STEP = "        step = first_step + i\n"
RESUME_MISTAKES = [
    (((STEP, "        step = i\n"),), "compare it with reference[first_step]"),
    ((("            return step\n", "            return i\n"),), "the position in resumed"),
    ((("rtol * abs(reference[step])", "rtol"),), "relative"),
    ((("    if first_step + len(resumed) > len(reference):", "    if False:"),), "raise ValueError"),
]


@pytest.mark.parametrize("edits, words", RESUME_MISTAKES)
def test_resume_exact_mistakes(edits, words, runs):
    fails(lab12.resume_exact, *ex3(ns12(*edits), runs), words=words)


def test_a_resume_that_drifts_is_named_by_its_step(sol, tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps({"losses": [4.35, 4.2300001], "first_step": 2}))
    fails(lab12.resume_exact, sol["first_divergence"], runs_a(tmp_path), str(tmp_path), words="diverged at step 3")


def test_a_run_not_made_yet_is_named(sol, tmp_path):
    fails(lab12.resume_exact, sol["first_divergence"], str(tmp_path / "A"), str(tmp_path / "C"),
          words="run section 2's cells")


def runs_a(tmp_path) -> str:
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "metrics.json").write_text(json.dumps(RUN_A))
    return str(tmp_path / "A")
