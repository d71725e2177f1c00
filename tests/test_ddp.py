"""minifsdp.ddp against the single-process computation and against torch's own DDP.

Parity: gpt-tiny, AdamW, 3 steps, global batch of 8 sequences split across
ranks (and into micro-batches for gradient accumulation). Tolerances (fp32):
* vs torch DDP in the same processes: bit-identical losses and parameters
  at 1 and 2 ranks (same arithmetic: grad / N, then a sum); at 4 ranks
  parameters within 2e-5 absolute (measured <= 1.1e-5): how gloo orders a
  sum of 4 addends depends on the message size, and our buckets differ from
  torch's (torch also uses a 1 MiB first bucket);
* vs one process on the whole batch: losses within 1e-5 (measured 4.8e-7),
  parameters within atol 2e-5 / rtol 1e-4 (measured <= 8e-6 absolute): a
  mean over 8 sequences vs a mean of per-rank means rounds differently, and
  Adam's m / sqrt(v) amplifies that for gradients near zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

from minifsdp import WorkerError, launch, trace
from minifsdp.ddp import DistributedDataParallel, NaiveDataParallel, bucket_assignment
from minifsdp.models import build_model, lm_loss

GLOBAL_BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-2
LOSS_TOL = 1e-5
PARAM_ATOL, PARAM_RTOL = 2e-5, 1e-4
TORCH_TOL_4_RANKS = 2e-5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank and in the reference run."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _single_process_reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _wrap(kind: str, model: nn.Module, **kw):
    if kind == "naive":
        return NaiveDataParallel(model)
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, **kw)
    return DistributedDataParallel(model, gradient_as_bucket_view=kind.startswith("ddp_view"), **kw)


def _train(kinds: list[str], accum: int, steps: int = STEPS, bucket_cap_mb: float = 0.05) -> dict:
    """Each kind trains its own copy; rank r starts from DIFFERENT weights (seed r): the wrap must broadcast."""
    r, n = tdist.get_rank(), tdist.get_world_size()
    out = {}
    for kind in kinds:
        kw = {} if kind == "naive" else {"bucket_cap_mb": bucket_cap_mb}
        model = _wrap(kind, build_model("gpt-tiny", seed=r), **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        losses = []
        for step in range(steps):
            x, y = _batch(step)
            per_rank = GLOBAL_BATCH // n
            xs, ys = x[r * per_rank:(r + 1) * per_rank].chunk(accum), y[r * per_rank:(r + 1) * per_rank].chunk(accum)
            local = 0.0
            for k, (xm, ym) in enumerate(zip(xs, ys)):
                last = k == accum - 1
                with (torch.enable_grad() if last else model.no_sync()):
                    loss = lm_loss(model(xm), ym) / accum
                    loss.backward()
                local += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=(kind != "ddp_view_keep"))  # keep: grads accumulate in place in the buckets
            total = torch.tensor([local])
            tdist.all_reduce(total)  # test bookkeeping only: the global mean loss
            losses.append(total.item() / n)
        out[kind] = {"losses": losses, "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("accum", [1, 2])
def test_parity_with_single_process_and_torch_ddp(n, accum):
    ref_losses, ref_params = _single_process_reference()
    results = launch(_train, n, ["naive", "ddp", "ddp_view", "ddp_view_keep", "torch"], accum, timeout=120)
    for r, res in enumerate(results):
        torch_run = res["torch"]
        for kind in ("naive", "ddp", "ddp_view", "ddp_view_keep"):
            ours = res[kind]
            assert ours["losses"] == pytest.approx(ref_losses, abs=LOSS_TOL), (kind, r)
            assert ours["losses"] == pytest.approx(torch_run["losses"], abs=LOSS_TOL), (kind, r)
            for name, ref in ref_params.items():
                torch.testing.assert_close(ours["params"][name], ref, atol=PARAM_ATOL, rtol=PARAM_RTOL,
                                           msg=lambda m: f"{kind} rank {r} {name}: {m}")
                if n <= 2:
                    assert torch.equal(ours["params"][name], torch_run["params"][name]), (kind, r, name)
                else:
                    torch.testing.assert_close(ours["params"][name], torch_run["params"][name],
                                               atol=TORCH_TOL_4_RANKS, rtol=0,
                                               msg=lambda m: f"{kind} vs torch rank {r} {name}: {m}")
        # every rank holds the same model (the broadcast at wrap worked, every step was identical)
        for name, p in res["ddp"]["params"].items():
            assert torch.equal(p, results[0]["ddp"]["params"][name])


def _subgroups():
    """Two data-parallel groups {0, 1} and {2, 3} (what a 2 x 2 mesh's data dimension looks like)."""
    r = tdist.get_rank()
    groups = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]  # every rank creates every group
    mine = groups[r // 2]
    out = {}
    for kind in ("ddp", "torch"):
        model = build_model("gpt-tiny", seed=r)  # ranks 2, 3 start from rank 2's weights, not rank 0's
        model = (DistributedDataParallel(model, process_group=mine, bucket_cap_mb=0.05) if kind == "ddp" else
                 torch.nn.parallel.DistributedDataParallel(model, process_group=mine, bucket_cap_mb=0.05))
        x, y = _batch(r)  # each rank its own data
        lm_loss(model(x[:4]), y[:4]).backward()
        out[kind] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        out[kind + "_w"] = model.module.head.weight.detach().clone()
    return out


def test_process_group_subgroups_match_torch():
    res = launch(_subgroups, 4, timeout=120)
    for r in range(4):
        for name, g in res[r]["torch"].items():
            assert torch.equal(res[r]["ddp"][name], g), (r, name)  # sums of 2: bit-identical
    assert torch.equal(res[0]["ddp_w"], res[1]["ddp_w"]) and torch.equal(res[2]["ddp_w"], res[3]["ddp_w"])
    assert not torch.equal(res[0]["ddp_w"], res[2]["ddp_w"])    # each group broadcast from its own first rank
    assert torch.equal(res[2]["ddp"]["head.weight"], res[3]["ddp"]["head.weight"])
    assert not torch.equal(res[0]["ddp"]["head.weight"], res[2]["ddp"]["head.weight"])


def _grad_storage(view: bool):
    model = DistributedDataParallel(build_model("gpt-tiny"), bucket_cap_mb=0.05, gradient_as_bucket_view=view)
    x, y = _batch(0)
    lm_loss(model(x), y).backward()
    grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
             for p in model.module.parameters()}
    buckets = {b.buffer.untyped_storage().data_ptr(): b.nbytes for b in model.buckets}
    psi = sum(p.numel() * 4 for p in model.module.parameters())
    return grads, buckets, psi


def test_gradient_as_bucket_view_saves_one_gradient_copy():
    grads, buckets, psi = launch(_grad_storage, 1, True, timeout=60)[0]
    assert grads == buckets and sum(buckets.values()) == psi          # grads live in the buckets: Ψ in all
    grads, buckets, psi = launch(_grad_storage, 1, False, timeout=60)[0]
    assert not set(grads) & set(buckets)                              # separate copies: 2Ψ in all
    assert sum(grads.values()) + sum(buckets.values()) == 2 * psi


def test_bucket_assignment_reverse_order_and_cap():
    ts = [torch.zeros(100), torch.zeros(200), torch.zeros(300)]
    assert bucket_assignment(ts, 1000 / 2**20) == [[2], [1, 0]]
    assert bucket_assignment(ts, 2000 / 2**20) == [[2, 1], [0]]
    assert bucket_assignment(ts, 1) == [[2, 1, 0]]
    # a bucket closes as soon as it reaches the cap
    assert bucket_assignment(ts, 500 / 2**20) == [[2], [1], [0]]
    # dtypes never share a bucket (a bucket is one flat tensor)
    mixed = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10)]
    assert sorted(bucket_assignment(mixed, 1)) == [[1], [2, 0]]
    # a smaller first bucket (torch: 1 MiB when bucket_cap_mb is left at its default)
    assert bucket_assignment(ts, 2000 / 2**20, first_bucket_mb=1200 / 2**20) == [[2], [1, 0]]
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        bucket_assignment(ts, 0)


def _buckets_of_gpt(cap_mb: float):
    model = DistributedDataParallel(build_model("gpt-tiny"), bucket_cap_mb=cap_mb)
    names = [n for n, _ in model.module.named_parameters()]
    sizes = {n: p.numel() * 4 for n, p in model.module.named_parameters()}
    return names, sizes, [(b.names, b.nbytes) for b in model.buckets], list(model.state_dict())[:2]


def test_ddp_buckets_on_gpt():
    cap_mb = 0.05
    cap = int(cap_mb * 2**20)
    names, sizes, buckets, sd_keys = launch(_buckets_of_gpt, 1, cap_mb, timeout=60)[0]
    assert len(buckets) >= 2
    assert [n for b, _ in buckets for n in b] == names[::-1]          # reverse parameter order
    for i, (bnames, nbytes) in enumerate(buckets):
        assert nbytes == sum(sizes[n] for n in bnames)
        assert nbytes - sizes[bnames[-1]] < cap                          # below the cap before its last tensor
        if i + 1 < len(buckets):
            assert nbytes >= cap                                         # closed because it reached the cap
    assert all(k.startswith("module.") for k in sd_keys)                # state_dict keys like torch DDP


def _rewrap(kind: str):
    """A notebook cell run twice: the module is wrapped again, the first wrapper dropped."""
    r = tdist.get_rank()
    module = build_model("gpt-tiny", seed=0)
    wrap = (lambda m: NaiveDataParallel(m)) if kind == "naive" else (lambda m: DistributedDataParallel(m))
    model = wrap(module)
    model(_batch(0)[0][:2]).sum().backward()   # the first wrapper has been used (and armed)
    model = wrap(module)
    module.zero_grad()
    with trace.Tracer() as tracer:
        x, y = _batch(1)
        lm_loss(model(x[r::2]), y[r::2]).backward()
    psi = sum(p.numel() * 4 for p in module.parameters())
    return tracer.trace.bytes_by_op().get("all_reduce", 0), psi


@pytest.mark.parametrize("kind", ["ddp", "naive"])
def test_rewrapping_does_not_sync_twice(kind):
    reduced, psi = launch(_rewrap, 2, kind, timeout=60)[0]
    assert reduced == 2 * psi  # only the live wrapper all-reduces


def _default_layout():
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(256, 256) for _ in range(10)]))
    return [b.nbytes for b in model.buckets]


def test_default_cap_has_a_small_first_bucket_like_torch():
    sizes = launch(_default_layout, 1, timeout=60)[0]
    total = 10 * (256 * 256 + 256) * 4                      # 2.5 MiB of fp32 parameters
    assert sum(sizes) == total and len(sizes) == 2
    # first bucket: filled until it reached 1 MiB (4 layers: 4 x 257 KiB), the rest in one 25 MiB bucket
    assert sizes[0] >= 2**20 and sizes[0] - 256 * 256 * 4 < 2**20 and sizes[0] == 4 * (256 * 256 + 256) * 4


def _traced_step(kind: str, cap_mb: float, accum: int = 1, pattern: str = "right") -> dict:
    """One optimizer step under a tracer. pattern: how no_sync is used (see test_no_sync_pitfalls_are_observable)."""
    r = tdist.get_rank()
    kw = {} if kind == "naive" else {"bucket_cap_mb": cap_mb}
    model = _wrap(kind, build_model("gpt-tiny", seed=0), **kw)
    x, y = _batch(0)
    x, y = x[r::tdist.get_world_size()], y[r::tdist.get_world_size()]
    with trace.Tracer() as tracer:
        for k, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            last = k == accum - 1
            if last and pattern == "last_forward_inside":  # forward inside no_sync, backward outside
                with model.no_sync():
                    loss = lm_loss(model(xm), ym)
                loss.backward()
            elif last:
                loss = lm_loss(model(xm), ym)
                with tracer.span("backward"):
                    loss.backward()
            elif pattern == "right":
                with model.no_sync():
                    lm_loss(model(xm), ym).backward()
            elif pattern == "forward_outside":
                loss = lm_loss(model(xm), ym)
                with model.no_sync():
                    loss.backward()
    psi = sum(p.numel() * p.element_size() for p in model.module.parameters())
    return {"spans": [(s.name, s.start, s.end, s.args.get("bytes", 0)) for s in tracer.trace.spans],
            "psi": psi, "n_params": len(list(model.module.parameters())),
            "n_buckets": len(model.buckets) if kind in ("ddp", "ddp_view") else None,
            "grads": {n: p.grad.clone() for n, p in model.module.named_parameters()}}


@pytest.mark.parametrize("n", [1, 2])
def test_bytes_per_step_is_two_psi(n):
    for kind in ("ddp", "naive"):
        for accum in (1, 2):
            res = launch(_traced_step, n, kind, 0.05, accum, timeout=60)[0]
            reduces = [s for s in res["spans"] if s[0] == "all_reduce"]
            assert sum(s[3] for s in reduces) == 2 * res["psi"], (kind, accum)
            assert len(reduces) == (res["n_buckets"] if kind == "ddp" else res["n_params"]), (kind, accum)


def test_all_reduce_overlaps_backward():
    res = launch(_traced_step, 2, "ddp", 0.02, timeout=60)[0]
    spans = res["spans"]
    (_, b_start, b_end, _), = [s for s in spans if s[0] == "backward"]
    (_, d_start, d_end, _), = [s for s in spans if s[0] == "ddp.backward"]
    reduce_starts = sorted(s[1] for s in spans if s[0] == "all_reduce")
    assert res["n_buckets"] >= 3 and len(reduce_starts) == res["n_buckets"]
    # the first bucket goes on the wire while backward is still computing the other buckets' gradients
    assert b_start <= d_start < reduce_starts[0] < reduce_starts[-1] < d_end <= b_end
    assert sum(start < d_end for start in reduce_starts) >= 2


def test_no_sync_pitfalls_are_observable():
    right = launch(_traced_step, 2, "ddp", 0.05, 2, "right", timeout=60)
    fwd_out = launch(_traced_step, 2, "ddp", 0.05, 2, "forward_outside", timeout=60)
    last_in = launch(_traced_step, 2, "ddp", 0.05, 1, "last_forward_inside", timeout=60)

    def reduced_bytes(res):
        return sum(s[3] for s in res["spans"] if s[0] == "all_reduce")

    psi = right[0]["psi"]
    assert reduced_bytes(right[0]) == 2 * psi
    # forward outside no_sync: the backward inside still all-reduces -> twice the traffic, same gradients
    assert reduced_bytes(fwd_out[0]) == 2 * 2 * psi
    for name, g in right[0]["grads"].items():
        torch.testing.assert_close(fwd_out[0]["grads"][name], g, atol=1e-7, rtol=1e-5)
    # the last forward inside no_sync, its backward outside: NOTHING is all-reduced, the ranks' gradients differ
    assert reduced_bytes(last_in[0]) == 0
    assert any(not torch.allclose(last_in[0]["grads"][k], last_in[1]["grads"][k]) for k in right[0]["grads"])
    # torch DDP behaves the same way in both cases (it also decides at forward time)
    torch_fwd_out = launch(_traced_step, 2, "torch", 0.05, 2, "forward_outside", timeout=60)
    torch_last_in = launch(_traced_step, 2, "torch", 0.05, 1, "last_forward_inside", timeout=60)
    for r in range(2):
        for name in right[0]["grads"]:
            torch.testing.assert_close(torch_fwd_out[r]["grads"][name], fwd_out[r]["grads"][name], atol=1e-7, rtol=1e-5)
            torch.testing.assert_close(torch_last_in[r]["grads"][name], last_in[r]["grads"][name], atol=1e-7, rtol=1e-5)


class _TwoBranch(nn.Module):
    """``b`` is used only when asked: unused everywhere, or on some ranks only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)   # never used

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return self.b(h) if use_b else h


def _unused(kind: str, find_unused: bool, use_b_on: tuple[int, ...]):
    r = tdist.get_rank()
    model = _TwoBranch()
    wrapped = (torch.nn.parallel.DistributedDataParallel if kind == "torch" else DistributedDataParallel)(
        model, find_unused_parameters=find_unused, bucket_cap_mb=1e-4)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r))
    for _ in range(2):  # twice: the state is reset correctly after a step with unused parameters
        model.zero_grad()
        wrapped(x, r in use_b_on).pow(2).sum().backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_unused_parameter_error_names_it_and_the_fix():
    with pytest.raises(WorkerError, match=r"never\.weight.*find_unused_parameters=True"):
        launch(_unused, 2, "ddp", False, (0, 1), timeout=60)


def _recover_after_unused_error():
    r = tdist.get_rank()
    model = _TwoBranch()
    wrapped = DistributedDataParallel(model, bucket_cap_mb=1e-4)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(r))
    try:
        wrapped(x, False).sum().backward()
        raise AssertionError("expected the unused-parameter error")
    except RuntimeError as e:
        assert "find_unused_parameters=True" in str(e)
    model.zero_grad()
    (wrapped(x, True).sum() + model.never(x).sum()).backward()  # fixed: every parameter takes part
    return {n: p.grad.clone() for n, p in model.named_parameters()}, x


def test_wrapper_still_works_after_the_unused_error():
    (g0, x0), (g1, x1) = launch(_recover_after_unused_error, 2, timeout=60)
    ref = _TwoBranch()
    for x in (x0, x1):
        (ref(x, True).sum() + ref.never(x).sum()).div(2).backward()  # mean over the 2 ranks' losses
    for name, p in ref.named_parameters():
        torch.testing.assert_close(g0[name], p.grad, atol=1e-6, rtol=1e-5)
        assert torch.equal(g0[name], g1[name])


@pytest.mark.parametrize("use_b_on", [(0, 1), (0,)])
def test_find_unused_parameters_matches_torch(use_b_on):
    ours = launch(_unused, 2, "ddp", True, use_b_on, timeout=60)
    theirs = launch(_unused, 2, "torch", True, use_b_on, timeout=60)
    for r in range(2):
        assert ours[r]["never.weight"] is None and theirs[r]["never.weight"] is None
        assert ours[r]["b.weight"] is not None  # used by one rank at least: averaged, everyone gets it
        for name, g in theirs[r].items():
            if g is not None:
                torch.testing.assert_close(ours[r][name], g, atol=1e-7, rtol=1e-6)


class _WithBuffer(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("stat", torch.full((3,), value))

    def forward(self, x):
        return self.lin(x) + self.stat[:2]


def _buffers():
    r = tdist.get_rank()
    model = DistributedDataParallel(_WithBuffer(float(r)))
    at_wrap = model.module.stat.clone()
    model.module.stat.fill_(10.0 + r)  # ranks drift apart (e.g. BatchNorm running stats)...
    model(torch.ones(1, 2))            # ...and forward broadcasts rank 0's buffers again
    return at_wrap, model.module.stat.clone(), model.module.lin.weight.clone()


def test_buffers_and_parameters_broadcast_from_rank_0():
    results = launch(_buffers, 2, timeout=60)
    for at_wrap, after_forward, weight in results:
        assert torch.equal(at_wrap, torch.zeros(3))
        assert torch.equal(after_forward, torch.full((3,), 10.0))
        assert torch.equal(weight, results[0][2])


def _bad_inputs(case: str):
    if case == "device_ids":
        DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    elif case == "no_params":
        DistributedDataParallel(nn.ReLU())
    elif case == "different_models":
        DistributedDataParallel(nn.Linear(2, 2 + tdist.get_rank()))


@pytest.mark.parametrize("case, match", [("device_ids", "device_ids must be None"),
                                         ("no_params", "no parameter that requires a gradient"),
                                         ("different_models", "ranks wrapped different models")])
def test_bad_input_errors_name_the_fix(case, match):
    with pytest.raises(WorkerError, match=match):
        launch(_bad_inputs, 2, case, timeout=60)


def test_outside_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match="inside minifsdp.launch"):
        DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="inside minifsdp.launch"):
        NaiveDataParallel(nn.Linear(2, 2))


# ---------------------------------------------------------------------------
# torch's signature and construction semantics
# ---------------------------------------------------------------------------
def test_signature_matches_installed_torch_parameter_by_parameter():
    import inspect
    ours = list(inspect.signature(DistributedDataParallel).parameters.values())
    theirs = list(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters.values())
    assert [p.name for p in ours] == [p.name for p in theirs]
    for a, b in zip(ours, theirs):
        assert (a.name, a.kind, a.default) == (b.name, b.kind, b.default)


def _construction(lib: str, case: str):
    """Wrap a module whose parameters AND buffers differ per rank; report what each rank holds after
    wrapping and after one forward in which the buffers drifted again."""
    import warnings
    r = tdist.get_rank()
    DDP = torch.nn.parallel.DistributedDataParallel if lib == "torch" else DistributedDataParallel
    module = _WithBuffer(float(r))
    with torch.no_grad():
        module.lin.weight.fill_(r + 1.0)
    kwargs = {"default": {}, "broadcast_buffers=False": {"broadcast_buffers": False},
              "forward_sync_buffers=False": {"forward_sync_buffers": False},
              "init_sync=False": {"init_sync": False}}.get(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "positional process_group":  # slot 7, as torch: here each rank alone in its group
            groups = [tdist.new_group([0]), tdist.new_group([1])]
            model = DDP(module, None, None, 0, None, True, groups[r])
        else:
            model = DDP(module, **kwargs)
    at_wrap = (module.stat.clone(), module.lin.weight.clone())
    module.stat.fill_(10.0 + r)
    model(torch.ones(1, 2)).sum().backward()
    return {"at_wrap": at_wrap, "after_forward": module.stat.clone(),
            "warnings": sorted({str(w.category.__name__) for w in caught if "buffers" in str(w.message)}),
            "broadcast_buffers": model.broadcast_buffers}


@pytest.mark.parametrize("case", ["default", "broadcast_buffers=False", "forward_sync_buffers=False",
                                  "init_sync=False", "positional process_group"])
def test_construction_matches_torch(case):
    ours = launch(_construction, 2, "minifsdp", case, timeout=60)
    theirs = launch(_construction, 2, "torch", case, timeout=60)
    for r in range(2):
        for a, b in zip(ours[r]["at_wrap"], theirs[r]["at_wrap"]):
            assert torch.equal(a, b), (case, r)
        assert torch.equal(ours[r]["after_forward"], theirs[r]["after_forward"]), (case, r)
        assert ours[r]["warnings"] == theirs[r]["warnings"] and ours[r]["broadcast_buffers"] == theirs[r][
            "broadcast_buffers"], (case, r)
    if case == "broadcast_buffers=False":  # what it means: rank 1 keeps its buffers at wrap AND after forward
        assert torch.equal(ours[1]["at_wrap"][0], torch.full((3,), 1.0))
        assert torch.equal(ours[1]["after_forward"], torch.full((3,), 11.0))


def _unsupported():
    """The error each option torch has and minifsdp lacks raises (one launch for all of them)."""
    kwargs = {"bucket_cap_mb_list": [1, 2], "skip_all_reduce_unused_params": True,
              "delay_all_reduce_named_params": [("w", None)], "param_to_hook_all_reduce": nn.Parameter(torch.ones(1))}
    messages = {}
    for option, value in kwargs.items():
        try:
            DistributedDataParallel(nn.Linear(2, 2), **{option: value})
        except NotImplementedError as e:
            messages[option] = str(e)
    return messages


def test_unsupported_torch_options_say_why():
    messages = launch(_unsupported, 1, timeout=120)[0]
    assert len(messages) == 4   # mixed_precision is supported (reduce_dtype: tests/test_mixed_precision.py)
    for option, message in messages.items():
        assert message.startswith(f"DistributedDataParallel({option}=...) is not implemented in minifsdp: ")
        assert message.endswith("; leave it at its default") and len(message) > 90  # with the reason
