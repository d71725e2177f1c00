"""minifsdp.fsdp: fully sharded data parallel (ZeRO-3), mirroring ``torch.distributed.fsdp``.

Change the import and code written for PyTorch's FSDP1 runs here::

    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from minifsdp.fsdp.wrap import size_based_auto_wrap_policy   # or transformer_auto_wrap_policy, ...

Read in this order: ``naive.py`` first (the whole cycle in four hooks, no
options: lab 04 builds it), then the real one: ``api.py`` (the options),
``flat_param.py`` (flatten, pad, shard, gather, free), ``fully_sharded.py``
(one training step: hooks, strategies, prefetch, no_sync), ``wrap.py``
(units), ``full_params.py`` (clipping, summon_full_params), ``state_dict.py``
(checkpoints; ``save_sharded`` / ``load_sharded`` for a sharded checkpoint
folder that loads at any world size). The constructor's helpers:
``strategy.py`` (process groups), ``params.py`` (which parameters,
meta-device init); ``unit.py`` holds what the files share, so imports here run
one way (tests/test_import_graph.py). ``fully_sharded_data_parallel.py`` only
re-exports under torch's module path.

Per-parameter FSDP (FSDP2, ``fully_shard``; lab 04b) is the second half:
``policies.py`` (its options), ``fsdp_param.py`` (one parameter's Shard(0) with
padding), ``param_group.py`` (one all-gather and one reduce-scatter per module),
``fully_shard.py`` (the hooks of one step, ``FSDPModule``'s methods)::

    from minifsdp.fsdp import fully_shard, MixedPrecisionPolicy   # torch.distributed.fsdp's names

``minifsdp.fsdp.wrap`` is the module, as in torch: ``from minifsdp.fsdp.wrap import wrap``.
"""

from . import wrap  # the module (torch's ``torch.distributed.fsdp.wrap``), not the function of that name
from .api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig,
                  LocalStateDictConfig, MixedPrecision, OptimStateDictConfig, ShardedOptimStateDictConfig,
                  ShardedStateDictConfig, ShardingStrategy, StateDictConfig, StateDictSettings, StateDictType)
from .fully_shard import FSDPModule, UnshardHandle, fully_shard
from .fully_sharded import FullyShardedDataParallel
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state_dict import FlatShard, load_sharded, save_sharded
from .strategy import init_hybrid_groups
from .wrap import (ModuleWrapPolicy, always_wrap_policy, auto_wrap, default_auto_wrap_policy, enable_wrap,
                   lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy)

FSDP = FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "CPUOffload", "StateDictType", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig",
           "LocalStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "LocalOptimStateDictConfig", "StateDictSettings", "FlatShard",
           "save_sharded", "load_sharded",
           "init_hybrid_groups", "ModuleWrapPolicy", "always_wrap_policy", "auto_wrap", "default_auto_wrap_policy",
           "enable_wrap", "lambda_auto_wrap_policy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
           "wrap",  # "wrap": the module
           "fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
