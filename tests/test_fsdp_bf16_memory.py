"""bf16 FSDP holds no memory torch's FSDP1 does not: its peak is within 2 % of torch's (``PEAK_MARGIN``).

The extra memory was the bf16 copy of the shard that an all-gather reads: it
stayed alive while a prefetched gather was in flight (one bf16 shard of a block
during backward). The shard is now cast straight into its own slot of the
unsharded tensor and gathered in place (``FlatParamHandle.unshard``, as torch's
FSDP2). (``reduce_grad``'s ``finish`` also drops the finished reduce-scatter's
work object, which may hold the unit's full bf16 gradient, before the fp32 copy
of the reduced shard is made; what gloo's worker thread allocates meanwhile
depends on timing, so that step is checked for values, not bytes.)

Measured by ``minifsdp.memory.MemoryTracker`` (exact byte counts), at 2 ranks:
each step's growth to the byte, the values it produced, and the whole
trainer's peak beside torch FSDP1's with torch's ``MixedPrecision``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp import launch
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import MixedPrecision
from minifsdp.memory import MemoryTracker
from minifsdp.train import TrainConfig, run_rank

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)


def _gather_and_reduce() -> dict:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 7)), mixed_precision=BF16)  # 1927: padded
    h = model._handles[0]
    rank = torch.distributed.get_rank()
    want = h.gather_full().to(torch.bfloat16)  # fp32 gather, then cast: what the bf16 gather must give
    out: dict = {"padded": h.padded_numel, "shard": h.shard_numel}
    tracker = MemoryTracker()
    tracker.track_model(model)  # the fp32 shard is booked before, not counted as growth
    with tracker:
        base = tracker.total()
        tracker.reset_peak()
        h.unshard(async_op=True)  # as a prefetch: the gather stays in flight
        h.wait()
        out["gather_growth"] = tracker.peak_total - base
        out["gathered_equal"] = torch.equal(h._full.detach(), want)
        h.reshard()

        h._full.grad = torch.full((h.padded_numel,), float(rank + 1), dtype=torch.bfloat16)  # ranks 1 and 2
        finish = h.reduce_grad(dp_size=2)  # the reduce-scatter runs async; finish() stores the fp32 shard
        finish()
    grad = h.flat_param.grad
    out["grad"] = (grad.dtype, grad.numel(), torch.equal(grad, torch.full_like(grad, 1.5)))
    return out


def test_bf16_shard_is_gathered_in_place_and_gradient_reaches_the_optimizer_in_fp32():
    for r in launch(_gather_and_reduce, 2, timeout=120):
        padded, shard = r["padded"], r["shard"]
        assert r["gathered_equal"]
        # only the unsharded bf16 tensor: no separate bf16 copy of the shard (+ 2 x shard bytes before)
        assert r["gather_growth"] == padded * 2, (r["gather_growth"], padded * 2)
        assert r["grad"] == (torch.float32, shard, True)  # the mean of 1 and 2, in fp32 for the optimizer


def _peaks(configs: list[TrainConfig]) -> list[int]:
    return [run_rank(cfg)["memory"]["peak_total"] for cfg in configs]


# Ours may exceed torch FSDP1's peak by at most this factor. Not "<=": torch's exact peak moves between
# releases (its bookkeeping tensors, the order it frees in), which is no fault of ours. The bug this file
# guards against, a separate bf16 copy of the shard, is checked to the byte by the test above; this one
# keeps the whole trainer's peak at torch's level.
PEAK_MARGIN = 1.02


def test_bf16_fsdp_peak_within_a_margin_of_torch_fsdp1():
    configs = [TrainConfig(strategy=s, world_size=2, model="gpt-tiny", steps=2, precision="bf16", quiet=True,
                           write_plots=False) for s in ("fsdp", "torch-fsdp")]
    for ours, torch_fsdp1 in launch(_peaks, 2, configs, timeout=180):
        assert ours <= PEAK_MARGIN * torch_fsdp1, f"peak {ours:,} B > {PEAK_MARGIN} x torch FSDP1's {torch_fsdp1:,} B"
