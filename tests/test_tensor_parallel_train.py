"""The trainer's tensor-parallel strategies keep the parity contract: losses equal --strategy single's."""

import pytest

from minifsdp import bench, models, planner
from minifsdp.train import TrainConfig, parse_args, train, validate

LOSS_RTOL = 1e-5


def _run(tmp_path, **kw):
    return train(TrainConfig(model="gpt-tiny", steps=4, batch_size=8, quiet=True, track_memory=False,
                             write_plots=False, out=str(tmp_path / kw["strategy"]), **kw))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), strategy="single", world_size=1)


@pytest.mark.parametrize("kw", [
    {"strategy": "tp", "world_size": 2, "tp": 2},
    {"strategy": "tp", "world_size": 2, "tp": 2, "sequence_parallel": True, "grad_accum": 2},
    {"strategy": "fsdp+tp", "world_size": 4, "dp": 2, "tp": 2},
    {"strategy": "torch-tp", "world_size": 2, "tp": 2},
    {"strategy": "torch-fsdp+tp", "world_size": 4, "dp": 2, "tp": 2},
    {"strategy": "3d", "world_size": 8, "pp": 2, "tp": 2, "dp": 2, "micro_batches": 2},
], ids=["tp2", "tp2-sp-accum2", "fsdp2xtp2", "torch-tp2", "torch-fsdp2xtp2", "3d-pp2xtp2xdp2"])
def test_parity_with_single(tmp_path, single, kw):
    m = _run(tmp_path, **kw)
    assert m["losses"] == pytest.approx(single["losses"], rel=LOSS_RTOL)
    assert m["losses"][-1] < m["losses"][0]
    per_step = m["bytes_per_step"][0]
    if kw["strategy"] in ("tp", "torch-tp"):  # exactly the planner's count (the per-block test pins it to the
        tokens = 8 * models.MODEL_PRESETS["gpt-tiny"].block_size  # paper's); torch's DTensor collectives counted too
        assert per_step == planner.tp_comm_bytes(models.MODEL_PRESETS["gpt-tiny"], tokens, 2,
                                                 kw.get("sequence_parallel", False), micro_steps=kw.get("grad_accum", 1))
    if kw["strategy"] in ("fsdp+tp", "torch-fsdp+tp"):  # FSDP's all-gather / reduce-scatter over dp, TP's
        assert per_step == bench.expected_bytes("gpt-tiny", "fsdp+tp", 4)["by_op"]  # all-reduces over tp


def test_cli_defaults_and_bad_input(tmp_path):
    cfg = parse_args(["--strategy", "fsdp+tp", "--dp", "2", "--tp", "2"])
    assert cfg.world_size == 4 and cfg.tp == 2 and cfg.dp == 2
    assert parse_args(["--strategy", "tp", "--tp", "2", "--sequence-parallel"]).world_size == 2
    assert parse_args(["--strategy", "3d", "--pp", "2", "--tp", "2", "--dp", "2"]).world_size == 8
    out = str(tmp_path)
    with pytest.raises(ValueError, match="n_head=2 is not divisible by tp=4"):
        validate(TrainConfig(strategy="tp", world_size=4, tp=4, out=out))
    with pytest.raises(ValueError, match=r"dp x pp x tp = 2 x 1 x 2 ranks: use --world-size 4"):
        validate(TrainConfig(strategy="fsdp+tp", world_size=2, dp=2, tp=2, out=out))
    with pytest.raises(ValueError, match="length 15 is not divisible by tp=2"):
        validate(TrainConfig(strategy="tp", world_size=2, tp=2, seq_len=15, sequence_parallel=True, out=out))
