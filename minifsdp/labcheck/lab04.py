"""Checks for lab 04 (FSDP): the learner's flat shard and per-unit gather / free / reduce-scatter cycle.

The learner builds, on a multi-unit GPT (each transformer ``Block`` a unit, the
root holding the rest), the four moments of FSDP: a pre-forward hook that
all-gathers the unit, a post-forward hook that frees it, a pre-backward gather
and a post-backward reduce-scatter (``minifsdp/fsdp/naive.py`` is the same cycle
in the library). Each check runs the learner's code on 2 or more ranks (CPU
ranks where the machine has fewer GPUs), compares with one process and with the
library, and prints one verdict::

    from minifsdp.labcheck import lab04 as check
    check.flat_shard(shard_flat, free, allocate, is_gathered)
    check.fsdp_forward(shard_model, gather, pre_forward, post_forward, install_hooks)
    check.fsdp_backward(shard_model, pre_backward, post_backward)
    check.hint("fsdp_forward")          # the next hint for an exercise, idea first

Targets (Ψ = the number of parameters; fp32, so the parameters take 4Ψ bytes):
one process's logits, gradients, losses and parameters (fp32 tolerances below:
the ranks add the gradient in another order); bytes moved per step exactly
``3 x 4 B x`` the padded Ψ (all-gather in forward, again in backward, one
reduce-scatter: the learner frees the root after forward like every other unit,
so the root is gathered twice too); the peak memory of a step within
``PEAK_MARGIN`` of ``minifsdp.fsdp.FullyShardedDataParallel`` on the same model,
batch and ranks.

Authorship: every check refuses the library's FSDP (``LIBRARY``: the naive FSDP,
its ``FlatUnit`` and hooks, ``FullyShardedDataParallel``, ``FlatParamHandle``)
statically and at run time, a :class:`~minifsdp.labcheck.authorship.Wire` around
the learner's part of each worker.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from .. import comm, data, dist, models, trace
from ..fsdp import FullyShardedDataParallel, naive
from ..fsdp.flat_param import FlatParamHandle
from ..memory import MemoryTracker
from .authorship import Wire, watched
from .verdict import Hints, call, failed, passed, require_own, run, run_explained

__all__ = ["flat_shard", "fsdp_forward", "fsdp_backward", "hint", "results", "LIBRARY", "PEAK_MARGIN"]

# The library's implementation of what the exercises build: sharding, gather, free, the hooks.
LIBRARY = (naive.NaiveFullyShardedDataParallel, naive.FlatUnit, naive.pre_forward, naive.post_forward,
           naive.pre_backward, naive.post_backward, FullyShardedDataParallel, FlatParamHandle)


results: dict[str, Any] = {}   # what the last run of each check measured, for the lab's plots
MODEL, STEPS, BATCH, SEQ, LR = "gpt-tiny", 3, 12, 16, 1e-3   # 12 rows: 2, 3 or 4 ranks split them evenly
MEM_MODEL, MEM_BATCH, MEM_SEQ, MEM_RANKS = "gpt-mini", 4, 32, 2
FORWARD_RANKS, BACKWARD_RANKS = (2, 3), (2, 3, 4)   # 3: the blocks need padding
ATOL, RTOL = 1e-5, 1e-4       # fp32, another order of additions than one process
PEAK_MARGIN = 0.25             # the learner's peak within +-25 % of minifsdp's FSDP (same model, batch, ranks)
FP32 = 4
UNSHARDED = "unsharded_params"

hint = Hints({
    "flat_shard": [
        "One flat vector per unit: every tensor flattened, in order, end to end; then zeros at the end "
        "until its length divides by world. Rank r keeps the r-th of world equal pieces.",
        "The shard becomes the unit's own Parameter: it must own exactly its memory (a view into the "
        "padded vector keeps all of it alive) and carry no autograd history.",
        "free / allocate act on the storage under unit.full, never on the tensor object. A storage's size "
        "counts bytes: the element size of full's dtype times the numbers.",
        "allocate then tells each tracker in memory.active_trackers() what the bytes are (its register "
        "method). is_gathered asks the storage how many bytes it holds now.",
    ],
    "fsdp_forward": [
        "Units: a Block's parameters belong to its unit; the root takes what no Block took. Visit the Blocks "
        "before the root, or the root takes everything. Names come from named_modules().",
        "A parameter sits in its module's _parameters under its attribute name (named_parameters with "
        "recurse=False lists a module's own). The Unit scaffolding removes the originals.",
        "Before forward: gather (skip when gathered), then put back each parameter as its piece of "
        "unit.full, reshaped. Pieces of full itself, so that autograd reaches full; the all-gather "
        "writes through full.data, so that autograd does not see the write.",
        "After forward the weights go, and backward will need them. Whose gradient is computed just before "
        "this unit's backward? Hook that tensor (when it requires grad) to call pre_backward(unit).",
    ],
    "fsdp_backward": [
        "Backward needs the unit's weights again: the views autograd saved read the storage of unit.full.",
        "The post-accumulate hook on full runs when full.grad is complete. Every rank holds its own "
        "gradient of the whole flat vector; each rank needs the average over ranks, of its chunk only.",
        "A reduce-scatter sums over ranks, and each rank's loss is a mean over its own rows. Its output has "
        "the shard's size; add it to shard.grad when one is already there.",
        "Leave no full-size tensor: free the weights, and take the gradient off full (full.grad left there "
        "is added to by the next backward, so gradients add up across steps).",
    ],
})


# -- how a raw torch error reads, in the lab's words -----------------------------------------------------
_FULL_WRITTEN = ("unit.full itself was written in place (autograd counts the writes, and the views it saved in "
                 "forward would be stale in backward): write the gathered numbers through unit.full.data")
_TRANSLATIONS = (
    ("setStorage", "a unit was still freed when its backward ran: did post_forward hook the unit's output, "
                   "and does that hook's pre_backward gather the unit again?"),
    ("storage of size 0", "a unit was still freed when its backward ran: did post_forward hook the unit's "
                          "output, and does that hook's pre_backward gather the unit again?"),
    ("is a view and is being modified inplace", "the all-gather wrote into unit.full itself, which autograd "
     "tracks (the modules' weights are views of it): write the gathered numbers through unit.full.data"),
    ("leaf Variable that requires grad is being used in an in-place", "the all-gather wrote into unit.full "
     "itself, a leaf autograd tracks: write the gathered numbers through unit.full.data"),
    ("modified by an inplace operation", _FULL_WRITTEN),
    ("does not require grad and does not have a grad_fn", "the loss does not reach unit.full: the modules' "
     "weights must be pieces of unit.full itself, not of unit.full.data (which autograd does not track)"),
    ("non-empty list of Tensors", "a unit got no parameters at all (torch.cat of an empty list in "
     "shard_flat): make the Block units first and the root last; the root takes only what is left"),
)


def _run(what: str, fn: Callable, world_size: int, *args: Any) -> list:
    """``verdict.run``, with the raw torch errors a learner meets said in one sentence of the lab."""
    return run_explained(what, fn, world_size, *args, translations=_TRANSLATIONS)


def _chunks(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(F.pad(flat, (0, math.ceil(flat.numel() / n) * n - flat.numel())).chunk(n))


# -- exercise 1: the flat shard and its memory, in this process --------------------------------------------
def flat_shard(shard_flat: Callable[[list[torch.Tensor], int, int], torch.Tensor], free: Callable,
               allocate: Callable, is_gathered: Callable) -> None:
    """``shard_flat`` on a 53-parameter MLP at N = 2, 3, 4; free / allocate / is_gathered on fp32 and bf16."""
    what = "flat shard"
    require_own(what, LIBRARY, shard_flat, free, allocate, is_gathered)
    shard_flat = watched(shard_flat, *LIBRARY)
    params = list(models.build_model("mlp", dims=(6, 5, 3)).parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    for n in (2, 3, 4):
        want = _chunks(flat, n)
        got = [call(what, shard_flat, params, r, n) for r in range(n)]
        if not all(isinstance(g, torch.Tensor) for g in got):
            bad = next(g for g in got if not isinstance(g, torch.Tensor))
            failed(what, f"shard_flat at N={n} returned {type(bad).__name__}: return a tensor, this rank's chunk")
        sizes = [g.numel() for g in got]
        if sizes != [want[0].numel()] * n:
            failed(what, f"shard_flat at N={n}: shard sizes {sizes}, expected {n} x {want[0].numel()} "
                         f"(= ceil(53/{n})): pad the flat vector with zeros to a multiple of N first, then cut "
                         "N equal chunks")
        if not all(torch.equal(g.detach().reshape(-1), w) for g, w in zip(got, want)):
            if sorted(tuple(g.tolist()) for g in got) == sorted(tuple(w.tolist()) for w in want):
                failed(what, f"shard_flat at N={n}: the right chunks, given to the wrong ranks: rank r keeps "
                             "chunk number r (rank 0 the first), the order the all-gather puts them back in")
            if torch.equal(torch.cat([g.detach().reshape(-1) for g in got])[:flat.numel()], flat):
                failed(what, f"shard_flat at N={n}: the parameters are right but the padding is not: pad with "
                             "zeros, at the end")
            failed(what, f"shard_flat at N={n}: the shards put together are not the parameters (in order, each "
                         "flattened) followed by zeros")
        for r, g in enumerate(got):
            if g.requires_grad or g.grad_fn is not None:
                failed(what, f"shard_flat at N={n}, rank {r}: the shard carries autograd history "
                             "(requires_grad): detach it, it becomes the unit's own Parameter")
            held = g.untyped_storage().nbytes()
            if held != g.numel() * g.element_size() or g.dim() != 1:
                failed(what, f"shard_flat at N={n}, rank {r}: the shard is a view into a tensor of {held:,} "
                             f"bytes, not {g.numel() * g.element_size():,} bytes of its own: return a copy of "
                             "the chunk, or each rank keeps the whole flat vector alive")
    _storage_cycle(what, free, allocate, is_gathered)
    passed(what, "shards of 27, 18, 14 numbers at N = 2, 3, 4 (padding 1, 1, 3), chunk r on rank r, each a copy; "
                 "unit.full at 0 B after free, at padded_numel x element size after allocate (fp32 and bf16), "
                 f"named {UNSHARDED!r}")


def _storage_cycle(what: str, free: Callable, allocate: Callable, is_gathered: Callable) -> None:
    """free / allocate / is_gathered in this process, on stand-in units of 10 fp32 and 6 bf16 numbers."""
    free, allocate, is_gathered = (watched(f, *LIBRARY) for f in (free, allocate, is_gathered))
    for dtype, numel in ((torch.float32, 10), (torch.bfloat16, 6)):
        full = torch.zeros(numel, dtype=dtype, device=dist.device(), requires_grad=True)
        unit = SimpleNamespace(name="test", full=full, padded_numel=numel, numel=numel)
        nbytes = lambda: unit.full.untyped_storage().nbytes()   # noqa: E731
        size = numel * full.element_size()
        kind = str(dtype).replace("torch.", "")
        call(what, free, unit)
        if unit.full is not full:
            failed(what, "free replaced unit.full by another tensor: keep the same tensor object (the views "
                         "autograd saved point into it) and release only the memory under it")
        if nbytes() != 0:
            failed(what, f"after free, {nbytes()} bytes are still behind unit.full: release its whole storage")
        answer = call(what, is_gathered, unit)
        if answer is not False:
            failed(what, f"is_gathered said {answer!r} right after free: False when no memory is behind "
                         "unit.full")
        with MemoryTracker() as tracker:
            call(what, allocate, unit)
            named = tracker.live().get(UNSHARDED, 0)
        if unit.full is not full:
            failed(what, "allocate replaced unit.full by another tensor: give memory back to the same tensor")
        if nbytes() != size:
            hint_ = (": a storage's size counts bytes, not numbers" if nbytes() == numel else
                     f": count the bytes of full's own dtype ({full.element_size()} B a number)"
                     if nbytes() == numel * FP32 else "")
            failed(what, f"allocate on a unit of {numel} {kind} numbers gave unit.full {nbytes()} bytes, "
                         f"expected {size}{hint_}")
        answer = call(what, is_gathered, unit)
        if answer is not True:
            failed(what, f"is_gathered said {answer!r} right after allocate: True when memory is behind "
                         "unit.full")
        if named != size:
            failed(what, f"allocate: the memory tracker saw {named} bytes named {UNSHARDED!r}, expected {size}: "
                         "register unit.full under that name with each tracker in memory.active_trackers()")


# -- one process ---------------------------------------------------------------------------------------
def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return data.get_batch(step + 100 * micro, BATCH, SEQ)


def _micro_batches(step: int) -> int:
    """Two backward passes before the first optimizer step (gradient accumulation), one after."""
    return 2 if step == 0 else 1


def _single(model_name: str = MODEL, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = models.build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"losses": []}
    x0, _ = _batch(0)
    with torch.no_grad():
        out["logits"] = model(x0)
    for step in range(steps):
        for micro in range(_micro_batches(step)):
            x, y = _batch(step, micro)
            loss = models.lm_loss(model(x), y)
            loss.backward()
            if step == 0 and micro == 0:
                out["grads_first"] = {k: p.grad.clone() for k, p in model.named_parameters()}
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


def _hooked(output: Any) -> str:
    """"hooked" when a tensor of this output that takes part in autograd carries a gradient hook, "no hook",
    or "no grad" when no tensor of it takes part in autograd."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return "no grad"
    return "hooked" if any(getattr(t, "_backward_hooks", None) for t in tensors) else "no hook"


def _fsdp_worker(mode: str, shard_model: Callable | None, model_name: str, steps: int, batch: int, seq: int,
                 forward_only: bool = False, track_memory: bool = False) -> dict:
    """Train ``steps`` steps on this rank: ``mode`` "learner" (the lab's ``shard_model``, under a library wire),
    or "FULL_SHARD" / "SHARD_GRAD_OP" (``minifsdp.fsdp``). Plain data back."""
    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    model = models.build_model(model_name).to(device)
    names = {id(m): name for name, m in model.named_modules()}
    tracker, tracer = MemoryTracker(), trace.Tracer(rank=rank)
    out: dict[str, Any] = {"mode": mode, "losses": []}
    learner = mode == "learner"
    with Wire(*LIBRARY) if learner else contextlib.nullcontext():
        units = list(shard_model(model, {models.Block})) if learner else []
    # The wire watches every call (sys.setprofile): a memory-tracked step runs ~4x slower under it, which would
    # stretch the learner's memory curve beside the library's. That run repeats code the gpt-tiny runs of the
    # same check already watched step by step; its units are still built under the wire (above).
    wire = (lambda: Wire(*LIBRARY)) if learner and not track_memory else contextlib.nullcontext   # noqa: E731
    if learner:
        net, params = model, [u.shard for u in units]
        out["units"] = [(u.name, u.numel, u.padded_numel, u.shard.numel()) for u in units]
        out["post_accumulate_hook"] = [u.name for u in units if getattr(u.full, "_post_accumulate_grad_hooks", None)]
        versions = {u.name: u.full._version for u in units}   # writes through full.data leave it alone
        hooked: dict[str, str] = {}
        for u in units:   # registered after the learner's hooks: runs after their post_forward
            u.module.register_forward_hook(lambda m, a, output, u=u: hooked.__setitem__(u.name, _hooked(output)))
    else:
        from ..fsdp import ModuleWrapPolicy, ShardingStrategy
        net = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({models.Block}),
                                       sharding_strategy=ShardingStrategy[mode])
        params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    holder = torch.nn.ParameterList(params)   # the tracker's handle on the shards and their .grad
    rows = slice(rank * batch // n, (rank + 1) * batch // n)
    with tracer:
        if forward_only:
            x, _ = data.get_batch(0, batch, seq)
            with trace.span("measured", step=0), wire():
                logits = net(x[rows].to(device))
            out["logits"] = logits.detach().cpu()
            out["gathered_after"] = [u.name for u in units if _holds_memory(u)]
            out["hooked"] = hooked if learner else {}
            out["full_written"] = [u.name for u in units if u.full._version != versions[u.name]]
            out["bytes"] = tracer.trace.bytes_by_op(within="measured")
            return out
        for step in range(steps):
            last = step == steps - 1
            tracking = track_memory and last   # the last step: the optimizer state exists
            if tracking:
                tracker.track_model(holder)
                tracker.track_optimizer(opt)
            with tracker if tracking else contextlib.nullcontext():
                tracker.reset_peak()
                with trace.span("measured" if last else "step", step=step):
                    for micro in range(_micro_batches(step) if learner else 1):
                        x, y = data.get_batch(step + 100 * micro, batch, seq)
                        with wire():
                            loss = models.lm_loss(net(x[rows].to(device)), y[rows].to(device))
                            loss.backward()
                        if learner and step == 0 and micro == 0:
                            out["grads_first"] = [None if u.shard.grad is None else u.shard.grad.detach().cpu()
                                                  .clone() for u in units]
                    if tracking:
                        tracker.snapshot("after backward")   # labels the shards' new .grad as gradients
                if learner and step == 0:
                    out["grads0"] = [None if u.shard.grad is None else u.shard.grad.detach().cpu().clone()
                                     for u in units]
                    out["gathered_after"] = [u.name for u in units if _holds_memory(u)]
                    out["full_grad_left"] = [u.name for u in units if u.full.grad is not None]
                    out["full_written"] = [u.name for u in units if u.full._version != versions[u.name]]
                opt.step()
                opt.zero_grad(set_to_none=True)
            total = loss.detach().reshape(1).clone()
            torch.distributed.all_reduce(total)
            out["losses"].append(total.item() / n)
    tracker.close()
    out["bytes"] = tracer.trace.bytes_by_op(within="measured")
    if track_memory:
        out["peak"] = tracker.peak_total
        out["peak_by_category"] = dict(tracker.peak_by_category)
        out["samples"] = list(tracker.samples)
    if learner:   # the final parameters, gathered by the check (not by the learner's code), under their names
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


def _library_memory_worker(modes: tuple[str, ...]) -> dict:
    """``_fsdp_worker`` with the library's strategies in turn, memory tracked, in one launch."""
    return {m: _fsdp_worker(m, None, MEM_MODEL, 2, MEM_BATCH, MEM_SEQ, False, True) for m in modes}


def _padded_numel(model_name: str, n: int) -> int:
    """Ψ with each unit padded to a multiple of n: what the units gather, the target of the byte checks."""
    return sum(math.ceil(v / n) * n for v in _expected_units(model_name).values())


def _expected_units(model_name: str) -> dict[str, int]:
    """Parameters per unit when every Block is a unit and the root holds the rest."""
    model = models.build_model(model_name, device="meta")
    units = {name: models.count_parameters(m) for name, m in model.named_modules() if isinstance(m, models.Block)}
    return {**units, "root": models.count_parameters(model) - sum(units.values())}


def _check_units(what: str, n: int, res: list[dict], model_name: str = MODEL) -> None:
    """Every rank made the same units -- each Block, the root with the rest -- each with an equal padded shard."""
    units = res[0]["units"]
    if any(r["units"] != units for r in res):
        failed(what, f"{n} ranks: the ranks made different units")
    got, want = {name: numel for name, numel, _, _ in units}, _expected_units(model_name)
    if got != want:
        failed(what, f"units {got} (name: parameters), expected {want}: every Block is a unit named by its "
                     "module path, and the root (named 'root') holds every parameter no Block holds; each "
                     "parameter in exactly one unit")
    if units[-1][0] != "root":
        failed(what, "the root must be the last unit (it takes what the others left)")
    for name, numel, padded, shard in units:
        if shard * n != padded or padded < numel or padded - numel >= n:
            failed(what, f"{n} ranks: unit {name} has {numel} parameters, {padded} padded, shards of {shard}: "
                         "each rank keeps an equal chunk of the zero-padded flat vector (shard_flat)")


def fsdp_forward(shard_model: Callable, gather: Callable, pre_forward: Callable, post_forward: Callable,
                 install_hooks: Callable, world_sizes: tuple[int, ...] = FORWARD_RANKS) -> None:
    """A forward at 2 and 3 ranks: one process's logits, every unit freed and hooked, 4 B x padded Ψ once."""
    what = "FSDP forward"
    require_own(what, LIBRARY, shard_model, gather, pre_forward, post_forward, install_hooks)
    ref = _single(steps=0)
    n_params = models.count_parameters(models.build_model(MODEL, device="meta"))
    for n in (max(2, w) for w in world_sizes):
        res = _run(what, _fsdp_worker, n, "learner", shard_model, MODEL, 1, BATCH, SEQ, True)
        _check_units(what, n, res)
        for r, out in enumerate(res):
            rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
            want = ref["logits"][rows]
            if out["logits"].shape != want.shape or not torch.allclose(out["logits"], want, atol=ATOL, rtol=RTOL):
                failed(what, f"{n} ranks, rank {r}: the logits differ from one process's: before a unit runs, its "
                             "modules must see the gathered parameters, in order (all-gather puts rank r's shard "
                             "at position r), each piece reshaped to its parameter's shape")
            if out["gathered_after"]:
                failed(what, f"{n} ranks, rank {r}: after forward, unit(s) {out['gathered_after']} still hold their "
                             "full parameters: the post-forward hook frees the unit it just ran")
            if out["full_written"]:
                failed(what, _FULL_WRITTEN)
            if "no grad" in out["hooked"].values():
                failed(what, f"{n} ranks, rank {r}: the output of unit(s) "
                             f"{[k for k, v in out['hooked'].items() if v == 'no grad']} does not take part in "
                             "autograd: the modules' weights must be pieces of unit.full itself (a leaf that "
                             "requires grad), not of unit.full.data, which autograd does not track")
            unhooked = [name for name, state in out["hooked"].items() if state != "hooked"]
            if unhooked:
                failed(what, f"{n} ranks, rank {r}: the output of unit(s) {unhooked} carries no gradient hook: "
                             "the unit is freed after forward, so backward must be told to gather it first: hook "
                             "the output, whose gradient is computed just before this unit's backward")
            missing = [name for name, *_ in out["units"] if name not in out["post_accumulate_hook"]]
            if missing:
                failed(what, f"unit(s) {missing}: no hook on unit.full tells post_backward that the unit's whole "
                             "gradient is ready: which hook runs once a leaf's .grad is complete?")
        padded = _padded_numel(MODEL, n)
        got = res[0]["bytes"]
        if got != {"all_gather": FP32 * padded}:
            hint_ = ("gathered more than once: gather only when the unit's full tensor is empty"
                     if got.get("all_gather", 0) > FP32 * padded else "every unit must be all-gathered once")
            failed(what, f"{n} ranks: forward moved {got}, the target is all_gather {FP32 * padded:,} B "
                         f"(4 B x padded Ψ): {hint_}")
    passed(what, f"one process's logits (|diff| <= {ATOL:g}) at {', '.join(map(str, world_sizes))} ranks; "
                 f"all-gathered per forward at {n} ranks: yours {sum(got.values()):,} B, target 4 B x padded Ψ = "
                 f"{FP32 * padded:,} B (Ψ = {n_params:,} parameters); every unit freed and hooked after its forward")


def fsdp_backward(shard_model: Callable, pre_backward: Callable, post_backward: Callable,
                  world_sizes: tuple[int, ...] = BACKWARD_RANKS) -> None:
    """Whole steps at 2, 3, 4 ranks against one process; bytes 3 x 4 B x padded Ψ exact; peak vs minifsdp's FSDP."""
    what = "FSDP backward"
    require_own(what, LIBRARY, shard_model, pre_backward, post_backward)
    ref = _single()
    worst = 0.0
    sizes = tuple(max(2, w) for w in world_sizes)
    for n in sizes:
        res = _run(what, _fsdp_worker, n, "learner", shard_model, MODEL, STEPS, BATCH, SEQ)
        _check_units(what, n, res)
        for r, out in enumerate(res):
            if out["full_written"]:
                failed(what, _FULL_WRITTEN)
            if out["gathered_after"]:
                failed(what, f"{n} ranks, rank {r}: after backward, unit(s) {out['gathered_after']} still hold "
                             "their full parameters: the post-backward hook frees the unit once its gradient is "
                             "reduce-scattered")
            if out["full_grad_left"]:
                failed(what, f"{n} ranks, rank {r}: after backward, unit(s) {out['full_grad_left']} still hold a "
                             "full-size gradient in unit.full.grad: take it off once reduce-scattered, or the next "
                             "backward adds to it and gradients are adding up across steps")
            for name, grad, first, slot_names in zip((u[0] for u in out["units"]), out["grads0"],
                                                     out["grads_first"], out["slots"]):
                if grad is None:
                    failed(what, f"{n} ranks, rank {r}: unit {name} has no gradient on its shard after backward: "
                                 "the post-backward hook stores this rank's chunk in the shard's .grad")
                want = _chunks(torch.cat([ref["grads"][k].reshape(-1) for k in slot_names]), n)[r]
                if grad.shape != want.shape:
                    failed(what, f"{n} ranks, rank {r}: unit {name}'s gradient shard has {grad.numel()} numbers, "
                                 f"the shard {want.numel()}: reduce-scatter leaves one chunk per rank")
                if torch.allclose(grad, want, atol=ATOL, rtol=RTOL):
                    continue
                once = _chunks(torch.cat([ref["grads_first"][k].reshape(-1) for k in slot_names]), n)[r]
                if first is not None and torch.allclose(first, once, atol=ATOL, rtol=RTOL):
                    hint_ = ("the first backward was right, the second replaced it: with two backward passes "
                             "before a step the shard's .grad must add up (add to it when it is there), as "
                             "torch's .grad does")
                elif torch.allclose(grad, n * want, atol=ATOL * n, rtol=RTOL):
                    hint_ = (f"it is {n} x the right one: the reduce-scatter SUMS over ranks and each rank's "
                             "loss is already a mean over its rows: divide by the world size")
                else:
                    hint_ = ("reduce-scatter the unit's full gradient (its padded flat layout, as the "
                             "parameters), so rank r receives chunk r")
                failed(what, f"{n} ranks, rank {r}: unit {name}'s gradient after the first step's two backward "
                             f"passes differs from one process's: {hint_}")
        for k, want in ref["params"].items():
            diff = (res[0]["params"][k] - want).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(res[0]["params"][k], want, atol=ATOL, rtol=RTOL):
                failed(what, f"{n} ranks: {k} differs from one process after {STEPS} steps by {diff:.1e}")
        loss_diff = max(abs(a - b) for a, b in zip(res[0]["losses"], ref["losses"]))
        if not loss_diff <= ATOL:
            failed(what, f"{n} ranks: losses differ from one process's by {loss_diff:.1e} (> {ATOL:g})")
        padded = FP32 * _padded_numel(MODEL, n)
        target = {"all_gather": 2 * padded, "reduce_scatter": padded}
        got = res[0]["bytes"]
        if got != target:
            if got.get("all_gather", 0) < 2 * padded:
                hint_ = "backward needs the parameters again: the pre-backward hook all-gathers the unit"
            elif got.get("all_gather", 0) > 2 * padded:
                hint_ = "a unit was gathered more than twice: gather only when its full tensor is empty"
            else:
                hint_ = "reduce-scatter each unit's gradient exactly once per backward"
            failed(what, f"{n} ranks: a step moved {got}, target {target} (3 x 4 B x padded Ψ): {hint_}")
    # memory: the learner's units beside minifsdp's FSDP on gpt-mini, two ranks
    n_mem = MEM_RANKS
    mem = {"learner": _run(what, _fsdp_worker, n_mem, "learner", shard_model, MEM_MODEL, 2, MEM_BATCH, MEM_SEQ,
                           False, True)}
    by_rank = run(what, _library_memory_worker, n_mem, ("FULL_SHARD", "SHARD_GRAD_OP"), timeout=120)
    for mode in ("FULL_SHARD", "SHARD_GRAD_OP"):
        mem[mode] = [r[mode] for r in by_rank]
    mine, lib = max(r["peak"] for r in mem["learner"]), max(r["peak"] for r in mem["FULL_SHARD"])
    if not all(r["peak_by_category"].get(UNSHARDED, 0) > 0 for r in mem["learner"]):
        failed(what, f"the memory tracker saw no {UNSHARDED!r} bytes at the peak of your step: allocate "
                     "registers unit.full with each active tracker under that name")
    mem_units = _expected_units(MEM_MODEL)
    results["fsdp_backward"] = {
        "memory": mem, "world_size": n_mem, "bytes": got, "bytes_world_size": sizes[-1], "units": res[0]["units"],
        "unit_bytes": {k: FP32 * math.ceil(v / n_mem) * n_mem for k, v in mem_units.items()}}
    if abs(mine / lib - 1) > PEAK_MARGIN:
        failed(what, f"peak of a step on {MEM_MODEL}, {n_mem} ranks: yours {mine / 2**20:.2f} MiB, minifsdp FSDP "
                     f"(FULL_SHARD) {lib / 2**20:.2f} MiB: more than {PEAK_MARGIN:.0%} apart; free each unit right "
                     "after its forward and right after its gradient is reduce-scattered")
    passed(what, f"one process's gradients and parameters (max |diff| {worst:.1e}) at {', '.join(map(str, sizes))} "
                 f"ranks; bytes per step at {sizes[-1]} ranks: yours {sum(got.values()):,} B, target 3·4Ψ "
                 f"(Ψ padded) = {3 * padded:,} B; peak on {MEM_MODEL}, {n_mem} ranks: yours {mine / 2**20:.2f} MiB, "
                 f"target within {PEAK_MARGIN:.0%} of minifsdp FSDP's {lib / 2**20:.2f} MiB")
