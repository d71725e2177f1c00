"""calibrate's measurements and the predicted step time against the trainer's measured one.

The accuracy test runs one launch of 2 ranks: a short calibration (the four collectives DDP and FSDP
use, linear layers, a block's other ops, AdamW), then the trainer's loop (``run_rank``) on gpt-small
for ddp and for fsdp, 4 steps each, and holds ``calibrate.predict_run`` to the median of the steps
after the first (each step: its slowest rank's).

**Why CPU seconds, and the margin.** Every clock of the two ranks (the calibration's and the
trainer's step timer) counts its process's CPU seconds (``time.process_time``: the compute thread
and gloo's threads), not wall seconds. With a free core per rank the two agree; on a shared machine
the wall clock also measures the other processes, and they come and go within seconds. Measured on
this 2-core machine while other test runs kept its load average at 9-17, wall-clock ratios
predicted / measured ranged from 0.18 to 1.6 within minutes (the calibration and the run got
different shares of the cores): no margin under 2x survives that. In CPU seconds, 6 runs of this
test's protocol at load 3-5 gave ddp 0.85-1.01 and fsdp 0.83-0.94, and 20 runs while developing
the model (load 2-17) stayed within 0.72-1.25: heavy load costs a process cache misses, hence CPU
time, and the model leaves out FSDP's flat-buffer copies, so it reads low more often than high.
``MARGIN`` = 1.4 accepts predicted / measured in [1/1.4, 1.4]; it is below sqrt(2), so a prediction
off by 2x in either direction fails wherever in the band the true ratio lies.
"""
from __future__ import annotations

import statistics
import sys

import cloudpickle
import pytest

from minifsdp import calibrate
from minifsdp.launch import launch
from minifsdp.step_time import fit_alpha_beta
from minifsdp.train import TrainConfig, validate

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MARGIN = 1.4
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")   # what ddp and fsdp call
SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)


def _calibrate_then_train(cfgs):
    """On every rank: this process's CPU seconds as the clock, a calibration, then each cfg's loop."""
    import time

    from minifsdp.calibrate import measure_rank
    from minifsdp.train import run_rank

    time.perf_counter = time.process_time   # calibrate's and the trainer's timers: CPU seconds of this rank
    return [measure_rank(SIZES, 5, OPS)] + [run_rank(cfg)["step_time_s"] for cfg in cfgs]


@pytest.fixture(scope="module")
def predicted_and_measured():
    cfgs = [TrainConfig(strategy=s, world_size=2, model="gpt-small", steps=4, batch_size=8, quiet=True,
                        track_memory=False, write_plots=False, out="unused", timeout=300) for s in ("ddp", "fsdp")]
    for cfg in cfgs:
        validate(cfg)
    cal, out = _measure(cfgs)
    # Another process that takes the cores during the run but not during the calibration (a parallel test run)
    # inflates even CPU seconds (one run read 0.57): measured once more, both again. A model off by 2x fails twice.
    if not all(within(predicted.step_s / measured) for predicted, measured in out.values()):
        cal, out = _measure(cfgs)
    return cal, out


def _measure(cfgs):
    per_rank = launch(_calibrate_then_train, 2, cfgs, timeout=300)
    cal = calibrate.from_ranks([r[0] for r in per_rank])
    out = {}
    for i, cfg in enumerate(cfgs, start=1):
        steps = [max(times) for times in zip(*(r[i] for r in per_rank))]   # a step ends when its slowest rank does
        out[cfg.strategy] = (calibrate.predict_run(cfg, calibration=cal), statistics.median(steps[1:]))
    return cal, out


def within(ratio: float) -> bool:
    return 1 / MARGIN <= ratio <= MARGIN


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_predicted_step_is_within_the_margin_of_the_measured(predicted_and_measured, strategy):
    _, runs = predicted_and_measured
    predicted, measured = runs[strategy]
    ratio = predicted.step_s / measured
    assert within(ratio), f"{strategy}: predicted {predicted} against measured {measured * 1e3:.1f} ms"
    assert not within(2 * ratio) and not within(ratio / 2)   # the margin cannot let a 2x error through
    assert predicted.matmul_s > predicted.comm_s > 0 and 0 < predicted.mfu < 1


def test_the_calibration_fits_every_op_it_measured(predicted_and_measured):
    cal, _ = predicted_and_measured
    assert cal.device == "cpu" and sorted(cal.compute) == [2] and sorted(cal.collectives) == sorted(OPS)
    for op, by_group in cal.collectives.items():
        fit, points = by_group[2], by_group[2]["points"]
        assert [b for b, _ in points] == [2 * s if op == "all_reduce" else s for s in SIZES]   # comm's volume
        assert (fit["alpha_s"], fit["beta_s_per_byte"]) == fit_alpha_beta(*zip(*points))
        assert fit["beta_s_per_byte"] > 0
    rates = cal.compute[2]
    assert [n for n, _ in rates["matmul_flops"]["fp32"]] == [256, 512, 1024]
    assert rates["elementwise_bytes_per_s"] > 0 and rates["optimizer_s_per_param"] > 0


def test_the_calibration_round_trips_through_its_json(predicted_and_measured, tmp_path):
    cal, runs = predicted_and_measured
    cal.save(str(tmp_path / "calibration.json"))
    cfg = TrainConfig(strategy="torch-ddp", world_size=2, model="gpt-small", batch_size=8)
    again = calibrate.predict_run(cfg, calibration=str(tmp_path / "calibration.json"))
    assert again.step_s == pytest.approx(runs["ddp"][0].step_s)   # torch's DDP moves and computes what ours does


@pytest.mark.parametrize("argv, message", [
    (["--world-sizes", "0"], "--world-sizes must be >= 1"),
    (["--world-sizes", "2", "--sizes-kib", "64"], "at least 2 distinct positive message sizes"),
    (["--world-sizes", "2", "--sizes-kib", "0", "64"], "at least 2 distinct positive message sizes"),
    (["--world-sizes", "2", "--repeats", "0"], "--repeats >= 1"),
])
def test_bad_input_is_one_line_before_any_process(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        calibrate.main(argv)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_predict_run_without_a_calibration_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m minifsdp.calibrate"):
        calibrate.predict_run(TrainConfig(strategy="ddp", world_size=2), calibration=str(tmp_path / "none.json"))


def test_the_trainer_line_puts_predicted_beside_measured(predicted_and_measured, tmp_path):
    cal, runs = predicted_and_measured
    cfg = TrainConfig(strategy="fsdp", world_size=2, model="gpt-small", batch_size=8)
    metrics = {"step_time_s": [[0.9, 0.40, 0.44], [0.8, 0.41, 0.43]]}          # slowest rank per step: .41, .44
    line = calibrate.predicted_line(cfg, metrics, cal)
    assert line.startswith(f"predicted step {runs['fsdp'][0].step_s * 1e3:.1f} ms") and "measured 425.0 ms" in line
    assert "python -m minifsdp.calibrate" in calibrate.predicted_line(cfg, metrics, str(tmp_path / "none.json"))
    pipeline = TrainConfig(strategy="pp", world_size=4, pp=4, model="gpt-small", batch_size=8, micro_batches=8)
    assert "not modelled" in calibrate.predicted_line(pipeline, metrics, cal)   # 6 layers on 4 stages
    assert calibrate.predicted_seconds(pipeline, cal) is None


def test_bench_prints_each_sides_prediction(predicted_and_measured, tmp_path, monkeypatch):
    """bench's predicted column is predict_run's for each side (the runs themselves stand in: no processes)."""
    from minifsdp import bench

    cal, _ = predicted_and_measured
    cal.save(str(tmp_path / "calibration.json"))
    fake = {"step_time_s": [[0.5, 0.5], [0.5, 0.5]], "bytes_per_step": [{"all_reduce": 1.0}], "losses": [1.0, 0.9]}
    monkeypatch.setattr(bench, "_run", lambda *args, **kwargs: fake)
    rows = bench.run(bench.BenchConfig(model="gpt-small", world_sizes=(2,), pairs=("fsdp:torch-fsdp",), repeats=1,
                                       steps=2, warmup=1, memory=False, out=str(tmp_path),
                                       calibration=str(tmp_path / "calibration.json")))
    expected = calibrate.predict_run(TrainConfig(strategy="fsdp", world_size=2, model="gpt-small", batch_size=8),
                                     calibration=cal).step_s
    assert rows[0]["predicted_s"] == {"fsdp": pytest.approx(expected), "torch-fsdp": pytest.approx(expected)}
    assert f"| 500.0 / 500.0 | {expected * 1e3:.0f} / {expected * 1e3:.0f} |" in bench.table(rows)
