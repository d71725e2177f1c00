"""One training loop for every strategy: ``python -m minifsdp.train``.

Front layer. The loop is the same whatever the parallelism; a *strategy* is
only a function that wraps the model and builds the optimizer:

    single      one process, the whole global batch (the yardstick)
    ddp-naive   all-reduce every gradient after backward   (minifsdp.ddp)
    ddp         bucketed all-reduce overlapped with backward (minifsdp.ddp)
    zero1/zero2 optimizer-state / gradient sharding          (minifsdp.zero)
    fsdp        fully sharded data parallel                  (minifsdp.fsdp)
    pp, pp+dp   pipeline parallel (gpipe | 1f1b | interleaved | zero-bubble),
                torch-pp: the same with torch.distributed.pipelining,
                x data-parallel replicas                     (minifsdp.pipeline)
    tp          Megatron tensor parallel (--tp N, --sequence-parallel)  (minifsdp.tensor_parallel)
    fsdp+tp     FSDP over --dp replicas of a --tp split model: 2D  (minifsdp.mesh)
    3d          --pp stages x --tp split layers x --dp replicas    (pipeline + tensor_parallel)
    torch-ddp, torch-zero1, torch-fsdp (FSDP1), torch-fsdp2 (fully_shard)
                PyTorch's own, for comparison                (torch_reference.py)

``--sharding-strategy`` (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD)
applies to fsdp and torch-fsdp; torch-fsdp2 takes the first two. HYBRID_SHARD
on one machine is 2 x (N/2): shard groups of N/2 consecutive ranks,
replicated twice (at world size 2: shard 1 x replicate 2).

``--precision fp32|bf16|fp16``, ``--autocast`` and ``--checkpoint none|full|selective``
compose with the strategies (``validate`` names the few exceptions and the fix).
FSDP-based ones (fsdp, fsdp+tp, torch-fsdp, torch-fsdp2, torch-fsdp+tp) cast parameters
with their MixedPrecision policy; the others compute under autocast, and DDP/ZeRO
reduce gradients in the low dtype (torch-ddp/torch-zero1: torch's bf16/fp16 compression
comm hook). fp16 adds the gradient scaler, so strategies that run their own train step
(pipelines, torch-tp, torch-fsdp+tp) take bf16 only. Checkpointing wraps every Block,
or with tensor parallel every split block, after the split and before FSDP; torch-*
strategies use torch's checkpoint_wrapper.

The parity contract: with the same ``--seed``, ``--model`` and global batch,
every strategy's ``losses`` in ``metrics.json`` equal ``--strategy single``'s
within tolerance (tests/test_train.py). ``--batch-size`` is the *global*
batch: with 4 ranks and ``--grad-accum 2`` each rank runs micro-batches of
``batch_size / 8`` sequences, and the 8 slices together are exactly the batch
one process would see (``minifsdp.data.get_batch``).

Run it from a shell (ranks started by ``minifsdp.launch``)::

    python -m minifsdp.train --strategy ddp --world-size 2 --model gpt-tiny --steps 20

or under torchrun, on one machine or many (the same code, env:// rendezvous)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m minifsdp.train --strategy fsdp

Writes to ``--out``: ``metrics.json``, ``trace.json`` (Perfetto),
``timeline.png``, ``memory.png``, and prints a per-rank summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as tdist

from . import data, dist, models, torch_reference, trace
from .launch import launch
from .mixed_precision import (PRECISIONS, GradScaler, MixedPrecision, ShardedGradScaler, check_dtype_supported,
                              policy_for)

# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


@dataclass
class TrainConfig:
    strategy: str = "single"
    world_size: int = 1
    model: str = "gpt-tiny"
    steps: int = 10
    batch_size: int = 8           # global batch (sequences per optimizer step)
    seq_len: int | None = None    # default: the model's block size
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    out: str = "runs/train"
    track_memory: bool = True     # ~1.3x slower on CPU; off for benchmarks
    write_plots: bool = True      # timeline.png / memory.png (a few seconds)
    timeout: float = 900.0
    quiet: bool = False
    # sharding options (fsdp / zero)
    sharding_strategy: str = "FULL_SHARD"
    wrap: str = "block"           # none | block | size
    prefetch: str = "BACKWARD_PRE"
    cpu_offload: bool = False
    bucket_cap_mb: float = 25.0
    checkpoint: str = "none"     # activation checkpointing of every Block: none | full | selective
    # fsdp: MixedPrecision(p, p, p); ddp / zero1 / zero2: autocast compute + gradients reduced in p
    precision: str = "fp32"       # fp32 | bf16 | fp16 (fp16 also turns the gradient scaler on)
    autocast: bool = False        # forward + loss under torch.autocast (bf16, or fp16 with --precision fp16)
    # pipeline options (pp, pp+dp): world = pp x dp ranks
    pp: int = 2
    dp: int = 1
    micro_batches: int = 4
    schedule: str = "1f1b"        # gpipe | 1f1b | interleaved | zero-bubble
    virtual_stages: int = 1       # stages per rank (interleaved, zero-bubble)
    # tensor parallel options (tp, fsdp+tp): world = dp x tp ranks
    tp: int = 2
    sequence_parallel: bool = False

    @property
    def micro_batch(self) -> int:
        return self.batch_size // (self.world_size * self.grad_accum)


Builder = Callable[[torch.nn.Module, TrainConfig], "tuple[torch.nn.Module, torch.optim.Optimizer]"]
STRATEGIES: dict[str, Builder] = {}


def strategy(name: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        STRATEGIES[name] = fn
        return fn
    return register


def _adamw(params: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


@strategy("single")
def _single(model: torch.nn.Module, cfg: TrainConfig):
    return model, _adamw(model.parameters(), cfg)


@strategy("ddp-naive")
def _ddp_naive(model: torch.nn.Module, cfg: TrainConfig):
    from .ddp import NaiveDataParallel

    wrapped = NaiveDataParallel(model)
    return wrapped, _adamw(wrapped.parameters(), cfg)


@strategy("ddp")
def _ddp(model: torch.nn.Module, cfg: TrainConfig):
    from .ddp import DistributedDataParallel

    wrapped = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, mixed_precision=_reduce_policy(cfg))
    return wrapped, _adamw(wrapped.parameters(), cfg)


@strategy("zero1")
def _zero1(model: torch.nn.Module, cfg: TrainConfig):
    # DDP's bucketed, overlapped all-reduce + OSS, the pairing torch-zero1 uses
    # (DDP + ZeroRedundancyOptimizer). wrap_zero(stage=1) all-reduces one
    # gradient at a time: the same bytes, more calls (12% slower at 4 ranks).
    from .ddp import DistributedDataParallel
    from .zero import OSS

    wrapped = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, mixed_precision=_reduce_policy(cfg))
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    return wrapped, OSS(trainable, optim=torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay)


@strategy("zero2")
def _zero2(model: torch.nn.Module, cfg: TrainConfig):
    from .zero import wrap_zero

    return wrap_zero(model, stage=2, mixed_precision=_reduce_policy(cfg), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _reduce_policy(cfg: TrainConfig) -> Any:
    """DDP and ZeRO keep whole fp32 parameters: their share of --precision is the gradient dtype."""
    mp = policy_for(cfg.precision)
    return None if mp is None else MixedPrecision(reduce_dtype=mp.reduce_dtype)


@strategy("fsdp")
def _fsdp(model: torch.nn.Module, cfg: TrainConfig):
    from .fsdp import BackwardPrefetch, CPUOffload, ModuleWrapPolicy, ShardingStrategy
    from .fsdp import FullyShardedDataParallel as FSDP
    from .fsdp import init_hybrid_groups, size_based_auto_wrap_policy

    import functools

    policy = {"block": ModuleWrapPolicy({models.Block}), "none": None,
              "size": functools.partial(size_based_auto_wrap_policy, min_num_params=100_000)}[cfg.wrap]
    # HYBRID_SHARD on one machine: 2 x (N/2) "nodes", the groups torch_reference.hybrid_groups gives torch-fsdp
    hybrid = cfg.sharding_strategy == "HYBRID_SHARD"
    groups = init_hybrid_groups(shard_size=max(1, dist.world_size() // 2)) if hybrid else None
    wrapped = FSDP(model, process_group=groups, auto_wrap_policy=policy,
                   sharding_strategy=ShardingStrategy[cfg.sharding_strategy],
                   backward_prefetch=BackwardPrefetch[cfg.prefetch] if cfg.prefetch != "NONE" else None,
                   cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
                   mixed_precision=policy_for(cfg.precision))
    return wrapped, _adamw(wrapped.parameters(), cfg)


@strategy("pp")
@strategy("pp+dp")
@strategy("torch-pp")
def _pipeline(model: torch.nn.Module, cfg: TrainConfig):
    # This rank keeps only its stages; the loop calls wrapped.train_step(x, y), which
    # runs the schedule (forward and backward, micro-batch by micro-batch).
    from .pipeline import PipelineParallel

    wrapped = PipelineParallel(model, cfg.pp, cfg.micro_batches, cfg.schedule, cfg.virtual_stages,
                               dp=cfg.dp if cfg.strategy == "pp+dp" else 1,
                               api="torch" if cfg.strategy == "torch-pp" else "minifsdp",
                               autocast_dtype=_pipeline_autocast(cfg))
    return wrapped, _adamw(wrapped.parameters(), cfg)


def _pipeline_autocast(cfg: TrainConfig) -> torch.dtype | None:
    """--precision bf16 / --autocast: each stage's forward under bf16 autocast (fp16 is refused in validate)."""
    return torch.bfloat16 if cfg.precision == "bf16" or cfg.autocast else None


@strategy("tp")
@strategy("fsdp+tp")
def _tensor_parallel(model: torch.nn.Module, cfg: TrainConfig):
    # Megatron tensor parallel inside groups of --tp consecutive ranks; fsdp+tp also shards
    # each slice with FSDP over the --dp ranks that hold it (the mesh's dp dimension): 2D.
    from .mesh import DeviceMesh
    from .tensor_parallel import ParallelBlock, ParallelGPT, initialize_model_parallel, tensor_parallel_gpt

    dp = cfg.dp if cfg.strategy == "fsdp+tp" else 1
    mesh = initialize_model_parallel(cfg.tp, mesh=DeviceMesh(dp=dp, tp=cfg.tp))
    wrapped = tensor_parallel_gpt(model, sequence_parallel=cfg.sequence_parallel)
    if cfg.checkpoint != "none":  # the split blocks, before FSDP wraps them (as _fsdp's order)
        apply_checkpointing(wrapped, cfg, ParallelBlock)
    if cfg.strategy == "fsdp+tp":
        from .fsdp import FullyShardedDataParallel as FSDP
        from .fsdp import ModuleWrapPolicy, ShardingStrategy

        wrapped = FSDP(wrapped, process_group=mesh.get_group("dp"), auto_wrap_policy=ModuleWrapPolicy({ParallelBlock}),
                       sharding_strategy=ShardingStrategy[cfg.sharding_strategy],
                       mixed_precision=policy_for(cfg.precision))
    wrapped.lm_loss = ParallelGPT.loss  # vocab-parallel: the full logits never exist
    wrapped.data_parallel_rank, wrapped.data_parallel_size = mesh.get_local_rank("dp"), dp
    return wrapped, _adamw(wrapped.parameters(), cfg)


@strategy("torch-tp")
def _torch_tensor_parallel(model: torch.nn.Module, cfg: TrainConfig):
    # PyTorch's own (DTensor Colwise/RowwiseParallel) on the same splits as tp, for the benchmark;
    # its loss and backward must run inside loss_parallel, so it brings its own train_step.
    import functools

    from .tensor_parallel.torch_tp import torch_tensor_parallel_gpt, torch_tp_train_step

    wrapped = torch_tensor_parallel_gpt(model, cfg.tp)
    if cfg.checkpoint != "none":
        apply_checkpointing(wrapped, cfg)
    wrapped.train_step = functools.partial(torch_tp_train_step, wrapped, autocast=lambda: _autocast(cfg, dist.device()))
    wrapped.data_parallel_rank, wrapped.data_parallel_size = 0, 1  # every rank reads the whole batch
    return wrapped, _adamw(wrapped.parameters(), cfg)


@strategy("torch-fsdp+tp")
def _torch_fsdp_tp(model: torch.nn.Module, cfg: TrainConfig):
    # torch's 2D recipe for the benchmark: DTensor TP inside, FSDP2 fully_shard over the dp dimension.
    import functools

    from .tensor_parallel.torch_tp import torch_fsdp_tp_gpt, torch_tp_train_step

    wrapped, dp_rank = torch_fsdp_tp_gpt(model, cfg.dp, cfg.tp, mp_policy=torch_reference.mixed_precision_policy(cfg),
                                         before_shard=functools.partial(apply_checkpointing, cfg=cfg)
                                         if cfg.checkpoint != "none" else None)
    wrapped.train_step = functools.partial(torch_tp_train_step, wrapped, autocast=lambda: _autocast(cfg, dist.device()))
    wrapped.data_parallel_rank, wrapped.data_parallel_size = dp_rank, cfg.dp
    return wrapped, _adamw(wrapped.parameters(), cfg)


@strategy("3d")
def _three_d(model: torch.nn.Module, cfg: TrainConfig):
    # PP x TP x DP on one DeviceMesh (tp fastest): split every layer --tp ways, cut the split model
    # into --pp stages whose peers are the mesh's pp group, average gradients over its dp group.
    from .mesh import DeviceMesh
    from .pipeline import PipelineParallel
    from .tensor_parallel import ParallelBlock, ParallelGPT, initialize_model_parallel, tensor_parallel_gpt

    mesh = initialize_model_parallel(cfg.tp, cfg.pp, mesh=DeviceMesh(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp))
    split = tensor_parallel_gpt(model)
    if cfg.checkpoint != "none":  # the split blocks, before the pipeline cuts the model (as _tensor_parallel)
        apply_checkpointing(split, cfg, ParallelBlock)
    wrapped = PipelineParallel(split, cfg.pp, cfg.micro_batches, cfg.schedule,
                               cfg.virtual_stages, dp=cfg.dp, pp_group=mesh.get_group("pp"),
                               dp_group=mesh.get_group("dp") if cfg.dp > 1 else None,
                               loss_fn=ParallelGPT.loss,  # the last stage's head is vocab-parallel
                               autocast_dtype=_pipeline_autocast(cfg))
    return wrapped, _adamw(wrapped.parameters(), cfg)


# PyTorch's own implementations, for comparison (torch_reference.py): torch-ddp,
# torch-zero1, torch-fsdp (FSDP1), torch-fsdp2 (fully_shard).
STRATEGIES.update(torch_reference.STRATEGIES)

# Which --sharding-strategy values a strategy accepts (the others ignore it).
SHARDING_OPTIONS: dict[str, tuple[str, ...]] = {
    "fsdp": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),
    "fsdp+tp": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), **torch_reference.SHARDING_OPTIONS}


def validate(cfg: TrainConfig) -> None:
    """One-line errors that name the fix, before any process starts."""
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {cfg.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    options = SHARDING_OPTIONS.get(cfg.strategy)
    if options is not None and cfg.sharding_strategy not in options:
        raise ValueError(f"--strategy {cfg.strategy} does not take sharding strategy {cfg.sharding_strategy!r}; "
                         f"choose one of: {', '.join(options)}")
    if options is not None and cfg.sharding_strategy == "HYBRID_SHARD" and cfg.world_size % 2:
        raise ValueError(f"HYBRID_SHARD here is 2 x (N/2) ranks: use an even --world-size, got {cfg.world_size}")
    if cfg.model not in models.MODEL_PRESETS:
        raise ValueError(f"unknown model {cfg.model!r}; choose one of: {', '.join(models.MODEL_PRESETS)}")
    if cfg.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {cfg.world_size}")
    if cfg.strategy == "single" and cfg.world_size != 1:
        raise ValueError("--strategy single runs one process: use --world-size 1, or a parallel strategy")
    if cfg.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, got {cfg.grad_accum}")
    if cfg.checkpoint not in ("none", "full", "selective"):
        raise ValueError(f"--checkpoint must be none, full or selective, got {cfg.checkpoint!r}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if (cfg.precision != "fp32" or cfg.autocast) and cfg.strategy not in PRECISION_STRATEGIES:
        raise ValueError(f"--precision/--autocast are not wired into --strategy {cfg.strategy} yet; use them "
                         f"with {', '.join(PRECISION_STRATEGIES)}")
    if cfg.precision == "fp16" and cfg.strategy in ("torch-tp", "torch-fsdp+tp"):
        raise ValueError(f"--strategy {cfg.strategy} runs its own train step without loss scaling, which fp16 "
                         "needs: use --precision bf16")
    if cfg.strategy in ("pp", "pp+dp", "torch-pp", "3d"):
        _validate_pipeline(cfg)
    if cfg.strategy in ("tp", "fsdp+tp", "torch-tp", "torch-fsdp+tp", "3d"):
        _validate_tensor_parallel(cfg)
    per = (cfg.dp if cfg.strategy in ("pp+dp", "fsdp+tp", "torch-fsdp+tp", "3d") else 1 if cfg.strategy in ("pp", "torch-pp", "tp", "torch-tp")
           else cfg.world_size) * cfg.grad_accum
    if cfg.batch_size < per or cfg.batch_size % per:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of world size x grad accum = {per} "
                         f"(e.g. --batch-size {max(per, cfg.batch_size // per * per or per)})")
    block = models.MODEL_PRESETS[cfg.model].block_size
    if cfg.seq_len is not None and not 1 <= cfg.seq_len <= block:
        raise ValueError(f"--seq-len must be between 1 and the model's block size {block}, got {cfg.seq_len}")
    _check_writable(cfg.out)


def _validate_pipeline(cfg: TrainConfig) -> None:
    if cfg.precision == "fp16":
        raise ValueError(f"--strategy {cfg.strategy}: fp16 needs its loss scaled inside the pipeline schedule, "
                         "which train_step does not do: use --precision bf16")
    if cfg.checkpoint != "none" and cfg.schedule == "zero-bubble":
        raise ValueError("--schedule zero-bubble splits backward into input and weight passes, which recompute "
                         "(--checkpoint) does not support here: use --checkpoint none or another schedule")
    if cfg.strategy == "3d":
        return  # its sizes: _validate_tensor_parallel
    dp = cfg.dp if cfg.strategy == "pp+dp" else 1
    if cfg.world_size != cfg.pp * dp:
        raise ValueError(f"--strategy {cfg.strategy} runs pp x dp = {cfg.pp} x {dp} ranks: use --world-size "
                         f"{cfg.pp * dp} (got {cfg.world_size})")
    if cfg.grad_accum != 1:
        raise ValueError("a pipeline accumulates over its micro-batches: use --micro-batches, not --grad-accum")
    if cfg.batch_size % (dp * cfg.micro_batches):
        raise ValueError(f"--batch-size {cfg.batch_size} must split into {dp} replica(s) x {cfg.micro_batches} "
                         f"micro-batches: use a multiple of {dp * cfg.micro_batches}")
    layers = models.MODEL_PRESETS[cfg.model].n_layer + 2
    v = cfg.virtual_stages if cfg.schedule in ("interleaved", "zero-bubble") else 1
    if cfg.pp * v > layers:
        raise ValueError(f"{cfg.pp} x {v} stages but {cfg.model} has {layers} layers (embed, blocks, head): "
                         "use fewer stages (--pp / --virtual-stages)")


def _validate_tensor_parallel(cfg: TrainConfig) -> None:
    from .tensor_parallel import check_divisible

    dp = cfg.dp if cfg.strategy in ("fsdp+tp", "torch-fsdp+tp", "3d") else 1
    pp = cfg.pp if cfg.strategy == "3d" else 1
    if cfg.strategy == "3d":
        if cfg.grad_accum != 1 or cfg.batch_size % (dp * cfg.micro_batches):
            raise ValueError(f"--strategy 3d accumulates over --micro-batches (no --grad-accum); --batch-size must "
                             f"be a multiple of dp x micro-batches = {dp * cfg.micro_batches}")
        if pp < 1 or pp > models.MODEL_PRESETS[cfg.model].n_layer + 2:
            raise ValueError(f"--pp {pp}: use 1 to {models.MODEL_PRESETS[cfg.model].n_layer + 2} stages")
    if cfg.strategy.startswith("torch-") and (cfg.grad_accum != 1 or cfg.sequence_parallel):
        raise ValueError(f"--strategy {cfg.strategy} runs one micro-batch per step without sequence parallel: "
                         "drop --grad-accum / --sequence-parallel")
    if cfg.tp < 1 or dp < 1:
        raise ValueError(f"--tp and --dp must be >= 1, got --tp {cfg.tp} --dp {dp}")
    if cfg.world_size != dp * pp * cfg.tp:
        raise ValueError(f"--strategy {cfg.strategy} runs dp x pp x tp = {dp} x {pp} x {cfg.tp} ranks: use "
                         f"--world-size {dp * pp * cfg.tp} (got {cfg.world_size})")
    config = models.MODEL_PRESETS[cfg.model]
    check_divisible(config, cfg.tp, cfg.seq_len or config.block_size, cfg.sequence_parallel)


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        # A probe name unique to this process: under torchrun every rank runs this check
        # at once, and a shared name lets one rank delete the other's probe.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {path!r} is not writable ({exc.strerror}); choose another folder") from None


# --------------------------------------------------------------------------
# The loop (runs on every rank)
# --------------------------------------------------------------------------


def run_rank(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank; return losses, step times, the trace and the memory report."""
    rank, world = dist.rank(), dist.world_size()
    device = dist.device()
    seq_len = cfg.seq_len or models.MODEL_PRESETS[cfg.model].block_size
    micro = cfg.batch_size // (world * cfg.grad_accum)
    tracer = trace.Tracer(rank=rank, strategy=cfg.strategy)
    tracker = _memory_tracker(cfg, device)
    losses, step_times = [], []
    # torch's strategies do not go through minifsdp.comm: count their collectives here (DTensor's too)
    counted = (*torch_reference.STRATEGIES, "torch-tp", "torch-fsdp+tp", "torch-pp")
    counter = (torch_reference.count_collectives(pipelining=cfg.strategy == "torch-pp") if cfg.strategy in counted
               else nullcontext())
    with tracer, tracker or nullcontext(), counter:
        model = models.build_model(cfg.model, seed=cfg.seed).to(device)
        n_params = models.count_parameters(model)
        if tracker is not None:
            tracker.track_model(model)
        if cfg.checkpoint != "none" and cfg.strategy not in _CHECKPOINT_IN_BUILDER:
            apply_checkpointing(model, cfg)  # checkpoint the blocks, then wrap: PyTorch's recipe order
        with trace.span("wrap"):
            model, optimizer = STRATEGIES[cfg.strategy](model, cfg)
        if tracker is not None:
            tracker.track_model(model)
            tracker.track_optimizer(optimizer)
        # Which slice of the global batch this rank reads: its own, or (pipeline) its replica's.
        data_rank = getattr(model, "data_parallel_rank", rank)
        data_world = getattr(model, "data_parallel_size", world)
        loss_fn = getattr(model, "lm_loss", models.lm_loss)  # tensor parallel: vocab-parallel cross-entropy
        scaler = _grad_scaler(cfg, device)   # fp16 only; a pass-through otherwise
        for step in range(cfg.steps):
            start = time.perf_counter()
            with trace.span("step", step=step):
                local = torch.zeros((), device=device)
                for m in range(cfg.grad_accum):
                    x, y = data.get_batch(step, cfg.batch_size, seq_len, seed=cfg.seed, rank=data_rank,
                                          world_size=data_world, micro_step=m, grad_accum=cfg.grad_accum)
                    x, y = x.to(device), y.to(device)
                    last = m == cfg.grad_accum - 1
                    sync = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
                    if hasattr(model, "train_step"):  # a pipeline runs forward and backward itself
                        loss = model.train_step(x, y) / cfg.grad_accum
                    else:
                        with sync:
                            with trace.span("forward", step=step, micro=m), _autocast(cfg, device):
                                logits = model(x)  # 16-bit under a policy or autocast: the loss in fp32
                                loss = loss_fn(logits.float(), y)  # (a no-op in fp32; vocab-parallel CE too)
                                loss = loss / cfg.grad_accum
                            with trace.span("backward", step=step, micro=m):
                                scaler.scale(loss).backward()
                    local += loss.detach()
                with trace.span("optimizer", step=step):
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - start)
            losses.append(_global_mean(local))
            if tracker is not None:
                tracker.snapshot(f"step {step}")
            if rank == 0 and not cfg.quiet:
                _progress(step, cfg.steps, losses[-1], step_times[-1])
    report = tracker.report() if tracker is not None else {}
    return {"rank": rank, "losses": losses, "step_time_s": step_times, "trace": tracer.trace,
            "memory": report, "n_params": n_params}


# Tensor parallel replaces each Block by its split (ParallelBlock, or DTensor layers): these builders
# checkpoint the split blocks themselves, after the split and before any FSDP wrapping.
_CHECKPOINT_IN_BUILDER = ("tp", "fsdp+tp", "torch-tp", "torch-fsdp+tp", "3d")


def apply_checkpointing(model: torch.nn.Module, cfg: TrainConfig, block: type = models.Block) -> None:
    """--checkpoint: wrap every ``block`` (a Block, or tensor parallel's ParallelBlock). full recomputes
    the whole block in backward; selective keeps its linear layers' outputs and recomputes the rest
    (minifsdp.checkpoint.selective). torch's strategies get torch's own checkpoint_wrapper, so the
    benchmark compares like with like."""
    import functools

    from .checkpoint import LINEAR_OPS

    if cfg.strategy.startswith("torch-"):
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as ac
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
    else:
        from . import checkpoint as ac
        from .checkpoint import create_selective_checkpoint_contexts
    selective = {"context_fn": functools.partial(create_selective_checkpoint_contexts, list(LINEAR_OPS))}
    wrapper = functools.partial(ac.checkpoint_wrapper, checkpoint_impl=ac.CheckpointImpl.NO_REENTRANT,
                                **(selective if cfg.checkpoint == "selective" else {}))
    ac.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, block))


# Strategies that take --precision / --autocast (FSDP: a MixedPrecision policy; the others: autocast
# for compute, and DDP/ZeRO reduce gradients in the low dtype).
# tp and torch-tp compute under autocast; fsdp+tp and torch-fsdp2 / torch-fsdp+tp cast with their FSDP's policy;
# torch-ddp / torch-zero1 reduce with torch's bf16/fp16 compression comm hook.
PRECISION_STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "tp", "fsdp+tp", "torch-ddp", "torch-zero1",
                        "torch-fsdp", "torch-fsdp2", "torch-tp", "torch-fsdp+tp")
PRECISION_STRATEGIES += ("pp", "pp+dp", "torch-pp", "3d")  # bf16 autocast around each stage's forward
# parameters cast by the wrapper: no autocast needed
_POLICY_STRATEGIES = ("fsdp", "fsdp+tp", "torch-fsdp", "torch-fsdp2", "torch-fsdp+tp")
# each rank holds part of the gradients: the scaler's found-inf flag is all-reduced
SHARDED_GRAD_STRATEGIES = ("zero2", "fsdp", "tp", "fsdp+tp", "torch-fsdp", "torch-fsdp2")


def _autocast(cfg: TrainConfig, device: torch.device) -> Any:
    """One autocast region per forward (autocast caches 16-bit weight copies until its region ends)."""
    on = cfg.autocast or (cfg.precision != "fp32" and cfg.strategy not in _POLICY_STRATEGIES)
    return torch.autocast(device.type, dtype=PRECISIONS["fp16" if cfg.precision == "fp16" else "bf16"],
                          enabled=on)


def _grad_scaler(cfg: TrainConfig, device: torch.device) -> Any:
    """fp16 needs loss scaling; sharded gradients need the found-inf flag agreed on by every rank.
    torch's strategies get torch's scalers, so the benchmark compares like with like."""
    enabled = cfg.precision == "fp16"
    if cfg.strategy.startswith("torch-"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
        return (TorchSharded(device.type, enabled=enabled) if cfg.strategy in SHARDED_GRAD_STRATEGIES
                else torch.amp.GradScaler(device.type, enabled=enabled))
    check_dtype_supported(PRECISIONS[cfg.precision], device)
    cls = ShardedGradScaler if cfg.strategy in SHARDED_GRAD_STRATEGIES else GradScaler
    return cls(device, enabled=enabled)


def _memory_tracker(cfg: TrainConfig, device: torch.device) -> Any:
    if not cfg.track_memory:
        return None
    from .memory import MemoryTracker

    return MemoryTracker(device=str(device))


def _global_mean(local: torch.Tensor) -> float:
    """Mean loss over the global batch: the mean of equal-sized rank slices.

    Bookkeeping, not training traffic: it goes straight to torch.distributed
    (to its c10d module, past torch_reference's counter) so it does not count
    in the strategy's bytes.
    """
    if dist.world_size() == 1:
        return local.item()
    t = local.detach().clone().reshape(1)
    tdist.distributed_c10d.all_reduce(t)
    return t.item() / dist.world_size()


def _progress(step: int, steps: int, loss: float, seconds: float) -> None:
    width = 24
    done = int(width * (step + 1) / steps)
    print(f"[{'#' * done}{'.' * (width - done)}] step {step + 1:>4}/{steps}  loss {loss:.4f}  "
          f"{seconds * 1e3:7.1f} ms", flush=True)


# --------------------------------------------------------------------------
# Driver: launch (one machine) or torchrun (any number), then write outputs
# --------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ
                                                    and "MASTER_ADDR" in os.environ)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the configured training; returns the metrics written to ``metrics.json``."""
    if _under_torchrun():
        dist.init()
        cfg = dataclasses.replace(cfg, world_size=dist.world_size())
        validate(cfg)
        result = run_rank(cfg)
        gathered: list[Any] = [None] * dist.world_size()
        tdist.all_gather_object(gathered, result)
        dist.destroy()
        if dist.rank() != 0 and int(os.environ.get("RANK", "0")) != 0:
            return {}
        results = gathered
    else:
        validate(cfg)
        if cfg.strategy == "single":
            results = [run_rank(cfg)]  # no process group needed: dist.rank() == 0
        else:
            results = launch(run_rank, cfg.world_size, cfg, timeout=cfg.timeout)
    return write_outputs(cfg, results)


def write_outputs(cfg: TrainConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    os.makedirs(cfg.out, exist_ok=True)
    traces = [r["trace"] for r in results]
    metrics = {
        "strategy": cfg.strategy, "world_size": cfg.world_size, "model": cfg.model,
        "n_params": results[0]["n_params"], "steps": cfg.steps, "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum, "seed": cfg.seed, "lr": cfg.lr,
        "losses": results[0]["losses"],
        "step_time_s": [r["step_time_s"] for r in results],
        "median_step_time_s": [statistics.median(r["step_time_s"]) for r in results],
        "peak_bytes": [r["memory"].get("peak_total") for r in results],
        "peak_by_category": [r["memory"].get("peak_by_category") for r in results],
        "bytes_per_step": [{op: b / cfg.steps for op, b in t.bytes_by_op(within="step").items()} for t in traces],
        "config": dataclasses.asdict(cfg),
    }
    with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    trace.save_chrome_trace(traces, os.path.join(cfg.out, "trace.json"))
    if cfg.write_plots:
        _save_plots(cfg, traces)
    if not cfg.quiet:
        print(summary_table(metrics))
        print(f"\nwrote {cfg.out}/: metrics.json, trace.json (open in https://ui.perfetto.dev), "
              "timeline.png, memory.png")
    return metrics


def _save_plots(cfg: TrainConfig, traces: list[trace.Trace]) -> None:
    from . import plot

    fig = plot.timeline(traces, title=f"{cfg.strategy}, {cfg.world_size} rank(s), {cfg.model}")
    fig.savefig(os.path.join(cfg.out, "timeline.png"), dpi=110, bbox_inches="tight")
    if any(t.memory for t in traces):
        fig = plot.memory(traces)
        fig.savefig(os.path.join(cfg.out, "memory.png"), dpi=110, bbox_inches="tight")


def summary_table(metrics: dict[str, Any]) -> str:
    """Per-rank medians: step time, peak memory by category, bytes per collective per step."""
    mib = 2 ** 20
    lines = [f"{'rank':>4}  {'step ms':>8}  {'peak MiB':>9}  {'by category (MiB)':<48}  bytes/step"]
    for r, step_s in enumerate(metrics["median_step_time_s"]):
        peak = metrics["peak_bytes"][r]
        cats = metrics["peak_by_category"][r] or {}
        cat_txt = ", ".join(f"{k} {v / mib:.1f}" for k, v in cats.items() if v) or "-"
        comm_txt = ", ".join(f"{op} {b / mib:.2f} MiB" for op, b in metrics["bytes_per_step"][r].items()) or "-"
        lines.append(f"{r:>4}  {step_s * 1e3:8.1f}  {(peak or 0) / mib:9.1f}  {cat_txt:<48}  {comm_txt}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m minifsdp.train", description=__doc__.split("\n")[0])
    p.add_argument("--strategy", default="single", help=f"one of: {', '.join(STRATEGIES)}")
    p.add_argument("--world-size", type=int, default=None, help="ranks to launch (default 2, or 1 for single)")
    p.add_argument("--model", default="gpt-tiny", help=f"one of: {', '.join(models.MODEL_PRESETS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, split across data-parallel ranks")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train")
    p.add_argument("--no-memory", action="store_true", help="skip memory tracking (faster)")
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   help="FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD (fsdp, torch-fsdp, torch-fsdp2)")
    p.add_argument("--wrap", default="block", choices=["none", "block", "size"])
    p.add_argument("--prefetch", default="BACKWARD_PRE")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--checkpoint", default="none", choices=["none", "full", "selective"],
                   help="activation checkpointing of every Block, or of tensor parallel's split blocks (selective "
                        "keeps the linear layers' outputs)")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="fsdp, fsdp+tp, torch-fsdp*: MixedPrecision policy; ddp/zero/torch-ddp: autocast + "
                        "gradients reduced in it; tp, torch-tp: autocast; fp16 adds the gradient scaler")
    p.add_argument("--autocast", action="store_true", help="run forward and loss under torch.autocast")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (pp, pp+dp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (pp+dp)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per pipeline step")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zero-bubble"])
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (interleaved, zero-bubble)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per model copy (tp, fsdp+tp)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard layer norms along the sequence (tp)")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    pipeline_world = a.pp * (a.dp if a.strategy == "pp+dp" else 1)
    model_world = {"tp": a.tp, "torch-tp": a.tp, "fsdp+tp": a.dp * a.tp,
                   "torch-fsdp+tp": a.dp * a.tp, "3d": a.pp * a.dp * a.tp}.get(a.strategy)
    world = a.world_size if a.world_size is not None else (
        1 if a.strategy == "single" else pipeline_world if a.strategy in ("pp", "pp+dp", "torch-pp") else model_world or 2)
    return TrainConfig(strategy=a.strategy, world_size=world, model=a.model, steps=a.steps,
                       batch_size=a.batch_size, seq_len=a.seq_len, grad_accum=a.grad_accum, lr=a.lr,
                       seed=a.seed, out=a.out, track_memory=not a.no_memory, timeout=a.timeout,
                       sharding_strategy=a.sharding_strategy, wrap=a.wrap, prefetch=a.prefetch,
                       cpu_offload=a.cpu_offload, pp=a.pp, dp=a.dp, micro_batches=a.micro_batches,
                       schedule=a.schedule, virtual_stages=a.virtual_stages, tp=a.tp,
                       sequence_parallel=a.sequence_parallel, checkpoint=a.checkpoint, precision=a.precision,
                       autocast=a.autocast)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    try:
        train(cfg)
    except ValueError as exc:  # bad input: one line, no traceback
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
