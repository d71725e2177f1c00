"""Checks of lab 06 (activation checkpointing): exact gradients, activations measured, recompute counted.

Every check runs the learner's code on a real GPT (``gpt-tiny`` with dropout
0.1, so a recompute that draws other dropout masks shows up), compares the
gradients *bit for bit* with the plain model, and measures the activations
alive after the forward with ``minifsdp.memory.MemoryTracker``. The targets
are measured here with the library's own checkpointing
(``minifsdp.checkpoint``), never typed in. When something is off the check
reruns with dropout 0 or counts ops to say which idea is missing. Read
``verdict.py`` first.

Whose code ran: each exercise has its library (``_REENTRANT``, ``_HOOKS``,
``_SELECTIVE``, ``_predict_library()``: minifsdp's implementation of that
exercise, and torch's own). ``_refuse`` fails the learner's code when it
reaches one of them by any route a reader can see (a call, an alias, a notebook
helper, a subclass, the check's own measuring helpers), and a ``Wire`` around
the learner's part of each run fails it when one runs, however it was reached.
The checks run in this process: checkpointing is per rank, nothing is launched.

``check.hint(name)`` gives the next hint for an exercise, idea first, never the code.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as _torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .. import estimate, models
from ..checkpoint import (LINEAR_OPS, MATMUL_OPS, CheckpointImpl, CheckpointWrapper, ReentrantCheckpointFunction,
                          SelectiveCheckpointContext, apply_activation_checkpointing, checkpoint,
                          checkpoint_non_reentrant, checkpoint_reentrant, checkpoint_wrapper,
                          create_selective_checkpoint_contexts, offload_saved_tensors, selective_checkpoint_wrapper)
from ..checkpoint.non_reentrant import _Frame
from ..checkpoint.replay import ForwardState
from ..checkpoint.selective import _Cached, _Caching
from ..memory import ACTIVATIONS, MemoryTracker
from .verdict import CheckFailed, Hints, call, failed, figures, library_reached, passed, require_written, watched

FP32 = 4
B, T = 4, 32
_LINEAR = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

# ------------------------------------------------------------------ the library of each exercise
def _library(*objs: Any) -> tuple:
    """``objs`` as the guards can watch them. A decorated function (``contextlib.contextmanager``, torch's
    dynamo-disabling wrappers, which ``TorchDispatchMode`` puts around every ``__torch_dispatch__``) runs a
    generic wrapper's code that other functions share, so the guards get the function inside instead; a
    class with such a method is given as its methods (``_refuse`` tests subclasses of those classes itself)."""
    out: list[Any] = []
    for obj in objs:
        if isinstance(obj, type):
            methods = [(value, inspect.unwrap(fn)) for klass in obj.__mro__
                       if klass.__module__.startswith(("minifsdp.", "torch.utils.checkpoint"))
                       for value in vars(klass).values()
                       for fn in [getattr(value, "__func__", value)] if inspect.isfunction(fn)]
            if any(inner is not getattr(value, "__func__", value) for value, inner in methods):
                out += [inner for _, inner in methods]
                continue
            if not obj.__module__.startswith("minifsdp."):  # torch's class: its methods, and the class for
                out += [inner for _, inner in methods]      # the static guard's subclass test
        elif callable(obj) and hasattr(obj, "__wrapped__"):
            out.append(inspect.unwrap(obj))
            continue
        out.append(obj)
    return tuple(out)


# torch's own checkpointing is the same shortcut under another name.
_TORCH_CHECKPOINT = (_torch_checkpoint.checkpoint, _torch_checkpoint.checkpoint_sequential,
                     _torch_checkpoint.CheckpointFunction, _torch_checkpoint._checkpoint_without_reentrant_generator,
                     _torch_checkpoint._checkpoint_hook)
_TORCH_SELECTIVE = (_torch_checkpoint.create_selective_checkpoint_contexts,
                    _torch_checkpoint._CachingTorchDispatchMode, _torch_checkpoint._CachedTorchDispatchMode)
# Exercises 1 and 2: any of minifsdp's checkpointing entry points, either implementation, its RNG replay.
_CHECKPOINTING = _library(checkpoint, checkpoint_reentrant, ReentrantCheckpointFunction, checkpoint_non_reentrant,
                          _Frame, ForwardState, CheckpointWrapper, checkpoint_wrapper, selective_checkpoint_wrapper,
                          apply_activation_checkpointing, offload_saved_tensors, *_TORCH_CHECKPOINT)
_REENTRANT = _HOOKS = _CHECKPOINTING
# Exercise 3: the library's two dispatch modes, their factory and its op lists.
_SELECTIVE_CLASSES = (_Caching, _Cached, _torch_checkpoint._CachingTorchDispatchMode,
                      _torch_checkpoint._CachedTorchDispatchMode)
_SELECTIVE = _library(_Caching, _Cached, create_selective_checkpoint_contexts, selective_checkpoint_wrapper,
                      LINEAR_OPS, MATMUL_OPS, *_TORCH_SELECTIVE)
_SAVED_TENSORS_HOOKS = torch.autograd.graph.saved_tensors_hooks  # what exercise 2 is about (not a shortcut)


def _check_helpers() -> tuple:
    """The check's own measuring code: refused statically in learner code (a wire cannot watch what the
    check itself runs around the learner's code)."""
    return (_step, _measured_activations, _selective_step, _library_contexts, _exercise, _LINEAR)


def _predict_library() -> tuple:
    """Exercise 4: the library's answer (the estimate with checkpointing) and any way of measuring it."""
    return _library(estimate.gpt_checkpoint_activation_bytes, MemoryTracker, _measured_activations) + _CHECKPOINTING


hint = Hints({
    "ReentrantCheckpoint": [
        "forward already runs with autograd recording off. What must it keep so that backward can run the "
        "block again, and what must it not keep?",
        "Dropout: the recompute must draw the same masks as the forward. Which global state decides them, and "
        "how do you restore it without moving the caller's random stream (torch.random has a tool)?",
        "backward runs with gradients disabled. Rebuild the block's graph with them enabled, on fresh leaves "
        "made from the saved inputs, then backpropagate grad_output through that graph.",
        "After that nested backward the fresh leaves hold the inputs' gradients; return one value per argument "
        "of forward, None for run.",
    ],
    "checkpoint_with_hooks": [
        "pack may return any small object instead of the tensor; autograd hands it to unpack in backward. "
        "What small value identifies a saved tensor?",
        "Saving order is deterministic: re-running the block saves the same tensors in the same order, so the "
        "i-th tensor saved by the recompute is the one the forward's i-th pack dropped.",
        "The first unpack of the block recomputes it (the forward's RNG state, gradients enabled) under a second "
        "pair of hooks whose pack collects what is saved; every unpack then hands out one collected tensor, once.",
        "The recompute's own graph is thrown away: its unpack is never called.",
    ],
    "KeepOutputs": [
        "The mode sees every aten op with its arguments: ask the policy about each call.",
        "Keep a detached alias (no copy) of each chosen output, per op, in the order the calls come.",
    ],
    "ReuseOutputs": [
        "The recompute calls the same ops in the same order as the forward: count the calls of each op.",
        "For an op with kept outputs, the k-th call returns (a detached alias of) the k-th kept output instead "
        "of running; every other op runs.",
    ],
    "keep_expensive": [
        "The table above lists which ops cost the FLOPs; the others are cheap to run again.",
        "A Linear layer is one aten op on CPU and GPU, under two names: with and without a bias.",
        "Attention's batched matmuls cost few FLOPs here and their outputs are B·h·T² values: recompute them.",
    ],
    "predict_activations": [
        "Start from the un-checkpointed total; each checkpointed block changes it by the same amount.",
        "A checkpointed block gives back everything it would have saved, except what it needs to run again.",
        "What does a block need to run again? Its input: B·T·d values, 4 bytes each in fp32.",
    ],
    "fewest_checkpointed_blocks": [
        "More checkpointed blocks: less memory, more recompute. Look for the smallest k that fits.",
        "k runs from 0 to L; if even k = L does not fit, return None.",
    ],
})


def _refuse(what: str, library: tuple, *fns: Any) -> None:
    """Statically: none of ``fns`` reaches ``library`` or the check's own measuring helpers, and none is a
    subclass of the library's dispatch modes (given to the guards as their methods, see ``_library``)."""
    for fn in fns:
        for base in _SELECTIVE_CLASSES:
            if isinstance(fn, type) and issubclass(fn, base):
                failed(what, f"your class {fn.__name__} subclasses the library's {base.__module__}."
                             f"{base.__qualname__}: the exercise is to build this mechanism yourself")
        reached = library_reached(fn, *library, *_check_helpers())
        if reached:
            name = reached[0]
            for ops, label in ((LINEAR_OPS, "LINEAR_OPS"), (MATMUL_OPS, "MATMUL_OPS"), (_LINEAR, "_LINEAR")):
                name = name.replace(f"?.{ops!r}", f"op list {label}")  # a tuple has no qualified name
            failed(what, f"your code reaches the library's {name}: the exercise is to build this mechanism "
                         "yourself, without minifsdp's implementation of it")


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


_RNG_HINT = ("dropout drew other masks in the recompute: remember the RNG state when the forward starts and "
             "put it back (inside torch.random.fork_rng, so the caller's stream is untouched) before re-running")


def _exercise(what: str, run: Callable[[nn.Module, torch.Tensor], torch.Tensor], impl: CheckpointImpl,
              library: tuple) -> str:
    """Grads exact with dropout; activations after forward equal the library's full checkpointing.
    The learner's forward and backward run under a wire on ``library``."""
    config = _model().config
    batch = _batch(config)
    _, want = _step(_model(), batch)
    target, _ = _step(_checkpoint_blocks(_model(), lambda blk, x: checkpoint_wrapper(blk, impl)(x)), batch)
    none, _ = _step(_model(), batch)
    learner_step = watched(_step, *library)
    try:
        yours, got = call(what, learner_step, _checkpoint_blocks(_model(), run), batch)
    except CheckFailed as err:
        if "does not require grad" in str(err):
            failed(what, "backward rebuilt the block without a graph (its output does not require grad): "
                         "backward runs with gradients disabled, so re-run the block under torch.enable_grad()")
        raise

    def without_dropout() -> tuple[dict, dict]:
        return (call(what, learner_step, _checkpoint_blocks(_model(0.0), run), batch)[1],
                _step(_model(0.0), batch)[1])

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
    _refuse(what, _REENTRANT, function_cls)
    require_written(what, function_cls.forward, function_cls.backward)
    passed(what, _exercise(what, lambda blk, x: function_cls.apply(blk, x), CheckpointImpl.REENTRANT, _REENTRANT))


# ------------------------------------------------------------------ exercise 2: saved-tensor hooks
def hooks(checkpoint_fn: Callable[..., torch.Tensor]) -> None:
    """``checkpoint_fn(run, x)``: non-reentrant checkpoint with ``saved_tensors_hooks``."""
    what = "checkpoint with saved-tensor hooks"
    require_written(what, checkpoint_fn)
    _refuse(what, _HOOKS, checkpoint_fn)
    try:
        detail = _exercise(what, checkpoint_fn, CheckpointImpl.NO_REENTRANT, _HOOKS)
    except CheckFailed as err:
        if "raised KeyError" in str(err) or "raised IndexError" in str(err):
            failed(what, f"unpack found nothing recomputed ({str(err).split('raised ')[1]}): backward runs with "
                         "gradients disabled, and autograd saves tensors only where they are enabled")
        raise
    if not library_reached(checkpoint_fn, _SAVED_TENSORS_HOOKS):
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
    _refuse(what, _SELECTIVE, keep_cls, reuse_cls, policy)
    # TorchDispatchMode wraps each subclass's __torch_dispatch__ (dynamo off): read the learner's own function
    require_written(what, inspect.unwrap(keep_cls.__torch_dispatch__), inspect.unwrap(reuse_cls.__torch_dispatch__),
                    policy)
    policy = watched(policy, *_SELECTIVE)  # the library's modes run it: the wire watches the policy's calls
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
        mine, got, matmuls = call(what, watched(_selective_step, *_SELECTIVE), modes)
    except CheckFailed as err:
        if "library" in str(err) or "not written yet" in str(err):
            raise
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
def _measured_activations(config_overrides: dict, batch: int, seq: int, k: int) -> int:
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
    library = _predict_library()
    _refuse(what, library, predict, choose)  # predict from one block's formula: no measuring, no library answer
    predict, choose = watched(predict, *library), watched(choose, *library)
    cases = [({}, B, T), ({"n_layer": 3, "n_embd": 48, "n_head": 4}, 2, 16)]
    lines, library_off, curves = [], 0, []
    for overrides, batch, seq in cases:
        config = dataclasses.replace(models.MODEL_PRESETS["gpt-tiny"], **overrides)
        btd = batch * seq * config.n_embd * FP32
        measured = []
        for k in range(config.n_layer + 1):
            want = _measured_activations(overrides, batch, seq, k)
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
            if k and got == _measured_activations(overrides, batch, seq, 0):
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

