"""Checks of lab 08 (tensor parallel): f and g, a parallel MLP, head-aligned q/k/v slices, vocab-parallel loss.

Every check runs the learner's code on real ranks (``launch``, 2 ranks; the
slicing check in this process), compares with the full single-process layer
and counts the learner's collectives on the tracer against the design's
target. When a result is wrong the check recomputes the one or two typical
mistakes (here, not in the notebook) to say which idea is missing. Targets
come from ``minifsdp.tensor_parallel`` and ``comm``, never typed in. Read
``verdict.py`` first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import comm, dist, models, trace
from .. import tensor_parallel as tpl
from ..tensor_parallel.layers import _local_slice
from .verdict import call, failed, figures, is_library, passed, run, uses

TP = 2
B, T = 2, 8
_LIBRARY = ("copy_to_model_parallel_region", "reduce_from_model_parallel_region", "_CopyToModelParallelRegion",
            "_ReduceFromModelParallelRegion", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
            "vocab_parallel_cross_entropy", "_VocabParallelCrossEntropy", "tensor_parallel_gpt")


def _told_library(what: str, *fns: Any) -> None:
    for fn in fns:
        names = [n for f in (fn, getattr(fn, "forward", None), getattr(fn, "backward", None),
                             getattr(fn, "__init__", None)) if f is not None for n in uses(f, *_LIBRARY)]
        if is_library(fn) or names:
            failed(what, f"this calls the library's {', '.join(sorted(set(names))) or fn.__name__}: "
                         "write the mechanism yourself (comm.all_reduce and plain tensor ops)")


def _calls(tracer: trace.Tracer) -> list[tuple[str, int]]:
    return [(s.name, s.args["numel"]) for s in tracer.trace.comm_spans()]


def _config() -> models.GPTConfig:
    return models.MODEL_PRESETS["gpt-tiny"]


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
        with fwd:
            y = cls.apply(x)
        with bwd:
            (y * (ws[r] if name == "f" else ws[0])).sum().backward()  # f: rank-specific use; g: same everywhere
        out[name] = {"y": y.detach(), "grad": None if x.grad is None else x.grad.clone(),
                     "changed": not torch.equal(x.detach(), before), "fwd": _calls(fwd), "bwd": _calls(bwd)}
    out["x"], out["sum_x"], out["w"], out["sum_w"] = xs[r], sum(xs), ws, sum(ws)
    return out


def f_and_g(f_cls: Any, g_cls: Any) -> None:
    """f: identity forward, all-reduce backward; g: all-reduce forward, identity backward."""
    what = "f and g"
    _told_library(what, f_cls, g_cls)
    outs = run(what, _f_and_g_worker, TP, f_cls, g_cls)
    for r, o in enumerate(outs):
        f, g = o["f"], o["g"]
        if f["changed"] or g["changed"]:
            failed(what, "your forward changed its input in place (all-reduce a clone: autograd still needs x)")
        if not torch.allclose(f["y"], o["x"]):
            failed(what, f"f's forward changed x on rank {r}: every rank already holds the whole input, "
                         "f hands it on unchanged")
        if f["grad"] is None or not torch.allclose(f["grad"], o["sum_w"], atol=1e-6):
            local = f["grad"] is not None and torch.allclose(f["grad"], o["w"][r], atol=1e-6)
            failed(what, "f's backward returned this rank's gradient only: x feeds every rank's slice, so dL/dx "
                         "is the sum of the ranks' contributions (all-reduce it)" if local else
                         f"f's backward gives the wrong gradient on rank {r}: it should be the sum over ranks")
        if not torch.allclose(g["y"], o["sum_x"], atol=1e-6):
            failed(what, f"g's forward on rank {r} is not the sum of every rank's partial result (all-reduce)")
        if g["grad"] is None or not torch.allclose(g["grad"], o["w"][0], atol=1e-6):
            scaled = g["grad"] is not None and torch.allclose(g["grad"], TP * o["w"][0], atol=1e-6)
            failed(what, f"g's backward all-reduced: the output's gradient is already the same on every rank, "
                         f"so summing makes it {TP}x too big; pass it through" if scaled else
                         "g's backward must hand the output's gradient back unchanged")
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
    mine = cls(full)
    x = torch.randn(B, T, first.in_features, generator=torch.Generator().manual_seed(81)).to(dev)
    xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yf = full(xf)
    fwd, bwd = trace.Tracer(), trace.Tracer()
    with fwd:
        yp = mine(xp)
    up = torch.randn(yf.shape, generator=torch.Generator().manual_seed(82)).to(dev)
    yf.backward(up)
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


def parallel_mlp(mlp_cls: Callable[[Any], torch.nn.Module]) -> None:
    """The learner's ParallelMLP on 2 ranks against the full MLP: output, input and weight gradients,
    parameters held, and the all-reduces per forward and backward (target 1 and 1 of B*T*d)."""
    d = _config().n_embd
    _check_layer("parallel MLP", "mlp", mlp_cls, (4 * d * d + 4 * d) // TP + 4 * d * d // TP + d,
                 "each rank keeps 4d/tp rows of c_fc (and its bias), the matching 4d/tp columns of c_proj, "
                 "and c_proj's whole bias")


def parallel_attention(attn_cls: Callable[[Any], torch.nn.Module]) -> None:
    """The learner's ParallelAttention on 2 ranks against the full attention, as ``parallel_mlp``."""
    d = _config().n_embd
    _check_layer("parallel attention", "attn", attn_cls, (3 * d * d + 3 * d) // TP + d * d // TP + d,
                 "each rank keeps its heads' rows of c_attn, the matching columns of c_proj and its whole bias")


def _check_layer(what: str, kind: str, cls: Any, target_params: int, layout: str) -> None:
    _told_library(what, cls)
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
    passed(what, f"equals the full layer on {TP} ranks; " + figures("all-reduces forward + backward", 2, 2) +
           f", each of B*T*d = {numel:,} values ({comm.collective_bytes('all_reduce', 4 * numel, TP)['bytes']:,} B "
           "volume)")


# ----------------------------------------------------------------------------- q/k/v slices
def qkv_shard(shard_fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
    """The rows of c_attn (stacked [q; k; v]) rank r keeps, for tp = 2 and 4: whole heads of each."""
    what = "q, k, v slices"
    _told_library(what, shard_fn)
    d = 16
    weight = torch.arange(3 * d * 2, dtype=torch.float32).view(3 * d, 2)
    for tp in (2, 4):
        for r in range(tp):
            got = call(what, shard_fn, weight, r, tp)
            want = torch.cat([part.chunk(tp)[r] for part in weight.split(d)])
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                failed(what, f"tp={tp}, rank {r}: expected a tensor of shape {tuple(want.shape)}, got "
                             f"{getattr(got, 'shape', type(got).__name__)}")
            if torch.equal(got, weight.chunk(tp)[r]):
                failed(what, f"tp={tp}, rank {r} took a contiguous block of the stacked rows: rank 0 would hold "
                             "all of q and none of v. Cut q, k and v each, and keep slice r of every one")
            if not torch.equal(got, want):
                failed(what, f"tp={tp}, rank {r}: not rows [r*d/tp, (r+1)*d/tp) of each of q, k and v, in that order")
    passed(what, "tp = 2 and 4: every rank holds its heads' rows of q, k and v (d/tp each)")


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
    with tracer:
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
    _told_library(what, loss_fn)
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
                             "add up; every rank must subtract the same, global max (all-reduce with MAX)")
            failed(what, f"{off}: only the rank that owns the target id may contribute its logit (the others add "
                         "0), and the sum of exponentials and the target's logit are sums over ranks")
    moved = sum(int(s.args["bytes"]) for s in outs[0]["calls"])
    gather = comm.collective_bytes("all_gather", outs[0]["logits_bytes"], TP)["bytes"]
    if moved >= gather:
        failed(what, figures("bytes moved", moved, f"< {gather:,}", unit="B") +
               ": that is as much as gathering the logits; reduce per-token numbers instead")
    passed(what, f"equals F.cross_entropy on {TP} ranks; " + figures("bytes moved", moved, 3 * 2 * 4 * B * T, unit="B")
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
    _told_library(what, gather_cls, rs_cls)
    outs = run(what, _sp_worker, TP, gather_cls, rs_cls)
    labels = {"gather": "GatherSequence", "reduce_scatter": "ReduceScatterSequence"}
    for r, o in enumerate(outs):
        for name, (y_want, g_want) in o["want"].items():
            got = o[name]
            if got["y"].shape != y_want.shape:
                failed(what, f"{labels[name]}'s output has shape {tuple(got['y'].shape)}, not "
                             f"{tuple(y_want.shape)}: the sequence is dim 1 of (B, T, d); move it to dim 0 for comm "
                             "and back")
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
