"""PyTorch's own side, in one place: what "the same run with torch" means for every minifsdp strategy.

Front layer. Each record here is a ``records.Strategy`` with
``implementation="torch"``, built the same way as minifsdp's
(``minifsdp.strategies``): ``build(model, cfg, layout) -> Built``. The trainer
lists them beside its own (``--strategy torch-fsdp`` trains the same model on
the same data as ``--strategy fsdp``), and the benchmark (``minifsdp.bench``)
puts each pair side by side. Reading order:

    counting.py        how torch's collectives reach minifsdp's tracer (``count_collectives``)
    data_parallel.py   torch-ddp, torch-zero1 (ZeroRedundancyOptimizer), torch-fsdp (FSDP1), torch-fsdp2
    tensor_parallel.py DTensor tensor parallel on minifsdp's splits, FSDP2 x TP, loss_parallel's step
    composed.py        torch-pp (torch.distributed.pipelining), torch-tp, torch-fsdp+tp

No technique package imports this one: the techniques are minifsdp's; torch's
live here, at the front, for comparison.
"""

from __future__ import annotations

from ..records import Strategy
from ..save_resume import TorchState
from .composed import torch_fsdp_tp, torch_pipeline, torch_tp
from .counting import count_collectives, count_ddp_buckets
from .data_parallel import hybrid_groups, mixed_precision_policy, torch_ddp, torch_fsdp, torch_fsdp2, torch_zero1

__all__ = ["STRATEGIES", "count_collectives", "count_ddp_buckets", "hybrid_groups", "mixed_precision_policy",
           "torch_ddp", "torch_zero1", "torch_fsdp", "torch_fsdp2", "torch_pipeline", "torch_tp", "torch_fsdp_tp"]

_FSDP1_OPTIONS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
_FSDP2_OPTIONS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")  # FSDP2 has no NO_SHARD (DDP is that)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    # torch's bf16/fp16 compression comm hook reduces gradients in --precision; compute under autocast
    Strategy("torch-ddp", torch_ddp, implementation="torch", doc="DistributedDataParallel"),
    Strategy("torch-zero1", torch_zero1, implementation="torch", doc="DDP + ZeroRedundancyOptimizer"),
    Strategy("torch-fsdp", torch_fsdp, implementation="torch", sharding_options=_FSDP1_OPTIONS, policy_cast=True,
             sharded_grads=True, state=TorchState, doc="FullyShardedDataParallel (FSDP1)"),
    Strategy("torch-fsdp2", torch_fsdp2, implementation="torch", sharding_options=_FSDP2_OPTIONS,
             policy_cast=True, sharded_grads=True, doc="fully_shard (FSDP2)"),
    Strategy("torch-pp", torch_pipeline, degrees=("pp",), implementation="torch", own_train_step=True,
             doc="torch.distributed.pipelining"),
    Strategy("torch-tp", torch_tp, degrees=("tp",), implementation="torch", own_train_step=True,
             checkpoints_split_blocks=True, doc="DTensor tensor parallel"),
    Strategy("torch-fsdp+tp", torch_fsdp_tp, degrees=("dp", "tp"), implementation="torch", policy_cast=True,
             own_train_step=True, checkpoints_split_blocks=True, doc="FSDP2 x DTensor TP"),
)}
