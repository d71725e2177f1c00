"""Workers for the context-parallel tests (sent by value to the ranks; see tests/fsdp_helpers.py).

One launch per cp size runs every multi-rank check (launches cost seconds on 2
cores): ``cp_checks`` returns, per rank, the largest relative differences it saw,
the bytes and work the tracer measured, and the errors raised for bad input.
"""

import sys

import cloudpickle
import torch

from minifsdp import comm, dist, models, trace
from minifsdp import context_parallel as C

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPLITS = ("zigzag", "naive")
B, T, STEPS = 2, 32, 3  # gpt-tiny: block_size 32 (divisible by 2*cp for cp = 2 and 4)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def rel(a, b):
    """max |a - b| / max |b|: the relative error of a whole tensor."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def rel_model(ours, ref):
    """The same over a whole model ({name: tensor} each): max |a - b| over every entry / max |b| over every
    entry. Per tensor would divide by a near-zero scale where the true value is zero: the key bias's gradient
    is exactly 0 (softmax ignores a constant added to a row's scores), so both sides hold rounding noise that
    AdamW's g / sqrt(v) turns into updates of ~lr, and those parameters differ by rounding, not by the split."""
    diff = max((ours[n] - ref[n]).abs().max().item() for n in ref)
    return diff / max(t.abs().max().item() for t in ref.values())


def attention_parity(cp, rank, split, b=2, h=2, t=32, hd=8):
    """ring_attention vs one process's causal attention on the whole sequence: output and grads of q, k, v."""
    q, k, v = (torch.randn(b, h, t, hd, generator=_gen(s), requires_grad=True) for s in (1, 2, 3))
    up = torch.randn(b, h, t, hd, generator=_gen(4))
    mask = models._future_mask(t)
    full = C.softmax_attention(q, k, v, mask)
    full.backward(up)
    shard = lambda x: C.shard_sequence(x.detach(), cp, rank, split, dim=2)  # noqa: E731
    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    out = C.ring_attention(ql, kl, vl, split=split)
    out.backward(shard(up))
    return {"out": rel(out, shard(full)), "dq": rel(ql.grad, shard(q.grad)), "dk": rel(kl.grad, shard(k.grad)),
            "dv": rel(vl.grad, shard(v.grad))}


def gpt_parity(cp, rank, split, wrap=None):
    """ContextParallelGPT (gradients averaged over the cp group) vs the full GPT on the whole sequence, both
    trained STEPS AdamW steps: relative errors of losses, gradients (plain / DDP) and final parameters.
    Also the tracer's ring bytes per (layer, phase, op) of the first step, and each layer's measured work."""
    from minifsdp.ddp import DistributedDataParallel
    from minifsdp.fsdp import FullyShardedDataParallel

    full = models.build_model("gpt-tiny", seed=0)
    base = models.build_model("gpt-tiny", seed=0)
    cpm = C.context_parallel_gpt(base, None, split)
    model = {"ddp": DistributedDataParallel, "fsdp": FullyShardedDataParallel}[wrap](cpm) if wrap else cpm
    opt_f = torch.optim.AdamW(full.parameters(), lr=1e-3, weight_decay=0.1)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    errs, measured = {"loss": 0.0, "param": 0.0}, None
    ref = dict(full.named_parameters())
    grads = lambda m: {n: p.grad for n, p in m.named_parameters()}  # noqa: E731
    for step in range(STEPS):
        data = torch.randint(0, 256, (B, T + 1), generator=_gen(100 + step))
        x, y = data[:, :-1], data[:, 1:]
        lf = models.lm_loss(full(x), y)
        lf.backward()
        tracer = trace.Tracer()
        with tracer:
            lc = cpm.loss(model(C.shard_sequence(x, cp, rank, split)), C.shard_sequence(y, cp, rank, split))
            lc.backward()
        if not wrap:
            C.all_reduce_gradients(cpm)
        if measured is None:
            measured = _ring_bytes_and_work(tracer.trace)
        errs["loss"] = max(errs["loss"], abs(C.global_loss(lc).item() - lf.item()) / abs(lf.item()))
        if wrap != "fsdp":  # FSDP keeps sharded flat gradients; its parameters are compared below
            errs["grad"] = max(errs.get("grad", 0.0), rel_model(grads(cpm), grads(full)))
            if step == 0:  # the models still equal: every gradient tensor on its own scale too
                errs["grad_per_tensor_step0"] = max(rel(p.grad, ref[n].grad) for n, p in cpm.named_parameters())
        opt_f.step(), opt_c.step()
        opt_f.zero_grad(), opt_c.zero_grad()
    params = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    if wrap == "fsdp":
        with FullyShardedDataParallel.summon_full_params(model):
            errs["param"] = rel_model(params(base), params(full))
    else:
        errs["param"] = rel_model(params(cpm), params(full))
    return errs, measured


def _ring_bytes_and_work(tr):
    """{(layer, phase, op): bytes} of the ring's p2p spans; {(phase, "pairs" | "scores"): sum} of its blocks."""
    sent = {}
    for s in tr.comm_spans():
        if s.name in ("send", "recv"):
            key = (s.args.get("unit"), s.args.get("phase"), s.name)
            sent[key] = sent.get(key, 0) + s.args["bytes"]
    work = {}
    for s in tr.compute_spans():
        if s.name == "ring_attention.block":
            for what in ("pairs", "scores"):
                key = (s.args["phase"], what)
                work[key] = work.get(key, 0) + s.args[what]
    return {"bytes": sent, "work": work}


def measured_work(cp, rank, split, b=2, h=2, t=256, hd=32, repeats=5):
    """One attention layer alone: the unmasked pairs this rank computed forward, and its median seconds."""
    q, k, v = (C.shard_sequence(torch.randn(b, h, t, hd, generator=_gen(s)), cp, rank, split, dim=2)
               for s in (1, 2, 3))
    pairs, times = None, []
    for _ in range(repeats):
        tracer = trace.Tracer()
        with tracer:
            C.ring_attention(q, k, v, split=split)
        blocks = [s for s in tracer.trace.compute_spans() if s.name == "ring_attention.block"]
        pairs = sum(s.args["pairs"] for s in blocks)
        times.append(sum(s.duration for s in blocks))
    return {"pairs": pairs, "seconds": sorted(times)[len(times) // 2]}


def bad_input(cp, rank):
    """The one-line errors for input ring attention cannot take."""
    out = {}
    x = torch.zeros(1, 2, 4, 8)
    for name, call in {
        "zigzag_len": lambda: C.shard_sequence(torch.zeros(1, 4 * cp + 2), cp, rank, "zigzag"),
        "naive_len": lambda: C.shard_sequence(torch.zeros(1, 3 * cp + 1), cp, rank, "naive"),
        "ring_len": lambda: C.ring_attention(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8),
                                             torch.zeros(1, 2, 3, 8)),
        "not_causal": lambda: C.ring_attention(x, x, x, is_causal=False),
        "attn_mask": lambda: C.ring_attention(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool)),
        "model_mask": lambda: C.context_parallel_gpt(_bidirectional(models.build_model("gpt-tiny"))),
        "split": lambda: C.context_parallel_gpt(models.build_model("gpt-tiny"), split="stripes"),
        "dropout": lambda: C.context_parallel_gpt(models.build_model("gpt-tiny", dropout=0.1)),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _bidirectional(model):
    for block in model.blocks:
        block.attn.future_mask.zero_()  # nothing blocked: a bidirectional (non-causal) mask
    return model


def torch_context_parallel(cp):
    """torch.distributed.tensor.experimental.context_parallel on CPU/gloo: causal SDPA under it, vs the full
    result. Returns ("ran", error vs full) or (exception type, first line of its message)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (cp,))
    q, k, v = (torch.randn(1, 2, 16, 8, generator=_gen(s)) for s in (1, 2, 3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ql, kl, vl = q.clone(), k.clone(), v.clone()
    try:
        with context_parallel(mesh, buffers=[ql, kl, vl], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
    except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
        return type(e).__name__, (str(e).splitlines() or [""])[0]
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    return "ran", rel(context_parallel_unshard(mesh, [out], [2])[0], full)


def cp_checks(cp, with_wrappers=False, with_torch=False):
    """Every multi-rank check at one cp size (the whole world is the cp group), in one launch."""
    rank = dist.rank()
    out = {"attention": {s: attention_parity(cp, rank, s) for s in SPLITS},
           "gpt": {}, "bytes": {}, "work": {}, "errors": bad_input(cp, rank)}
    for split in SPLITS:
        out["gpt"][split], measured = gpt_parity(cp, rank, split)
        out["bytes"][split], out["work"][split] = measured["bytes"], measured["work"]
        out["work_alone"] = out.get("work_alone", {})
        out["work_alone"][split] = measured_work(cp, rank, split)
    if with_wrappers:
        for wrap in ("ddp", "fsdp"):
            out[wrap] = gpt_parity(cp, rank, "zigzag", wrap)[0]
    if with_torch:
        out["torch"] = torch_context_parallel(cp)
    comm.barrier()
    return out
