"""Checks of lab 06 (activation checkpointing): exact gradients, activations measured, recompute counted.

Every check runs the learner's code on a real GPT (``gpt-tiny`` with dropout
0.1, so a recompute that draws other dropout masks shows up), compares the
gradients *bit for bit* with the plain model, and measures the activations
alive after the forward with ``minifsdp.memory.MemoryTracker``. The targets
are measured here with the library's own checkpointing
(``minifsdp.checkpoint``), never typed in. When something is off the check
reruns with dropout 0 or counts ops to say which idea is missing. Read
``verdict.py`` first.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import estimate, models
from ..checkpoint import (CheckpointImpl, ReentrantCheckpointFunction, SelectiveCheckpointContext,
                          checkpoint_wrapper, create_selective_checkpoint_contexts)
from ..memory import ACTIVATIONS, MemoryTracker
from .verdict import CheckFailed, call, failed, figures, passed, require_written, uses

FP32 = 4
B, T = 4, 32
_LIBRARY_NAMES = ("checkpoint", "checkpoint_reentrant", "checkpoint_non_reentrant", "checkpoint_wrapper",
                  "ReentrantCheckpointFunction", "apply_activation_checkpointing")
_LINEAR = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class _Checkpointed(nn.Module):
    """A block whose call goes through ``run(block, x)`` (the learner's checkpoint)."""

    def __init__(self, block: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.block, self.run = block, run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.block, x)


def _model(dropout: float = 0.1, **overrides: Any) -> nn.Module:
    return models.build_model("gpt-tiny", seed=6, dropout=dropout, **overrides)


def _batch(config: models.GPTConfig, batch: int = B, seq: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(60)
    return (torch.randint(0, config.vocab_size, (batch, seq), generator=g),
            torch.randint(0, config.vocab_size, (batch, seq), generator=g))


def _checkpoint_blocks(model: nn.Module, run: Callable | None, k: int | None = None) -> nn.Module:
    """Replace the first ``k`` blocks (all: None) by ``_Checkpointed(block, run)``."""
    for i in range(len(model.blocks) if k is None else k):
        model.blocks[i] = _Checkpointed(model.blocks[i], run)
    return model


def _step(model: nn.Module, batch: tuple, seed: int = 1) -> tuple[int, dict[str, torch.Tensor | None]]:
    """Activations alive after the forward (bytes; the 4-byte loss value itself left out: it is not saved
    for backward) and every parameter's gradient, dropout drawn from ``seed``."""
    x, y = batch
    tracker = MemoryTracker()
    tracker.track_model(model)
    with tracker:
        torch.manual_seed(seed)
        loss = models.lm_loss(model(x.clone()), y.clone())
        activations = tracker.snapshot()[ACTIVATIONS] - loss.nbytes  # saved for backward, not the loss
        loss.backward()
    tracker.close()
    grads = {_plain_name(n): (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    return activations, grads


def _plain_name(name: str) -> str:
    return name.replace("block.", "").replace("_checkpoint_wrapped_module.", "")


def _compare(what: str, got: dict, want: dict, rerun_without_dropout: Callable[[], dict] | None,
             rng_hint: str) -> None:
    """Fail with the reason when the gradients are not bit-identical."""
    none_blocks = [n for n, g in got.items() if g is None and n.startswith("blocks.")]
    if none_blocks:
        failed(what, f"{len(none_blocks)} parameters of the checkpointed blocks got no gradient (e.g. "
                     f"{none_blocks[0]}): backward must run the block again with gradients enabled and "
                     "backpropagate the output's gradient through that new graph")
    none_other = [n for n, g in got.items() if g is None]
    if none_other:
        failed(what, f"the gradient stops at the first checkpointed block ({none_other[0]} got none): return "
                     "the gradient of each *input* too: re-run on fresh leaves that require grad and read their .grad")
    worst = max(got, key=lambda n: (got[n] - want[n]).abs().max().item())
    if all(torch.equal(got[n], want[n]) for n in want):
        return
    if rerun_without_dropout is not None:
        g0, w0 = rerun_without_dropout()
        if all(g0[n] is not None and torch.equal(g0[n], w0[n]) for n in w0):
            failed(what, f"exact without dropout, off with it: {rng_hint}")
    diff = (got[worst] - want[worst]).abs().max().item()
    failed(what, f"gradients differ from the un-checkpointed model (worst: {worst}, by {diff:.3g}); the recompute "
                 "must run exactly the computation the forward ran, on the same inputs")


def _library_used(what: str, *fns: Any) -> None:
    for fn in fns:
        found = uses(fn, *_LIBRARY_NAMES)
        if found:
            failed(what, f"it calls the library's {found[0]}: write the mechanism yourself (the library's is "
                         "the yardstick the check compares with)")


_RNG_HINT = ("dropout drew other masks in the recompute: remember the RNG state when the forward starts and "
             "put it back (inside torch.random.fork_rng, so the caller's stream is untouched) before re-running")


def _exercise(what: str, run: Callable[[nn.Module, torch.Tensor], torch.Tensor], impl: CheckpointImpl) -> str:
    """Grads exact with dropout; activations after forward equal the library's full checkpointing."""
    config = _model().config
    batch = _batch(config)
    _, want = _step(_model(), batch)
    target, _ = _step(_checkpoint_blocks(_model(), lambda blk, x: checkpoint_wrapper(blk, impl)(x)), batch)
    none, _ = _step(_model(), batch)
    try:
        yours, got = call(what, _step, _checkpoint_blocks(_model(), run), batch)
    except CheckFailed as err:
        if "does not require grad" in str(err):
            failed(what, "backward rebuilt the block without a graph (its output does not require grad): "
                         "backward runs with gradients disabled, so re-run the block under torch.enable_grad()")
        raise

    def without_dropout() -> tuple[dict, dict]:
        return (call(what, _step, _checkpoint_blocks(_model(0.0), run), batch)[1], _step(_model(0.0), batch)[1])

    _compare(what, got, want, without_dropout, _RNG_HINT)
    if yours >= none:
        failed(what, "gradients are right but nothing was saved: " +
               figures("activations after forward", yours, target, unit="B") +
               f" (no checkpointing: {none:,} B); keep only the block's inputs, not what its ops save")
    if yours > target:
        failed(what, "gradients are right, but " + figures("activations after forward", yours, target, unit="B") +
               "; something inside the block is still kept until backward")
    return (f"gradients bit-identical to no checkpointing (dropout 0.1), "
            + figures("activations after forward", yours, target, target, unit="B") + f", none: {none:,} B")


# ------------------------------------------------------------------ exercise 1: reentrant
def reentrant(function_cls: type) -> None:
    """``function_cls.apply(run, x)``: an autograd Function that recomputes ``run(x)`` in backward."""
    what = "reentrant checkpoint"
    if not (isinstance(function_cls, type) and issubclass(function_cls, torch.autograd.Function)):
        failed(what, "pass the class itself, a subclass of torch.autograd.Function")
    if issubclass(function_cls, ReentrantCheckpointFunction):
        failed(what, "that is the library's ReentrantCheckpointFunction: write your own Function")
    require_written(what, function_cls.forward, function_cls.backward)
    _library_used(what, function_cls.forward, function_cls.backward)
    passed(what, _exercise(what, lambda blk, x: function_cls.apply(blk, x), CheckpointImpl.REENTRANT))


# ------------------------------------------------------------------ exercise 2: saved-tensor hooks
def hooks(checkpoint_fn: Callable[..., torch.Tensor]) -> None:
    """``checkpoint_fn(run, x)``: non-reentrant checkpoint with ``saved_tensors_hooks``."""
    what = "checkpoint with saved-tensor hooks"
    require_written(what, checkpoint_fn)
    _library_used(what, checkpoint_fn)
    try:
        detail = _exercise(what, checkpoint_fn, CheckpointImpl.NO_REENTRANT)
    except CheckFailed as err:
        if "raised KeyError" in str(err) or "raised IndexError" in str(err):
            failed(what, f"unpack found nothing recomputed ({str(err).split('raised ')[1]}): backward runs with "
                         "gradients disabled, and autograd saves tensors only where they are enabled")
        raise
    if not uses(checkpoint_fn, "saved_tensors_hooks"):
        failed(what, "right, but without torch.autograd.graph.saved_tensors_hooks(pack, unpack): that is the "
                     "mechanism this exercise is about")
    passed(what, detail)


# ------------------------------------------------------------------ exercise 3: selective policy
class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _library_contexts(policy: Any) -> Callable[[], tuple]:
    return functools.partial(create_selective_checkpoint_contexts, policy)


def _learner_contexts(keep_cls: type, reuse_cls: type, policy: Any) -> Callable[[], tuple]:
    def contexts() -> tuple:
        kept: dict = {}
        return keep_cls(policy, kept), reuse_cls(kept)
    return contexts


def _selective_step(contexts: Callable[[], tuple] | None, dropout: float = 0.1) -> tuple[int, dict, int]:
    """Activations after forward, gradients, and linear-layer matmuls run during backward
    (backward's own gradient matmuls included; ``contexts=None``: no checkpointing)."""
    model = _model(dropout)
    if contexts is not None:
        _checkpoint_blocks(model, lambda blk, x: checkpoint_wrapper(blk, context_fn=contexts)(x))
    x, y = _batch(model.config)
    tracker, counter = MemoryTracker(), _CountOps()
    tracker.track_model(model)
    with tracker:
        torch.manual_seed(1)
        loss = models.lm_loss(model(x.clone()), y.clone())
        activations = tracker.snapshot()[ACTIVATIONS] - loss.nbytes  # saved for backward, not the loss
        with counter:
            loss.backward()
    tracker.close()
    grads = {_plain_name(n): p.grad for n, p in model.named_parameters()}
    return activations, grads, sum(counter.counts[op] for op in _LINEAR)


def selective(keep_cls: type, reuse_cls: type, policy: Callable[..., Any]) -> None:
    """``keep_cls(policy, kept)`` / ``reuse_cls(kept)``: the forward and recompute dispatch modes;
    ``policy(ctx, op, *args, **kwargs) -> bool``: True keeps the op's output."""
    what = "selective checkpointing"
    for cls in (keep_cls, reuse_cls):
        if not (isinstance(cls, type) and issubclass(cls, TorchDispatchMode)):
            failed(what, "pass your two classes themselves (subclasses of TorchDispatchMode), then the policy")
    require_written(what, keep_cls.__torch_dispatch__, reuse_cls.__torch_dispatch__, policy)
    found = uses(policy, "LINEAR_OPS", "MATMUL_OPS") + uses(keep_cls.__torch_dispatch__, "_Caching") + \
        uses(reuse_cls.__torch_dispatch__, "_Cached")
    if found:
        failed(what, f"it uses the library's {found[0]}: write it yourself (the table above lists the ops)")
    answer = call(what, policy, SelectiveCheckpointContext(is_recompute=False), torch.ops.aten.addmm.default)
    if not isinstance(answer, bool) and type(answer).__name__ != "CheckpointPolicy":
        failed(what, f"the policy returned {answer!r}; return True (keep the output) or False (recompute it)")
    config = _model().config
    _, want = _step(_model(), _batch(config))
    none, _, backward_own = _selective_step(None)  # backward's own matmuls (the gradients)
    full, _, full_matmuls = _selective_step(_library_contexts(lambda ctx, op, *a, **k: False))
    target, _, _ = _selective_step(_library_contexts(lambda ctx, op, *a, **k: op in _LINEAR))  # measured
    full_recomputed = full_matmuls - backward_own
    # the policy, run by the library's modes
    yours, got, matmuls = call(what, _selective_step, _library_contexts(policy))
    _compare(what, got, want, None, _RNG_HINT)
    if matmuls - backward_own:
        failed(what, f"with your policy backward re-ran {matmuls - backward_own} linear-layer matmuls "
                     f"(aten.mm / aten.addmm; full checkpointing re-runs {full_recomputed}): keep the outputs "
                     "of the ops that cost the FLOPs")
    if yours > target:
        failed(what, "your policy recomputes no linear layer, but " +
               figures("activations after forward", yours, target, unit="B") +
               "; it also keeps outputs that are cheap to recompute (elementwise ops, or attention's B·h·T² "
               "scores)")
    # the modes, run with the library's policy
    modes = _learner_contexts(keep_cls, reuse_cls, lambda ctx, op, *a, **k: op in _LINEAR)
    try:
        mine, got, matmuls = call(what, _selective_step, modes)
    except CheckFailed as err:
        failed(what, f"your policy is right, but with your modes the recompute failed ({str(err).split(': ', 1)[1]}); "
                     "the k-th call of an op in the recompute must get the output of its k-th call in the forward")
    if matmuls - backward_own:
        failed(what, f"your policy is right, but with it your modes re-ran {matmuls - backward_own} linear "
                     "matmuls in backward: ReuseOutputs must hand back the kept output instead of running the op")
    if any(g is None or not torch.equal(g, want[n]) for n, g in got.items()):
        failed(what, "your policy is right, but with your modes the gradients differ: the k-th call of an op in "
                     "the recompute must get the output of its k-th call in the forward")
    if mine > target:
        failed(what, "your policy is right, but your KeepOutputs keeps " +
               figures("activation bytes", mine, target, unit="B") + ": keep only what the policy chooses")
    passed(what, f"0 linear matmuls recomputed (full checkpointing: {full_recomputed}), gradients bit-identical, "
                 + figures("activations after forward", mine, target, unit="B")
                 + f"; full checkpointing {full:,} B, none {none:,} B")


# ------------------------------------------------------------------ exercise 4: where to checkpoint
def measured_activations(config_overrides: dict, batch: int, seq: int, k: int) -> int:
    """Activations after forward of gpt-tiny (with overrides, dropout 0) with its first k blocks checkpointed."""
    model = models.build_model("gpt-tiny", seed=6, **config_overrides)
    _checkpoint_blocks(model, lambda blk, x: checkpoint_wrapper(blk)(x), k)
    return _step(model, _batch(model.config, batch, seq))[0]


def predicted_activations(predict: Callable[[models.GPTConfig, int, int, int], int],
                          choose: Callable[[int, models.GPTConfig, int, int], int | None]) -> None:
    """``predict(config, batch, seq_len, k)``: activation bytes after forward with k blocks checkpointed;
    ``choose(budget, config, batch, seq_len)``: the fewest checkpointed blocks that fit ``budget``."""
    what = "activations vs checkpointed blocks"
    require_written(what, predict, choose)
    found = uses(predict, "gpt_checkpoint_activation_bytes", "checkpoint_wrapper", "MemoryTracker")
    if found:
        failed(what, f"it uses {found[0]}: predict from the formula of one block, without measuring or the "
                     "library's answer")
    cases = [({}, B, T), ({"n_layer": 3, "n_embd": 48, "n_head": 4}, 2, 16)]
    lines, library_off, curves = [], 0, []
    for overrides, batch, seq in cases:
        config = dataclasses.replace(models.MODEL_PRESETS["gpt-tiny"], **overrides)
        btd = batch * seq * config.n_embd * FP32
        measured = []
        for k in range(config.n_layer + 1):
            want = measured_activations(overrides, batch, seq, k)
            measured.append(want)
            got = call(what, predict, config, batch, seq, k)
            library = estimate.gpt_checkpoint_activation_bytes(config, batch, seq, checkpointed_layers=k)["total"]
            library_off = max(library_off, abs(library - want))
            if got == want:
                continue
            shape = f"L={config.n_layer}, d={config.n_embd}, B={batch}, T={seq}, k={k}"
            if k and got == want - k * btd:
                failed(what, f"{k * btd:,} B short at {shape}: a checkpointed block still keeps one tensor "
                             "until backward (what it needs to run again)")
            if k and got == measured_activations(overrides, batch, seq, 0):
                failed(what, f"your prediction does not change with k ({shape}): each checkpointed block "
                             "gives back what it would have saved, except its input")
            failed(what, figures(f"bytes at {shape}", got, want, library, unit="B"))
        lines.append(f"L={config.n_layer}: k=0..{config.n_layer} exact")
        curves.append((config, batch, seq, measured))
    for config, batch, seq, measured in curves:  # budgets between the measured values, and one below them all
        for k, need in enumerate(measured):
            for budget, want in ((need, k), (need - 1, k + 1 if k < config.n_layer else None)):
                got = call(what, choose, budget, config, batch, seq)
                if got != want:
                    failed(what, f"bytes are right, but for a budget of {budget:,} B (L={config.n_layer}, "
                                 f"d={config.n_embd}) you chose k={got}; the fewest blocks that fit is "
                                 f"{want} (None: not even all L fit)")
    lines.append("fewest blocks for every budget right")
    agree = "equal to it" if not library_off else f"within {library_off:,} B of it"
    passed(what, "; ".join(lines) + f" (measured by the memory tracker; the library's estimate is {agree})")

