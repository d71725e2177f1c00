"""The checks of lab 06 (minifsdp.labcheck.lab06) judge the learner's code.

Each check passes with the solution (solutions/src/06_activation_checkpointing.py,
exec'd as a notebook runs it) and fails with one sentence naming the missing idea
on the blank lab and on typical mistakes (the solution with one small edit).
"""
from __future__ import annotations

import pytest

from minifsdp.checkpoint import ReentrantCheckpointFunction, checkpoint
from labcheck_helpers import fails, lab_tests, load, run_cell, shortcut_fails
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


# ------------------------------------------------------------------ library shortcuts, one set per exercise
def _shortcut(source: str) -> dict:
    """The notebook's namespace (imports and solution) with ``source`` run on top, as a learner's cell."""
    return run_cell(load(L06), source)


def _refused(check, *args) -> str:
    message = shortcut_fails(check, *args)
    assert "library's" in message, message
    return message


REENTRANT_SUBCLASS = '''
from minifsdp.checkpoint import ReentrantCheckpointFunction as _Fn

class ReentrantCheckpoint(_Fn):
    @staticmethod
    def forward(ctx, run, *inputs):
        return _Fn.forward(ctx, run, True, *inputs)

    @staticmethod
    def backward(ctx, grad_output):
        return (None, *_Fn.backward(ctx, grad_output)[2:])
'''
REENTRANT_HIDDEN = '''
import importlib

def _the_function():  # a helper that finds the library's Function where no name shows it
    return getattr(importlib.import_module("minifsdp.checkpoint.reentrant"), "Reentrant" + "CheckpointFunction")

class ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *inputs):
        return _the_function().forward(ctx, run, True, *inputs)

    @staticmethod
    def backward(ctx, grad_output):
        return (None, *_the_function().backward(ctx, grad_output)[2:])
'''
REENTRANT_TORCH = '''
import importlib

class ReentrantCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *inputs):
        ctx.fn = getattr(importlib.import_module("torch.utils.checkpoint"), "Checkpoint" + "Function")
        return ctx.fn.forward(ctx, run, True, *inputs)

    @staticmethod
    def backward(ctx, grad_output):
        return (None, *ctx.fn.backward(ctx, grad_output)[2:])
'''


def test_reentrant_shortcuts():
    for source in (REENTRANT_SUBCLASS, REENTRANT_HIDDEN, REENTRANT_TORCH):
        _refused(lab06.reentrant, _shortcut(source)["ReentrantCheckpoint"])


HOOKS_DO_NOTHING = '''
def checkpoint_with_hooks(run, *inputs):  # the library's checkpoint inside a pair of hooks that do nothing
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return checkpoint(run, *inputs, use_reentrant=False)
'''
HOOKS_HELPER_ALIAS = '''
from minifsdp.checkpoint.non_reentrant import checkpoint_non_reentrant as _recompute

def _mine(run, *inputs):
    return _recompute(run, *inputs)

def checkpoint_with_hooks(run, *inputs):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return _mine(run, *inputs)
'''
HOOKS_HIDDEN = '''
import importlib

def checkpoint_with_hooks(run, *inputs):
    library = importlib.import_module("minifsdp." + "checkpoint")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return getattr(library, "check" + "point")(run, *inputs, use_reentrant=False)
'''
HOOKS_TORCH = '''
import torch.utils.checkpoint as tuc

def checkpoint_with_hooks(run, *inputs):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return tuc.checkpoint(run, *inputs, use_reentrant=False)
'''


def test_hooks_shortcuts():
    for source in (HOOKS_DO_NOTHING, HOOKS_HELPER_ALIAS, HOOKS_HIDDEN, HOOKS_TORCH):
        _refused(lab06.hooks, _shortcut(source)["checkpoint_with_hooks"])


SELECTIVE_SUBCLASS = '''
from minifsdp.checkpoint.selective import _Cached, _Caching

class KeepOutputs(_Caching):
    pass

class ReuseOutputs(_Cached):
    pass
'''
SELECTIVE_OPS_ALIAS = '''
from minifsdp.checkpoint import LINEAR_OPS as EXPENSIVE

def keep_expensive(ctx, op, *args, **kwargs):
    return op in EXPENSIVE
'''
SELECTIVE_HIDDEN = '''
import importlib

def _library_pair(policy):  # the library's two modes, found where no name shows them
    return getattr(importlib.import_module("minifsdp.checkpoint"), "create_selective_" + "checkpoint_contexts")(policy)

class KeepOutputs(TorchDispatchMode):
    def __init__(self, policy, kept):
        super().__init__()
        kept["modes"] = _library_pair(policy)
        self.mode = kept["modes"][0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.mode.__torch_dispatch__(func, types, args, kwargs)

class ReuseOutputs(TorchDispatchMode):
    def __init__(self, kept):
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.kept["modes"][1].__torch_dispatch__(func, types, args, kwargs)
'''


def test_selective_shortcuts():
    for source in (SELECTIVE_SUBCLASS, SELECTIVE_OPS_ALIAS, SELECTIVE_HIDDEN):
        _refused(lab06.selective, *_selective(_shortcut(source)))


PREDICT_ALIAS = '''
from minifsdp.estimate import gpt_checkpoint_activation_bytes as activations_with

def predict_activations(config, batch, seq_len, k):
    return activations_with(config, batch, seq_len, checkpointed_layers=k)["total"]
'''
PREDICT_CHECK_HELPER = '''
import dataclasses

def predict_activations(config, batch, seq_len, k):  # "predicting" with the check's own measurement
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "name"}
    return check._measured_activations(fields, batch, seq_len, k)
'''
PREDICT_HIDDEN = '''
import importlib

def predict_activations(config, batch, seq_len, k):
    library = importlib.import_module("minifsdp.estimate")
    estimate_with = getattr(library, "gpt_checkpoint_" + "activation_bytes")
    return estimate_with(config, batch, seq_len, checkpointed_layers=k)["total"]
'''


def test_prediction_shortcuts():
    for source in (PREDICT_ALIAS, PREDICT_CHECK_HELPER, PREDICT_HIDDEN):
        _refused(lab06.predicted_activations, *_prediction(_shortcut(source)))


def test_measuring_helpers_are_private():
    public = [n for n in dir(lab06) if "measure" in n.lower() and not n.startswith("_")]
    assert not public, f"the check's measuring helpers must be private: {public}"


def test_every_stub_names_a_hint():
    import re
    import labcheck_helpers as helpers
    text = (helpers.ROOT / "solutions" / "src" / f"{L06}.py").read_text(encoding="utf-8")
    named = set(re.findall(r'# HINT: .*check\.hint\("(\w+)"\)', text))
    assert named == set(lab06.hint.table), (named, set(lab06.hint.table))
    assert all(2 <= len(steps) <= 4 for steps in lab06.hint.table.values())
