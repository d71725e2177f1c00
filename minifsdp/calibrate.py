"""Calibrate this machine: collective latency and bandwidth, matmul FLOP/s, the other ops' rate; predict a run.

Front layer. ``python -m minifsdp.calibrate --world-sizes 1 2 4`` starts each
world size's ranks once (``launch``) and, on every rank at the same time (the
ranks share the machine as a training run's do):

* **compute** — a linear layer's forward and backward (its three n x n GEMMs,
  6n³ FLOPs) in fp32 and bf16 at a few sizes; a GPT block's non-matmul ops
  (layer norms, masked softmax, residual add, GELU) forward and backward on a
  block's shapes, as bytes of saved activations per second
  (``_block_elementwise``); the same ops on a handful of values (seconds per
  op: dispatch, autograd, launch); AdamW's step over weight-sized tensors
  (seconds per parameter). The ranks' rates are averaged.
* **collectives** — each of ``step_time.OPS`` (all_reduce, all_gather,
  reduce_scatter, broadcast, all_to_all, and send/recv as a ring shift: every
  rank sends to the next and receives from the previous) through ``comm``, at
  a few message sizes; per size the median of a few batches of calls, the
  slowest rank's. ``step_time.fit_alpha_beta`` fits ``t = α + β·bytes`` (least
  squares in relative error), bytes in ``comm``'s volume (an all-reduce of S
  bytes counts 2S): the units the planner counts in, so ``α·calls + β·bytes``
  is the op's time in a step.

Each measurement is the median of a few batches of calls made by every rank at
once: with more ranks than cores, or other processes running, a batch gets the
share of a core a training step would get.

nccl-tests (``all_reduce_perf``) measure the same curves; Hockney's α–β model
is the line through them. The result is a small JSON (``runs/calibration.json``
by default) that ``step_time.Calibration`` reads back and that the planner
(``planner.plan(..., calibration=...)``), ``bench`` and the trainer
(``predict_run``) turn into a predicted step time and MFU.

On CPU the numbers move with the machine's load: calibrate just before the
runs you predict, ideally with nothing else running.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import comm, dist, models, planner
from .launch import launch
from .layout import Layout
from .records import TrainConfig
from .step_time import DEFAULT_PATH, OPS, Calibration, OpCounter, StepTime, fit_alpha_beta, predict_gpt
from .strategies import STRATEGIES

__all__ = ["calibrate", "measure_rank", "from_ranks", "predict_run", "predicted_seconds", "predicted_line", "summary",
           "default_sizes", "main"]

# Message sizes (bytes of the full tensor) and matmul sizes: a quick sweep per device type.
_SIZES = {"cpu": (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20),
          "cuda": (64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)}
_MATMUL = {"cpu": (256, 512, 1024), "cuda": (1024, 4096, 8192)}
_BLOCK = {"cpu": (4, 128, 384, 6), "cuda": (8, 512, 1024, 16)}   # batch, length, width, heads: a block's shapes
_ADAMW = {"cpu": (8, 1 << 19), "cuda": (8, 1 << 24)}    # tensors x elements: weight matrices


def default_sizes(device_type: str) -> tuple[int, ...]:
    return _SIZES.get(device_type, _SIZES["cuda"])


def _seconds(fn: Callable[[], Any], repeats: int, device: torch.device, batch_s: float = 0.02,
             collective: bool = False) -> float:
    """Seconds per call of ``fn()``: the median of ``repeats`` batches of calls, each long enough (``batch_s``)
    that the clock's resolution does not decide it (CUDA: synchronised). A batch shares the cores with the
    other ranks (and whatever else runs) as a training step would. A ``collective`` makes every rank agree
    on the batch's length (the most any rank wants)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    fn()  # warm-up, and how long one call takes
    sync()
    calls = max(1, min(1000, int(batch_s / max(time.perf_counter() - start, 1e-6))))
    if collective:  # bookkeeping, not a measured collective: straight to torch.distributed
        agreed = torch.tensor([calls], device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        calls = int(agreed.item())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _block_elementwise(x: torch.Tensor, hidden: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A GPT block's ops that are not matmuls, on tensors of its shapes: ln_1, the masked softmax, the
    residual add and ln_2, GELU. Autograd saves ln's inputs, the probabilities and GELU's input: what
    ``step_time.elementwise_bytes`` counts in a GPT."""
    a = F.layer_norm(x, x.shape[-1:])
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
    b = F.layer_norm(x + a, x.shape[-1:])
    return a.sum() + probs.sum() + b.sum() + F.gelu(hidden).sum()


def _measure_compute(device: torch.device, repeats: int) -> dict[str, Any]:
    kind = device.type if device.type in _MATMUL else "cuda"
    flops: dict[str, list[list[float]]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        flops[name] = []
        for n in _MATMUL[kind]:  # a linear layer's three GEMMs: forward, input and weight gradients
            x, w, grad = (torch.randn(n, n, device=device, dtype=dtype, requires_grad=i < 2) for i in range(3))
            flops[name].append([n, 6 * n**3 / _seconds(lambda: (x @ w).backward(grad), repeats, device)])
    B, T, h, H = _BLOCK[kind]
    x, hidden, scores = (torch.randn(*shape, device=device, requires_grad=True)
                         for shape in ((B, T, h), (B, T, 4 * h), (B, H, T, T)))
    mask = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    saved = 4 * (B * T * h * 2 + B * T * 4 * h + B * H * T * T)    # ln inputs, GELU's input, the probabilities
    chain_s = _seconds(lambda: _block_elementwise(x, hidden, scores, mask).backward(), repeats, device)
    # the same ops on a handful of values: what each op costs before any work (dispatch, autograd, launch)
    tiny = [torch.randn(*shape, device=device, requires_grad=True) for shape in ((1, 4, 8), (1, 4, 32), (1, 2, 4, 4))]
    with OpCounter() as ops:
        _block_elementwise(*tiny, mask[:4, :4]).backward()
    op_s = _seconds(lambda: _block_elementwise(*tiny, mask[:4, :4]).backward(), repeats, device) / ops.n
    count, numel = _ADAMW[kind]
    params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)
    adamw_s = _seconds(opt.step, repeats, device)
    return {"matmul_flops": flops, "elementwise_bytes_per_s": saved / chain_s, "op_s": op_s,
            "optimizer_s_per_param": adamw_s / (count * numel)}


def _collective(op: str, nbytes: int, device: torch.device) -> tuple[Callable[[], None], int]:
    """A call of ``op`` on a full tensor of ``nbytes`` (fp32), and its volume in ``comm``'s bytes."""
    n, rank = dist.world_size(), dist.rank()
    numel = max(n, nbytes // 4 // n * n)
    full, received = torch.ones(numel, device=device), torch.empty(numel, device=device)
    part = torch.ones(numel // n, device=device)
    calls = {
        "all_reduce": lambda: comm.all_reduce(full),
        "all_gather": lambda: comm.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: comm.reduce_scatter_tensor(part, full),
        "broadcast": lambda: comm.broadcast(full, src=0),
        "all_to_all": lambda: comm.all_to_all_single(received, full),
        "send": lambda: [h.wait() for h in (comm.isend(full, (rank + 1) % n), comm.irecv(received, (rank - 1) % n))],
    }
    return calls[op], comm.collective_bytes(op, numel * 4, n)["bytes"]


def measure_rank(sizes: tuple[int, ...] | None = None, repeats: int = 3, ops: tuple[str, ...] = OPS) -> dict[str, Any]:
    """Run on every rank of a launch (``launch(measure_rank, n)``): this rank's compute rates, measured while
    every rank measures, then each collective at each size: ``{"compute": ..., "collectives": {op: [[bytes, s]]}}``."""
    device, n = dist.device(), dist.world_size()
    sizes = sizes or default_sizes(device.type)
    if n > 1:
        torch.distributed.barrier()
    out: dict[str, Any] = {"compute": _measure_compute(device, repeats), "collectives": {},
                           "device": device.type, "backend": dist.backend()}
    for op in ops if n > 1 else ():
        for nbytes in sizes:
            fn, volume = _collective(op, nbytes, device)
            torch.distributed.barrier()
            out["collectives"].setdefault(op, []).append([volume, _seconds(fn, repeats, device, collective=True)])
        if dist.rank() == 0:
            print(f"  {n} ranks: {op} at {len(sizes)} sizes", flush=True)
    return out


def calibrate(world_sizes: tuple[int, ...] = (1, 2), sizes: tuple[int, ...] | None = None, repeats: int = 3,
              timeout: float = 300.0, verbose: bool = True) -> Calibration:
    """Measure at each world size (one launch each) and fit α, β per collective and group size."""
    if not world_sizes or min(world_sizes) < 1:
        raise ValueError(f"--world-sizes must be >= 1 each, got {list(world_sizes)}; e.g. --world-sizes 1 2")
    if repeats < 1 or (sizes is not None and (len(set(sizes)) < 2 or min(sizes) <= 0)):
        raise ValueError("calibrate needs --repeats >= 1 and at least 2 distinct positive message sizes to fit α "
                         "and β")
    cal = Calibration()
    for n in sorted(set(world_sizes)):
        if verbose:
            print(f"calibrating {n} rank(s) ...", flush=True)
        cal = cal.merge(from_ranks(launch(measure_rank, n, sizes, repeats, timeout=timeout)))
    cal.notes = {"torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": repeats}
    return cal


def from_ranks(per_rank: list[dict[str, Any]]) -> Calibration:
    """One world size's ``Calibration`` from every rank's ``measure_rank``: the ranks' compute rates averaged,
    each collective's time the slowest rank's (a collective ends when its last rank does), α and β fitted."""
    n, rates = len(per_rank), [r["compute"] for r in per_rank]
    cal = Calibration(per_rank[0]["device"], per_rank[0]["backend"])
    cal.compute[n] = {
        "matmul_flops": {d: [[size, statistics.mean(r["matmul_flops"][d][i][1] for r in rates)]
                             for i, (size, _) in enumerate(rates[0]["matmul_flops"][d])]
                         for d in rates[0]["matmul_flops"]},
        "elementwise_bytes_per_s": statistics.mean(r["elementwise_bytes_per_s"] for r in rates),
        "optimizer_s_per_param": statistics.mean(r["optimizer_s_per_param"] for r in rates),
        "op_s": statistics.mean(r["op_s"] for r in rates)}
    for op, points in per_rank[0]["collectives"].items():
        slowest = [[b, max(r["collectives"][op][i][1] for r in per_rank)] for i, (b, _) in enumerate(points)]
        alpha, beta = fit_alpha_beta([b for b, _ in slowest], [s for _, s in slowest])
        cal.collectives[op] = {n: {"alpha_s": alpha, "beta_s_per_byte": beta, "points": slowest}}
    return cal


def summary(cal: Calibration) -> str:
    """The calibration as a table: α (µs) and bandwidth 1/β (GB/s of volume) per op and group size; compute."""
    lines = [f"{cal.device} / {cal.backend}", f"{'op':<15} {'ranks':>5} {'alpha us':>9} {'GB/s':>8}"]
    for op, by_group in cal.collectives.items():
        for g, fit in sorted(by_group.items()):
            bw = 1 / fit["beta_s_per_byte"] / 1e9 if fit["beta_s_per_byte"] > 0 else float("inf")
            lines.append(f"{op:<15} {g:>5} {fit['alpha_s'] * 1e6:9.1f} {bw:8.2f}")
    for n, c in sorted(cal.compute.items()):
        rates = "; ".join(f"{d} " + " ".join(f"{int(s)}:{r / 1e9:.0f}" for s, r in points)
                          for d, points in c["matmul_flops"].items())
        lines.append(f"{n} rank(s), per rank: linear GFLOP/s (n:rate) {rates}; other ops "
                     f"{c['elementwise_bytes_per_s'] / 1e9:.2f} GB/s saved; "
                     f"AdamW {c['optimizer_s_per_param'] * 1e9:.1f} ns/param; {c['op_s'] * 1e6:.1f} us an op")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# The trainer's prediction: a TrainConfig and its Layout through the planner
# --------------------------------------------------------------------------

_ZERO_STAGE = {"zero1": 1, "zero2": 2, "fsdp": 3, "fsdp2": 3, "fsdp+tp": 3}
_SHARDING_STAGE = {"SHARD_GRAD_OP": 2, "NO_SHARD": 0}


def predict_run(cfg: TrainConfig, layout: Layout | None = None,
                calibration: Calibration | str | None = None) -> StepTime:
    """The predicted step of ``train(cfg)`` on ``layout`` (default: the record's): the planner's bytes per mesh
    dimension (for data parallel alone, the record's exact ``expected_bytes``, sharding option included) through
    ``step_time.predict_gpt``. torch's records move what minifsdp's of the same name do. ``calibration``: a
    ``Calibration`` or a JSON path (default ``runs/calibration.json``)."""
    record = STRATEGIES[cfg.strategy]
    ours = STRATEGIES.get(cfg.strategy.removeprefix("torch-"), record)
    layout = layout or record.layout(cfg)
    cal = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration or DEFAULT_PATH)
    config = models.MODEL_PRESETS[cfg.model]
    seq_len = cfg.seq_len or config.block_size
    zero = _ZERO_STAGE.get(ours.name, 0)
    if ours.sharding_options:
        zero = _SHARDING_STAGE.get(cfg.sharding_strategy, zero)
    micro = cfg.micro_batches if layout.pp > 1 else cfg.grad_accum
    plan = planner.plan(config, batch=cfg.batch_size, seq_len=seq_len, layout=layout, micro_batches=micro,
                        precision=cfg.precision, zero_stage=0 if layout.ep > 1 else min(zero, 3),
                        sequence_parallel=cfg.sequence_parallel, cp_split=cfg.cp_split)
    comm_bytes: dict[str, dict[str, float]] = plan.comm
    groups = None
    if record.degrees == ("dp",) and ours.expected_bytes is not None:
        by_op = ours.expected_bytes(dataclasses.replace(cfg, strategy=ours.name), layout)["by_op"]
        comm_bytes = {"dp": {op: b for op, b in by_op.items() if b and op != "total"}}
        if layout.dp_shard is not None:  # HYBRID_SHARD: gathers inside a shard group, all-reduce across them
            groups = {"all_gather": layout.shard_size, "reduce_scatter": layout.shard_size,
                      "all_reduce": layout.dp_replicate}
    return predict_gpt(cal, config, batch=cfg.batch_size, seq_len=seq_len, comm=comm_bytes,
                       params_per_device=plan.params_per_device, dp=layout.dp, tp=layout.tp, pp=layout.pp,
                       cp=layout.cp, ep=layout.ep, micro_batches=micro, virtual_stages=layout.virtual_stages,
                       precision=cfg.precision, autocast=cfg.autocast, checkpoint=cfg.checkpoint, zero_stage=zero,
                       group_sizes=groups)


def predicted_seconds(cfg: TrainConfig, calibration: Calibration | str | None = None) -> float | None:
    """``predict_run(cfg).step_s``, or None for a layout the planner does not model (e.g. 6 layers on 4 stages)."""
    try:
        return predict_run(cfg, calibration=calibration).step_s
    except ValueError:
        return None


def predicted_line(cfg: TrainConfig, metrics: dict[str, Any], calibration: Calibration | str | None = None) -> str:
    """The trainer's summary line: ``predict_run(cfg)`` beside the run's measured step (the median over the
    steps after the first of the slowest rank's), or what to run when there is no calibration."""
    try:
        predicted = predict_run(cfg, calibration=calibration)
    except FileNotFoundError:
        return f"predicted step: no calibration; python -m minifsdp.calibrate writes {DEFAULT_PATH}"
    except ValueError as exc:  # a layout the planner does not model
        return f"predicted step: not modelled ({exc})"
    steps = [max(times) for times in zip(*metrics["step_time_s"])]
    return f"{predicted}; measured {statistics.median(steps[1:] or steps) * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minifsdp.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2],
                   help="ranks to calibrate at (1: compute only; >= 2: compute and collectives)")
    p.add_argument("--sizes-kib", type=int, nargs="+", default=None,
                   help="message sizes in KiB (default: 4 to 16384 on CPU, 64 to 262144 on CUDA)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (the median is kept)")
    p.add_argument("--out", default=DEFAULT_PATH, help="the JSON to write (merged into an existing one)")
    a = p.parse_args(argv)
    try:
        cal = calibrate(tuple(a.world_sizes), tuple(s << 10 for s in a.sizes_kib) if a.sizes_kib else None,
                        a.repeats)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    try:
        cal = Calibration.load(a.out).merge(cal)
    except FileNotFoundError:
        pass
    cal.save(a.out)
    print(summary(cal))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
