"""The GPU check: every solution notebook's launched work on the GPUs this machine has, in one table.

    python tools/gpu_check.py                      # on a CUDA machine: NCCL at the GPU count present
    MINIFSDP_FAKE_GPU=2 python tools/gpu_check.py  # on a CPU machine: as a 2-GPU VM (pretend GPUs)
    python tools/gpu_check.py solutions/02_data_parallel.ipynb --pretend 1

What it runs, and what each row says:

* **each solution notebook**, end to end (``tools/run_notebooks.py``), with every ``launch``
  logged (``MINIFSDP_LAUNCH_LOG``): the world sizes and backends its launches used - ``nccl`` on
  real GPUs, ``gpu`` on pretend ones, ``gloo`` where a lesson needs more ranks than GPUs and ran CPU
  ranks - the verdicts its check cells printed (``passed`` / ``not yet``) and its seconds;
* **memory**: one gpt-tiny training step per rank, the memory tracker's peak beside
  ``torch.cuda.max_memory_allocated`` (CUDA only; the tracker rounds to the allocator's 512 B blocks,
  so they agree within the allocator's caching slack, stated in the row);
* **bf16**: the same step under ``torch.autocast(bfloat16)``, its loss beside fp32's.

The table is what README's GPU section shows; on a CPU machine the same script runs under pretend
GPU counts (``tests/test_gpu_check.py``), so it is ready when a GPU machine is.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))
import run_notebooks as runner  # noqa: E402

PASSED, NOT_YET = re.compile(r"✅ passed"), re.compile(r"❌ not yet|CheckFailed")


def _launches(log: Path) -> str:
    """'2 x nccl, 4 x gloo' style summary of the launches a notebook made (each distinct pair once)."""
    if not log.exists():
        return "-"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    seen = Counter((r["world_size"], r["backend"]) for r in rows)
    return ", ".join(f"{n}r {b} x{c}" for (n, b), c in sorted(seen.items()))


def run_notebook(path: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one solution notebook; its launches, verdicts and seconds (an error is a row, not a crash)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "launches.jsonl"
        started = time.perf_counter()
        outputs: list[str] = []
        error = ""
        with contextlib.closing(
                runner.execute_cells(path, ROOT, runner.CELL_TIMEOUT, env={**env, "MINIFSDP_LAUNCH_LOG": str(log)},
                                     collect=outputs)) as cells:
            for index, err in cells:
                if err is not None:
                    error = f"cell {index}: {err.ename}: {err.evalue}"[:120]
                    break
        text = "\n".join(outputs)
        return {"lab": path.stem, "launches": _launches(log), "passed": len(PASSED.findall(text)),
                "not_yet": len(NOT_YET.findall(text)), "seconds": time.perf_counter() - started, "error": error}


def _step_worker(precision: str) -> dict:
    """One gpt-tiny AdamW step on this rank: the tracker's peak, CUDA's max allocated, the loss."""
    import torch

    from minifsdp import data, dist, models
    from minifsdp.memory import MemoryTracker

    device = dist.device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)  # what was there before this step's model and data
    model = models.build_model("gpt-tiny", seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (t.to(device) for t in data.get_batch(0, 8, 32, rank=dist.rank(), world_size=dist.world_size()))
    tracker = MemoryTracker(device=str(device) if cuda else None)
    tracker.track_model(model)
    with tracker:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = models.lm_loss(model(x), y)
        loss.backward()
        opt.step()
    out = {"loss": float(loss.detach()), "tracker_peak": tracker.peak_total, "cuda_peak": None}
    if cuda:
        torch.cuda.synchronize()
        out["cuda_peak"] = torch.cuda.max_memory_allocated(device) - base
    return out


MEMORY_MARGIN = 0.10   # tracker peak vs torch.cuda.max_memory_allocated: the allocator's rounding and caching
BF16_MARGIN = 0.02     # bf16 autocast loss vs fp32's, relative, on the first step of gpt-tiny


def device_rows(world: int) -> list[dict[str, Any]]:
    """The memory-tracker row (fp32 step) and the bf16 autocast row, on ``world`` ranks (GPUs when there are
    that many). Each holds a target: the tracker within MEMORY_MARGIN of CUDA's counter (CUDA only), bf16's
    loss within BF16_MARGIN of fp32's."""
    from minifsdp import launch
    rows, losses = [], {}
    for precision in ("fp32", "bf16"):
        started = time.perf_counter()
        row = {"lab": f"step {precision}", "launches": f"{world}r", "passed": 0, "not_yet": 0, "error": ""}
        try:
            r0 = launch(_step_worker, world, precision, timeout=300)[0]
        except Exception as exc:  # noqa: BLE001 - a row, not a crash
            row.update(not_yet=1, seconds=time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}"[:120])
            rows.append(row)
            continue
        losses[precision] = r0["loss"]
        if precision == "fp32" and r0["cuda_peak"] is not None:
            ratio = r0["tracker_peak"] / max(r0["cuda_peak"], 1)
            ok = abs(ratio - 1) <= MEMORY_MARGIN
            detail = (f"tracker {r0['tracker_peak']:,} B / cuda max {r0['cuda_peak']:,} B = {ratio:.3f} "
                      f"(target 1 +- {MEMORY_MARGIN})")
        elif precision == "fp32":
            ok, detail = True, f"tracker peak {r0['tracker_peak']:,} B (no CUDA here: no allocator to compare)"
        else:
            gap = abs(r0["loss"] - losses["fp32"]) / abs(losses["fp32"]) if "fp32" in losses else float("inf")
            ok = gap <= BF16_MARGIN
            detail = f"loss {r0['loss']:.4f} vs fp32 {losses.get('fp32', float('nan')):.4f} (rel {gap:.1e}, target <= {BF16_MARGIN})"
        row.update(passed=int(ok), not_yet=int(not ok), seconds=time.perf_counter() - started, detail=detail)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], machine: str) -> str:
    """The markdown table README shows."""
    lines = [f"GPU check on {machine}", "",
             "| lab | launches (ranks, backend, times) | passed | not yet | seconds | note |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        note = r.get("error") or r.get("detail", "")
        lines.append(f"| {r['lab']} | {r['launches']} | {r['passed']} | {r['not_yet']} | {r['seconds']:.1f} "
                     f"| {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="solution notebooks (default: all of solutions/)")
    parser.add_argument("--pretend", type=int, default=None,
                        help="no CUDA here: behave as a VM with this many GPUs (MINIFSDP_FAKE_GPU)")
    parser.add_argument("--no-steps", action="store_true", help="skip the memory / bf16 step rows")
    args = parser.parse_args(argv)
    import torch
    env: dict[str, str] = {}
    if args.pretend is not None:
        env["MINIFSDP_FAKE_GPU"] = str(args.pretend)
        os.environ["MINIFSDP_FAKE_GPU"] = str(args.pretend)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    machine = (f"{gpus} x {torch.cuda.get_device_name(0)}, NCCL" if gpus else
               f"CPU, pretend {os.environ.get('MINIFSDP_FAKE_GPU', '0')} GPU(s)")
    notebooks = args.notebooks or sorted((ROOT / "solutions").glob("*.ipynb"))
    rows = []
    for path in notebooks:
        row = run_notebook(path.resolve(), env)
        print(f"{row['lab']}: {row['launches']}; passed {row['passed']}, not yet {row['not_yet']}, "
              f"{row['seconds']:.1f} s {row['error']}", flush=True)
        rows.append(row)
    if not args.no_steps:
        rows += device_rows(max(1, min(2, gpus or 2)))
    print(table(rows, machine))
    return 0 if all(not r["error"] and not r["not_yet"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
