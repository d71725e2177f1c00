"""minifsdp.mixed_precision: the precision policy and the gradient scaler.

Mirrors ``torch.distributed.fsdp.MixedPrecision``, ``torch.amp.GradScaler`` and
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``::

    from minifsdp.mixed_precision import MixedPrecision, ShardedGradScaler
    model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    scaler = ShardedGradScaler()
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()

Read ``policy.py`` first (number formats, casting vs autocast), then
``grad_scaler.py`` (loss scaling, the found-inf flag shared by all ranks).
"""
from .grad_scaler import GradScaler, OptState, ShardedGradScaler, unscale_grads_, update_scale
from .policy import (LOW_PRECISION, PRECISIONS, MixedPrecision, autocast, autocast_dtype, cast_floating,
                     check_dtype_supported, format_info, format_table, from_fairscale, keep_fp32,
                     needs_loss_scaling, policy_for, resolve)

__all__ = ["MixedPrecision", "GradScaler", "ShardedGradScaler", "OptState", "unscale_grads_", "update_scale",
           "LOW_PRECISION", "PRECISIONS", "autocast", "autocast_dtype", "cast_floating", "check_dtype_supported",
           "format_info", "format_table", "from_fairscale", "keep_fp32", "needs_loss_scaling", "policy_for",
           "resolve"]
