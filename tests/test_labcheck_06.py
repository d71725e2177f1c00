"""The checks of lab 06 (minifsdp.labcheck.lab06) judge the learner's code.

Each check passes with the solution (solutions/src/06_activation_checkpointing.py,
exec'd as a notebook runs it) and fails with one sentence naming the missing idea
on the blank lab and on typical mistakes (the solution with one small edit).
"""
from __future__ import annotations

import pytest

from minifsdp.checkpoint import ReentrantCheckpointFunction, checkpoint
from labcheck_helpers import fails, lab_tests, load
from minifsdp.labcheck import lab06

L06 = "06_activation_checkpointing"

NO_RNG = (("torch.set_rng_state(ctx.rng_state)", "pass"), ("torch.set_rng_state(rng_state)", "pass"))
NO_ENABLE_GRAD_REENTRANT = (("with torch.random.fork_rng(devices=[]), torch.enable_grad():",
                             "with torch.random.fork_rng(devices=[]):"),)
PACK_KEEPS_TENSOR = (("    def pack(tensor):\n        return next(numbers)", "    def pack(tensor):\n        return tensor"),
                     ("        if i not in recomputed:", "        if not isinstance(i, int):\n            return i\n"
                                                          "        if i not in recomputed:"))
NO_ENABLE_GRAD_HOOKS = (("with torch.random.fork_rng(devices=[]), torch.enable_grad(), \\",
                         "with torch.random.fork_rng(devices=[]), \\"),)
SAVE_NOTHING = (("return op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)", "return False"),)
SAVE_ALL_MATMULS = (("return op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)",
                     "return op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, "
                     "torch.ops.aten.bmm.default)"),)
NEVER_REUSE = (("        if func in self.kept:\n            k = self.calls.get(func, 0)",
                "        if False:\n            k = self.calls.get(func, 0)"),)
REUSE_LAST_FIRST = (("return self.kept[func][k].detach()", "return self.kept[func][-1 - k].detach()"),)
MOST_BLOCKS = (("    for k in range(config.n_layer + 1):\n        if predict_activations",
                "    for k in reversed(range(config.n_layer + 1)):\n        if predict_activations"),)
FORGET_INPUT = (("return plain[\"total\"] - k * (plain[\"per_layer\"] - kept)", "return plain[\"total\"] - k * plain[\"per_layer\"]"),)
IGNORE_K = (("return plain[\"total\"] - k * (plain[\"per_layer\"] - kept)", "return plain[\"total\"]"),)


CHECKS = [(lab06.reentrant, ("ReentrantCheckpoint",)), (lab06.hooks, ("checkpoint_with_hooks",)),
          (lab06.selective, ("KeepOutputs", "ReuseOutputs", "keep_expensive")),
          (lab06.predicted_activations, ("predict_activations", "fewest_checkpointed_blocks"))]
MISTAKES = (NO_RNG, NO_ENABLE_GRAD_REENTRANT, PACK_KEEPS_TENSOR, NO_ENABLE_GRAD_HOOKS, SAVE_NOTHING,
            SAVE_ALL_MATMULS, NEVER_REUSE, REUSE_LAST_FIRST, FORGET_INPUT, IGNORE_K, MOST_BLOCKS)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L06, CHECKS, MISTAKES, words=("yours", "target"))


def test_reentrant_mistakes():
    fails(lab06.reentrant, load(L06, edits=NO_RNG)["ReentrantCheckpoint"], words="dropout drew other masks")
    fails(lab06.reentrant, load(L06, edits=NO_ENABLE_GRAD_REENTRANT)["ReentrantCheckpoint"],
          words="torch.enable_grad()")
    fails(lab06.reentrant, ReentrantCheckpointFunction, words="library")


def test_hooks_mistakes():
    fails(lab06.hooks, load(L06, edits=NO_RNG)["checkpoint_with_hooks"], words="dropout drew other masks")
    fails(lab06.hooks, load(L06, edits=PACK_KEEPS_TENSOR)["checkpoint_with_hooks"], words="nothing was saved")
    fails(lab06.hooks, load(L06, edits=NO_ENABLE_GRAD_HOOKS)["checkpoint_with_hooks"],
          words="autograd saves tensors only where they are enabled")
    fails(lab06.hooks, checkpoint, words="library")


def _selective(ns):
    return ns["KeepOutputs"], ns["ReuseOutputs"], ns["keep_expensive"]


def test_selective_mistakes():
    fails(lab06.selective, *_selective(load(L06, edits=SAVE_NOTHING)), words="linear-layer matmuls")
    fails(lab06.selective, *_selective(load(L06, edits=SAVE_ALL_MATMULS)), words="cheap to recompute")
    fails(lab06.selective, *_selective(load(L06, edits=NEVER_REUSE)), words="must hand back the kept output")
    fails(lab06.selective, *_selective(load(L06, edits=REUSE_LAST_FIRST)), words="k-th call")


def _prediction(ns):
    return ns["predict_activations"], ns["fewest_checkpointed_blocks"]


def test_prediction_mistakes():
    fails(lab06.predicted_activations, *_prediction(load(L06, edits=FORGET_INPUT)), words="still keeps one tensor")
    fails(lab06.predicted_activations, *_prediction(load(L06, edits=IGNORE_K)), words="does not change with k")
    fails(lab06.predicted_activations, *_prediction(load(L06, edits=MOST_BLOCKS)), words="the fewest blocks")
