"""The demo: every collective on N ranks of this machine, timed, traced and plotted.

Layer 6 (front). ``python -m minifsdp.demo [--world-size 2] [--out runs/demo]``
(or ``make demo``) launches N ranks (CPU processes with gloo, or one GPU each
with NCCL, via ``dist.device()``), runs all_reduce, all_gather,
reduce_scatter, broadcast and send/recv at a few sizes through
``minifsdp.comm`` while a ``trace.Tracer`` and a ``memory.MemoryTracker``
record, and writes to the out folder:

    trace.json      every span of every rank: open it in https://ui.perfetto.dev
    timeline.png    ranks x (compute, comm) lanes      (plot.timeline)
    memory.png      live bytes by category, per rank   (plot.memory)
    bandwidth.png   time per call vs size, log-log     (plot.bandwidth)
    summary.json    per op, size and rank: bytes, every call's seconds, bandwidths

How it measures, in the manner of nccl-tests: one untimed warm-up call per
(op, size) (first calls set up connections and buffers), then ``--repeats``
timed calls; the median is reported. Each call is timed on the host around
the collective, after a device synchronize on GPUs (NCCL calls return
before the transfer ends). Bandwidths, for a tensor of S bytes taking t s:

    algbw = S / t                  what the caller sees ("my tensor moved at ...")
    busbw = ring_bytes / t         what each link carried with a ring algorithm:
                                   2S(N-1)/N for all_reduce, S(N-1)/N for
                                   all_gather / reduce_scatter / broadcast, S for send
                                   (comm.collective_bytes; nccl-tests' "busbw")

S is the *full* tensor (the all_gather output, the reduce_scatter input), the
size ``comm.collective_bytes`` takes; the ``bytes`` column is its volume
(2S for all_reduce), the number the tracer records on every comm span.

Example, 2 ranks on a laptop CPU (yours will differ)::

    op              size        bytes   rank 0 ms  rank 1 ms  algbw GB/s  busbw GB/s
    all_reduce      1.0 MiB   2.0 MiB       0.80       0.79        1.31        1.31
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Sequence

import torch

from . import comm, dist, trace
from .launch import launch, max_world_size

__all__ = ["main", "run_demo", "parse_size", "OPS", "DEFAULT_SIZES"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send/recv")
DEFAULT_SIZES = (64 << 10, 1 << 20, 8 << 20)  # 64 KiB, 1 MiB, 8 MiB of fp32
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 1000, "k": 1 << 10, "mib": 1 << 20, "mb": 10 ** 6,
          "m": 1 << 20, "gib": 1 << 30, "gb": 10 ** 9, "g": 1 << 30}


def parse_size(text: str) -> int:
    """``"64KiB"`` -> 65536. Binary (KiB, MiB, GiB; K, M, G) and decimal (KB, MB, GB) units.

    >>> parse_size("64KiB"), parse_size("1.5 MiB"), parse_size("4096")
    (65536, 1572864, 4096)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write e.g. 64KiB, 1MiB or 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# --------------------------------------------------------------------------
# The worker: runs on every rank
# --------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    # CPU collectives are done when they return; NCCL's are queued on a stream.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buffers(op: str, numel: int, n: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The tensors one call of ``op`` needs; ``numel`` elements is the full tensor S."""
    if op == "all_gather":                                  # input S/N -> output S
        return torch.full((numel // n,), float(rank), device=device), torch.empty(numel, device=device)
    if op == "reduce_scatter":                              # input S -> output S/N
        return torch.full((numel,), float(rank), device=device), torch.empty(numel // n, device=device)
    return (torch.full((numel,), float(rank), device=device),)


def _call(op: str, bufs: tuple[torch.Tensor, ...], rank: int, n: int) -> str | None:
    """One call of ``op`` through minifsdp.comm; returns the name recorded, None if idle."""
    if op == "all_reduce":
        comm.all_reduce(bufs[0])
    elif op == "all_gather":
        comm.all_gather_into_tensor(bufs[1], bufs[0])
    elif op == "reduce_scatter":
        comm.reduce_scatter_tensor(bufs[1], bufs[0])
    elif op == "broadcast":
        comm.broadcast(bufs[0], src=0)
    else:  # send/recv in pairs: 0 -> 1, 2 -> 3, ...; with an odd N the last rank sits out
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        if peer >= n:
            return None
        if rank % 2 == 0:
            comm.send(bufs[0], dst=peer)
            return "send"
        comm.recv(bufs[0], src=peer)
        return "recv"
    return op


def _check(op: str, bufs: tuple[torch.Tensor, ...], rank: int, n: int) -> None:
    """The demo also checks the answers (each rank filled its buffer with its rank)."""
    total = n * (n - 1) / 2
    if op == "all_reduce":
        # repeated in place: after k calls every element is total * n**(k-1); checked before repeats
        ok = bool((bufs[0] == total).all())
    elif op == "all_gather":
        per = bufs[0].numel()
        ok = all(bool((bufs[1][r * per:(r + 1) * per] == r).all()) for r in range(n))
    elif op == "reduce_scatter":
        ok = bool((bufs[1] == total).all())
    elif op == "broadcast":
        ok = bool((bufs[0] == 0).all())
    else:
        ok = rank % 2 == 0 or rank - 1 < 0 or bool((bufs[0] == rank - 1).all())
    if not ok:
        raise AssertionError(f"{op} on rank {rank} returned a wrong result")


def _worker(sizes: Sequence[int], repeats: int, t_launch: float) -> dict[str, Any]:
    from .memory import MemoryTracker

    # torch 2.13 nudges *_tensor collectives towards *_single names on every call; noise here.
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated",
                            category=FutureWarning)

    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    tracker = MemoryTracker(device=str(device))
    # The first op under a dispatch mode imports torch._dynamo (1-3 s on a
    # small CPU): pay it before the tracer starts so the timeline shows the demo.
    with tracker:
        torch.zeros(1, device=device)
    comm.barrier()  # untraced: ranks start the traced part together
    t_ready = time.perf_counter()  # perf_counter is one clock for all processes of a machine
    tracer = trace.Tracer(rank=rank, device=str(device), backend=dist.backend())
    results: list[dict[str, Any]] = []
    ops = [op for op in OPS if not (op == "send/recv" and n == 1)]
    with tracer, tracker:
        for op in ops:
            for size in sizes:
                numel = max(n, size // 4 // n * n)  # fp32 elements, divisible by N
                comm.barrier()                       # start every (op, size) together
                # Everything allocated in this phase is a communication buffer,
                # including scratch the backend makes inside a call (gloo's
                # reduce_scatter allocates a full-size temporary).
                with tracker.category("comm"):
                    with tracer.span("fill buffers", op=op, numel=numel):
                        bufs = _buffers(op, numel, n, rank, device)
                        _sync(device)
                    tracker.snapshot(f"{op} {size} allocated")
                    name = _call(op, bufs, rank, n)    # warm-up, untimed
                    _sync(device)
                    _check(op, bufs, rank, n)
                    seconds = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        _call(op, bufs, rank, n)
                        _sync(device)
                        seconds.append(time.perf_counter() - start)
                if name is not None:
                    recorded = [s for s in tracer.trace.comm_spans() if s.name == name][-1]
                    tensor_bytes = numel * 4
                    median = statistics.median(seconds)
                    results.append({
                        "op": name, "rank": rank, "world_size": n, "tensor_bytes": tensor_bytes,
                        "bytes": recorded.args["bytes"], "ring_bytes": recorded.args["ring_bytes"],
                        "seconds": seconds, "median_s": median,
                        "algbw_GBps": tensor_bytes / median / 1e9,
                        "busbw_GBps": recorded.args["ring_bytes"] / median / 1e9,
                    })
                del bufs
                tracker.snapshot(f"{op} {size} freed")
    return {"trace": tracer.trace, "results": results, "peak_bytes": tracker.peak_total,
            "startup_s": t_ready - t_launch, "collectives_s": time.perf_counter() - t_ready,
            "device": str(device), "backend": dist.backend()}


# --------------------------------------------------------------------------
# The parent: launch, summarise, write files
# --------------------------------------------------------------------------
def summary_rows(results: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """One row per (op, size): per-rank medians, bandwidths at the slowest rank's median.

    send and recv become one "send/recv" row (the sender's and receiver's
    times); a rank that sat out (odd world size) has None.
    """
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in results:
        op = "send/recv" if r["op"] in ("send", "recv") else r["op"]
        row = rows.setdefault((op, r["tensor_bytes"]), {"op": op, "tensor_bytes": r["tensor_bytes"],
                                                       "bytes": r["bytes"], "ring_bytes": r["ring_bytes"],
                                                       "median_s_by_rank": [None] * world_size})
        row["median_s_by_rank"][r["rank"]] = r["median_s"]
    for row in rows.values():
        slowest = max(t for t in row["median_s_by_rank"] if t is not None)
        row["algbw_GBps"] = row["tensor_bytes"] / slowest / 1e9
        row["busbw_GBps"] = row["ring_bytes"] / slowest / 1e9
    return list(rows.values())


def format_table(rows: list[dict[str, Any]], world_size: int) -> str:
    from .plot import human_bytes

    ranks = range(world_size)
    head = f"{'op':<15}{'size':>10}{'bytes':>11}" + "".join(f"{f'rank {r} ms':>11}" for r in ranks)
    lines = [head + f"{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for row in rows:
        ms = "".join(f"{row['median_s_by_rank'][r] * 1e3:>11.2f}" if row["median_s_by_rank"][r] is not None
                     else f"{'-':>11}" for r in ranks)
        lines.append(f"{row['op']:<15}{human_bytes(row['tensor_bytes']):>10}{human_bytes(row['bytes']):>11}"
                     f"{ms}{row['algbw_GBps']:>12.3g}{row['busbw_GBps']:>12.3g}")
    return "\n".join(lines)


def run_demo(world_size: int = 2, out: str = "runs/demo", sizes: Sequence[int] = DEFAULT_SIZES,
             repeats: int = 5, timeout: float = 120.0, quiet: bool = False) -> dict[str, Any]:
    """Run the demo (see the module docstring) and return the summary written to summary.json."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()
    say(f"[1/4] launching {world_size} rank(s) (backend {dist.default_backend()}): "
        f"{', '.join(OPS)} at {', '.join(_human(s) for s in sizes)}, {repeats} timed calls each")
    outputs = launch(_worker, world_size, list(sizes), repeats, time.perf_counter(), timeout=timeout)
    traces = [o["trace"] for o in outputs]
    results = [r for o in outputs for r in o["results"]]
    startup = max(o["startup_s"] for o in outputs)
    say(f"[2/4] done in {time.perf_counter() - t_start:.1f} s: start-up {startup:.1f} s (processes, "
        f"imports, process group), collectives {max(o['collectives_s'] for o in outputs):.1f} s. "
        f"Median of {repeats} calls:")
    rows = summary_rows(results, world_size)
    say(format_table(rows, world_size))

    os.makedirs(out, exist_ok=True)
    summary = {"world_size": world_size, "device": outputs[0]["device"], "backend": outputs[0]["backend"],
               "sizes": list(sizes), "repeats": repeats, "dtype": "float32",
               "peak_bytes_by_rank": [o["peak_bytes"] for o in outputs],
               "startup_s": startup, "collectives_s": [o["collectives_s"] for o in outputs],
               "rows": rows, "results": results}
    paths = {name: os.path.join(out, name) for name in
             ("trace.json", "summary.json", "timeline.png", "memory.png", "bandwidth.png")}
    with open(paths["summary.json"], "w") as f:
        json.dump(summary, f, indent=1)
    trace.save_chrome_trace(traces, paths["trace.json"])
    say(f"[3/4] wrote {paths['trace.json']} and {paths['summary.json']}")

    from . import plot

    plot.timeline(traces, title=f"demo: collectives on {world_size} rank(s)").savefig(
        paths["timeline.png"], dpi=110, bbox_inches="tight")
    plot.memory(traces, title="demo: live memory (comm = collective buffers)").savefig(
        paths["memory.png"], dpi=110, bbox_inches="tight")
    points = [{"op": r["op"], "world_size": r["world_size"], "bytes": r["tensor_bytes"], "seconds": s}
              for r in results for s in r["seconds"]]
    plot.bandwidth(points, title=f"demo: time per call, {world_size} rank(s)",
                   xlabel="tensor size S (full tensor)").savefig(paths["bandwidth.png"], dpi=110,
                                                                 bbox_inches="tight")
    say(f"[4/4] wrote timeline.png, memory.png, bandwidth.png in {out}/ "
        f"({time.perf_counter() - t_start:.1f} s in all)")
    say(f"open {paths['trace.json']} at https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return summary


def _human(n: int) -> str:
    from .plot import human_bytes

    return human_bytes(n)


def _writable_folder(path: str) -> str | None:
    """None if ``path`` is (or can be made) a folder we can write in, else why not."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m minifsdp.demo",
                                description="Every collective on N ranks: timed, traced, plotted.")
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--out", default="runs/demo", help="folder for trace.json, plots, summary.json")
    p.add_argument("--sizes", default=",".join(_human(s).replace(".0 ", "").replace(" ", "")
                                                for s in DEFAULT_SIZES),
                   help="comma-separated tensor sizes, e.g. 64KiB,1MiB,8MiB")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per op and size (default 5)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before the run is stopped")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    p.add_argument("--train-steps", type=int, default=10,
                   help="then train --train-model with DDP for this many steps (0: skip; default 10)")
    p.add_argument("--train-model", default="gpt-small", help="model preset for the training run")
    args = p.parse_args(argv)
    # Every check happens here, before any process starts.
    limit = max_world_size()
    if not 1 <= args.world_size <= limit:
        p.error(f"--world-size must be between 1 and {limit} on this machine; got {args.world_size} "
                "(try --world-size 2)")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    if not sizes or min(sizes) < 4 * args.world_size:
        p.error(f"--sizes: each size must be at least {4 * args.world_size} bytes "
                f"(one fp32 per rank); e.g. --sizes 64KiB,1MiB")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1; got {args.repeats}")
    if args.timeout <= 0:
        p.error(f"--timeout must be positive seconds; got {args.timeout}")
    why = _writable_folder(args.out)
    if why:
        p.error(f"--out {args.out!r} is not a writable folder ({why}); pass --out to a folder you can write")
    if args.train_steps < 0:
        p.error(f"--train-steps must be >= 0; got {args.train_steps}")
    summary = run_demo(args.world_size, args.out, sizes, args.repeats, args.timeout, args.quiet)
    if args.train_steps:
        summary["train"] = run_training(args.world_size, args.out, args.train_model, args.train_steps,
                                        args.quiet)
    return summary


def run_training(world_size: int, out: str, model: str, steps: int, quiet: bool) -> dict[str, Any]:
    """The same ranks now train a GPT with minifsdp's DDP (python -m minifsdp.train does the work)."""
    from .train import TrainConfig, train

    strategy = "ddp" if world_size > 1 else "single"
    folder = os.path.join(out, "train")
    if not quiet:
        print(f"\ntraining {model} with {strategy} on {world_size} rank(s) for {steps} steps "
              f"(python -m minifsdp.train --strategy {strategy} --world-size {world_size} --model {model})",
              flush=True)
    return train(TrainConfig(strategy=strategy, world_size=world_size, model=model, steps=steps,
                             batch_size=4 * world_size, out=folder, quiet=quiet))


if __name__ == "__main__":
    main(sys.argv[1:])
