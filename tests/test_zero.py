"""ZeRO-1 (OSS) and ZeRO-2 (ShardedDataParallel) against one process training the same model on the global batch.

Reference: one process, torch.optim.AdamW(lr=1e-2, weight_decay=0.1,
eps=1e-6), the whole global batch of 12 rows. Distributed: N ranks, 12/N
rows each, gradients averaged over ranks. The only difference is the order
of the floating-point sums in that average. Why eps=1e-6 and not AdamW's
1e-8: a byte seen once in a batch can get an embedding gradient of ~3e-9
that is pure cancellation (terms of ~1e-2 summing to nearly zero), so its
*sign* depends on the summation order, and with eps=1e-8 Adam turns that
noise into a 0.2*lr update of either sign (a 2e-3 parameter difference).
With eps=1e-6 such noise moves a parameter by < 1e-4*lr, while real
gradients (typically 1e-3..1e-2 here) are still normalised. fp32 tolerances:

* losses:            |diff| <= 1e-5 (measured max 5e-7)
* parameters:        |diff| <= 1e-4 after 3 steps (measured max 1.3e-5; vs torch's
                     ZeroRedundancyOptimizer 1.7e-6)
* optimizer state:   |diff| <= 1e-6 (measured max 8e-8); ``step`` exact
* gradient norms:    relative 1e-5
* memory and bytes moved: exact, computed from the partition.
"""

import functools

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

from minifsdp import WorkerError, data, estimate, launch, models, trace
from minifsdp.zero import (OSS, ShardedDataParallel, ZeroRedundancyOptimizer, all_reduce_gradients,
                           local_state_bytes, partition_parameters, wrap_zero)

STEPS, B, T, LR, WD, EPS = 3, 12, 16, 1e-2, 0.1, 1e-6
LOSS_ATOL, PARAM_ATOL, STATE_ATOL, NORM_RTOL = 1e-5, 1e-4, 1e-6, 1e-5


class Odd(nn.Module):
    """Three parameters of 18, 3 and 1 elements: with 4 ranks one rank owns nothing."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(6, 3, generator=g))
        self.b = nn.Parameter(torch.randn(3, generator=g))
        self.s = nn.Parameter(torch.randn(1, generator=g))

    def forward(self, x):
        return torch.tanh(x @ self.w + self.b) * self.s


def _build(name):
    return Odd() if name == "odd" else models.build_model(name, seed=0)


def _batch(name, step, rows=slice(None)):
    if name == "odd":
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(B, 6, generator=g), torch.randn(B, 3, generator=g)
    else:
        x, y = data.get_batch(step, B, T, seed=0)
    return x[rows], y[rows]


def _loss(name, model, x, y):
    out = model(x)
    return nn.functional.mse_loss(out, y) if name == "odd" else models.lm_loss(out, y)


@functools.lru_cache(maxsize=None)
def _reference(name, steps=STEPS, clip=None, norm_type=2.0):
    """One process, full global batch: losses, parameters, state dict, grad norms after each step."""
    model = _build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses, norms, states = [], [], []
    for step in range(steps):
        loss = _loss(name, model, *_batch(name, step))
        loss.backward()
        if clip is not None:
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        states.append(({k: v.clone() for k, v in model.state_dict().items()}, _clone(opt.state_dict())))
    return losses, norms, states


def _clone(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _zero_worker(name, stage, steps, clip=None, norm_type=2.0, bucket=2**20, subgroups=False):
    group = None
    if subgroups:  # ranks {0, 1} and {2, 3}: every rank creates every group, in the same order
        groups = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
        group = groups[tdist.get_rank() // 2]
    r, n = tdist.get_rank(group), tdist.get_world_size(group)
    module = _build(name)
    model, opt = wrap_zero(module, stage, group=group, lr=LR, weight_decay=WD, eps=EPS, broadcast_buffer_size=bucket)
    rows = slice(r * B // n, (r + 1) * B // n)
    out = {"losses": [], "norms": []}
    for step in range(steps):
        tracer = trace.Tracer()
        with tracer:  # the comm of one step: backward's gradient traffic, clip, re-assembly
            loss = _loss(name, model, *_batch(name, step, rows))
            loss.backward()
            out["held_grad_bytes"] = sum(p.grad.numel() * 4 for p in module.parameters() if p.grad is not None)
            if clip is not None:
                out["norms"].append(opt.clip_grad_norm(clip, norm_type).item())
            opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        tdist.all_reduce(global_loss, group=group)  # for the check only, outside the tracer
        out["losses"].append(global_loss.item() / n)
    out["bytes_by_op"] = tracer.trace.bytes_by_op()
    numel = sum(p.numel() for p in module.parameters())
    out["formula"] = estimate.comm_bytes_per_step(numel, n, "zero1" if stage == 1 else "zero2")
    out["formula"].pop("total")
    out["params"] = {k: v.clone() for k, v in module.state_dict().items()}
    out["owned_bytes"] = sum(p.numel() * 4 for p in opt.local_params)
    # AdamW keeps exp_avg and exp_avg_sq (numel fp32 each) and a scalar fp32 step per parameter.
    out["expected_state_bytes"] = sum(2 * p.numel() * 4 + 4 for p in opt.local_params)
    out["state_bytes"] = local_state_bytes(opt)
    out["owners"] = [opt.param_to_rank[p] for p in module.parameters()]
    opt.consolidate_state_dict(recipient_rank=0)
    out["full_state"] = opt.state_dict() if r == 0 else None
    return out


def _assert_same_params(got, want, atol=PARAM_ATOL):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")


def _assert_same_optimizer_state(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert got["state"][i].keys() == s.keys()
        assert torch.equal(got["state"][i]["step"], s["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][i][k], s[k], atol=STATE_ATOL, rtol=0)


def _check_run(results, name, stage, n, clip=None, norm_type=2.0):
    losses, norms, states = _reference(name, STEPS, clip, norm_type)
    params, opt_state = states[-1]
    psi = sum(v.numel() * 4 for k, v in params.items() if k in dict(_build(name).named_parameters()))
    for out in results:  # every rank ends with the same, correct model
        assert out["losses"] == pytest.approx(losses, abs=LOSS_ATOL)
        _assert_same_params(out["params"], params)
        if clip is not None:
            assert out["norms"] == pytest.approx(norms, rel=NORM_RTOL)
    _assert_same_optimizer_state(results[0]["full_state"], opt_state)
    # Optimizer state: exactly the owned parameters' state; the shards add up to the whole.
    ref_state_bytes = sum(v.numel() * v.element_size() for s in opt_state["state"].values() for v in s.values())
    assert [o["state_bytes"] for o in results] == [o["expected_state_bytes"] for o in results]
    assert sum(o["state_bytes"] for o in results) == ref_state_bytes
    biggest = max(v.numel() for v in _build(name).parameters()) * 8 + 4
    assert max(o["state_bytes"] for o in results) <= ref_state_bytes / n + biggest  # greedy's bound
    # Gradients held after backward: ZeRO-2 the owned shard only, ZeRO-1 all of them.
    for o in results:
        assert o["held_grad_bytes"] == (o["owned_bytes"] if stage == 2 else psi)
    assert sum(o["owned_bytes"] for o in results) == psi
    # Bytes per step, comm's volume convention: ZeRO-1 all-reduce 2Ψ + broadcast Ψ = 3Ψ;
    # ZeRO-2 reduce Ψ + broadcast Ψ = 2Ψ; clipping adds one all-reduced fp32 scalar (2*4 B).
    clip_bytes = 8 if clip is not None else 0
    if n == 1:
        expected = {}
    elif stage == 1:
        expected = {"all_reduce": 2 * psi + clip_bytes, "broadcast": psi}
    else:
        expected = {"reduce": psi, "broadcast": psi, **({"all_reduce": clip_bytes} if clip_bytes else {})}
    for o in results:
        assert o["bytes_by_op"] == expected
        formula = dict(o["formula"])  # estimate's exact formula agrees (it leaves clipping out)
        if clip_bytes and n > 1:
            formula["all_reduce"] = formula.get("all_reduce", 0) + clip_bytes
        assert formula == expected
    if n > 1 and clip is None:  # ZeRO-2 moves the paper's 2Ψ; FairScale-style ZeRO-1 one Ψ more than its 2Ψ
        paper = estimate.paper_comm_bytes(psi // 4, "zero1" if stage == 1 else "zero2")
        assert sum(expected.values()) == paper + (psi if stage == 1 else 0)


# Eight runs cover stage x world size; some also clip (2-norm) or broadcast every parameter alone.
@pytest.mark.parametrize("stage,n,bucket,clip", [(1, 1, 2**20, None), (1, 2, 2**20, 0.05), (1, 3, 0, None),
                                                 (1, 4, 2**20, None), (2, 1, 2**20, 0.05), (2, 2, 0, None),
                                                 (2, 3, 2**20, 0.05), (2, 4, 4096, None)])
def test_gpt_parity_memory_and_bytes(stage, n, bucket, clip):
    """gpt-tiny (42880 parameters, 3 steps): same losses/params/state (and clipped norms) as one process."""
    results = launch(_zero_worker, n, "gpt-tiny", stage, STEPS, clip, 2.0, bucket, timeout=120)
    _check_run(results, "gpt-tiny", stage, n, clip=clip)
    if clip is not None:  # OSS.clip_grad_norm == torch.nn.utils.clip_grad_norm_, and it really clipped
        assert min(_reference("gpt-tiny", STEPS, clip)[1]) > clip
    if n == 4:  # uneven: 42880 elements do not split into equal whole-parameter shards
        assert len({o["owned_bytes"] for o in results}) > 1


@pytest.mark.parametrize("stage,n", [(1, 3), (2, 4)])
def test_uneven_tiny_parameters_and_clipping(stage, n):
    """3 parameters (18, 3, 1 elements) on 3-4 ranks: a rank may own nothing; clipping with the inf norm."""
    results = launch(_zero_worker, n, "odd", stage, STEPS, 0.3, float("inf"), timeout=120)
    _check_run(results, "odd", stage, n, clip=0.3, norm_type=float("inf"))
    if n == 4:
        assert sorted(o["owned_bytes"] for o in results) == [0, 4, 12, 72]
    assert max(_reference("odd", STEPS, 0.3, float("inf"))[1]) > 0.3  # the clip was active


def _resume_worker(params, full_state, stage):
    """Load a plain AdamW's state dict (after 2 steps) into OSS, take step 3, round-trip the state."""
    r, n = tdist.get_rank(), tdist.get_world_size()
    module = _build("gpt-tiny")
    module.load_state_dict(params)
    model, opt = wrap_zero(module, stage, lr=LR, weight_decay=WD, eps=EPS)
    opt.load_state_dict(full_state)
    opt.consolidate_state_dict(recipient_rank=n - 1)  # a recipient other than 0
    round_trip = _clone(opt.state_dict()) if r == n - 1 else None  # like torch's: references, so copy
    rows = slice(r * B // n, (r + 1) * B // n)
    _loss("gpt-tiny", model, *_batch("gpt-tiny", 2, rows)).backward()
    opt.step()
    return {"params": {k: v.clone() for k, v in module.state_dict().items()}, "round_trip": round_trip}


@pytest.mark.parametrize("stage,n", [(2, 3)])
def test_load_state_dict_resumes_like_one_process(stage, n):
    _, _, states = _reference("gpt-tiny")
    params2, state2 = states[1]
    results = launch(_resume_worker, n, params2, state2, stage, timeout=120)
    _assert_same_optimizer_state(results[-1]["round_trip"], state2)
    for k, v in state2["state"].items():  # loading and consolidating again changes nothing at all
        assert all(torch.equal(results[-1]["round_trip"]["state"][k][key], v[key]) for key in v)
    for out in results:
        _assert_same_params(out["params"], states[2][0])


def _no_sync_worker(stage):
    """Two micro-batches per step, the first inside no_sync(): the same as the full batch."""
    r, n = tdist.get_rank(), tdist.get_world_size()
    module = _build("gpt-tiny")
    model, opt = wrap_zero(module, stage, lr=LR, weight_decay=WD, eps=EPS)
    rows_per_micro = B // n // 2
    for step in range(2):
        for micro in range(2):
            start = (2 * r + micro) * rows_per_micro
            loss = _loss("gpt-tiny", model, *_batch("gpt-tiny", step, slice(start, start + rows_per_micro))) / 2
            if micro == 0:
                with model.no_sync():
                    loss.backward()
                held_after_no_sync = sum(p.grad.numel() for p in module.parameters() if p.grad is not None)
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.clone() for k, v in module.state_dict().items()}, "held": held_after_no_sync}


@pytest.mark.parametrize("stage", [2])
def test_no_sync_gradient_accumulation(stage):
    results = launch(_no_sync_worker, 2, stage, timeout=120)
    numel = sum(p.numel() for p in _build("gpt-tiny").parameters())
    for out in results:
        assert out["held"] == numel  # no_sync keeps full local gradients, sends nothing
        _assert_same_params(out["params"], _reference("gpt-tiny")[2][1][0])


# ---------------------------------------------------------------------------
# Single process: partitioning, a world of one, and errors that name the fix
# ---------------------------------------------------------------------------
def test_partition_parameters_greedy_biggest_first():
    ps = [torch.zeros(10), torch.zeros(7), torch.zeros(5), torch.zeros(4)]
    assert partition_parameters(ps, 2) == [0, 1, 1, 0]  # 10+4 = 14 vs 7+5 = 12
    assert partition_parameters(ps, 1) == [0, 0, 0, 0]
    assert sorted(partition_parameters(ps[:2], 4)) == [0, 1]  # ranks 2, 3 own nothing
    params = list(_build("gpt-tiny").parameters())
    for n in (2, 3, 4, 5):
        owners = partition_parameters(params, n)
        loads = [sum(p.numel() for p, o in zip(params, owners) if o == r) for r in range(n)]
        assert sum(loads) == sum(p.numel() for p in params)
        assert max(loads) <= sum(loads) / n + max(p.numel() for p in params)
        assert owners == partition_parameters(params, n)  # deterministic: every rank agrees


def test_world_of_one_is_the_plain_optimizer():
    """No process group: OSS with param groups (one added later) and an LR schedule is bit-identical to AdamW."""
    a, b = _build("gpt-tiny"), _build("gpt-tiny")
    groups = lambda m: [{"params": list(m.blocks.parameters()), "lr": 3e-3},  # noqa: E731
                        {"params": [m.tok_emb.weight, m.pos_emb.weight]}]
    oss = OSS(groups(a), optim=torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    oss.add_param_group({"params": list(a.ln_f.parameters()) + [a.head.weight], "weight_decay": 0.0})
    ref = torch.optim.AdamW(groups(b), lr=LR, weight_decay=WD, eps=EPS)
    ref.add_param_group({"params": list(b.ln_f.parameters()) + [b.head.weight], "weight_decay": 0.0})
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step) for o in (oss, ref)]
    for step in range(3):
        for m, opt, schedule in ((a, oss, schedules[0]), (b, ref, schedules[1])):
            _loss("gpt-tiny", m, *_batch("gpt-tiny", step)).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()  # acts on OSS.param_groups; OSS.step passes the lr on to the inner optimizer
    assert oss.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 3e-3 * 0.5 ** 3  # and the steps used it:
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    oss.consolidate_state_dict()
    _assert_same_optimizer_state(oss.state_dict(), ref.state_dict())
    assert oss.param_groups[1]["betas"] == (0.9, 0.999)  # the inner optimizer's defaults show through


def test_bad_input_errors_name_the_fix():
    model = _build("odd")
    oss = OSS(model.parameters(), torch.optim.AdamW, lr=LR)
    with pytest.raises(RuntimeError, match="call consolidate_state_dict"):
        oss.state_dict()
    with pytest.raises(ValueError, match="recipient_rank must be a rank"):
        oss.consolidate_state_dict(recipient_rank=3)
    with pytest.raises(ValueError, match="for stage 3 use minifsdp.fsdp"):
        wrap_zero(model, 3)
    with pytest.raises(TypeError, match="optimizer class such as torch.optim.AdamW"):
        OSS(model.parameters(), optim="adamw")
    with pytest.raises(TypeError, match="OSS\\(model.parameters"):
        ShardedDataParallel(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="build the OSS from this module's parameters"):
        ShardedDataParallel(model, OSS(_build("odd").parameters(), lr=LR))
    with pytest.raises(ValueError, match="param groups"):
        oss.load_state_dict({"state": {}, "param_groups": []})
    with pytest.warns(UserWarning, match="reduce_fp16 is deactivated.*reduce_buffer_size=0"):  # as FairScale
        assert not ShardedDataParallel(model, oss, reduce_fp16=True).reduce_fp16
    _loss("odd", model, *_batch("odd", 0)).backward()
    oss.step()
    with pytest.raises(RuntimeError, match="create the OSS with all param groups"):
        oss.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize("stage", [2])
def test_inside_subgroups(stage):
    """4 ranks as two independent groups of 2 ({0,1}, {2,3}): each trains like a world of 2."""
    results = launch(_zero_worker, 4, "gpt-tiny", stage, STEPS, None, 2.0, 2**20, True, timeout=120)
    _check_run(results[:2], "gpt-tiny", stage, 2)
    for a, b in zip(results[:2], results[2:]):
        assert a["owned_bytes"] == b["owned_bytes"]
        _assert_same_params(b["params"], a["params"], atol=0)


def _torch_zero_worker(stage):
    """Ours next to PyTorch's own ZeRO-1: DDP + torch.distributed.optim.ZeroRedundancyOptimizer (same tolerances)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    r, n = tdist.get_rank(), tdist.get_world_size()
    ours_module, theirs_module = _build("gpt-tiny"), _build("gpt-tiny")
    ours, ours_opt = wrap_zero(ours_module, stage, lr=LR, weight_decay=WD, eps=EPS)
    theirs = DistributedDataParallel(theirs_module)
    theirs_opt = ZeroRedundancyOptimizer(theirs_module.parameters(), optimizer_class=torch.optim.AdamW,
                                         lr=LR, weight_decay=WD, eps=EPS)
    # And the by-hand ZeRO-1 a lab writes first: OSS + one all-reduce per gradient after backward.
    manual = _build("gpt-tiny")
    manual_opt = OSS(manual.parameters(), optim=torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    rows = slice(r * B // n, (r + 1) * B // n)
    for step in range(STEPS):
        for model, opt in ((ours, ours_opt), (theirs, theirs_opt), (manual, manual_opt)):
            _loss("gpt-tiny", model, *_batch("gpt-tiny", step, rows)).backward()
            if model is manual:
                all_reduce_gradients(manual)
            opt.step()
            opt.zero_grad()
    ours_opt.consolidate_state_dict(0)
    theirs_opt.consolidate_state_dict(0)
    states = (ours_opt.state_dict(), theirs_opt.state_dict()) if r == 0 else None
    return {"manual": {k: v.clone() for k, v in manual.state_dict().items()},
            "ours": {k: v.clone() for k, v in ours_module.state_dict().items()},
            "theirs": {k: v.clone() for k, v in theirs_module.state_dict().items()}, "states": states}


@pytest.mark.parametrize("stage,n", [(2, 3)])
def test_matches_torch_zero_redundancy_optimizer(stage, n):
    results = launch(_torch_zero_worker, n, stage, timeout=120)
    for out in results:
        _assert_same_params(out["ours"], out["theirs"])
        _assert_same_params(out["manual"], _reference("gpt-tiny")[2][-1][0])
    ours, theirs = results[0]["states"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, s in theirs["state"].items():
        assert torch.equal(ours["state"][i]["step"], s["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][k], s[k], atol=STATE_ATOL, rtol=0)


def _peak_grad_worker(bound):
    """Exact gradient bytes held during ZeRO-2's backward, read after each gradient's hook."""
    if isinstance(bound, list):
        return [_peak_grad_worker(b) for b in bound]
    r, n = tdist.get_rank(), tdist.get_world_size()
    module = _build("gpt-tiny")
    opt = OSS(module.parameters(), lr=LR)
    model = ShardedDataParallel(module, opt, max_inflight_bytes=bound)
    params = list(module.parameters())
    peak = [0]

    def measure(_):  # registered after ShardedDataParallel's hook, so it runs after it
        peak[0] = max(peak[0], sum(q.grad.numel() * 4 for q in params if q.grad is not None))
    for p in params:
        p.register_post_accumulate_grad_hook(measure)
    rows = slice(r * B // n, (r + 1) * B // n)
    for step in range(2):
        _loss("gpt-tiny", model, *_batch("gpt-tiny", step, rows)).backward()
        opt.step()
        opt.zero_grad()
    return peak[0], sum(p.numel() * 4 for p in opt.local_params), max(p.numel() * 4 for p in params)


def test_zero2_gradient_memory_during_backward_is_bounded():
    """4 ranks. max_inflight_bytes=0: never more than the owned shard; 8 KiB: at most shard + 8 KiB + one gradient."""
    for (owned_peak, owned, _), (peak, owned_too, biggest) in launch(_peak_grad_worker, 4, [0, 8192], timeout=120):
        assert owned_peak == owned == owned_too
        assert owned <= peak <= owned + 8192 + biggest


def _tied_frozen_unused(stage=None):
    """gpt-tiny with tied embeddings, a frozen position embedding and an unused Linear."""
    torch.manual_seed(0)
    module = models.build_model("gpt-tiny", seed=0, tie_embeddings=True)
    module.pos_emb.weight.requires_grad_(False)
    module.unused = nn.Linear(3, 3)
    if stage is None:
        model, opt, r, n = module, torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, eps=EPS), 0, 1
    else:
        model, opt = wrap_zero(module, stage, lr=LR, weight_decay=WD, eps=EPS)
        r, n = tdist.get_rank(), tdist.get_world_size()
    for step in range(STEPS):
        _loss("gpt-tiny", model, *_batch("gpt-tiny", step, slice(r * B // n, (r + 1) * B // n))).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_tied_frozen_and_unused_parameters():
    """A tied weight counts (and is reduced) once; frozen and unused parameters stay as they were."""
    want = _tied_frozen_unused()
    for got in launch(_tied_frozen_unused, 3, 2, timeout=120):
        _assert_same_params(got, want)


def _mismatched_models():
    module = _build("odd" if tdist.get_rank() == 1 else "gpt-tiny")
    wrap_zero(module, 2, lr=LR)


def test_different_models_on_ranks_is_an_error_not_a_hang():
    with pytest.raises(WorkerError, match="ranks hold different models.*same model on every rank"):
        launch(_mismatched_models, 2, timeout=60)


def _sgd_run(distributed):
    """SGD with momentum through OSS (FairScale-style arguments) on the odd model; a world of one if not distributed."""
    module = _build("odd")
    r, n = (tdist.get_rank(), tdist.get_world_size()) if distributed else (0, 1)
    if distributed:
        opt = OSS(module.parameters(), optim=torch.optim.SGD, broadcast_buffer_size=-1, force_broadcast_object=True,
                  lr=0.1, momentum=0.9)
        model = ShardedDataParallel(module, opt, reduce_buffer_size=2**23, auto_refresh_trainable=False)
    else:
        model, opt = module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        _loss("odd", model, *_batch("odd", step, slice(r * B // n, (r + 1) * B // n))).backward()
        opt.step()
        opt.zero_grad()
    if distributed:
        opt.consolidate_state_dict()
    return {k: v.clone() for k, v in module.state_dict().items()}, opt.state_dict() if r == 0 else None


def test_any_inner_optimizer_sgd_momentum():
    """optim=torch.optim.SGD: other state (momentum_buffer), same parity, same consolidated state."""
    want_params, want_state = _sgd_run(False)
    results = launch(_sgd_run, 3, True, timeout=120)
    for params, _ in results:
        _assert_same_params(params, want_params, atol=1e-6)
    got_state = results[0][1]
    assert got_state["param_groups"] == want_state["param_groups"]
    assert got_state["state"].keys() == want_state["state"].keys() == {0, 1, 2}
    for i, s in want_state["state"].items():
        torch.testing.assert_close(got_state["state"][i]["momentum_buffer"], s["momentum_buffer"], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# Fidelity: FairScale's OSS / ShardedDataParallel and torch's ZeroRedundancyOptimizer
# ---------------------------------------------------------------------------
def _params_of(fn):
    """(name, kind, default) of each parameter; a ``**kwargs`` by kind only (its name is invisible to callers)."""
    import inspect
    return [("**" if p.kind == p.VAR_KEYWORD else p.name, p.kind, p.default)
            for p in inspect.signature(fn).parameters.values()]


def test_signatures_match_fairscale_and_torch():
    """Same parameters, order, kinds and defaults: a positional argument lands in the same slot."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    assert _params_of(ZeroRedundancyOptimizer) == _params_of(TorchZeRO)
    fairscale = pytest.importorskip("fairscale")  # pip install --no-deps fairscale (a test reference only)
    from fairscale.nn.data_parallel import ShardedDataParallel as FairScaleSDP
    from fairscale.optim import OSS as FairScaleOSS
    del fairscale
    assert _params_of(OSS) == _params_of(FairScaleOSS)  # optim defaults to SGD, as FairScale's
    ours = _params_of(ShardedDataParallel)
    assert ours[:len(_params_of(FairScaleSDP))] == _params_of(FairScaleSDP)
    assert all(kind == KEYWORD_ONLY for _, kind, _ in ours[len(_params_of(FairScaleSDP)):])  # our extras


KEYWORD_ONLY = __import__("inspect").Parameter.KEYWORD_ONLY


def test_oss_default_optimizer_is_sgd_and_zero_redundancy_rejects_what_it_lacks():
    model = _build("odd")
    assert isinstance(OSS(model.parameters(), lr=LR).optim, torch.optim.SGD)
    with pytest.raises(NotImplementedError, match="parameters_as_bucket_view=True.*leave it False"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, parameters_as_bucket_view=True)
    with pytest.raises(NotImplementedError, match="overlap_with_ddp=True.*no comm hooks"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, None, False, True)


def _zero_redundancy_worker(lib):
    """The same torch-style script, with torch's DDP + ZeroRedundancyOptimizer or minifsdp's."""
    if lib == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer as ZeRO
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        from minifsdp.ddp import DistributedDataParallel as DDP
        from minifsdp.zero import ZeroRedundancyOptimizer as ZeRO
    r, n = tdist.get_rank(), tdist.get_world_size()
    module = _build("gpt-tiny")
    model = DDP(module)
    opt = ZeRO(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
    for step in range(STEPS):
        _loss("gpt-tiny", model, *_batch("gpt-tiny", step, slice(r * B // n, (r + 1) * B // n))).backward()
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)
    return {k: v.clone() for k, v in module.state_dict().items()}, (_clone(opt.state_dict()) if r == 0 else None)


def test_zero_redundancy_optimizer_matches_torch():
    """World size 2, gloo: the same parameters bit for bit, the same consolidated state dict."""
    ours, theirs = (launch(_zero_redundancy_worker, 2, lib, timeout=120) for lib in ("minifsdp", "torch"))
    for (p_ours, _), (p_theirs, _) in zip(ours, theirs):
        _assert_same_params(p_ours, p_theirs, atol=0)
    _assert_same_optimizer_state(ours[0][1], theirs[0][1])


def _fp16_worker(lib):
    """ZeRO-2 with FairScale's fp16 options: gradients reduced and parameters broadcast as fp16."""
    r, n = tdist.get_rank(), tdist.get_world_size()
    module = _build("gpt-tiny")
    if lib == "fairscale":
        from fairscale.nn.data_parallel import ShardedDataParallel as SDP
        from fairscale.optim import OSS as Oss
    else:
        SDP, Oss = ShardedDataParallel, OSS
    opt = Oss(module.parameters(), torch.optim.AdamW, broadcast_fp16=True, lr=LR, weight_decay=WD, eps=EPS)
    model = SDP(module, opt, reduce_buffer_size=0, reduce_fp16=True)
    with trace.Tracer() as tracer:
        for step in range(STEPS):
            _loss("gpt-tiny", model, *_batch("gpt-tiny", step, slice(r * B // n, (r + 1) * B // n))).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in module.state_dict().items()}, tracer.trace.bytes_by_op()


def test_fp16_reduce_and_broadcast_match_fairscale():
    """reduce_fp16 / broadcast_fp16 at world size 2: FairScale's parameters, half the bytes of fp32."""
    pytest.importorskip("fairscale")
    ours, theirs = (launch(_fp16_worker, 2, lib, timeout=120) for lib in ("minifsdp", "fairscale"))
    psi = sum(p.numel() for p in _build("gpt-tiny").parameters()) * 4
    full = _reference("gpt-tiny")[2][-1][0]
    for (p_ours, moved), (p_theirs, _) in zip(ours, theirs):
        _assert_same_params(p_ours, p_theirs, atol=0)
        assert moved == {"reduce": STEPS * psi // 2, "broadcast": STEPS * psi // 2}
        assert any(not torch.equal(p_ours[k], full[k]) for k in full)  # the fp16 rounding did happen


def _fp16_broadcast_worker(buffer_size):
    module = _build("gpt-tiny")
    opt = OSS(module.parameters(), torch.optim.AdamW, broadcast_fp16=True, broadcast_buffer_size=buffer_size, lr=LR)
    _loss("gpt-tiny", module, *_batch("gpt-tiny", 0)).backward()
    with trace.Tracer() as tracer:
        opt.step()
    return tracer.trace.bytes_by_op()


@pytest.mark.parametrize("buffer_size", [0, 2**20])  # every parameter alone, or packed into flat buckets
def test_broadcast_fp16_halves_the_bytes_however_parameters_are_bucketed(buffer_size):
    psi = sum(p.numel() for p in _build("gpt-tiny").parameters()) * 4
    for moved in launch(_fp16_broadcast_worker, 2, buffer_size, timeout=120):
        assert moved == {"broadcast": psi // 2}
