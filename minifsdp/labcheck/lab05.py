"""Checks of lab 05 (mixed precision): underflow, the scaler's two rules, fp16 training, FSDP bytes.

The yardsticks are measurements made while the check runs and torch's own
kernels, never numbers copied from the lab:

* ``underflow``: the learner's fraction against casting real values and
  counting the zeros (fp16, bf16, fp32);
* ``unscale``: the learner's in-place unscale and inf/NaN flag against torch's
  ``_amp_foreach_non_finite_check_and_unscale_`` on the same gradients;
* ``update``: the learner's rule, step by step over a sequence of overflows,
  against torch's ``_amp_update_scale_`` and ``minifsdp.mixed_precision.update_scale``;
* ``rescue``: the learner's fp16 step with their scaler trains gpt-tiny like the
  same loop built on the library's scaler rules, and unlike fp16 without scaling;
* ``sharded_step``: the learner's step on N ranks of FSDP, an inf written into one
  rank's gradient shard, against ``ShardedGradScaler`` in the same loop: every rank
  skips the same steps, holds the same scale, ends with the library's shards;
* ``policy_bytes``: the learner's bytes per step for four precision policies
  against the tracer's count of a real 2-rank FSDP step.

Read ``verdict.py`` first, then ``minifsdp/mixed_precision``; the FSDP runs the last two
checks launch are in ``lab05_runs.py``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .. import data, dist, models
from ..mixed_precision import unscale_grads_, update_scale
from .lab05_runs import POLICIES, SHARDED_STEPS, fsdp_bytes, overflowing, sharded_worker
from .verdict import call, failed, figures, forbid, passed, require_written, run

SCALER_LIBRARY = ("GradScaler", "ShardedGradScaler", "unscale_grads_", "update_scale",
                  "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------ exercise 1: what underflows
def _values() -> torch.Tensor:
    """Magnitudes from 1e-46 to 1 (every fp16/bf16 region), both signs, and some exact zeros."""
    g = torch.Generator().manual_seed(5)
    mags = 10 ** (torch.rand(4000, generator=g, dtype=torch.float64) * 46 - 46)
    signs = torch.where(torch.rand(4000, generator=g) < 0.5, -1.0, 1.0).double()
    return torch.cat([(mags * signs).float(), torch.zeros(200)])


def underflow(underflow_fraction: Callable[[torch.Tensor, torch.dtype], float]) -> None:
    """``underflow_fraction(values, dtype)``: the share of the nonzero values that become 0 in ``dtype``."""
    what = "underflow fraction"
    require_written(what, underflow_fraction)
    v = _values()
    nonzero = v != 0
    lines = []
    for dtype in DTYPES:
        got = call(what, underflow_fraction, v.clone(), dtype)
        try:
            got = float(got)
        except (TypeError, ValueError):
            failed(what, f"return a number (a fraction between 0 and 1), got {type(got).__name__}")
        lost = (nonzero & (v.to(dtype) == 0)).sum().item()
        want = lost / nonzero.sum().item()
        if abs(got - want) > 1e-6:
            fi = torch.finfo(dtype)
            below_normal = (nonzero & (v.abs() < fi.smallest_normal)).sum().item() / nonzero.sum().item()
            name = str(dtype).replace("torch.", "")
            if abs(got - below_normal) < 1e-6:
                failed(what, f"{name}: you counted every value below the smallest *normal* number "
                             f"({fi.smallest_normal:.3g}); subnormals down to {fi.smallest_normal * fi.eps:.3g} "
                             "survive with fewer digits: count only the values that become exactly 0")
            if abs(got - lost / v.numel()) < 1e-6:
                failed(what, f"{name}: divide by the number of *nonzero* values: a value that was already 0 "
                             "did not underflow")
            if abs(got - (1 - want)) < 1e-6:
                failed(what, f"{name}: that is the share that survives; the question is the share that is lost")
            failed(what, f"{name}: {figures('fraction lost', got, want)} (cast, then count the nonzero inputs "
                         "whose cast is 0)")
        lines.append(f"{str(dtype).replace('torch.', '')} {got:.3f}")
    passed(what, "share of values from 1e-46 to 1 that round to 0: " + ", ".join(lines) + " (measured by casting)")


# ------------------------------------------------------------------ exercise 2a: unscale_
def _grad_cases() -> list[tuple[str, list[torch.Tensor], float]]:
    g = torch.Generator().manual_seed(7)
    clean = [torch.randn(5, 3, generator=g) * 1000, torch.randn(7, generator=g) * 3]
    inf_last = [torch.randn(4, generator=g), torch.tensor([1.0, math.inf, 2.0])]
    nan_first = [torch.tensor([math.nan, 1.0]), torch.randn(3, generator=g)]
    neg_inf = [torch.tensor([-math.inf]), torch.ones(2)]
    return [("finite gradients", clean, 1024.0), ("an inf in the last tensor", inf_last, 2.0**16),
            ("a NaN", nan_first, 8.0), ("a -inf", neg_inf, 3.0)]


def unscale(unscale_: Callable[[list[torch.Tensor], float], Any]) -> None:
    """``unscale_(grads, scale)``: grads /= scale in place; return True if any value is inf or NaN."""
    what = "unscale_"
    require_written(what, unscale_)
    forbid(what, unscale_, SCALER_LIBRARY, "it calls the library's or torch's unscale kernel: write the loop over "
           "the gradients yourself", unscale_grads_)
    for name, grads, scale in _grad_cases():
        theirs = [t.clone() for t in grads]
        torch_flag = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch_flag, torch.tensor(1.0 / scale))
        mine = [t.clone() for t in grads]
        objects = list(mine)
        got = call(what, unscale_, mine, scale)
        if any(a is not b for a, b in zip(mine, objects)) or all(torch.equal(a, b) for a, b in zip(mine, grads)):
            failed(what, f"{name}: the gradient tensors are unchanged; the optimizer reads p.grad, so change "
                         "those tensors in place (an in-place multiply), do not build new ones")
        finite = [torch.isfinite(t) for t in theirs]
        for m, t, f in zip(mine, theirs, finite):
            if not torch.allclose(m[f], t[f], rtol=1e-6, atol=0):
                ratio = (m[f] / t[f]).median().item() if f.any() else float("nan")
                hint = (f"they are {scale:g}x too large: each gradient holds S times the true value, divide by S"
                        if math.isclose(ratio, scale * scale, rel_tol=1e-3) else
                        f"they come out {ratio:.3g}x the true gradients: multiply by 1/S once")
                failed(what, f"{name} (S = {scale:g}): {hint}")
        if bool(got) != bool(torch_flag.item()):
            if torch_flag.item():
                kind = "NaN" if "NaN" in name else "inf"
                failed(what, f"{name}: you returned {got!r} but there is a {kind}: check every value of every "
                             "tensor for inf *and* NaN (torch.isfinite says both)")
            failed(what, f"{name}: you reported an overflow in finite gradients (returned {got!r})")
    passed(what, f"{len(_grad_cases())} gradient lists: divided by S in place, inf/NaN flags equal to torch's "
                 "_amp_foreach_non_finite_check_and_unscale_")


# ------------------------------------------------------------------ exercise 2b: update
OVERFLOWS = [0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
RULE = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def _torch_update(scale: float, tracker: int, found: int) -> tuple[float, int]:
    s, t = torch.tensor(scale, dtype=torch.float32), torch.tensor(tracker, dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor(float(found)), RULE["growth_factor"], RULE["backoff_factor"],
                             RULE["growth_interval"])
    return s.item(), int(t.item())


def update(update_scale_fn: Callable[..., tuple[float, int]]) -> None:
    """``update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)``."""
    what = "update rule"
    require_written(what, update_scale_fn)
    forbid(what, update_scale_fn, SCALER_LIBRARY, "it calls the library's or torch's update: write the rule yourself",
           update_scale)
    scale, tracker = 2.0**10, 0
    for i, found in enumerate(OVERFLOWS):
        want = _torch_update(scale, tracker, found)
        assert want == update_scale(scale, tracker, bool(found), **RULE), "library and torch disagree"
        got = call(what, update_scale_fn, scale, tracker, bool(found), RULE["growth_factor"],
                   RULE["backoff_factor"], RULE["growth_interval"])
        if not (isinstance(got, tuple) and len(got) == 2):
            failed(what, "return a pair (new scale, new count of clean steps in a row)")
        got = (float(got[0]), int(got[1]))
        if got != want:
            event = "an overflow" if found else f"clean step {tracker + 1} in a row (growth_interval 3)"
            if found and got[0] == want[0]:
                why = "after an overflow the count of clean steps starts again from 0"
            elif found:
                why = "an overflow multiplies the scale by backoff_factor (0.5)"
            elif want[0] > scale and got[0] == scale:
                why = "the scale grows on the growth_interval-th clean step in a row, counting this step"
            elif want[0] == scale and got[0] > scale:
                why = ("too early: grow only when the count, this step included, reaches growth_interval"
                       if tracker + 1 < RULE["growth_interval"] else "after growing, the count starts again from 0")
            elif want[0] > scale and got[1] != 0:
                why = "after growing, the count of clean steps starts again from 0"
            else:
                why = "a clean step adds one to the count and keeps the scale until the count reaches growth_interval"
            failed(what, f"step {i}, {event}, from (scale {scale:g}, count {tracker}): yours {got}, expected "
                         f"{want}: {why}")
        scale, tracker = want
    library = (2.0**10, 0)
    for found in OVERFLOWS:
        library = update_scale(*library, bool(found), **RULE)
    passed(what, figures(f"{len(OVERFLOWS)} steps with {sum(OVERFLOWS)} overflows, final scale", scale, scale,
                         library[0]) + " (torch's _amp_update_scale_ agreed at every step)")


def scaler_rules(unscale_fn: Callable[[list[torch.Tensor], float], Any], update_scale_fn: Callable[..., Any]) -> None:
    """Exercise 2: both rules of the scaler, each against torch's kernel (one verdict line each)."""
    unscale(unscale_fn)
    update(update_scale_fn)


# ------------------------------------------------------------------ exercise 3: fp16 training, rescued
RESCUE_STEPS, RESCUE_BATCH, RESCUE_SEQ = 12, 8, 32
SHRINK = 2.0**-16      # puts gpt-tiny's gradients where a large model's are (below fp16's range)


def _fp16_setup() -> tuple[torch.nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
    model16 = models.build_model("gpt-tiny", seed=0).half()
    master = [p.detach().float().requires_grad_() for p in model16.parameters()]
    return model16, master, torch.optim.AdamW(master, lr=3e-3, eps=1e-16)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return models.lm_loss(logits.float(), y) * SHRINK   # the loss in fp32, as autocast computes it


def _scales(scales: list[float]) -> list[str]:
    return [f"{s:g}" for s in scales]


@functools.lru_cache(maxsize=None)
def _reference_run(init_scale: float, scaled: bool = True) -> tuple[list[float], list[float]]:
    """The same loop with the library's rules: (losses, scales)."""
    model16, master, opt = _fp16_setup()
    scale, tracker, losses, scales = (init_scale if scaled else 1.0), 0, [], []
    for step in range(RESCUE_STEPS):
        x, y = data.get_batch(step, RESCUE_BATCH, RESCUE_SEQ)
        loss = _loss(model16(x), y)
        (loss * scale).backward()
        for p16, p32 in zip(model16.parameters(), master):
            p32.grad, p16.grad = p16.grad.float(), None
        found = bool(unscale_grads_([p.grad for p in master], torch.tensor(1.0 / scale)).item())
        if not found:
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p16, p32 in zip(model16.parameters(), master):
                p16.copy_(p32)
        if scaled:
            scale, tracker = update_scale(scale, tracker, found, 2.0, 0.5, 4)
        losses.append(loss.item() / SHRINK)
        scales.append(scale)
    return losses, scales


def rescue(fp16_train_step: Callable[..., float], LossScaler: type) -> None:
    """``fp16_train_step(model16, master, opt, batch, loss_fn, scaler) -> loss``, with the lab's ``LossScaler``."""
    what = "fp16 training with loss scaling"
    require_written(what, fp16_train_step)
    forbid(what, fp16_train_step, (*SCALER_LIBRARY, "autocast", "FullyShardedDataParallel"),
           "it uses {name}: write the step with your own scaler (scaler.scale, scaler.unscale_, scaler.update)")
    init_scale = 2.0**36   # too large at first: the first steps overflow, are skipped, and the scale backs off
    scaler = call(what, LossScaler, init_scale=init_scale, growth_interval=4)
    model16, master, opt = _fp16_setup()
    losses, scales = [], []
    for step in range(RESCUE_STEPS):
        before16 = next(model16.parameters()).detach().clone()
        got = call(what, fp16_train_step, model16, master, opt,
                   data.get_batch(step, RESCUE_BATCH, RESCUE_SEQ), _loss, scaler)
        losses.append(float(got) / SHRINK)
        scales.append(float(scaler.scale))
        if not all(torch.isfinite(p).all() for p in master):
            failed(what, f"step {step}: the fp32 master weights hold inf/NaN: when unscale_ finds an overflow, "
                         "skip optimizer.step() (and still update the scale)")
        if step == RESCUE_STEPS - 1 and torch.equal(before16, next(model16.parameters()).detach()) \
                and not torch.equal(before16, master[0].detach().half()):
            failed(what, "the fp16 model never changes: after the optimizer updates the fp32 master, copy the "
                         "master back into the fp16 parameters")
    want_losses, want_scales = _reference_run(init_scale)
    unscaled, _ = _reference_run(init_scale, scaled=False)
    if losses[0] - losses[-1] < 0.5 * (want_losses[0] - want_losses[-1]):
        failed(what, f"your loss barely falls ({losses[0]:.3f} -> {losses[-1]:.3f}; with scaling it reaches "
                     f"{want_losses[-1]:.3f}, fp16 without scaling {unscaled[-1]:.3f}): the gradients underflow in "
                     "fp16; multiply the loss by scaler.scale before backward")
    if scales == [init_scale] * RESCUE_STEPS:
        failed(what, "the scale never changed although the first steps overflow: call scaler.update(found_inf) "
                     "once per step")
    if scales != want_scales:
        failed(what, f"scales {_scales(scales[:6])}... differ from the rule's {_scales(want_scales[:6])}...: one "
                     "unscale_ and one update per step, after backward")
    if max(abs(a - b) for a, b in zip(losses, want_losses)) > 1e-3:
        failed(what, f"{figures('final loss', losses[-1], want_losses[-1])}: your losses differ from the same loop "
                     "built on the library's rules (one scaled backward, unscale, step unless overflow, copy back)")
    skipped = sum(1 for a, b in zip([init_scale] + scales, scales) if b < a)
    passed(what, figures(f"{RESCUE_STEPS} steps ({skipped} skipped on overflow), final loss", losses[-1],
                         want_losses[-1]) + f"; fp16 without scaling {unscaled[-1]:.3f}")


# ------------------------------------------------------------------ exercise 3b: every rank skips the same step
def sharded_step(sharded_scaler_step: Callable[..., Any], LossScaler: type) -> None:
    """``sharded_scaler_step(shard, opt, scaler) -> found_inf`` on N ranks of FSDP, an inf on one rank's shard."""
    what = "every rank skips the same step"
    require_written(what, sharded_scaler_step)
    forbid(what, sharded_scaler_step, ("GradScaler", "ShardedGradScaler", "unscale_grads_", "_sync_found_inf",
                                       "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"),
           "it uses the library's {name}: agree on the flag yourself (your scaler, one all-reduce)")
    n = dist.lab_world_size(2)
    yours, library = zip(*run(what, sharded_worker, n, sharded_scaler_step, LossScaler))
    want = [not overflowing(step, n) for step in range(SHARDED_STEPS)]      # stepped?
    for step in range(SHARDED_STEPS):
        bad, did = overflowing(step, n), [res["stepped"][step] for res in yours]
        if did == [want[step]] * n:
            continue
        if not bad:
            failed(what, f"step {step}: no shard overflowed but rank {did.index(False)} skipped the step")
        if len(bad) == n:
            failed(what, f"step {step}: every rank's shard holds an inf/NaN and rank {did.index(True)} still "
                         "stepped: skip opt.step() when the flag says overflow")
        who = f"only rank {min(bad)}'s shard overflowed"
        if any(did[r] for r in bad):
            failed(what, f"step {step}: {who}, and it stepped anyway: a step is skipped when *any* rank "
                         "overflowed, so combine the flags with MAX (MIN or an average skips only when all do)")
        failed(what, f"step {step}: {who}, but rank {did.index(True)} stepped: its own shard was clean, so it "
                     "never knew; all-reduce the flag (MAX) before deciding, so every rank skips the same step")
    for r, res in enumerate(yours):
        if res["found"] != [not w for w in want]:
            step = next(i for i, (f, w) in enumerate(zip(res["found"], want)) if f == w)
            failed(what, f"step {step}: rank {r} returned found_inf={res['found'][step]}: return the flag all ranks "
                         "agreed on")
        if res["scales"] != yours[0]["scales"]:
            step = next(i for i, (a, b) in enumerate(zip(res["scales"], yours[0]["scales"])) if a != b)
            failed(what, f"after step {step} rank 0 holds scale {yours[0]['scales'][step]:g} and rank {r} "
                         f"{res['scales'][step]:g}: update every rank's scaler with the agreed flag")
    if yours[0]["scales"] != library[0]["scales"]:
        failed(what, f"scales {_scales(yours[0]['scales'])} differ from ShardedGradScaler's "
                     f"{_scales(library[0]['scales'])}: one unscale_ and one update(found_inf) per step")
    for r in range(n):
        diff = max((a - b).abs().max().item() for a, b in zip(yours[r]["shard"], library[r]["shard"]))
        if not diff == 0.0:
            failed(what, f"rank {r}'s shard after {SHARDED_STEPS} steps differs from ShardedGradScaler's by {diff:.3g}"
                         ": unscale the gradients (your scaler's unscale_) before opt.step()")
    skipped = lambda res: [i for i, s in enumerate(res["stepped"]) if not s]  # noqa: E731
    passed(what, figures(f"{n} FSDP ranks, an overflow in rank {n - 1}'s shard at step 3, rank 0's at 7, every "
                         "rank's at 8; steps skipped on every rank",
                         skipped(yours[0]), [i for i, w in enumerate(want) if not w], skipped(library[0]))
           + f"; final scale {yours[0]['scales'][-1]:g}, shards equal to ShardedGradScaler's")


# ------------------------------------------------------------------ exercise 4: the policy's bytes
@functools.lru_cache(maxsize=None)
def _measured_bytes() -> tuple:
    """The tracer's bytes of one FSDP step per policy, on 2 ranks (measured once per process)."""
    return tuple(run("bytes per step by precision policy", fsdp_bytes, dist.lab_world_size(2), POLICIES)[0].items())


def policy_bytes(predict: Callable[[list[tuple[int, int]], Any], dict[str, int]]) -> None:
    """``predict(units, mp) -> {"all_gather": bytes, "reduce_scatter": bytes}`` for one FSDP step."""
    what = "bytes per step by precision policy"
    require_written(what, predict)
    measured = dict(_measured_bytes())
    units = measured.pop("units")
    lines = []
    for name, mp in POLICIES.items():
        got = call(what, predict, list(units), mp)
        if not isinstance(got, dict) or not {"all_gather", "reduce_scatter"} <= set(got):
            failed(what, "return a dict with the keys 'all_gather' and 'reduce_scatter' (bytes per step)")
        want = {op: sum(v for k, v in measured[name].items() if op in k) for op in ("all_gather", "reduce_scatter")}
        for op in ("all_gather", "reduce_scatter"):
            if int(got[op]) != want[op]:
                ratio = int(got[op]) / want[op]
                if name == "bf16 (reduce_dtype None)" and op == "reduce_scatter" and math.isclose(ratio, 2.0):
                    why = "reduce_dtype=None means 'same as param_dtype', not fp32"
                elif math.isclose(ratio, 2.0) and op == "all_gather":
                    why = "the shard is cast to param_dtype *before* the gather: 2 bytes per element in bf16"
                elif math.isclose(ratio, 0.5) or math.isclose(ratio, 2.0):
                    why = "bytes per element of the dtype this collective runs in (fp32 4, bf16 2)"
                else:
                    why = "count each unit's elements once per gather (all-gather) or once (reduce-scatter)"
                failed(what, f"{name}, {op}: {figures('bytes', int(got[op]), want[op])}: {why}")
        lines.append(f"{name} {want['all_gather']:,}+{want['reduce_scatter']:,} B")
    passed(what, "yours = the tracer's count of a 2-rank FSDP step for every policy (all-gather+reduce-scatter): "
                 + "; ".join(lines))
