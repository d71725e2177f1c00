"""Benchmark minifsdp's strategies side by side with PyTorch's own, in one run.

Front layer. ``python -m minifsdp.bench`` trains the same model on the same data with each side of a
pair (``ddp`` vs ``torch-ddp``, ``fsdp`` vs ``torch-fsdp``, ...; ``fsdp2`` vs ``fsdp`` puts our
per-parameter and flat-unit FSDP side by side) at each world size, alternating the order of the pair
between repeats so that a noisy machine hurts both sides alike, and reports medians and ratios (ours /
the reference, torch's in every pair but ``fsdp2:fsdp``):

* step time — the median over the steps after ``--warmup``, then the median over repeats (timing
  runs do *not* track memory: tracking costs ~1.3x);
* peak memory — one extra short run per side with the memory tracker;
* bytes moved per step — from the tracer's comm spans, in the ZeRO paper's units
  (``comm.collective_bytes``). minifsdp records its own collectives; torch's are counted by
  ``torch_reference.count_collectives`` (and a DDP comm hook for DDP's C++ all-reduce), so both columns
  are measured. The third column, *expected*, is ``estimate.comm_bytes_per_step`` for the model's
  structure (``expected_bytes``; ``estimate.fully_shard_comm_bytes`` for fsdp2, padded per parameter),
  padding included; minifsdp must move exactly that. *paper* is the ZeRO paper's k·4Ψ bytes for Ψ fp32
  parameters (``estimate.paper_comm_bytes``).
* same losses — both sides' losses agree (rel 1e-5): they trained the same.
* predicted — each side's step from ``calibrate.predict_run`` (the planner's bytes and FLOPs through
  ``--calibration``, measured first by ``python -m minifsdp.calibrate`` when the file is missing).
* ``--pin-malloc`` fixes glibc's malloc thresholds for every worker of both sides (``PINNED_MALLOC``).
  glibc raises its mmap threshold to the largest block freed so far, so a side that frees one big
  temporary each step (torch's bf16 compress hook: a 13 MB bf16 copy per bucket) keeps later mid-sized
  blocks (AdamW's temporaries) on the heap, while the other side has them mapped and page-faulted again
  every step (README's bench section has the measurement).
* activations (with any ``side#full``/``side#selective``) — what autograd holds after one rank's
  forward, per ``--checkpoint`` mode: ``estimate``'s prediction beside the memory tracker's
  measurement (``activation_rows``).

A side is ``strategy[@OPTION][#CHECKPOINT][%PRECISION]``, parsed once into a ``Side``: the option is
the sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD) or, for pipelines, the
schedule (for cp, the split); ``#full`` / ``#selective`` the activation checkpointing; ``%bf16`` /
``%fp16`` / ``%autocast`` the precision::

    python -m minifsdp.bench --model gpt-small --world-sizes 2 4 \\
        --pairs ddp:torch-ddp fsdp@SHARD_GRAD_OP:torch-fsdp@SHARD_GRAD_OP
    python -m minifsdp.bench --preset sharding    # DDP / ZeRO / every FSDP sharding strategy vs torch
    python -m minifsdp.bench --preset checkpoint  # side#full, side#selective: activation checkpointing
    python -m minifsdp.bench --preset pipeline    # pp@SCHEDULE vs torch-pp@SCHEDULE
    python -m minifsdp.bench --preset precision   # side%bf16 (MixedPrecision policy), side%autocast
    python -m minifsdp.bench --preset context     # cp@zigzag / cp@naive vs single: full attention, one rank
    python -m minifsdp.bench --preset experts     # ep vs single: the MoE on one process (gpt-moe-small)

HYBRID_SHARD is 2 x (N/2) ranks on one machine (at world size 2: shard 1 x replicate 2). There torch's
FSDP1 switches a shard group of one to NO_SHARD *within* that group (it warns), so its replicas never
synchronise and its losses drift from one process's: the "same losses" column says no.

Writes ``bench.json`` and prints a table; README.md quotes it. Read first: ``train.py`` (each run is
one ``train()``) and ``estimate.py`` (the expected bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
from typing import Any

import torch

from . import calibrate, estimate, models
from .memory import ACTIVATIONS, MemoryTracker
from .records import TrainConfig, apply_checkpointing
from .train import STRATEGIES, train, validate

PRESETS: dict[str, tuple[str, ...]] = {
    # ZeRO-1/2/3 and each sharding strategy beside torch's own
    "sharding": ("ddp:torch-ddp", "zero1:torch-zero1", "zero2:torch-fsdp@SHARD_GRAD_OP",
                 "fsdp@FULL_SHARD:torch-fsdp@FULL_SHARD", "fsdp@SHARD_GRAD_OP:torch-fsdp@SHARD_GRAD_OP",
                 "fsdp@NO_SHARD:torch-fsdp@NO_SHARD", "fsdp@HYBRID_SHARD:torch-fsdp@HYBRID_SHARD",
                 "fsdp@FULL_SHARD:torch-fsdp2", "fsdp@SHARD_GRAD_OP:torch-fsdp2@SHARD_GRAD_OP",
                 # per-parameter sharding (fully_shard) beside torch's, and beside our flat-unit FSDP
                 "fsdp2:torch-fsdp2", "fsdp2:fsdp"),
    # activation checkpointing of every Block (train --checkpoint), ours beside torch's checkpoint_wrapper
    "checkpoint": ("fsdp:torch-fsdp", "fsdp#full:torch-fsdp#full", "fsdp#selective:torch-fsdp#selective"),
    # mixed precision (train --precision / --autocast): side%bf16 casts FSDP's parameters (a MixedPrecision
    # policy, torch's own on torch's side), side%autocast runs forward under torch.autocast. %fp16 adds the
    # gradient scaler: ShardedGradScaler beside torch's (FSDP), GradScaler beside torch.amp's (DDP).
    "precision": ("fsdp:torch-fsdp", "fsdp%bf16:torch-fsdp%bf16", "fsdp%autocast:torch-fsdp%autocast",
                  "fsdp#full%bf16:torch-fsdp#full%bf16", "fsdp%bf16:torch-fsdp2%bf16", "fsdp2%bf16:torch-fsdp2%bf16",
                  "fsdp2%bf16:fsdp%bf16", "ddp%bf16:torch-ddp%bf16",
                  "fsdp%fp16:torch-fsdp%fp16", "ddp%fp16:torch-ddp%fp16"),
    # each pipeline schedule beside torch.distributed.pipelining's (pp = world size, m = 2 x pp
    # micro-batches, v = 2 stages per rank for interleaved and zero-bubble)
    "pipeline": ("pp@gpipe:torch-pp@gpipe", "pp@1f1b:torch-pp@1f1b", "pp@interleaved:torch-pp@interleaved",
                 "pp@zero-bubble:torch-pp@zero-bubble"),
    # Megatron tensor parallel beside torch.distributed.tensor.parallel (tp = world size);
    # tp%bf16: autocast, its forward all-reduces 16-bit
    "tensor": ("tp:torch-tp", "fsdp+tp:torch-fsdp+tp", "tp#full:torch-tp#full", "tp%bf16:torch-tp%bf16"),
    # torch's context_parallel does not run on CPU (tests/test_context_parallel.py): ring attention (cp = world
    # size, each split) against full attention on one rank doing the same total work
    "context": ("cp@zigzag:single", "cp@naive:single"),
    # expert parallel (ep = world size, dropless all-to-all) against the single-process MoE
    "experts": ("ep:single",),
}
# A preset's model when --model is not given: tensor parallel at 4 ranks needs heads divisible by 4
# (gpt-small has 6). On a CPU without AVX512-BF16 bf16 is emulated and slow: run --preset precision
# with --model gpt-mini there.
PRESET_MODELS = {"tensor": "gpt-mini", "experts": "gpt-moe-small"}
LOSS_RTOL = 1e-5  # fp32, a few AdamW steps: as tests/test_train.py


@dataclasses.dataclass
class BenchConfig:
    model: str = "gpt-small"
    world_sizes: tuple[int, ...] = (2, 4)
    pairs: tuple[str, ...] = ("ddp:torch-ddp",)
    steps: int = 8
    warmup: int = 2
    repeats: int = 3
    batch_size: int = 8
    out: str = "runs/bench"
    memory: bool = True
    pin_malloc: bool = False
    calibration: str | None = None  # a calibrate JSON: predicted step times beside the measured


# --pin-malloc: glibc's mmap threshold (no dynamic raising) and trim threshold, inherited by every worker
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}

PRECISION_SUFFIXES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "fp16": ("fp16", False),
                      "autocast": ("fp32", True)}
LOSS_RTOL_BY_PRECISION = {"fp32": LOSS_RTOL, "bf16": 2.0**-8, "fp16": 2.0**-11}  # one ulp of the compute dtype


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a pair, ``name@option#checkpoint%precision`` parsed once: ``Side.parse("fsdp@SHARD_GRAD_OP#full")``."""

    text: str
    name: str
    option: str | None = None      # the sharding strategy, or a pipeline's schedule
    checkpoint: str = "none"       # none | full | selective
    precision: str = "fp32"
    autocast: bool = False

    @classmethod
    def parse(cls, side: str) -> "Side":
        head, _, precision = side.partition("%")
        head, _, mode = head.partition("#")
        if "#" in precision:  # "%bf16#full" as well as "#full%bf16"
            precision, _, mode = precision.partition("#")
        name, _, option = head.partition("@")
        record = STRATEGIES.get(name)
        if record is None:
            raise ValueError(f"unknown strategy {name!r} in --pairs; choose from: {', '.join(STRATEGIES)}")
        options = record.option_choices
        if option and not options:
            takes = ", ".join(n for n, r in STRATEGIES.items() if r.option_choices)
            raise ValueError(f"{name!r} takes no @option in --pairs (only {takes} do); write {name!r} alone")
        if option and option not in options:
            raise ValueError(f"unknown option {option!r} for {name} in --pairs; choose from: {', '.join(options)}")
        if (mode or "none") not in ("none", "full", "selective"):
            raise ValueError(f"unknown checkpointing {mode!r} in --pairs side {side!r}; write side#full or "
                             "side#selective")
        if (precision or "fp32") not in PRECISION_SUFFIXES:
            raise ValueError(f"unknown precision {precision!r} in --pairs side {side!r}; write side%bf16, side%fp16 "
                             "or side%autocast")
        dtype, autocast = PRECISION_SUFFIXES[precision or "fp32"]
        return cls(side, name, option or None, mode or "none", dtype, autocast)

    @property
    def record(self) -> Any:
        return STRATEGIES[self.name]

    @property
    def loss_rtol(self) -> float:
        return LOSS_RTOL_BY_PRECISION["bf16" if self.autocast else self.precision]

    def train_config(self, model: str, world_size: int, batch_size: int = 8, **kw: Any) -> TrainConfig:
        """The trainer's config for this side at ``world_size`` ranks (``Strategy.bench_flags``: a pipeline over
        all of them, tp = world size, fsdp+tp's 2D as (world/2) x 2, cp / ep = world size, single on one rank)."""
        return TrainConfig(strategy=self.name, model=model, batch_size=batch_size, checkpoint=self.checkpoint,
                           precision=self.precision, autocast=self.autocast,
                           **self.record.bench_flags(world_size, self.option), **kw)


def parse_pair(pair: str) -> tuple[Side, Side]:
    """``"ours:theirs"``, each side parsed by ``Side.parse``."""
    sides = pair.split(":")
    if len(sides) != 2 or not all(sides):
        raise ValueError(f"a pair is ours:theirs, e.g. fsdp@FULL_SHARD:torch-fsdp@FULL_SHARD; got {pair!r}")
    return Side.parse(sides[0]), Side.parse(sides[1])


def _config(cfg: BenchConfig, side: Side | str, world_size: int, track_memory: bool, steps: int,
            out: str) -> TrainConfig:
    side = side if isinstance(side, Side) else Side.parse(side)
    return side.train_config(cfg.model, world_size, cfg.batch_size, steps=steps, quiet=True, out=out,
                             track_memory=track_memory, write_plots=False)


def _run(cfg: BenchConfig, side: Side, world_size: int, track_memory: bool, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return train(_config(cfg, side, world_size, track_memory, steps, tmp))


def _median_step(metrics: dict[str, Any], warmup: int) -> float:
    """Median over steps after warm-up of the slowest rank's step time (a step ends when all ranks do)."""
    per_step = [max(times) for times in zip(*metrics["step_time_s"])]
    return statistics.median(per_step[warmup:] or per_step)


# --------------------------------------------------------------------------
# Expected bytes: what minifsdp's side must move, from the model's structure
# --------------------------------------------------------------------------

def expected_bytes(model_name: str, side: str | Side, world_size: int, batch_size: int = 8) -> dict[str, Any]:
    """Bytes per step minifsdp's ``side`` moves as ``train.py`` sets it up: its record's ``expected_bytes``
    (``minifsdp.strategies``: ``estimate`` for data parallel, ``planner`` for pipeline and tensor parallel),
    on the layout the trainer runs. ``"total"`` is exact (padding, the root rule), ``"paper"`` the ZeRO
    paper's k·4Ψ (``estimate.paper_comm_bytes``; None where the paper has no row, e.g. HYBRID_SHARD).

    >>> e = expected_bytes("gpt-tiny", "fsdp@FULL_SHARD", 2)   # Ψ = 42,880 parameters, 4Ψ = 171,520 B
    >>> e["paper"], e["total"], e["by_op"]["all_gather"]       # 3·4Ψ; 3·4Ψ - 4Ψ_root
    (514560, 444672, 273152)
    """
    side = side if isinstance(side, Side) else Side.parse(side)
    if side.record.expected_bytes is None:
        raise ValueError(f"no expected bytes for {side.text!r}: it is not one of minifsdp's strategies")
    cfg = side.train_config(model_name, world_size, batch_size)
    return side.record.expected_bytes(cfg, side.record.layout(cfg))


# --------------------------------------------------------------------------
# One pair at one world size
# --------------------------------------------------------------------------

def bench_pair(cfg: BenchConfig, ours_side: Side, theirs_side: Side, world_size: int) -> dict[str, Any]:
    parsed = {ours_side.text: ours_side, theirs_side.text: theirs_side}
    ours, theirs = ours_side.text, theirs_side.text
    times: dict[str, list[float]] = {ours: [], theirs: []}
    moved: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    for rep in range(cfg.repeats):
        order = (ours, theirs) if rep % 2 == 0 else (theirs, ours)
        for side in order:
            m = _run(cfg, parsed[side], world_size, track_memory=False, steps=cfg.steps)
            times[side].append(_median_step(m, cfg.warmup))
            # bytes: rank 0 of the first run (every run moves the same); torch's are counted too
            moved.setdefault(side, sum(m["bytes_per_step"][0].values()))
            losses.setdefault(side, m["losses"])
            print(f"  world {world_size}  repeat {rep + 1}/{cfg.repeats}  {side:<26} "
                  f"{times[side][-1] * 1e3:8.1f} ms/step", flush=True)
    row: dict[str, Any] = {"world_size": world_size, "ours": ours, "theirs": theirs,
                           "step_s": {k: statistics.median(v) for k, v in times.items()},
                           "step_s_all": times, "bytes_per_step": moved, "losses": losses}
    row["step_ratio"] = row["step_s"][ours] / row["step_s"][theirs]
    if cfg.calibration:  # torch's side moves and computes what ours does: the same model, its own record
        row["predicted_s"] = {k: calibrate.predicted_seconds(s.train_config(cfg.model, world_size, cfg.batch_size),
                                                             cfg.calibration) for k, s in parsed.items()}
    row["same_losses"] = all(math.isclose(a, b, rel_tol=ours_side.loss_rtol)
                             for a, b in zip(losses[ours], losses[theirs]))
    expected = expected_bytes(cfg.model, ours_side, world_size, cfg.batch_size)
    row["n_params"] = expected["n_params"]
    row["bytes_expected"], row["bytes_expected_by_op"] = expected["total"], expected["by_op"]
    row["bytes_paper"], row["bytes_paper_key"] = expected["paper"], expected["paper_key"]
    row["bytes_match"] = None if expected["total"] is None or not expected.get("exact", True) else \
        moved[ours] == expected["total"]  # ep's all-to-alls: the uniform routing's, exact only on average
    if cfg.memory:
        peaks = {}
        for side in (ours, theirs):
            m = _run(cfg, parsed[side], world_size, track_memory=True, steps=2)
            peaks[side] = max(p for p in m["peak_bytes"] if p is not None)
        row["peak_bytes"] = peaks
        row["peak_ratio"] = peaks[ours] / peaks[theirs]
    return row


# --------------------------------------------------------------------------
# Activations: estimate's prediction beside the tracker, per --checkpoint mode
# --------------------------------------------------------------------------

def activation_rows(model_name: str, batch: int) -> list[dict[str, Any]]:
    """Bytes autograd holds after one forward of ``batch`` sequences (one rank's share), for each
    ``--checkpoint`` mode: ``estimate.gpt_checkpoint_activation_bytes`` and the memory tracker's
    ``activations`` after the forward, on one process (sharding changes parameters, not activations).
    The tracker also sees the 4-byte loss itself, which the estimate (what backward saves) leaves out."""
    config = models.MODEL_PRESETS[model_name]
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g) for _ in range(2))
    rows = []
    for mode in ("none", "full", "selective"):
        model = models.build_model(model_name, seed=0)
        if mode != "none":  # as train --checkpoint wraps minifsdp's sides
            apply_checkpointing(model, mode)
        tracker = MemoryTracker()
        tracker.track_model(model)
        with tracker:
            loss = models.lm_loss(model(x.clone()), y.clone())  # ids made inside count, as in training
            measured = tracker.snapshot()[ACTIVATIONS]
            loss.backward()
        tracker.close()
        predicted = estimate.gpt_checkpoint_activation_bytes(config, batch, config.block_size, checkpoint=mode)
        rows.append({"checkpoint": mode, "batch": batch, "predicted": predicted["total"], "measured": measured})
    return rows


def activation_table(rows: list[dict[str, Any]]) -> str:
    mib = 2 ** 20
    lines = ["| sequences per rank | --checkpoint | predicted MiB | measured MiB | measured − predicted (B) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['checkpoint']} | {r['predicted'] / mib:.3f} | {r['measured'] / mib:.3f} | "
                     f"{r['measured'] - r['predicted']:+d} |")
    return "\n".join(lines)


_PAPER_LABEL = {k: f"{v}·4Ψ" for k, v in estimate.ZERO_PAPER_PSI.items()}  # Ψ fp32 parameters


def table(rows: list[dict[str, Any]]) -> str:
    """The README table: one line per pair and world size."""
    mib = 2 ** 20
    head = ("| world | minifsdp | reference | step ms (ours / ref) | predicted ms (ours / ref) | step ratio | peak MiB"
            " (ours / ref) | peak ratio | MiB moved per step (ours / ref / expected) | paper | ours = expected "
            "| same losses |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        ours, theirs = r["ours"], r["theirs"]
        s, peak, moved, p = r["step_s"], r.get("peak_bytes"), r["bytes_per_step"], r.get("predicted_s")
        peak_txt = f"{peak[ours] / mib:.1f} / {peak[theirs] / mib:.1f}" if peak else "-"
        peak_ratio = f"{r['peak_ratio']:.3f}" if peak else "-"
        expected = "-" if r["bytes_expected"] is None else f"{r['bytes_expected'] / mib:.3f}"
        moved_txt = f"{moved[ours] / mib:.3f} / {moved[theirs] / mib:.3f} / {expected}"
        paper = (f"{_PAPER_LABEL[r['bytes_paper_key']]} = {r['bytes_paper'] / mib:.3f}"
                 if r["bytes_paper"] is not None else "-")
        predicted = " / ".join("-" if p[k] is None else f"{p[k] * 1e3:.0f}" for k in (ours, theirs)) if p else "-"
        lines.append(f"| {r['world_size']} | {ours} | {theirs} | {s[ours] * 1e3:.1f} / {s[theirs] * 1e3:.1f} | "
                     f"{predicted} | {r['step_ratio']:.3f} | {peak_txt} | {peak_ratio} | {moved_txt} | {paper} | "
                     f"{({True: 'yes', False: 'NO'}).get(r['bytes_match'], '-')} | "
                     f"{'yes' if r['same_losses'] else 'NO'} |")
    return "\n".join(lines)


def run(cfg: BenchConfig) -> list[dict[str, Any]]:
    pairs = [parse_pair(p) for p in cfg.pairs]  # every error before the first run
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.pin_malloc:  # read by glibc when each worker process starts
        os.environ.update(PINNED_MALLOC)
        print("glibc malloc pinned for every worker: " + ", ".join(f"{k}={v}" for k, v in PINNED_MALLOC.items()))
    for side in {side for pair in pairs for side in pair}:
        for world_size in cfg.world_sizes:
            validate(_config(cfg, side, world_size, False, cfg.steps, cfg.out))
    rows = []
    for ours, theirs in pairs:
        for world_size in cfg.world_sizes:
            print(f"{ours.text} vs {theirs.text}, {cfg.model}, world size {world_size}", flush=True)
            rows.append(bench_pair(cfg, ours, theirs, world_size))
    activations = []  # estimate vs tracker, when a pair checkpoints
    # data-parallel sides only: tensor and pipeline parallel split the activations themselves
    if any(side.checkpoint != "none" and side.record.degrees in (("dp",), ()) for pair in pairs for side in pair):
        for world_size in cfg.world_sizes:
            activations += activation_rows(cfg.model, cfg.batch_size // world_size)
    with open(os.path.join(cfg.out, "bench.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "rows": rows, "activations": activations}, f, indent=1)
    print(table(rows))
    if activations:
        print("\nActivations after one rank's forward (" + cfg.model + "):\n" + activation_table(activations))
    print(f"\nwrote {cfg.out}/bench.json")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minifsdp.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default gpt-small (--preset tensor: gpt-mini)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--pairs", nargs="+", default=None,
                   help="ours:theirs pairs; a side is strategy[@OPTION][#CHECKPOINT][%PRECISION] (default ddp:torch-ddp)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named list of pairs (sharding: DDP/ZeRO/FSDP; pipeline: every pp schedule; tensor: tp, fsdp+tp)")
    for flag, default in (("--steps", 8), ("--warmup", 2), ("--repeats", 3), ("--batch-size", 8)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--calibration", default=calibrate.DEFAULT_PATH, help="calibrate's JSON (measured first if missing)")
    p.add_argument("--pin-malloc", action="store_true",
                   help="fix glibc's malloc thresholds for both sides' workers (see the module docstring)")
    a = p.parse_args(argv)
    pairs = (*PRESETS.get(a.preset, ()), *(a.pairs or ())) or ("ddp:torch-ddp",)
    cfg = BenchConfig(model=a.model or PRESET_MODELS.get(a.preset, "gpt-small"), world_sizes=tuple(a.world_sizes), pairs=pairs, steps=a.steps,
                      warmup=a.warmup, repeats=a.repeats, batch_size=a.batch_size, out=a.out,
                      memory=not a.no_memory, pin_malloc=a.pin_malloc, calibration=a.calibration)
    try:
        if not os.path.exists(a.calibration):
            calibrate.calibrate((1, *a.world_sizes)).save(a.calibration)
        run(cfg)
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
