"""torch's import path ``torch.distributed.fsdp.fully_sharded_data_parallel``, re-exported.

Code that imports from the module rather than the package runs unchanged::

    from minifsdp.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel, ShardingStrategy

Nothing is defined here: the class is in ``fully_sharded.py`` (read that), the
options in ``api.py``.
"""

from .api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig,
                  LocalStateDictConfig, MixedPrecision, OptimStateDictConfig, ShardedOptimStateDictConfig,
                  ShardedStateDictConfig, ShardingStrategy, StateDictConfig, StateDictSettings, StateDictType)
from .fully_sharded import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload",
           "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig",
           "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "LocalOptimStateDictConfig", "StateDictSettings"]
