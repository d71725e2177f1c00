"""What the trainer's precision tests share (test_mixed_precision_train.py, test_train_composable.py):
the tolerances, one run's metrics, and fp32 single's losses, the parity contract's reference."""
from __future__ import annotations

import pytest

from minifsdp.train import TrainConfig, train

TOL = {"bf16": 2.0**-8, "fp16": 2.0**-11}   # one ulp of each 16-bit format, relative per step's loss


def run_metrics(tmp_path, strategy, precision="fp32", world_size=None, **kw) -> dict:
    """gpt-tiny, 4 steps, global batch 8 x 32 tokens: ``strategy``'s metrics.json (2 ranks unless single)."""
    world_size = world_size or (1 if strategy == "single" else 2)
    cfg = TrainConfig(strategy=strategy, world_size=world_size, model="gpt-tiny", steps=4,
                      batch_size=8, seq_len=32, lr=3e-3, precision=precision, out=str(tmp_path / strategy),
                      quiet=True, track_memory=False, write_plots=False, timeout=180, **kw)
    return train(cfg)


@pytest.fixture(scope="module")
def fp32_single(tmp_path_factory):
    """``--strategy single`` in fp32: the losses every strategy must reproduce."""
    return run_metrics(tmp_path_factory.mktemp("single"), "single")["losses"]


# ---------------------------------------------------------------- several trainer runs in one launch
import sys  # noqa: E402

import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _run_ranks(cfgs):
    from minifsdp.train import run_rank

    return [run_rank(cfg) for cfg in cfgs]


def train_in_one_launch(cfgs, world_size, timeout=300) -> list[dict]:
    """``train(cfg)`` for every cfg (all at ``world_size`` ranks), their ranks started once: each rank runs
    the trainer's loop (``run_rank``) for one cfg after the other, and each cfg's metrics are written as
    ``train`` writes them (``write_outputs``). Launches cost seconds on 2 cores; the runs share them."""
    from minifsdp.launch import launch
    from minifsdp.train import validate, write_outputs

    for cfg in cfgs:
        assert cfg.world_size == world_size, cfg
        validate(cfg)
    per_rank = launch(_run_ranks, world_size, cfgs, timeout=timeout)
    return [write_outputs(cfg, [ranks[i] for ranks in per_rank]) for i, cfg in enumerate(cfgs)]
