"""Checks for lab 03 (ZeRO): who owns what, ZeRO-1's sharded step, ZeRO-2's gradient hook, the bytes.

Each check runs the learner's functions (on 2 and 4 ranks where ranks matter),
compares with one process on the same global batch and with the library
(``minifsdp.zero``), and prints one verdict (``verdict.py``)::

    from minifsdp.labcheck import lab03 as check
    check.ownership(greedy_partition, owner_buckets, unpack_bucket)
    check.zero1(greedy_partition, local_optimizer, zero1_step, consolidate_state)
    check.zero2(greedy_partition, local_optimizer, zero1_step, install_zero2)
    runs = check.strategy_runs((1, 2, 4))          # the library's DDP / ZeRO-1 / ZeRO-2, measured
    check.predict_model_states(predict_model_states, runs, n_params)
    check.hint("zero1_step")                       # the next hint, idea first

Targets (Ψ = the number of parameters; fp32, so ``k = 4`` bytes per parameter):
the same parameters as one process (1e-4: the ranks add the gradient average in
another order); per rank exactly the bytes of what it owns: AdamW state
``2·4 B x owned elements + 4 B per owned tensor`` (two moments, one step
counter), ZeRO-2 gradients ``4 B x owned``; ZeRO-1 broadcasts ``4Ψ`` bytes per
step in at most ``N`` broadcasts (one bucket per owner); ZeRO-2 reduces ``4Ψ``.

Authorship (LAB-GUIDE §1): each exercise is refused statically when its code
reaches the library's implementation (``minifsdp.zero``'s partition, OSS,
ShardedDataParallel, ZeroRedundancyOptimizer, torch's ZeroRedundancyOptimizer;
``estimate``'s formulas and this module's measuring functions for the byte
prediction), and the learner's part of every run is watched by a ``Wire``, inside
the launched workers too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import types
from collections import Counter
from typing import Any, Callable

import torch

from .. import comm, data, dist, estimate, models, trace
from ..launch import launch
from ..memory import GRADIENTS, OPTIMIZER, PARAMETERS, MemoryTracker
from . import authorship as _authorship
from .verdict import Hints, Wire, call, check_world, failed, passed, require_own, run, watched

__all__ = ["ownership", "zero1", "zero2", "strategy_runs", "predict_model_states", "library_hook", "hint",
           "results", "LR", "WD", "EPS"]

# What the last run of each check measured (the lab draws the learner's run from it): a check cell is
# one call that prints a verdict, so the runs are kept here rather than returned.
results: dict[str, Any] = {}

# AdamW as in tests/test_zero.py. eps=1e-6 rather than 1e-8: a gradient that is pure rounding noise
# (~1e-9, its sign set by the order of a sum) would otherwise become a full-size update of either sign.
LR, WD, EPS = 1e-2, 0.1, 1e-6
MODEL, STEPS, BATCH, SEQ = "gpt-tiny", 3, 8, 32
WORLDS = (2, 4)          # a check never counts one rank as a proof: it averages, gathers and shards nothing
FP32 = 4
PARAM_TOL, LOSS_TOL = 1e-4, 1e-5

hint = Hints({
    "greedy_partition": [
        "Every rank must get the same answer without talking: the rule may use only the sizes.",
        "Keep a running load (elements owned so far) per rank; visit the parameters biggest first.",
        "Sort the indices by (-size, index); pick the rank with the smallest (load, rank).",
    ],
    "owner_buckets": [
        "A bucket is everything one rank owns, flattened and laid end to end: one tensor per rank.",
        "Go through the tensors in list order; a 1-D view of each owned one joins its owner's list.",
        "A rank that owns nothing still needs a tensor: 0 elements, the tensors' dtype and device.",
    ],
    "unpack_bucket": [
        "The layout is owner_buckets': same order, so the offsets follow from the sizes alone.",
        "Keep a running offset; each owned tensor takes the next numel() elements, reshaped like it.",
        "Write into the tensor's own storage (its .data, in place); rebinding a name changes nothing.",
    ],
    "local_optimizer": [
        "An optimizer keeps state for exactly the tensors it is given.",
        "Give AdamW only the parameters whose owner is this rank, with the same keyword arguments.",
    ],
    "zero1_step": [
        "After the step only the owners hold the new values; every other copy is one step behind.",
        "Each owner sends what it owns to everyone: one broadcast per owner, with src = that owner.",
        "Pack with owner_buckets, broadcast bucket r from rank r, unpack it on every rank; all ranks "
        "call the broadcasts in the same order.",
    ],
    "consolidate_state": [
        "Only a parameter's owner has its AdamW moments; the checkpoint must bring them to rank 0.",
        "Every rank takes part for every parameter, in order: the owner sends, the others receive.",
        "Non-owners receive into a buffer shaped like the parameter, on its device; the owner sends a "
        "copy of optimizer.state[p][key]. Only rank 0 returns the list.",
    ],
    "install_zero2": [
        "A post-accumulate-grad hook runs once p.grad is complete: the right moment to send it.",
        "The owner needs the average, and a reduce SUMS: scale first, then reduce to dst = the owner.",
        "Each hook must know its own parameter's owner: bind it when you register (a default argument).",
        "On every rank but the owner, drop the gradient (p.grad = None) right after the reduce.",
    ],
    "predict_model_states": [
        "Section 1's table says which of the three each stage shards; fp32 is 4 bytes per element.",
        "A sharded term counts the owned elements, an unsharded one all n_params. AdamW: two moments "
        "per element plus one 4-byte step per tensor it steps.",
        "moved: sum the volumes of the step's collectives (all-reduce of S bytes: 2S; reduce, "
        "broadcast: S); a world of one moves nothing.",
    ],
})


# -- the library each exercise must not reach ---------------------------------------------------
def _torch_zero() -> tuple:
    """torch's ZeroRedundancyOptimizer and its methods (a Wire watches minifsdp classes' methods only)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    return (TorchZeRO,) + tuple(v for v in vars(TorchZeRO).values() if isinstance(v, types.FunctionType))


def _library() -> tuple:
    """minifsdp's ZeRO (and torch's): the partition, the sharded optimizers and step, the reduce hook."""
    from .. import zero
    return (zero.partition_parameters, zero.OSS, zero.ZeroRedundancyOptimizer, zero.ShardedDataParallel,
            zero.wrap_zero, zero.all_reduce_gradients, zero.local_state_bytes) + _torch_zero()


def _predict_library() -> tuple:
    """What answers the byte prediction for you: estimate's formulas, the library's state counter, and this
    module's own measuring functions (the runs hold the measured bytes)."""
    from .. import zero
    return (estimate.model_state_bytes_per_device, estimate.comm_bytes_per_step, estimate.paper_comm_bytes,
            zero.local_state_bytes, strategy_runs, _zero_worker, _model_states_worker, _single_process,
            _single_process.__wrapped__)


# -- exercise 1: ownership and the owners' buckets ----------------------------------------------
def _lpt(sizes: list[int], n: int, order: Any = None) -> list[int]:
    load, owners = [0] * n, [0] * len(sizes)
    for i in order if order is not None else sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(n), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def _check_partition(what: str, fn: Callable, library: tuple) -> str:
    gpt_sizes = [p.numel() for p in models.build_model(MODEL, device="meta").parameters()]
    cases = [([10, 7, 5, 4], 2), ([4, 5, 7, 10], 2), ([3, 3, 3, 3], 2), ([6, 1, 1, 1, 1, 1, 1], 2),
             ([5, 2], 4), (gpt_sizes, 2), (gpt_sizes, 3), (gpt_sizes, 4)]
    mine = watched(fn, *library)
    for sizes, n in cases:
        got = call(what, mine, list(sizes), n)
        want = _lpt(sizes, n)
        where = f"greedy_partition({sizes if len(sizes) < 10 else 'gpt-tiny sizes'}, {n})"
        try:
            got = list(got)
        except TypeError:
            failed(what, f"{where} returned {type(got).__name__}: return a list, one owner rank per parameter")
        if len(got) != len(sizes):
            failed(what, f"{where} returned {len(got)} owners: return one owner rank per parameter")
        if not all(isinstance(r, int) and 0 <= r < n for r in got):
            failed(what, f"{where} = {got}: each owner must be a rank, an int in 0..{n - 1}")
        if got == want:
            continue

        def load(owners: list[int]) -> list[int]:
            return sorted(sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n))
        if got == _lpt(sizes, n, order=range(len(sizes))):
            why = "you visited the parameters in list order: sort them by size, biggest first"
        elif got == [i % n for i in range(len(sizes))]:
            why = "that is round-robin by position; go by size: biggest first, onto the least-loaded rank"
        elif load(got) == load(want):
            why = ("the loads are right but the ranks differ: break ties the same way on every rank "
                   "(equal sizes: lower index first; equal loads: lowest rank)")
        elif max(load(got)) > max(load(want)):
            why = (f"rank loads {load(got)} are less balanced than greedy's {load(want)}: visit the "
                   "parameters biggest first and give each to the rank with the smallest load so far")
        else:
            why = "follow the rule exactly: biggest first (ties by index), onto the least-loaded rank (ties: lowest)"
        failed(what, f"{where} = {got}, expected {want}: {why}")
    loads = [sum(s for s, o in zip(gpt_sizes, _lpt(gpt_sizes, 4)) if o == r) for r in range(4)]
    return (f"the library's owners on {len(cases)} cases (gpt-tiny on 4 ranks: loads "
            f"{', '.join(f'{x:,}' for x in loads)} elements, Ψ/4 = {sum(gpt_sizes) / 4:,.0f})")


def _check_buckets(what: str, pack: Callable, unpack: Callable, library: tuple) -> str:
    """Layout in parameter order, exactly the owned elements, a round trip that writes back in place into the
    owned tensors only; a rank that owns nothing gets an empty bucket."""
    pack, unpack = watched(pack, *library), watched(unpack, *library)
    torch.manual_seed(0)
    gpt = [torch.nn.Parameter(torch.randn(p.shape)) for p in models.build_model(MODEL, device="meta").parameters()]
    small = [torch.nn.Parameter(torch.randn(s)) for s in (5, 2)]
    cases = [(gpt, 1), (gpt, 2), (gpt, 4), (small, 4)]
    for tensors, n in cases:
        owners = _lpt([t.numel() for t in tensors], n)
        where = f"{'gpt-tiny' if tensors is gpt else 'two tensors (5, 2 elements)'} on {n} rank(s)"
        want = [torch.cat([t.detach().reshape(-1) for t, o in zip(tensors, owners) if o == r] or [torch.empty(0)])
                for r in range(n)]
        got = call(what, pack, tensors, owners, n)
        try:
            got = list(got)
        except TypeError:
            failed(what, f"{where}: owner_buckets returned {type(got).__name__}: return a list of 1-D tensors")
        if len(got) != n:
            failed(what, f"{where}: owner_buckets returned {len(got)} buckets: return one per rank ({n})")
        for r, (g, w) in enumerate(zip(got, want)):
            if not torch.is_tensor(g) or g.dim() != 1:
                failed(what, f"{where}, rank {r}: a bucket is one 1-D tensor (flatten each tensor, then join them)")
            if g.numel() != w.numel():
                why = (f"it holds every tensor: a bucket carries only the tensors rank {r} owns"
                       if g.numel() == sum(t.numel() for t in tensors) else
                       f"rank {r} owns {w.numel():,} elements: put exactly the tensors it owns in its bucket")
                failed(what, f"{where}, rank {r}: bucket of {g.numel():,} elements; {why}")
            if g.dtype != w.dtype:
                failed(what, f"{where}, rank {r}: the bucket is {g.dtype}, the tensors {w.dtype}: keep their dtype")
            if not torch.equal(g.detach(), w):
                failed(what, f"{where}, rank {r}: the right number of elements in another layout: join the owned "
                             "tensors in parameter (list) order, each flattened, so every rank reads the same layout")
        for r in range(n):
            restored = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
            call(what, unpack, want[r].clone(), restored, owners, r)
            for i, (t, o, orig) in enumerate(zip(restored, owners, tensors)):
                if o != r and t.detach().abs().sum() != 0:
                    failed(what, f"{where}, unpacking rank {r}'s bucket changed tensor {i}, which rank {o} owns: "
                                 "write only into the owned tensors")
                if o == r and not torch.equal(t.detach(), orig.detach()):
                    why = ("it is untouched: copy into the tensor itself, in place (rebinding a name leaves the "
                           "model's tensor as it was)" if t.detach().abs().sum() == 0 else
                           "its values are wrong: read the bucket in the same order and at the same offsets "
                           "owner_buckets wrote")
                    failed(what, f"{where}, rank {r}: tensor {i} after unpack_bucket differs from the packed one; "
                                 + why)
    sizes = [w.numel() for w in [torch.cat([t.reshape(-1) for t, o in zip(gpt, _lpt([t.numel() for t in gpt], 4))
                                             if o == r]) for r in range(4)]]
    return (f"round trip exact on {len(cases)} layouts; gpt-tiny on 4 ranks: {len(gpt)} broadcasts become 4, "
            f"buckets of {', '.join(f'{s:,}' for s in sizes)} elements")


def ownership(greedy_partition: Callable[[list[int], int], list[int]], owner_buckets: Callable,
              unpack_bucket: Callable) -> None:
    """Exercise 1: the learner's partition against the library's rule, and the owners' buckets' round trip.
    Pure bookkeeping, the same on every rank: checked in this process, for 1 to 4 owners."""
    what = "ownership"
    library = _library()
    require_own(what, library, greedy_partition, owner_buckets, unpack_bucket)
    owners = _check_partition(what, greedy_partition, library)
    buckets = _check_buckets(what, owner_buckets, unpack_bucket, library)
    passed(what, f"{owners}; {buckets}")


# -- one process, and the worker that trains with the learner's pieces (or the library's) ----------
@functools.lru_cache(maxsize=4)
def _single_process(model_name: str = MODEL, steps: int = STEPS, batch: int = BATCH, seq: int = SEQ) -> dict:
    """Losses, final parameters and AdamW state bytes of one process on the whole global batch."""
    torch.manual_seed(0)
    model = models.build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for step in range(steps):
        x, y = data.get_batch(step, batch, seq)
        loss = models.lm_loss(model(x), y)
        loss.backward()
        if step == 0:
            grads0 = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    moments = [{k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for p in model.parameters()]
    return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()}, "grads0": grads0,
            "moments": moments,
            "state_bytes": sum(t.nbytes for s in opt.state.values() for t in s.values()),
            "n_params": models.count_parameters(model), "n_tensors": len(list(model.parameters()))}


def _settled(tracker: MemoryTracker, label: str) -> dict[str, int]:
    """The books once they stop moving: gloo's thread lets go of a finished collective's tensor
    a moment after ``wait()`` returns, so a dropped gradient can outlive ``p.grad = None`` by a little -
    by milliseconds on a loaded machine, where that thread waits for a core: the books must hold still
    for several looks in a row (about 15 ms), not one."""
    books, still = tracker.snapshot(label), 0
    for _ in range(400):
        time.sleep(0.003)
        again = tracker.snapshot(label)
        still = still + 1 if again == books else 0
        if still >= 5:
            return books
        books = again
    return books


def _zero_worker(mode: str, fns: dict[str, Callable] | None, model_name: str = MODEL, steps: int = STEPS,
                 batch: int = BATCH, seq: int = SEQ, track: bool = True) -> dict:
    """Train on this rank; ``mode``: "zero1" / "zero2" with the learner's ``fns`` (watched by a Wire on the
    library), or "ddp", "lib-zero1", "lib-zero2" with the library. Returns plain data for the checks and plots.

    ``track``: measure with ``MemoryTracker`` (books by category, memory samples); without it
    (faster) the bytes are counted from the tensors: ``p.grad`` and the optimizer's state."""
    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    model = models.build_model(model_name).to(device)   # same seed on every rank: the same start
    params = list(model.parameters())
    # samples at every 1 % change of the total: the gradients' rise and fall is visible on small models too
    tracker = MemoryTracker(sample_change=0.01 if model_name == MODEL else 0.05)
    tracer = trace.Tracer(rank=rank)
    tracker.track_model(model)
    learner = mode in ("zero1", "zero2")
    # the learner's part of the run (its functions and hooks) under a tripwire on the library's ZeRO
    wire = Wire(*_library()) if learner else contextlib.nullcontext()
    losses: list[float] = []
    grads0: dict[str, Any] = {}
    consolidated = None
    with wire:
        step_fn: Callable[[], None]
        if learner:
            owners = [int(o) for o in fns["greedy_partition"]([p.numel() for p in params], n)]
            optimizer = fns["local_optimizer"](params, owners, rank, lr=LR, weight_decay=WD, eps=EPS)
            if mode == "zero2":
                fns["install_zero2"](params, owners)
            net = model

            def step_fn() -> None:
                fns["zero1_step"](params, owners, optimizer)
            owned = [p for p, o in zip(params, owners) if o == rank]
        elif mode == "ddp":
            owners, net = [rank] * len(params), model
            optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=EPS)
            step_fn, owned = optimizer.step, params
        else:
            from ..zero import wrap_zero
            net, optimizer = wrap_zero(model, 1 if mode == "lib-zero1" else 2, lr=LR, weight_decay=WD, eps=EPS)
            tracker.track_model(model)  # OSS moved the small parameters into its flat broadcast buckets
            owners = [optimizer.param_to_rank[p] for p in params]
            step_fn, owned = optimizer.step, optimizer.local_params

        def books(label: str) -> dict[str, int]:
            if track:
                return _settled(tracker, label)
            state = sum(t.nbytes for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))
            return {PARAMETERS: sum(p.nbytes for p in params), OPTIMIZER: state,
                    GRADIENTS: sum(p.grad.nbytes for p in params if p.grad is not None)}

        with tracker if track else contextlib.nullcontext(), tracer:
            for step in range(steps):
                x, y = data.get_batch(step, batch, seq, rank=rank, world_size=n)
                tracker.reset_peak()
                with trace.span("step", step=step):
                    loss = models.lm_loss(net(x.to(device)), y.to(device))
                    loss.backward()
                    if mode in ("zero1", "ddp") and n > 1:       # DDP's average (ZeRO-2 reduces in its hooks)
                        for p in params:
                            p.grad.div_(n)
                            comm.all_reduce(p.grad)
                    after_backward = books("backward")
                    held = [p.grad is not None for p in params]
                    if step == 0 and learner:   # the gradients held after the first backward,
                        grads0 = {k: p.grad.tolist() for k, p in model.named_parameters()   # as lists: no tensor
                                  if p.grad is not None}                                     # the tracker counts
                    step_fn()
                    after_step = books("step")
                model.zero_grad(set_to_none=True)
                total = loss.detach().reshape(1).clone()
                if n > 1:
                    torch.distributed.all_reduce(total)            # bookkeeping, outside the "step" span
                losses.append(total.item() / n)
        tracker.close()
        if mode == "zero1" and "consolidate_state" in fns:
            got = fns["consolidate_state"](params, owners, optimizer)
            consolidated = None if got is None else [
                {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in dict(m).items()}
                if isinstance(m, dict) else m for m in got]
    if learner:
        _refuse_library_objects()
    last = [s for s in tracer.trace.spans if s.name == "step" and s.args.get("step") == steps - 1][0]
    windows = [(s.start, s.end) for s in tracer.trace.compute_spans() if s.name == "step"]
    counts = Counter(s.name for s in tracer.trace.comm_spans() if any(a <= s.start <= b for a, b in windows))
    return {"mode": mode, "owners": owners, "losses": losses, "held": held, "grads0": grads0,
            "consolidated": consolidated,
            "parameters": after_backward[PARAMETERS], "gradients": after_backward[GRADIENTS],
            "optimizer": after_step[OPTIMIZER],
            "peak": tracker.peak_total,
            "owned_numel": sum(p.numel() for p in owned), "owned_tensors": len(owned),
            "bytes": {op: b // steps for op, b in tracer.trace.bytes_by_op(within="step").items()},
            "counts": {op: c // steps for op, c in counts.items()},
            "samples": [m for m in tracer.trace.memory if last.start <= m.time <= last.end],
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def _refuse_library_objects() -> None:
    """Raise LibraryShortcut if an object of the library's ZeRO classes is alive in this worker. The Wire sees
    calls on this thread; on a GPU, autograd runs gradient hooks on its own threads, which it cannot see."""
    import gc
    classes = tuple(obj for obj in _library() if isinstance(obj, type))
    for obj in gc.get_objects():
        kind = type(obj)   # not isinstance: it reads obj.__class__, which some torch objects warn about
        if issubclass(kind, classes):
            raise _authorship.LibraryShortcut(
                f"your code built the library's {kind.__module__}.{kind.__qualname__}: the exercise is to build "
                "this mechanism yourself, not to call (or subclass, or return) minifsdp's implementation of it")


def _model_states_worker(modes: tuple[str, ...], model_name: str, steps: int, batch: int, seq: int) -> dict:
    """``_zero_worker`` for each of the library's ``modes`` in turn, in one launch (lab 03, section 4)."""
    return {mode: _zero_worker(mode, None, model_name, steps, batch, seq) for mode in modes}


def strategy_runs(worlds: tuple[int, ...], model_name: str = "gpt-mini", steps: int = 2, batch: int = 4,
                  seq: int = 16) -> dict[str, dict[int, list[dict]]]:
    """The library's DDP, ZeRO-1 (OSS) and ZeRO-2 (ShardedDataParallel) trained ``steps`` steps at each world
    size of ``worlds``, measured: ``{"ddp" | "zero1" | "zero2": {N: [per-rank dict]}}``, each rank's dict with
    the tracker's books ("parameters", "gradients", "optimizer"), "bytes" (volume per collective per step),
    "owned_numel", "owned_tensors", "samples" (memory over the last step) and "peak"."""
    modes = {"ddp": "ddp", "zero1": "lib-zero1", "zero2": "lib-zero2"}
    by_n = {n: launch(_model_states_worker, n, tuple(modes.values()), model_name, steps, batch, seq, timeout=120)
            for n in worlds}
    return {s: {n: [r[mode] for r in by_n[n]] for n in worlds} for s, mode in modes.items()}


def _compare_with_single(what: str, n: int, res: list[dict], ref: dict, why_params: str) -> float:
    for r, out in enumerate(res[1:], start=1):
        if not all(torch.equal(out["params"][k], res[0]["params"][k]) for k in out["params"]):
            failed(what, f"{n} ranks: after training, rank {r}'s parameters differ from rank 0's: after the "
                         "step every rank must receive each parameter from its owner (src = the owner), "
                         "all ranks calling the broadcasts in the same order")
    worst = 0.0
    for k, want in ref["params"].items():
        diff = (res[0]["params"][k] - want).abs().max().item()
        worst = max(worst, diff)
        if not diff <= PARAM_TOL:
            failed(what, f"{n} ranks: the ranks agree, but {k} differs from one process by {diff:.1e} "
                         f"(> {PARAM_TOL:g}): {why_params}")
    loss_diff = max(abs(a - b) for a, b in zip(res[0]["losses"], ref["losses"]))
    if not loss_diff <= LOSS_TOL:
        failed(what, f"{n} ranks: losses {res[0]['losses']} differ from one process's {ref['losses']} "
                     f"by {loss_diff:.1e} (> {LOSS_TOL:g})")
    return worst


def _worlds(world_sizes: tuple[int, ...] | None) -> tuple[int, ...]:
    """The check's world sizes: 2 and 4 ranks (CPU ranks where the machine has fewer GPUs), never 1."""
    return tuple(sorted({check_world(n) for n in (world_sizes or WORLDS)}))


def _check_consolidated(what: str, n: int, res: list[dict], ref: dict) -> None:
    """Rank 0's consolidated AdamW moments equal one process's; the other ranks return None."""
    got = res[0]["consolidated"]
    if not isinstance(got, list) or len(got) != len(ref["moments"]):
        failed(what, f"{n} ranks: consolidate_state returned {type(got).__name__} on rank 0; return a list with "
                     f"one dict per parameter ({len(ref['moments'])})")
    if any(r["consolidated"] is not None for r in res[1:]):
        failed(what, f"{n} ranks: consolidate_state returned something on a rank other than 0: only rank 0 keeps "
                     "the checkpoint (return None elsewhere)")
    names = [k for k, _ in models.build_model(MODEL, device="meta").named_parameters()]
    for i, (mine, want) in enumerate(zip(got, ref["moments"])):
        for key in ("exp_avg", "exp_avg_sq"):
            if not isinstance(mine, dict) or key not in mine or not torch.is_tensor(mine[key]):
                failed(what, f"{n} ranks: consolidated entry {i} ({names[i]}) has no tensor {key!r}: each entry "
                             "holds both AdamW moments")
            if mine[key].shape != want[key].shape or not torch.allclose(mine[key], want[key], atol=1e-6,
                                                                          rtol=PARAM_TOL):
                owner = res[0]["owners"][i]
                failed(what, f"{n} ranks: the consolidated {key} of {names[i]} (owned by rank {owner}) is not one "
                             "process's: it must come from the parameter's owner, the only rank that stepped it")


def _check_broadcasts(what: str, n: int, res: list[dict], psi: int) -> None:
    moved, count = res[0]["bytes"].get("broadcast", 0), res[0]["counts"].get("broadcast", 0)
    if moved != FP32 * psi:
        failed(what, f"{n} ranks: the broadcasts moved {moved:,} B per step; the parameters are 4Ψ = "
                     f"{FP32 * psi:,} B (Ψ = {psi:,} parameters): send each parameter exactly once per step")
    if count > n:
        failed(what, f"{n} ranks: {count} broadcasts per step, about one per parameter; the target is at most "
                     f"{n}, one per owner: send each owner's parameters as one bucket (your owner_buckets)")


def zero1(greedy_partition: Callable, local_optimizer: Callable, zero1_step: Callable,
          consolidate_state: Callable, world_sizes: tuple[int, ...] | None = None) -> None:
    """Exercise 2: ZeRO-1 with the learner's functions at 2 and 4 ranks, against one process and OSS."""
    what = "ZeRO-1"
    worlds = _worlds(world_sizes)
    fns = dict(greedy_partition=greedy_partition, local_optimizer=local_optimizer, zero1_step=zero1_step,
               consolidate_state=consolidate_state)
    require_own(what, _library(), *fns.values())
    ref = _single_process()
    psi = ref["n_params"]
    runs, worst = {}, 0.0
    for n in worlds:
        res = run(what, _zero_worker, n, "zero1", fns, MODEL, STEPS, BATCH, SEQ, False)
        runs[n] = res
        states = [r["optimizer"] for r in res]
        if all(s == ref["state_bytes"] for s in states):
            failed(what, f"{n} ranks: every rank keeps the full AdamW state ({ref['state_bytes']:,} B): "
                         "local_optimizer must give AdamW only the parameters this rank owns")
        for r, out in enumerate(res):
            own = 2 * FP32 * out["owned_numel"] + FP32 * out["owned_tensors"]
            if out["optimizer"] != own:
                failed(what, f"{n} ranks, rank {r}: optimizer state {out['optimizer']:,} B, but the state of the "
                             f"parameters it owns is {own:,} B (exp_avg + exp_avg_sq + step): step only this "
                             "rank's parameters")
        if sum(states) != ref["state_bytes"]:
            failed(what, f"{n} ranks: the shards hold {sum(states):,} B of state, one process "
                         f"{ref['state_bytes']:,} B: every parameter must be stepped by exactly one rank")
        worst = max(worst, _compare_with_single(
            what, n, res, ref, "each parameter must come from its owner (who stepped it), after optimizer.step()"))
        _check_broadcasts(what, n, res, psi)
        _check_consolidated(what, n, res, ref)
    n = max(worlds)
    lib = launch(_zero_worker, n, "lib-zero1", None, MODEL, STEPS, BATCH, SEQ, False, timeout=120)
    mine, theirs = max(r["optimizer"] for r in runs[n]), max(r["optimizer"] for r in lib)
    target = estimate.model_state_bytes_per_device(psi, n, 1, padding=False)["optimizer"]
    results[what] = {"learner": runs, "library": lib, "single": ref}
    passed(what, f"one process's parameters (max |diff| {worst:.1e} <= {PARAM_TOL:g}) and, consolidated on "
                 f"rank 0, its AdamW moments at {', '.join(map(str, worlds))} ranks; {n} ranks: "
                 f"{runs[n][0]['counts'].get('broadcast', 0)} broadcasts of 4Ψ = {FP32 * psi:,} B in all per step "
                 f"(Ψ = {psi:,} parameters); largest AdamW state: yours {mine:,} B, target 2·4Ψ/N = "
                 f"{target:,.0f} B (+ whole parameters, + 4 B steps), minifsdp.zero.OSS {theirs:,} B")


def zero2(greedy_partition: Callable, local_optimizer: Callable, zero1_step: Callable, install_zero2: Callable,
          world_sizes: tuple[int, ...] | None = None) -> None:
    """Exercise 3: ZeRO-2 with the learner's hook at 2 and 4 ranks: same model as one process, each rank ends
    backward with exactly its owned (averaged) gradients, 4Ψ bytes of reduces per step; the library beside it."""
    what = "ZeRO-2"
    worlds = _worlds(world_sizes)
    fns = dict(greedy_partition=greedy_partition, local_optimizer=local_optimizer, zero1_step=zero1_step,
               install_zero2=install_zero2)
    require_own(what, _library(), *fns.values())
    ref = _single_process()
    psi = ref["n_params"]
    out: dict[str, Any] = {"learner": {}, "library": {}, "n_params": psi}
    for n in worlds:
        res = run(what, _zero_worker, n, "zero2", fns)
        out["learner"][n] = res
        moved = res[0]["bytes"]
        if "all_reduce" in moved:
            failed(what, f"{n} ranks: the gradients were all-reduced ({moved['all_reduce']:,} B per step): each "
                         "gradient needs to reach its owner only, which moves half as much")
        for r, one in enumerate(res):
            owned = [o == r for o in one["owners"]]
            if one["held"] == [True] * len(owned) and not all(owned):
                failed(what, f"{n} ranks, rank {r}: after backward it still holds every gradient "
                             f"({one['gradients']:,} B): a rank that does not own a parameter drops its gradient "
                             "(p.grad = None) once it is on its way to the owner")
            if one["held"] != owned:
                extra = sum(h and not o for h, o in zip(one["held"], owned))
                missing = sum(o and not h for h, o in zip(one["held"], owned))
                failed(what, f"{n} ranks, rank {r}: after backward it holds {extra} gradient(s) it does not own "
                             f"and lacks {missing} it owns: keep exactly the gradients of the owned parameters")
            want = FP32 * one["owned_numel"]
            if one["gradients"] != want:
                failed(what, f"{n} ranks, rank {r}: {one['gradients']:,} B of gradients after backward, the owned "
                             f"parameters' are {want:,} B")
            for k, g in one["grads0"].items():
                want, g = ref["grads0"][k], torch.tensor(g)
                if not torch.allclose(g, want, atol=LOSS_TOL, rtol=PARAM_TOL):
                    why = (f"it is {n} x the average: the reduce SUMS the ranks' gradients; divide by N first"
                           if torch.allclose(g, n * want, atol=n * LOSS_TOL, rtol=PARAM_TOL) else
                           "each owner must end backward with the average over the ranks of its gradients")
                    failed(what, f"{n} ranks, rank {r}: its gradient of {k} after backward differs from one "
                                 f"process's: {why}")
        _compare_with_single(what, n, res, ref,
                             "each gradient must arrive at its owner as the average over the ranks")
        if moved.get("reduce", 0) != FP32 * psi:
            failed(what, f"{n} ranks: the reduces moved {moved.get('reduce', 0):,} B per step; the gradients are "
                         f"4Ψ = {FP32 * psi:,} B: send each gradient to its owner exactly once per backward")
        _check_broadcasts(what, n, res, psi)
    n = max(worlds)
    out["library"][n] = launch(_zero_worker, n, "lib-zero2", None, timeout=120)
    mine = [r["gradients"] + r["optimizer"] for r in out["learner"][n]]
    lib = [r["gradients"] + r["optimizer"] for r in out["library"][n]]
    f = estimate.model_state_bytes_per_device(psi, n, 2, padding=False)
    steps = sum(r["owned_tensors"] for r in out["learner"][n]) * FP32
    volume = sum(out["learner"][n][0]["bytes"].values())
    results[what] = out
    passed(what, f"one process's parameters at {', '.join(map(str, worlds))} ranks; {n} ranks, gradients + "
                 f"AdamW state per rank: yours {', '.join(f'{b:,}' for b in mine)} B (sum {sum(mine):,} = N x "
                 f"formula {n * (f['gradients'] + f['optimizer']):,.0f} + {steps} B of steps), minifsdp.zero "
                 f"{', '.join(f'{b:,}' for b in lib)} B; moved per step: reduce 4Ψ + broadcast 4Ψ = 2·4Ψ = "
                 f"{volume:,} B (Ψ = {psi:,} parameters)")


def library_hook() -> None:
    """The library's ZeRO-2 hook (``ShardedDataParallel._on_grad_ready``), shown once the learner's passed."""
    if "ZeRO-2" not in results:
        print("The library's hook is shown here once your install_zero2 passes its check (run that first).")
        return
    from ..zero import ShardedDataParallel
    print(inspect.getsource(ShardedDataParallel._on_grad_ready))


# -- exercise 4: each rank's bytes, and the bytes per step --------------------------------------
_CATS = ("parameters", "gradients", "optimizer")
_STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2}


def _exact(stage: int, n_params: int, owned_numel: int, owned_tensors: int, world_size: int) -> dict[str, int]:
    """What the check holds the prediction to (the same arithmetic as the tracker's books and comm's volume)."""
    grads = owned_numel if stage >= 2 else n_params
    moved = {0: 2 * FP32 * n_params, 1: 3 * FP32 * n_params, 2: 2 * FP32 * n_params}[stage]
    return {"parameters": FP32 * n_params, "gradients": FP32 * grads,
            "optimizer": 2 * FP32 * owned_numel + FP32 * owned_tensors, "moved": moved if world_size > 1 else 0}


def _measured_moved(out: dict) -> int:
    return sum(out["bytes"].values())


def predict_model_states(fn: Callable[[int, int, int, int, int], dict[str, int]],
                         runs: dict[str, dict[int, list]], n_params: int) -> None:
    """Exercise 4: the learner's byte-exact prediction against every rank of ``runs[strategy][n]`` (the
    tracker's books and comm's volume, ``strategy_runs``) and on cases the check makes up (other sizes).

    The learner's ``fn(stage, n_params, owned_numel, owned_tensors, world_size)`` returns the bytes
    "parameters", "gradients" (after backward), "optimizer" (after a step) and "moved" (volume per step)."""
    what = "predict_model_states"
    library = _predict_library()
    require_own(what, library, fn)
    mine = watched(fn, *library)
    keys = _CATS + ("moved",)
    worlds = {n for by_n in runs.values() for n in by_n}
    if not worlds or max(worlds) < 2:
        failed(what, "the runs hold no world of 2 ranks or more: pass the runs of section 4 "
                     "(check.strategy_runs at 1, 2 and 4 ranks); one rank shards nothing")
    cases = []
    for strategy, by_n in runs.items():
        for n, res in by_n.items():
            for r, out in enumerate(res):
                measured = {c: out[c] for c in _CATS}
                measured["moved"] = _measured_moved(out)
                cases.append((f"stage {_STAGE_OF[strategy]} ({strategy}), {n} ranks, rank {r}",
                              (_STAGE_OF[strategy], n_params, out["owned_numel"], out["owned_tensors"], n),
                              measured, "the run measured"))
    # cases no run holds: a prediction has to come from the rule, not from looking the runs up
    for stage, psi, owned, tensors, n in ((1, 1_000, 300, 3, 4), (2, 5_000, 2_600, 7, 2), (0, 777, 777, 4, 8),
                                          (2, 4_096, 1_024, 1, 4), (1, 10, 10, 2, 1)):
        cases.append((f"stage {stage}, Ψ = {psi:,} parameters, {owned:,} owned in {tensors} tensors, {n} ranks",
                      (stage, psi, owned, tensors, n), _exact(stage, psi, owned, tensors, n), "the rule gives"))
    for where, args, want, source in cases:
        got = call(what, mine, *args)
        if not isinstance(got, dict) or not set(keys) <= set(got):
            failed(what, f"return a dict with the keys {keys}, got {got!r}")
        for key in keys:
            g = int(got[key])
            if g != want[key]:
                failed(what, f"{where}: you predict {g:,} B of {key}, {source} {want[key]:,} B: "
                             + _diagnose(key, g, want[key], args))
    measured = sum(len(res) for by_n in runs.values() for res in by_n.values())
    big = max(worlds)
    volumes = {s: _measured_moved(runs[s][big][0]) for s in runs if big in runs[s]}
    psi_line = ", ".join(f"{s} {v:,} B ({v / (FP32 * n_params):g}·4Ψ)" for s, v in volumes.items())
    passed(what, f"right to the byte on {measured} measured ranks and {len(cases) - measured} made-up cases "
                 f"(parameters, gradients, AdamW state, bytes per step); moved at {big} ranks: {psi_line}, "
                 f"Ψ = {n_params:,} parameters")


def _diagnose(key: str, got: int, want: int, args: tuple) -> str:
    """The likely slip behind a wrong prediction, in words."""
    stage, n_params, owned, k, n = args
    if key == "moved":
        if n == 1:
            return "a world of one moves nothing: every collective is a no-op there"
        if got * FP32 == want:
            return "you counted elements: fp32 is 4 bytes per element"
        if stage == 1 and got == 2 * FP32 * n_params:
            return ("that is the paper's ZeRO-1; this one is FairScale's OSS on DDP: it all-reduces the whole "
                    "gradients (2·4Ψ) and then broadcasts the parameters from their owners (4Ψ)")
        if got == want // 2 and stage != 1:
            return "an all-reduce of S bytes counts 2S in comm's volume (a reduce-scatter plus an all-gather)"
        if n > 1 and got * n == want * (n - 1):
            return "that is what a rank sends with ring algorithms; count the volume, (N-1)/N is not part of it"
        return ("add the step's collectives: DDP all-reduces the gradients; OSS all-reduces them and broadcasts "
                "the parameters; ZeRO-2 reduces each gradient to its owner and broadcasts the parameters")
    if got * FP32 == want or (key == "optimizer" and got == 2 * owned + k):
        return "you counted elements: fp32 is 4 bytes per element"
    per_element = {"parameters": FP32, "gradients": FP32, "optimizer": 2 * FP32}[key]
    if n > 1 and abs(got - per_element * n_params / n) <= FP32 * k + 1 and got != want:
        return ("you divided all the parameters by N: a rank owns whole parameters, so count owned_numel "
                "(the shards are not equal)")
    if key == "parameters" and got == FP32 * owned:
        return "stages 0-2 keep every parameter on every rank (sharding them is ZeRO-3)"
    if key == "gradients" and got == FP32 * owned:
        return "ZeRO-1 keeps every averaged gradient (it all-reduces); only ZeRO-2 shards them"
    if key == "gradients" and got == FP32 * n_params:
        return "ZeRO-2 keeps only the gradients of the owned parameters"
    if key == "optimizer" and got == 2 * FP32 * owned:
        return f"you forgot AdamW's 4-byte step counter, one per owned tensor ({k} here)"
    if key == "optimizer" and got > want and got - want == 2 * FP32 * (n_params - owned):
        return "from stage 1 on, the optimizer state covers the owned parameters only"
    return ("sharded terms count the owned elements, unsharded ones all n_params; AdamW: 2 x 4 B per element "
            "+ 4 B per tensor")
