"""Checks of lab 02 (data parallel): the learner's gradient-hook DDP, bucket layout,
bucketed DDP with overlapped asynchronous all-reduces, and gradient accumulation.

The yardstick of every check is the single process: gpt-tiny on the whole global
batch, computed here, in the checking process. The learner's code always runs on
2 and 4 ranks (``WORLDS``; ``launch`` runs CPU ranks on a machine with fewer
GPUs: one rank averages nothing, so it would prove nothing) with a *different
seed per rank*, so a missing broadcast shows; the tracer counts what it sent,
and the same run with ``minifsdp.ddp``'s class, after the learner's, gives the
library's figures beside the learner's:

* bytes all-reduced per step: target 2·4Ψ (Ψ = the number of parameters; an
  all-reduce of Ψ fp32 gradients moves 2·4Ψ bytes, the ZeRO paper's volume), exact;
* overlap: how many bucket all-reduces were launched while backward was still
  computing, and the learner's timeline drawn above the library's.

Whose code ran: each check refuses ``minifsdp.ddp``'s mechanism statically
(``refuse_library``: aliases, notebook helpers, subclasses) and at run time (a
``Wire`` around the learner's part of each worker, not around the library's
comparison run). Exercise 4 gets a library ``DistributedDataParallel`` by design:
there the learner's code may use its public interface (forward, ``no_sync``) but
not call its private synchronisation methods itself.

Read ``verdict.py`` first.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from .. import data, dist, models, plot, trace
from ..ddp import BucketedDataParallel, DistributedDataParallel, NaiveDataParallel, broadcast_coalesced
from ..ddp import bucket_assignment
from ..ddp.common import _weak_hook
from .authorship import LibraryShortcut, _functions_of
from .verdict import Hints, Wire, call, failed, figures, passed, refuse_library, require_written, run, watched

GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4  # fp32: N per-rank means summed in another order than one process sums
BATCH, SEQ = 8, 32
WORLDS = (2, 4)                    # every check runs the learner's code on 2 and on 4 ranks

# The library's implementation of the exercises: watched at run time (Wire) and refused statically.
LIBRARY = (NaiveDataParallel, BucketedDataParallel, DistributedDataParallel, bucket_assignment,
           broadcast_coalesced, _weak_hook)
STATIC_ONLY = (_TorchDDP,)          # torch's DDP: a C++ reducer, no Python code for a wire to see
LAYOUT_LIBRARY = (bucket_assignment, BucketedDataParallel, DistributedDataParallel)
_torch_layout = getattr(tdist, "_compute_bucket_assignment_by_size", None)  # torch's rule, in C++
LAYOUT_STATIC_ONLY = (_torch_layout,) if _torch_layout is not None else ()
# Exercise 4 is handed a library DDP: its forward, no_sync and hooks run legitimately (and call
# broadcast_coalesced for buffers, _weak_hook's hook for gradients); the other ways to sync are watched.
ACCUM_WIRE = (NaiveDataParallel, bucket_assignment)

hint = Hints({
    "make_data_parallel": [
        "Two things make N ranks equal one process: they compute at the same weights, and they all step "
        "with the same gradient, the average of their N gradients.",
        "Equal weights are a one-time job, before any forward. Averaging is once per parameter per backward: "
        "autograd tells you, through a hook, when that parameter's .grad is complete.",
        "comm.all_reduce sums in place; an average is that sum over the world size. A tensor that autograd "
        "tracks is changed in place under torch.no_grad(). The hook receives the parameter.",
    ],
    "bucket_layout": [
        "Backward produces the last layer's gradient first, so the first bucket to fill holds the last "
        "parameters.",
        "Keep the open bucket and its size in bytes: a tensor's bytes are its number of elements times its "
        "element size.",
        "Add a tensor, then ask whether the open bucket has reached the cap; whatever is still open at the end "
        "is the last (smaller) bucket, unless it is empty.",
    ],
    "BucketedDDP": [
        "A bucket is one flat fp32 tensor holding its parameters' gradients side by side; slice_of(i) shows "
        "where parameter i lives in it, through self.flat and self.offset.",
        "In __init__: each bucket's buffer is as long as its parameters together, on dist.device(); a "
        "parameter's offset is where the ones before it in the same bucket end.",
        "grad_ready: the gradient goes into its slice and the bucket's pending count goes down; the gradient "
        "that completes a bucket starts that bucket's all-reduce without waiting for it (keep what it returns).",
        "finish_gradient_sync: each handle waited for, the sum turned into the average, each slice copied back "
        "into its p.grad; then the pending counts and the handles are reset, or the next step goes wrong.",
    ],
    "accumulation_step": [
        "Gradients add up in p.grad across backward passes. If each micro-batch's loss is divided by k, the "
        "sum of the k gradients is the gradient of the mean loss over all k micro-batches.",
        "One all-reduce of that sum, after the last micro-batch, gives every rank the average: syncing every "
        "micro-batch moves k times the bytes for the same result. no_sync() turns the sync off inside it.",
        "The DDP decides in forward whether the coming backward will all-reduce. Which forwards, and which "
        "backwards, must run inside no_sync() so that only the last micro-batch syncs?",
    ],
})


# ------------------------------------------------------------------ the guards
def _refuse(what: str, fns: tuple, library: tuple) -> None:
    """``refuse_library`` for each of ``fns``: one sentence on the first that reaches the library."""
    for fn in fns:
        refuse_library(what, fn, *library)


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
    if abs(ratio - world) < 0.05 * world:
        return (f"with {world} ranks the gradients are {world}x too large: the all-reduce sums; divide by the "
                "world size to average")
    if abs(ratio - 1 / world) < 0.05 / world:
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


def _bytes(tr: trace.Trace, op: str) -> int:
    return sum(int(s.args.get("bytes", 0)) for s in tr.comm_spans() if s.name == op)


def _psi_text(psi: int) -> str:
    return f"Ψ = {psi:,} parameters"


# ------------------------------------------------------------------ exercise 1: gradient-hook DDP
def _hook_ddp_worker(make_dp: Callable | None, step: int, with_library: bool = False) -> dict:
    """One traced forward/backward through ``make_dp(model)`` under a wire (None: the library's
    NaiveDataParallel, unwatched); then, with ``with_library``, the library's run for its figures."""
    model = models.build_model("gpt-tiny", seed=dist.rank()).to(dist.device())  # different weights per rank!
    x, y = _local_batch(step)
    with trace.Tracer() as tracer:
        with Wire(*LIBRARY) if make_dp is not None else contextlib.nullcontext():
            wrapped = make_dp(model) if make_dp is not None else NaiveDataParallel(model)
            if wrapped is None:
                raise TypeError("make_data_parallel returned None: return the model")
            with trace.span("forward"):
                loss = models.lm_loss(wrapped(x), y)
            with trace.span("backward"):
                loss.backward()
    out = {"params": {n: p.detach().cpu() for n, p in model.named_parameters()}, "grads": _grads(model),
           "trace": tracer.trace}
    if with_library:  # the library's version, same ranks, same data, outside the wire
        out["library"] = _hook_ddp_worker(None, step)["trace"]
    return out


def hook_ddp(make_data_parallel: Callable) -> None:
    """``make_data_parallel(model)``: broadcast, then a post-accumulate-grad hook averaging each gradient."""
    what = "gradient-hook data parallel"
    require_written(what, make_data_parallel)
    _refuse(what, (make_data_parallel,), LIBRARY + STATIC_ONLY)
    want = _reference_grads(0)
    psi = _psi()
    for world in WORLDS:
        results = run(what, _hook_ddp_worker, world, make_data_parallel, 0, world == WORLDS[-1])
        problem = next((p for p in (_same_start(res["params"], world) for res in results) if p), None)
        for r, res in enumerate(results):
            problem = problem or _grad_problem(res["grads"], want, world, r)
        if problem:
            failed(what, problem)
        tr = results[0]["trace"]
        backward = next(s for s in tr.compute_spans() if s.name == "backward")
        reduces = [s for s in tr.comm_spans() if s.name == "all_reduce"]
        mine = _bytes(tr, "all_reduce")
        if mine != 2 * 4 * psi:
            failed(what, f"with {world} ranks, {mine:,} B all-reduced per step through comm, target 2·4Ψ = "
                         f"{2 * 4 * psi:,} B ({_psi_text(psi)}): every gradient exactly once, with comm.all_reduce")
        if not all(backward.start <= s.start <= backward.end for s in reduces):
            failed(what, "some all-reduces ran outside backward: average each gradient from its hook, as autograd "
                         "finishes it (register_post_accumulate_grad_hook)")
    library = _bytes(results[0]["library"], "all_reduce")
    passed(what, f"gradients = single process at world sizes {list(WORLDS)}; "
           + figures(f"{world} ranks, all-reduce bytes per step (target 2·4Ψ, {_psi_text(psi)})", mine,
                     2 * 4 * psi, library, unit="B")
           + f"; {len(reduces)} all-reduces, each inside backward")


# ------------------------------------------------------------------ exercise 2: bucket layout
def bucket_layout(layout_fn: Callable) -> None:
    """``layout_fn(params, cap_bytes)`` must group parameter indices as torch's DDP does (reverse, close at the cap)."""
    what = "bucket layout"
    require_written(what, layout_fn)
    _refuse(what, (layout_fn,), LAYOUT_LIBRARY + LAYOUT_STATIC_ONLY)
    mine = watched(layout_fn, *LAYOUT_LIBRARY)
    model = models.build_model("gpt-mini", seed=0)
    params = list(model.parameters())
    at_1mib = None
    for cap_mb in (0.25, 1.0, 4.0, 1e-6, 100.0):
        got = call(what, mine, params, int(cap_mb * 2**20))
        want = bucket_assignment(params, cap_mb)   # the library's, in the check's process: the target
        got = [list(b) for b in got] if isinstance(got, (list, tuple)) else got
        if cap_mb == 1.0:
            at_1mib = got
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
           + figures("buckets at a 1 MiB cap", len(at_1mib), len(bucket_assignment(params, 1.0)))
           + " (target torch's rule), and at 4 other caps")


# ------------------------------------------------------------------ exercise 3: bucketed, overlapped DDP
def _traced_steps(cls: Callable | None, cap_mb: float, steps: int, model_name: str = "gpt-tiny",
                  batch: int = BATCH, keep: bool = True, with_library: bool = False, watch: bool = True) -> dict:
    """``steps`` steps of ``cls(model, cap_mb)`` + ``finish_gradient_sync()`` (None: the library's DDP), no
    optimizer (each step's gradient is compared); every step traced. With ``watch`` the learner's part (build,
    forward, backward, sync) runs under a wire; the library's comparison run comes after, outside it."""
    model = models.build_model(model_name, seed=dist.rank()).to(dist.device())
    tracer = trace.Tracer()
    grads = []
    with Wire(*LIBRARY) if cls is not None and watch else contextlib.nullcontext():
        with tracer:
            ddp = cls(model, cap_mb) if cls is not None else DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        forward = model if cls is not None else ddp
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
    library = _traced_steps(None, cap_mb, steps, model_name, batch, False)["trace"] if with_library else None
    return {"grads": grads, "trace": tracer.trace, "params": params, "library": library}


def _step_report(tr: trace.Trace, step: int) -> dict[str, Any]:
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


def _step_timeline(traces: list[trace.Trace], step: int, ax: Any, title: str) -> None:
    """``plot.timeline`` of one step of every rank (1 ms margins), on ``ax``."""
    t0 = min(s.start for tr in traces for s in tr.spans)
    windows = [_step_report(tr, step)["window"] for tr in traces]
    lo, hi = min(w.start for w in windows), max(w.end for w in windows)
    plot.timeline(traces, ax=ax, title=title, window=((lo - t0) * 1e3 - 1, (hi - t0) * 1e3 + 1))


def bucketed_ddp(cls: Callable, cap_mb: float = 0.05) -> plot.Figure:
    """``cls(model, cap_mb)`` + ``finish_gradient_sync()``: bucketed async all-reduce, overlapped with backward."""
    what = "bucketed, overlapped data parallel"
    if not isinstance(cls, type):
        failed(what, f"expected the class BucketedDDP, got {type(cls).__name__}: pass the class itself")
    _refuse(what, (cls,), LIBRARY + STATIC_ONLY)   # first: a subclass of the library's inherits its methods
    require_written(what, cls.__init__, cls.grad_ready, cls.finish_gradient_sync)
    psi = _psi()
    want = [_reference_grads(0), _reference_grads(1)]
    n_buckets = len(bucket_assignment(list(models.build_model("gpt-tiny").parameters()), cap_mb))
    for world in WORLDS:
        results = run(what, _traced_steps, world, cls, cap_mb, 2, "gpt-tiny", BATCH, True, world == WORLDS[-1])
        problem = next((p for p in (_same_start(res["params"], world) for res in results) if p), None)
        for r, res in enumerate(results):
            for step in (0, 1):
                problem = problem or _grad_problem(res["grads"][step], want[step], world, r)
                if problem and step == 1 and not _grad_problem(res["grads"][0], want[0], world, r):
                    problem = ("step 0 is right but step 1 is not: reset what finish_gradient_sync leaves behind "
                               "(pending counts, handles) for the next backward. " + problem)
            if problem:
                failed(what, problem)
        rep = _step_report(results[0]["trace"], 1)
        if rep["bytes"] != 2 * 4 * psi:
            failed(what, f"with {world} ranks, {rep['bytes']:,} B all-reduced in a step, target 2·4Ψ = "
                         f"{2 * 4 * psi:,} B ({_psi_text(psi)}): all-reduce each bucket once per step, and nothing "
                         "else")
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
    lib = _step_report(library_traces[0], 1)
    fig, (mine_ax, lib_ax) = plot.column_figure(nrows=2, height=5.0)
    _step_timeline([res["trace"] for res in results], 1, mine_ax, f"your bucketed DDP, {world} ranks, "
                   f"gpt-tiny, cap {cap_mb} MiB, step 1 (ms)")
    _step_timeline(library_traces, 1, lib_ax, "minifsdp.ddp.DistributedDataParallel, "
                   "same model, cap and step (ms)")
    passed(what, f"gradients = single process at world sizes {list(WORLDS)} (2 steps); "
           + figures(f"bytes per step (target 2·4Ψ, {_psi_text(psi)})", rep["bytes"], 2 * 4 * psi, lib["bytes"],
                     unit="B")
           + "; " + figures("buckets launched during backward", rep["launched_in_backward"], n_buckets,
                            lib["launched_in_backward"]))
    return fig


def bucket_run(cls: Callable, cap_mb: float, world: int = 2, steps: int = 3, model_name: str = "gpt-mini",
               batch: int = BATCH) -> tuple[dict[str, Any], plot.Figure]:
    """The bucket-size explorer's run (not a check): your ``cls`` on ``world`` ranks, ``steps`` traced steps
    of ``model_name`` at ``cap_mb``. Returns rank 0's report of the last step (``all_reduces``,
    ``launched_in_backward``, ``in_flight_at_backward_end``, ``step_ms``, ``backward_ms``) and the figure of
    that step on every rank (time in ms)."""
    what = "bucket-size run"
    require_written(what, cls.__init__, cls.grad_ready, cls.finish_gradient_sync)
    _refuse(what, (cls,), LIBRARY + STATIC_ONLY)
    runs = run(what, _traced_steps, world, cls, cap_mb, steps, model_name, batch, False, False, False,
               timeout=120)
    last = steps - 1
    report = _step_report(runs[0]["trace"], last)
    fig, ax = plot.column_figure(height=2.8)
    _step_timeline([r["trace"] for r in runs], last, ax, f"your BucketedDDP, {model_name}, cap {cap_mb:g} MiB, "
                   f"{world} ranks, step {last} (ms)")
    return report, fig


# ------------------------------------------------------------------ exercise 4: accumulation with no_sync
_HERE = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["minifsdp"], torch))
_DECORATORS = (os.path.join("torch", "utils", "_contextlib.py"), os.sep + "contextlib.py")


class _PrivateCalls:
    """Exercise 4's extra rule: the DDP model's private methods (its own synchronisation:
    ``_launch_ready_buckets``, ``_pack``, ``_copy_back``, ...) may run only when the DDP itself calls them (its
    hooks, its end-of-backward callback), never from the learner's code. A profiler that chains to the one
    already set (the ``Wire`` around it); on leaving, a private call from the learner's code raises
    ``LibraryShortcut``."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self._previous: Any = None
        self._alive: list[types.CodeType] = []

    def __enter__(self) -> "_PrivateCalls":
        private: dict[int, str] = {}
        for fn, name in _functions_of(DistributedDataParallel):
            attr = name.rsplit(".", 1)[-1]
            if attr.startswith("_") and not attr.startswith("__"):
                private[id(fn.__code__)] = name
                self._alive.append(fn.__code__)
        hits, previous = self.hits, sys.getprofile()

        def profile(frame: types.FrameType, event: str, arg: Any) -> None:
            if previous is not None:
                previous(frame, event, arg)
            if event != "call" or id(frame.f_code) not in private:
                return
            caller = frame.f_back
            while caller is not None and caller.f_code.co_filename.endswith(_DECORATORS):
                caller = caller.f_back    # @torch.no_grad()'s wrapper: who called the wrapper?
            if caller is not None and not caller.f_code.co_filename.startswith(_HERE):
                hits.append(private[id(frame.f_code)])
        self._previous = previous
        sys.setprofile(profile)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        sys.setprofile(self._previous)
        if self.hits and not isinstance(exc, LibraryShortcut):
            raise LibraryShortcut(
                f"your code called the library's {self.hits[0]} itself: the DDP model synchronises on its own "
                "(its hooks, its end of backward); the exercise is to arrange the micro-batches so that it "
                "does so once") from None


def _accumulation_worker(step_fn: Callable, accum: int, batch: int) -> dict:
    model = DistributedDataParallel(models.build_model("gpt-tiny", seed=0).to(dist.device()))
    micro = [tuple(t.to(dist.device()) for t in data.get_batch(0, batch, SEQ, rank=dist.rank(),
                                                                  world_size=dist.world_size(), micro_step=m,
                                                                  grad_accum=accum)) for m in range(accum)]
    forwards: list[int] = []
    model.module.register_forward_pre_hook(lambda module, args: forwards.append(int(args[0].shape[0])))
    with trace.Tracer() as tracer:
        with Wire(*ACCUM_WIRE), _PrivateCalls():
            returned = step_fn(model, micro)
    reduces = [s for s in tracer.trace.comm_spans() if s.name == "all_reduce"]
    return {"all_reduce_bytes": _bytes(tracer.trace, "all_reduce"), "all_reduces": len(reduces),
            "buckets": len(model.buckets), "forwards": forwards, "micro_rows": int(micro[0][0].shape[0]),
            "returned": None if returned is None else type(returned).__name__, "grads": _grads(model.module)}


def accumulation(step_fn: Callable, accum: int = 4, batch: int = 16) -> None:
    """``step_fn(ddp_model, micro_batches)``: the whole-batch gradient with one all-reduce (2·4Ψ bytes)."""
    what = "gradient accumulation"
    require_written(what, step_fn)
    _refuse(what, (step_fn,), LIBRARY + STATIC_ONLY)
    want = _reference_grads(0, batch)
    psi = _psi()
    for world in WORLDS:
        res = run(what, _accumulation_worker, world, step_fn, accum, batch)
        moved = res[0]["all_reduce_bytes"]
        if moved == accum * 2 * 4 * psi:
            failed(what, f"every micro-batch was all-reduced ({moved:,} B = {accum} x 2·4Ψ): the DDP decides in "
                         "forward whether the coming backward syncs; only the last micro-batch may sync")
        if moved == 0:
            failed(what, "nothing was all-reduced: the last micro-batch, its forward included, must run outside "
                         "no_sync()")
        if moved != 2 * 4 * psi:
            failed(what, f"with {world} ranks, {moved:,} B all-reduced, target one all-reduce of every gradient, "
                         f"2·4Ψ = {2 * 4 * psi:,} B ({_psi_text(psi)}): only the last micro-batch may sync")
        if res[0]["all_reduces"] != res[0]["buckets"]:
            failed(what, f"{res[0]['all_reduces']} all-reduces, but the model's DDP sends its gradients in "
                         f"{res[0]['buckets']} bucket(s): let the model synchronise (no_sync() around what must "
                         "not sync), instead of all-reducing the gradients yourself")
        sizes = res[0]["forwards"]
        if len(sizes) != accum or any(s != res[0]["micro_rows"] for s in sizes):
            failed(what, f"the model ran {len(sizes)} forward(s) of {sizes} sequences for k = {accum} "
                         f"micro-batches of {res[0]['micro_rows']}: run each micro-batch through the model on its "
                         "own (that is what keeps one micro-batch's activations in memory, not k)")
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
        if res[0]["returned"] is not None:
            failed(what, f"it returned a {res[0]['returned']}: accumulation_step works in place on p.grad and "
                         "returns None")
    passed(what, f"world sizes {list(WORLDS)}; "
           + figures(f"all-reduce bytes for {accum} micro-batches (target 2·4Ψ, {_psi_text(psi)})", moved,
                     2 * 4 * psi, unit="B")
           + f"; {len(sizes)} forwards; gradients = single process on the whole batch")
