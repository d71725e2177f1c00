"""The step-time model (minifsdp.step_time) on synthetic calibrations: the α–β fit, the FLOP count,
the overlap rule, and the planner's ``Plan.time``. No processes: every number here is arithmetic."""
from __future__ import annotations

import dataclasses

import pytest

from minifsdp import planner, step_time
from minifsdp.models import MODEL_PRESETS
from minifsdp.step_time import Calibration, fit_alpha_beta, gpt_matmul_flops, predict_gpt

SIZES = [4096, 262144, 1 << 20, 4 << 20, 16 << 20]


@pytest.mark.parametrize("alpha, beta", [(1e-4, 1e-9), (2.5e-3, 7e-10), (0.0, 3e-9), (5e-5, 0.0)])
def test_fit_recovers_alpha_and_beta_from_a_line(alpha, beta):
    seconds = [alpha + beta * b for b in SIZES]
    a, b = fit_alpha_beta(SIZES, seconds)
    assert a == pytest.approx(alpha, rel=1e-9, abs=1e-15) and b == pytest.approx(beta, rel=1e-9, abs=1e-18)


def test_fit_is_least_squares_in_relative_error():
    """Off the line: the fit minimises sum(((α + β x - t) / t)²), so its gradient there is zero."""
    seconds = [2e-4, 5e-4, 1.2e-3, 4.1e-3, 1.5e-2]
    a, b = fit_alpha_beta(SIZES, seconds)
    residual = [(a + b * x - t) / t**2 for x, t in zip(SIZES, seconds)]
    assert sum(residual) == pytest.approx(0, abs=1e-6)
    assert sum(r * x for r, x in zip(residual, SIZES)) == pytest.approx(0, abs=1e-6 * SIZES[-1])


def test_a_negative_latency_is_refitted_through_the_origin():
    sizes, seconds = [1000, 2000, 3000], [0.5e-6, 2.0e-6, 3.5e-6]         # the line's α would be -1 µs
    a, b = fit_alpha_beta(sizes, seconds)
    # min sum(((β x - t) / t)²): β = sum(x / t) / sum(x² / t²)
    assert a == 0.0 and b == pytest.approx(sum(x / t for x, t in zip(sizes, seconds)) /
                                           sum((x / t) ** 2 for x, t in zip(sizes, seconds)))


def test_a_negative_bandwidth_term_is_refitted_as_latency_alone():
    sizes, seconds = [1000, 2000, 3000], [3e-6, 2e-6, 1e-6]            # larger messages measured faster: noise
    a, b = fit_alpha_beta(sizes, seconds)
    weights = [1 / t**2 for t in seconds]
    assert b == 0.0 and a == pytest.approx(sum(w * t for w, t in zip(weights, seconds)) / sum(weights))
    assert a > 0


@pytest.mark.parametrize("sizes, seconds", [([1000], [1.0]), ([1000, 1000], [1.0, 2.0]), ([1, 2], [0.0, 1.0])])
def test_fit_refuses_what_cannot_be_fitted(sizes, seconds):
    with pytest.raises(ValueError, match="fit_alpha_beta needs >= 2 distinct sizes"):
        fit_alpha_beta(sizes, seconds)


def synthetic(device: str = "cpu", flops: float = 1e11) -> Calibration:
    """A calibration as calibrate writes it: 2 ranks, every op α = 100 µs, 1 GB/s of volume."""
    fit = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "points": []}
    return Calibration(device, "gloo" if device == "cpu" else "nccl",
                       compute={2: {"matmul_flops": {"fp32": [[256, flops / 2], [512, flops], [1024, flops]]},
                                    "elementwise_bytes_per_s": 1e9, "optimizer_s_per_param": 1e-8}},
                       collectives={op: {2: dict(fit)} for op in step_time.OPS})


def test_calibration_round_trips_and_prices_a_collective(tmp_path):
    cal = synthetic()
    cal.save(str(tmp_path / "c.json"))
    back = Calibration.load(str(tmp_path / "c.json"))
    assert back == cal
    assert back.collective_seconds("all_reduce", 2e6, 2, calls=3) == pytest.approx(3e-4 + 2e-3)
    assert back.collective_seconds("recv", 1e6, 2) == back.collective_seconds("send", 1e6, 2)
    with pytest.raises(FileNotFoundError, match="run python -m minifsdp.calibrate first"):
        Calibration.load(str(tmp_path / "missing.json"))


def test_an_uncalibrated_group_size_scales_by_the_ring():
    alpha, beta = synthetic().alpha_beta("all_gather", 4)          # (n-1)/n: 3/4 against 1/2
    assert alpha == pytest.approx(3e-4) and beta == pytest.approx(1.5e-9)


def test_matmul_rate_interpolates_between_sizes():
    cal = synthetic()
    assert cal.matmul_flops(2, "fp32", 2 * 256**3) == 5e10
    assert cal.matmul_flops(2, "fp32", 2 * 512**3) == pytest.approx(1e11)
    middle = cal.matmul_flops(2, "fp32", 2 * 362**3)                   # halfway in log: the geometric mean
    assert middle == pytest.approx((5e10 * 1e11) ** 0.5, rel=0.01)
    assert cal.matmul_flops(2, "bf16") == 1e11                          # no bf16 measured: fp32's


def test_flops_are_6n_plus_attention_and_recompute_adds_a_forward():
    cfg = MODEL_PRESETS["gpt-small"]
    h, L, T, V = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.vocab_size
    tokens = 4 * T
    none, full, sel = (gpt_matmul_flops(cfg, tokens, T, c) for c in ("none", "full", "selective"))
    assert none["model"] == 6 * (12 * L * h * h + h * V) * tokens + 12 * L * T * h * tokens
    assert full["total"] == none["model"] + none["blocks"] // 3
    assert sel["total"] == none["model"] + 4 * L * T * h * tokens


def _predict(cal, **kw):
    cfg = MODEL_PRESETS["gpt-small"]
    plan = planner.plan(cfg, batch=8, dp=2)
    return predict_gpt(cal, cfg, batch=8, seq_len=cfg.block_size, comm=plan.comm,
                       params_per_device=plan.params_per_device, dp=2, **kw)


def test_half_the_flops_rate_doubles_the_matmul_time_and_cpu_overlaps_nothing():
    fast, slow = _predict(synthetic(flops=1e11)), _predict(synthetic(flops=5e10))
    assert slow.matmul_s == pytest.approx(2 * fast.matmul_s)
    assert fast.overlapped_s == 0 and fast.step_s == pytest.approx(fast.compute_s + fast.comm_s)
    grads = planner.plan("gpt-small", batch=8, dp=2).comm["dp"]["all_reduce"]
    assert fast.comm["dp"]["all_reduce"] == pytest.approx(2 * 1e-4 + 1e-9 * grads)  # 41.6 MiB: two 25 MiB buckets
    assert fast.mfu == pytest.approx(fast.model_flops / fast.step_s / 1e11)


def test_cuda_hides_the_data_parallel_collectives_behind_compute():
    cuda = _predict(synthetic("cuda"))
    dp = cuda.comm["dp"]
    assert cuda.overlapped_s == pytest.approx(min(cuda.compute_s, dp["all_reduce"]))
    assert cuda.step_s == pytest.approx(max(cuda.compute_s, dp["all_reduce"]) + dp["broadcast"])


def test_zero_shards_the_optimizer_step_and_a_pipeline_pays_its_bubble():
    assert _predict(synthetic(), zero_stage=3).optimizer_s == pytest.approx(_predict(synthetic()).optimizer_s / 2)
    cal = synthetic()
    cal.compute[3] = cal.compute[2]
    cfg = MODEL_PRESETS["gpt-small"]
    p = planner.plan(cfg, batch=12, pp=3, micro_batches=6, calibration=cal)
    work = p.time.matmul_s + p.time.memory_s
    assert p.time.bubble_s == pytest.approx(work * 2 / 6)              # (p - 1) / (v m)
    assert "predicted step" in str(p) and "MFU" in str(p)
    assert planner.plan(cfg, batch=12, pp=3, micro_batches=6).time is None


def test_merge_adds_world_sizes():
    two, four = synthetic(), dataclasses.replace(synthetic(), compute={4: synthetic().compute[2]},
                                                 collectives={"all_reduce": {4: {"alpha_s": 1.0, "beta_s_per_byte": 0,
                                                                                 "points": []}}})
    merged = two.merge(four)
    assert sorted(merged.compute) == [2, 4] and sorted(merged.collectives["all_reduce"]) == [2, 4]
    assert merged.alpha_beta("all_reduce", 4) == (1.0, 0)


def test_op_count_grows_by_a_block_per_layer_and_dispatch_adds_on_cpu_only():
    tiny = MODEL_PRESETS["gpt-tiny"]
    two, four, six = (step_time.gpt_op_count(dataclasses.replace(tiny, n_layer=n)) for n in (2, 4, 6))
    for phase in ("forward", "backward", "optimizer"):
        assert six[phase] - four[phase] == four[phase] - two[phase] > 0          # the same ops for every block
    cal = synthetic()
    cal.compute[2]["op_s"] = 1e-5
    cpu = _predict(cal)
    ops = step_time.gpt_op_count(MODEL_PRESETS["gpt-small"])
    assert cpu.dispatch_s == pytest.approx(1e-5 * sum(ops.values()))
    assert cpu.compute_s == pytest.approx(cpu.matmul_s + cpu.memory_s + cpu.optimizer_s + cpu.dispatch_s)
    cuda = dataclasses.replace(cal, device="cuda")
    cuda.compute[2] = dict(cal.compute[2], op_s=1.0)                             # the host is the slower side
    assert _predict(cuda).compute_s == pytest.approx(sum(ops.values()))


def test_the_docstring_examples_hold():
    import doctest

    assert doctest.testmod(step_time).failed == 0
