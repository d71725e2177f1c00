"""The trainer's --checkpoint none|full|selective keeps the parity contract and lowers the peak.

Activation checkpointing recomputes, bit for bit (fp32), what the forward would
have saved, so ``--strategy single`` trains *identically* with and without it;
every parallel strategy with it matches single's losses within the trainer's
fp32 tolerance (LOSS_RTOL, as tests/test_train.py). torch-* strategies use
torch's own checkpoint_wrapper (train.apply_checkpointing).
"""

import pytest

from minifsdp.train import TrainConfig, parse_args, train, validate

LOSS_RTOL = 1e-5  # as tests/test_train.py: fp32, reductions in another order across ranks


def _run(tmp_path, strategy="single", world_size=1, checkpoint="none", track_memory=False, **kw):
    out = tmp_path / f"{strategy}-{checkpoint}"
    return train(TrainConfig(model="gpt-tiny", steps=3, batch_size=8, quiet=True, write_plots=False, out=str(out),
                             strategy=strategy, world_size=world_size, checkpoint=checkpoint,
                             track_memory=track_memory, **kw))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), track_memory=True)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_single_is_bit_identical_and_peak_drops(tmp_path, single, mode):
    m = _run(tmp_path, checkpoint=mode, track_memory=True)
    assert m["losses"] == single["losses"], f"--checkpoint {mode} changed the losses of one process"
    assert m["peak_bytes"][0] < single["peak_bytes"][0], f"--checkpoint {mode} did not lower the peak"
    assert m["config"]["checkpoint"] == mode


@pytest.mark.parametrize("strategy,mode", [("ddp", "full"), ("fsdp", "full"), ("fsdp", "selective"),
                                           ("torch-fsdp", "full"), ("fsdp2", "full")])
def test_parity_with_single(tmp_path, single, strategy, mode):
    m = _run(tmp_path, strategy, 2, mode)
    assert m["losses"] == pytest.approx(single["losses"], rel=LOSS_RTOL), (strategy, mode, m["losses"])


def test_command_line_and_bad_input(tmp_path):
    assert parse_args(["--checkpoint", "selective"]).checkpoint == "selective"
    assert parse_args([]).checkpoint == "none"
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "some"])
    with pytest.raises(ValueError, match="--checkpoint must be none, full or selective"):
        validate(TrainConfig(checkpoint="every-other", out=str(tmp_path)))
    with pytest.raises(ValueError, match="zero-bubble splits backward .* use --checkpoint none or another schedule"):
        validate(TrainConfig(strategy="pp", world_size=2, schedule="zero-bubble", checkpoint="full", out=str(tmp_path)))


def test_bench_sides_carry_checkpointing(tmp_path):
    from minifsdp import bench

    ours, theirs = bench.parse_pair("fsdp#full:torch-fsdp#full")
    assert (ours.name, ours.checkpoint, theirs.name, theirs.checkpoint) == ("fsdp", "full", "torch-fsdp", "full")
    assert bench.Side.parse("fsdp@SHARD_GRAD_OP#selective").checkpoint == "selective"
    assert bench.Side.parse("ddp").checkpoint == "none"
    cfg = bench._config(bench.BenchConfig(), "torch-fsdp#selective", 2, False, 2, str(tmp_path))
    assert (cfg.strategy, cfg.checkpoint) == ("torch-fsdp", "selective")
    with pytest.raises(ValueError, match="write side#full or side#selective"):
        bench.parse_pair("fsdp#every:torch-fsdp")
    assert all(bench.parse_pair(p) for p in bench.PRESETS["checkpoint"])
