"""Pipeline x data parallel for the trainer: ``--strategy pp`` and ``--strategy pp+dp``.

World = ``dp`` replicas of a ``pp``-rank pipeline; the ranks of one pipeline
are consecutive (rank = d * pp + s, Megatron's and FairScale's layout, tensor
parallel aside)::

    pp=2, dp=2      pipeline group      data-parallel group
    rank 0           [0, 1]  stage 0     [0, 2]
    rank 1           [0, 1]  stage 1     [1, 3]
    rank 2           [2, 3]  stage 0     [0, 2]
    rank 3           [2, 3]  stage 1     [1, 3]

Replica d trains on slice d of the global batch (``data_parallel_rank``); its
pipeline splits the slice into micro-batches. The data dimension is
``minifsdp.ddp.DistributedDataParallel``: each stage's module is wrapped in a
DDP over the ranks holding the same stage (the data-parallel group), and the
stage runs DDP the way torch's ``PipelineStage`` does (stage.py): every
forward and every backward under ``no_sync()`` except the stage's last
backward of the step, which all-reduces the m micro-batches' summed gradients
in DDP's buckets, overlapped with that backward. One step on rank 0
(pp=2, dp=2, 1F1B, m=4)::

    rank 0 (stage 0):  F0 F1 B0 F2 B1 F3 B2 [B3 + all-reduce buckets over {0, 2}]
    rank 1 (stage 1):  F0 B0 F1 B1 F2 B2 F3 [B3 + all-reduce buckets over {1, 3}]

Bytes per step and rank: one all-reduce of the stage's gradients, 2P_stage
(P_stage = the stage's parameter bytes; ``estimate.comm_bytes_per_step(stage params, dp, "ddp")``; buffers are not
broadcast: a GPT's only buffer is its constant causal mask), plus the
activations and gradients the pipeline sends.

Why DDP and not FSDP: a pipeline keeps every micro-batch in flight on the
same parameters, so FSDP would gather a stage's parameters for each
micro-batch (or keep them gathered, then it is DDP with extra steps); DDP's
one decision per step, "which backward synchronises", is exactly what the
schedule knows. Zero bubble splits backward: its last W hands the weight
gradients to autograd in one call, so DDP's hooks see one backward (stage.py).

Precision (``autocast_dtype``): each stage's forward runs under
``torch.autocast`` (fp32 parameters and gradients, 16-bit matmuls), one region
per micro-batch as the trainer does; the loss is taken on fp32 logits.
``bf16`` only: fp16 needs a gradient scaler to scale each micro-batch's loss
inside the schedule, which ``train_step`` does not take.

``stage_cls`` / ``schedule_cls`` / ``ddp_cls`` swap in other classes with the
same constructors: ``minifsdp.torch_reference.pipelining`` passes
``torch.distributed.pipelining``'s and torch's DDP (the trainer's ``torch-pp``),
so only the classes differ between the two sides of the benchmark.

``train_step(x, y)`` is what the trainer's loop calls instead of
``loss = lm_loss(model(x), y); loss.backward()``; it returns the replica's
mean loss on every rank of the pipeline (broadcast from the last stage), so
the trainer's global mean is the same as ``--strategy single``'s.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as tdist
from torch import nn

from .. import dist, models
from ..ddp import DistributedDataParallel
from ..mesh import DeviceMesh
from .executor import (PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                       ScheduleInterleavedZeroBubble)
from .partition import split_gpt
from .stage import PipelineStage

__all__ = ["PipelineParallel", "SCHEDULE_CLASSES", "pipeline_groups"]

SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble}


def pipeline_groups(pp: int, dp: int) -> tuple[tdist.ProcessGroup | None, tdist.ProcessGroup | None]:
    """This rank's (pipeline group, data-parallel group): the pp and dp groups of ``DeviceMesh(dp=dp, pp=pp)``.

    With tp = 1 the mesh's layout is ``rank = d * pp + s``: stage s of replica d (every rank builds
    every group, in the same order, inside the mesh's constructor).
    """
    world = dist.world_size()
    if world != pp * dp:
        raise ValueError(f"world size {world} != pp x dp = {pp} x {dp}: launch {pp * dp} ranks or change --pp / --dp")
    if dp == 1:
        return None, None
    mesh = DeviceMesh(dp=dp, pp=pp)
    return mesh.get_group("pp"), mesh.get_group("dp")


class PipelineParallel(nn.Module):
    """This rank's stages of ``model`` (a GPT) plus the schedule that runs them.

    ``schedule``: gpipe | 1f1b | interleaved | zero-bubble; ``virtual_stages``
    (interleaved, zero-bubble) stages per rank; ``checkpoint``: always |
    except_last | never; ``balance``: layers per stage (default: by parameter count);
    ``stage_cls`` / ``schedule_cls`` / ``ddp_cls``: other classes with the same constructors (torch's: no
    checkpoint option); default minifsdp's ``PipelineStage``, ``SCHEDULE_CLASSES[schedule]``, DDP.
    ``pp_group`` / ``dp_group``: groups made elsewhere (a ``DeviceMesh`` with tensor parallel
    too); by default ``pipeline_groups(pp, dp)`` over the whole world.
    ``loss_fn(output, target)``: the last stage's loss per micro-batch (default ``models.lm_loss``;
    tensor parallel: ``ParallelGPT.loss``). ``autocast_dtype``: ``torch.bfloat16`` runs the
    stages' forwards under autocast (see the module docstring).
    """

    def __init__(self, model: models.GPT, pp: int, n_microbatches: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, dp: int = 1, checkpoint: str = "never", balance: list[int] | None = None,
                 stage_cls: type | None = None, schedule_cls: type | None = None,
                 ddp_cls: type | None = None, pp_group: tdist.ProcessGroup | None = None,
                 dp_group: tdist.ProcessGroup | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = models.lm_loss,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        if schedule not in SCHEDULE_CLASSES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULE_CLASSES)}")
        own_stages = stage_cls is None or stage_cls is PipelineStage
        if not own_stages and checkpoint != "never":
            raise ValueError(f"stage_cls={stage_cls.__name__} has no checkpoint option: use checkpoint='never'")
        if autocast_dtype not in (None, torch.bfloat16):
            raise ValueError(f"autocast_dtype={autocast_dtype}: a pipeline runs bf16 autocast only (fp16 needs a "
                             "gradient scaler inside the schedule): use torch.bfloat16 or None")
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages} must be >= 1 (stages per rank; 1 for gpipe and 1f1b)")
        v = virtual_stages if schedule in ("interleaved", "zero-bubble") else 1
        if virtual_stages != 1 and v == 1:
            raise ValueError(f"--virtual-stages {virtual_stages} needs --schedule interleaved or zero-bubble")
        if pp_group is None and dp_group is None:
            pp_group, dp_group = pipeline_groups(pp, dp)
        elif dist.world_size(pp_group) != pp or (dist.world_size(dp_group) if dp_group is not None else 1) != dp:
            raise ValueError(f"pp_group has {dist.world_size(pp_group)} ranks and dp_group {dist.world_size(dp_group)}; "
                             f"pp={pp} and dp={dp} need groups of those sizes")
        self.pp_group, self.dp_group = pp_group, dp_group
        self.pp, self.dp, self.n_microbatches = pp, dp, n_microbatches
        self.data_parallel_rank = dist.rank(dp_group) if dp > 1 else 0
        self.data_parallel_size = dp
        parts = split_gpt(model, pp * v, balance)
        mine = [s for s in range(pp * v) if s % pp == dist.rank(pp_group)]
        self.stage_modules = nn.ModuleList(parts[s] for s in mine)  # the parameters, under their model names
        device = dist.device()
        extra = {"checkpoint": checkpoint} if own_stages else {}
        self.ddp_cls = ddp_cls or DistributedDataParallel
        self.stages = [(stage_cls or PipelineStage)(self._wrap(parts[s], autocast_dtype), s, pp * v, device,
                                                    group=self.pp_group, **extra) for s in mine]
        cls = schedule_cls or SCHEDULE_CLASSES[schedule]
        if autocast_dtype is not None:
            loss_fn = _fp32_loss(loss_fn)
        self.schedule = cls(self.stages[0] if v == 1 and schedule in ("gpipe", "1f1b") else self.stages,
                            n_microbatches, loss_fn=loss_fn)
        self._last_rank = dist.global_rank(self.pp_group, (pp * v - 1) % pp)

    def _wrap(self, part: nn.Module, autocast_dtype: torch.dtype | None) -> nn.Module:
        """What the stage runs: the part, under autocast, in a DDP over the replicas of this stage."""
        module = _Autocast(part, autocast_dtype) if autocast_dtype is not None else part
        if self.dp == 1:
            return module
        # The causal mask is the only buffer and never changes: no broadcast before each forward.
        return self.ddp_cls(module, process_group=self.dp_group, forward_sync_buffers=False)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through train_step(x, y), not model(x): its stages live on "
                           "different ranks")

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One pipelined forward + backward of this replica's batch; returns its mean loss on every rank."""
        losses: list[torch.Tensor] = []
        holds = {st.stage_index for st in self.stages}
        first, last = 0 in holds, self.stages[0].num_stages - 1 in holds
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        self.schedule.step(*args, **kwargs, return_outputs=False)
        loss = torch.stack(losses).mean() if last else x.new_zeros((), dtype=torch.float32)
        if self.pp > 1:
            # Bookkeeping (what to print), not training traffic: straight to torch.distributed's own
            # function, which torch_reference.count_collectives does not swap (so torch-pp counts as pp).
            tdist.distributed_c10d.broadcast(loss, src=self._last_rank, group=self.pp_group)
        return loss


class _Autocast(nn.Module):
    """``module`` whose forward runs under ``torch.autocast(dtype)``: one region per micro-batch."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(dist.device().type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def _fp32_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """The loss on fp32 logits (autocast leaves the head's output in bf16), as the trainer does."""
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output.float(), target)
    return loss
