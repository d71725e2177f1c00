"""One training loop for every strategy: ``python -m minifsdp.train``.

Front layer. The loop is the same whatever the parallelism; a *strategy* is
a record (``minifsdp.records.Strategy``) whose builder wraps the model and
builds the optimizer. The records are the ``--strategy`` names:
``minifsdp.strategies`` lists minifsdp's (single, ddp-naive, ddp, zero1,
zero2, fsdp, fsdp2, pp, pp+dp, tp, fsdp+tp, 3d, cp, ep) and ``minifsdp.torch_reference``
PyTorch's own for comparison (torch-ddp, torch-zero1, torch-fsdp, torch-fsdp2,
torch-pp, torch-tp, torch-fsdp+tp). Each record's ``layout(cfg)`` turns the
flags into the run's degrees (``minifsdp.layout.Layout``: dp x pp x tp x cp, ep inside dp,
HYBRID_SHARD's 2 x (N/2), the pipeline's virtual stages), validated once.

``--sharding-strategy`` (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD)
applies to fsdp and torch-fsdp; fsdp2 and torch-fsdp2 take all but NO_SHARD.

``--precision fp32|bf16|fp16``, ``--autocast`` and ``--checkpoint none|full|selective`` compose
with the strategies as their records say (``validate`` names the few exceptions and the fix):
a ``policy_cast`` record casts parameters with its MixedPrecision policy, the others compute
under autocast; fp16 adds the gradient scaler, so a record with its own train step takes bf16.

The parity contract: with the same ``--seed``, ``--model`` and global batch,
every strategy's ``losses`` in ``metrics.json`` equal ``--strategy single``'s
within tolerance (tests/test_train.py). ``--batch-size`` is the *global*
batch: with 4 ranks and ``--grad-accum 2`` each rank runs micro-batches of
``batch_size / 8`` sequences, and the 8 slices together are exactly the batch
one process would see (``minifsdp.data.get_batch``).

Run it from a shell (``python -m minifsdp.train --strategy ddp --world-size 2``: ranks started
by ``minifsdp.launch``) or under torchrun, on one machine or many (env:// rendezvous)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 -m minifsdp.train --strategy fsdp

Writes ``metrics.json``, ``trace.json`` (Perfetto), ``timeline.png``, ``memory.png`` to ``--out``;
``--save-every K`` checkpoints to ``<out>/checkpoints/step_N``, ``--resume DIR`` goes on from one
(``minifsdp.save_resume``: atomic, every strategy, any data-parallel world size).
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
from typing import Any

import torch
import torch.distributed as tdist

from . import calibrate, data, dist, faults, models, phases, save_resume, torch_reference, trace
from .launch import launch
from .layout import MULTI_STAGE_SCHEDULES
from .mixed_precision import PRECISIONS
from .records import RoutingCounter, Strategy, TrainConfig, apply_checkpointing, autocast
from .strategies import STRATEGIES

__all__ = ["TrainConfig", "STRATEGIES", "train", "run_rank", "validate", "parse_args", "main"]


def validate(cfg: TrainConfig) -> None:
    """One-line errors that name the fix, before any process starts."""
    record = STRATEGIES.get(cfg.strategy)
    if record is None:
        raise ValueError(f"unknown strategy {cfg.strategy!r}; choose one of: {', '.join(STRATEGIES)}")
    options = record.sharding_options
    if options and cfg.sharding_strategy not in options:
        raise ValueError(f"--strategy {cfg.strategy} does not take sharding strategy {cfg.sharding_strategy!r}; "
                         f"choose one of: {', '.join(options)}")
    if cfg.model not in models.MODEL_PRESETS:
        raise ValueError(f"unknown model {cfg.model!r}; choose one of: {', '.join(models.MODEL_PRESETS)}")
    # the degrees first: --pp 0 must be blamed on --pp, not on the --world-size derived from it
    for flag in ("steps", "pp", "dp", "tp", "cp", "ep", "micro_batches", "virtual_stages", "grad_accum", "world_size"):
        if getattr(cfg, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(cfg, flag)}")
    if cfg.prefetch not in ("BACKWARD_PRE", "BACKWARD_POST", "NONE"):
        raise ValueError(f"--prefetch must be BACKWARD_PRE, BACKWARD_POST or NONE, got {cfg.prefetch!r}")
    if not cfg.lr >= 0:
        raise ValueError(f"--lr must be a non-negative learning rate, got {cfg.lr}")
    if cfg.checkpoint not in ("none", "full", "selective"):
        raise ValueError(f"--checkpoint must be none, full or selective, got {cfg.checkpoint!r}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if (cfg.precision != "fp32" or cfg.autocast) and not record.takes_precision:
        takes = ", ".join(name for name, r in STRATEGIES.items() if r.takes_precision)
        raise ValueError(f"--precision/--autocast are not wired into --strategy {cfg.strategy} yet; use them "
                         f"with {takes}")
    if cfg.precision == "fp16" and record.own_train_step and "pp" not in record.degrees:
        raise ValueError(f"--strategy {cfg.strategy} runs its own train step without loss scaling, which fp16 "
                         "needs: use --precision bf16")
    pipeline = "pp" in record.degrees
    if pipeline:
        _validate_pipeline(cfg)
    layout = record.layout(cfg)
    layout.validate(cfg.world_size, models.MODEL_PRESETS[cfg.model].n_layer + 2 if pipeline else None,
                    what=f"--strategy {cfg.strategy}", model=cfg.model)
    record.check_config(cfg, layout)  # a MoE model where it cannot run; cp's sequence split, ep's experts
    if pipeline and cfg.batch_size % (layout.dp * cfg.micro_batches):
        raise ValueError(f"--batch-size {cfg.batch_size} must split into {layout.dp} replica(s) x "
                         f"{cfg.micro_batches} micro-batches: use a multiple of {layout.dp * cfg.micro_batches}")
    if "tp" in record.degrees:
        _validate_tensor_parallel(cfg, record, layout.tp)
    per = layout.dp * cfg.grad_accum
    if cfg.batch_size < per or cfg.batch_size % per:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of world size x grad accum = {per} "
                         f"(e.g. --batch-size {max(per, cfg.batch_size // per * per or per)})")
    block = models.MODEL_PRESETS[cfg.model].block_size
    if cfg.seq_len is not None and not 1 <= cfg.seq_len <= block:
        raise ValueError(f"--seq-len must be between 1 and the model's block size {block}, got {cfg.seq_len}")
    _check_writable(cfg.out)
    save_resume.check_resume(cfg, record)  # a complete checkpoint of this model, strategy and split


def _validate_pipeline(cfg: TrainConfig) -> None:
    if cfg.precision == "fp16":
        raise ValueError(f"--strategy {cfg.strategy}: fp16 needs its loss scaled inside the pipeline schedule, "
                         "which train_step does not do: use --precision bf16")
    if cfg.checkpoint != "none" and cfg.schedule == "zero-bubble":
        raise ValueError("--schedule zero-bubble splits backward into input and weight passes, which recompute "
                         "(--checkpoint) does not support here: use --checkpoint none or another schedule")
    if cfg.virtual_stages != 1 and cfg.schedule not in MULTI_STAGE_SCHEDULES:
        raise ValueError(f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved or zero-bubble")
    if cfg.grad_accum != 1:
        raise ValueError("a pipeline accumulates over its micro-batches: use --micro-batches, not --grad-accum")


def _validate_tensor_parallel(cfg: TrainConfig, record: Strategy, tp: int) -> None:
    from .tensor_parallel import check_divisible

    if record.is_torch and (cfg.grad_accum != 1 or cfg.sequence_parallel):
        raise ValueError(f"--strategy {cfg.strategy} runs one micro-batch per step without sequence parallel: "
                         "drop --grad-accum / --sequence-parallel")
    config = models.MODEL_PRESETS[cfg.model]
    check_divisible(config, tp, cfg.seq_len or config.block_size, cfg.sequence_parallel)


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
    record = STRATEGIES[cfg.strategy]
    seq_len = cfg.seq_len or models.MODEL_PRESETS[cfg.model].block_size
    tracer = trace.Tracer(rank=rank, strategy=cfg.strategy)
    tracker = _memory_tracker(cfg, device)
    losses, step_times, allocations = [], [], []  # allocations: per step, what the tracker saw (phases.py)
    # torch's strategies do not go through minifsdp.comm: count their collectives here (DTensor's too)
    counter = (torch_reference.count_collectives(pipelining="pp" in record.degrees) if record.is_torch
               else nullcontext())
    with tracer, tracker or nullcontext(), counter:
        model = models.build_model(cfg.model, seed=cfg.seed).to(device)
        n_params = models.count_parameters(model)
        if tracker is not None:
            tracker.track_model(model)
        if cfg.checkpoint != "none" and not record.checkpoints_split_blocks:
            apply_checkpointing(model, cfg.checkpoint, record.implementation)  # then wrap: PyTorch's recipe order
        with trace.span("wrap"):
            built = record.build(model, cfg, record.layout(cfg))
        model, optimizer = built.model, built.optimizer
        routing = RoutingCounter(model)  # a MoE model's kept assignments per expert (a hook; {} for a dense one)
        if tracker is not None:
            tracker.track_model(model)
            tracker.track_optimizer(optimizer)
        # Which slice of the global batch this rank reads: its own, or its replica's.
        data_rank = rank if built.data_rank is None else built.data_rank
        data_world = world if built.data_size is None else built.data_size
        scaler = record.grad_scaler(cfg, device)   # fp16 only; a pass-through otherwise
        checkpointer = save_resume.Checkpointer(cfg, record, built, scaler)
        first = checkpointer.resume()  # --resume: the step to run next (its data position), else 0
        for step in range(first, cfg.steps):
            faults.inject(step)  # MINIFSDP_FAULT=RANK:MODE:STEP fails a rank on purpose (lab 12's gallery)
            start = time.perf_counter()
            with trace.span("step", step=step):
                local = torch.zeros((), device=device)
                for m in range(cfg.grad_accum):
                    x, y = data.get_batch(step, cfg.batch_size, seq_len, seed=cfg.seed, rank=data_rank,
                                          world_size=data_world, micro_step=m, grad_accum=cfg.grad_accum)
                    x, y = built.local_batch(x.to(device), y.to(device))  # cp: this rank's share of each
                    last = m == cfg.grad_accum - 1
                    sync = built.micro_batch(last)  # no gradient sync before the last micro-batch
                    if built.train_step is not None:  # a pipeline runs forward and backward itself
                        with trace.span("forward_backward", step=step, micro=m):
                            loss = built.train_step(x, y) / cfg.grad_accum
                    else:
                        with sync:
                            with (trace.span("forward", step=step, micro=m),
                                  autocast(cfg, device, record.policy_cast)):
                                logits = model(x)  # 16-bit under a policy or autocast: the loss in fp32
                                loss = built.loss(logits.float(), y)  # (a no-op in fp32; + a MoE's aux loss)
                                loss = loss / cfg.grad_accum
                            with trace.span("backward", step=step, micro=m):
                                scaler.scale(loss).backward()
                    local += loss.detach()
                with trace.span("optimizer", step=step):
                    built.finish_backward()  # ep: gradients all-reduced once the last backward is done
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - start)
            losses.append(_global_mean(local))
            if tracker is not None:
                tracker.snapshot(f"step {step}")
                allocations.append(tracker.take_allocations())  # what this step asked the allocator for
            if rank == 0 and not cfg.quiet:
                _progress(step, cfg.steps, losses[-1], step_times[-1])
            checkpointer.maybe_save(step + 1)  # --save-every: after the step, outside its span
    report = tracker.report() if tracker is not None else {}
    return {"rank": rank, "losses": losses, "step_time_s": step_times, "trace": tracer.trace, "allocations": allocations,
            "memory": report, "n_params": n_params, "routing": routing.totals(), "first_step": first}


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
        dist.init(timeout_s=cfg.timeout)
        faults.install()  # a failing rank prints its one-line cause before torchrun's report
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
        if not STRATEGIES[cfg.strategy].degrees:
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
        "losses": results[0]["losses"], "first_step": results[0]["first_step"],  # --resume: losses from there
        "step_time_s": [r["step_time_s"] for r in results],
        "median_step_time_s": [statistics.median(r["step_time_s"]) for r in results],
        "minor_faults": [phases.step_faults(t) for t in traces],  # per rank, per step (getrusage; None on Windows)
        "phases": [phases.step_phases(t) for t in traces],  # per rank, per step: seconds by phase
        "allocated_by_class": [[phases.size_classes(a) for a in r["allocations"]] for r in results],
        "peak_bytes": [r["memory"].get("peak_total") for r in results],
        "peak_by_category": [r["memory"].get("peak_by_category") for r in results],
        "bytes_per_step": [{op: b / cfg.steps for op, b in t.bytes_by_op(within="step").items()} for t in traces],
        "routing": [r.get("routing", {}) for r in results],  # MoE: per rank, layer -> kept assignments per expert
        "config": dataclasses.asdict(cfg),
    }
    with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    trace.save_chrome_trace(traces, os.path.join(cfg.out, "trace.json"))
    if cfg.write_plots:
        _save_plots(cfg, traces)
    if not cfg.quiet:
        print(summary_table(metrics))
        print(calibrate.predicted_line(cfg, metrics))  # the planner's step time from runs/calibration.json
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
                   help="FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD (fsdp*, torch-fsdp*; no NO_SHARD in FSDP2)")
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
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks per sequence (cp; x --dp replicas)")
    p.add_argument("--cp-split", default="zigzag", choices=["zigzag", "naive"], help="how cp cuts each sequence")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (ep, MoE models; divides --world-size)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps to <out>/checkpoints")
    p.add_argument("--resume", default=None, help="a checkpoints folder (its latest complete step) or a step_N")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    flags = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(a, f.name)}
    cfg = TrainConfig(**{**flags, "world_size": 2 if a.world_size is None else a.world_size},
                      track_memory=not a.no_memory)
    record = STRATEGIES.get(a.strategy)  # an unknown name: validate says so
    if a.world_size is None and record is not None:  # the layout's; data parallel alone at 2 ranks
        cfg.world_size = record.default_world_size(cfg)
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    try:
        train(cfg)
    except ValueError as exc:  # bad input: one line, no traceback
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
