"""Checks of lab 05 (mixed precision): what 16 bits lose, a loss scaler, an fp16 step, FSDP's precision.

The yardsticks are measurements made while the check runs and torch's own
kernels, never numbers copied from the lab:

* ``lost_in_16_bits`` (exercise 1): the learner's underflow and swamping fractions
  against casting real values and counting (fp16, bf16, fp32);
* ``loss_scaler`` (2): the learner's ``LossScaler`` against torch's
  ``_amp_foreach_non_finite_check_and_unscale_`` (unscale and flag) and
  ``_amp_update_scale_`` (the scale, step by step over a sequence of overflows);
* ``rescue`` (3): the learner's fp16 step with their scaler trains gpt-tiny like the
  same loop built on the library's scaler rules, and unlike fp16 without scaling;
* ``fsdp_precision`` (4): the learner's sharded step on 2 FSDP ranks, an inf written
  into one rank's gradient shard, against ``ShardedGradScaler`` in the same loop (every
  rank skips the same steps, holds the same scale, ends with the library's shards), and
  the learner's bytes per step for four precision policies against the tracer's count.

Every exercise is held to "your own mechanism": ``refuse_library`` reads the learner's
code (aliases, helpers, subclasses) and a tripwire (``verdict.watched``, a ``Wire``) watches it run, on
the library's scalers and byte logic, torch's scalers and amp kernels included.
``hint(name)`` gives the next hint of an exercise. Read ``verdict.py`` first; the runs the
FSDP check launches are in ``lab05_runs.py``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .. import data as _data
from .. import models as _models
from ..mixed_precision import unscale_grads_ as _unscale_grads_
from ..mixed_precision import update_scale as _update_scale
from . import lab05_runs as _runs
from .verdict import Hints, call, check_world, failed, figures, passed, refuse_library, require_written, run
from .verdict import watched as _watched  # private: the check module's public names are its checks

hint = Hints({
    "underflow_fraction": [
        "Casting to dtype is the experiment: store each value in dtype and look at what comes back.",
        "A value underflows when it was nonzero and its cast is exactly 0; subnormals come back nonzero.",
        "Boolean masks count; the denominator is the number of nonzero values, not of all values.",
    ],
    "swamped_fraction": [
        "Precision, not range: a weight keeps ~8 significant bits in bf16, so a small enough update is "
        "rounded away when added.",
        "Store the weights and the updates in dtype, add them there, and compare the sum with the stored "
        "weight.",
        "Compare with the weight as stored in dtype (its cast), not the fp32 original; a bf16 tensor plus an "
        "fp32 one computes in fp32. Divide by the nonzero updates.",
    ],
    "LossScaler": [
        "An overflow means S was too large: shrink it at once. Only a long enough run of clean steps earns "
        "a larger S.",
        "The state is the scale and the number of clean steps in a row. unscale_ changes each gradient "
        "tensor itself (the optimizer reads those objects) and reports any inf or NaN in any of them.",
        "update has two cases. In the clean case count this step first, then compare with growth_interval; "
        "after growing or backing off, the count starts again from 0.",
    ],
    "fp16_train_step": [
        "Gradients survive fp16 only if the loss was multiplied by S before backward; the optimizer must see "
        "the true gradients, in fp32, on the master copy, and never an inf.",
        "Forward and scaled backward in fp16; give each master parameter its fp16 gradient as an fp32 .grad; "
        "unscale and check; step only when clean; clear the gradients.",
        "The fp16 model must end the step holding the master's new values (copied without autograd), and "
        "the scale moves on every step, overflow or not.",
    ],
    "sharded_scaler_step": [
        "Each rank sees only its own shard: the decision to skip must be the same on every rank, so the "
        "ranks must share their flags.",
        "Your scaler gives this rank's flag; make it a one-element tensor on dist.device(), combine it "
        "across ranks with one collective, then decide and update the scale with the combined flag.",
        "Which reduce op turns 'some rank has 1' into 1 everywhere? MIN or an average would skip only when "
        "every rank overflowed.",
    ],
    "policy_bytes": [
        "Each collective moves elements x bytes per element, in the dtype it runs in.",
        "All-gather: every unit's elements once per gather, in param_dtype. Reduce-scatter: each unit's "
        "elements once, in reduce_dtype.",
        "None means a default: no policy or param_dtype None is fp32; reduce_dtype None is 'same as "
        "param_dtype'. dtype.itemsize gives the bytes per element.",
    ],
})

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fraction(what: str, got: Any) -> float:
    try:
        return float(got)
    except (TypeError, ValueError):
        failed(what, f"return a number (a fraction between 0 and 1), got {type(got).__name__}")
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ exercise 1: what 16 bits lose
def _values() -> torch.Tensor:
    """Magnitudes from 1e-46 to 1 (every fp16/bf16 region), both signs, and some exact zeros."""
    g = torch.Generator().manual_seed(5)
    mags = 10 ** (torch.rand(4000, generator=g, dtype=torch.float64) * 46 - 46)
    signs = torch.where(torch.rand(4000, generator=g) < 0.5, -1.0, 1.0).double()
    return torch.cat([(mags * signs).float(), torch.zeros(200)])


def _weights_and_updates() -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as a model has them (small, near 1 like a norm's, of order 1) and updates from 1e-9 to 0.1."""
    g = torch.Generator().manual_seed(11)
    n = 4000
    w = torch.cat([torch.randn(n // 2, generator=g) * 0.02, 1 + 0.1 * torch.randn(n // 4, generator=g),
                   torch.randn(n // 4, generator=g)])
    mags = 10 ** (torch.rand(n, generator=g, dtype=torch.float64) * 8 - 9)
    u = (mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()).float()
    u[::20] = 0
    return w, u


def _lost(values: torch.Tensor, dtype: torch.dtype) -> float:
    nonzero = values != 0
    return (nonzero & (values.to(dtype) == 0)).sum().item() / nonzero.sum().item()


def _swamped(w: torch.Tensor, u: torch.Tensor, dtype: torch.dtype, stored: bool = True) -> float:
    """Share of nonzero updates that leave the weight unchanged: both stored in dtype and added there
    (``stored``), or added in fp32 and rounded (what ``param.add_`` of an fp32 update does: also right)."""
    nonzero, w16 = u != 0, w.to(dtype)
    same = (w16 + u.to(dtype)) == w16 if stored else (w + u).to(dtype) == w16
    return (nonzero & same).sum().item() / nonzero.sum().item()


_EXERCISE1_LIBRARY = (_lost, _swamped)   # no library function computes these: the check's own answers


def _underflow(underflow_fraction: Callable[..., Any]) -> str:
    what = "what 16 bits lose (underflow_fraction)"
    v, lines = _values(), []
    nonzero = v != 0
    for dtype in _DTYPES:
        got = _fraction(what, call(what, _watched(underflow_fraction, *_EXERCISE1_LIBRARY), v.clone(), dtype))
        want = _lost(v, dtype)
        if abs(got - want) > 1e-6:
            fi, name = torch.finfo(dtype), _name(dtype)
            below_normal = (nonzero & (v.abs() < fi.smallest_normal)).sum().item() / nonzero.sum().item()
            if abs(got - below_normal) < 1e-6:
                failed(what, f"{name}: you counted every value below the smallest *normal* number "
                             f"({fi.smallest_normal:.3g}); subnormals down to {fi.smallest_normal * fi.eps:.3g} "
                             "survive with fewer digits: count only the values that become exactly 0")
            if abs(got - want * nonzero.sum().item() / v.numel()) < 1e-6:
                failed(what, f"{name}: divide by the number of *nonzero* values: a value that was already 0 "
                             "did not underflow")
            if abs(got - (1 - want)) < 1e-6:
                failed(what, f"{name}: that is the share that survives; the question is the share that is lost")
            failed(what, f"{name}: {figures('fraction lost', got, want)} (cast, then count the nonzero inputs "
                         "whose cast is 0)")
        lines.append(f"{_name(dtype)} {got:.3f}")
    return "values from 1e-46 to 1 lost to underflow: " + ", ".join(lines)


def _swamping(swamped_fraction: Callable[..., Any]) -> str:
    what = "what 16 bits lose (swamped_fraction)"
    w, u = _weights_and_updates()
    lines = []
    for dtype in _DTYPES:
        got = _fraction(what, call(what, _watched(swamped_fraction, *_EXERCISE1_LIBRARY), w.clone(), u.clone(),
                                   dtype))
        want, rounded = _swamped(w, u, dtype), _swamped(w, u, dtype, stored=False)
        if min(abs(got - want), abs(got - rounded)) > 1e-6:
            name, nonzero = _name(dtype), u != 0
            promoted = (nonzero & ((w.to(dtype) + u) == w.to(dtype))).sum().item() / nonzero.sum().item()
            original = (nonzero & ((w.to(dtype) + u.to(dtype)) == w)).sum().item() / nonzero.sum().item()
            if dtype != torch.float32 and abs(got - promoted) < 1e-6:
                failed(what, f"{name}: your sum was computed in fp32 ({name} + fp32 gives fp32), so almost nothing "
                             f"is lost: store the update in {name} too, so the addition happens in {name}")
            if dtype != torch.float32 and abs(got - original) < 1e-6:
                failed(what, f"{name}: compare the new weight with the weight as stored in {name} (its cast), not "
                             "with the fp32 original, which the stored weight almost never equals")
            if abs(got - want * nonzero.sum().item() / u.numel()) < 1e-6:
                failed(what, f"{name}: divide by the number of *nonzero* updates: a zero update changes nothing, "
                             "but it was not swamped")
            if abs(got - (1 - want)) < 1e-6:
                failed(what, f"{name}: that is the share of updates that move the weight; the question is the "
                             "share that leaves it unchanged")
            failed(what, f"{name}: {figures('fraction swamped', got, want)} (weights and updates stored in "
                         f"{name}, added in {name}: how many sums equal the stored weight?)")
        lines.append(f"{_name(dtype)} {got:.3f}")
    return "updates from 1e-9 to 0.1 swamped by their weight: " + ", ".join(lines)


def lost_in_16_bits(underflow_fraction: Callable[..., Any], swamped_fraction: Callable[..., Any]) -> None:
    """Exercise 1: ``underflow_fraction(values, dtype)`` and ``swamped_fraction(weights, updates, dtype)``."""
    what = "what 16 bits lose"
    for fn in (underflow_fraction, swamped_fraction):
        refuse_library(what, fn, *_EXERCISE1_LIBRARY)
    require_written(what, underflow_fraction, swamped_fraction)
    detail = _underflow(underflow_fraction) + "; " + _swamping(swamped_fraction)
    passed(what, detail + " (measured by casting)")


# ------------------------------------------------------------------ exercise 2: a loss scaler
def _grad_cases() -> list[tuple[str, list[torch.Tensor], float]]:
    g = torch.Generator().manual_seed(7)
    clean = [torch.randn(5, 3, generator=g) * 1000, torch.randn(7, generator=g) * 3]
    inf_last = [torch.randn(4, generator=g), torch.tensor([1.0, math.inf, 2.0])]
    nan_first = [torch.tensor([math.nan, 1.0]), torch.randn(3, generator=g)]
    neg_inf = [torch.tensor([-math.inf]), torch.ones(2)]
    return [("finite gradients", clean, 1024.0), ("an inf in the last tensor", inf_last, 2.0**16),
            ("a NaN", nan_first, 8.0), ("a -inf", neg_inf, 3.0)]


_OVERFLOWS = [0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
_RULE = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


def _torch_update(scale: float, tracker: int, found: int) -> tuple[float, int]:
    s, t = torch.tensor(scale, dtype=torch.float32), torch.tensor(tracker, dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor(float(found)), _RULE["growth_factor"], _RULE["backoff_factor"],
                             _RULE["growth_interval"])
    return s.item(), int(t.item())


def _methods(what: str, LossScaler: Any) -> None:
    refuse_library(what, LossScaler, *_runs.SCALER_LIBRARY)
    if not isinstance(LossScaler, type):
        failed(what, f"pass the class LossScaler itself (got {type(LossScaler).__name__})")
    missing = [m for m in ("__init__", "unscale_", "update") if not callable(getattr(LossScaler, m, None))]
    if missing:
        failed(what, f"LossScaler needs the methods __init__, unscale_(grads) and update(found_inf); "
                     f"{', '.join(missing)} is missing")
    require_written(what, LossScaler.__init__, LossScaler.unscale_, LossScaler.update)


def _state(what: str, scaler: Any) -> tuple[float, int]:
    try:
        return float(scaler.scale), int(scaler.tracker)
    except AttributeError as err:
        failed(what, f"keep the state in self.scale (S, a float) and self.tracker (the clean steps in a row): "
                     f"{err}")
    except (TypeError, ValueError):
        failed(what, "self.scale must be a number and self.tracker a whole number")
    raise AssertionError("unreachable")


def _new_scaler(what: str, LossScaler: type, **kwargs: Any) -> Any:
    return call(what, _watched(LossScaler, *_runs.SCALER_LIBRARY), **kwargs)


def _unscale(what: str, LossScaler: type) -> None:
    for name, grads, scale in _grad_cases():
        theirs = [t.clone() for t in grads]
        torch_flag = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch_flag, torch.tensor(1.0 / scale))
        scaler = _new_scaler(what, LossScaler, init_scale=scale)
        if _state(what, scaler) != (scale, 0):
            failed(what, f"LossScaler(init_scale={scale:g}) holds (scale, tracker) = {_state(what, scaler)}: a new "
                         f"scaler starts at (init_scale, 0)")
        mine = [t.clone() for t in grads]
        objects = list(mine)
        got = call(what, _watched(scaler.unscale_, *_runs.SCALER_LIBRARY), mine)
        if any(a is not b for a, b in zip(mine, objects)) or all(torch.equal(a, b) for a, b in zip(mine, grads)):
            failed(what, f"unscale_, {name}: the gradient tensors are unchanged; the optimizer reads p.grad, so "
                         "change those tensors in place (an in-place multiply), do not build new ones")
        for m, t in zip(mine, theirs):
            f = torch.isfinite(t)
            if not torch.allclose(m[f], t[f], rtol=1e-6, atol=0):
                ratio = (m[f] / t[f]).median().item() if f.any() else float("nan")
                why = (f"they are {scale:g}x too large: each gradient holds S times the true value, divide by S"
                       if math.isclose(ratio, scale * scale, rel_tol=1e-3) else
                       f"they come out {ratio:.3g}x the true gradients: divide by S once")
                failed(what, f"unscale_, {name} (S = {scale:g}): {why}")
        if bool(got) != bool(torch_flag.item()):
            if torch_flag.item():
                kind = "NaN" if "NaN" in name else "inf"
                failed(what, f"unscale_, {name}: you returned {got!r} but there is a {kind}: check every value of "
                             "every tensor for inf *and* NaN (torch.isfinite says both)")
            failed(what, f"unscale_, {name}: you reported an overflow in finite gradients (returned {got!r})")
        if _state(what, scaler)[0] != scale:
            failed(what, f"unscale_ changed the scale ({scale:g} -> {_state(what, scaler)[0]:g}): only update() "
                         "moves it")


def _update(what: str, LossScaler: type) -> float:
    scaler = _new_scaler(what, LossScaler, init_scale=2.0**10, **_RULE)
    update = _watched(scaler.update, *_runs.SCALER_LIBRARY)
    scale, tracker = 2.0**10, 0
    for i, found in enumerate(_OVERFLOWS):
        want = _torch_update(scale, tracker, found)
        assert want == _update_scale(scale, tracker, bool(found), **_RULE), "library and torch disagree"
        try:                                               # every step from the right state: one mistake, one verdict
            scaler.scale, scaler.tracker = scale, tracker
        except AttributeError:
            failed(what, "keep self.scale and self.tracker as plain attributes: the check sets them to replay "
                         "each step from the right state")
        call(what, update, bool(found))
        got = _state(what, scaler)
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
                       if tracker + 1 < _RULE["growth_interval"] else "after growing, the count starts again from 0")
            elif want[0] > scale and got[1] != 0:
                why = "after growing, the count of clean steps starts again from 0"
            else:
                why = "a clean step adds one to the count and keeps the scale until the count reaches growth_interval"
            failed(what, f"update, step {i}, {event}, from (scale {scale:g}, count {tracker}): yours {got}, "
                         f"expected {want}: {why}")
        scale, tracker = want
    return scale


def loss_scaler(LossScaler: type) -> None:
    """Exercise 2: ``LossScaler(init_scale, growth_factor, backoff_factor, growth_interval)`` with ``scale``,
    ``tracker``, ``unscale_(grads) -> found_inf`` and ``update(found_inf)``, against torch's kernels."""
    what = "loss scaler"
    _methods(what, LossScaler)
    _unscale(what, LossScaler)
    final = _update(what, LossScaler)
    library = (2.0**10, 0)
    for found in _OVERFLOWS:
        library = _update_scale(*library, bool(found), **_RULE)
    passed(what, f"{len(_grad_cases())} gradient lists unscaled in place with torch's inf/NaN flags; "
           + figures(f"{len(_OVERFLOWS)} steps with {sum(_OVERFLOWS)} overflows, final scale", final, final,
                     library[0]) + " (torch's _amp_update_scale_ agreed at every step)")


# ------------------------------------------------------------------ exercise 3: fp16 training, rescued
_RESCUE_STEPS, _RESCUE_BATCH, _RESCUE_SEQ = 12, 8, 32
_SHRINK = 2.0**-16      # puts gpt-tiny's gradients where a large model's are (below fp16's range)


def _fp16_setup() -> tuple[torch.nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
    model16 = _models.build_model("gpt-tiny", seed=0).half()
    master = [p.detach().float().requires_grad_() for p in model16.parameters()]
    return model16, master, torch.optim.AdamW(master, lr=3e-3, eps=1e-16)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _models.lm_loss(logits.float(), y) * _SHRINK   # the loss in fp32, as autocast computes it


def _scales(scales: list[float]) -> list[str]:
    return [f"{s:g}" for s in scales]


@functools.lru_cache(maxsize=None)
def _reference_run(init_scale: float, scaled: bool = True) -> tuple[list[float], list[float]]:
    """The same loop with the library's rules: (losses, scales)."""
    model16, master, opt = _fp16_setup()
    scale, tracker, losses, scales = (init_scale if scaled else 1.0), 0, [], []
    for step in range(_RESCUE_STEPS):
        x, y = _data.get_batch(step, _RESCUE_BATCH, _RESCUE_SEQ)
        loss = _loss(model16(x), y)
        (loss * scale).backward()
        for p16, p32 in zip(model16.parameters(), master):
            p32.grad, p16.grad = p16.grad.float(), None
        found = bool(_unscale_grads_([p.grad for p in master], torch.tensor(1.0 / scale)).item())
        if not found:
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p16, p32 in zip(model16.parameters(), master):
                p16.copy_(p32)
        if scaled:
            scale, tracker = _update_scale(scale, tracker, found, 2.0, 0.5, 4)
        losses.append(loss.item() / _SHRINK)
        scales.append(scale)
    return losses, scales


def rescue(fp16_train_step: Callable[..., float], LossScaler: type) -> None:
    """Exercise 3: ``fp16_train_step(model16, master, opt, batch, loss_fn, scaler) -> loss``, with the lab's
    ``LossScaler``: trains fp16 gpt-tiny from too large a scale like the loop built on the library's rules."""
    what = "fp16 training with loss scaling"
    refuse_library(what, fp16_train_step, *_runs.STEP_LIBRARY)
    refuse_library(what, LossScaler, *_runs.SCALER_LIBRARY)
    require_written(what, fp16_train_step)
    init_scale = 2.0**36   # too large at first: the first steps overflow, are skipped, and the scale backs off
    scaler = _new_scaler(what, LossScaler, init_scale=init_scale, growth_interval=4)
    step_fn = _watched(fp16_train_step, *_runs.STEP_LIBRARY)
    model16, master, opt = _fp16_setup()
    losses, scales = [], []
    for step in range(_RESCUE_STEPS):
        before16 = next(model16.parameters()).detach().clone()
        got = call(what, step_fn, model16, master, opt, _data.get_batch(step, _RESCUE_BATCH, _RESCUE_SEQ), _loss,
                   scaler)
        try:
            losses.append(float(got) / _SHRINK)
        except (TypeError, ValueError):
            failed(what, f"return the loss as a float (loss.item()), got {type(got).__name__}")
        scales.append(_state(what, scaler)[0])
        if not all(torch.isfinite(p).all() for p in master):
            failed(what, f"step {step}: the fp32 master weights hold inf/NaN: when unscale_ finds an overflow, "
                         "skip optimizer.step() (and still update the scale)")
        if step == _RESCUE_STEPS - 1 and torch.equal(before16, next(model16.parameters()).detach()) \
                and not torch.equal(before16, master[0].detach().half()):
            failed(what, "the fp16 model never changes: after the optimizer updates the fp32 master, copy the "
                         "master back into the fp16 parameters")
    want_losses, want_scales = _reference_run(init_scale)
    unscaled, _ = _reference_run(init_scale, scaled=False)
    if scales == [init_scale] * _RESCUE_STEPS:
        failed(what, "the scale never changed although the first steps overflow: call scaler.update(found_inf) "
                     "once per step")
    if losses[0] - losses[-1] < 0.5 * (want_losses[0] - want_losses[-1]):
        failed(what, f"your loss barely falls ({losses[0]:.3f} -> {losses[-1]:.3f}; with scaling it reaches "
                     f"{want_losses[-1]:.3f}, fp16 without scaling {unscaled[-1]:.3f}): the gradients underflow in "
                     "fp16; multiply the loss by scaler.scale before backward")
    if scales != want_scales:
        failed(what, f"scales {_scales(scales[:6])}... differ from the rule's {_scales(want_scales[:6])}...: one "
                     "unscale_ and one update per step, after backward")
    if max(abs(a - b) for a, b in zip(losses, want_losses)) > 1e-3:
        failed(what, f"{figures('final loss', losses[-1], want_losses[-1])}: your losses differ from the same loop "
                     "built on the library's rules (one scaled backward, unscale, step unless overflow, copy back)")
    skipped = sum(1 for a, b in zip([init_scale] + scales, scales) if b < a)
    passed(what, figures(f"{_RESCUE_STEPS} steps ({skipped} skipped on overflow), final loss", losses[-1],
                         want_losses[-1]) + f"; fp16 without scaling {unscaled[-1]:.3f}")


# ------------------------------------------------------------------ exercise 4a: every rank skips the same step
def _sharded_step(sharded_scaler_step: Callable[..., Any], LossScaler: type) -> str:
    what = "every rank skips the same step"
    refuse_library(what, sharded_scaler_step, *_runs.SCALER_LIBRARY)
    refuse_library(what, LossScaler, *_runs.SCALER_LIBRARY)
    require_written(what, sharded_scaler_step)
    n = check_world(2)
    yours, library = zip(*run(what, _runs.sharded_worker, n, sharded_scaler_step, LossScaler))
    steps = _runs.SHARDED_STEPS
    want = [not _runs.overflowing(step, n) for step in range(steps)]      # stepped?
    for step in range(steps):
        bad, did = _runs.overflowing(step, n), [res["stepped"][step] for res in yours]
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
            failed(what, f"rank {r}'s shard after {steps} steps differs from ShardedGradScaler's by {diff:.3g}"
                         ": unscale the gradients (your scaler's unscale_) before opt.step()")
    skipped = lambda res: [i for i, s in enumerate(res["stepped"]) if not s]  # noqa: E731
    return (figures(f"{n} FSDP ranks, an overflow in one rank's shard at step 3, another's at 7, every rank's at 8; "
                    "steps skipped on every rank", skipped(yours[0]), [i for i, w in enumerate(want) if not w],
                    skipped(library[0]))
            + f", final scale {yours[0]['scales'][-1]:g}, shards equal to ShardedGradScaler's")


# ------------------------------------------------------------------ exercise 4b: the policy's bytes
@functools.lru_cache(maxsize=None)
def _measured_bytes() -> tuple:
    """The tracer's bytes of one FSDP step per policy, on 2 ranks (measured once per process)."""
    return tuple(run("bytes per step by precision policy", _runs.fsdp_bytes, check_world(2),
                     _runs.POLICIES)[0].items())


def _policy_bytes(predict: Callable[[list[tuple[int, int]], Any], dict[str, int]]) -> str:
    what = "bytes per step by precision policy"
    library = (*_runs.BYTES_LIBRARY, _measured_bytes, _runs.fsdp_bytes)
    refuse_library(what, predict, *library)
    require_written(what, predict)
    measured = dict(_measured_bytes())
    units = measured.pop("units")
    lines = []
    for name, mp in _runs.POLICIES.items():
        got = call(what, _watched(predict, *library), list(units), mp)
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
    return ("bytes per step = the tracer's count of a 2-rank FSDP step for every policy (all-gather+reduce-scatter): "
            + "; ".join(lines))


def fsdp_precision(sharded_scaler_step: Callable[..., Any], policy_bytes: Callable[..., Any],
                   LossScaler: type) -> None:
    """Exercise 4: ``sharded_scaler_step(shard, opt, scaler) -> found_inf`` on 2 FSDP ranks with an inf in
    one rank's shard, and ``policy_bytes(units, mp)`` against the tracer, under four policies."""
    detail = _sharded_step(sharded_scaler_step, LossScaler) + ". " + _policy_bytes(policy_bytes)
    passed("mixed precision under FSDP", detail)
