"""The benchmark: pairs with options, bytes moved equal the exact expected value (padding included), torch's counted."""

import json
import tempfile

import pytest
import torch.distributed as tdist

from minifsdp import bench, estimate, models, torch_reference
from minifsdp.train import TrainConfig, train, validate


def _bytes(side: str, world: int) -> list[dict[str, float]]:
    """Bytes per step by collective, every rank, of a 2-step gpt-tiny run (no memory tracking)."""
    parsed = bench.Side.parse(side)
    name, option = parsed.name, parsed.option
    with tempfile.TemporaryDirectory() as tmp:
        m = train(TrainConfig(strategy=name, sharding_strategy=option or "FULL_SHARD", world_size=world,
                              model="gpt-tiny", steps=2, batch_size=2 * world, quiet=True, out=tmp,
                              track_memory=False, write_plots=False, timeout=120))
    return m["bytes_per_step"]


# That minifsdp's own side moves exactly expected_bytes, for every strategy and world size: test_bytes_agree.py.
def test_expected_bytes_padding_and_root_rule():
    units, root = estimate.fsdp_unit_numels(models.build_model("gpt-tiny"), (models.Block,))
    psi = 4 * (sum(units) + root)
    full = bench.expected_bytes("gpt-tiny", "fsdp@FULL_SHARD", 2)
    assert full["paper"] == 3 * psi and full["total"] == 3 * psi - 4 * root  # no padding at N = 2 here
    padded = bench.expected_bytes("gpt-tiny", "fsdp@SHARD_GRAD_OP", 3)
    assert padded["total"] > padded["paper"] == 2 * psi  # at N = 3 the units do not split evenly
    zero1 = bench.expected_bytes("gpt-tiny", "zero1", 2)  # FairScale/torch ZeRO-1: the paper's 2Ψ + Ψ (+ buffers)
    assert zero1["total"] == zero1["paper"] + psi + 2048 and zero1["by_op"]["broadcast"] == psi + 2048
    assert bench.expected_bytes("gpt-tiny", "fsdp@HYBRID_SHARD", 4)["paper"] is None


# torch's traffic, counted by torch_reference: FSDP1 moves what minifsdp's formula says
# (3Ψ - Ψ_root for FULL_SHARD, padding included); DDP and ZeRO-1 the same as ours.
@pytest.mark.parametrize("theirs,ours,world", [
    ("torch-fsdp@FULL_SHARD", "fsdp@FULL_SHARD", 3), ("torch-fsdp@SHARD_GRAD_OP", "zero2", 2),
    ("torch-fsdp@NO_SHARD", "fsdp@NO_SHARD", 2), ("torch-ddp", "ddp", 2), ("torch-zero1", "zero1", 2),
    ("torch-fsdp2", "fsdp@FULL_SHARD", 2),  # gpt-tiny's dims are even: FSDP2's per-parameter padding is nil
])
def test_torch_bytes_are_counted(theirs, ours, world):
    counted = _bytes(theirs, world)[0]
    if ours == "zero2":  # ours reduces to owners; torch reduce-scatters a flat parameter: the same total
        expected = bench.expected_bytes("gpt-tiny", "fsdp@SHARD_GRAD_OP", world)["by_op"]
    else:
        expected = dict(bench.expected_bytes("gpt-tiny", ours, world)["by_op"])
    assert counted == expected


def test_count_collectives_restores_torch():
    import torch.distributed._functional_collectives as funcol  # DTensor's collectives (torch-tp) are counted too

    before = tdist.all_gather_single, tdist.all_reduce, tdist._broadcast_coalesced, funcol.all_reduce
    with pytest.raises(RuntimeError):
        with torch_reference.count_collectives():
            assert tdist.all_reduce is not before[1] and funcol.all_reduce is not before[3]
            raise RuntimeError("boom")
    assert (tdist.all_gather_single, tdist.all_reduce, tdist._broadcast_coalesced, funcol.all_reduce) == before


def test_bench_pair_writes_ratios(tmp_path):
    pair = "fsdp@SHARD_GRAD_OP:torch-fsdp@SHARD_GRAD_OP"
    rows = bench.run(bench.BenchConfig(model="gpt-tiny", world_sizes=(2,), pairs=(pair,), steps=3, warmup=1,
                                       repeats=2, out=str(tmp_path)))
    saved = json.load(open(tmp_path / "bench.json"))
    assert saved["rows"] == json.loads(json.dumps(rows))
    row, (ours, theirs) = rows[0], pair.split(":")
    assert set(row["step_s_all"]) == {ours, theirs} and all(len(v) == 2 for v in row["step_s_all"].values())
    assert row["step_ratio"] == pytest.approx(row["step_s"][ours] / row["step_s"][theirs])
    assert row["peak_ratio"] == pytest.approx(row["peak_bytes"][ours] / row["peak_bytes"][theirs])
    assert row["bytes_per_step"][ours] == row["bytes_per_step"][theirs] == row["bytes_expected"]
    assert row["bytes_match"] and row["same_losses"]
    assert f"| 2 | {ours} | {theirs} |" in bench.table(rows) and "| 2·4Ψ = " in bench.table(rows)


def test_activation_rows_measure_what_estimate_predicts():
    rows = {r["checkpoint"]: r for r in bench.activation_rows("gpt-tiny", 4)}
    for mode, r in rows.items():  # the tracker also holds the fp32 loss scalar (4 B) that backward does not save
        assert r["measured"] - r["predicted"] == 4, f"{mode}: measured {r['measured']} B, predicted {r['predicted']} B"
    assert rows["full"]["measured"] < rows["selective"]["measured"] < rows["none"]["measured"]
    assert "| 4 | full |" in bench.activation_table(list(rows.values()))


def test_every_preset_pair_parses():
    assert len(bench.PRESETS["sharding"]) == 11
    for pair in bench.PRESETS["sharding"]:
        ours, theirs = bench.parse_pair(pair)
        assert bench.expected_bytes("gpt-tiny", ours, 4)["total"] > 0
        assert theirs.record.is_torch or (ours.name, theirs.name) == ("fsdp2", "fsdp")  # per-parameter vs flat


@pytest.mark.parametrize("preset", sorted(bench.PRESETS))
def test_every_preset_validates_with_its_default_model(tmp_path, preset):
    """What `python -m minifsdp.bench --preset P` runs (its default model, world sizes 2 and 4) passes
    validation before anything starts, and every pipeline side has an exact expected byte count."""
    model = bench.PRESET_MODELS.get(preset, "gpt-small")
    cfg = bench.BenchConfig(model=model, pairs=bench.PRESETS[preset], out=str(tmp_path))
    for pair in bench.PRESETS[preset]:
        for side in bench.parse_pair(pair):
            for world in cfg.world_sizes:
                validate(bench._config(cfg, side, world, False, cfg.steps, cfg.out))
                if side.name == "pp":
                    assert bench.expected_bytes(model, side, world)["total"] > 0, side


@pytest.mark.parametrize("pair,message", [
    ("ddp:nope", "unknown strategy 'nope'"),
    ("fsdp@HALF_SHARD:torch-fsdp", "unknown option 'HALF_SHARD' for fsdp"),
    ("torch-fsdp2@NO_SHARD:fsdp", "choose from: FULL_SHARD, SHARD_GRAD_OP"),
    ("ddp@FULL_SHARD:torch-ddp", "'ddp' takes no @option"),
    ("cp@ring:single", "unknown option 'ring' for cp in --pairs; choose from: zigzag, naive"),
    ("ddp", "a pair is ours:theirs"),
])
def test_bench_rejects_bad_pairs(tmp_path, pair, message):
    with pytest.raises(ValueError, match=message):
        bench.run(bench.BenchConfig(pairs=(pair,), out=str(tmp_path)))


def test_bench_checks_every_run_before_the_first(tmp_path):
    with pytest.raises(ValueError, match="use an even --world-size"):
        bench.run(bench.BenchConfig(model="gpt-tiny", pairs=bench.PRESETS["sharding"], world_sizes=(2, 3),
                                    batch_size=6, out=str(tmp_path / "hybrid")))
    with pytest.raises(ValueError, match="multiple of world size"):
        bench.run(bench.BenchConfig(model="gpt-tiny", world_sizes=(3,), out=str(tmp_path / "batch")))


@pytest.mark.parametrize("malloc,pinned_runs", [("pinned", [True, True]), ("both", [False, False, True, True])])
def test_malloc_thresholds_reach_the_runs_that_pin_them(tmp_path, monkeypatch, malloc, pinned_runs):
    for name in bench.PINNED_MALLOC:  # setenv first: monkeypatch then restores the original (unset) afterwards
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    seen = []

    def fake_train(cfg):  # stands in for the runs: what would the workers inherit?
        seen.append({k: bench.os.environ.get(k) for k in bench.PINNED_MALLOC})
        return {"step_time_s": [[0.5, 0.5]], "bytes_per_step": [{"all_reduce": 1.0}], "losses": [1.0, 0.9]}

    monkeypatch.setattr(bench, "train", fake_train)
    rows = bench.run(bench.BenchConfig(model="gpt-tiny", world_sizes=(2,), pairs=("ddp:torch-ddp",), out=str(tmp_path),
                                       repeats=1, steps=2, warmup=1, memory=False, malloc=malloc))
    assert [s == bench.PINNED_MALLOC for s in seen] == pinned_runs  # one run per side and mode
    assert all(v is None for s in seen if s != bench.PINNED_MALLOC for v in s.values())  # unpinned: unset
    assert all(bench.os.environ.get(k) is None for k in bench.PINNED_MALLOC)  # and unset again afterwards
    assert ("step_ratio_pinned" in rows[0]) == (malloc == "both")
    with pytest.raises(ValueError, match="unknown --malloc"):
        bench.run(bench.BenchConfig(model="gpt-tiny", world_sizes=(2,), out=str(tmp_path), malloc="sometimes"))
