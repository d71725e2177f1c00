"""Checks of lab 09 (putting it together): mesh coordinates and groups, a planned layout run for real.

``mesh_coords`` and ``mesh_groups`` compare the learner's arithmetic with
``minifsdp.mesh.DeviceMesh`` on several shapes. ``planned_layout`` takes the
learner's choice under a memory cap, checks it against every candidate the
planner can price, trains it (``minifsdp.train``, memory tracked) and holds
the prediction against the measurement: peak within 10 %, bytes per step
exact. ``ranking`` checks the learner's which-to-choose table built from the
lab's own runs. Read ``verdict.py`` first.
"""
from __future__ import annotations

import tempfile
from typing import Any, Callable

from .. import planner
from ..estimate import format_bytes
from ..mesh import DeviceMesh
from ..train import TrainConfig, train
from .verdict import call, failed, figures, is_library, passed, uses

SHAPES = [(2, 1, 2), (2, 2, 2), (1, 4, 1), (3, 2, 2), (4, 1, 1)]
TPS = (1, 2, 4)
ZERO = (0, 3)
_LIBRARY = ("DeviceMesh", "coords", "groups", "ranks_along", "rank_at")


def _not_library(what: str, fn: Any) -> None:
    names = uses(fn, *_LIBRARY)
    if is_library(fn) or names:
        failed(what, f"this asks minifsdp.mesh ({', '.join(names) or fn.__name__}): do the arithmetic yourself")


def mesh_coords(coords_fn: Callable[[int, int, int, int], dict]) -> None:
    """``coords_fn(rank, dp, pp, tp) -> {"dp": d, "pp": p, "tp": t}`` for every rank of several meshes."""
    what = "mesh coordinates"
    _not_library(what, coords_fn)
    for dp, pp, tp in SHAPES:
        mesh = DeviceMesh(dp, pp, tp, build_groups=False)
        for rank in range(mesh.world_size):
            got, want = call(what, coords_fn, rank, dp, pp, tp), mesh.coords(rank)
            if got != want:
                swapped = {"dp": rank % dp, "pp": rank // dp % pp, "tp": rank // (dp * pp)}
                hint = (": tp must vary fastest (consecutive ranks split one layer), dp slowest" if got == swapped
                        else "")
                failed(what, f"mesh dp={dp} pp={pp} tp={tp}, rank {rank}: yours {got}, expected {want}{hint}")
    passed(what, f"every rank of {len(SHAPES)} meshes, up to {max(d * p * t for d, p, t in SHAPES)} ranks")


def mesh_groups(groups_fn: Callable[[str, int, int, int], list]) -> None:
    """``groups_fn(dim, dp, pp, tp)`` -> every group along ``dim``, each a list of ranks."""
    what = "mesh groups"
    _not_library(what, groups_fn)
    for dp, pp, tp in SHAPES:
        mesh = DeviceMesh(dp, pp, tp, build_groups=False)
        for dim in ("dp", "pp", "tp"):
            got = call(what, groups_fn, dim, dp, pp, tp)
            want = mesh.groups(dim)
            if not isinstance(got, list) or sorted(sorted(g) for g in got) != sorted(want):
                failed(what, f"mesh dp={dp} pp={pp} tp={tp}, {dim} groups: yours {got}, expected {want} "
                             f"(a {dim} group is the ranks that differ only in their {dim} coordinate)")
    passed(what, f"dp, pp and tp groups of {len(SHAPES)} meshes")


def _strategy(layout: dict[str, int]) -> dict[str, Any]:
    """The trainer's strategy for a (dp, tp, ZeRO stage) layout."""
    dp, tp, zero = layout["dp"], layout["tp"], layout["zero_stage"]
    if tp > 1:
        return {"strategy": "tp", "tp": tp} if dp == 1 else {"strategy": "fsdp+tp", "tp": tp, "dp": dp}
    return {"strategy": "single"} if dp == 1 else {"strategy": "ddp" if zero == 0 else "fsdp"}


def _moved(p: planner.Plan) -> float:
    return sum(sum(ops.values()) for ops in p.comm.values())


def planned_layout(choose_fn: Callable[..., dict], model: str, batch: int, seq_len: int, devices: int,
                   cap_bytes: float) -> dict[str, Any]:
    """Run the learner's layout for ``model`` and hold the planner's prediction against the measurement.

    Candidates: tp in 1, 2, 4 (dp = devices / tp), ZeRO stage 0 or 3 (3 with tp > 1 and dp > 1:
    FSDP x TP). Returns the run's metrics."""
    what = "planned layout"
    layout = call(what, choose_fn, cap_bytes, devices)
    if not isinstance(layout, dict) or not {"dp", "tp", "zero_stage"} <= set(layout):
        failed(what, f"return a dict with dp, tp and zero_stage, got {layout!r}")
    layout = {k: int(layout[k]) for k in ("dp", "tp", "zero_stage")}
    if layout["dp"] * layout["tp"] != devices:
        failed(what, f"dp x tp = {layout['dp'] * layout['tp']} devices, not the {devices} you have")
    plans = {}
    for tp in TPS:
        for zero in ZERO:
            if tp > 1 and devices // tp > 1 and zero == 0:
                continue  # the trainer's 2D strategy is FSDP x TP
            plans[(devices // tp, tp, zero)] = planner.plan(model, batch=batch, seq_len=seq_len, dp=devices // tp,
                                                            tp=tp, zero_stage=zero)
    key = (layout["dp"], layout["tp"], layout["zero_stage"])
    if key not in plans:
        failed(what, f"{layout} is not a candidate: tp in {TPS}, dp = devices / tp, zero_stage in {ZERO} "
                     "(3 when both dp and tp are above 1)")
    plan = plans[key]
    if not plan.fits(cap_bytes):
        failed(what, figures("predicted peak", format_bytes(plan.total_memory), f"<= {format_bytes(cap_bytes)}") +
               f": {layout} does not fit under the cap")
    best = min(_moved(p) for p in plans.values() if p.fits(cap_bytes))
    if _moved(plan) > best:
        failed(what, figures("bytes per step", format_bytes(_moved(plan)), format_bytes(best)) +
               ": another layout that fits moves fewer bytes")
    run = _strategy(layout)
    with tempfile.TemporaryDirectory() as out:
        metrics = train(TrainConfig(model=model, steps=2, batch_size=batch, seq_len=seq_len, quiet=True,
                                    write_plots=False, out=out, world_size=devices, **run))
    peak = max(p for p in metrics["peak_bytes"] if p is not None)
    moved = sum(metrics["bytes_per_step"][0].values())
    if abs(peak - plan.total_memory) > 0.10 * plan.total_memory:
        failed(what, figures("measured peak", format_bytes(peak), format_bytes(plan.total_memory)) +
               ": more than 10 % from the planner's prediction")
    if moved != _moved(plan):
        failed(what, figures("bytes per step measured", format_bytes(moved), format_bytes(_moved(plan))))
    passed(what, f"{run['strategy']} {layout}: peak measured {format_bytes(peak)}, predicted "
                 f"{format_bytes(plan.total_memory)} (cap {format_bytes(cap_bytes)}); bytes per step "
                 f"{format_bytes(moved)} = predicted")
    return metrics


def ranking(rank_fn: Callable[[list, float], list], rows: list[dict[str, Any]], cap_bytes: float) -> None:
    """``rank_fn(rows, cap)``: the names of the runs whose peak fits under ``cap``, fewest bytes per step first."""
    what = "which to choose"
    got = call(what, rank_fn, [dict(r) for r in rows], cap_bytes)
    fits = [r for r in rows if r["peak"] <= cap_bytes]
    want = [r["name"] for r in sorted(fits, key=lambda r: r["bytes"])]
    if not isinstance(got, list) or [str(n) for n in got] != want:
        over = [r["name"] for r in rows if r["peak"] > cap_bytes]
        failed(what, f"yours {got}, expected {want}: keep the runs whose measured peak is under the cap "
                     f"(not {over}), then order them by bytes moved per step")
    passed(what, f"{len(want)} of {len(rows)} runs fit under {format_bytes(cap_bytes)}; cheapest: {want[0] if want else '-'}")


def _fsdp_tp_worker(build_fn: Callable, steps: int) -> dict[str, Any]:
    import torch

    from .. import data, dist, models, trace
    from ..fsdp import FullyShardedDataParallel
    from ..tensor_parallel import ParallelGPT

    mesh = DeviceMesh(dp=2, pp=1, tp=2)
    dev = dist.device()
    model = build_fn(models.build_model("gpt-tiny", seed=0).to(dev), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tracer, losses = trace.Tracer(), []
    with tracer:
        for step in range(steps):
            x, y = data.get_batch(step, 8, 32, seed=0, rank=mesh.get_local_rank("dp"), world_size=2)
            loss = ParallelGPT.loss(model(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / 4)
    return {"losses": losses, "fsdp": isinstance(model, FullyShardedDataParallel),
            "ops": sorted(tracer.trace.bytes_by_op())}


def fsdp_tp(build_fn: Callable[[Any, DeviceMesh], Any], steps: int = 3) -> None:
    """``build_fn(model, mesh)`` on 4 ranks (dp 2 x tp 2): losses of ``steps`` AdamW steps equal one process's."""
    import torch

    from .. import data, models
    from .verdict import run

    what = "FSDP x TP"
    outs = run(what, _fsdp_tp_worker, 4, build_fn, steps)
    model = models.build_model("gpt-tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    want = []
    for step in range(steps):
        x, y = data.get_batch(step, 8, 32, seed=0)
        loss = models.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    got = outs[0]
    if not got["fsdp"]:
        failed(what, "the model you return is not FSDP-wrapped: shard the tensor-parallel model over the dp group")
    if not all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got["losses"], want)):
        failed(what, f"losses {[round(v, 5) for v in got['losses']]} differ from one process's "
                     f"{[round(v, 5) for v in want]}: FSDP must shard over the mesh's dp group, TP use its tp group")
    missing = {"all_gather", "reduce_scatter", "all_reduce"} - set(got["ops"])
    if missing:
        failed(what, f"no {', '.join(sorted(missing))} recorded: TP all-reduces, FSDP all-gathers and reduce-scatters")
    passed(what, f"4 ranks (dp 2 x tp 2), {steps} AdamW steps: losses equal one process's to 1e-5; "
                 "FSDP's all-gather / reduce-scatter and TP's all-reduce both ran")


def tp_bytes(bytes_fn: Callable[[int, int, int], int], measured: int, n_layer: int, hidden: int,
             tokens: int) -> None:
    """``bytes_fn(n_layer, hidden, tokens)``: the bytes the tp run's all-reduces moved per step, to the byte."""
    what = "TP bytes per step"
    got = call(what, bytes_fn, n_layer, hidden, tokens)
    if got == measured:
        passed(what, figures("bytes", int(got), int(measured), unit="B") + " (measured by the tracer)")
        return
    blocks, ends, loss = 4 * n_layer * tokens * hidden * 4, 2 * tokens * hidden * 4, 3 * tokens * 4
    if got * 2 == measured or got == (blocks + ends + loss):
        failed(what, figures("bytes", got, int(measured), unit="B") + ": an all-reduce of S bytes moves 2S "
                     "(reduce-scatter then all-gather), the volume comm records")
    if got == 2 * (blocks + ends):
        failed(what, figures("bytes", got, int(measured), unit="B") + ": the vocab-parallel loss all-reduces "
                     "too: a max per token, then two sums per token")
    failed(what, figures("bytes", got, int(measured), unit="B") + ": per block 4 all-reduces of tokens x hidden "
                 "fp32 values, plus the embedding's and the head's, plus the loss's per-token reductions")
