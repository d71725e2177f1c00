"""Every --strategy is one record: what each claims, its layout from the CLI's flags, and the Layout's rules."""

import pytest

from minifsdp.layout import Layout
from minifsdp.train import STRATEGIES, parse_args

# name -> (degrees, implementation, policy_cast, sharded_grads, own_train_step, checkpoints_split_blocks)
CLAIMS = {
    "single": ((), "minifsdp", False, False, False, False),
    "ddp-naive": (("dp",), "minifsdp", False, False, False, False),
    "ddp": (("dp",), "minifsdp", False, False, False, False),
    "zero1": (("dp",), "minifsdp", False, False, False, False),
    "zero2": (("dp",), "minifsdp", False, True, False, False),
    "fsdp": (("dp",), "minifsdp", True, True, False, False),
    "fsdp2": (("dp",), "minifsdp", True, True, False, False),
    "pp": (("pp",), "minifsdp", False, False, True, False),
    "pp+dp": (("pp", "dp"), "minifsdp", False, False, True, False),
    "tp": (("tp",), "minifsdp", False, True, False, True),
    "fsdp+tp": (("dp", "tp"), "minifsdp", True, True, False, True),
    "3d": (("dp", "pp", "tp"), "minifsdp", False, False, True, True),
    "cp": (("dp", "cp"), "minifsdp", False, False, False, False),
    "ep": (("dp", "ep"), "minifsdp", False, True, False, False),
    "torch-ddp": (("dp",), "torch", False, False, False, False),
    "torch-zero1": (("dp",), "torch", False, False, False, False),
    "torch-fsdp": (("dp",), "torch", True, True, False, False),
    "torch-fsdp2": (("dp",), "torch", True, True, False, False),
    "torch-pp": (("pp",), "torch", False, False, True, False),
    "torch-tp": (("tp",), "torch", False, False, True, True),
    "torch-fsdp+tp": (("dp", "tp"), "torch", True, False, True, True),
}

# CLI flags -> the world size the record's layout runs
CLI = [
    (["--strategy", "single"], 1), (["--strategy", "ddp", "--world-size", "4"], 4),
    (["--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--world-size", "4"], 4),
    (["--strategy", "fsdp2", "--sharding-strategy", "HYBRID_SHARD", "--world-size", "4"], 4),
    (["--strategy", "pp", "--pp", "4"], 4), (["--strategy", "pp+dp", "--pp", "2", "--dp", "2"], 4),
    (["--strategy", "torch-pp", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"], 2),
    (["--strategy", "tp", "--tp", "2"], 2), (["--strategy", "fsdp+tp", "--dp", "2", "--tp", "2"], 4),
    (["--strategy", "torch-fsdp+tp", "--dp", "2", "--tp", "2"], 4),
    (["--strategy", "3d", "--pp", "2", "--tp", "2", "--dp", "2"], 8),
    (["--strategy", "cp"], 2), (["--strategy", "cp", "--cp", "4"], 4), (["--strategy", "cp", "--cp", "2", "--dp", "2"], 4),
    (["--strategy", "ep", "--model", "gpt-moe-tiny"], 2), (["--strategy", "ep", "--ep", "4"], 4),
    (["--strategy", "ep", "--ep", "2", "--world-size", "4"], 4),
]


def test_every_record_claims_what_it_composes():
    assert set(STRATEGIES) == set(CLAIMS)
    for name, record in STRATEGIES.items():
        got = (record.degrees, record.implementation, record.policy_cast, record.sharded_grads,
               record.own_train_step, record.checkpoints_split_blocks)
        assert got == CLAIMS[name], name
        assert record.takes_precision == (name not in ("ddp-naive", "cp", "ep")), name
        assert (record.expected_bytes is not None) == (name in ("ddp-naive", "ddp", "zero1", "zero2", "fsdp", "fsdp2",
                                                                "pp", "tp", "fsdp+tp", "cp", "ep")), name


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_every_record_builds_its_layout_from_the_cli_defaults(name):
    cfg = parse_args(["--strategy", name])
    layout = STRATEGIES[name].layout(cfg)
    layout.validate(cfg.world_size)
    assert layout.world_size == cfg.world_size


@pytest.mark.parametrize("argv,world", CLI)
def test_layout_world_size_from_the_cli(argv, world):
    cfg = parse_args(argv)
    layout = STRATEGIES[cfg.strategy].layout(cfg)
    assert cfg.world_size == layout.world_size == world
    if "HYBRID_SHARD" in argv:
        assert (layout.dp_replicate, layout.dp_shard) == (2, 2)
    if "--virtual-stages" in argv:
        assert layout.stages == 4
    if cfg.strategy in ("cp", "ep"):  # cp: a factor of the world (x --dp); ep: inside dp (dp = --world-size)
        assert (layout.cp, layout.ep) == ((cfg.cp, 1) if cfg.strategy == "cp" else (1, cfg.ep))
        assert layout.dp == (cfg.dp if cfg.strategy == "cp" else cfg.world_size)


def test_layout_rules_and_one_line_errors():
    assert Layout.hybrid(2).shard_size == 1 and Layout.hybrid(2).dp_replicate == 2  # 2 x (N/2) at N = 2
    assert Layout(dp=2, pp=2, tp=2).mesh_degrees() == {"dp": 2, "pp": 2, "tp": 2}
    assert Layout.hybrid(4).mesh_degrees() == {"dp": 4, "pp": 1, "tp": 1, "dp_shard": 2}
    with pytest.raises(ValueError, match="use an even --world-size, got 3"):
        Layout.hybrid(3).validate()
    with pytest.raises(ValueError, match=r"dp x pp x tp = 2 x 1 x 2 ranks: use --world-size 4 \(got 2\)"):
        Layout(dp=2, tp=2).validate(2)
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        Layout(tp=0).validate()
    # cp and ep: cp a factor of the world, ep inside dp (it divides dp), data parallel their only partner
    assert Layout(dp=2, cp=2).mesh_degrees() == {"dp": 2, "pp": 1, "tp": 1, "cp": 2}
    assert Layout(dp=4, ep=2).world_size == 4 and Layout(dp=4, ep=2).mesh_degrees()["ep"] == 2
    with pytest.raises(ValueError, match=r"--ep 4 must divide the data-parallel degree 2 .* use --world-size a "
                                         "multiple of 4"):
        Layout(dp=2, ep=4).validate()
    with pytest.raises(ValueError, match=r"context parallel composes with data parallel only .* use --pp 1 --tp 1"):
        Layout(cp=2, tp=2).validate()
    with pytest.raises(ValueError, match=r"expert parallel composes with data parallel only"):
        Layout(dp=2, ep=2, pp=2).validate()
    with pytest.raises(ValueError, match=r"dp x pp x tp x cp = 1 x 1 x 1 x 2 ranks: use --world-size 2 \(got 4\)"):
        Layout(cp=2).validate(4)
    with pytest.raises(ValueError, match="4 x 2 stages but gpt-tiny has 4 layers"):
        Layout(pp=4, virtual_stages=2).validate(n_layers=4, model="gpt-tiny")
