"""What lab 05's checks watch and launch: the library's scaler and byte logic (the tripwires), the
learner's sharded scaler step beside ``ShardedGradScaler``'s on N FSDP ranks, and one FSDP step per
precision policy under the tracer.

Workers for ``minifsdp.launch`` (module level, so that every rank imports them);
``lab05`` reads their results and says the verdicts. Read ``lab05.py`` first.
"""
from __future__ import annotations

import collections
import math
import types
from typing import Any, Callable

import torch

from .. import comm, data, dist, estimate, models, trace
from ..fsdp import FullyShardedDataParallel
from ..mixed_precision import GradScaler, MixedPrecision, ShardedGradScaler, unscale_grads_, update_scale
from .authorship import Wire

# ------------------------------------------------------------------ the library, per exercise
# torch's amp kernels are C functions: the static guard sees them by name, a Wire when they run.
TORCH_KERNELS = (torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_)


def _torch_scalers() -> tuple:
    """torch's own scalers and every Python method they define (a Wire follows only minifsdp's classes)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
    classes = (torch.amp.GradScaler, TorchSharded)
    methods = tuple(f for c in classes for f in vars(c).values() if isinstance(f, types.FunctionType))
    return classes + methods


# the loss scaler (exercise 2), the fp16 step (3) and the sharded step (4a): any gradient scaler
SCALER_LIBRARY = (GradScaler, ShardedGradScaler, unscale_grads_, update_scale, *_torch_scalers(), *TORCH_KERNELS)
# the fp16 step also must not hand the master copy to FSDP's own mixed precision
STEP_LIBRARY = (*SCALER_LIBRARY, FullyShardedDataParallel)
# bytes by policy (4b): the estimates that compute those bytes, the policy's own default logic, a measured run
BYTES_LIBRARY = (estimate.comm_bytes_per_step, estimate.paper_comm_bytes, estimate.param_bytes,
                 estimate.grad_bytes, comm.collective_bytes, MixedPrecision.effective_reduce_dtype.fget,
                 FullyShardedDataParallel, trace.Tracer)


# ------------------------------------------------------------------ exercise 4a: every rank skips the same step
SHARDED_STEPS = 10
SHARDED_INJECT = {3: "last", 7: "first", 8: "every"}   # step -> whose gradient shard gets an inf (a NaN at 7)
SHARDED_RULE = dict(init_scale=2.0**10, growth_interval=3)


def overflowing(step: int, n: int) -> set[int]:
    return {"last": {n - 1}, "first": {0}, "every": set(range(n))}.get(SHARDED_INJECT.get(step, ""), set())


def fsdp_tiny(mp: MixedPrecision | None = None) -> torch.nn.Module:
    """gpt-tiny under minifsdp's FSDP, a unit per Block (both FSDP exercises' model)."""
    from ..fsdp import ModuleWrapPolicy
    return FullyShardedDataParallel(models.build_model("gpt-tiny", seed=0),
                                    auto_wrap_policy=ModuleWrapPolicy({models.Block}), mixed_precision=mp)


def sharded_run(step_fn: Callable[..., Any] | None, scaler_cls: type | None) -> dict[str, Any]:
    """FSDP gpt-tiny, a scaled backward per step, an inf written into the planned ranks' shards;
    the step is the learner's (``step_fn``, under the scaler tripwire) or ``ShardedGradScaler``'s (None)."""
    n, r = dist.world_size(), dist.rank()
    model = fsdp_tiny()
    shard = list(model.parameters())            # this rank's fp32 master shards: what the optimizer steps
    opt = torch.optim.AdamW(shard, lr=1e-2)
    if step_fn:
        with Wire(*SCALER_LIBRARY):
            scaler = scaler_cls(**SHARDED_RULE)
    else:
        scaler = ShardedGradScaler(dist.device(), **SHARDED_RULE)
    found, stepped, scales = [], [], []
    for step in range(SHARDED_STEPS):
        x, y = data.get_batch(step, 4, 16, rank=r, world_size=n)
        scale = float(scaler.scale) if step_fn else scaler.get_scale()
        (models.lm_loss(model(x.to(dist.device())), y.to(dist.device())) * scale).backward()
        if r in overflowing(step, n):
            shard[0].grad[0] = math.nan if step == 7 else math.inf
        before = [p.detach().clone() for p in shard]
        if step_fn:
            with Wire(*SCALER_LIBRARY):
                found.append(bool(step_fn(shard, opt, scaler)))
            scales.append(float(scaler.scale))
        else:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        opt.zero_grad()
        stepped.append(not all(torch.equal(a, p) for a, p in zip(before, shard)))
    return {"found": found, "stepped": stepped, "scales": scales, "shard": [p.detach().cpu() for p in shard]}


def sharded_worker(step_fn: Callable[..., Any], scaler_cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """The learner's run, then the library's, on this rank (one launch for both)."""
    return sharded_run(step_fn, scaler_cls), sharded_run(None, None)


# ------------------------------------------------------------------ exercise 4b: bytes per step by policy
POLICIES = {"fp32": None, "bf16": MixedPrecision(torch.bfloat16, torch.bfloat16),
            "bf16, fp32 reduce": MixedPrecision(torch.bfloat16, torch.float32),
            "bf16 (reduce_dtype None)": MixedPrecision(param_dtype=torch.bfloat16)}


def fsdp_bytes(policies: dict[str, Any]) -> dict[str, Any]:
    """One FSDP step per policy (gpt-tiny, a unit per Block): measured bytes and each unit's gathers."""
    out: dict[str, Any] = {}
    for name, mp in policies.items():
        model = fsdp_tiny(mp)
        x, y = data.get_batch(0, 4, 16, rank=dist.rank(), world_size=dist.world_size())
        with trace.Tracer() as tracer:
            models.lm_loss(model(x.to(dist.device())), y.to(dist.device())).backward()
        out[name] = tracer.trace.bytes_by_op()
        gathers = collections.Counter((str(s.args.get("unit")), s.args["numel"]) for s in tracer.trace.comm_spans()
                                      if "all_gather" in s.name)
        out["units"] = sorted((numel, times) for (_, numel), times in gathers.items())  # (numel, gathers) per unit
    return out
