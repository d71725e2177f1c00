"""The trainer's --precision and --autocast keep the parity contract (metrics.json losses).

gpt-tiny, 4 steps, global batch 8 x 32 tokens of text, 2 ranks, against
`--strategy single` in fp32 (the contract's reference). Tolerances, relative per
step's loss: bf16 2**-8 (one bf16 ulp: the loss moves by less than bf16's grid step),
fp16 2**-11 (one fp16 ulp; the gradient scaler is on). fp32 stays exact as before
(tests/test_train.py). FSDP casts its parameters (a MixedPrecision policy); DDP and
ZeRO compute under autocast and reduce their gradients in the low dtype; torch's FSDP1
with the same policy is the external reference.
"""
from __future__ import annotations

import pytest
import torch

from minifsdp.train import TrainConfig, parse_args, validate
from train_helpers import TOL, fp32_single  # noqa: F401  (fp32_single: a fixture)
from train_helpers import run_metrics as _metrics


def _run(tmp_path, strategy, precision="fp32", **kw):
    return _metrics(tmp_path, strategy, precision, **kw)["losses"]


@pytest.mark.parametrize("strategy, precision", [("fsdp", "bf16"), ("fsdp", "fp16"), ("ddp", "bf16"),
                                                 ("zero2", "fp16"), ("torch-fsdp", "bf16"), ("fsdp2", "fp16")])
def test_precision_tracks_fp32_single(tmp_path, fp32_single, strategy, precision):
    losses = _run(tmp_path, strategy, precision)
    torch.testing.assert_close(losses, fp32_single, atol=0, rtol=TOL[precision])
    assert losses != fp32_single, "it did not compute in low precision"
    assert losses[-1] < losses[0]


def test_autocast_flag_on_fsdp_fp32(tmp_path, fp32_single):
    losses = _run(tmp_path, "fsdp", autocast=True)
    torch.testing.assert_close(losses, fp32_single, atol=0, rtol=TOL["bf16"])


def test_cli_and_bad_input():
    cfg = parse_args(["--strategy", "fsdp", "--precision", "bf16", "--autocast"])
    assert (cfg.precision, cfg.autocast) == ("bf16", True)
    with pytest.raises(ValueError, match="--precision/--autocast are not wired into --strategy ddp-naive"):
        validate(TrainConfig(strategy="ddp-naive", world_size=2, precision="bf16", out="/tmp"))
    with pytest.raises(ValueError, match="--precision must be one of"):
        validate(TrainConfig(strategy="fsdp", world_size=2, precision="fp8", out="/tmp"))
