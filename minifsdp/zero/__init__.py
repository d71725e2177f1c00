"""ZeRO stages 1 and 2, FairScale style: ``from minifsdp.zero import OSS, ShardedDataParallel``.

Mirrors ``fairscale.optim.OSS`` and ``fairscale.nn.data_parallel.ShardedDataParallel``
(the ZeRO paper's stages 1 and 2, Rajbhandari et al. 2020). Read in this order:

* ``oss.py`` — stage 1: each rank keeps the optimizer state of the parameters
  it owns and steps only those; owners broadcast the updated parameters.
* ``sharded_dp.py`` — stage 2: backward reduces each gradient to its owner
  only, other ranks drop it; ``wrap_zero(model, stage)`` builds either stage.

Stage 3 (parameters sharded too) is ``minifsdp.fsdp``.
"""

from .oss import OSS, all_reduce_gradients, optimizer_state_bytes, partition_parameters
from .sharded_dp import ShardedDataParallel, bytes_per_step, reduce, wrap_zero

__all__ = ["OSS", "ShardedDataParallel", "wrap_zero", "partition_parameters", "all_reduce_gradients",
           "optimizer_state_bytes", "bytes_per_step", "reduce"]
