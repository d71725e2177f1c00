"""Workers for the expert-parallel tests (sent by value to the ranks; see tests/tp_helpers.py).

One launch per ep size runs every multi-rank check (launches cost seconds on 2 cores) and returns
plain numbers; tests/test_expert_parallel.py asserts on them. The workers put the models and batches on
``dist.device()``, so the same launch runs on pretend GPUs (``MINIFSDP_FAKE_GPU``) and real ones.
"""

import contextlib
import sys

import cloudpickle
import torch

from minifsdp import comm, dist, fake_gpu, models, trace
from minifsdp import expert_parallel as EP

cloudpickle.register_pickle_by_value(sys.modules[__name__])

B, T = 8, 16            # the global batch: 8 sequences of 16 tokens
MODEL = "gpt-moe-tiny"  # E = 8, k = 2; n_layer=4 below gives two MoE layers (blocks 1 and 3)
MODES = {"dropless": ({}, "all_to_all"), "capacity": ({"capacity_factor": 1.0}, "all_to_all"),
         "all_gather": ({}, "all_gather")}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(a, b):
    return abs(a - b) / abs(b)


def _err(a, b):
    return (a - b).abs().max().item()


def _capture_routing(model):
    """For each MoE layer of the single-process model, its last forward's (expert_idx, keep), recomputed
    from the layer's input with models' routing functions: the reference for the bytes and the drops."""
    seen = {}

    def hook(name, moe):
        def fn(module, inputs, output):
            with torch.no_grad():
                x = inputs[0]
                _, idx, _ = models.top_k_routing(moe.router(x), moe.top_k)
                keep = torch.ones_like(idx, dtype=torch.bool)
                if moe.capacity_factor is not None:
                    cap = models.expert_capacity(x.shape[1], moe.top_k, moe.n_expert, moe.capacity_factor)
                    keep = models.capacity_mask(idx, moe.n_expert, cap)
                seen[name] = (idx.cpu(), keep.cpu())
        return fn

    for name, m in model.named_modules():
        if isinstance(m, models.MoE):
            m.register_forward_hook(hook(name, m))
    return seen


def _expected_bytes(routing, ep, r, d):
    """{(unit, phase, exchange): (bytes, ring_bytes)} of rank r's all-to-alls, from the reference routing,
    and {unit: {"kept": assignments kept in the whole batch, "local": those routed to their own rank}}."""
    out, rows = {}, {}
    for unit, (idx, keep) in routing.items():
        E = 8
        counts = torch.stack([torch.bincount(idx[s * B // ep:(s + 1) * B // ep][keep[s * B // ep:(s + 1) * B // ep]],
                                             minlength=E) for s in range(ep)])          # (ep, E) kept
        ring = EP.moe_all_to_all_bytes(counts, r, d)
        S = counts.view(ep, ep, E // ep).sum(-1)
        rows[unit] = {"kept": int(counts.sum()), "local": int(S.diagonal().sum())}
        sent, received = int(S[r].sum()) * d * 4, int(S[:, r].sum()) * d * 4           # own rows included
        out[(unit, "forward", "counts")] = (E * 8, ring["counts"])
        out[(unit, "forward", "dispatch")] = (sent, ring["dispatch"])
        out[(unit, "forward", "combine")] = (received, ring["combine"])
        out[(unit, "backward", "combine")] = (sent, ring["dispatch"])      # output gradients to the experts
        out[(unit, "backward", "dispatch")] = (received, ring["combine"])  # input gradients home
    return out, rows


def _dropped_by_hand(routing, cf, k=2, E=8):
    """Assignments over capacity, counted per sequence and expert: sum of max(0, asked - C)."""
    total = 0
    for idx, _ in routing.values():
        cap = models.expert_capacity(idx.shape[1], k, E, cf)
        asked = torch.nn.functional.one_hot(idx, E).sum(dim=(1, 2))          # (B, E)
        total += int((asked - cap).clamp_min(0).sum())
    return total


def _parity(ep, r, mode, steps):
    """The ep model on this rank's sequences vs the single-process model on the whole batch."""
    overrides, dispatcher = MODES[mode]
    dev = dist.device()
    full = models.build_model(MODEL, n_layer=4, **overrides).to(dev)
    par = EP.expert_parallel_gpt(models.build_model(MODEL, n_layer=4, **overrides), None, dispatcher).to(dev)
    routing = _capture_routing(full)
    opt_f = torch.optim.AdamW(full.parameters(), lr=1e-3, weight_decay=0.1)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.1)
    full_params = dict(full.named_parameters())
    b = B // ep
    out = {"loss": 0.0, "aux": 0.0, "grad": 0.0, "param": 0.0, "losses": [],
           "local_experts": sorted({n.split(".experts.")[1].split(".")[0] for n, _ in par.named_parameters()
                                    if ".experts." in n})}
    for step in range(steps):
        data = torch.randint(0, 256, (B, T + 1), generator=_gen(100 + step)).to(dev)
        x, y = data[:, :-1], data[:, 1:]
        lf = models.lm_loss(full(x), y)
        aux_f = full.aux_loss()
        (lf + aux_f).backward()
        tracer = trace.Tracer() if step == 0 else contextlib.nullcontext()
        with tracer:
            lp = models.lm_loss(par(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b])
            aux_p = par.aux_loss()
            (lp + aux_p).backward()
        EP.all_reduce_gradients(par)
        total_f, total_p = (lf + aux_f).item(), EP.global_loss(lp + aux_p).item()
        out["losses"].append((total_f, total_p))
        out["loss"] = max(out["loss"], _rel(total_p, total_f))
        out["aux"] = max(out["aux"], _rel(EP.global_loss(aux_p).item(), aux_f.item()))
        out["grad"] = max(out["grad"], max(_err(p.grad, full_params[n].grad) for n, p in par.named_parameters()))
        if step == 0:
            spans = tracer.trace.comm_spans()
            measured = {}
            for s in spans:
                if s.name == "all_to_all":
                    key = (s.args["unit"], s.args["phase"], s.args["exchange"])
                    measured[key] = tuple(a + v for a, v in zip(measured.get(key, (0, 0)),
                                                                  (s.args["bytes"], s.args["ring_bytes"])))
            out["measured"] = measured
            out["calls"] = sorted({(s.name, s.args.get("phase"), s.args.get("exchange")) for s in spans})
            out["ring_bytes"] = sum(s.args["ring_bytes"] for s in spans)
            out["expected"], out["rows"] = _expected_bytes(routing, ep, r, full.config.n_embd)
            stats = EP.routing_stats(par)
            out["dropped_ep"] = sum(sum(v["dropped"]) for v in stats.values())
            out["routed_ep"] = sum(sum(v["routed"]) for v in stats.values())
            out["dropped_single"] = sum(int(m.dropped_per_expert.sum()) for m in full.modules()
                                        if isinstance(m, models.MoE))
            if overrides.get("capacity_factor"):
                out["dropped_by_hand"] = _dropped_by_hand(routing, overrides["capacity_factor"])
        opt_f.step(), opt_p.step()
        opt_f.zero_grad(), opt_p.zero_grad()
    out["param"] = max(_err(p.detach(), full_params[n].detach()) for n, p in par.named_parameters())
    return out


def _comm_check(ep, r):
    """comm.all_to_all_single with uneven splits: rank r sends j + r + 1 rows of 3 to rank j."""
    dev = dist.device()
    send = [j + r + 1 for j in range(ep)]
    recv = [r + s + 1 for s in range(ep)]
    x = torch.cat([torch.full((n, 3), 100.0 * r + j, device=dev) for j, n in enumerate(send)])
    out = x.new_empty(sum(recv), 3)
    tracer = trace.Tracer()
    with tracer:
        comm.all_to_all_single(out, x, recv, send)
    expect = torch.cat([torch.full((n, 3), 100.0 * s + r) for s, n in enumerate(recv)])
    span = tracer.trace.comm_spans()[0]
    try:
        comm.all_to_all_single(out, x, recv, send[:-1] + [send[-1] + 1])
        bad = None
    except ValueError as e:
        bad = str(e)
    return {"values_ok": bool(torch.equal(out.cpu(), expect)), "name": span.name, "bytes": span.args["bytes"],
            "ring_bytes": span.args["ring_bytes"], "expect_bytes": sum(send) * 12,
            "expect_ring": (sum(send) - send[r]) * 12, "bad_splits": bad}


def _bad_input(ep):
    errors = {}
    for name, kw in (("not_divisible", {"n_expert": ep + 1}), ("dense", {"n_expert": 0})):
        try:
            EP.expert_parallel_gpt(models.build_model(MODEL, **kw))
        except ValueError as e:
            errors[name] = str(e)
    return errors


def _skewed(ep, r):
    """One MoE layer whose router sends every token to experts 0 and 1 (rank 0's): the other ranks send
    all their rows away and their experts get none (empty splits). Output, input gradient, expert and
    router gradients vs the single-process layer on the whole batch (the loss a sum: nothing averaged)."""
    import copy

    dev = dist.device()
    full = models.build_model(MODEL).blocks[1].mlp.to(dev)
    with torch.no_grad():
        full.router.weight.zero_()
        full.router.weight[0, 0], full.router.weight[1, 0] = 10.0, 9.0
    par = EP.ExpertParallelMoE(copy.deepcopy(full), None, label="skewed")
    x = torch.randn(B, T, 32, generator=_gen(7)) * 0.1
    x[..., 0] = 1.0
    up = torch.randn(B, T, 32, generator=_gen(8)).to(dev)
    x = x.to(dev)
    b = B // ep
    xf, xp = x.clone().requires_grad_(), x[r * b:(r + 1) * b].clone().requires_grad_()
    yf, yp = full(xf), par(xp)
    (yf * up).sum().backward()
    (yp * up[r * b:(r + 1) * b]).sum().backward()
    router = par.router.weight.grad.clone()
    comm.all_reduce(router)
    fp = dict(full.named_parameters())
    return {"routed": par.tokens_per_expert.tolist(),
            "out": _err(yp, yf[r * b:(r + 1) * b]), "dx": _err(xp.grad, xf.grad[r * b:(r + 1) * b]),
            "experts": max(_err(p.grad, fp[n].grad) for n, p in par.experts.named_parameters(prefix="experts")),
            "router": _err(router, full.router.weight.grad)}


def ep_checks(ep, modes=tuple(MODES), steps=3):
    """Everything multi-rank, on the world as the ep group: {"comm", "errors", mode: parity/bytes/drops}."""
    r = dist.rank()
    result = {"comm": _comm_check(ep, r), "errors": _bad_input(ep), "pretend_gpu": dist.device() is fake_gpu.FAKE_GPU}
    result["skewed"] = _skewed(ep, r)
    for mode in modes:
        result[mode] = _parity(ep, r, mode, steps)
    return result
