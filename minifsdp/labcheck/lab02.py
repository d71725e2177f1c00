"""Checks of lab 02 (data parallel): the learner's gradient-hook DDP, bucket layout,
bucketed DDP with overlapped asynchronous all-reduces, and gradient accumulation.

The yardstick of every check is the single process: gpt-tiny on the whole global
batch, computed here, in the checking process. The learner's code runs on 1, 2
and 4 ranks (``dist.lab_world_size``) with a *different seed per rank*, so a
missing broadcast shows; the tracer counts what it sent, and the same run with
``minifsdp.ddp``'s class gives the library's figures beside the learner's:

* bytes all-reduced per step: target 2·4Ψ (the ZeRO paper's volume of an
  all-reduce of Ψ fp32 gradients), exact;
* overlap: how many bucket all-reduces were launched while backward was still
  computing, and the learner's timeline drawn above the library's.

Read ``verdict.py`` first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import data, dist, models, plot, trace
from ..ddp import DistributedDataParallel, NaiveDataParallel, bucket_assignment
from .verdict import call, failed, figures, passed, require_written, run, uses

GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4  # fp32: N per-rank means summed in another order than one process sums
BATCH, SEQ = 8, 32
LIBRARY = ("DistributedDataParallel", "BucketedDataParallel", "NaiveDataParallel", "bucket_assignment",
           "broadcast_coalesced")


def _world_sizes() -> list[int]:
    """2 and 4 ranks (fewer on a VM with fewer GPUs); 1 rank is the single process itself."""
    return sorted({dist.lab_world_size(n) for n in (2, 4)})


def _reference_grads(step: int, batch: int = BATCH) -> dict[str, torch.Tensor]:
    """The single-process gradient of gpt-tiny (seed 0) on the whole global batch of ``step``."""
    model = models.build_model("gpt-tiny", seed=0)
    x, y = data.get_batch(step, batch, SEQ)
    models.lm_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _psi() -> int:
    return models.count_parameters(models.build_model("gpt-tiny", seed=0))


def _local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data.get_batch(step, BATCH, SEQ, rank=dist.rank(), world_size=dist.world_size())
    return x.to(dist.device()), y.to(dist.device())


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in model.named_parameters()}


def _grad_problem(grads: dict, want: dict, world: int, rank: int) -> str | None:
    """The most likely mistake behind gradients that differ from the single process, in words."""
    missing = [n for n, g in grads.items() if g is None]
    if missing:
        return f"rank {rank}: {missing[0]!r} has no .grad after backward"
    dot = sum((grads[n] * want[n]).sum() for n in grads)
    ratio = (dot / sum((g * g).sum() for g in want.values())).item()  # least-squares scale
    if world > 1 and abs(ratio - world) < 0.05 * world:
        return (f"with {world} ranks the gradients are {world}x too large: the all-reduce sums; divide by the "
                "world size to average")
    if world > 1 and abs(ratio - 1 / world) < 0.05 / world:
        return f"with {world} ranks the gradients are {world}x too small: divide by the world size once, not twice"
    for n in grads:
        if not torch.allclose(grads[n], want[n], atol=GRAD_ATOL, rtol=GRAD_RTOL):
            worst = (grads[n] - want[n]).abs().max().item()
            return (f"with {world} ranks, rank {rank}'s gradient of {n!r} differs from the single process by "
                    f"{worst:.2e} (atol {GRAD_ATOL}, rtol {GRAD_RTOL}): is every gradient averaged exactly once, "
                    "at rank 0's weights?")
    return None


def _same_start(params: dict, world: int) -> str | None:
    reference = models.build_model("gpt-tiny", seed=0)
    for n, p in reference.named_parameters():
        if not torch.equal(params[n], p.detach()):
            return (f"with {world} ranks the parameter {n!r} is not rank 0's: the ranks started from different "
                    "weights (each builds its model with its own seed); broadcast rank 0's parameters first")
    return None


# ------------------------------------------------------------------ exercise 1: gradient-hook DDP
def _hook_ddp_worker(make_dp: Callable | None, step: int, with_library: bool = False) -> dict:
    """One traced forward/backward through ``make_dp(model)`` (None: the library's NaiveDataParallel)."""
    model = models.build_model("gpt-tiny", seed=dist.rank()).to(dist.device())  # different weights per rank!
    x, y = _local_batch(step)
    with trace.Tracer() as tracer:
        wrapped = make_dp(model) if make_dp is not None else NaiveDataParallel(model)
        with trace.span("forward"):
            loss = models.lm_loss(wrapped(x), y)
        with trace.span("backward"):
            loss.backward()
    out = {"params": {n: p.detach().cpu() for n, p in model.named_parameters()}, "grads": _grads(model),
           "trace": tracer.trace}
    if with_library:  # the library's version, same ranks, same data: its figures beside the learner's
        out["library"] = _hook_ddp_worker(None, step)["trace"]
    return out


def _bytes(tr: trace.Trace, op: str) -> int:
    return sum(int(s.args.get("bytes", 0)) for s in tr.comm_spans() if s.name == op)


def hook_ddp(make_data_parallel: Callable) -> None:
    """``make_data_parallel(model)``: broadcast, then a post-accumulate-grad hook averaging each gradient."""
    what = "gradient-hook data parallel"
    require_written(what, make_data_parallel)
    if uses(make_data_parallel, *LIBRARY):
        failed(what, f"it uses minifsdp.ddp's {uses(make_data_parallel, *LIBRARY)[0]}: write the hooks yourself")
    want = _reference_grads(0)
    psi = _psi()
    for world in _world_sizes():
        results = run(what, _hook_ddp_worker, world, make_data_parallel, 0, world == max(_world_sizes()))
        problem = next((p for p in (_same_start(res["params"], world) for res in results) if p), None)
        for r, res in enumerate(results):
            problem = problem or _grad_problem(res["grads"], want, world, r)
        if problem:
            failed(what, problem)
        tr = results[0]["trace"]
        backward = next(s for s in tr.compute_spans() if s.name == "backward")
        reduces = [s for s in tr.comm_spans() if s.name == "all_reduce"]
        if world > 1 and not all(backward.start <= s.start <= backward.end for s in reduces):
            failed(what, "some all-reduces ran outside backward: average each gradient from its hook, as autograd "
                         "finishes it (register_post_accumulate_grad_hook)")
    mine = _bytes(tr, "all_reduce")
    library = _bytes(results[0]["library"], "all_reduce")
    if world > 1 and mine != 2 * 4 * psi:
        failed(what, f"{mine:,} B all-reduced per step, target 2·4Ψ = {2 * 4 * psi:,} B: every gradient exactly once")
    passed(what, f"gradients = single process at world sizes {_world_sizes()}; "
           + figures(f"{world} ranks, all-reduce bytes per step (target 2·4Ψ, Ψ = {psi:,})", mine, 2 * 4 * psi,
                     library, unit="B")
           + f"; {len(reduces)} all-reduces, one per parameter tensor, each inside backward")


# ------------------------------------------------------------------ exercise 2: bucket layout
def bucket_layout(layout_fn: Callable) -> None:
    """``layout_fn(params, cap_bytes)`` must group parameter indices as torch's DDP does (reverse, close at the cap)."""
    what = "bucket layout"
    require_written(what, layout_fn)
    if uses(layout_fn, "bucket_assignment"):
        failed(what, "it calls minifsdp.ddp.bucket_assignment: write the rule yourself")
    model = models.build_model("gpt-mini", seed=0)
    params = list(model.parameters())
    for cap_mb in (0.25, 1.0, 4.0, 1e-6, 100.0):
        got = call(what, layout_fn, params, int(cap_mb * 2**20))
        want = bucket_assignment(params, cap_mb)
        got = [list(b) for b in got] if isinstance(got, (list, tuple)) else got
        if got == want:
            continue
        flat = [i for b in got for i in b] if isinstance(got, list) else []
        if sorted(flat) != list(range(len(params))):
            failed(what, f"cap {cap_mb} MiB: every parameter index must be in exactly one bucket "
                         f"({len(params)} parameters, you placed {len(flat)})")
        if flat == list(range(len(params))) and len(params) > 1:
            failed(what, "the buckets follow the parameters in forward order: backward produces the last layer's "
                         "gradients first, so fill buckets in reverse order")
        sizes = [sum(params[i].numel() * 4 for i in b) for b in got]
        cap = int(cap_mb * 2**20)
        if any(s < cap for s in sizes[:-1]) and any(s > cap for s in sizes):
            failed(what, f"cap {cap_mb} MiB: you got {len(got)} buckets, torch's rule gives {len(want)}: add "
                         "gradients to the open bucket until its size reaches the cap, then close it")
        failed(what, f"cap {cap_mb} MiB: you got {len(got)} buckets of {[round(s / 2**20, 3) for s in sizes]} MiB, "
                     f"torch's rule gives {len(want)}: close a bucket as soon as it reaches (>=) the cap, and keep "
                     "what is left at the end as a last, smaller bucket")
    passed(what, f"gpt-mini's {len(params)} tensors: "
           + figures("buckets at a 1 MiB cap", len(layout_fn(params, 2**20)), len(bucket_assignment(params, 1.0)))
           + " (target torch's rule), and at 4 other caps")


# ------------------------------------------------------------------ exercise 3: bucketed, overlapped DDP
def traced_steps(cls: Callable | None, cap_mb: float, steps: int, model_name: str = "gpt-tiny",
                     batch: int = BATCH, keep: bool = True, with_library: bool = False) -> dict:
    """``steps`` steps (no optimizer: each step's gradient is compared); every step traced."""
    model = models.build_model(model_name, seed=dist.rank()).to(dist.device())
    tracer = trace.Tracer()
    with tracer:
        ddp = cls(model, cap_mb) if cls is not None else DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    forward = model if cls is not None else ddp
    grads = []
    for step in range(steps):
        x, y = data.get_batch(step, batch, SEQ, rank=dist.rank(), world_size=dist.world_size())
        x, y = x.to(dist.device()), y.to(dist.device())
        with tracer, trace.span("step", step=step):
            with trace.span("forward"):
                loss = models.lm_loss(forward(x), y)
            with trace.span("backward"):
                loss.backward()
            if cls is not None:
                with trace.span("sync"):
                    ddp.finish_gradient_sync()
        if keep:
            grads.append(_grads(model))
        model.zero_grad(set_to_none=True)
    params = {n: p.detach().cpu() for n, p in model.named_parameters()} if keep else {}
    library = traced_steps(None, cap_mb, steps, model_name, batch, False)["trace"] if with_library else None
    return {"grads": grads, "trace": tracer.trace, "params": params, "library": library}


def step_report(tr: trace.Trace, step: int) -> dict[str, Any]:
    """Bytes, all-reduces and overlap of one step of one rank's trace (learner's or library's)."""
    window = next(s for s in tr.compute_spans() if s.name == "step" and s.args.get("step") == step)
    inside = [s for s in tr.spans if window.start <= s.start <= window.end]
    backward = next(s for s in inside if s.name == "backward")
    reduces = [s for s in inside if s.kind == trace.COMM and s.name == "all_reduce"]
    return {"bytes": sum(int(s.args["bytes"]) for s in reduces), "all_reduces": len(reduces),
            "async": all(s.args.get("async_op") for s in reduces),
            "launched_in_backward": sum(s.start < backward.end for s in reduces),
            "in_flight_at_backward_end": sum(s.start < backward.end < s.end for s in reduces),
            "step_ms": window.duration * 1e3, "backward_ms": backward.duration * 1e3, "window": window}


def step_timeline(traces: list[trace.Trace], step: int, ax: Any, title: str) -> None:
    """``plot.timeline`` of one step of every rank (1 ms margins), on ``ax``."""
    t0 = min(s.start for tr in traces for s in tr.spans)
    windows = [step_report(tr, step)["window"] for tr in traces]
    lo, hi = min(w.start for w in windows), max(w.end for w in windows)
    plot.timeline(traces, ax=ax, title=title, window=((lo - t0) * 1e3 - 1, (hi - t0) * 1e3 + 1))


def bucketed_ddp(cls: Callable, cap_mb: float = 0.05) -> plot.Figure:
    """``cls(model, cap_mb)`` + ``finish_gradient_sync()``: bucketed async all-reduce, overlapped with backward."""
    what = "bucketed, overlapped data parallel"
    require_written(what, cls.__init__, cls.grad_ready, cls.finish_gradient_sync)
    if uses(cls.__init__, *LIBRARY) or uses(cls.grad_ready, *LIBRARY):
        failed(what, "it uses minifsdp.ddp's own classes: build the buckets yourself")
    psi = _psi()
    want = [_reference_grads(0), _reference_grads(1)]
    worlds = _world_sizes()
    for world in worlds:
        results = run(what, traced_steps, world, cls, cap_mb, 2, "gpt-tiny", BATCH, True, world == worlds[-1])
        problem = next((p for p in (_same_start(res["params"], world) for res in results) if p), None)
        for r, res in enumerate(results):
            for step in (0, 1):
                problem = problem or _grad_problem(res["grads"][step], want[step], world, r)
                if problem and step == 1 and not _grad_problem(res["grads"][0], want[0], world, r):
                    problem = ("step 0 is right but step 1 is not: reset what finish_gradient_sync leaves behind "
                               "(pending counts, handles) for the next backward. " + problem)
            if problem:
                failed(what, problem)
    rep = step_report(results[0]["trace"], 1)
    n_buckets = len(bucket_assignment(list(models.build_model("gpt-tiny").parameters()), cap_mb))
    if world > 1:
        if rep["bytes"] != 2 * 4 * psi:
            failed(what, f"{rep['bytes']:,} B all-reduced in a step, target 2·4Ψ = {2 * 4 * psi:,} B: all-reduce "
                         "each bucket once per step, and nothing else")
        if rep["all_reduces"] != n_buckets:
            failed(what, f"{rep['all_reduces']} all-reduces in a step for {n_buckets} buckets: one per bucket")
        if not rep["async"]:
            failed(what, "the all-reduces are blocking: launch them with async_op=True so backward goes on "
                         "computing while a bucket travels, and wait for the handles at the end")
        if rep["launched_in_backward"] < n_buckets:
            failed(what, f"only {rep['launched_in_backward']} of {n_buckets} buckets were launched during backward: "
                         "launch a bucket from the hook that completes it, not after backward")
        if rep["in_flight_at_backward_end"] == 0:
            failed(what, "every bucket was waited for right after its launch, so nothing overlapped backward: "
                         "keep the handles and wait for them in finish_gradient_sync")
    library_traces = [res["library"] for res in results]
    lib = step_report(library_traces[0], 1)
    fig, (mine_ax, lib_ax) = plot.column_figure(nrows=2, height=5.0)
    step_timeline([res["trace"] for res in results], 1, mine_ax, f"your bucketed DDP, {world} ranks, "
                  f"gpt-tiny, cap {cap_mb} MiB, step 1 (ms)")
    step_timeline(library_traces, 1, lib_ax, "minifsdp.ddp.DistributedDataParallel, "
                  "same model, cap and step (ms)")
    passed(what, f"gradients = single process at world sizes {worlds} (2 steps); "
           + figures(f"bytes per step (target 2·4Ψ, Ψ = {psi:,})", rep["bytes"], 2 * 4 * psi, lib["bytes"], unit="B")
           + "; " + figures("buckets launched during backward", rep["launched_in_backward"], n_buckets,
                            lib["launched_in_backward"]))
    return fig


# ------------------------------------------------------------------ exercise 4: accumulation with no_sync
def _accumulation_worker(step_fn: Callable, accum: int, batch: int) -> dict:
    model = DistributedDataParallel(models.build_model("gpt-tiny", seed=0).to(dist.device()))
    micro = [tuple(t.to(dist.device()) for t in data.get_batch(0, batch, SEQ, rank=dist.rank(),
                                                                  world_size=dist.world_size(), micro_step=m,
                                                                  grad_accum=accum)) for m in range(accum)]
    with trace.Tracer() as tracer:
        step_fn(model, micro)
    return {"all_reduce_bytes": _bytes(tracer.trace, "all_reduce"), "grads": _grads(model.module)}


def accumulation(step_fn: Callable, accum: int = 4, batch: int = 16) -> None:
    """``step_fn(ddp_model, micro_batches)``: the whole-batch gradient with one all-reduce (2·4Ψ bytes)."""
    what = "gradient accumulation"
    require_written(what, step_fn)
    want = _reference_grads(0, batch)
    psi = _psi()
    for world in sorted({dist.lab_world_size(2), dist.lab_world_size(4)}):
        res = run(what, _accumulation_worker, world, step_fn, accum, batch)
        moved = res[0]["all_reduce_bytes"]
        if world > 1 and moved == accum * 2 * 4 * psi:
            failed(what, f"every micro-batch was all-reduced ({moved:,} B = {accum} x 2·4Ψ): run the forward AND "
                         "the backward of all micro-batches but the last inside no_sync() (DDP decides in forward)")
        if world > 1 and moved == 0:
            failed(what, "nothing was all-reduced: the last micro-batch, its forward included, must run outside "
                         "no_sync()")
        if world > 1 and moved != 2 * 4 * psi:
            failed(what, f"{moved:,} B all-reduced, target one all-reduce of every gradient, 2·4Ψ = "
                         f"{2 * 4 * psi:,} B: only the last micro-batch may run outside no_sync()")
        grads = res[0]["grads"]
        if any(g is None for g in grads.values()):
            failed(what, "some parameters have no .grad: call backward() on each micro-batch's loss")
        ratio = (sum((grads[n] * want[n]).sum() for n in grads) / sum((g * g).sum() for g in want.values())).item()
        if abs(ratio - accum) < 0.05 * accum:
            failed(what, f"the gradients are {accum}x too large: divide each micro-batch's loss by k = "
                         "len(micro_batches), so that the sum of the k gradients is the gradient of their mean")
        for n in grads:
            if not torch.allclose(grads[n], want[n], atol=GRAD_ATOL, rtol=GRAD_RTOL):
                failed(what, f"with {world} ranks the accumulated gradient of {n!r} is not the single-process "
                             "gradient of the whole batch: run every micro-batch once, each loss divided by k")
    passed(what, figures(f"all-reduce bytes for {accum} micro-batches", moved, 2 * 4 * psi, unit="B")
           + "; gradients = single process on the whole batch")
