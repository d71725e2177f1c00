"""Benchmark minifsdp's strategies side by side with PyTorch's own, in one run.

Front layer. ``python -m minifsdp.bench`` trains the same model on the same
data with each strategy of a pair (``ddp`` vs ``torch-ddp``, ``fsdp`` vs
``torch-fsdp``, ...) at each world size, alternating the order of the pair
between repeats so that a noisy machine hurts both sides alike, and reports
medians and ratios (minifsdp / torch):

* step time — the median over the steps after ``--warmup``, then the median
  over repeats (timing runs do *not* track memory: tracking costs ~1.3x);
* peak memory — one extra short run per strategy with the memory tracker;
* bytes moved per step — from the tracer's comm spans (for torch's own
  implementations, from a DDP comm hook that counts each bucket).

    python -m minifsdp.bench --model gpt-small --world-sizes 2 4 --pairs ddp:torch-ddp

Writes ``bench.json`` and prints a table; README.md quotes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import Any

from . import estimate
from .train import STRATEGIES, TrainConfig, train


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


def _run(cfg: BenchConfig, strategy: str, world_size: int, track_memory: bool, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        tc = TrainConfig(strategy=strategy, world_size=world_size, model=cfg.model, steps=steps,
                         batch_size=cfg.batch_size, quiet=True, out=tmp, track_memory=track_memory,
                         write_plots=False)
        return train(tc)


def _median_step(metrics: dict[str, Any], warmup: int) -> float:
    """Median over steps after warm-up of the slowest rank's step time (a step ends when all ranks do)."""
    per_step = [max(times) for times in zip(*metrics["step_time_s"])]
    return statistics.median(per_step[warmup:] or per_step)


def bench_pair(cfg: BenchConfig, ours: str, theirs: str, world_size: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {ours: [], theirs: []}
    for rep in range(cfg.repeats):
        order = (ours, theirs) if rep % 2 == 0 else (theirs, ours)
        for name in order:
            m = _run(cfg, name, world_size, track_memory=False, steps=cfg.steps)
            times[name].append(_median_step(m, cfg.warmup))
            print(f"  world {world_size}  repeat {rep + 1}/{cfg.repeats}  {name:<12} "
                  f"{times[name][-1] * 1e3:8.1f} ms/step", flush=True)
    row: dict[str, Any] = {"world_size": world_size, "ours": ours, "theirs": theirs,
                           "step_s": {k: statistics.median(v) for k, v in times.items()},
                           "step_s_all": times}
    row["step_ratio"] = row["step_s"][ours] / row["step_s"][theirs]
    if cfg.memory:
        peaks, moved = {}, {}
        for name in (ours, theirs):
            m = _run(cfg, name, world_size, track_memory=True, steps=2)
            peaks[name] = max(p for p in m["peak_bytes"] if p is not None)
            moved[name] = sum(m["bytes_per_step"][0].values())
            row["n_params"] = m["n_params"]
        row["peak_bytes"], row["bytes_per_step"] = peaks, moved
        row["peak_ratio"] = peaks[ours] / peaks[theirs]
        strategy = ours.replace("-naive", "")
        try:
            row["bytes_formula"] = estimate.comm_bytes_per_step(row["n_params"], world_size, strategy,
                                                                ring=False)["total"]
        except (ValueError, KeyError):
            row["bytes_formula"] = None
    return row


def table(rows: list[dict[str, Any]]) -> str:
    mib = 2 ** 20
    head = (f"| world | minifsdp | torch | step ms (ours / torch) | step ratio | peak MiB (ours / torch) "
            f"| peak ratio | MiB moved per step (ours / torch / formula) |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        s = r["step_s"]
        peak = r.get("peak_bytes", {})
        moved = r.get("bytes_per_step", {})
        peak_txt = f"{peak[r['ours']] / mib:.1f} / {peak[r['theirs']] / mib:.1f}" if peak else "-"
        formula = r.get("bytes_formula")
        theirs_moved = f"{moved[r['theirs']] / mib:.2f}" if moved.get(r["theirs"]) else "n/a"  # torch's C++ comm
        moved_txt = (f"{moved[r['ours']] / mib:.2f} / {theirs_moved} / {formula / mib:.2f}"
                     if moved and formula else "-")
        lines.append(f"| {r['world_size']} | {r['ours']} | {r['theirs']} | {s[r['ours']] * 1e3:.1f} / "
                     f"{s[r['theirs']] * 1e3:.1f} | {r['step_ratio']:.3f} | {peak_txt} | "
                     f"{r.get('peak_ratio', float('nan')):.3f} | {moved_txt} |")
    return "\n".join(lines)


def run(cfg: BenchConfig) -> list[dict[str, Any]]:
    for pair in cfg.pairs:
        for name in pair.split(":"):
            if name not in STRATEGIES:
                raise ValueError(f"unknown strategy {name!r} in --pairs; choose from: {', '.join(STRATEGIES)}")
    os.makedirs(cfg.out, exist_ok=True)
    rows = []
    for pair in cfg.pairs:
        ours, theirs = pair.split(":")
        for world_size in cfg.world_sizes:
            print(f"{ours} vs {theirs}, {cfg.model}, world size {world_size}", flush=True)
            rows.append(bench_pair(cfg, ours, theirs, world_size))
    with open(os.path.join(cfg.out, "bench.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "rows": rows}, f, indent=1)
    print(table(rows))
    print(f"\nwrote {cfg.out}/bench.json")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minifsdp.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--pairs", nargs="+", default=["ddp:torch-ddp"], help="ours:theirs strategy pairs")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--no-memory", action="store_true")
    a = p.parse_args(argv)
    cfg = BenchConfig(model=a.model, world_sizes=tuple(a.world_sizes), pairs=tuple(a.pairs), steps=a.steps,
                      warmup=a.warmup, repeats=a.repeats, batch_size=a.batch_size, out=a.out,
                      memory=not a.no_memory)
    try:
        run(cfg)
    except ValueError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
