"""The checks of lab 02 (minifsdp.labcheck.lab02) judge the learner's code.

Each check must pass with the solution, and fail with a clear sentence
(``CheckFailed``) on the blank lab, on typical mistakes and on a library
shortcut. See labcheck_helpers.py for how the notebook's cells are loaded.
"""
from __future__ import annotations

import pytest

from labcheck_helpers import edits_apply, fails, load, shortcut_fails  # noqa: F401

L02 = "02_data_parallel"
EXTRA02: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def lab02():
    from minifsdp.labcheck import lab02
    return lab02


def test_lab02_solution_passes(lab02, capsys):
    ns = load(L02, extra=EXTRA02)
    lab02.hook_ddp(ns["make_data_parallel"])
    lab02.bucket_layout(ns["bucket_layout"])
    fig = lab02.bucketed_ddp(ns["BucketedDDP"])
    assert fig.get_size_inches()[0] <= 11
    lab02.accumulation(ns["accumulation_step"])
    out = capsys.readouterr().out
    assert out.count("✅") == 4 and "2·4Ψ" in out and "library" in out


def test_lab02_blank_fails(lab02):
    ns = load(L02, blank=True, extra=EXTRA02,
              edits=(("layout = bucket_layout(list(mini.parameters()), int(cap * MiB))", "continue"),))
    fails(lab02.hook_ddp, ns["make_data_parallel"], words="not written yet")
    fails(lab02.bucket_layout, ns["bucket_layout"], words="not written yet")
    fails(lab02.bucketed_ddp, ns["BucketedDDP"], words="not written yet")
    fails(lab02.accumulation, ns["accumulation_step"], words="not written yet")


@pytest.mark.parametrize("check, name, edits, words", [
    ("hook_ddp", "make_data_parallel", (("        p.grad.div_(world)\n", "        pass\n"),), "too large"),
    ("hook_ddp", "make_data_parallel", (("            comm.broadcast(p, src=0)\n", "            pass\n"),),
     "different weights"),
    ("bucket_layout", "bucket_layout", (("for i in reversed(range(len(params))):", "for i in range(len(params)):"),),
     "reverse"),
    ("bucket_layout", "bucket_layout", (("    if current:\n        buckets.append(current)\n", ""),),
     "exactly one bucket"),
    ("bucketed_ddp", "BucketedDDP", (("            self.flat[k].div_(self.world)\n", ""),), "too large"),
    ("bucketed_ddp", "BucketedDDP",
     (("self.handles.append((k, comm.all_reduce(self.flat[k], async_op=True)))",
       "handle = comm.all_reduce(self.flat[k], async_op=True); handle.wait(); self.handles.append((k, handle))"),),
     "nothing overlapped"),
    ("bucketed_ddp", "BucketedDDP", (("        self.pending = [len(bucket) for bucket in self.buckets]\n        # END",
                                      "        # END"),), "step 1"),
    ("accumulation", "accumulation_step", (("    with model.no_sync():\n", "    if True:\n"),), "every micro-batch"),
    ("accumulation", "accumulation_step", (("(models.lm_loss(model(x), y) / k).backward()\n    # END",
                                            "models.lm_loss(model(x), y).backward()\n    # END"),), "divided by k"),
], ids=["hook-no-divide", "hook-no-broadcast", "layout-forward", "layout-drops-last", "bucketed-no-divide",
        "bucketed-blocking", "bucketed-no-reset", "accum-no-nosync", "accum-last-not-divided"])
def test_lab02_mistakes_fail(lab02, check, name, edits, words):
    edits_apply(L02, edits)
    ns = load(L02, extra=EXTRA02, edits=edits)
    fails(getattr(lab02, check), ns[name], words=words)


def test_the_library_itself_is_told_apart(lab02):
    from minifsdp.ddp import bucket_assignment
    fails(lab02.bucket_layout, bucket_assignment, words="library's own")
