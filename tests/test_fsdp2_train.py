"""--strategy fsdp2 (minifsdp's ``fully_shard``): bytes to the byte, losses at an uneven world, padding.

* Bytes: the tracer's count of a real fsdp2 run, on every rank, equals
  ``estimate.fully_shard_comm_bytes`` (the record's ``expected_bytes``, what bench prints as
  *expected*), and that formula equals a count by hand from the parameter shapes:
  N·ceil(d0/N)·(numel/d0) elements per parameter per all-gather. At world sizes 2 and 3,
  FULL_SHARD and SHARD_GRAD_OP, fp32 and bf16, gradient accumulation (2 micro-batches, the
  sync on the last one only); HYBRID_SHARD at 4 (2 x 2). World size 3 pads: gpt-tiny's
  32-, 128- and 256-row tensors do not split in 3. torch's fully_shard at 3 moves the same.
* Losses: every one of those runs reproduces ``--strategy single`` (fp32 rel 1e-5, bf16 one
  bf16 ulp), the uneven world size included.
* Padding: per parameter (FSDP2) at most N - 1 rows of each parameter, per flat unit (FSDP1)
  at most N - 1 elements of each unit; gpt-tiny at N = 3 printed side by side.

One launch per world size, each run 2 steps of gpt-tiny on a global batch of 12.
"""
from __future__ import annotations

import math

import pytest

from minifsdp import bench, estimate, launch, models
from minifsdp.strategies import STRATEGIES
from minifsdp.train import TrainConfig, run_rank, train

STEPS, BATCH = 2, 12  # 12 sequences split evenly at 2, 3 and 4 ranks, and into 2 micro-batches at 2 and 3
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2.0**-8}  # tests/test_train.py; one bf16 ulp (tests/train_helpers.py)

# label -> the trainer's flags
CASES = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"sharding_strategy": "SHARD_GRAD_OP"},
    "FULL_SHARD%bf16": {"precision": "bf16"},
    "SHARD_GRAD_OP%bf16": {"sharding_strategy": "SHARD_GRAD_OP", "precision": "bf16"},
    "FULL_SHARD grad-accum 2": {"grad_accum": 2},
}
HYBRID_CASES = {"HYBRID_SHARD": {"sharding_strategy": "HYBRID_SHARD"},
                "HYBRID_SHARD%bf16": {"sharding_strategy": "HYBRID_SHARD", "precision": "bf16"}}


def _cases(world: int) -> dict[str, dict]:
    return HYBRID_CASES if world == 4 else CASES


def _config(strategy: str, world: int, **flags) -> TrainConfig:
    return TrainConfig(strategy=strategy, world_size=world, model="gpt-tiny", steps=STEPS, batch_size=BATCH,
                       quiet=True, track_memory=False, write_plots=False, **flags)


def _runs(configs: list[TrainConfig]) -> list[dict]:
    """On every rank: each config's bytes per step (the tracer's, inside the steps) and its losses."""
    out = []
    for cfg in configs:
        r = run_rank(cfg)
        moved = r["trace"].bytes_by_op(within="step")
        out.append({"bytes": {op: b // cfg.steps for op, b in moved.items()}, "losses": r["losses"]})
    return out


def _by_hand(world: int, elem: int, reshard_blocks: bool, shard: int | None = None, micro: int = 1) -> dict[str, int]:
    """The per-parameter count from gpt-tiny's shapes, written out here (no estimate code)."""
    model = models.build_model("gpt-tiny")
    s = shard or world
    blocks = [sum(s * math.ceil(p.shape[0] / s) * (p.numel() // p.shape[0]) for p in b.parameters())
              for b in model.blocks]
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = sum(s * math.ceil(p.shape[0] / s) * (p.numel() // p.shape[0])
               for p in model.parameters() if id(p) not in in_blocks)
    gathered = sum(blocks) + root + (sum(blocks) if reshard_blocks else 0)  # the root is kept for backward
    out = {"all_gather": micro * gathered * elem, "reduce_scatter": (sum(blocks) + root) * elem} if s > 1 else {}
    if world // s > 1:
        out["all_reduce"] = 2 * (sum(blocks) + root) // s * elem
    return out


def _expected(cfg: TrainConfig) -> dict:
    """fsdp2's record's expected bytes (``estimate.fully_shard_comm_bytes``) for this config."""
    record = STRATEGIES[cfg.strategy]
    return record.expected_bytes(cfg, record.layout(cfg))


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    return train(_config("single", 1, out=str(tmp_path_factory.mktemp("single"))))["losses"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_bytes_equal_the_per_parameter_formula_on_every_rank(world, single_losses):
    cases = _cases(world)
    configs = [_config("fsdp2", world, **flags) for flags in cases.values()]
    if world == 3:  # torch's fully_shard pads the same way: its counted bytes equal the formula too
        configs.append(_config("torch-fsdp2", world))
    per_rank = launch(_runs, world, configs, timeout=240)
    for i, (label, flags) in enumerate(cases.items()):
        expected = _expected(configs[i])
        assert sum(expected["by_op"].values()) == expected["total"]
        if "grad_accum" not in flags:  # what bench prints beside the measured bytes
            assert bench.expected_bytes("gpt-tiny", f"fsdp2@{label}", world, BATCH) == expected
        precision = flags.get("precision", "fp32")
        by_hand = _by_hand(world, 2 if precision == "bf16" else 4, flags.get("sharding_strategy") != "SHARD_GRAD_OP",
                           shard=world // 2 if "HYBRID" in label else None, micro=flags.get("grad_accum", 1))
        assert expected["by_op"] == by_hand, (label, world)
        for rank, runs in enumerate(per_rank):
            assert runs[i]["bytes"] == expected["by_op"], (label, world, rank, runs[i]["bytes"])
            assert runs[i]["losses"] == per_rank[0][i]["losses"]  # every rank reports the global mean
        assert per_rank[0][i]["losses"] == pytest.approx(single_losses, rel=LOSS_RTOL[precision]), (label, world)
    if world == 3:
        torch_side = per_rank[0][len(cases)]
        assert torch_side["bytes"] == _expected(configs[0])["by_op"]
        assert torch_side["losses"] == pytest.approx(per_rank[0][0]["losses"], rel=LOSS_RTOL["fp32"])


def test_per_parameter_padding_beside_the_flat_units(capsys):
    """gpt-tiny at N = 3: a flat unit pads at most N - 1 elements, a parameter at most N - 1 of its rows."""
    n = 3
    model = models.build_model("gpt-tiny")
    groups, root = estimate.fully_shard_group_shapes(model, (models.Block,))
    units, root_numel = estimate.fsdp_unit_numels(model, (models.Block,))
    assert [sum(math.prod(s) for s in g) for g in (*groups, root)] == [*units, root_numel]
    lines = ["| group | parameters | flat unit (FSDP1): padded / padding | per parameter (FSDP2): padded / padding |",
             "|---|---|---|---|"]
    totals = {"flat": 0, "per_param": 0}
    for name, shapes, numel in zip(["blocks.0", "blocks.1", "root"], [*groups, root], [*units, root_numel]):
        flat = estimate.padded_numel(numel, n)
        assert flat - numel <= n - 1
        per_param = 0
        for shape in shapes:
            rows, row_numel = shape[0], math.prod(shape[1:])
            padded = estimate.fully_shard_padded_numel(shape, n)
            assert padded - math.prod(shape) == (n * math.ceil(rows / n) - rows) * row_numel  # whole rows
            assert padded - math.prod(shape) <= (n - 1) * row_numel
            per_param += padded
        totals["flat"] += flat - numel
        totals["per_param"] += per_param - numel
        lines.append(f"| {name} | {numel:,} | {flat:,} / {flat - numel} | {per_param:,} / {per_param - numel} |")
    print("\n".join(lines))
    # gpt-tiny's units: blocks 12,704 -> 12,705 flat but 12,903 per parameter; root 17,472 -> 17,472 and 17,634
    assert totals == {"flat": 2, "per_param": 2 * 199 + 162}
    assert "| blocks.0 | 12,704 | 12,705 / 1 | 12,903 / 199 |" in capsys.readouterr().out
