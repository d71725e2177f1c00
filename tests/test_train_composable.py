"""--precision, --autocast and --checkpoint compose with tensor parallel and with torch's references.

The parity contract of tests/test_mixed_precision_train.py (its runs, its fp32
`--strategy single` reference and its tolerances, imported, not copied): gpt-tiny,
4 AdamW steps, global batch 8 x 32 tokens.

* fp32 + activation checkpointing is exact (rel 1e-5, as tests/test_train.py): the
  recompute repeats the same fp32 ops. tp and fsdp+tp checkpoint their split blocks
  (ParallelBlock), so the recompute also repeats each block's two row-parallel
  all-reduces: the bytes show it, exactly as bench.expected_bytes predicts.
* bf16 stays within one bf16 ulp of the fp32 losses (TOL["bf16"] = 2**-8; measured
  here 4e-5 to 6e-5 relative): tp under autocast, fsdp+tp with FSDP's MixedPrecision
  policy, torch-ddp with autocast and torch's bf16 compression comm hook, torch-fsdp2
  with MixedPrecisionPolicy, torch's 2D recipe (torch-fsdp+tp). torch's bf16 runs also
  equal minifsdp's (ddp, fsdp) to rel 1e-5: the same casts, sums and reduce dtype.
  Their bytes equal bench.expected_bytes: under autocast TP's forward all-reduces are bf16
  (the row-parallel outputs) and the backward ones fp32.
"""
from __future__ import annotations

import pytest
import torch
from train_helpers import TOL, fp32_single  # noqa: F401  (fp32_single: a fixture)
from train_helpers import run_metrics as _metrics

from minifsdp import bench
from minifsdp.train import TrainConfig, validate

EXACT = 1e-5  # fp32, reductions in another order across ranks (tests/test_train.py)
SAME_ALGORITHM = 1e-5  # minifsdp vs torch, both bf16 with the same casts and reduce dtype (equal to the digit here)
TP_WORLD = {"tp": {"world_size": 2, "tp": 2}, "fsdp+tp": {"world_size": 4, "dp": 2, "tp": 2}}


@pytest.mark.parametrize("strategy", ["tp", "fsdp+tp"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_tensor_parallel_checkpointing_is_exact(tmp_path, fp32_single, strategy, mode):
    m = _metrics(tmp_path, strategy, checkpoint=mode, **TP_WORLD[strategy])
    assert m["losses"] == pytest.approx(fp32_single, rel=EXACT)
    # the split blocks really were recomputed: their forward all-reduces ran twice per step
    world = TP_WORLD[strategy]["world_size"]
    expected = bench.expected_bytes("gpt-tiny", f"{strategy}#{mode}", world)
    assert m["bytes_per_step"][0] == expected["by_op"]
    assert expected["total"] > bench.expected_bytes("gpt-tiny", strategy, world)["total"]


def _fsdp_moved_bf16(metrics):
    """FSDP's parameters gathered and gradients reduce-scattered in bf16: half of fp32's expected bytes."""
    fp32 = bench.expected_bytes("gpt-tiny", "fsdp+tp", 4)["by_op"]
    moved = metrics["bytes_per_step"][0]
    return moved["all_gather"] * 2 == fp32["all_gather"] and moved["reduce_scatter"] * 2 == fp32["reduce_scatter"]


@pytest.mark.parametrize("strategy", ["tp", "fsdp+tp"])
def test_bf16_tracks_fp32_single(tmp_path, fp32_single, strategy):
    m = _metrics(tmp_path, strategy, "bf16", **TP_WORLD[strategy])
    torch.testing.assert_close(m["losses"], fp32_single, atol=0, rtol=TOL["bf16"])
    assert m["losses"] != fp32_single, "it did not compute in bf16"
    assert m["losses"][-1] < m["losses"][0]
    assert strategy == "tp" or _fsdp_moved_bf16(m)
    # tp (autocast): forward row-parallel all-reduces in bf16, backward ones and the loss's fp32 (gpt-tiny:
    # 530,432 B vs 661,504 fp32); fsdp+tp (FSDP's policy): all but the loss's bf16 (166,912 vs 330,752)
    expected = bench.expected_bytes("gpt-tiny", f"{strategy}%bf16", TP_WORLD[strategy]["world_size"])
    assert m["bytes_per_step"][0] == expected["by_op"]


def test_tp_bf16_checkpoint_recomputes_in_bf16(tmp_path, fp32_single):
    """--checkpoint full re-runs each block's forward up to its last saved tensor: one more bf16
    all-reduce per block (gpt-tiny tp2: 595,968 B = 530,432 + 2 blocks x 256 tokens x 32 x 2 B x 2)."""
    m = _metrics(tmp_path, "tp", "bf16", checkpoint="full", **TP_WORLD["tp"])
    torch.testing.assert_close(m["losses"], fp32_single, atol=0, rtol=TOL["bf16"])
    expected = bench.expected_bytes("gpt-tiny", "tp#full%bf16", 2)
    assert m["bytes_per_step"][0] == expected["by_op"]
    assert expected["total"] - bench.expected_bytes("gpt-tiny", "tp%bf16", 2)["total"] == 2 * 256 * 32 * 2 * 2


@pytest.mark.parametrize("ours,theirs", [("ddp", "torch-ddp"), ("fsdp", "torch-fsdp2"), ("fsdp2", "torch-fsdp2")])
def test_torchs_bf16_tracks_fp32_single_and_equals_ours(tmp_path, fp32_single, ours, theirs):
    mine, torchs = _metrics(tmp_path, ours, "bf16"), _metrics(tmp_path, theirs, "bf16")
    torch.testing.assert_close(torchs["losses"], fp32_single, atol=0, rtol=TOL["bf16"])
    assert torchs["losses"] != fp32_single, "torch's side did not compute in bf16"
    assert mine["losses"] == pytest.approx(torchs["losses"], rel=SAME_ALGORITHM)
    # torch's 16-bit traffic is counted (its comm hook, FSDP2's collectives): the same bytes as ours
    assert mine["bytes_per_step"][0] == torchs["bytes_per_step"][0]
    if ours == "ddp":  # the gradients all-reduced in bf16: 2 bytes x Ψ, volume 2x
        assert torchs["bytes_per_step"][0]["all_reduce"] == 2 * 2 * torchs["n_params"]


def test_torch_2d_recipe_composes(tmp_path, fp32_single):
    """torch-fsdp+tp in torchtitan's order: DTensor TP, torch's checkpoint_wrapper per block, then
    fully_shard with MixedPrecisionPolicy(bf16); loss and backward under loss_parallel."""
    m = _metrics(tmp_path, "torch-fsdp+tp", "bf16", checkpoint="selective", **TP_WORLD["fsdp+tp"])
    torch.testing.assert_close(m["losses"], fp32_single, atol=0, rtol=TOL["bf16"])
    assert m["losses"] != fp32_single
    assert _fsdp_moved_bf16(m)  # torch's collectives are counted (torch_reference.count_collectives)


def test_bench_sides_and_remaining_refusals(tmp_path):
    out = str(tmp_path)
    for pair in ("tp#full:torch-tp#full", "ddp%bf16:torch-ddp%bf16", "fsdp%bf16:torch-fsdp2%bf16",
                 "fsdp+tp#selective%bf16:torch-fsdp+tp#selective%bf16", *bench.PRESETS["precision"],
                 *bench.PRESETS["checkpoint"]):
        for side in bench.parse_pair(pair):  # gpt-tiny's 2 heads: tp = 2, so world size 2
            validate(bench._config(bench.BenchConfig(model="gpt-tiny"), side, 2, False, 2, out))
    cfg = bench._config(bench.BenchConfig(model="gpt-tiny"), "fsdp+tp#selective%bf16", 4, False, 2, out)
    assert (cfg.strategy, cfg.dp, cfg.tp, cfg.checkpoint, cfg.precision) == ("fsdp+tp", 2, 2, "selective", "bf16")
    validate(cfg)
    cfg = bench._config(bench.BenchConfig(), "torch-tp%autocast#full", 2, False, 2, out)
    assert (cfg.strategy, cfg.tp, cfg.checkpoint, cfg.precision, cfg.autocast) == ("torch-tp", 2, "full", "fp32", True)
    # under autocast only TP's forward all-reduces are 16-bit: 2L N h 2 B less each (N = 8 x 32 / dp, L = 2, h = 32)
    assert bench.expected_bytes("gpt-tiny", "tp", 2)["total"] - bench.expected_bytes(
        "gpt-tiny", "tp%autocast", 2)["total"] == 4 * 2 * 256 * 32 * 2
    by_op = bench.expected_bytes("gpt-tiny", "fsdp+tp%autocast", 4)["by_op"]
    assert by_op == {**bench.expected_bytes("gpt-tiny", "fsdp+tp", 4)["by_op"], "all_reduce": 265216}
    # what is still refused says why and what to use instead
    with pytest.raises(ValueError, match="without loss scaling, which fp16 needs: use --precision bf16"):
        validate(TrainConfig(strategy="torch-tp", world_size=2, tp=2, precision="fp16", out=out))
    for kw in TP_WORLD.values():  # refused before
        validate(TrainConfig(strategy="fsdp+tp" if "dp" in kw else "tp", checkpoint="selective", precision="fp16",
                             out=out, **kw))
