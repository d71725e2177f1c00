"""The scaling table: per-rank memory and bytes per step at 1, 2, 4, 8 ranks, measured beside the prediction.

For DDP, ZeRO-1, ZeRO-2, ZeRO-3 (flat ``fsdp`` FULL_SHARD) and per-parameter FSDP
(``fsdp2``) this trains the same model on the same global batch at each world
size N (``python -m minifsdp.train``'s loop, ``run_rank``, with the memory
tracker on) and writes, per strategy and N:

* the peak bytes of the most loaded rank, with its breakdown by category at that
  moment (``minifsdp.memory.MemoryTracker``: exact live bytes on CPU), beside
  ``minifsdp.planner.plan(dp=N, zero_stage=...)``'s peak (``Plan.total_memory``);
* the bytes per step that rank moves (``comm``'s volume: the ZeRO paper's units,
  an all-reduce of S bytes counts 2S), beside the strategy record's prediction
  (``Strategy.expected_bytes``: ``estimate.comm_bytes_per_step`` /
  ``estimate.fully_shard_comm_bytes``).

N = 1 is ``--strategy single`` for every line: one process, no wrapper, no
collective, the point each line starts from (a wrapper around one rank only
adds its own buffers). The global batch stays the same as N grows (strong
scaling), so the activations per rank shrink with N as the sharded states do.

Outputs in ``--out`` (default docs/scaling/): ``scaling.md`` (the table),
``scaling.png`` (per-rank MiB against N, one colour per strategy, measured solid,
predicted dashed; bytes per step beside it) and ``scaling.json`` (every number).
Progress goes to stdout; one launch per world size runs every strategy in turn::

    python tools/scaling_table.py                       # gpt-mini, N = 1, 2, 4, 8: a few minutes
    python tools/scaling_table.py --world-sizes 1,2 --strategies zero2,fsdp --out /tmp/scaling
    python tools/scaling_table.py --replot              # the table and figure again from scaling.json

The margin: bytes per step equal the prediction exactly; the planner's peak is a
lower bound of the measured one, within ``MEMORY_MARGIN`` where the terms it
leaves out are small (README, "Scaling").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

# What each strategy is in the planner's terms (the ZeRO stage over dp), and its name in the table
STAGES: dict[str, tuple[str, int]] = {
    "ddp": ("DDP", 0), "zero1": ("ZeRO-1", 1), "zero2": ("ZeRO-2", 2),
    "fsdp": ("ZeRO-3 (fsdp)", 3), "fsdp2": ("FSDP2 (fsdp2)", 3),
}
MEMORY_MARGIN = 0.10   # measured peak <= (1 + margin) x the planner's, where its left-out terms are small
MIB = 2 ** 20


@dataclasses.dataclass
class Point:
    """One strategy at one world size: measured (the most loaded rank) and predicted."""

    strategy: str
    world_size: int
    peak: int                        # bytes, the most loaded rank's peak
    by_category: dict[str, int]      # that rank's live bytes by category at its peak
    predicted_peak: float            # planner.plan(...).total_memory
    predicted_by_category: dict[str, float]
    bytes_per_step: float            # that rank's collectives' volume per step
    predicted_bytes: float


def config(strategy: str, world_size: int, model: str, batch_size: int, seq_len: int, steps: int,
           timeout: float) -> Any:
    """The trainer's config of one point (N = 1: ``single``)."""
    from minifsdp.train import TrainConfig

    return TrainConfig(strategy=strategy if world_size > 1 else "single", world_size=world_size, model=model,
                       steps=steps, batch_size=batch_size, seq_len=seq_len, quiet=True, write_plots=False,
                       track_memory=True, timeout=timeout,
                       out=os.path.join(tempfile.gettempdir(), "minifsdp-scaling"))  # nothing is written there


def predict(cfg: Any) -> tuple[float, dict[str, float], float]:
    """The planner's peak and categories, and the record's bytes per step, for ``cfg``'s run."""
    from minifsdp import planner
    from minifsdp.strategies import STRATEGIES

    stage = STAGES[cfg.strategy][1] if cfg.strategy in STAGES else 0
    plan = planner.plan(cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len, dp=cfg.world_size, zero_stage=stage)
    record = STRATEGIES[cfg.strategy]
    moved = record.expected_bytes(cfg, record.layout(cfg))["total"] if record.expected_bytes else 0
    return plan.total_memory, dict(plan.memory), moved


def _run_all(cfgs: list[Any]) -> list[dict[str, Any]]:
    """On every rank: the trainer's loop for each config in turn; only what the table needs comes back."""
    from minifsdp.train import run_rank

    out = []
    for cfg in cfgs:
        r = run_rank(cfg)
        moved = sum(r["trace"].bytes_by_op(within="step").values()) / cfg.steps
        out.append({"peak": r["memory"]["peak_total"], "by_category": r["memory"]["peak_by_category"],
                    "bytes_per_step": moved, "losses": r["losses"]})
    return out


def measure(strategies: list[str], world_sizes: list[int], *, model: str = "gpt-mini", batch_size: int = 8,
            seq_len: int = 64, steps: int = 2, timeout: float = 900.0,
            log: Callable[[str], None] = print) -> list[Point]:
    """Run every strategy at every world size (one launch per size) and predict each; the points in order."""
    from minifsdp.launch import launch
    from minifsdp.train import validate

    unknown = [s for s in strategies if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STAGES)}")
    if any(n < 1 or batch_size % n for n in world_sizes):
        raise ValueError(f"every world size must divide --batch-size {batch_size}, got {world_sizes}")
    points = []
    for n in world_sizes:
        names = ["single"] if n == 1 else strategies
        cfgs = [config(s, n, model, batch_size, seq_len, steps, timeout) for s in names]
        for cfg in cfgs:
            validate(cfg)
        log(f"[scaling] N = {n}: {', '.join(names)} ({model}, batch {batch_size} x {seq_len}, {steps} steps) ...")
        start = time.perf_counter()
        per_rank = [_run_all(cfgs)] if n == 1 else launch(_run_all, n, cfgs, timeout=timeout)
        log(f"[scaling] N = {n}: done in {time.perf_counter() - start:.1f} s")
        for i, cfg in enumerate(cfgs):
            ranks = [results[i] for results in per_rank]
            top = max(ranks, key=lambda r: r["peak"])
            moved = max(r["bytes_per_step"] for r in ranks)
            planned, cats, predicted_bytes = predict(cfg)
            log(f"[scaling]   {cfg.strategy:<6} peak {top['peak'] / MIB:7.2f} MiB (planner {planned / MIB:7.2f}), "
                f"{moved / MIB:6.2f} MiB/step (predicted {predicted_bytes / MIB:6.2f})")
            for s in strategies if n == 1 else [cfg.strategy]:  # N = 1 (single) starts every line
                points.append(Point(s, n, top["peak"], top["by_category"], planned, cats, moved, predicted_bytes))
    return points


# --------------------------------------------------------------------------
# Outputs: the table, the figure, the numbers
# --------------------------------------------------------------------------

_SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "activations": "acts",
          "temporary": "temp", "unsharded_params": "gathered params", "unsharded_grads": "unsharded grads"}


def markdown(points: list[Point]) -> str:
    """One row per run: measured and predicted peak (MiB), their ratio, bytes per step, the breakdown at the peak;
    N = 1 (single) first, then each strategy from 2 ranks up."""
    lines = ["| strategy | N | peak MiB | planner MiB | measured / planner | MiB moved per step | predicted | "
             "at the peak, by category (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    singles = [p for p in points if p.world_size == 1][:1]  # N = 1 is the same run for every line: one row
    rest = sorted((p for p in points if p.world_size > 1), key=lambda p: (list(STAGES).index(p.strategy), p.world_size))
    for p in singles + rest:
        name = "single" if p.world_size == 1 else STAGES[p.strategy][0]
        cats = ", ".join(f"{_SHORT.get(k, k)} {v / MIB:.2f}" for k, v in p.by_category.items() if v >= MIB / 100)
        lines.append(f"| {name} | {p.world_size} | {p.peak / MIB:.2f} | {p.predicted_peak / MIB:.2f} | "
                     f"{p.peak / p.predicted_peak:.3f} | {p.bytes_per_step / MIB:.2f} | "
                     f"{p.predicted_bytes / MIB:.2f} | {cats} |")
    return "\n".join(lines)


def plot(points: list[Point], path: str, title: str = "") -> None:
    """Per-rank peak MiB and MiB per step against N: measured solid, predicted dashed, a colour per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, comm) = plt.subplots(1, 2, figsize=(10, 4))
    strategies = list(dict.fromkeys(p.strategy for p in points))
    for i, s in enumerate(strategies):
        own = sorted((p for p in points if p.strategy == s), key=lambda p: p.world_size)
        n = [p.world_size for p in own]
        color = f"C{i}"
        mem.plot(n, [p.peak / MIB for p in own], "-o", color=color, label=STAGES[s][0])
        mem.plot(n, [p.predicted_peak / MIB for p in own], "--x", color=color)
        comm.plot(n, [p.bytes_per_step / MIB for p in own], "-o", color=color, label=STAGES[s][0])
        comm.plot(n, [p.predicted_bytes / MIB for p in own], "--x", color=color)
    sizes = sorted({p.world_size for p in points})
    for ax, what in ((mem, "peak memory per rank (MiB)"), (comm, "bytes moved per rank per step (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("world size N (ranks)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    mem.set_ylim(bottom=0)
    comm.set_ylim(bottom=0)
    mem.plot([], [], "k-", label="measured")
    mem.plot([], [], "k--x", label="predicted")
    mem.legend(fontsize=8)
    fig.suptitle(title or "measured (solid) vs predicted (dashed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(points: list[Point], out: str, title: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scaling.md"), "w") as f:
        f.write(f"{title}\n\n{markdown(points)}\n")
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump({"title": title, "points": [dataclasses.asdict(p) for p in points]}, f, indent=1)
    plot(points, os.path.join(out, "scaling.png"), title)


def load(out: str) -> tuple[list[Point], str]:
    """The points and title ``write`` saved in ``out``/scaling.json."""
    with open(os.path.join(out, "scaling.json")) as f:
        saved = json.load(f)
    return [Point(**p) for p in saved["points"]], saved["title"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python tools/scaling_table.py", description=__doc__.split("\n")[0])
    p.add_argument("--strategies", default=",".join(STAGES), help=f"comma-separated, of: {', '.join(STAGES)}")
    p.add_argument("--world-sizes", default="1,2,4,8")
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--batch-size", type=int, default=8, help="global batch, the same at every N")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "scaling"))
    p.add_argument("--replot", action="store_true", help="redraw the table and figure from --out's scaling.json")
    a = p.parse_args(argv)
    out = os.path.normpath(a.out)
    if a.replot:
        points, title = load(out)
        write(points, out, title)
        print(f"redrew {out}/scaling.md and scaling.png from scaling.json")
        return
    try:
        sizes = [int(n) for n in a.world_sizes.split(",")]
    except ValueError:
        sys.exit(f"error: --world-sizes takes comma-separated integers, got {a.world_sizes!r}")
    try:
        points = measure(a.strategies.split(","), sizes, model=a.model, batch_size=a.batch_size,
                         seq_len=a.seq_len, steps=a.steps, timeout=a.timeout)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    title = (f"{a.model}, global batch {a.batch_size} x {a.seq_len} tokens, fp32 AdamW, {a.steps} steps, "
             f"CPU (gloo); N = 1 is --strategy single")
    write(points, out, title)
    print(markdown(points))
    print(f"\nwrote {out}/: scaling.md, scaling.png, scaling.json")


if __name__ == "__main__":
    main()
