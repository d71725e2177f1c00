"""The benchmark driver runs both sides of a pair in one run and reports medians and ratios."""

import json

import pytest

from minifsdp import bench


def test_bench_pair_writes_ratios(tmp_path):
    rows = bench.run(bench.BenchConfig(model="gpt-tiny", world_sizes=(2,), pairs=("ddp:torch-ddp",), steps=3,
                                       warmup=1, repeats=2, out=str(tmp_path)))
    saved = json.load(open(tmp_path / "bench.json"))
    assert saved["rows"] == json.loads(json.dumps(rows))
    row = rows[0]
    assert set(row["step_s_all"]) == {"ddp", "torch-ddp"} and all(len(v) == 2 for v in row["step_s_all"].values())
    assert row["step_ratio"] == pytest.approx(row["step_s"]["ddp"] / row["step_s"]["torch-ddp"])
    assert row["peak_ratio"] == pytest.approx(row["peak_bytes"]["ddp"] / row["peak_bytes"]["torch-ddp"])
    # minifsdp's DDP moves exactly the formula's 2 x parameter bytes per step
    assert row["bytes_per_step"]["ddp"] >= row["bytes_formula"] == 2 * 4 * row["n_params"]
    assert "| 2 | ddp | torch-ddp |" in bench.table(rows)


def test_bench_rejects_unknown_strategy(tmp_path):
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        bench.run(bench.BenchConfig(pairs=("ddp:nope",), out=str(tmp_path)))
