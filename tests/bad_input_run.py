"""How one row of ``bad_input_cases.py`` is run: in this process, on a pinned machine, watched.

``run(row)`` executes what the user did (``exec`` of the row's source in
``namespace()``, or the trainer's ``parse_args`` + ``validate`` / ``main``) in a
fresh temporary folder and returns what it raised. ``world=N`` rows run on rank 0
of an N-rank process group made in this process with torch's ``fake`` backend
(its test double: no process starts). The machine is pinned (2 CPU cores, no GPU,
no torchrun variables) so every message reads the same on every machine, and the
row is watched: a ``torch.distributed`` collective or a process start raises
``Forbidden`` instead of running, so a check made too late fails its row.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator
from unittest import mock

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn

from bad_input_cases import Row

def namespace() -> dict[str, Any]:
    """What a row's source sees: the public names it uses, and small models built fresh for each row."""
    from minifsdp import models
    from minifsdp.checkpoint import apply_activation_checkpointing, checkpoint_wrapper
    from minifsdp.context_parallel import check_sequence_length, context_parallel_gpt
    from minifsdp.data import get_batch
    from minifsdp.ddp import DistributedDataParallel, NaiveDataParallel
    from minifsdp.expert_parallel import expert_parallel_gpt
    from minifsdp.fsdp import FSDP, MixedPrecisionPolicy, fully_shard, init_hybrid_groups
    from minifsdp.launch import launch
    from minifsdp.layout import Layout
    from minifsdp.mesh import DeviceMesh
    from minifsdp.mixed_precision import GradScaler, MixedPrecision, autocast, policy_for
    from minifsdp.pipeline import (PipelineParallel, PipelineStage, ScheduleGPipe, make_plan, split_gpt,
                                   split_microbatches)
    from minifsdp.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                          check_divisible, initialize_model_parallel, tensor_parallel_gpt)
    from minifsdp.zero import OSS, ShardedDataParallel, ZeroRedundancyOptimizer, wrap_zero

    names = dict(locals())
    names.update(torch=torch, nn=nn, Block=models.Block, GPTConfig=models.GPTConfig, build_model=models.build_model,
                 MODEL_PRESETS=models.MODEL_PRESETS, work=_work,
                 mlp=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                 gpt=lambda **overrides: models.build_model("gpt-tiny", **overrides),
                 moe=lambda: models.build_model("gpt-moe-tiny"), saved=_saved, trainer=_trainer)
    return names


def _saved(model: str = "gpt-tiny", strategy: str = "fsdp", step: int = 2, complete: bool = True) -> str:
    """A checkpoint folder as ``--save-every`` leaves it, without its tensors: the meta.json and DCP's
    .metadata that ``--resume`` reads before any process starts (``complete=False``: a save killed midway)."""
    from minifsdp.save_resume import META, model_shapes

    path = os.path.join("checkpoints", f"step_{step}" + ("" if complete else ".tmp"))
    os.makedirs(path)
    open(os.path.join(path, ".metadata"), "wb").close()
    meta = {"step": step, "strategy": strategy, "model": model, "world_size": 2, "precision": "fp32",
            "layout": {"dp": 2, "pp": 1, "tp": 1, "cp": 1, "ep": 1}, "params": model_shapes(model)}
    with open(os.path.join(path, META), "w") as f:
        json.dump(meta, f)
    return path


def _trainer(argv: str) -> None:
    """``python -m minifsdp.train ARGV`` up to its validation, which runs before any process starts."""
    from minifsdp import train

    train.validate(train.parse_args(argv.split()))


def _work() -> int:
    return 0


class Forbidden(BaseException):
    """A collective or a process start inside a row: raised past any ``except Exception`` of the library."""


@dataclass
class Outcome:
    error: BaseException | None
    forbidden: list[str] = field(default_factory=list)  # the collectives / process starts the row attempted

    @property
    def message(self) -> str:
        return "" if self.error is None else str(self.error)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
                "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")


_MACHINE_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "MINIFSDP_FAKE_GPU")


def run(row: Row) -> Outcome:
    """Run one row in a fresh folder on a pinned machine, inside its group; what it raised and attempted."""
    attempted: list[str] = []
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder), _pinned_machine(), _world(row.world), \
            _forbid(attempted):
        try:
            _call(row)
            error = None
        except (Exception, SystemExit, Forbidden) as exc:  # SystemExit: train.main's "error: ..." exit
            error = exc
    return Outcome(error, attempted)


def _call(row: Row) -> None:
    if row.argv is None:
        exec(row.source, namespace())
        return
    from minifsdp import train

    if row.main:
        train.main(list(row.argv))
    else:
        train.validate(train.parse_args(list(row.argv)))


@contextlib.contextmanager
def _pinned_machine() -> Iterator[None]:
    """2 CPU cores, no GPU and not under torchrun, whatever runs the rows, so every message reads the same
    everywhere (and train.main never joins a torchrun job)."""
    from minifsdp import dist

    env = {k: v for k, v in os.environ.items() if k not in _MACHINE_VARIABLES}
    with mock.patch.object(os, "cpu_count", return_value=2), mock.patch.object(dist, "gpu_count", return_value=0), \
            mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.dict(os.environ, env, clear=True):
        yield


@contextlib.contextmanager
def _world(n: int) -> Iterator[None]:
    """Rank 0 of an n-rank process group in this process (torch's fake backend); n = 1: no group at all."""
    if n == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from minifsdp import tensor_parallel

    if tdist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process; run the rows in a fresh one")
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        yield
    finally:
        if tensor_parallel.model_parallel_is_initialized():
            tensor_parallel.destroy_model_parallel()
        tdist.destroy_process_group()


@contextlib.contextmanager
def _forbid(attempted: list[str]) -> Iterator[None]:
    """Every torch.distributed collective and every process start raises ``Forbidden`` (and is recorded)."""
    def refuse(what: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            attempted.append(what)
            raise Forbidden(f"{what} ran before the bad input was refused")
        return call

    with contextlib.ExitStack() as stack:
        for name in _COLLECTIVES:
            for module in (tdist, c10d):
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, refuse(name)))
        stack.enter_context(mock.patch.object(multiprocessing.process.BaseProcess, "start", refuse("process start")))
        stack.enter_context(mock.patch.object(subprocess.Popen, "__init__", refuse("subprocess")))
        yield
