"""One count of bytes: what the tracer records, what bench expects and what estimate computes agree.

For every minifsdp strategy (ddp, zero1, zero2, fsdp FULL_SHARD / SHARD_GRAD_OP /
NO_SHARD / HYBRID_SHARD) at world sizes 2, 3 and 4, one training step of
gpt-tiny set up as ``python -m minifsdp.train`` does, in one launch per world
size. Exact: bytes are integers, and world size 3 pads every FSDP unit
(12,704 and 17,472 parameters are not multiples of 3). HYBRID_SHARD runs at 2
and 4 only: train.py lays it out as 2 x (N/2) ranks, so it needs an even world.
With ``--precision bf16`` DDP, ZeRO-1 and ZeRO-2 reduce bf16 gradients but
broadcast fp32 parameters and buffers: the same agreement, at 2 and 4 ranks.
"""

from __future__ import annotations

import pytest
import torch

from minifsdp import bench, estimate, launch, models
from minifsdp.train import TrainConfig, run_rank

SIDES = ("ddp", "zero1", "zero2", "fsdp@FULL_SHARD", "fsdp@SHARD_GRAD_OP", "fsdp@NO_SHARD", "fsdp@HYBRID_SHARD")


def _sides(world: int) -> list[str]:
    return [s for s in SIDES if world % 2 == 0 or s != "fsdp@HYBRID_SHARD"]


def _one_step_each(configs: list[TrainConfig]) -> list[dict[str, int]]:
    """On every rank: one training step per config; the bytes the tracer saw inside that step."""
    return [run_rank(cfg)["trace"].bytes_by_op(within="step") for cfg in configs]


def _by_hand(side: str, world: int, grad_dtype: torch.dtype | None = None) -> dict[str, int]:
    """estimate's formula, its inputs counted here from the model (no bench code)."""
    model = models.build_model("gpt-tiny")
    units, root = estimate.fsdp_unit_numels(model, (models.Block,))
    name, _, option = side.partition("@")
    strategy = option.lower() if name == "fsdp" else name
    out = estimate.comm_bytes_per_step(units, world, strategy, root_numel=root,
                                       buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                                       shard_size=world // 2 if option == "HYBRID_SHARD" else None,
                                       grad_dtype=grad_dtype)
    out.pop("total")
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tracer_bench_and_estimate_agree_for_every_strategy(world):
    configs = []
    for side in _sides(world):
        name, option = bench.Side.parse(side).name, bench.Side.parse(side).option
        configs.append(TrainConfig(strategy=name, sharding_strategy=option or "FULL_SHARD", world_size=world,
                                   model="gpt-tiny", steps=1, batch_size=world, quiet=True,
                                   track_memory=False, write_plots=False))
    per_rank = launch(_one_step_each, world, configs, timeout=180)
    for i, side in enumerate(_sides(world)):
        expected = bench.expected_bytes("gpt-tiny", side, world)
        assert _by_hand(side, world) == expected["by_op"], side
        assert sum(expected["by_op"].values()) == expected["total"]
        for rank, recorded in enumerate(per_rank):
            assert recorded[i] == expected["by_op"], (side, world, rank, recorded[i], expected["by_op"])


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_gradients_of_ddp_and_zero_are_predicted_to_the_byte(world):
    sides = ("ddp", "zero1", "zero2")
    configs = [TrainConfig(strategy=s, world_size=world, model="gpt-tiny", steps=1, batch_size=world, quiet=True,
                           track_memory=False, write_plots=False, precision="bf16") for s in sides]
    per_rank = launch(_one_step_each, world, configs, timeout=180)
    for i, side in enumerate(sides):
        expected = bench.expected_bytes("gpt-tiny", side + "%bf16", world)
        assert _by_hand(side, world, grad_dtype=torch.bfloat16) == expected["by_op"], side
        fp32 = _by_hand(side, world)
        reduced = "reduce" if side == "zero2" else "all_reduce"
        assert expected["by_op"][reduced] * 2 == fp32[reduced], side  # the gradients' bytes halve
        assert expected["by_op"]["broadcast"] == fp32["broadcast"], side  # fp32 parameters and buffers
        for rank, recorded in enumerate(per_rank):
            assert recorded[i] == expected["by_op"], (side, world, rank, recorded[i], expected["by_op"])


def test_fp16_scaler_found_inf_flag_is_counted():
    """fp16 adds the gradient scaler. Where gradients are sharded (zero2, fsdp) every rank saw only its part, so
    ShardedGradScaler all-reduces the found-inf flag: one fp32 per step, 8 B in the all-reduce's 2x convention.
    DDP's gradients are whole on every rank: its GradScaler moves nothing."""
    sides = ("ddp", "zero2", "fsdp@FULL_SHARD")
    configs = [TrainConfig(strategy=bench.Side.parse(s).name, world_size=2, model="gpt-tiny", steps=1, batch_size=2,
                           quiet=True, track_memory=False, write_plots=False, precision="fp16") for s in sides]
    per_rank = launch(_one_step_each, 2, configs, timeout=180)
    for i, side in enumerate(sides):
        expected = bench.expected_bytes("gpt-tiny", side + "%fp16", 2)
        if side == "fsdp@FULL_SHARD":  # gathers and reduce-scatters fp16; all-reduces only the flag
            assert expected["by_op"]["all_reduce"] == 8
        else:  # fp32 parameters, fp16 gradients (as bf16's test) + the flag where gradients are sharded
            by_hand = _by_hand(side, 2, grad_dtype=torch.float16)
            if side == "zero2":
                by_hand["all_reduce"] = 8
            assert expected["by_op"] == by_hand, side
        for rank, recorded in enumerate(per_rank):
            assert recorded[i] == expected["by_op"], (side, rank, recorded[i], expected["by_op"])
