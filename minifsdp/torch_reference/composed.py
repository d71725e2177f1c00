"""torch's model-parallel strategies for the trainer: pipelining, DTensor tensor parallel, FSDP2 x TP.

Front layer (``minifsdp.torch_reference``). Built like minifsdp's pipeline and
tensor-parallel strategies (``minifsdp.strategies``), with torch's classes:

    torch-pp       torch.distributed.pipelining's PipelineStage and schedules (and
                   torch's DDP over a stage's replicas)               vs  pp, pp+dp
    torch-tp       DTensor Colwise/RowwiseParallel (``tensor_parallel``) vs  tp
    torch-fsdp+tp  DTensor TP inside, FSDP2 ``fully_shard`` over dp   vs  fsdp+tp

The DTensor ones take their loss and backward inside ``loss_parallel``, so they
bring their own train step (``tensor_parallel.torch_tp_train_step``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import dist, trace
from ..layout import Layout
from ..pipeline import SCHEDULE_CLASSES, PipelineParallel
from ..records import Built, TrainConfig, adamw, apply_checkpointing, autocast, pipeline_autocast
from .data_parallel import mixed_precision_policy
from .tensor_parallel import torch_fsdp_tp_gpt, torch_tensor_parallel_gpt, torch_tp_train_step

__all__ = ["torch_pipeline", "torch_tp", "torch_fsdp_tp"]


def torch_pipeline(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    """minifsdp's ``PipelineParallel`` (the split, the loop over stages) with torch.distributed.pipelining's
    ``PipelineStage`` and schedule of the same name, and torch's DDP: the only difference from ``pp``."""
    from torch.distributed import pipelining
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    wrapped = PipelineParallel(model, layout.pp, cfg.micro_batches, cfg.schedule, layout.virtual_stages, dp=layout.dp,
                               stage_cls=pipelining.PipelineStage, ddp_cls=TorchDDP,
                               schedule_cls=getattr(pipelining, SCHEDULE_CLASSES[cfg.schedule].__name__),
                               autocast_dtype=pipeline_autocast(cfg))
    for part in wrapped.stage_modules:  # "forward" spans, as minifsdp's executor opens them (phases.py)
        _forward_spans(part)
    return Built(wrapped, adamw(wrapped.parameters(), cfg), train_step=wrapped.train_step,
                 data_rank=wrapped.data_parallel_rank, data_size=wrapped.data_parallel_size)


def _forward_spans(module: torch.nn.Module) -> None:
    """Record each forward of ``module`` as a "forward" span (``trace.span``, entered and left by hooks):
    torch's schedules run forward and backward inside their own ``step``, where train.py cannot open spans."""
    open_spans: list[Any] = []

    def before(*_: object) -> None:
        open_spans.append(trace.span("forward"))
        open_spans[-1].__enter__()

    def after(*_: object) -> None:
        open_spans.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def torch_tp(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    """DTensor tensor parallel on the same splits as tp; every rank reads the whole batch."""
    wrapped = torch_tensor_parallel_gpt(model, layout.tp)
    if cfg.checkpoint != "none":
        apply_checkpointing(wrapped, cfg.checkpoint, "torch")
    step = functools.partial(torch_tp_train_step, wrapped, autocast=lambda: autocast(cfg, dist.device(), False))
    return Built(wrapped, adamw(wrapped.parameters(), cfg), train_step=step, data_rank=0, data_size=1)


def torch_fsdp_tp(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    """torch's 2D recipe: DTensor TP inside, FSDP2 fully_shard over the dp dimension (its MixedPrecisionPolicy)."""
    before_shard = (functools.partial(apply_checkpointing, checkpoint=cfg.checkpoint, implementation="torch")
                    if cfg.checkpoint != "none" else None)
    wrapped, dp_rank = torch_fsdp_tp_gpt(model, layout.dp, layout.tp, mp_policy=mixed_precision_policy(cfg),
                                         before_shard=before_shard)
    step = functools.partial(torch_tp_train_step, wrapped, autocast=lambda: autocast(cfg, dist.device(), True))
    return Built(wrapped, adamw(wrapped.parameters(), cfg), train_step=step, data_rank=dp_rank, data_size=layout.dp)
