"""The checks of lab 04 (FSDP): pass on the solution, fail in words on the rest.

The learner's functions come from the notebook source itself (solutions/src/04_fsdp.py): the exercise
cells and the ``Unit`` scaffolding are executed into a fresh ``__main__`` namespace (so ``launch`` sends
them to the workers by value), as the solution, as the blank lab (every exercise still raises
NotImplementedError), or as the solution with a small edit (a typical mistake). Each runs through the
one-call check of the lab, which must pass, or fail with ``CheckFailed`` and one sentence naming what is
wrong. Every exercise also has library shortcuts, written the way a learner looking for one would: each
must fail with a sentence naming the library, statically (a helper, an alias, a module attribute) and at
run time (an import the code does not show, caught by the wire inside the workers).
"""

from __future__ import annotations

import sys

import pytest

from labcheck_helpers import edits_apply, fails, hints_come_one_at_a_time, load, run_cell, shortcut_fails
from minifsdp.labcheck import lab04

STEM = "04_fsdp"
TWO = (2,)   # one launch is enough for a mistake; the solution runs at every world size of the check


def ns04(*edits: tuple[str, str], blank: bool = False) -> dict:
    edits_apply(STEM, edits)
    return load(STEM, blank=blank, edits=edits, extra=("class Unit",))


def ex1(ns: dict) -> tuple:
    return tuple(ns[k] for k in ("shard_flat", "free", "allocate", "is_gathered"))


def ex2(ns: dict) -> tuple:
    return tuple(ns[k] for k in ("shard_model", "gather", "pre_forward", "post_forward", "install_hooks"))


def ex3(ns: dict) -> tuple:
    return tuple(ns[k] for k in ("shard_model", "pre_backward", "post_backward"))


def forward(ns: dict, **kw) -> None:
    lab04.fsdp_forward(*ex2(ns), world_sizes=kw.get("world_sizes", TWO))


def backward(ns: dict, **kw) -> None:
    lab04.fsdp_backward(*ex3(ns), world_sizes=kw.get("world_sizes", TWO))


@pytest.fixture(scope="module")
def sol() -> dict:
    return ns04()


# ------------------------------------------------------------------------------------ solution and blank
def test_checks_pass_on_the_solution(sol, capsys):
    lab04.flat_shard(*ex1(sol))
    lab04.fsdp_forward(*ex2(sol), world_sizes=(3,))
    lab04.fsdp_backward(*ex3(sol), world_sizes=(3,))
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 3, out
    for word in ("yours", "target", "171,528 B", "514,584 B"):
        assert word in out, out
    assert set(lab04.results["fsdp_backward"]["memory"]) == {"learner", "FULL_SHARD", "SHARD_GRAD_OP"}


def test_checks_fail_on_the_blank_lab():
    blank = ns04(blank=True)
    fails(lab04.flat_shard, *ex1(blank), words="not written yet")
    fails(lab04.fsdp_forward, *ex2(blank), words="not written yet")
    fails(lab04.fsdp_backward, *ex3(blank), words="not written yet")


def test_hints_come_one_at_a_time(capsys):
    hints_come_one_at_a_time(lab04.hint, ("flat_shard", "fsdp_forward", "fsdp_backward"), capsys)


# ------------------------------------------------------------------------------------ exercise 1
@pytest.mark.parametrize("edits, words", [
    ((("    padded = math.ceil(flat.numel() / world) * world\n", "    padded = flat.numel()\n"),), "pad the flat vector"),
    ((("return flat.chunk(world)[rank].clone()", "return flat.chunk(world)[world - 1 - rank].clone()"),), "wrong ranks"),
    ((("return flat.chunk(world)[rank].clone()", "return flat.chunk(world)[rank]"),), "a copy"),
    ((("torch.cat([p.detach().reshape(-1) for p in params])", "torch.cat([p.reshape(-1) for p in params])"),),
     "autograd history"),
    ((("resize_(unit.padded_numel * unit.full.element_size())", "resize_(unit.padded_numel)"),), "bytes, not numbers"),
    ((("resize_(unit.padded_numel * unit.full.element_size())", "resize_(unit.padded_numel * 4)"),), "own dtype"),
    ((("    unit.full.untyped_storage().resize_(0)\n",
       "    unit.full = torch.empty(0, device=unit.full.device, requires_grad=True)\n"),), "replaced unit.full"),
    ((('        tracker.register(unit.full, "unsharded_params")\n', "        pass\n"),), "unsharded_params"),
    ((("return unit.full.untyped_storage().nbytes() > 0", "return unit.full.numel() > 0"),), "is_gathered said True"),
])
def test_flat_shard_mistakes(edits, words):
    fails(lab04.flat_shard, *ex1(ns04(*edits)), words=words)


LIB_FREE_HELPER = """
from minifsdp.fsdp import naive as _fsdp


def _release(u):
    _fsdp.FlatUnit.free(u)                      # the library's free, through a helper and an alias
"""


def test_flat_shard_library_shortcuts():
    # a helper calling the library's FlatUnit.free: refused statically
    helper = ns04(("def free(unit: \"Unit\") -> None:", LIB_FREE_HELPER + "\n\ndef free(unit: \"Unit\") -> None:"),
                  ("    unit.full.untyped_storage().resize_(0)\n    # END SOLUTION", "    _release(unit)\n    # END SOLUTION"))
    shortcut_fails(lab04.flat_shard, *ex1(helper))
    # an import the code does not show (a string): only the run-time wire sees it
    hidden = ns04(("    unit.full.untyped_storage().resize_(0)\n    # END SOLUTION",
                   "    getattr(__import__('importlib').import_module('minifsdp.fsdp.' + 'naive'), 'FlatUnit')"
                   ".free(unit)\n    # END SOLUTION"))
    message = shortcut_fails(lab04.flat_shard, *ex1(hidden))
    assert "FlatUnit.free" in message, message


# ------------------------------------------------------------------------------------ exercise 2
@pytest.mark.parametrize("edits, words", [
    ((("    free(unit)\n    if output.requires_grad:", "    if output.requires_grad:"),), "still hold"),
    ((("    comm.all_gather_into_tensor(unit.full.data, unit.shard.detach())\n", ""),), "logits differ"),
    ((('candidates[::-1] + [("root", model)]', "candidates[::-1]"),), "root"),
    ((("    if output.requires_grad:\n        output.register_hook(lambda grad: pre_backward(unit))\n", ""),),
     "carries no gradient hook"),
    ((("    unit.full.register_post_accumulate_grad_hook(lambda full: post_backward(unit))\n", ""),),
     "whole gradient is ready"),
    # raw torch errors, translated into one sentence each
    ((("pieces = torch.split(unit.full, unit.sizes", "pieces = torch.split(unit.full.data, unit.sizes"),),
     "does not take part in autograd"),
    ((('candidates[::-1] + [("root", model)]', '[("root", model)] + candidates[::-1]'),), "root last"),
    # gathered into a buffer, then copied into unit.full itself under no_grad: autograd's version counter moves
    ((("    comm.all_gather_into_tensor(unit.full.data, unit.shard.detach())\n",
       "    buf = torch.empty_like(unit.full.data)\n    comm.all_gather_into_tensor(buf, unit.shard.detach())\n"
       "    with torch.no_grad():\n        unit.full.copy_(buf)\n"),), "written in place"),
])
def test_forward_mistakes(edits, words):
    fails(forward, ns04(*edits), words=words)


def test_gathering_into_full_itself(monkeypatch):
    """torch refuses the in-place write into a tensor autograd tracks; the check says it in the lab's words.
    (Under MINIFSDP_FAKE_GPU the pretend GPU's dispatch modes let the write through unnoticed, and the
    numbers come out right: the mistake shows on CPU ranks and on real GPUs, so run it on CPU ranks.)"""
    monkeypatch.delenv("MINIFSDP_FAKE_GPU", raising=False)
    ns = ns04(("comm.all_gather_into_tensor(unit.full.data, unit.shard.detach())",
               "comm.all_gather_into_tensor(unit.full, unit.shard.detach())"))
    fails(forward, ns, words="through unit.full.data")
    fails(backward, ns, words="through unit.full.data")


LIB_UNITS = """
from minifsdp.fsdp.naive import NaiveFullyShardedDataParallel as _Sharded


def shard_model(model: nn.Module, unit_types: set[type]) -> list[Unit]:
    return _Sharded(model, unit_types).units        # the library's units, every hook of the lab left empty
"""
HIDDEN_UNITS = """
def shard_model(model: nn.Module, unit_types: set[type]) -> list[Unit]:
    import importlib
    lib = importlib.import_module("minifsdp.fsdp." + "na" + "ive")
    return getattr(lib, "Naive" + "FullyShardedDataParallel")(model, unit_types).units
"""
EMPTY_HOOKS = """
def gather(unit):
    pass


def pre_forward(unit):
    pass


def post_forward(unit, output):
    pass


def install_hooks(unit):
    pass


def pre_backward(unit):
    pass


def post_backward(unit):
    pass
"""


def shortcut_ns(body: str) -> dict:
    """The solution's namespace, with shard_model and the hooks replaced by a shortcut (exec'd as a cell)."""
    return run_cell(ns04(), body + EMPTY_HOOKS)


SUBCLASS = """
from minifsdp.fsdp.naive import FlatUnit


class MyUnit(FlatUnit):
    def __init__(self, name, module, params):
        super().__init__(name, module, params, dist.device())
"""


FSDP_UNITS = """
def shard_model(model: nn.Module, unit_types: set[type]) -> list[Unit]:
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(unit_types))   # the notebook's own import of it
    return [m for m in wrapped.modules() if isinstance(m, FSDP)]
"""


def test_the_guards_let_the_learners_own_tools_through(capsys):
    # trace.span and comm.annotate are context managers, as two of FSDP's methods are: not the library's FSDP
    ns = ns04(("    if is_gathered(unit):\n        return\n    allocate(unit)\n",
               "    if is_gathered(unit):\n        return\n    with trace.span('gather', unit=unit.name), "
               "comm.annotate(unit=unit.name):\n        allocate(unit)\n"))
    forward(ns)
    assert "✅ passed" in capsys.readouterr().out


def test_forward_library_shortcuts():
    message = shortcut_fails(forward, shortcut_ns(FSDP_UNITS))    # FSDP's constructor ran in the workers
    assert "FullyShardedDataParallel" in message, message
    shortcut_fails(forward, shortcut_ns(LIB_UNITS))            # refused statically: an alias of the library's class
    # the lab's Unit replaced by a subclass of the library's FlatUnit calling super().__init__
    subclass = ns04(("def shard_model(model: nn.Module", SUBCLASS + "\n\ndef shard_model(model: nn.Module"),
                    ("        unit = Unit(name, m, params)\n", "        unit = MyUnit(name, m, params)\n"))
    shortcut_fails(forward, subclass)
    message = shortcut_fails(forward, shortcut_ns(HIDDEN_UNITS))  # only the wire in the workers sees this one
    assert "naive" in message, message


# ------------------------------------------------------------------------------------ exercise 3
@pytest.mark.parametrize("edits, words", [
    ((("grad.div_(unit.world)", "grad"),), "divide by the world size"),
    ((("        unit.shard.grad += chunk\n    free(unit)\n", "        unit.shard.grad += chunk\n"),), "frees"),
    ((("    if unit.shard.grad is None:\n        unit.shard.grad = chunk\n    else:\n        unit.shard.grad += chunk\n",
       "    unit.shard.grad = chunk\n"),), "must add up"),
    ((("    grad, unit.full.grad = unit.full.grad, None\n", "    grad = unit.full.grad\n"),),
     "gradients are adding up across steps"),
    ((("    gather(unit)\n    # END SOLUTION\n\n\ndef post_backward", "    pass\n    # END SOLUTION\n\n\ndef post_backward"),),
     "still freed when its backward ran"),
    # a post_forward that never hooks its output, met in exercise 3: the raw setStorage error, translated
    ((("    if output.requires_grad:\n        output.register_hook(lambda grad: pre_backward(unit))\n", ""),),
     "did post_forward hook the unit's output"),
])
def test_backward_mistakes(edits, words):
    fails(backward, ns04(*edits), words=words)


LIB_REDUCE = """
import minifsdp.fsdp.naive as fsdp_naive


def post_backward(unit: Unit) -> None:
    fsdp_naive.FlatUnit.reduce_scatter_grad(unit)   # the library's reduce-scatter, on the lab's Unit
    free(unit)
"""
HIDDEN_REDUCE = """
def post_backward(unit: Unit) -> None:
    import importlib
    flat_unit = getattr(importlib.import_module("minifsdp.fsdp." + "naive"), "Flat" + "Unit")
    flat_unit.reduce_scatter_grad(unit)
    free(unit)
"""


def test_backward_library_shortcuts():
    for body in (LIB_REDUCE, HIDDEN_REDUCE):
        ns = run_cell(ns04(), body)
        message = shortcut_fails(backward, ns)
        assert "reduce_scatter_grad" in message or "naive" in message, message
    # the whole cycle from the library: its units, the lab's hooks left empty
    shortcut_fails(backward, shortcut_ns(HIDDEN_UNITS))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
