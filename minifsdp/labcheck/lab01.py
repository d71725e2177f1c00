"""Checks of lab 01 (memory anatomy): the learner predicts bytes, the check measures them.

Every target here is a measurement made by ``minifsdp.memory.MemoryTracker``
while the check runs (a real AdamW step, a real forward pass), never a formula
copied from the lab; the library's own estimate (``minifsdp.estimate``) is
printed beside it. When a prediction is off, the check varies one size at a
time (batch B, sequence T, width d, heads h) and fits the error to the shapes a
saved tensor can have — B·T·d, B·T, B·h·T², a constant — so the verdict says
*what kind* of tensor is missing (e.g. "2 tensors of B·T·d fp32 values per
block") without listing the answer's terms.

Predicting is the exercise: every prediction function is refused, statically and
at run time (``refuse_library`` and a ``Wire``), when it reaches the library's
formulas (``minifsdp.estimate``), counts a built model, or measures (the
``MemoryTracker``, or this module's own measuring helpers, which are private:
``_measure_*``). Read ``verdict.py`` first.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import data, estimate, models
from ..memory import ACTIVATIONS, GRADIENTS, OPTIMIZER, OTHER, PARAMETERS, MemoryTracker
from .verdict import Hints, call, failed, figures, passed, refuse_library, require_written, uses, watched

FP32, INT64 = 4, 8

hint = Hints({
    "predict_model_states": [
        "Ψ is the number of parameters: the sum over the shapes of their products. Each category holds a "
        "fixed number of fp32 values per parameter (4 bytes each).",
        "A gradient is one value per weight. AdamW keeps two running moments per weight (Loshchilov & Hutter).",
        "torch's AdamW also keeps, for every parameter TENSOR, its step count as a 0-d fp32 tensor.",
    ],
    "predict_gpt_params": [
        "Add up the shapes printed above the exercise: two embeddings, L blocks, a final LayerNorm, the head.",
        "A block: two LayerNorms (a weight, and a bias if config.bias) and four Linear layers, d to 3d, d to d, "
        "d to 4d and 4d to d, each with a bias of its output width if config.bias.",
        "With config.tie_embeddings the head IS the token embedding's weight: count it once.",
    ],
    "predict_mlp_activation_bytes": [
        "Go op by op: Linear, ReLU, Linear, ReLU, Linear, cross_entropy. What does each backward need? The "
        "probe's rules above tell you.",
        "A tensor two ops keep (a ReLU's output is also the next Linear's input) is stored once. Count the "
        "batch itself (the first Linear keeps it) and the labels (int64, 8 bytes each).",
        "cross_entropy keeps its log-softmax output, the labels and one fp32 scalar.",
    ],
    "predict_block_activation_bytes": [
        "Walk Block.forward line by line and write down what each op keeps; probe any op you are unsure of.",
        "Count values by kind: hidden-state sized (B·T·d), wider MLP tensors (B·T·4d), LayerNorm statistics "
        "(B·T per statistic), attention probabilities (B·h·T·T); then 4 bytes each.",
        "The two attention matmuls keep q, k and v (as contiguous copies); the scale, the mask and the residual "
        "adds keep nothing.",
    ],
    "predict_gpt_activation_bytes": [
        "L blocks (your block formula), plus what the ops outside the blocks keep: read GPT.embed, GPT.unembed "
        "and lm_loss.",
        "The embedding lookups keep their indices (token ids, and the positions: int64); the final LayerNorm "
        "and the head keep what any LayerNorm and Linear keep.",
        "The loss keeps what cross_entropy keeps, over V classes for every one of the B·T tokens.",
    ],
})


# ------------------------------------------------------------------ exercise 1: model states from shapes
def _measure_model_states(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> dict[str, int]:
    """Parameters, gradients and AdamW state of one real step, as the tracker books them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker()
    tracker.track_model(model)
    with tracker:
        x, y = (t.clone() for t in batch)
        loss_fn(model(x), y).backward()
        grads = tracker.live()[GRADIENTS]
        opt.step()
        out = {"parameters": tracker.live()[PARAMETERS], "gradients": grads, "optimizer": tracker.live()[OPTIMIZER]}
    tracker.close()
    return out


def _model_cases() -> list[tuple[str, torch.nn.Module, tuple, Callable]]:
    gen = torch.Generator().manual_seed(0)
    mlp_batch = (torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen))
    return [("mlp", models.build_model("mlp"), mlp_batch, F.cross_entropy),
            ("gpt-tiny", models.build_model("gpt-tiny"), data.get_batch(0, 2, 16), models.lm_loss),
            ("gpt-tiny, 3 layers of width 48", models.build_model("gpt-tiny", n_layer=3, n_embd=48, n_head=4),
             data.get_batch(0, 2, 16), models.lm_loss)]


def _adamw_mistake(got: int, want: int, n: int, k: int) -> str:
    known = {
        FP32 * n: "you counted one moment; AdamW keeps two per parameter (exp_avg and exp_avg_sq)",
        FP32 * n + FP32 * k: "you counted one moment; AdamW keeps two per parameter (exp_avg and exp_avg_sq)",
        2 * FP32 * n: f"{want - got} B short: the `step` counter, a 4-byte fp32 tensor per parameter *tensor* "
                      f"({k} tensors here)",
        2 * n + k: "you counted elements; the state is fp32, 4 bytes per element",
        2 * n: "you counted elements (4 bytes each), and there is a small per-tensor term too",
        3 * FP32 * n + FP32 * k: "you counted the parameters as optimizer state too",
    }
    return known.get(got, f"off by {want - got:+,} B: what does AdamW keep for every parameter, and what once "
                          "per parameter tensor?")


def _gpt_params_problem(count: Callable) -> str | None:
    """``count(config)`` against the parameters of built GPTs (biases, ties and sizes varied)."""
    base = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    for change in ({}, {"n_layer": 3}, {"n_embd": 48, "n_head": 4}, {"bias": False}, {"tie_embeddings": True},
                   {"block_size": 64, "vocab_size": 100}):
        config = models.GPTConfig(**{**base, **change})
        want = models.count_parameters(models.GPT(config))
        got = int(count(config))
        if got != want:
            what = ", ".join(f"{k}={v}" for k, v in change.items()) or "the base config"
            return (f"Ψ for gpt (L=2, d=32, V=64, block_size=32) with {what}: yours {got:,}, the built model has "
                    f"{want:,} ({want - got:+,}): which shapes did you miss or count twice?")
    return None


def _predicting(what: str, *fns: Callable, also: tuple = ()) -> list[Callable]:
    """Refuse (statically) a prediction that reaches the library's formulas or measures; return the functions
    watched (at run time: the same library, and ``also``, may not run inside them)."""
    for fn in fns:
        refuse_library(what, fn, *LIBRARY)
    return [watched(fn, *LIBRARY, *also) for fn in fns]


def _bytes(what: str, fn: Callable, *args: Any) -> int:
    """``fn(*args)`` as a whole number of bytes, or a verdict saying what it returned instead."""
    got = call(what, fn, *args)
    if isinstance(got, bool) or not isinstance(got, (int, float)) or got != int(got):
        failed(what, f"{getattr(fn, '__name__', 'your function')} returned {got!r}: return a whole number of "
                     "bytes (an int)")
    return int(got)


def model_states(predict: Callable[[dict], dict], count: Callable | None = None) -> None:
    """``predict({name: shape})`` -> {"parameters", "gradients", "optimizer"} bytes, fp32 AdamW;
    ``count(config)`` -> Ψ of a GPT from its config."""
    what = "model states from shapes"
    require_written(what, predict, *([count] if count else []))
    # Stepping a real optimizer is measuring, not predicting: torch's Adam/AdamW step is watched too.
    watched_predict, *watched_count = _predicting(what, predict, *([count] if count else []),
                                                  also=(inspect.unwrap(torch.optim.AdamW.step),))
    if count is not None and uses(count, "count_parameters", "gpt_param_count", "GPT", "build_model"):
        failed(what, "predict_gpt_params builds or counts a model: predict Ψ from the config alone")
    ran = uses(predict, "step", "AdamW", "Adam", "count_parameters", "model_state_bytes_per_device",
               "optimizer_state_bytes_for")
    if ran:
        failed(what, f"it uses {ran[0]}: predict from the shapes alone (no optimizer, no library estimate)")
    lines = []
    for name, model, batch, loss_fn in _model_cases():
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        got = call(what, watched_predict, dict(shapes))
        if not isinstance(got, dict) or not {"parameters", "gradients", "optimizer"} <= set(got):
            failed(what, "return a dict with the keys 'parameters', 'gradients' and 'optimizer' (bytes)")
        want = _measure_model_states(model, batch, loss_fn)
        n, k = sum(math.prod(s) for s in shapes.values()), len(shapes)
        for key in ("parameters", "gradients"):
            if int(got[key]) != want[key]:
                hint = ("you counted elements, not bytes (fp32: 4 bytes each)" if int(got[key]) == n else
                        f"off by {want[key] - int(got[key]):+,} B: one fp32 value per parameter")
                failed(what, f"{name}: {key} {int(got[key]):,} B predicted, {want[key]:,} B measured: {hint}")
        if int(got["optimizer"]) != want["optimizer"]:
            failed(what, f"{name}: AdamW state {int(got['optimizer']):,} B predicted, {want['optimizer']:,} B "
                         f"measured after one step: {_adamw_mistake(int(got['optimizer']), want['optimizer'], n, k)}")
        library = estimate.optimizer_state_bytes_for(n, "adamw")
        lines.append(f"{name} (Ψ = {n:,} parameters): " + figures("AdamW bytes", int(got["optimizer"]), want["optimizer"],
                                                         library, unit="B"))
    if count is not None:
        problem = call(what, _gpt_params_problem, watched_count[0])
        if problem:
            failed(what, problem)
        lines.append("your Ψ of a GPT = the built model's, 6 configs (biases, ties)")
    passed(what, "parameters and gradients 4Ψ each, to the byte; " + "; ".join(lines[-3:])
           + " (target: measured after a real step; the library's estimate leaves out the per-tensor step counters)")


# ------------------------------------------------------------------ exercise 2: the MLP's activations
def _measure_mlp_activations(batch: int) -> int:
    """Bytes saved for backward by one forward + cross-entropy of the lab's MLP (the loss itself excluded)."""
    mlp = models.build_model("mlp")
    gen = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, 8, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
    tracker = MemoryTracker()
    tracker.track_model(mlp)
    with tracker:
        tracker.register([x, y], ACTIVATIONS)
        loss = F.cross_entropy(mlp(x), y)
        saved = tracker.live()[ACTIVATIONS] - loss.nbytes
    tracker.close()
    return saved


def mlp_activations(predict: Callable[[int], int]) -> None:
    """``predict(B)``: bytes the MLP's forward + loss keep for backward (batch and labels included)."""
    what = "MLP activations"
    require_written(what, predict)
    (predict,) = _predicting(what, predict)
    cases = (32, 7, 1)
    got = {b: _bytes(what, predict, b) for b in cases}
    want = {b: _measure_mlp_activations(b) for b in cases}
    if got == want:
        passed(what, figures("B = 32", got[32], want[32], unit="B") + " (target measured); B = 7 and 1 too")
        return
    diff = {b: want[b] - got[b] for b in cases}
    per_sample = (diff[32] - diff[1]) / 31
    constant = diff[1] - per_sample
    parts = []
    if per_sample:
        parts.append(f"{'missing' if per_sample > 0 else 'counted too much:'} {abs(per_sample):g} B per sample "
                     f"(= {abs(per_sample) / FP32:g} fp32 values or {abs(per_sample) / INT64:g} int64 values)")
    if constant:
        parts.append(f"{'missing' if constant > 0 else 'extra'} {abs(constant):g} B whatever the batch (a scalar?)")
    failed(what, f"B = 32: predicted {got[32]:,} B, measured {want[32]:,} B; " + "; ".join(parts)
           + ": for each op, which tensor does its backward need, and is it the same tensor as another op's?")


# ------------------------------------------------------------------ exercise 3: one transformer block
def _measure_block_activations(config: models.GPTConfig, batch: int, seq_len: int) -> int:
    """Bytes one ``models.Block`` keeps for backward, its input included (as the GPT's residual stream)."""
    block = models.Block(config)
    x = torch.randn(batch, seq_len, config.n_embd, requires_grad=True)
    tracker = MemoryTracker()
    with tracker:
        tracker.register(list(block.parameters()), PARAMETERS)
        tracker.register(list(block.buffers()), OTHER)
        tracker.register([x], ACTIVATIONS)
        out = block(x)
        saved = tracker.live()[ACTIVATIONS] - out.nbytes  # the output is the next block's input
    tracker.close()
    return saved


def _config(d: int = 32, h: int = 2) -> models.GPTConfig:
    return models.GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=h, n_embd=d, dropout=0.0)


def _explain_by_shape(diffs: dict[tuple, int]) -> list[str]:
    """Fit error(B, T, d, h) = a·B·T·d + b·B·T + c·B·h·T² + e over the cases; say it in tensors."""
    cases = list(diffs)
    rows = torch.tensor([[B * T * d, B * T, B * h * T * T, 1] for B, T, d, h in cases], dtype=torch.float64)
    rhs = torch.tensor([diffs[c] for c in cases], dtype=torch.float64) / FP32
    coef = torch.linalg.lstsq(rows, rhs.unsqueeze(1)).solution.squeeze(1).tolist()
    names = ["tensor(s) of B·T·d values (hidden-state sized: a saved input of a Linear, a LayerNorm, or q/k/v)",
             "tensor(s) of B·T values (one number per token and row: LayerNorm statistics)",
             "tensor(s) of B·h·T² values (one number per pair of positions per head)",
             "fp32 value(s) whatever the sizes"]
    out = []
    for a, name in zip(coef, names):
        if abs(a) > 0.05:
            out.append(f"{'missing' if a > 0 else 'counted once too often:'} {abs(a):.3g} {name}")
    return out


def block_activations(predict: Callable[[Any, int, int], int]) -> None:
    """``predict(config, B, T)``: bytes one Block keeps for backward, fp32, its input included."""
    what = "one block's activations"
    require_written(what, predict)
    (predict,) = _predicting(what, predict)
    cases = [(2, 16, 32, 2), (4, 16, 32, 2), (2, 32, 32, 2), (2, 16, 64, 2), (2, 16, 32, 4), (3, 24, 48, 4)]
    got, want = {}, {}
    for B, T, d, h in cases:
        got[B, T, d, h] = _bytes(what, predict, _config(d, h), B, T)
        want[B, T, d, h] = _measure_block_activations(_config(d, h), B, T)
    if got == want:
        B, T, d, h = cases[-1]
        library = sum(estimate.gpt_layer_activation_breakdown(_config(d, h), B, T).values())
        passed(what, figures(f"B={B}, T={T}, d={d}, h={h}", got[cases[-1]], want[cases[-1]], library, unit="B")
               + " (target measured); 6 shapes, all exact")
        return
    B, T, d, h = first = next(c for c in cases if got[c] != want[c])
    reasons = _explain_by_shape({c: want[c] - got[c] for c in cases})
    if not reasons and all(got[c] and 3.5 < want[c] / got[c] < 4.5 for c in cases):
        reasons = ["you seem to count elements: fp32 values are 4 bytes"]
    failed(what, f"B={B}, T={T}, d={d}, h={h}: predicted {got[first]:,} B, measured {want[first]:,} B; "
           + ("; ".join(reasons) or "the error does not follow any tensor shape: use the config's sizes")
           + ". Walk Block.forward op by op: what does each backward need?")


# ------------------------------------------------------------------ exercise 4: the whole GPT
def _measure_gpt_activations(config: models.GPTConfig, batch: int, seq_len: int) -> int:
    """Bytes one forward + ``lm_loss`` of ``models.GPT(config)`` keep for backward (ids and targets included)."""
    model = models.GPT(config)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
    y = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
    tracker = MemoryTracker()
    with tracker:
        tracker.register(list(model.parameters()), PARAMETERS)
        tracker.register(list(model.buffers()), OTHER)
        tracker.register([x, y], ACTIVATIONS)
        loss = models.lm_loss(model(x), y)
        saved = tracker.live()[ACTIVATIONS] - loss.nbytes
    tracker.close()
    return saved


def gpt_activations(predict: Callable[[Any, int, int], int], block_fn: Callable) -> None:
    """``predict(config, B, T)`` for the whole GPT, built on the learner's ``block_fn``."""
    what = "the whole GPT's activations"
    require_written(what, predict, block_fn)
    predict, block_fn = _predicting(what, predict, block_fn)
    base = dict(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    variants = [({}, 2, 16), ({}, 4, 16), ({}, 2, 32), ({"n_layer": 3}, 2, 16), ({"vocab_size": 128}, 2, 16)]
    for change, B, T in variants:
        config = models.GPTConfig(**{**base, **change})
        got, want = _bytes(what, predict, config, B, T), _measure_gpt_activations(config, B, T)
        if got == want:
            continue
        blocks = config.n_layer * _bytes(what, block_fn, config, B, T)
        outside = want - blocks
        failed(what, f"n_layer={config.n_layer}, V={config.vocab_size}, B={B}, T={T}: predicted {got:,} B, measured "
                     f"{want:,} B ({want - got:+,} B). Your blocks account for {blocks:,} B, so outside them the model "
                     f"keeps {outside:,} B: the token ids, the positions, the final LayerNorm, the head's input, "
                     "and what the loss keeps (its backward needs the softmax of the logits)")
    config = models.GPTConfig(**base)
    library = estimate.gpt_activation_bytes(config, 8, 32)["total"]
    passed(what, figures("gpt (L=2, d=32, V=64), B=8, T=32", _bytes(what, predict, config, 8, 32),
                         _measure_gpt_activations(config, 8, 32), library, unit="B") + " (target measured)")


# The library's implementation of this lab's predictions, refused in any form (statically and at run time):
# its formulas, counting or building a model, and measuring (the tracker, this module's measuring helpers).
LIBRARY = (estimate.param_bytes, estimate.grad_bytes, estimate.optimizer_state_bytes_for,
           estimate.model_state_bytes_per_device, estimate.gpt_param_count, estimate.gpt_layer_activation_breakdown,
           estimate.gpt_activation_bytes, estimate.gpt_checkpoint_activation_bytes, models.count_parameters,
           models.build_model, models.GPT, models.Block, MemoryTracker, _measure_model_states,
           _measure_mlp_activations, _measure_block_activations, _measure_gpt_activations)
