"""The checks of lab 05 (minifsdp.labcheck.lab05): pass on the solution, fail in words otherwise.

The learner's functions are the notebook's own cells (solutions/src/05_mixed_precision.py),
exec'd into a fresh ``__main__`` namespace as a notebook runs them: as written (the
solution), as the blank lab has them (``NotImplementedError``), or with one line changed
(a typical mistake). Each check must pass on the first and raise ``CheckFailed`` with a
one-line reason that names the mistake on the others.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minifsdp.labcheck import lab05
from minifsdp.labcheck.verdict import CheckFailed

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "solutions" / "src" / "05_mixed_precision.py"
sys.path.insert(0, str(ROOT / "tools"))
import notebooks as nbt  # noqa: E402


def notebook(blank: bool = False, old: str = "", new: str = "") -> dict:
    """The import cell and the cells that define the exercises and ``LossScaler``, run as a notebook would."""
    text = SOURCE.read_text(encoding="utf-8")
    assert old in text, f"the mistake no longer matches the notebook: {old!r}"
    cells = [c.source for c in nbt.parse_source(text, SOURCE.name) if c.cell_type == "code"]
    ns: dict = {"__name__": "__main__"}
    for i, src in enumerate(cells):
        if i and "# BEGIN SOLUTION" not in src and "class LossScaler" not in src or "def one_overflow_step" in src:
            continue
        src = nbt.make_lab_source(src)[0] if blank and "# BEGIN SOLUTION" in src else src.replace(old, new)
        exec(compile(src, f"<05 cell {i}>", "exec"), ns)
    return ns


def verdict(check, *args) -> str:
    with pytest.raises(CheckFailed) as info:
        check(*args)
    message = str(info.value)
    assert "\n" not in message.strip(), "a verdict is one line"
    return message


def test_solution_passes_every_check(capsys):
    ns = notebook()
    lab05.underflow(ns["underflow_fraction"])
    lab05.scaler_rules(ns["unscale_"], ns["update_scale"])
    lab05.rescue(ns["fp16_train_step"], ns["LossScaler"])
    lab05.sharded_step(ns["sharded_scaler_step"], ns["LossScaler"])
    lab05.policy_bytes(ns["policy_bytes"])
    out = capsys.readouterr().out
    assert out.count("✅") == 6, out   # underflow, unscale + update (scaler_rules), rescue, sharded step, bytes
    assert "steps skipped on every rank: yours [3, 7, 8], target [3, 7, 8], library [3, 7, 8]" in out, out


def test_blank_lab_is_not_written_yet():
    ns = notebook(blank=True)
    for check, args in ((lab05.underflow, ["underflow_fraction"]), (lab05.scaler_rules, ["unscale_", "update_scale"]),
                        (lab05.update, ["update_scale"]), (lab05.rescue, ["fp16_train_step", "LossScaler"]),
                        (lab05.sharded_step, ["sharded_scaler_step", "LossScaler"]),
                        (lab05.policy_bytes, ["policy_bytes"])):
        assert "not written yet" in verdict(check, *(ns[a] for a in args))


@pytest.mark.parametrize("old, new, words", [
    ("lost = nonzero & (values.to(dtype) == 0)",
     "lost = nonzero & (values.abs() < torch.finfo(dtype).smallest_normal)", "subnormals"),
    ("return lost.sum().item() / nonzero.sum().item()", "return lost.sum().item() / values.numel()",
     "divide by the number of *nonzero* values"),
])
def test_underflow_mistakes(old, new, words):
    assert words in verdict(lab05.underflow, notebook(old=old, new=new)["underflow_fraction"])


@pytest.mark.parametrize("old, new, words", [
    ("        g.mul_(1.0 / scale)\n", "        g = g * (1.0 / scale)\n", "in place"),
    ("not bool(torch.isfinite(g).all())", "bool(torch.isinf(g).any())", "inf *and* NaN"),
    ("g.mul_(1.0 / scale)", "g.mul_(scale)", "too large"),
])
def test_unscale_mistakes(old, new, words):
    assert words in verdict(lab05.unscale, notebook(old=old, new=new)["unscale_"])


def test_unscale_tells_the_library_from_the_learner():
    from minifsdp.mixed_precision import unscale_grads_
    assert "library" in verdict(lab05.unscale, unscale_grads_)


@pytest.mark.parametrize("old, new, words", [
    ("return scale * growth_factor, 0", "return scale * growth_factor, tracker", "after growing"),
    ("return scale * backoff_factor, 0", "return scale * backoff_factor, tracker", "starts again from 0"),
    ("if tracker == growth_interval:", "if tracker == growth_interval + 1:", "growth_interval-th clean step"),
])
def test_update_mistakes(old, new, words):
    assert words in verdict(lab05.update, notebook(old=old, new=new)["update_scale"])


@pytest.mark.parametrize("old, new, words", [
    ("(loss * scaler.scale).backward()", "loss.backward()", "multiply the loss by scaler.scale"),
    ("            p16.copy_(p32)\n    scaler.update", "            pass\n    scaler.update", "copy the master back"),
    ("    if not found_inf:\n        opt.step()", "    opt.step()", "skip optimizer.step()"),
    ("self.scale, self.tracker = update_scale(", "self.scale, _ = update_scale(", "differ from the rule's"),
])
def test_rescue_mistakes(old, new, words):
    ns = notebook(old=old, new=new)
    assert words in verdict(lab05.rescue, ns["fp16_train_step"], ns["LossScaler"])


@pytest.mark.parametrize("old, new, words", [
    ("is not None else param\n", "is not None else torch.float32\n", "reduce_dtype=None means"),
    ("sum(numel * gathers for numel, gathers in units)", "sum(numel for numel, _ in units)", "once per gather"),
])
def test_policy_bytes_mistakes(old, new, words):
    assert words in verdict(lab05.policy_bytes, notebook(old=old, new=new)["policy_bytes"])


@pytest.mark.parametrize("old, new, words", [
    # each rank decides alone: rank 0 steps while the last rank skips
    ("    comm.all_reduce(flag, op=comm.ReduceOp.MAX)", "    pass", "all-reduce the flag (MAX) before deciding"),
    # MIN: skipped only when every rank overflowed
    ("op=comm.ReduceOp.MAX", "op=comm.ReduceOp.MIN", "*any* rank overflowed"),
    # the scale updated with this rank's own flag: the ranks' scales drift apart
    ("scaler.update(found_inf)\n    return", "scaler.update(mine)\n    return", "update every rank's scaler"),
])
def test_sharded_step_mistakes(old, new, words):
    ns = notebook(old=old, new=new)
    assert words in verdict(lab05.sharded_step, ns["sharded_scaler_step"], ns["LossScaler"])


def test_sharded_step_tells_the_library_from_the_learner():
    import minifsdp.mixed_precision as mp

    def with_library(shard, opt, scaler):
        mp.ShardedGradScaler().step(opt)
    assert "library's ShardedGradScaler" in verdict(lab05.sharded_step, with_library, object)
