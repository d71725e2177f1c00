"""``ShardedGradScaler`` at torch's import path (``torch.distributed.fsdp.sharded_grad_scaler``).

    from minifsdp.fsdp.sharded_grad_scaler import ShardedGradScaler

The scaler itself, and why sharded gradients need the found-inf flag
all-reduced, is in ``minifsdp/mixed_precision/grad_scaler.py``.
"""
from ..mixed_precision.grad_scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler"]
