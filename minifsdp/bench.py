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
* ``--malloc both`` runs every timing run twice, unpinned (as users run) and pinned: the table gets the
  pinned ratio beside the unpinned one. Each run's minor page faults per step (``trace.minor_faults``,
  getrusage) are a column too.
* ``--compute`` (fp32 data-parallel pairs): a third side, ``COMPUTE``, every rank training its share of
  the batch alone with no collectives (strategy single on each rank, checkpointed as ours is); the table
  divides each side's step by it, how far above the floor of its own compute each implementation is.
* ``--phases`` (``phases.py``): per side, the median milliseconds of forward, backward, comm wait (the
  main thread off the CPU: blocked in a wait or a blocking collective), optimizer and the rest, page
  faults per step, and what its third step allocated by size class (the memory tracker's run).
* activations (with any ``side#full``/``side#selective``) — what autograd holds after one rank's
  forward, per ``--checkpoint`` mode: ``estimate``'s prediction beside the memory tracker's
  measurement (``activation_rows``).

A side is ``strategy[@OPTION][#CHECKPOINT][%PRECISION]``, parsed once into a ``Side`` (``bench_sides.py``): the option is
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
    python -m minifsdp.bench --preset overview --malloc both --compute --phases   # one pair per technique

HYBRID_SHARD is 2 x (N/2) ranks on one machine (at world size 2: shard 1 x replicate 2). There torch's
FSDP1 switches a shard group of one to NO_SHARD *within* that group (it warns), so its replicas never
synchronise and its losses drift from one process's: the "same losses" column says no.

Writes ``bench.json`` and prints a table; README.md quotes it. Read first: ``train.py`` (each run is
one ``train()``) and ``estimate.py`` (the expected bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
from typing import Any, Iterator

from . import calibrate, phases
from .bench_report import activation_rows, activation_table, phase_rows, table
from .bench_sides import PRESET_MODELS, PRESETS, Side, parse_pair
from .records import TrainConfig
from .launch import launch
from .train import run_rank, train, validate, write_outputs



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
    pin_malloc: bool = False  # the same as malloc="pinned"
    calibration: str | None = None  # a calibrate JSON: predicted step times beside the measured
    malloc: str = "default"  # default | pinned (PINNED_MALLOC for both sides) | both (each run in both)
    phases: bool = False     # where the time goes, page faults, allocations by size class (phases.py)
    compute: bool = False    # data-parallel pairs: also the compute-only floor (COMPUTE)

    def malloc_modes(self) -> tuple[bool, ...]:
        """Pinned or not, for each timing run: (False,), (True,) or (False, True)."""
        mode = "pinned" if self.pin_malloc else self.malloc
        if mode not in ("default", "pinned", "both"):
            raise ValueError(f"unknown --malloc {mode!r}; choose default, pinned or both")
        return {"default": (False,), "pinned": (True,), "both": (False, True)}[mode]


# --pin-malloc: glibc's mmap threshold (no dynamic raising) and trim threshold, inherited by every worker
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}
# --compute: each rank trains its share of the batch alone (strategy single on every rank, no gradient
# sync): the per-rank work of data parallel with no collectives, the floor its step can approach.
COMPUTE = "compute"

def _config(cfg: BenchConfig, side: Side | str, world_size: int, track_memory: bool, steps: int,
            out: str) -> TrainConfig:
    """The trainer's config for one run of ``side`` (``COMPUTE[#checkpoint]``: single, ``world_size`` ranks)."""
    compute = _is_compute(side)
    parsed = side if isinstance(side, Side) else Side.parse("single" + side[len(COMPUTE):] if compute else side)
    tc = parsed.train_config(cfg.model, world_size, cfg.batch_size, steps=steps, quiet=True, out=out,
                             track_memory=track_memory, write_plots=False)
    return dataclasses.replace(tc, world_size=world_size) if compute else tc


def _is_compute(side: Side | str) -> bool:
    return isinstance(side, str) and side.partition("#")[0] == COMPUTE


@contextlib.contextmanager
def _malloc(pinned: bool) -> Iterator[None]:
    """glibc reads its thresholds when a process starts: set (or clear) them for the workers of one run."""
    before = {k: os.environ.get(k) for k in PINNED_MALLOC}
    os.environ.update(PINNED_MALLOC) if pinned else [os.environ.pop(k, None) for k in PINNED_MALLOC]
    try:
        yield
    finally:
        for k, v in before.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _run(cfg: BenchConfig, side: Side | str, world_size: int, track_memory: bool, steps: int,
         pinned: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, _malloc(pinned):
        tc = _config(cfg, side, world_size, track_memory, steps, tmp)
        if _is_compute(side):  # single on every rank: its data slice (rank, world) and nothing else
            return write_outputs(tc, launch(run_rank, world_size, tc, timeout=tc.timeout))
        return train(tc)


def _data_parallel(*sides: Side) -> bool:
    return all(s.record.degrees == ("dp",) for s in sides)


def _median_step(metrics: dict[str, Any], warmup: int) -> float:
    """Median over steps after warm-up of the slowest rank's step time (a step ends when all ranks do)."""
    return phases.median_over_steps(metrics["step_time_s"], warmup, max)


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
    parsed: dict[str, Side | str] = {ours_side.text: ours_side, theirs_side.text: theirs_side}
    ours, theirs = ours_side.text, theirs_side.text
    compute = COMPUTE + ("" if ours_side.checkpoint == "none" else "#" + ours_side.checkpoint)  # the same recompute
    if cfg.compute and _data_parallel(ours_side, theirs_side) and (ours_side.precision, ours_side.autocast) == \
            ("fp32", False):  # (no floor for 16-bit sides: single trains in fp32)
        parsed[compute] = compute
    modes = cfg.malloc_modes()
    times: dict[bool, dict[str, list[float]]] = {m: {k: [] for k in parsed} for m in modes}
    faults: dict[bool, dict[str, list[float]]] = {m: {k: [] for k in parsed} for m in modes}
    split: dict[str, list[dict[str, float]]] = {k: [] for k in parsed}  # phases, first malloc mode's runs
    moved: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    for rep in range(cfg.repeats):
        order = list(parsed) if rep % 2 == 0 else list(parsed)[::-1]
        for pinned in modes:
            for side in order:
                m = _run(cfg, parsed[side], world_size, track_memory=False, steps=cfg.steps, pinned=pinned)
                times[pinned][side].append(_median_step(m, cfg.warmup))
                f = phases.median_faults(m.get("minor_faults") or [], cfg.warmup)
                faults[pinned][side] += [] if f is None else [f]
                run_phases = phases.median_phases(m.get("phases") or [], cfg.warmup)
                if pinned == modes[0] and run_phases:
                    split[side].append(run_phases)
                # bytes: rank 0 of the first run (every run moves the same); torch's are counted too
                moved.setdefault(side, sum(m["bytes_per_step"][0].values()))
                losses.setdefault(side, m["losses"])
                print(f"  world {world_size}  repeat {rep + 1}/{cfg.repeats}  {side:<26} "
                      f"{times[pinned][side][-1] * 1e3:8.1f} ms/step{'  (malloc pinned)' if pinned else ''}", flush=True)
    median = statistics.median
    row: dict[str, Any] = {"world_size": world_size, "ours": ours, "theirs": theirs,
                           "step_s": {k: median(v) for k, v in times[modes[0]].items()},
                           "step_s_all": {k: times[modes[0]][k] for k in (ours, theirs)},
                           "bytes_per_step": {k: moved[k] for k in (ours, theirs)},
                           "losses": {k: losses[k] for k in (ours, theirs)},
                           "faults_per_step": {k: median(v) if v else None for k, v in faults[modes[0]].items()}}
    row["step_ratio"] = row["step_s"][ours] / row["step_s"][theirs]
    if len(modes) == 2:  # --malloc both: the same pair with glibc's thresholds pinned
        row["step_s_pinned"] = {k: median(v) for k, v in times[True].items()}
        row["faults_per_step_pinned"] = {k: median(v) if v else None for k, v in faults[True].items()}
        row["step_ratio_pinned"] = row["step_s_pinned"][ours] / row["step_s_pinned"][theirs]
    if compute in parsed:  # how far above the compute-only floor each side's step is
        row["over_compute"] = {k: row["step_s"][k] / row["step_s"][compute] for k in (ours, theirs)}
    if cfg.phases:
        row["phases"] = {k: {p: median(r[p] for r in v) for p in phases.PHASES} for k, v in split.items() if v}
    if cfg.calibration:  # torch's side moves and computes what ours does: the same model, its own record
        row["predicted_s"] = {k: calibrate.predicted_seconds(s.train_config(cfg.model, world_size, cfg.batch_size),
                                                             cfg.calibration) for k, s in parsed.items() if k != compute}
    row["same_losses"] = all(math.isclose(a, b, rel_tol=ours_side.loss_rtol)
                             for a, b in zip(losses[ours], losses[theirs]))
    expected = expected_bytes(cfg.model, ours_side, world_size, cfg.batch_size)
    row["n_params"] = expected["n_params"]
    row["bytes_expected"], row["bytes_expected_by_op"] = expected["total"], expected["by_op"]
    row["bytes_paper"], row["bytes_paper_key"] = expected["paper"], expected["paper_key"]
    row["bytes_match"] = None if expected["total"] is None or not expected.get("exact", True) else \
        moved[ours] == expected["total"]  # ep's all-to-alls: the uniform routing's, exact only on average
    if cfg.memory or cfg.phases:  # one tracked run per side: peak, and what its third step allocated
        peaks, allocated = {}, {}
        for side in (ours, theirs):
            m = _run(cfg, parsed[side], world_size, track_memory=True, steps=3 if cfg.phases else 2)
            peaks[side] = max(p for p in m["peak_bytes"] if p is not None)
            allocated[side] = m["allocated_by_class"][0][-1]  # rank 0, the last step
        row["peak_bytes"], row["allocated_per_step"] = peaks, allocated
        row["peak_ratio"] = peaks[ours] / peaks[theirs]
    return row


def run(cfg: BenchConfig) -> list[dict[str, Any]]:
    pairs = [parse_pair(p) for p in cfg.pairs]  # every error before the first run
    os.makedirs(cfg.out, exist_ok=True)
    if True in cfg.malloc_modes():  # read by glibc when each worker process starts
        print(("each run also " if len(cfg.malloc_modes()) == 2 else "") + "with glibc malloc pinned for every "
              "worker: " + ", ".join(f"{k}={v}" for k, v in PINNED_MALLOC.items()))
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
    if cfg.phases:
        print("\nWhere the time goes (ms per step; phases.py), page faults and allocations per step:\n"
              + phases.table(phase_rows(rows)))
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
    p.add_argument("--malloc", choices=("default", "pinned", "both"), default="default",
                   help="both: every timing run unpinned and pinned (the table's pinned ratio)")
    p.add_argument("--phases", action="store_true",
                   help="forward/backward/comm wait/optimizer/rest, page faults and allocations per step")
    p.add_argument("--compute", action="store_true",
                   help="data-parallel pairs: also the compute-only floor (each rank its share, no collectives)")
    a = p.parse_args(argv)
    pairs = (*PRESETS.get(a.preset, ()), *(a.pairs or ())) or ("ddp:torch-ddp",)
    cfg = BenchConfig(model=a.model or PRESET_MODELS.get(a.preset, "gpt-small"), world_sizes=tuple(a.world_sizes), pairs=pairs, steps=a.steps,
                      warmup=a.warmup, repeats=a.repeats, batch_size=a.batch_size, out=a.out,
                      memory=not a.no_memory, pin_malloc=a.pin_malloc, calibration=a.calibration,
                      malloc=a.malloc, phases=a.phases, compute=a.compute)
    try:
        if not os.path.exists(a.calibration):
            calibrate.calibrate((1, *a.world_sizes)).save(a.calibration)
        run(cfg)
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
