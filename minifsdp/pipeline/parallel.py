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
pipeline splits the slice into micro-batches. After the pipeline step each
stage's gradients are averaged over the replicas holding the same stage: one
flat all-reduce, DDP's idea with a single bucket, issued after the last
backward (a pipeline's backward is spread over the whole step, so there is
little to overlap with on the first stages anyway).

``api="torch"`` builds the same stages and schedule from
``torch.distributed.pipelining`` instead (the same names, so only the module
differs): the trainer's ``torch-pp``, for side-by-side runs in the benchmark.

``train_step(x, y)`` is what the trainer's loop calls instead of
``loss = lm_loss(model(x), y); loss.backward()``; it returns the replica's
mean loss on every rank of the pipeline (broadcast from the last stage), so
the trainer's global mean is the same as ``--strategy single``'s.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as tdist
from torch import nn

from .. import comm, dist, models
from .executor import (PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                       ScheduleInterleavedZeroBubble)
from .partition import split_gpt

__all__ = ["PipelineParallel", "SCHEDULE_CLASSES", "pipeline_groups"]

SCHEDULE_CLASSES: dict[str, type[PipelineSchedule]] = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble}
APIS = {"minifsdp": "minifsdp.pipeline", "torch": "torch.distributed.pipelining"}


def pipeline_groups(pp: int, dp: int) -> tuple[tdist.ProcessGroup | None, tdist.ProcessGroup | None]:
    """This rank's (pipeline group, data-parallel group); every rank builds every group, in order."""
    world, rank = dist.world_size(), dist.rank()
    if world != pp * dp:
        raise ValueError(f"world size {world} != pp x dp = {pp} x {dp}: launch {pp * dp} ranks or change --pp / --dp")
    if dp == 1:
        return None, None
    mine_pp = mine_dp = None
    for d in range(dp):
        g = tdist.new_group([d * pp + s for s in range(pp)])
        mine_pp = g if rank // pp == d else mine_pp
    for s in range(pp):
        g = tdist.new_group([d * pp + s for d in range(dp)])
        mine_dp = g if rank % pp == s else mine_dp
    return mine_pp, mine_dp


class PipelineParallel(nn.Module):
    """This rank's stages of ``model`` (a GPT) plus the schedule that runs them.

    ``schedule``: gpipe | 1f1b | interleaved | zero-bubble; ``virtual_stages``
    (interleaved, zero-bubble) stages per rank; ``checkpoint``: always |
    except_last | never; ``balance``: layers per stage (default: by parameter count);
    ``api``: minifsdp | torch (``torch.distributed.pipelining``'s classes, no checkpoint option).
    ``pp_group`` / ``dp_group``: groups made elsewhere (a ``DeviceMesh`` with tensor parallel
    too); by default ``pipeline_groups(pp, dp)`` over the whole world.
    """

    def __init__(self, model: models.GPT, pp: int, n_microbatches: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, dp: int = 1, checkpoint: str = "never", balance: list[int] | None = None,
                 api: str = "minifsdp", pp_group: tdist.ProcessGroup | None = None,
                 dp_group: tdist.ProcessGroup | None = None):
        super().__init__()
        if schedule not in SCHEDULE_CLASSES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULE_CLASSES)}")
        if api not in APIS or (api == "torch" and checkpoint != "never"):
            raise ValueError(f"api={api!r}, checkpoint={checkpoint!r}: use api minifsdp or torch (torch: no checkpoint)")
        lib = importlib.import_module(APIS[api])
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
        self.stage_modules = nn.ModuleList(parts[s] for s in mine)
        device = dist.device()
        extra = {"checkpoint": checkpoint} if api == "minifsdp" else {}
        self.stages = [lib.PipelineStage(parts[s], s, pp * v, device, group=self.pp_group, **extra) for s in mine]
        cls = getattr(lib, SCHEDULE_CLASSES[schedule].__name__)
        self.schedule = cls(self.stages[0] if v == 1 and schedule in ("gpipe", "1f1b") else self.stages,
                            n_microbatches, loss_fn=models.lm_loss)
        self._last_rank = _global(self.pp_group, (pp * v - 1) % pp)

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
            # Bookkeeping (what to print), not training traffic: straight to torch.distributed.
            tdist.broadcast(loss, src=self._last_rank, group=self.pp_group)
        if self.dp > 1:
            self._all_reduce_grads()
        return loss

    def _all_reduce_grads(self) -> None:
        """Average each gradient over the replicas of this stage: one flat buffer, one all-reduce."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.dp)
        comm.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _global(group: tdist.ProcessGroup | None, group_rank: int) -> int:
    return tdist.get_global_rank(group, group_rank) if group is not None else group_rank
