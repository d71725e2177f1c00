"""Where a step's time goes (minifsdp.phases): the phases add up to the step, bench --phases prints them.

* a synthetic trace: nested spans are counted once (a pipeline's forwards inside its forward_backward);
* real runs (gpt-tiny, 2 ranks; ours and torch's, a data-parallel and a pipeline side): every step's
  forward + backward + comm wait + optimizer + rest is the trainer's own step time within 5 %, and each
  is >= 0 (a phase counted twice drives "rest" below zero);
* ``python -m minifsdp.bench --phases --compute --malloc both`` prints the phase table and the table's
  pinned, page-fault and compute-only columns, and saves them in bench.json.
"""

import json

import pytest

from minifsdp import bench, phases
from minifsdp.trace import COMM, COMPUTE, Span, Trace
from minifsdp.train import train

pytestmark = pytest.mark.multiprocess


def _span(name, start, end, cpu, kind=COMPUTE):
    return Span(name=name, kind=kind, start=start, end=end, cpu=cpu, faults=0)


def test_nested_phase_spans_count_once():
    # a 10 s step whose thread ran 8 s: a schedule's forward_backward (5 s CPU) holds two forwards
    # (1 s + 1.5 s CPU): backward is what is left of it, 2.5 s; the optimizer 2 s; rest 8 - 2.5 - 2.5 - 2
    tr = Trace(spans=[_span("step", 0.0, 10.0, 8.0), _span("forward_backward", 0.1, 7.0, 5.0),
                      _span("forward", 0.2, 1.5, 1.0), _span("all_reduce", 0.5, 6.0, None, COMM),
                      _span("forward", 2.0, 4.0, 1.5), _span("optimizer", 7.5, 9.9, 2.0)])
    (row,) = phases.step_phases(tr)
    assert row == pytest.approx({"forward": 2.5, "backward": 2.5, "comm wait": 2.0, "optimizer": 2.0, "rest": 1.0})
    assert sum(row.values()) == pytest.approx(10.0)
    assert phases.step_phases(Trace(spans=[Span("step", COMPUTE, 0.0, 1.0)])) == []  # no CPU times: no phases


def test_size_classes_follow_glibc_thresholds():
    got = phases.size_classes([(4096, "activations"), (128 << 10, "comm"), (32 << 20, "temporary"), (1, "x")])
    assert got == {"< 128 KiB": 4097, "128 KiB - 32 MiB": 128 << 10, ">= 32 MiB": 32 << 20}
    assert phases.median_faults([[10, 3, 5], [20, 5, 7]], warmup=1) == 5.0  # steps 2, 3: means 4 and 6


@pytest.mark.parametrize("side", ["ddp", "torch-ddp", "pp@1f1b", "torch-pp@1f1b", "fsdp"])
def test_phases_add_up_to_the_step(side, tmp_path):
    parsed = bench.Side.parse(side)
    m = train(parsed.train_config("gpt-tiny", 2, 8, steps=4, quiet=True, out=str(tmp_path), track_memory=False,
                                  write_plots=False))
    for rank, (rows, times) in enumerate(zip(m["phases"], m["step_time_s"])):
        assert len(rows) == len(times) == 4
        for step, row in enumerate(rows):
            assert set(row) == set(phases.PHASES)
            assert min(row.values()) >= -1e-4, (rank, step, row)  # nothing counted twice
            assert row["forward"] > 0 and row["backward"] > 0, (rank, step, row)  # both found, torch's schedule too
        # steps 2-4 together: a rank preempted for a millisecond between the two timers is 5 % of one gpt-tiny step
        phased = sum(sum(row.values()) for row in rows[1:])
        assert phased == pytest.approx(sum(times[1:]), rel=0.05), (rank, rows, times)
    assert all(f is None or f >= 0 for faults in m["minor_faults"] for f in faults)


def test_bench_phases_prints_and_saves_every_column(tmp_path, capsys):
    bench.run(bench.BenchConfig(model="gpt-tiny", world_sizes=(2,), pairs=("ddp:torch-ddp", "pp@gpipe:torch-pp@gpipe"),
                                steps=3, warmup=1, repeats=1, phases=True, compute=True, malloc="both", out=str(tmp_path)))
    out = capsys.readouterr().out
    assert "| world | side | step ms | forward ms | backward ms | comm wait ms | optimizer ms | rest ms |" in out
    assert "step ratio, malloc pinned" in out and "step / compute-only (ours / ref)" in out
    ddp, pp = json.load(open(tmp_path / "bench.json"))["rows"]
    assert set(ddp["phases"]) == {"ddp", "torch-ddp", bench.COMPUTE}  # the compute floor: data parallel only
    assert set(pp["phases"]) == {"pp@gpipe", "torch-pp@gpipe"} and "over_compute" not in pp
    for row in (ddp, pp):
        assert row["step_ratio_pinned"] > 0 and set(row["allocated_per_step"]) == {row["ours"], row["theirs"]}
        assert all(sum(v.values()) > 0 for v in row["allocated_per_step"].values())
        for side, split in row["phases"].items():
            assert sum(split.values()) == pytest.approx(row["step_s"][side], rel=0.25)  # medians of different steps
            assert f"| 2 | {side} |" in out
