"""Checks of lab 09 (putting it together): the mesh, FSDP x TP and PP x DP built from it, a layout's
cost by hand, a planned layout run for real.

``mesh`` compares the learner's coordinates and groups with
``minifsdp.mesh.DeviceMesh`` on several shapes. ``two_d`` runs the learner's
2D layouts on 4 ranks (CPU ranks where GPUs are fewer) against one process.
``layout_costs`` holds the learner's tensor-parallel bytes against the tracer
and their ZeRO arithmetic against ``estimate`` (the ZeRO paper's formula) and
the planner. ``planned_layout`` takes the learner's choice under a memory cap,
checks it against every candidate the planner can price, trains it
(``minifsdp.train``, memory tracked) and holds the prediction against the
measurement: peak within 10 %, bytes per step exact.

Each check refuses the library's own version of the exercise (the mesh's
arithmetic, the trainer's 2D builders, the planner's byte formulas) by name,
alias, helper or subclass, and at run time (``authorship.Wire``). Read
``verdict.py`` first.
"""
from __future__ import annotations

import tempfile
from typing import Any, Callable

from .. import estimate, mesh as mesh_module, parallel_bytes, planner, strategies as strategies_module
from ..estimate import format_bytes
from ..mesh import DeviceMesh
from ..pipeline import parallel as pipeline_parallel
from ..train import TrainConfig, train
from .authorship import Wire, watched
from .verdict import Hints, call, failed, figures, passed, refuse_library, require_written, run

SHAPES = [(2, 1, 2), (2, 2, 2), (1, 4, 1), (3, 2, 2), (4, 1, 1)]
TPS = (1, 2, 4)
ZERO = (0, 3)
# the library's version of each exercise: what the checks refuse (statically and at run time)
_MESH_LIBRARY = (DeviceMesh, *(v for v in vars(mesh_module).values()
                               if callable(v) and getattr(v, "__module__", "") == mesh_module.__name__))
_TWO_D_LIBRARY = (strategies_module._tensor_parallel, strategies_module._three_d, strategies_module._pipeline,
                  pipeline_parallel.PipelineParallel, pipeline_parallel.pipeline_groups)
_COST_LIBRARY = tuple(v for m in (planner, parallel_bytes, estimate) for v in vars(m).values()
                      if callable(v) and getattr(v, "__module__", "") == m.__name__
                      and v is not estimate.format_bytes)

hint = Hints({
    "mesh_coords": [
        "A rank number is a mixed-radix number whose digits are (d, p, t), t the fastest digit.",
        "The fastest digit is what is left over after dividing by its size; divide it away for the next.",
        "Check yourself on dp=2, pp=2, tp=2: rank 5 is d=1, p=0, t=1.",
    ],
    "mesh_groups": [
        "Two ranks share a group along dim when every OTHER coordinate is equal.",
        "Use your mesh_coords: a key made of the other coordinates names the group a rank belongs to.",
        "Every rank is in exactly one group per dimension; a mesh of N ranks has N / size(dim) of them.",
    ],
    "fsdp_tp": [
        "Tensor parallel must cut the whole model, so it goes first; FSDP then shards what each rank holds.",
        "Ranks that hold the same slices differ only in dp: FSDP shards over that group, TP uses tp's.",
        "Lab 08's tensor_parallel takes the mesh; lab 04's FSDP takes a process_group and a wrap policy.",
    ],
    "pp_dp_step": [
        "Two questions per rank: which stage am I (pp coordinate), which slice of the batch (dp)?",
        "The stage talks to its pipeline over the pp group; the same stage's copies live in the dp group.",
        "After the schedule's step, each gradient is summed over dp; a sum of dp copies is not an average.",
    ],
    "tp_bytes_per_step": [
        "List tensor parallel's all-reduces: per block, two forward (g) and two backward (f).",
        "Add the embedding's forward g, the head's backward f, and the vocab-parallel loss's reductions.",
        "Activations are tokens x hidden fp32 values; the loss reduces a max and two sums per token.",
        "comm's volume of an all-reduce of S bytes is 2S.",
    ],
    "state_bytes": [
        "Start from one replica: 4 + 4 + 8 bytes per parameter (weight, gradient, two AdamW moments).",
        "ZeRO-1 divides the optimizer state by dp; each later stage divides one more category.",
    ],
    "choose_layout": [
        "Enumerate the candidates first, then price each one with the planner.",
        "A candidate's bytes per step are the sum over every dimension and op of its plan's comm.",
        "Keep the fitting ones; return the cheapest as a dict; say clearly when none fits.",
    ],
})


def _mesh_coords(coords_fn: Callable[[int, int, int, int], dict]) -> None:
    """``coords_fn(rank, dp, pp, tp) -> {"dp": d, "pp": p, "tp": t}`` for every rank of several meshes."""
    what = "mesh coordinates"
    for dp, pp, tp in SHAPES:
        mesh = DeviceMesh(dp, pp, tp, build_groups=False)
        for rank in range(mesh.world_size):
            got, want = call(what, watched(coords_fn, *_MESH_LIBRARY), rank, dp, pp, tp), mesh.coords(rank)
            if got != want:
                swapped = {"dp": rank % dp, "pp": rank // dp % pp, "tp": rank // (dp * pp)}
                hint = (": tp must vary fastest (consecutive ranks split one layer), dp slowest" if got == swapped
                        else "")
                failed(what, f"mesh dp={dp} pp={pp} tp={tp}, rank {rank}: yours {got}, expected {want}{hint}")


def _mesh_groups(groups_fn: Callable[[str, int, int, int], list]) -> None:
    """``groups_fn(dim, dp, pp, tp)`` -> every group along ``dim``, each a list of ranks."""
    what = "mesh groups"
    for dp, pp, tp in SHAPES:
        mesh = DeviceMesh(dp, pp, tp, build_groups=False)
        for dim in ("dp", "pp", "tp"):
            got = call(what, watched(groups_fn, *_MESH_LIBRARY), dim, dp, pp, tp)
            want = mesh.groups(dim)
            if not isinstance(got, list) or sorted(sorted(g) for g in got) != sorted(want):
                failed(what, f"mesh dp={dp} pp={pp} tp={tp}, {dim} groups: yours {got}, expected {want} "
                             f"(a {dim} group is the ranks that differ only in their {dim} coordinate)")


def mesh(coords_fn: Callable[[int, int, int, int], dict], groups_fn: Callable[[str, int, int, int], list]) -> None:
    """Exercise 1: the learner's ``mesh_coords`` and ``mesh_groups`` on every rank of five meshes."""
    what = "the mesh"
    require_written(what, coords_fn, groups_fn)
    for fn in (coords_fn, groups_fn):
        refuse_library(what, fn, *_MESH_LIBRARY)
    _mesh_coords(coords_fn)
    _mesh_groups(groups_fn)
    passed(what, f"coordinates and dp / pp / tp groups of every rank of {len(SHAPES)} meshes, up to "
                 f"{max(d * p * t for d, p, t in SHAPES)} ranks, equal DeviceMesh's")


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
    require_written(what, choose_fn)
    refuse_library(what, choose_fn, _moved, _strategy, planned_layout)
    layout = call(what, watched(choose_fn, _moved, _strategy), model, batch, seq_len, cap_bytes, devices)
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


def _fsdp_tp_worker(build_fn: Callable, steps: int) -> dict[str, Any]:
    import torch

    from .. import data, dist, models, trace
    from ..fsdp import FullyShardedDataParallel
    from ..tensor_parallel import ParallelGPT

    mesh = DeviceMesh(dp=2, pp=1, tp=2)
    dev = dist.device()
    with Wire(*_TWO_D_LIBRARY):  # the learner's build only: the steps below run the library's FSDP and TP
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


def _fsdp_tp(build_fn: Callable[[Any, DeviceMesh], Any], steps: int = 3) -> str:
    """``build_fn(model, mesh)`` on 4 ranks (dp 2 x tp 2): losses of ``steps`` AdamW steps equal one process's."""
    import torch

    from .. import data, models

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
    return (f"FSDP x TP: 4 ranks (dp 2 x tp 2), {steps} AdamW steps, losses equal one process's to 1e-5, "
            "FSDP's all-gather / reduce-scatter and TP's all-reduce both ran")


def _tp_bytes(bytes_fn: Callable[[int, int, int], int], measured: int, n_layer: int, hidden: int,
              tokens: int) -> str:
    """``bytes_fn(n_layer, hidden, tokens)``: the bytes the tp run's all-reduces moved per step, to the byte."""
    what = "TP bytes per step"
    got = call(what, watched(bytes_fn, *_COST_LIBRARY), n_layer, hidden, tokens)
    if got == measured:
        return figures("TP bytes per step", int(got), int(measured), unit="B") + " (target: the tracer's)"
    blocks, ends, loss = 4 * n_layer * tokens * hidden * 4, 2 * tokens * hidden * 4, 3 * tokens * 4
    if got * 2 == measured or got == (blocks + ends + loss):
        failed(what, figures("bytes", got, int(measured), unit="B") + ": an all-reduce of S bytes moves 2S "
                     "(reduce-scatter then all-gather), the volume comm records")
    if got == 2 * (blocks + ends):
        failed(what, figures("bytes", got, int(measured), unit="B") + ": the vocab-parallel loss all-reduces "
                     "too: a max per token, then two sums per token")
    failed(what, figures("bytes", got, int(measured), unit="B") + ": per block 4 all-reduces of tokens x hidden "
                 "fp32 values, plus the embedding's and the head's, plus the loss's per-token reductions")


# ------------------------------------------------------------------ PP x DP from the mesh
_PP_DP_M, _PP_DP_BATCH, _PP_DP_SEQ = 2, 8, 32


def _pp_dp_worker(step_fn: Callable) -> dict[str, Any]:
    from .. import data, dist, models, trace

    mesh = DeviceMesh(dp=2, pp=2, tp=1)
    x, y = (t.to(dist.device()) for t in data.get_batch(0, _PP_DP_BATCH, _PP_DP_SEQ))
    with trace.Tracer() as tracer, Wire(*_TWO_D_LIBRARY):
        part, losses = step_fn(models.build_model("gpt-tiny", seed=0).to(dist.device()), mesh, x, y, _PP_DP_M)
    return {"coords": mesh.coords(), "losses": [float(v) for v in losses or []],
            "grads": {n: None if q.grad is None else q.grad.cpu() for n, q in part.named_parameters()},
            "params": sum(q.numel() for q in part.parameters()), "bytes": tracer.trace.bytes_by_op()}


def _pp_dp(step_fn: Callable) -> str:
    """``step_fn(model, mesh, x, y, m)`` on 4 ranks (dp 2 x pp 2): one-process gradients on every rank, each
    replica's losses those of its own slice, every gradient all-reduced once over dp."""
    import torch

    from .. import data, models

    what = "PP x DP"
    outs = run(what, _pp_dp_worker, 4, step_fn, timeout=120)
    ref = models.build_model("gpt-tiny", seed=0)
    x, y = data.get_batch(0, _PP_DP_BATCH, _PP_DP_SEQ)
    models.lm_loss(ref(x), y).backward()
    want = dict(ref.named_parameters())
    with torch.no_grad():
        slices = [[models.lm_loss(ref(xm), ym).item() for xm, ym in zip(xs.chunk(_PP_DP_M), ys.chunk(_PP_DP_M))]
                  for xs, ys in zip(x.chunk(2), y.chunk(2))]
        whole = [models.lm_loss(ref(xm), ym).item() for xm, ym in zip(x.chunk(_PP_DP_M), y.chunk(_PP_DP_M))]
    by_coords = {(o["coords"]["dp"], o["coords"]["pp"]): o for o in outs}
    worst = 0.0
    for (d, s), o in sorted(by_coords.items()):
        for n, g in o["grads"].items():
            if g is None:
                failed(what, f"rank dp={d} pp={s}: {n} has no gradient: run the schedule's step on every rank of "
                             "the pipeline (the first stage with x, the last with target and losses)")
            err = ((g - want[n].grad).norm() / want[n].grad.norm()).item()
            if err > 1e-5:
                twin = by_coords.get((1 - d, s), {}).get("grads", {}).get(n)
                ratio = (g.norm() / want[n].grad.norm()).item()
                if twin is not None and not torch.allclose(g, twin):
                    hint = (f"it differs from the replica dp={1 - d}'s, which holds the same stage: all-reduce each "
                            "gradient over the mesh's dp group")
                elif abs(ratio - 2) < 1e-3:
                    hint = "it is 2 (= dp) times one process's: the all-reduce sums, so divide by dp to average"
                else:
                    hint = ("each replica must run its own slice of the batch through its pipeline, and the "
                            "gradients be averaged over the dp group")
                failed(what, f"rank dp={d} pp={s}: {n} differs from one process's gradient by {err:.1e} "
                             f"(relative): {hint}")
            worst = max(worst, err)
        if s == 1 and (len(o["losses"]) != _PP_DP_M
                       or any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(o["losses"], slices[d]))):
            def same(ref: list[float]) -> bool:
                return len(o["losses"]) == len(ref) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(o["losses"], ref))
            if same(whole):
                hint = ("every replica ran the whole batch (the average comes out right, but each replica did all "
                        "the work): replica d trains on slice d of the batch (x.chunk(dp)[d])")
            elif same(slices[1 - d]):
                hint = f"those are slice {1 - d}'s: replica d trains on slice d of the batch (x.chunk(dp)[d])"
            else:
                hint = "each replica splits its own slice of the batch into the m micro-batches"
            failed(what, f"replica dp={d}'s last stage returned losses {[round(v, 5) for v in o['losses']]}, one "
                         f"process gives {[round(v, 5) for v in slices[d]]} for that replica's micro-batches: {hint}")
    first = by_coords[(0, 0)]
    target = 2 * 4 * first["params"]  # comm records an all-reduce of S bytes as 2S (reduce-scatter + all-gather)
    moved = first["bytes"].get("all_reduce", 0)
    if moved != target:
        failed(what, figures("rank 0's all-reduce bytes", moved, target, unit="B")
               + f" (2 x 4 bytes x its stage's {first['params']:,} parameters): all-reduce every gradient of the "
                 "stage exactly once, over the dp group, with comm.all_reduce")
    return (f"PP x DP: m={_PP_DP_M}, gradients equal one process's on every rank (largest relative difference "
            f"{worst:.1e}), " + figures("rank 0's all-reduce over dp", moved, target, unit="B"))


def two_d(fsdp_tp_fn: Callable[[Any, DeviceMesh], Any], pp_dp_fn: Callable) -> None:
    """Exercise 2: the learner's FSDP x TP and PP x DP, each on 4 ranks against one process."""
    what = "two 2D layouts"
    require_written(what, fsdp_tp_fn, pp_dp_fn)
    for fn in (fsdp_tp_fn, pp_dp_fn):
        refuse_library(what, fn, *_TWO_D_LIBRARY)
    passed(what, f"{_fsdp_tp(fsdp_tp_fn)}; {_pp_dp(pp_dp_fn)}")


# ------------------------------------------------------------------ model states per device
_STATE_GRID = [(n, dp, z) for n in (1000, 4099) for dp in (1, 2, 3, 8) for z in (0, 1, 2, 3)]
_STATE_HINTS = {
    "optimizer": "the optimizer state is sharded over dp from ZeRO-1 on; fp32 AdamW keeps two moments, "
                 "8 bytes a parameter",
    "gradients": "the gradients are sharded over dp from ZeRO-2 on (ZeRO-1 keeps them whole); 4 bytes a parameter",
    "parameters": "the parameters are sharded over dp only at ZeRO-3 (FSDP); 4 bytes a parameter",
}


def _state_bytes(fn: Callable[[int, int, int], dict], model: str, batch: int, seq_len: int, devices: int) -> str:
    """``fn(n, dp, zero_stage)`` -> bytes of parameters, gradients and optimizer state one device keeps
    (fp32 AdamW): equal to ``estimate``'s unpadded ZeRO formula; on ``model``'s layouts, to the planner's
    states within FSDP's padding."""
    what = "model states per device"
    fn = watched(fn, *_COST_LIBRARY)
    for n, dp, zero in _STATE_GRID:
        got = call(what, fn, n, dp, zero)
        if not isinstance(got, dict) or set(got) != set(_STATE_HINTS):
            failed(what, f"return a dict with keys parameters, gradients, optimizer; got {got!r}")
        want = estimate.model_state_bytes_per_device(n, dp, zero, padding=False)
        for k in ("optimizer", "gradients", "parameters"):
            if abs(float(got[k]) - want[k]) > 1e-6 * want[k]:
                failed(what, f"n={n:,}, dp={dp}, ZeRO-{zero}: " + figures(k, float(got[k]), want[k], unit="B")
                       + f": {_STATE_HINTS[k]}")
    rows = []
    for dp, tp, zero in ((devices, 1, 0), (devices, 1, 3), (devices // 2, 2, 3)):
        p = planner.plan(model, batch=batch, seq_len=seq_len, dp=dp, tp=tp, zero_stage=zero)
        mine = sum(float(v) for v in call(what, fn, p.params_per_device, dp, zero).values())
        lib = p.memory["parameters"] + p.memory["gradients"] + p.memory["optimizer"]
        if abs(mine - lib) > 0.01 * lib:
            failed(what, f"{model} dp={dp} tp={tp} ZeRO-{zero}: " + figures("states", format_bytes(mine),
                                                                          format_bytes(lib)) + " (the planner)")
        rows.append(figures(f"dp{dp} tp{tp} ZeRO-{zero}", format_bytes(mine), format_bytes(lib)))
    return (f"model states: {len(_STATE_GRID)} (n, dp, stage) exact; {model} per device against the planner's, "
            + "; ".join(rows))


def layout_costs(bytes_fn: Callable[[int, int, int], int], states_fn: Callable[[int, int, int], dict],
                 measured_tp_bytes: int, model: str, batch: int, seq_len: int, devices: int,
                 tp_shape: tuple[int, int, int] = (2, 32, 8 * 32)) -> None:
    """Exercise 3: TP's bytes per step against the tracer's (gpt-tiny's ``tp_shape`` = n_layer, hidden,
    tokens), and model states per device against the ZeRO paper and the planner."""
    what = "a layout's cost by hand"
    require_written(what, bytes_fn, states_fn)
    for fn in (bytes_fn, states_fn):
        refuse_library(what, fn, *_COST_LIBRARY)
    passed(what, f"{_tp_bytes(bytes_fn, measured_tp_bytes, *tp_shape)}; "
                 f"{_state_bytes(states_fn, model, batch, seq_len, devices)}")
