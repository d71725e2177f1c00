"""The checks of lab 05 (mixed precision): pass on the solution, fail in words on the rest.

The learner's code comes from the notebook source itself (solutions/src/05_mixed_precision.py): the
exercise cells are executed into a fresh ``__main__`` namespace (so ``launch`` sends them to the workers
by value), as the solution, as the blank lab (every exercise still raises NotImplementedError), or as the
solution with a small edit (a typical mistake). Each runs through the lab's one-call check, which must pass,
or fail with ``CheckFailed`` and one sentence naming what is wrong. Every exercise also has library
shortcuts, written the way a learner looking for one would (a notebook helper, an alias, a subclass, a
name the code does not show): each must fail with a sentence naming the library, statically or, for the
hidden ones, at run time (the tripwire in this process or in the launched workers).
"""
from __future__ import annotations

import sys

import pytest

from labcheck_helpers import edits_apply, fails, hints_come_one_at_a_time, load, run_cell, shortcut_fails
from minifsdp.labcheck import lab05

STEM = "05_mixed_precision"


def ns05(*edits: tuple[str, str], blank: bool = False) -> dict:
    edits_apply(STEM, edits)
    return load(STEM, blank=blank, edits=edits)


def with_cell(body: str, *edits: tuple[str, str]) -> dict:
    """The solution's namespace with one more cell run after it (a shortcut replacing an exercise)."""
    return run_cell(ns05(*edits), body)


def ex1(ns: dict) -> None:
    lab05.lost_in_16_bits(ns["underflow_fraction"], ns["swamped_fraction"])


def ex2(ns: dict) -> None:
    lab05.loss_scaler(ns["LossScaler"])


def ex3(ns: dict) -> None:
    lab05.rescue(ns["fp16_train_step"], ns["LossScaler"])


def ex4(ns: dict) -> None:
    lab05.fsdp_precision(ns["sharded_scaler_step"], ns["policy_bytes"], ns["LossScaler"])


def ex4a(ns: dict) -> None:
    """Exercise 4's first part alone (its check launches 2 ranks)."""
    lab05._sharded_step(ns["sharded_scaler_step"], ns["LossScaler"])


def ex4b(ns: dict) -> None:
    """Exercise 4's second part alone (in this process, against the tracer's bytes measured once)."""
    lab05._policy_bytes(ns["policy_bytes"])


@pytest.fixture(scope="module")
def sol() -> dict:
    return ns05()


# ------------------------------------------------------------------------------------ solution, blank, hints
def test_checks_pass_on_the_solution(sol, capsys):
    for check in (ex1, ex2, ex3, ex4):
        check(sol)
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 4, out
    for words in ("steps skipped on every rank: yours [3, 7, 8], target [3, 7, 8], library [3, 7, 8]",
                  "bf16 136,576+85,760 B", "final loss: yours", "bfloat16 0.652"):
        assert words in out, out


def test_checks_fail_on_the_blank_lab():
    blank = ns05(blank=True)
    for check in (ex1, ex2, ex3, ex4):
        fails(check, blank, words="not written yet")


def test_hints_come_one_at_a_time(capsys):
    names = ("underflow_fraction", "swamped_fraction", "LossScaler", "fp16_train_step", "sharded_scaler_step",
             "policy_bytes")
    hints_come_one_at_a_time(lab05.hint, names, capsys)


def test_measuring_helpers_are_not_public():
    public = {n for n in vars(lab05) if not n.startswith("_")}
    assert public <= {"annotations", "functools", "math", "torch", "Any", "Callable", "hint", "Hints", "call",
                      "check_world", "failed", "figures", "passed", "refuse_library", "require_written", "run",
                      "lost_in_16_bits", "loss_scaler", "rescue", "fsdp_precision"}, public


# ------------------------------------------------------------------------------------ exercise 1
@pytest.mark.parametrize("edits, words", [
    ((("lost = nonzero & (values.to(dtype) == 0)",
       "lost = nonzero & (values.abs() < torch.finfo(dtype).smallest_normal)"),), "subnormals"),
    ((("return lost.sum().item() / nonzero.sum().item()", "return lost.sum().item() / values.numel()"),),
     "divide by the number of *nonzero* values"),
    ((("unchanged = (stored + updates.to(dtype)) == stored", "unchanged = (stored + updates) == stored"),),
     "computed in fp32"),
    ((("unchanged = (stored + updates.to(dtype)) == stored",
       "unchanged = (stored + updates.to(dtype)) == weights"),), "as stored in"),
    ((("return (nonzero & unchanged).sum().item() / nonzero.sum().item()",
       "return (nonzero & ~unchanged).sum().item() / nonzero.sum().item()"),), "share of updates that move"),
])
def test_lost_in_16_bits_mistakes(edits, words):
    fails(ex1, ns05(*edits), words=words)


def test_swamping_rounded_in_fp32_is_right_too(capsys):
    """param.add_(update) on a 16-bit weight adds in fp32 and rounds once: a right answer as well."""
    ex1(ns05(("unchanged = (stored + updates.to(dtype)) == stored",
              "unchanged = (weights + updates).to(dtype) == stored")))
    assert "✅ passed" in capsys.readouterr().out


EX1_HELPER = """
from minifsdp.labcheck import lab05 as measured

def count_lost(values, dtype):
    return measured._lost(values, dtype)

def underflow_fraction(values, dtype):
    return count_lost(values, dtype)
"""
EX1_ALIAS = "from minifsdp.labcheck.lab05 import _swamped as swamped_fraction\n"
EX1_HIDDEN = """
import importlib

def swamped_fraction(weights, updates, dtype):
    answer = getattr(importlib.import_module("minifsdp.labcheck.lab05"), "_swa" + "mped")
    return answer(weights, updates, dtype)
"""


def test_lost_in_16_bits_library_shortcuts():
    shortcut_fails(ex1, with_cell(EX1_HELPER))          # a notebook helper calling the check's own answer
    shortcut_fails(ex1, with_cell(EX1_ALIAS))           # the check's answer under the exercise's name
    shortcut_fails(ex1, with_cell(EX1_HIDDEN))          # a name the code does not show: the wire sees it run


# ------------------------------------------------------------------------------------ exercise 2
@pytest.mark.parametrize("edits, words", [
    ((("            g.mul_(1.0 / self.scale)\n", "            g = g * (1.0 / self.scale)\n"),), "in place"),
    ((("not bool(torch.isfinite(g).all())", "bool(torch.isinf(g).any())"),), "inf *and* NaN"),
    ((("g.mul_(1.0 / self.scale)", "g.mul_(self.scale)"),), "too large"),
    ((("self.scale, self.tracker = self.scale * self.growth_factor, 0",
       "self.scale = self.scale * self.growth_factor"),), "after growing"),
    ((("self.scale, self.tracker = self.scale * self.backoff_factor, 0",
       "self.scale = self.scale * self.backoff_factor"),), "starts again from 0"),
    ((("if self.tracker == self.growth_interval:", "if self.tracker == self.growth_interval + 1:"),),
     "growth_interval-th clean step"),
    ((("self.scale, self.tracker = float(init_scale), 0", "self.scale, self.count = float(init_scale), 0"),),
     "self.tracker"),
])
def test_loss_scaler_mistakes(edits, words):
    fails(ex2, ns05(*edits), words=words)


EX2_SUBCLASS = """
from minifsdp.mixed_precision import GradScaler

class LossScaler(GradScaler):
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval)
        self.tracker = 0

    @property
    def scale(self):
        return self.get_scale()
"""
EX2_HELPER = """
import minifsdp.mixed_precision as mp

def next_state(scale, tracker, found_inf, rule):
    return mp.update_scale(scale, tracker, found_inf, *rule)

class LossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.tracker, self.rule = float(init_scale), 0, (growth_factor, backoff_factor, growth_interval)

    def unscale_(self, grads):
        return bool(mp.unscale_grads_(grads, torch.tensor(1.0 / self.scale)).item())

    def update(self, found_inf):
        self.scale, self.tracker = next_state(self.scale, self.tracker, found_inf, self.rule)
"""
EX2_TORCH_KERNEL = """
import torch as T

class LossScaler:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.tracker, self.rule = float(init_scale), 0, (growth_factor, backoff_factor, growth_interval)

    def unscale_(self, grads):
        flag = T.zeros(())
        getattr(T, "_amp_foreach_non_finite" + "_check_and_unscale_")(grads, flag, T.tensor(1.0 / self.scale))
        return bool(flag.item())

    def update(self, found_inf):
        s, t = T.tensor(self.scale), T.tensor(self.tracker, dtype=T.int32)
        getattr(T, "_amp_update" + "_scale_")(s, t, T.tensor(float(found_inf)), *self.rule)
        self.scale, self.tracker = s.item(), int(t.item())
"""

EX2_FACTORY = """
from minifsdp.mixed_precision import GradScaler

def LossScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    return GradScaler("cpu", init_scale, growth_factor, backoff_factor, growth_interval)
"""


def test_loss_scaler_library_shortcuts():
    shortcut_fails(ex2, with_cell(EX2_FACTORY))         # an object the library built
    shortcut_fails(ex2, with_cell(EX2_SUBCLASS))        # a subclass of the library's scaler
    shortcut_fails(ex2, with_cell(EX2_HELPER))          # module attributes and a helper calling the library's rule
    message = shortcut_fails(ex2, with_cell(EX2_TORCH_KERNEL))  # torch's kernels by a name the code does not show
    assert "torch._amp_" in message, message


# ------------------------------------------------------------------------------------ exercise 3
@pytest.mark.parametrize("edits, words", [
    ((("(loss * scaler.scale).backward()", "loss.backward()"),), "multiply the loss by scaler.scale"),
    ((("            p16.copy_(p32)\n    scaler.update", "            pass\n    scaler.update"),), "copy the master back"),
    ((("    if not found_inf:\n        opt.step()\n    opt.zero_grad()", "    opt.step()\n    opt.zero_grad()"),),
     "skip optimizer.step()"),
    ((("    scaler.update(found_inf)\n    return loss.item()", "    return loss.item()"),), "never changed"),
])
def test_rescue_mistakes(edits, words):
    fails(ex3, ns05(*edits), words=words)


EX3_LIBRARY_SCALER = """
from minifsdp.mixed_precision import GradScaler as Scaler

def fp16_train_step(model16, master, opt, batch, loss_fn, scaler):
    x, y = batch
    theirs = Scaler("cpu", init_scale=scaler.scale)
    loss = loss_fn(model16(x), y)
    theirs.scale(loss).backward()
    for p16, p32 in zip(model16.parameters(), master):
        p32.grad, p16.grad = p16.grad.float(), None
    theirs.step(opt)
    theirs.update()
    opt.zero_grad()
    with torch.no_grad():
        for p16, p32 in zip(model16.parameters(), master):
            p16.copy_(p32)
    scaler.scale = theirs.get_scale()
    return loss.item()
"""
# the learner's own step, but the scaler it is handed reaches the library by a name the code does not show
EX3_HIDDEN = """
import importlib

class LossScaler(LossScaler):
    def update(self, found_inf):
        rule = getattr(importlib.import_module("minifsdp.mixed_precision"), "update" + "_scale")
        self.scale, self.tracker = rule(self.scale, self.tracker, found_inf, self.growth_factor,
                                        self.backoff_factor, self.growth_interval)
"""


def test_rescue_library_shortcuts():
    shortcut_fails(ex3, with_cell(EX3_LIBRARY_SCALER))  # the library's scaler under another name
    shortcut_fails(ex3, with_cell(EX3_LIBRARY_SCALER.replace(   # torch's own scaler
        "from minifsdp.mixed_precision import GradScaler as Scaler", "Scaler = torch.amp.GradScaler")))
    message = shortcut_fails(ex3, with_cell(EX3_HIDDEN))  # only the wire sees this one
    assert "update_scale" in message, message


# ------------------------------------------------------------------------------------ exercise 4
@pytest.mark.parametrize("edits, words", [
    # each rank decides alone: rank 0 steps while the last rank skips
    ((("    comm.all_reduce(flag, op=comm.ReduceOp.MAX)", "    pass"),), "all-reduce the flag (MAX) before deciding"),
    # MIN: skipped only when every rank overflowed
    ((("op=comm.ReduceOp.MAX", "op=comm.ReduceOp.MIN"),), "*any* rank overflowed"),
    # the scale updated with this rank's own flag: the ranks' scales drift apart
    ((("scaler.update(found_inf)\n    return found_inf", "scaler.update(mine)\n    return found_inf"),),
     "update every rank's scaler"),
])
def test_sharded_step_mistakes(edits, words):
    fails(ex4a, ns05(*edits), words=words)


@pytest.mark.parametrize("edits, words", [
    ((("is not None else param\n", "is not None else torch.float32\n"),), "reduce_dtype=None means"),
    ((("sum(numel * gathers for numel, gathers in units)", "sum(numel for numel, _ in units)"),), "once per gather"),
    ((("* param.itemsize", "* 4"),), "before* the gather"),
])
def test_policy_bytes_mistakes(edits, words):
    fails(ex4b, ns05(*edits), words=words)


def test_a_cpu_flag_is_caught_on_a_pretend_gpu(monkeypatch):
    """A flag made without device=dist.device() works on CPU ranks and fails on a GPU VM: the pretend GPU
    shows it here, as a verdict, not a traceback."""
    monkeypatch.setenv("MINIFSDP_FAKE_GPU", "2")
    fails(ex4a, ns05(("torch.tensor([float(mine)], device=dist.device())", "torch.tensor([float(mine)])")),
          words="your code raised")


EX4_SHARDED_HELPER = """
from minifsdp.mixed_precision import ShardedGradScaler

def agree(flag):
    return ShardedGradScaler()._sync_found_inf(flag)

def sharded_scaler_step(shard, opt, scaler):
    flag = torch.tensor(float(scaler.unscale_([p.grad for p in shard])), device=dist.device())
    found_inf = bool(agree(flag).item())
    if not found_inf:
        opt.step()
    scaler.update(found_inf)
    return found_inf
"""
EX4_SHARDED_HIDDEN = """
import importlib

def sharded_scaler_step(shard, opt, scaler):
    cls = getattr(importlib.import_module("minifsdp.mixed_precision"), "Sharded" + "GradScaler")
    flag = cls()._sync_found_inf(torch.tensor(float(scaler.unscale_([p.grad for p in shard])),
                                              device=dist.device()))
    found_inf = bool(flag.item())
    if not found_inf:
        opt.step()
    scaler.update(found_inf)
    return found_inf
"""
EX4_BYTES_ALIAS = """
from minifsdp.estimate import comm_bytes_per_step as predicted

def policy_bytes(units, mp):
    dtype = mp.param_dtype if mp and mp.param_dtype else torch.float32
    grad = mp.reduce_dtype or dtype if mp else torch.float32
    out = predicted([n for n, g in units if g == 2], 2, "full_shard", dtype,
                    root_numel=sum(n for n, g in units if g == 1), grad_dtype=grad)
    return {"all_gather": out["all_gather"], "reduce_scatter": out["reduce_scatter"]}
"""
EX4_BYTES_HIDDEN = """
def policy_bytes(units, mp):
    param = mp.param_dtype if mp is not None and mp.param_dtype is not None else torch.float32
    reduce = (mp.effective_reduce_dtype or param) if mp is not None else param   # the policy's own default logic
    return {"all_gather": sum(n * g for n, g in units) * param.itemsize,
            "reduce_scatter": sum(n for n, _ in units) * reduce.itemsize}
"""


def test_sharded_step_library_shortcuts():
    shortcut_fails(ex4, with_cell(EX4_SHARDED_HELPER))  # a helper using ShardedGradScaler's agreement
    message = shortcut_fails(ex4a, with_cell(EX4_SHARDED_HIDDEN))  # only the wire in the workers sees this one
    assert "ShardedGradScaler" in message, message


def test_policy_bytes_library_shortcuts():
    shortcut_fails(ex4, with_cell(EX4_BYTES_ALIAS.replace("predicted", "estimated_bytes")))  # refused statically
    shortcut_fails(ex4b, with_cell(EX4_BYTES_ALIAS))    # the estimate under another name
    message = shortcut_fails(ex4b, with_cell(EX4_BYTES_HIDDEN))   # a property: only the wire sees it run
    assert "effective_reduce_dtype" in message, message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
