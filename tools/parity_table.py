"""Every strategy and combination of ``python -m minifsdp.train``, a few steps each: their losses, for a refactor's proof.

A refactor of the trainer must not change what any strategy computes. This
runs the trainer's CLI for each row of ``ROWS`` (gpt-tiny, 3 steps, global
batch 8) and writes, per row, the ``losses`` of ``metrics.json`` and rank 0's
bytes per step. Run it on the commit before and the commit after, then
compare: every row's losses must be bit-identical (``==`` on the floats)::

    python tools/parity_table.py --out /tmp/parity_before.json      # on the old commit
    python tools/parity_table.py --out /tmp/parity_after.json --compare /tmp/parity_before.json

``--compare`` prints a Markdown table (row, before, after, identical) and
exits 1 if any row differs. ``--only SUBSTRING`` runs the matching rows.
``--vs-single`` holds every row to the parity contract instead: its losses
within tolerance of ``single``'s (fp32 rel 1e-5; bf16 and autocast one bf16
ulp, 2^-8; fp16 one fp16 ulp, 2^-11: tests/test_train.py, tests/train_helpers.py),
running ``single`` too if ``--only`` left it out::

    python tools/parity_table.py --out /tmp/parity_fsdp2.json --only fsdp2 --vs-single
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time

# (row name, CLI arguments after --model gpt-tiny --steps 3 --batch-size 8)
ROWS: list[tuple[str, str]] = [
    ("single", "--strategy single"),
    ("single bf16", "--strategy single --precision bf16"),
    ("single autocast", "--strategy single --autocast"),
    ("single ckpt full", "--strategy single --checkpoint full"),
    ("single ckpt selective", "--strategy single --checkpoint selective"),
    ("ddp-naive", "--strategy ddp-naive --world-size 2"),
    ("ddp", "--strategy ddp --world-size 2"),
    ("ddp grad-accum 2", "--strategy ddp --world-size 2 --grad-accum 2"),
    ("ddp bf16", "--strategy ddp --world-size 2 --precision bf16"),
    ("ddp fp16", "--strategy ddp --world-size 2 --precision fp16"),
    ("zero1", "--strategy zero1 --world-size 2"),
    ("zero2", "--strategy zero2 --world-size 2"),
    ("zero2 fp16", "--strategy zero2 --world-size 2 --precision fp16"),
    ("fsdp FULL_SHARD", "--strategy fsdp --world-size 2"),
    ("fsdp SHARD_GRAD_OP", "--strategy fsdp --world-size 2 --sharding-strategy SHARD_GRAD_OP"),
    ("fsdp NO_SHARD", "--strategy fsdp --world-size 2 --sharding-strategy NO_SHARD"),
    ("fsdp HYBRID_SHARD x4", "--strategy fsdp --world-size 4 --sharding-strategy HYBRID_SHARD"),
    ("fsdp wrap none", "--strategy fsdp --world-size 2 --wrap none"),
    ("fsdp bf16", "--strategy fsdp --world-size 2 --precision bf16"),
    ("fsdp fp16", "--strategy fsdp --world-size 2 --precision fp16"),
    ("fsdp ckpt full", "--strategy fsdp --world-size 2 --checkpoint full"),
    ("fsdp ckpt selective bf16", "--strategy fsdp --world-size 2 --checkpoint selective --precision bf16"),
    ("fsdp2 FULL_SHARD", "--strategy fsdp2 --world-size 2"),
    ("fsdp2 bf16", "--strategy fsdp2 --world-size 2 --precision bf16"),
    ("fsdp2 fp16", "--strategy fsdp2 --world-size 2 --precision fp16"),
    ("fsdp2 SHARD_GRAD_OP", "--strategy fsdp2 --world-size 2 --sharding-strategy SHARD_GRAD_OP"),
    ("fsdp2 HYBRID_SHARD x4", "--strategy fsdp2 --world-size 4 --sharding-strategy HYBRID_SHARD"),
    ("fsdp2 ckpt full", "--strategy fsdp2 --world-size 2 --checkpoint full"),
    ("fsdp2 grad-accum 2", "--strategy fsdp2 --world-size 2 --grad-accum 2"),
    ("torch-ddp", "--strategy torch-ddp --world-size 2"),
    ("torch-ddp bf16", "--strategy torch-ddp --world-size 2 --precision bf16"),
    ("torch-zero1", "--strategy torch-zero1 --world-size 2"),
    ("torch-fsdp", "--strategy torch-fsdp --world-size 2"),
    ("torch-fsdp SHARD_GRAD_OP", "--strategy torch-fsdp --world-size 2 --sharding-strategy SHARD_GRAD_OP"),
    ("torch-fsdp HYBRID_SHARD x4", "--strategy torch-fsdp --world-size 4 --sharding-strategy HYBRID_SHARD"),
    ("torch-fsdp ckpt full", "--strategy torch-fsdp --world-size 2 --checkpoint full"),
    ("torch-fsdp fp16", "--strategy torch-fsdp --world-size 2 --precision fp16"),
    ("torch-fsdp2", "--strategy torch-fsdp2 --world-size 2"),
    ("torch-fsdp2 SHARD_GRAD_OP bf16", "--strategy torch-fsdp2 --world-size 2 --sharding-strategy SHARD_GRAD_OP "
                                       "--precision bf16"),
    ("pp gpipe", "--strategy pp --pp 2 --schedule gpipe"),
    ("pp 1f1b", "--strategy pp --pp 2 --schedule 1f1b"),
    ("pp interleaved v2", "--strategy pp --pp 2 --schedule interleaved --virtual-stages 2"),
    ("pp zero-bubble v2", "--strategy pp --pp 2 --schedule zero-bubble --virtual-stages 2"),
    ("pp 1f1b bf16 ckpt full", "--strategy pp --pp 2 --precision bf16 --checkpoint full"),
    ("pp+dp 2x2", "--strategy pp+dp --pp 2 --dp 2"),
    ("torch-pp gpipe", "--strategy torch-pp --pp 2 --schedule gpipe"),
    ("torch-pp 1f1b", "--strategy torch-pp --pp 2 --schedule 1f1b"),
    ("torch-pp interleaved v2", "--strategy torch-pp --pp 2 --schedule interleaved --virtual-stages 2"),
    ("tp", "--strategy tp --tp 2"),
    ("tp sequence-parallel", "--strategy tp --tp 2 --sequence-parallel"),
    ("tp bf16 ckpt full", "--strategy tp --tp 2 --precision bf16 --checkpoint full"),
    ("tp fp16", "--strategy tp --tp 2 --precision fp16"),
    ("fsdp+tp 2x2", "--strategy fsdp+tp --dp 2 --tp 2"),
    ("fsdp+tp 2x2 bf16 ckpt selective", "--strategy fsdp+tp --dp 2 --tp 2 --precision bf16 --checkpoint selective"),
    ("torch-tp", "--strategy torch-tp --tp 2"),
    ("torch-tp autocast ckpt full", "--strategy torch-tp --tp 2 --autocast --checkpoint full"),
    ("torch-fsdp+tp 2x2", "--strategy torch-fsdp+tp --dp 2 --tp 2"),
    ("3d pp2 tp2", "--strategy 3d --pp 2 --tp 2 --dp 1"),
    ("3d pp2 tp2 ckpt full", "--strategy 3d --pp 2 --tp 2 --dp 1 --checkpoint full"),
]
COMMON = "--model gpt-tiny --steps 3 --batch-size 8 --no-memory"
# The parity contract's tolerances, relative per step's loss, by the precision a row computes in
TOLERANCE = {"fp32": 1e-5, "bf16": 2.0**-8, "fp16": 2.0**-11}


def run_row(args: str) -> dict:
    from minifsdp.train import parse_args, train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_args([*COMMON.split(), *args.split(), "--out", tmp, "--timeout", "300"])
        cfg = dataclasses.replace(cfg, quiet=True, write_plots=False)
        m = train(cfg)
    return {"losses": m["losses"], "world_size": m["world_size"], "bytes_per_step": m["bytes_per_step"][0]}


def compare(before: dict, after: dict) -> tuple[str, bool]:
    lines = ["| run | world | losses before | losses after | identical |", "|---|---|---|---|---|"]
    ok = True
    for name, _ in ROWS:
        b, a = before.get(name), after.get(name)
        same = b is not None and a is not None and b["losses"] == a["losses"]
        ok &= same
        fmt = (lambda r: "-" if r is None else ", ".join(f"{x:.9f}" for x in r["losses"]))
        world = (a or b or {}).get("world_size", "-")
        lines.append(f"| {name} | {world} | {fmt(b)} | {fmt(a)} | {'yes' if same else 'NO'} |")
    return "\n".join(lines), ok


def _precision(args: str) -> str:
    words = args.split()
    if "--precision" in words:
        return words[words.index("--precision") + 1]
    return "bf16" if "--autocast" in words else "fp32"


def against_single(results: dict) -> tuple[str, bool]:
    """Each row's largest relative loss difference from ``single``'s, beside its precision's tolerance."""
    reference = results["single"]["losses"]
    lines = ["| run | max relative difference from single | tolerance | within |", "|---|---|---|---|"]
    ok = True
    for name, args in ROWS:
        if name == "single" or name not in results:
            continue
        losses, tol = results[name]["losses"], TOLERANCE[_precision(args)]
        diff = None if losses is None else max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        within = diff is not None and diff <= tol
        ok &= within
        lines.append(f"| {name} | {'-' if diff is None else f'{diff:.2e}'} | {tol:.2e} | {'yes' if within else 'NO'} |")
    return "\n".join(lines), ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default=None, help="a JSON written by an earlier run: print the table")
    p.add_argument("--only", default=None, help="run only rows whose name contains this")
    p.add_argument("--vs-single", action="store_true", help="check every row's losses against single's (tolerance)")
    a = p.parse_args()
    results = {}
    for name, args in ROWS:
        if a.only and a.only not in name and not (a.vs_single and name == "single"):
            continue
        start = time.perf_counter()
        try:
            results[name] = run_row(args)
        except Exception as exc:  # a row that fails is reported, the others still run
            results[name] = {"losses": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"{name:<34} {time.perf_counter() - start:6.1f} s  {results[name]['losses']}", flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    if a.compare:
        text, ok = compare(json.load(open(a.compare)), results)
        print(text)
        sys.exit(0 if ok else 1)
    if a.vs_single:
        text, ok = against_single(results)
        print(text)
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
