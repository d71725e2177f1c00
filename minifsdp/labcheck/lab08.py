"""Checks of lab 08 (tensor parallel): f and g, the parallel MLP and attention, vocab-parallel loss, SP's operators.

Every check runs the learner's code on 2 ranks (``launch``; on a machine with
fewer GPUs ``launch`` runs CPU ranks and says so; the q/k/v slicing check runs
in this process), compares with the full single-process layer and counts the
learner's collectives on the tracer against the design's target. When a
result is wrong the check recomputes the one or two typical mistakes (here,
not in the notebook) to say which idea is missing. Targets come from
``minifsdp.tensor_parallel`` and ``comm``, never typed in.

Each exercise is the learner's own mechanism: ``refuse_library`` reads what
the learner's code can reach (aliases, notebook helpers, subclasses) and a
``Wire`` inside the workers trips if the library's implementation of the
exercise runs inside the learner's code (``minifsdp.tensor_parallel``'s f / g
and sequence-parallel autograd Functions, its parallel layers, its
vocab-parallel cross-entropy). ``hint("f_and_g")`` gives the next hint. Read
``verdict.py`` first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import comm, dist, models, trace
from .. import tensor_parallel as tpl
from ..tensor_parallel import cross_entropy as _ce
from ..tensor_parallel import layers as _layers
from ..tensor_parallel import mappings as _maps
from ..tensor_parallel.layers import _local_slice
from .authorship import Wire
from .verdict import Hints, call, check_world, failed, figures, passed, refuse_library, run, watched

__all__ = ["f_and_g", "parallel_layers", "vocab_parallel_loss", "sequence_parallel_ops", "hint"]

TP = check_world(2)   # every check runs the learner's code on 2 ranks (CPU ranks on a 1-GPU machine)
B, T = 2, 8

# The library's implementation of each exercise: refused statically, and a wire inside the workers.
_F_G = (_maps._CopyToModelParallelRegion, _maps._ReduceFromModelParallelRegion,
        _maps.copy_to_model_parallel_region, _maps.reduce_from_model_parallel_region, _maps._all_reduce)
_QKV = (_local_slice, _layers._master, tpl.local_slices, _layers.ColumnParallelLinear)
_LAYERS = _F_G + _QKV + (_layers.RowParallelLinear, tpl.ParallelMLP, tpl.ParallelAttention, tpl.ParallelBlock,
                         tpl.ParallelGPT, tpl.tensor_parallel_gpt)
_CE = (tpl.vocab_parallel_cross_entropy, _ce._VocabParallelCrossEntropy, _layers.local_vocab_ids, tpl.ParallelGPT)
_SP = (_maps._GatherFromSequenceParallelRegion, _maps._ReduceScatterToSequenceParallelRegion,
       _maps._ScatterToSequenceParallelRegion, _maps._GatherFromModelParallelRegion,
       _maps._ScatterToModelParallelRegion, _maps.gather_from_sequence_parallel_region,
       _maps.reduce_scatter_to_sequence_parallel_region, _maps.scatter_to_sequence_parallel_region,
       _maps.gather_from_model_parallel_region, _maps.scatter_to_model_parallel_region,
       _maps.gather_along, _maps._reduce_scatter_along, _maps.split_along)

hint = Hints({
    "f_and_g": [
        "For each operator, forward and backward, ask: is the tensor already the same on every rank, or is "
        "each rank's only a part of a sum?",
        "f, forward: every rank already holds the whole x. Backward: every rank's slice used x, so dL/dx is "
        "the sum of the ranks' parts.",
        "g mirrors f: forward, the ranks' partial outputs must be summed; backward, the output's gradient is "
        "already the same on every rank.",
        "comm.all_reduce sums in place: sum a copy, since autograd may still need the tensor it gave you.",
    ],
    "ParallelMLP": [
        "c_fc splits its output features (the hidden units), c_proj its input features: the same hidden units.",
        "nn.Linear stores weight as (out, in): rank r's hidden units are a block of c_fc's rows (and of its "
        "bias) and the same block of c_proj's columns.",
        "c_proj's bias belongs to the output, not to a hidden unit: keep it whole and add it once, after the sum.",
        "forward: x enters through your f, GeLU acts on each hidden unit alone, g sums the partial products; "
        "F.linear without a bias gives a partial product.",
    ],
    "shard_qkv": [
        "c_attn's rows are q's d rows, then k's, then v's. Rank r's heads are the same block of rows in each.",
        "Cut the stack into its three parts first, take block r of tp from each, then stack them in the order "
        "q, k, v. A 1-D bias works the same way.",
    ],
    "ParallelAttention": [
        "Load the slices as in ParallelMLP: shard_qkv for c_attn's weight and bias, c_proj's matching columns, "
        "c_proj's whole bias.",
        "forward is models.CausalSelfAttention.forward with n_head / tp heads, between your f and g.",
        "c_attn's output is [q | k | v], h*hd features each; this rank's heads side by side are c_proj's input.",
        "Add c_proj's bias once, after g, as in ParallelMLP.",
    ],
    "vocab_parallel_loss": [
        "The loss needs three numbers per token: the max logit, the sum of exp(z - max), the target's logit. "
        "Each reduces over the vocabulary.",
        "A reduction over the vocabulary is one over this rank's slice, then one across ranks (MAX for a max, "
        "SUM for a sum).",
        "Every rank must subtract the same, global max before exponentiating, or the ranks' sums do not add up.",
        "Only the rank whose slice holds the target id knows its logit; the others contribute 0 to that sum.",
    ],
    "sequence_parallel": [
        "all_reduce = reduce_scatter + all_gather: each operator does one of the halves forward, the other "
        "backward.",
        "Backward of a gather: each rank's full-sequence gradient is only a partial sum (it covers its columns "
        "of the next layer).",
        "comm's collectives work on dim 0, and the sequence is dim 1 of (B, T, d): move it to the front and back.",
    ],
})


def _calls(tracer: trace.Tracer) -> list[tuple[str, int]]:
    return [(s.name, s.args["numel"]) for s in tracer.trace.comm_spans()]


def _config() -> models.GPTConfig:
    return models.MODEL_PRESETS["gpt-tiny"]


def _refuse(what: str, library: tuple, *fns: Any) -> None:
    for fn in fns:
        refuse_library(what, fn, *library)


# ----------------------------------------------------------------------------- f and g
def _f_and_g_worker(f_cls: Any, g_cls: Any) -> dict[str, Any]:
    tpl.initialize_model_parallel(TP)
    r = tpl.get_model_parallel_rank()
    gen = torch.Generator().manual_seed(80)
    dev = dist.device()
    xs = [torch.randn(3, 4, generator=gen).to(dev) for _ in range(TP)]   # every rank's own tensor
    ws = [torch.randn(3, 4, generator=gen).to(dev) for _ in range(TP)]
    out: dict[str, Any] = {}
    for name, cls in (("f", f_cls), ("g", g_cls)):
        x = xs[r].clone().requires_grad_()
        before = x.detach().clone()
        fwd, bwd = trace.Tracer(), trace.Tracer()
        with Wire(*_F_G):
            with fwd:
                y = cls.apply(x)
            with bwd:
                (y * (ws[r] if name == "f" else ws[0])).sum().backward()  # f: rank-specific use; g: same everywhere
        out[name] = {"y": y.detach(), "grad": None if x.grad is None else x.grad.clone(),
                     "changed": not torch.equal(x.detach(), before), "fwd": _calls(fwd), "bwd": _calls(bwd)}
    out["x"], out["sum_x"], out["w"], out["sum_w"] = xs[r], sum(xs), ws, sum(ws)
    return out


def f_and_g(f_cls: Any, g_cls: Any) -> None:
    """The learner's f and g on 2 ranks: outputs and input gradients equal one process's, one all-reduce each."""
    what = "f and g"
    _refuse(what, _F_G, f_cls, g_cls)
    outs = run(what, _f_and_g_worker, TP, f_cls, g_cls)
    for r, o in enumerate(outs):
        f, g = o["f"], o["g"]
        if f["changed"] or g["changed"]:
            failed(what, "your forward changed its input in place (all-reduce a clone: autograd still needs x)")
        if not torch.allclose(f["y"], o["x"]):
            failed(what, f"f's forward changed x on rank {r}: every rank already holds the whole input, "
                         "and the column-parallel layer needs it as it is")
        if f["grad"] is None or not torch.allclose(f["grad"], o["sum_w"], atol=1e-6):
            local = f["grad"] is not None and torch.allclose(f["grad"], o["w"][r], atol=1e-6)
            failed(what, "f's backward returned this rank's gradient only: x feeds every rank's slice, so dL/dx "
                         "is the sum of the ranks' contributions" if local else
                         f"f's backward gives the wrong gradient on rank {r}: it should be the sum over ranks")
        if not torch.allclose(g["y"], o["sum_x"], atol=1e-6):
            failed(what, f"g's forward on rank {r} is not the sum of every rank's partial result")
        if g["grad"] is None or not torch.allclose(g["grad"], o["w"][0], atol=1e-6):
            scaled = g["grad"] is not None and torch.allclose(g["grad"], TP * o["w"][0], atol=1e-6)
            failed(what, f"g's backward summed over ranks: the output's gradient is already the same on every "
                         f"rank, so summing makes it {TP}x too big" if scaled else
                         "g's backward must give x the gradient one process would: the output's gradient")
    f, g = outs[0]["f"], outs[0]["g"]
    counts = (len(f["fwd"]), len(f["bwd"]), len(g["fwd"]), len(g["bwd"]))
    if counts != (0, 1, 1, 0):
        failed(what, figures("collectives (f fwd, f bwd, g fwd, g bwd)", counts, (0, 1, 1, 0)) +
               ": one all-reduce each, f's in backward and g's in forward")
    passed(what, f"{TP} ranks, outputs and gradients right; " +
           figures("all-reduces (f fwd, f bwd, g fwd, g bwd)", counts, (0, 1, 1, 0)))


# ----------------------------------------------------------------------------- parallel MLP and attention
def _layer_worker(kind: str, cls: Any) -> dict[str, Any]:
    tpl.initialize_model_parallel(TP)
    r = tpl.get_model_parallel_rank()
    dev = dist.device()
    block = models.build_model("gpt-tiny", seed=8).blocks[0].to(dev)
    full = block.mlp if kind == "mlp" else block.attn
    first = full.c_fc if kind == "mlp" else full.c_attn
    with torch.no_grad():  # GPT-2 starts its biases at 0, which would hide a bias added on every rank
        for bias in (first.bias, full.c_proj.bias):
            bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(bias.numel())).to(dev))
    x = torch.randn(B, T, first.in_features, generator=torch.Generator().manual_seed(81)).to(dev)
    xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yf = full(xf)
    up = torch.randn(yf.shape, generator=torch.Generator().manual_seed(82)).to(dev)
    yf.backward(up)
    fwd, bwd = trace.Tracer(), trace.Tracer()
    with Wire(*_LAYERS):                          # the learner's layer: built, run forward and backward
        mine = cls(full)
        with fwd:
            yp = mine(xp)
        with bwd:
            yp.backward(up)
    name, stride = ("c_fc", 1) if kind == "mlp" else ("c_attn", 3)
    want = {f"{name}.weight": _local_slice(first.weight.grad, 0, stride),
            f"{name}.bias": _local_slice(first.bias.grad, 0, stride),
            "c_proj.weight": _local_slice(full.c_proj.weight.grad, 1), "c_proj.bias": full.c_proj.bias.grad}
    grads = {n: p.grad for n, p in mine.named_parameters()}
    return {"rank": r, "y": yp.detach(), "y_full": yf.detach(), "bias": full.c_proj.bias.detach(),
            "dx": xp.grad, "dx_full": xf.grad, "fwd": _calls(fwd), "bwd": _calls(bwd),
            "n_params": sum(p.numel() for p in mine.parameters()),
            "grad_errors": {n: (None if grads.get(n) is None or grads[n].shape != w.shape
                                else (grads[n] - w).abs().max().item()) for n, w in want.items()}}


def _check_layer(what: str, kind: str, cls: Any, target_params: int, layout: str) -> str:
    outs = run(what, _layer_worker, TP, kind, cls)
    d = _config().n_embd
    for o in outs:
        r = o["rank"]
        if o["n_params"] != target_params:
            failed(what, figures(f"parameters on rank {r}", o["n_params"], target_params) + ": " + layout)
        if not torch.allclose(o["y"], o["y_full"], atol=1e-5):
            if torch.allclose(o["y"], o["y_full"] + (TP - 1) * o["bias"], atol=1e-5):
                failed(what, f"the output is c_proj's bias {TP}x over: every rank added it before the sum; "
                             "add the bias once, after g")
            failed(what, f"rank {r}'s output differs from the full layer's by "
                         f"{(o['y'] - o['y_full']).abs().max().item():.3g}: {layout}; f before, g after")
        if o["dx"] is None or not torch.allclose(o["dx"], o["dx_full"], atol=1e-5):
            failed(what, f"the input's gradient on rank {r} is not the full layer's: the input must enter through f")
        bad = [n for n, e in o["grad_errors"].items() if e is None or e > 1e-5]
        if bad:
            failed(what, f"rank {r}: the gradients of {', '.join(bad)} are not the full model's slices ({layout})")
    numel = B * T * d
    target = ([("all_reduce", numel)], [("all_reduce", numel)])
    if (outs[0]["fwd"], outs[0]["bwd"]) != target:
        failed(what, figures("collectives (forward, backward)", (outs[0]["fwd"], outs[0]["bwd"]), target) +
               ": one all-reduce of B*T*d forward (g) and one backward (f), nothing else")
    return f"{len(outs[0]['fwd']) + len(outs[0]['bwd'])}"


def _qkv_shard(shard_fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
    """The rows of c_attn (stacked [q; k; v]) rank r keeps, for tp = 2 and 4: whole heads of each."""
    what = "q, k, v slices"
    d = 16
    weight = torch.arange(3 * d * 2, dtype=torch.float32).view(3 * d, 2)
    bias = torch.arange(3 * d, dtype=torch.float32)
    mine = watched(shard_fn, *_QKV)
    for tp in (2, 4):
        for r in range(tp):
            for name, t in (("weight", weight), ("bias", bias)):
                got = call(what, mine, t, r, tp)
                want = torch.cat([part.chunk(tp)[r] for part in t.split(d)])
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    failed(what, f"tp={tp}, rank {r}, c_attn's {name}: expected a tensor of shape "
                                 f"{tuple(want.shape)}, got {getattr(got, 'shape', type(got).__name__)}")
                if torch.equal(got, t.chunk(tp)[r]):
                    failed(what, f"tp={tp}, rank {r} took a contiguous block of the stacked rows: rank 0 would "
                                 "hold all of q and none of v. A rank needs its heads' rows of q, of k and of v")
                if not torch.equal(got, want):
                    failed(what, f"tp={tp}, rank {r}, c_attn's {name}: not rank r's heads' rows of q, then of k, "
                                 "then of v")


def parallel_layers(mlp_cls: Callable[[Any], torch.nn.Module], shard_fn: Callable[..., torch.Tensor],
                    attn_cls: Callable[[Any], torch.nn.Module]) -> None:
    """The learner's ParallelMLP and ParallelAttention on 2 ranks against the full layers (output, input and
    weight gradients, parameters held, all-reduces per forward and backward: target 1 and 1 of B*T*d), and
    shard_qkv's rows for tp = 2 and 4."""
    d = _config().n_embd
    _refuse("parallel MLP", _LAYERS, mlp_cls)
    _refuse("q, k, v slices", _QKV, shard_fn)
    _refuse("parallel attention", _LAYERS, attn_cls)
    mlp = _check_layer("parallel MLP", "mlp", mlp_cls, (4 * d * d + 4 * d) // TP + 4 * d * d // TP + d,
                       "each rank keeps its 4d/tp hidden units: rows of c_fc (and of its bias), the matching "
                       "columns of c_proj, and c_proj's whole bias")
    _qkv_shard(shard_fn)
    attn = _check_layer("parallel attention", "attn", attn_cls, (3 * d * d + 3 * d) // TP + d * d // TP + d,
                        "each rank keeps its heads' rows of c_attn, the matching columns of c_proj and its "
                        "whole bias")
    numel = B * T * d
    passed("parallel MLP and attention", f"equal the full layers on {TP} ranks, q/k/v rows right for tp = 2 and 4; "
           + figures("all-reduces per layer (forward + backward)", f"{mlp} and {attn}", "2 and 2") +
           f", each of B*T*d = {numel:,} values ({comm.collective_bytes('all_reduce', 4 * numel, TP)['bytes']:,} B "
           "volume)")


# ----------------------------------------------------------------------------- vocab-parallel loss
def _ce_worker(loss_fn: Any, vocab: int) -> dict[str, Any]:
    tpl.initialize_model_parallel(TP)
    r = tpl.get_model_parallel_rank()
    gen = torch.Generator().manual_seed(83)
    logits = (torch.randn(B, T, vocab, generator=gen) * 4).to(dist.device())
    target = torch.randint(0, vocab, (B, T), generator=gen).to(dist.device())
    local = logits.chunk(TP, -1)[r].clone()
    before = local.clone()
    tracer = trace.Tracer()
    with Wire(*_CE), tracer:
        loss = loss_fn(local, target)
    full = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none").view(B, T)
    # the typical mistake, for the verdict: each rank subtracts its own max before the sums
    parts = logits.chunk(TP, -1)
    maxes = [p.max(-1).values for p in parts]
    sum_exp = sum((p - m.unsqueeze(-1)).exp().sum(-1) for p, m in zip(parts, maxes))
    owner = target // (vocab // TP)
    shifted_target = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.stack(maxes).gather(
        0, owner.unsqueeze(0)).squeeze(0)
    return {"loss": None if not isinstance(loss, torch.Tensor) else loss.detach(), "full": full,
            "changed": not torch.equal(local, before), "calls": tracer.trace.comm_spans(),
            "own_max": torch.log(sum_exp) - shifted_target, "logits_bytes": logits.numel() * 4}


def vocab_parallel_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """The learner's per-token loss from a vocabulary slice, on 2 ranks, against F.cross_entropy on the
    full logits; its bytes moved beside what gathering the logits would move."""
    what = "vocab-parallel cross-entropy"
    _refuse(what, _CE, loss_fn)
    vocab = _config().vocab_size
    outs = run(what, _ce_worker, TP, loss_fn, vocab)
    for r, o in enumerate(outs):
        if o["loss"] is None or o["loss"].shape != o["full"].shape:
            failed(what, f"return one loss per token, shape {tuple(o['full'].shape)} (no mean)")
        if o["changed"]:
            failed(what, "your function changed the logits in place; subtract the max out of place")
        if not torch.allclose(o["loss"], o["full"], atol=1e-4):
            off = f"rank {r}'s loss is off by up to {(o['loss'] - o['full']).abs().max().item():.3g}"
            if torch.allclose(o["loss"], o["own_max"], atol=1e-4):
                failed(what, f"{off}: each rank subtracted its own max, so the ranks' sums of exponentials do not "
                             "add up; every rank must subtract the same, global max")
            failed(what, f"{off}: only the rank that owns the target id may contribute its logit (the others add "
                         "0), and the sum of exponentials and the target's logit are sums over ranks")
    moved = sum(int(s.args["bytes"]) for s in outs[0]["calls"])
    gather = comm.collective_bytes("all_gather", outs[0]["logits_bytes"], TP)["bytes"]
    if moved >= gather:
        failed(what, figures("bytes moved", moved, f"< {gather:,}", unit="B") +
               ": that is as much as gathering the logits; reduce per-token numbers instead")
    target = comm.collective_bytes("all_reduce", 3 * 4 * B * T, TP)["bytes"]
    passed(what, f"equals F.cross_entropy on {TP} ranks; " + figures("bytes moved", moved, target, unit="B")
           + f"; gathering the logits would move {gather:,} B")


# ----------------------------------------------------------------------------- sequence parallel
def _sp_worker(gather_cls: Any, rs_cls: Any) -> dict[str, Any]:
    tpl.initialize_model_parallel(TP)
    r = tpl.get_model_parallel_rank()
    d = _config().n_embd
    gen = torch.Generator().manual_seed(84)
    dev = dist.device()
    shards = [torch.randn(B, T // TP, d, generator=gen).to(dev) for _ in range(TP)]  # every rank's positions
    partials = [torch.randn(B, T, d, generator=gen).to(dev) for _ in range(TP)]      # every rank's partial sums
    ups = [torch.randn(B, T, d, generator=gen).to(dev) for _ in range(TP)]           # rank-specific upstream grads
    out: dict[str, Any] = {}
    for name, cls, x, up in (("gather", gather_cls, shards[r], ups[r]),
                             ("reduce_scatter", rs_cls, partials[r], ups[r][:, :T // TP])):
        x = x.clone().requires_grad_()
        fwd, bwd = trace.Tracer(), trace.Tracer()
        with Wire(*_SP):
            with fwd:
                y = cls.apply(x)
            if y.shape == up.shape:  # a wrong shape is reported from the forward alone
                with bwd:
                    y.backward(up)
        out[name] = {"y": y.detach(), "grad": x.grad, "fwd": fwd.trace.comm_spans(), "bwd": bwd.trace.comm_spans()}
    mine = slice(r * T // TP, (r + 1) * T // TP)
    out["want"] = {"gather": (torch.cat(shards, dim=1), sum(ups)[:, mine]),
                   "reduce_scatter": (sum(partials)[:, mine], torch.cat([u[:, :T // TP] for u in ups], dim=1))}
    return out


def sequence_parallel_ops(gather_cls: Any, rs_cls: Any) -> None:
    """GatherSequence / ReduceScatterSequence on 2 ranks: values, gradients, and bytes equal to f + g's."""
    what = "sequence-parallel operators"
    _refuse(what, _SP, gather_cls, rs_cls)
    outs = run(what, _sp_worker, TP, gather_cls, rs_cls)
    labels = {"gather": "GatherSequence", "reduce_scatter": "ReduceScatterSequence"}
    for r, o in enumerate(outs):
        for name, (y_want, g_want) in o["want"].items():
            got = o[name]
            if got["y"].shape != y_want.shape:
                failed(what, f"{labels[name]}'s output has shape {tuple(got['y'].shape)}, not "
                             f"{tuple(y_want.shape)}: the sequence is dim 1 of (B, T, d), and comm's collectives "
                             "work on dim 0")
            if not torch.allclose(got["y"], y_want, atol=1e-5):
                failed(what, f"{labels[name]}'s forward on rank {r} is wrong: " +
                       ("every rank's positions, in rank order" if name == "gather" else
                        "the sum over ranks, then this rank's positions"))
            if got["grad"] is None or got["grad"].shape != g_want.shape or not torch.allclose(got["grad"], g_want,
                                                                                               atol=1e-5):
                failed(what, f"{labels[name]}'s backward on rank {r} is wrong: " +
                       ("each rank's full-sequence gradient is a partial sum: sum over ranks, keep my positions "
                        "(reduce-scatter)" if name == "gather" else "every position's gradient (all-gather)"))
    volume = sum(int(s.args["bytes"]) for n in labels for s in outs[0][n]["fwd"] + outs[0][n]["bwd"])
    target = 2 * comm.collective_bytes("all_reduce", B * T * _config().n_embd * 4, TP)["bytes"]
    if volume != target:
        failed(what, figures("bytes moved by the two, forward and backward", volume, target, unit="B") +
               ": one all-gather and one reduce-scatter of B*T*d each way")
    passed(what, f"values and gradients right on {TP} ranks; " +
           figures("bytes", volume, target, unit="B") + " (= the two all-reduces of f and g they replace)")
