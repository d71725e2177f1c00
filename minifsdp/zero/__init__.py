"""ZeRO stages 1 and 2, FairScale style: ``from minifsdp.zero import OSS, ShardedDataParallel``.

Mirrors ``fairscale.optim.OSS`` and ``fairscale.nn.data_parallel.ShardedDataParallel``
(the ZeRO paper's stages 1 and 2, Rajbhandari et al. 2020), and
``torch.distributed.optim.ZeroRedundancyOptimizer`` under torch's name.
Read ``ddp/`` first (what is being sharded), then in this order:

* ``oss.py`` — stage 1: each rank keeps the optimizer state of the parameters
  it owns and steps only those; owners broadcast the updated parameters.
* ``sharded_dp.py`` — stage 2: backward reduces each gradient to its owner
  only, other ranks drop it; ``wrap_zero(model, stage)`` builds either stage.
* ``zero_redundancy.py`` — ``ZeroRedundancyOptimizer``: torch's signature on ``OSS``.

Stage 3 (parameters sharded too) is ``minifsdp.fsdp``. Bytes per step:
``estimate.comm_bytes_per_step(n_params, N, "zero1" | "zero2")``.
"""

from .oss import OSS, all_reduce_gradients, local_state_bytes, partition_parameters
from .sharded_dp import ShardedDataParallel, reduce, wrap_zero
from .zero_redundancy import ZeroRedundancyOptimizer

__all__ = ["OSS", "ShardedDataParallel", "ZeroRedundancyOptimizer", "wrap_zero", "partition_parameters",
           "all_reduce_gradients", "local_state_bytes", "reduce"]
