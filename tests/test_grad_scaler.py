"""minifsdp.mixed_precision.GradScaler / ShardedGradScaler against torch.amp.GradScaler.

* One rank, 20 steps of gpt-tiny with overflows (a huge initial scale that
  overflows by itself, an inf and a NaN injected into a gradient, clipping
  after ``unscale_`` on some steps): bit-identical scales, losses, gradient
  norms and parameters to ``torch.amp.GradScaler("cpu")`` — the arithmetic is
  the same (multiply by the fp32 reciprocal of the scale; skip; back off/grow).
* FSDP at 2 and 4 ranks with ``ShardedGradScaler``: an inf injected into one
  rank's gradient shard makes *every* rank skip that step (its shard is
  unchanged) and back off to the same scale; clipping after ``unscale_`` with
  FSDP's ``clip_grad_norm_``. Losses and norms equal the single process with
  torch's scaler and the same injections within fp32 tolerance (1e-5 relative:
  a sum over ranks rounds differently from one sum).
* Growth after ``growth_interval`` clean steps; state dicts interchangeable
  with torch's; bad input gets a one-line error or warning.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

from fsdp_helpers import gpt_batch
from minifsdp import launch
from minifsdp.mixed_precision import (GradScaler, ShardedGradScaler, check_dtype_supported, policy, unscale_grads_,
                                      update_scale)
from minifsdp.models import build_model, lm_loss

STEPS = 20
INJECT = {5: math.inf, 11: math.nan}   # step -> value written into one gradient
CLIP_STEPS = {3, 5, 8, 12}             # steps that unscale_, then clip, then step
SCALER_KW = dict(init_scale=2.0**127, growth_interval=3)  # 2**127 overflows by itself at first
# Sharded: only the injected overflows (near fp32's max, a rank's partial gradient, not yet
# divided by N, overflows where the single process's does not: a different, correct, history).
SHARDED_KW = dict(init_scale=2.0**16, growth_interval=3)


def _run_single(scaler, steps=STEPS):
    """One process, plain model: (losses, scales, norms, final params) with ``scaler``."""
    model = build_model("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, scales, norms = [], [], []
    for step in range(steps):
        x, y = gpt_batch(step)
        loss = lm_loss(model(x), y)
        scaler.scale(loss).backward()
        if step in INJECT:
            model.head.weight.grad[0, 0] = INJECT[step]
        if step in CLIP_STEPS:
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, norms, [p.detach().clone() for p in model.parameters()]


def test_bit_parity_with_torch_grad_scaler_over_20_steps_with_overflows():
    ours = _run_single(GradScaler("cpu", **SCALER_KW))
    theirs = _run_single(torch.amp.GradScaler("cpu", **SCALER_KW))
    assert ours[1] == theirs[1], f"scale histories differ:\n{ours[1]}\n{theirs[1]}"
    assert ours[0] == theirs[0], "losses differ"
    assert [repr(n) for n in ours[2]] == [repr(n) for n in theirs[2]], "clip norms differ"
    assert all(torch.equal(a, b) for a, b in zip(ours[3], theirs[3])), "parameters are not bit-identical"
    # the run did exercise what it claims: natural overflow, injected skips, growth
    assert ours[1][0] == 2.0**126 and ours[1][5] < ours[1][4] and ours[1][11] < ours[1][10]
    assert any(b > a for a, b in zip(ours[1], ours[1][1:])), "the scale never grew"


def _fsdp_run(inject_rank):
    import torch.distributed as tdist

    from minifsdp.fsdp import FullyShardedDataParallel as FSDP
    from minifsdp.fsdp.sharded_grad_scaler import ShardedGradScaler as Scaler

    n, r = tdist.get_world_size(), tdist.get_rank()
    model = FSDP(build_model("gpt-tiny", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = Scaler(**SHARDED_KW)
    losses, scales, norms, skipped_unchanged = [], [], [], []
    for step in range(STEPS):
        x, y = gpt_batch(step)
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        loss = lm_loss(model(x[rows]), y[rows])
        scaler.scale(loss).backward()
        if step in INJECT and r == inject_rank:   # only this rank's shard sees the overflow
            next(iter(model.parameters())).grad[0] = INJECT[step]
        if step in CLIP_STEPS:
            scaler.unscale_(opt)
            norms.append(model.clip_grad_norm_(1.0).item())
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if step in INJECT:
            skipped_unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
        opt.zero_grad()
        loss = loss.detach()
        tdist.all_reduce(loss)
        losses.append(loss.item() / n)
        scales.append(scaler.get_scale())
    return losses, scales, norms, skipped_unchanged


@functools.lru_cache(maxsize=None)
def _sharded_reference():
    return _run_single(torch.amp.GradScaler("cpu", **SHARDED_KW))


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_scaler_one_rank_overflow_makes_every_rank_skip(world_size):
    ref_losses, ref_scales, ref_norms, _ = _sharded_reference()
    results = launch(_fsdp_run, world_size, world_size - 1, timeout=180)
    for rank, (losses, scales, norms, unchanged) in enumerate(results):
        assert unchanged == [True] * len(INJECT), f"rank {rank} stepped on an overflow another rank saw"
        assert scales == ref_scales, f"rank {rank} scale history {scales} != single process {ref_scales}"
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank} losses drift from single process"
        finite = [(a, b) for a, b in zip(norms, ref_norms) if math.isfinite(b)]
        assert [a for a, _ in finite] == pytest.approx([b for _, b in finite], rel=1e-5), "clip norms differ"


def test_growth_after_growth_interval_clean_steps_and_backoff():
    assert update_scale(8.0, 0, False, 2.0, 0.5, 3) == (8.0, 1)
    assert update_scale(8.0, 1, False, 2.0, 0.5, 3) == (8.0, 2)
    assert update_scale(8.0, 2, False, 2.0, 0.5, 3) == (16.0, 0)
    assert update_scale(16.0, 2, True, 2.0, 0.5, 3) == (8.0, 0)
    assert update_scale(2.0**127, 2, False, 2.0, 0.5, 3) == (2.0**127, 0), "growth past fp32 max must not happen"
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0, growth_interval=3)
    seen = []
    for _ in range(7):
        scaler.scale(w.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append(scaler.get_scale())
    assert seen == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_unscale_multiplies_by_reciprocal_and_flags_non_finite():
    g = [torch.tensor([3.0, -6.0]), torch.tensor([1.0])]
    assert unscale_grads_(g, torch.tensor(1 / 3.0)).item() == 0.0
    assert torch.equal(g[0], torch.tensor([3.0, -6.0]) * torch.tensor(1 / 3.0)), "unscale must multiply in fp32"
    assert unscale_grads_([torch.tensor([1.0, math.nan])], torch.tensor(1.0)).item() == 1.0


def test_state_dict_moves_between_torch_and_ours():
    ours = GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 1024.0 and theirs.get_growth_interval() == 7
    back = GradScaler("cpu")
    back.load_state_dict(theirs.state_dict())
    assert back.state_dict() == ours.state_dict()
    assert GradScaler("cpu", enabled=False).state_dict() == {}


def test_disabled_scaler_is_a_pass_through():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = GradScaler("cpu", enabled=False)
    loss = w.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [0.0, 0.0] and scaler.get_scale() == 1.0


def test_bad_input_gets_one_line_messages():
    with pytest.warns(UserWarning, match="bfloat16 is unnecessary: bf16 has fp32's 8-bit exponent"):
        GradScaler("cpu").scale(torch.ones((), dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="unnecessary"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            GradScaler("cpu").scale(torch.ones(()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradScaler("cpu").scale(torch.ones((), dtype=torch.float16))   # fp16: no warning
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    w.grad = torch.ones(2, dtype=torch.float16)
    opt = torch.optim.SGD([w], lr=1.0)
    with pytest.raises(ValueError, match="fp16 gradients .* keep fp32 master weights"):
        GradScaler("cpu").unscale_(opt)
    ShardedGradScaler("cpu").unscale_(opt)   # the sharded one accepts them, as torch's does
    scaler = GradScaler("cpu")
    w32 = torch.nn.Parameter(torch.ones(2))
    w32.grad = torch.ones(2)
    opt32 = torch.optim.SGD([w32], lr=1.0)
    scaler.unscale_(opt32)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt32)
    with pytest.raises(RuntimeError, match="no inf checks"):
        GradScaler("cpu").update()
    with pytest.raises(ValueError, match="growth_factor must be > 1.0"):
        GradScaler("cpu", growth_factor=1.0)


def test_fp16_where_the_device_cannot_compute_it(monkeypatch):
    check_dtype_supported(torch.float16, "cpu")   # torch 2.13 computes fp16 on CPU
    monkeypatch.setattr(policy, "_can_compute", lambda dtype, device_type: False)
    with pytest.raises(ValueError, match="cpu cannot compute in torch.float16 .* use precision fp32 or bf16"):
        check_dtype_supported(torch.float16, "cpu")
    with pytest.raises(ValueError, match="cpu cannot compute in torch.float16"):
        policy.autocast("cpu", torch.float16)        # the autocast helper checks too (FSDP: test_mixed_precision)
