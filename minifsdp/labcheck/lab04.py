"""Checks for lab 04 (FSDP): the learner's flat shard and per-unit gather / free / reduce-scatter cycle.

The learner builds, on a multi-unit GPT (each transformer ``Block`` a unit, the
root holding the rest), the four moments of FSDP: a pre-forward hook that
all-gathers the unit, a post-forward hook that frees it, a pre-backward gather
and a post-backward reduce-scatter (``minifsdp/fsdp/naive.py`` is the same cycle
in the library). Each check runs the learner's code on several ranks through
the lab's scaffolding ``shard_model(model, unit_types) -> units``, compares with
one process and with the library, and prints one verdict::

    from minifsdp.labcheck import lab04 as check
    check.shard_flat(shard_flat)
    check.fsdp_forward(shard_model, free, allocate, is_gathered, gather, pre_forward, post_forward, install_hooks)
    check.fsdp_cycle(shard_model, pre_backward, post_backward)

Targets (Ψ = the number of parameters, fp32): one process's losses and parameters
(fp32 tolerances below: the ranks add the gradient in another order); bytes moved
per step exactly ``3 x 4 B x`` the padded Ψ (all-gather in forward, again in
backward, one reduce-scatter; the learner frees the root too, so there is no
root rule); the peak memory of a step within ``PEAK_MARGIN`` of
``minifsdp.fsdp.FullyShardedDataParallel`` on the same model and batch.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import comm, data, dist, models, trace
from ..launch import launch
from ..memory import MemoryTracker
from .lab03 import blank, refuse_library, run_learner
from .verdict import failed, passed

__all__ = ["shard_flat", "fsdp_forward", "fsdp_cycle", "fsdp_worker", "library_memory_worker", "results",
           "PEAK_MARGIN"]

results: dict[str, Any] = {}   # what the last run of each check measured, for the lab's plots
MODEL, STEPS, BATCH, SEQ, LR = "gpt-tiny", 3, 12, 16, 1e-3   # 12 rows: 1, 2, 3 or 4 ranks split them evenly
MEM_MODEL, MEM_BATCH, MEM_SEQ = "gpt-mini", 4, 32
ATOL, RTOL = 1e-5, 1e-4       # fp32, another order of additions than one process
PEAK_MARGIN = 0.25             # the learner's peak within +-25 % of minifsdp's FSDP (same model, batch, ranks)
FP32 = 4


def _library() -> dict[str, Any]:
    from ..fsdp import FullyShardedDataParallel, naive
    return {"minifsdp.fsdp.FullyShardedDataParallel": FullyShardedDataParallel,
            "minifsdp.fsdp.naive.NaiveFullyShardedDataParallel": naive.NaiveFullyShardedDataParallel,
            "minifsdp.fsdp.naive.FlatUnit": naive.FlatUnit, "minifsdp.fsdp.naive.pre_forward": naive.pre_forward,
            "minifsdp.fsdp.naive.post_forward": naive.post_forward,
            "minifsdp.fsdp.naive.pre_backward": naive.pre_backward,
            "minifsdp.fsdp.naive.post_backward": naive.post_backward}


def _world_sizes(*wanted: int) -> tuple[int, ...]:
    return tuple(sorted({dist.lab_world_size(w) for w in wanted}))


def _chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(F.pad(flat, (0, math.ceil(flat.numel() / n) * n - flat.numel())).chunk(n))


# -- exercise 1: the flat shard, in this process -----------------------------------------------------
def shard_flat(fn: Callable[[list[torch.Tensor], int, int], torch.Tensor]) -> None:
    """The learner's ``shard_flat(params, rank, world)`` on a 53-parameter MLP at N = 1, 2, 3, 4."""
    what = "shard_flat"
    blank(what, shard_flat=fn)
    params = list(models.build_model("mlp", dims=(6, 5, 3)).parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    for n in (1, 2, 3, 4):
        want = _chunks(flat, n)
        try:
            got = [fn(params, r, n) for r in range(n)]
        except NotImplementedError as e:
            failed(what, f"not written yet (NotImplementedError: {e})")
        if not all(isinstance(g, torch.Tensor) for g in got):
            failed(what, f"at N={n} it returned {type(got[0]).__name__}: return a tensor, this rank's chunk")
        sizes = [g.numel() for g in got]
        if sizes != [want[0].numel()] * n:
            failed(what, f"at N={n}: shard sizes {sizes}, expected {n} x {want[0].numel()} (= ceil(53/{n})): "
                         "pad the flat vector with zeros to a multiple of N first, then cut N equal chunks")
        if all(torch.equal(g, w) for g, w in zip(got, want)):
            if any(g.requires_grad or g.data_ptr() == flat.data_ptr() for g in got):
                failed(what, f"at N={n}: the shard must be a detached copy (it becomes the unit's own Parameter)")
            continue
        if sorted(map(tuple, (g.tolist() for g in got))) == sorted(map(tuple, (w.tolist() for w in want))):
            failed(what, f"at N={n}: the right chunks, given to the wrong ranks: rank r keeps chunk number r "
                         "(rank 0 the first), the order the all-gather puts them back in")
        if torch.equal(torch.cat(got)[:flat.numel()], flat):
            failed(what, f"at N={n}: the parameters are right but the padding is not: pad with zeros, at the end")
        failed(what, f"at N={n}: the shards put together are not the parameters (in order, each flattened) "
                     "followed by zeros")
    passed(what, "53 parameters at N = 1, 2, 3, 4: shards of 53, 27, 18, 14 numbers "
                 "(padding 0, 1, 1, 3), chunk r on rank r")


# -- one process ---------------------------------------------------------------------------------------
def _batch(step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    return data.get_batch(step, batch, seq)


def _single(model_name: str = MODEL, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = models.build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"losses": []}
    x0, _ = _batch(0, BATCH, SEQ)
    with torch.no_grad():
        out["logits"] = model(x0)
    for step in range(steps):
        x, y = _batch(step, BATCH, SEQ)
        loss = models.lm_loss(model(x), y)
        loss.backward()
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
    out["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return out


# -- the worker: the learner's units, or the library's FSDP ------------------------------------------------
def _holds_memory(unit: Any) -> bool:
    """Measured here, not asked of the learner's is_gathered: bytes behind the unit's full tensor."""
    return unit.full.untyped_storage().nbytes() > 0


def _unit_fqns(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def fsdp_worker(mode: str, shard_model: Callable | None, model_name: str, steps: int, batch: int, seq: int,
                forward_only: bool = False, track_memory: bool = False) -> dict:
    """Train ``steps`` steps on this rank: ``mode`` "learner" (the lab's ``shard_model``), or "FULL_SHARD" /
    "SHARD_GRAD_OP" (``minifsdp.fsdp``). Plain data back."""
    from ..fsdp import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy

    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    model = models.build_model(model_name).to(device)
    names = _unit_fqns(model)
    tracker, tracer = MemoryTracker(), trace.Tracer(rank=rank)
    out: dict[str, Any] = {"mode": mode, "losses": []}
    if mode == "learner":
        units = list(shard_model(model, {models.Block}))
        net, params = model, [u.shard for u in units]
        out["units"] = [(u.name, u.numel, u.padded_numel, u.shard.numel()) for u in units]
    else:
        net = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({models.Block}),
                                       sharding_strategy=ShardingStrategy[mode])
        units, params = [], list(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    holder = torch.nn.ParameterList(params)   # the tracker's handle on the shards and their .grad
    with tracer:
        if forward_only:
            x, _ = _batch(0, batch, seq)
            rows = slice(rank * batch // n, (rank + 1) * batch // n)
            with trace.span("step", step=0):
                logits = net(x[rows].to(device))
            out["logits"] = logits.detach().cpu()
            out["gathered_after"] = [u.name for u in units if _holds_memory(u)]
            out["bytes"] = tracer.trace.bytes_by_op(within="step")
            return out
        for step in range(steps):
            x, y = _batch(step, batch, seq)
            rows = slice(rank * batch // n, (rank + 1) * batch // n)
            tracking = track_memory and step == steps - 1   # the last step: the optimizer state exists
            if tracking:
                tracker.track_model(holder)
                tracker.track_optimizer(opt)
            with tracker if tracking else contextlib.nullcontext():
                tracker.reset_peak()
                with trace.span("step", step=step):
                    loss = models.lm_loss(net(x[rows].to(device)), y[rows].to(device))
                    loss.backward()
                    if tracking:
                        tracker.snapshot("after backward")   # labels the shards' new .grad as gradients
                if mode == "learner" and step == 0:
                    out["grads0"] = [None if u.shard.grad is None else u.shard.grad.detach().cpu().clone()
                                     for u in units]
                    out["gathered_after"] = [u.name for u in units if _holds_memory(u)]
                opt.step()
                opt.zero_grad(set_to_none=True)
            total = loss.detach().reshape(1).clone()
            if n > 1:
                torch.distributed.all_reduce(total)
            out["losses"].append(total.item() / n)
    tracker.close()
    out["bytes"] = {op: b // steps for op, b in tracer.trace.bytes_by_op(within="step").items()}
    if track_memory:
        out["peak"] = tracker.peak_total
        out["peak_by_category"] = dict(tracker.peak_by_category)
        out["samples"] = list(tracker.samples)
    if mode == "learner":   # the final parameters, gathered, under the original names
        full: dict[str, torch.Tensor] = {}
        for u in units:
            buf = torch.empty(u.padded_numel, dtype=u.shard.dtype, device=device)
            comm.all_gather_into_tensor(buf, u.shard.detach().contiguous())
            pieces = buf[:u.numel].split([math.prod(shape) for *_, shape in u.slots])
            for (m, attr, shape), piece in zip(u.slots, pieces):
                full[f"{names[id(m)]}.{attr}".lstrip(".")] = piece.view(shape).cpu().clone()
        out["params"] = full
        out["slots"] = [[f"{names[id(m)]}.{attr}".lstrip(".") for m, attr, _ in u.slots] for u in units]
    return out


def library_memory_worker(modes: tuple[str, ...]) -> dict:
    """``fsdp_worker`` with the library's strategies in turn, memory tracked, in one launch."""
    return {m: fsdp_worker(m, None, MEM_MODEL, 2, MEM_BATCH, MEM_SEQ, False, True) for m in modes}


def _expected_units(model_name: str) -> dict[str, int]:
    """Parameters per unit when every Block is a unit and the root holds the rest."""
    model = models.build_model(model_name, device="meta")
    units = {name: models.count_parameters(m) for name, m in model.named_modules() if isinstance(m, models.Block)}
    return {**units, "root": models.count_parameters(model) - sum(units.values())}


def _run_units(what: str, n: int, res: list[dict], model_name: str = MODEL) -> None:
    """Every rank made the same units -- each Block, the root with the rest -- each with an equal padded shard."""
    units = res[0]["units"]
    if any(r["units"] != units for r in res):
        failed(what, f"{n} ranks: the ranks made different units")
    got, want = {name: numel for name, numel, _, _ in units}, _expected_units(model_name)
    if got != want:
        failed(what, f"units {got} (name: parameters), expected {want}: every Block is a unit and the root "
                     "(named 'root') holds every parameter no Block holds; each parameter in exactly one unit")
    if units[-1][0] != "root":
        failed(what, "the root must be the last unit (it takes what the others left)")
    for name, numel, padded, shard in units:
        if shard * n != padded or padded < numel or padded - numel >= n:
            failed(what, f"{n} ranks: unit {name} has {numel} parameters, {padded} padded, shards of {shard}: "
                         "each rank keeps an equal chunk of the zero-padded flat vector (shard_flat)")


def _storage_cycle(what: str, free: Callable, allocate: Callable, is_gathered: Callable) -> None:
    """free / allocate / is_gathered in this process, on a stand-in unit of 10 fp32 numbers."""
    full = torch.empty(10, device=dist.device(), requires_grad=True)
    unit = SimpleNamespace(name="test", full=full, padded_numel=10)
    nbytes = lambda: unit.full.untyped_storage().nbytes()   # noqa: E731
    free(unit)
    if unit.full is not full:
        failed(what, "free replaced unit.full by another tensor: keep the same tensor object (the views "
                     "autograd saved point into it) and release only the memory under it")
    if nbytes() != 0:
        failed(what, f"after free, {nbytes()} bytes are still behind unit.full: release its whole storage")
    if is_gathered(unit) is not False:
        failed(what, f"is_gathered said {is_gathered(unit)!r} right after free: False when no memory is behind "
                     "unit.full")
    allocate(unit)
    if unit.full is not full:
        failed(what, "allocate replaced unit.full by another tensor: give memory back to the same tensor")
    if nbytes() != 10 * FP32:
        hint = (": the storage's size counts bytes, not numbers" if nbytes() == 10 else "")
        failed(what, f"allocate on a unit of 10 fp32 numbers gave unit.full {nbytes()} bytes, "
                     f"expected {10 * FP32}{hint}")
    if is_gathered(unit) is not True:
        failed(what, f"is_gathered said {is_gathered(unit)!r} right after allocate: True when memory is behind "
                     "unit.full")


def fsdp_forward(shard_model: Callable, free: Callable, allocate: Callable, is_gathered: Callable,
                 gather: Callable, pre_forward: Callable, post_forward: Callable, install_hooks: Callable,
                 world_sizes: tuple[int, ...] | None = None) -> None:
    """free/allocate in this process; forward at 2 and 3 ranks: one process's logits, every unit freed, Ψ once."""
    what = "FSDP forward"
    fns = dict(free=free, allocate=allocate, is_gathered=is_gathered, shard_model=shard_model, gather=gather,
               pre_forward=pre_forward, post_forward=post_forward, install_hooks=install_hooks)
    blank(what, **fns)
    refuse_library(what, fns, _library())
    _storage_cycle(what, free, allocate, is_gathered)
    ref = _single(steps=0)
    n_params = models.count_parameters(models.build_model(MODEL, device="meta"))
    world_sizes = world_sizes or _world_sizes(2, 3)
    for n in world_sizes:
        res = run_learner(what, fsdp_worker, n, "learner", shard_model, MODEL, 1, BATCH, SEQ, True)
        _run_units(what, n, res)
        for r, out in enumerate(res):
            if out["gathered_after"]:
                failed(what, f"{n} ranks, rank {r}: after forward, unit(s) {out['gathered_after']} still hold their "
                             "full parameters: the post-forward hook frees the unit it just ran")
            rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
            want = ref["logits"][rows]
            if out["logits"].shape != want.shape or not torch.allclose(out["logits"], want, atol=ATOL, rtol=RTOL):
                failed(what, f"{n} ranks, rank {r}: the logits differ from one process's: before a unit runs, its "
                             "modules must see the gathered parameters, in order (all-gather puts rank r's shard "
                             "at position r), each piece reshaped to its parameter's shape")
        padded = sum(p for _, _, p, _ in res[0]["units"])
        got = res[0]["bytes"]
        if n > 1 and got != {"all_gather": FP32 * padded}:
            hint = ("gathered more than once: gather only when the unit's full tensor is empty"
                    if got.get("all_gather", 0) > FP32 * padded else "every unit must be all-gathered once")
            failed(what, f"{n} ranks: forward moved {got}, the target is all_gather {FP32 * padded:,} B "
                         f"(4 B x Ψ padded): {hint}")
    passed(what, f"one process's logits (|diff| <= {ATOL:g}) at {', '.join(map(str, world_sizes))} ranks; "
                 f"all-gather per forward: yours {FP32 * padded:,} B, target 4 B x Ψ = {FP32 * n_params:,} B "
                 f"+ padding; every unit freed after its forward")


def fsdp_cycle(shard_model: Callable, pre_backward: Callable, post_backward: Callable,
               world_sizes: tuple[int, ...] | None = None) -> None:
    """Whole steps at 1, 2, 3, 4 ranks against one process; bytes 3Ψ exact; peak vs minifsdp's FSDP."""
    what = "FSDP cycle"
    blank(what, pre_backward=pre_backward, post_backward=post_backward)
    refuse_library(what, dict(shard_model=shard_model, pre_backward=pre_backward, post_backward=post_backward),
                   _library())
    ref = _single()
    worst = 0.0
    sizes = world_sizes or _world_sizes(1, 2, 3, 4)
    for n in sizes:
        res = run_learner(what, fsdp_worker, n, "learner", shard_model, MODEL, STEPS, BATCH, SEQ)
        _run_units(what, n, res)
        for r, out in enumerate(res):
            if out["gathered_after"]:
                failed(what, f"{n} ranks, rank {r}: after backward, unit(s) {out['gathered_after']} still hold "
                             "their full parameters: the post-backward hook frees the unit once its gradient is "
                             "reduce-scattered")
            for u, (name, *_), grad, slot_names in zip(range(len(out["grads0"])), out["units"], out["grads0"],
                                                      out["slots"]):
                if grad is None:
                    failed(what, f"{n} ranks, rank {r}: unit {name} has no gradient on its shard after backward: "
                                 "the post-backward hook stores this rank's chunk in the shard's .grad")
                want = _chunks(torch.cat([ref["grads"][k].reshape(-1) for k in slot_names]), n)[r]
                if grad.shape != want.shape:
                    failed(what, f"{n} ranks, rank {r}: unit {name}'s gradient shard has {grad.numel()} numbers, "
                                 f"the shard {want.numel()}: reduce-scatter leaves one chunk per rank")
                if not torch.allclose(grad, want, atol=ATOL, rtol=RTOL):
                    if n > 1 and torch.allclose(grad, n * want, atol=ATOL * n, rtol=RTOL):
                        hint = (f"it is {n} x the right one: the reduce-scatter SUMS over ranks and each rank's "
                                "loss is already a mean over its rows: divide by the world size")
                    else:
                        hint = ("reduce-scatter the unit's full gradient (its padded flat layout, as the "
                                "parameters), so rank r receives chunk r")
                    failed(what, f"{n} ranks, rank {r}: unit {name}'s gradient after step 0 differs from one "
                                 f"process's: {hint}")
        for k, want in ref["params"].items():
            diff = (res[0]["params"][k] - want).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(res[0]["params"][k], want, atol=ATOL, rtol=RTOL):
                failed(what, f"{n} ranks: {k} differs from one process after {STEPS} steps by {diff:.1e}")
        loss_diff = max(abs(a - b) for a, b in zip(res[0]["losses"], ref["losses"]))
        if not loss_diff <= ATOL:
            failed(what, f"{n} ranks: losses differ from one process's by {loss_diff:.1e} (> {ATOL:g})")
        padded = FP32 * sum(p for _, _, p, _ in res[0]["units"])
        target = {"all_gather": 2 * padded, "reduce_scatter": padded}
        got = res[0]["bytes"]
        if n > 1 and got != target:
            if got.get("all_gather", 0) < 2 * padded:
                hint = "backward needs the parameters again: the pre-backward hook all-gathers the unit"
            elif got.get("all_gather", 0) > 2 * padded:
                hint = "a unit was gathered more than twice: gather only when its full tensor is empty"
            else:
                hint = "reduce-scatter each unit's gradient exactly once per backward"
            failed(what, f"{n} ranks: a step moved {got}, target {target} (3 x 4 B x Ψ padded): {hint}")
    # memory: the learner's units beside minifsdp's FSDP on gpt-mini, two ranks
    n = dist.lab_world_size(2)
    mem = {"learner": run_learner(what, fsdp_worker, n, "learner", shard_model, MEM_MODEL, 2, MEM_BATCH, MEM_SEQ,
                                  False, True)}
    by_rank = launch(library_memory_worker, n, ("FULL_SHARD", "SHARD_GRAD_OP"), timeout=120)
    for mode in ("FULL_SHARD", "SHARD_GRAD_OP"):
        mem[mode] = [r[mode] for r in by_rank]
    mine, lib = max(r["peak"] for r in mem["learner"]), max(r["peak"] for r in mem["FULL_SHARD"])
    if not all(r["peak_by_category"].get("unsharded_params", 0) > 0 for r in mem["learner"]):
        failed(what, "the memory tracker saw no 'unsharded_params' bytes in your step: allocate registers "
                     "unit.full with each active tracker under that category")
    results[what] = {"memory": mem, "world_size": n, "bytes": got, "units": res[0]["units"]}
    if abs(mine / lib - 1) > PEAK_MARGIN:
        failed(what, f"peak of a step on {MEM_MODEL}, {n} ranks: yours {mine / 2**20:.2f} MiB, minifsdp FSDP "
                     f"(FULL_SHARD) {lib / 2**20:.2f} MiB: more than {PEAK_MARGIN:.0%} apart; free each unit right "
                     "after its forward and right after its gradient is reduce-scattered")
    passed(what, f"one process's parameters (max |diff| {worst:.1e}) at {', '.join(map(str, sizes))} ranks; bytes "
                 f"per step at {sizes[-1]} ranks: yours {sum(got.values()):,} B, target 3 x 4 B x Ψ padded "
                 f"= {3 * padded:,} B; peak on {MEM_MODEL}, {n} ranks: yours {mine / 2**20:.2f} MiB, target within "
                 f"{PEAK_MARGIN:.0%} of minifsdp FSDP's {lib / 2**20:.2f} MiB")
