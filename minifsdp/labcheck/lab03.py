"""Checks for lab 03 (ZeRO): the learner's partition, ZeRO-1 step and ZeRO-2 gradient hook.

Each check runs the learner's functions (on several ranks where it matters),
compares with one process on the same global batch and with the library
(``minifsdp.zero``), and prints one verdict (``verdict.py``)::

    from minifsdp.labcheck import lab03 as check
    check.greedy_partition(greedy_partition)
    check.zero1(greedy_partition, local_optimizer, zero1_step, consolidate_state)
    check.owner_buckets(owner_buckets, unpack_bucket)
    runs = check.zero2(greedy_partition, local_optimizer, zero1_step, install_zero2)
    check.predict_model_states(predict_model_states, runs)

The worker that trains with the learner's pieces is ``zero_worker`` below; the
lab shows its loop. Targets: the same parameters as one process (fp32, 1e-4:
the ranks add the gradient average in another order), and per rank exactly
the bytes of what it owns: ZeRO-1 optimizer state ``8 B x owned + 4 B per owned
tensor`` (AdamW's two moments and step), ZeRO-2 gradients ``4 B x owned``;
summed over the ranks, that is ``N x`` the formula of ``estimate``
(``model_state_bytes_per_device(Ψ, N, stage, padding=False)``), Ψ = the number
of parameters.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import textwrap
import time
import types
from typing import Any, Callable

import torch

from .. import comm, data, dist, estimate, models, trace
from ..launch import WorkerError, launch
from ..memory import GRADIENTS, OPTIMIZER, PARAMETERS, MemoryTracker
from .verdict import failed, is_library, not_implemented, passed

__all__ = ["greedy_partition", "zero1", "owner_buckets", "zero2", "predict_model_states", "zero_worker", "model_states_worker",
           "single_process", "results", "LR", "WD", "EPS"]

# What the last run of each check measured (the lab draws the learner's run from it): a check cell is
# one call that prints a verdict, so the runs are kept here rather than returned.
results: dict[str, Any] = {}

# AdamW as in tests/test_zero.py. eps=1e-6 rather than 1e-8: a gradient that is pure rounding noise
# (~1e-9, its sign set by the order of a sum) would otherwise become a full-size update of either sign.
LR, WD, EPS = 1e-2, 0.1, 1e-6
MODEL, STEPS, BATCH, SEQ = "gpt-tiny", 3, 8, 32
FP32 = 4
PARAM_TOL, LOSS_TOL = 1e-4, 1e-5


# -- shared by the lab checks: run the learner's code, tell it from the library's -----------------
def library_calls(fns: dict[str, Callable], library: dict[str, Any]) -> list[str]:
    """``"fn uses lib"`` for each learner function that is, or calls by name, one of ``library``'s objects.

    Static: the names a function's code (nested functions included) loads, looked up in its
    globals; a module there (``zero.OSS``) is followed one attribute deep. Sound for the
    shortcut the check exists to catch (calling the library's finished version), not a sandbox.
    """
    found = []
    libs = list(library.items())
    for fname, fn in fns.items():
        if is_library(fn, *library.values()) and getattr(fn, "__module__", "") != "__main__":
            found.append(f"{fname} is the library's own {getattr(fn, '__qualname__', fn)}")
            continue
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        names, stack = set(), [code]
        while stack:
            c = stack.pop()
            names |= set(c.co_names)
            stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        g = getattr(fn, "__globals__", {})
        for n in sorted(names):
            obj = g.get(n)
            if obj is None and n.startswith("minifsdp"):   # ``from minifsdp.x import y`` inside the function
                obj = sys.modules.get(n)
            targets = [obj] + ([getattr(obj, a, None) for a in names] if isinstance(obj, types.ModuleType) else [])
            for lname, lib in libs:
                if any(t is lib for t in targets if t is not None):
                    found.append(f"{fname} calls the library's {lname}")
    return sorted(set(found))


def refuse_library(what: str, fns: dict[str, Callable], library: dict[str, Any]) -> None:
    calls = library_calls(fns, library)
    if calls:
        failed(what, "the check sees the library, not your code (" + "; ".join(calls) +
               "): write the mechanism yourself with torch and minifsdp.comm")


def run_learner(what: str, fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list:
    """``launch(fn, world_size, *args)``; a failure in the learner's code becomes a one-line verdict."""
    try:
        return launch(fn, world_size, *args, timeout=timeout)
    except WorkerError as err:
        cause = err.__cause__
        if isinstance(cause, NotImplementedError) or "NotImplementedError" in str(err):
            text = str(cause) if isinstance(cause, NotImplementedError) else str(err)
            failed(what, f"not written yet (NotImplementedError: {text})")
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        failed(what, f"your code raised on {world_size} rank(s): {first}")
    raise AssertionError("unreachable")


def _stub_hint(fn: Callable) -> str:
    """The message of the blank lab's ``raise NotImplementedError("...")`` in ``fn``'s source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args \
                and isinstance(node.exc.args[0], ast.Constant) and getattr(node.exc.func, "id", "") == \
                "NotImplementedError":
            return str(node.exc.args[0].value)
    return ""


def blank(what: str, **fns: Callable) -> None:
    """Fail at once, with the exercise's hint, if one of ``fns`` is still the blank lab's stub."""
    for name, fn in fns.items():
        if not_implemented(fn):
            failed(what, f"{name} is not written yet (NotImplementedError: {_stub_hint(fn)}); write it, "
                         "then run this check again")


# -- the rule, written for the check -------------------------------------------------------------
def _lpt(sizes: list[int], n: int, order: Any = None) -> list[int]:
    load, owners = [0] * n, [0] * len(sizes)
    for i in order if order is not None else sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(n), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def greedy_partition(fn: Callable[[list[int], int], list[int]]) -> None:
    """The learner's ``greedy_partition(sizes, world_size)`` on small cases and on gpt-tiny's sizes."""
    what = "greedy_partition"
    blank(what, greedy_partition=fn)
    from ..zero import partition_parameters
    refuse_library(what, {"greedy_partition": fn}, {"minifsdp.zero.partition_parameters": partition_parameters})
    gpt_sizes = [p.numel() for p in models.build_model(MODEL, device="meta").parameters()]
    cases = [([10, 7, 5, 4], 2), ([4, 5, 7, 10], 2), ([3, 3, 3, 3], 2), ([6, 1, 1, 1, 1, 1, 1], 2),
             ([5, 2], 4), (gpt_sizes, 3), (gpt_sizes, 4)]
    for sizes, n in cases:
        try:
            got = list(fn(list(sizes), n))
        except NotImplementedError as e:
            failed(what, f"not written yet (NotImplementedError: {e})")
        want = _lpt(sizes, n)
        where = f"greedy_partition({sizes if len(sizes) < 10 else 'gpt-tiny sizes'}, {n})"
        if len(got) != len(sizes):
            failed(what, f"{where} returned {len(got)} owners: return one owner rank per parameter")
        if not all(isinstance(r, int) and 0 <= r < n for r in got):
            failed(what, f"{where} = {got}: each owner must be a rank, an int in 0..{n - 1}")
        if got == want:
            continue

        def load(owners: list[int]) -> list[int]:
            return sorted(sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n))
        if got == _lpt(sizes, n, order=range(len(sizes))):
            hint = "you visited the parameters in list order: sort them by size, biggest first"
        elif got == [i % n for i in range(len(sizes))]:
            hint = "that is round-robin by position; go by size: biggest first, onto the least-loaded rank"
        elif load(got) == load(want):
            hint = ("the loads are right but the ranks differ: break ties the same way on every rank "
                    "(equal sizes: lower index first; equal loads: lowest rank)")
        elif max(load(got)) > max(load(want)):
            hint = (f"rank loads {load(got)} are less balanced than greedy's {load(want)}: visit the "
                    "parameters biggest first and give each to the rank with the smallest load so far")
        else:
            hint = "follow the rule exactly: biggest first (ties by index), onto the least-loaded rank (ties: lowest)"
        failed(what, f"{where} = {got}, expected {want}: {hint}")
    loads = [sum(s for s, o in zip(gpt_sizes, want) if o == r) for r in range(4)]
    passed(what, f"right on {len(cases)} cases; gpt-tiny on 4 ranks: loads {loads} elements "
                 f"(Ψ/4 = {sum(gpt_sizes) / 4:,.0f}; same owners as minifsdp.zero.partition_parameters)")


# -- one process, and the worker that trains with the learner's pieces (or the library's) ----------
@functools.lru_cache(maxsize=4)
def single_process(model_name: str = MODEL, steps: int = STEPS, batch: int = BATCH, seq: int = SEQ) -> dict:
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
    a moment after ``wait()`` returns, so a dropped gradient can outlive ``p.grad = None`` by microseconds."""
    books = tracker.snapshot(label)
    for _ in range(200):
        time.sleep(0.002)
        again = tracker.snapshot(label)
        if again == books:
            return books
        books = again
    return books


def zero_worker(mode: str, fns: dict[str, Callable] | None, model_name: str = MODEL, steps: int = STEPS,
                batch: int = BATCH, seq: int = SEQ, track: bool = True) -> dict:
    """Train on this rank; ``mode``: "zero1" / "zero2" with the learner's ``fns``, or "ddp",
    "lib-zero1", "lib-zero2" with the library. Returns plain data for the checks and plots.

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
    step_fn: Callable[[], None]
    if mode in ("zero1", "zero2"):
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
        owners = [optimizer.param_to_rank[p] for p in params]
        step_fn, owned = optimizer.step, optimizer.local_params
    losses: list[float] = []
    grads0: dict[str, Any] = {}

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
                if step == 0 and mode in ("zero1", "zero2"):   # the gradients held after the first backward,
                    grads0 = {k: p.grad.tolist() for k, p in model.named_parameters()   # as lists: no tensor
                              if p.grad is not None}                                     # that the tracker counts
                step_fn()
                after_step = books("step")
            model.zero_grad(set_to_none=True)
            total = loss.detach().reshape(1).clone()
            if n > 1:
                torch.distributed.all_reduce(total)            # bookkeeping, outside the "step" span
            losses.append(total.item() / n)
    tracker.close()
    consolidated = None
    if mode == "zero1" and "consolidate_state" in fns:
        got = fns["consolidate_state"](params, owners, optimizer)
        consolidated = None if got is None else [
            {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in dict(m).items()}
            if isinstance(m, dict) else m for m in got]
    last = [s for s in tracer.trace.spans if s.name == "step" and s.args.get("step") == steps - 1][0]
    return {"mode": mode, "owners": owners, "losses": losses, "held": held, "grads0": grads0,
            "consolidated": consolidated,
            "parameters": after_backward[PARAMETERS], "gradients": after_backward[GRADIENTS],
            "optimizer": after_step[OPTIMIZER],
            "peak": tracker.peak_total,
            "owned_numel": sum(p.numel() for p in owned), "owned_tensors": len(owned),
            "bytes": {op: b // steps for op, b in tracer.trace.bytes_by_op(within="step").items()},
            "samples": [m for m in tracer.trace.memory if last.start <= m.time <= last.end],
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def model_states_worker(modes: tuple[str, ...], model_name: str, steps: int, batch: int, seq: int) -> dict:
    """``zero_worker`` for each of the library's ``modes`` in turn, in one launch (lab 03, section 4)."""
    return {mode: zero_worker(mode, None, model_name, steps, batch, seq) for mode in modes}


def _compare_with_single(what: str, n: int, res: list[dict], ref: dict, hint_params: str) -> float:
    for r, out in enumerate(res[1:], start=1):
        if not all(torch.equal(out["params"][k], res[0]["params"][k]) for k in out["params"]):
            failed(what, f"{n} ranks: after training, rank {r}'s parameters differ from rank 0's: after the "
                         "step, broadcast every parameter from its owner (src=owners[i]), on every rank, "
                         "in the same order")
    worst = 0.0
    for k, want in ref["params"].items():
        diff = (res[0]["params"][k] - want).abs().max().item()
        worst = max(worst, diff)
        if not diff <= PARAM_TOL:
            failed(what, f"{n} ranks: the ranks agree, but {k} differs from one process by {diff:.1e} "
                         f"(> {PARAM_TOL:g}): {hint_params}")
    loss_diff = max(abs(a - b) for a, b in zip(res[0]["losses"], ref["losses"]))
    if not loss_diff <= LOSS_TOL:
        failed(what, f"{n} ranks: losses {res[0]['losses']} differ from one process's {ref['losses']} "
                     f"by {loss_diff:.1e} (> {LOSS_TOL:g})")
    return worst


def _world_sizes(*wanted: int) -> tuple[int, ...]:
    """The lab's world sizes on this machine: ``dist.lab_world_size`` caps each at the GPUs there are."""
    return tuple(sorted({dist.lab_world_size(w) for w in wanted}))


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


def _library() -> dict[str, Any]:
    from .. import zero
    return {"minifsdp.zero.partition_parameters": zero.partition_parameters, "minifsdp.zero.OSS": zero.OSS,
            "minifsdp.zero.ShardedDataParallel": zero.ShardedDataParallel,
            "minifsdp.zero.wrap_zero": zero.wrap_zero,
            "minifsdp.zero.all_reduce_gradients": zero.all_reduce_gradients}


def _learners_own(what: str, **fns: Callable) -> dict[str, Callable]:
    """``fns``, once none is the blank lab's stub and none is or calls ``minifsdp.zero`` (else a verdict)."""
    blank(what, **fns)
    refuse_library(what, fns, _library())
    return fns


def zero1(greedy_partition: Callable, local_optimizer: Callable, zero1_step: Callable,
          consolidate_state: Callable, world_sizes: tuple[int, ...] | None = None) -> None:
    """ZeRO-1 with the learner's four functions at 1, 2 and 4 ranks, against one process and OSS."""
    what = "ZeRO-1"
    world_sizes = world_sizes or _world_sizes(1, 2, 4)
    fns = _learners_own(what, greedy_partition=greedy_partition, local_optimizer=local_optimizer,
                        zero1_step=zero1_step, consolidate_state=consolidate_state)
    ref = single_process()
    psi_bytes = FP32 * ref["n_params"]
    runs, worst = {}, 0.0
    for n in world_sizes:
        res = run_learner(what, zero_worker, n, "zero1", fns, MODEL, STEPS, BATCH, SEQ, False)
        runs[n] = res
        states = [r["optimizer"] for r in res]
        if n > 1 and all(s == ref["state_bytes"] for s in states):
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
            what, n, res, ref, "the broadcast must come from each parameter's owner (who stepped it), "
                                   "after optimizer.step()"))
        _check_consolidated(what, n, res, ref)
        if n > 1 and res[0]["bytes"].get("broadcast", 0) != psi_bytes:
            failed(what, f"{n} ranks: the broadcasts moved {res[0]['bytes'].get('broadcast', 0):,} B per "
                         f"step, the parameters are {psi_bytes:,} B: broadcast each parameter exactly once per step")
    n = max(world_sizes)
    lib = launch(zero_worker, n, "lib-zero1", None, MODEL, STEPS, BATCH, SEQ, False, timeout=120)
    mine, theirs = max(r["optimizer"] for r in runs[n]), max(r["optimizer"] for r in lib)
    target = estimate.model_state_bytes_per_device(ref["n_params"], n, 1, padding=False)["optimizer"]
    results[what] = {"learner": runs, "library": lib}
    passed(what, f"one process's parameters (max |diff| {worst:.1e} <= {PARAM_TOL:g}) and, consolidated on "
                 f"rank 0, its AdamW moments at "
                 f"{', '.join(map(str, world_sizes))} ranks; largest optimizer state at {n} ranks: yours "
                 f"{mine:,} B, target 8Ψ/N = {target:,.0f} B (+ whole parameters, + 4 B steps), "
                 f"minifsdp.zero.OSS {theirs:,} B")


def zero2(greedy_partition: Callable, local_optimizer: Callable, zero1_step: Callable, install_zero2: Callable,
          world_sizes: tuple[int, ...] | None = None) -> None:
    """ZeRO-2 with the learner's hook: same model as one process, each rank ends backward with
    exactly its owned gradients, 2Ψ moved per step; the library's ZeRO-2 measured beside it."""
    what = "ZeRO-2"
    world_sizes = world_sizes or _world_sizes(2, 4)
    fns = _learners_own(what, greedy_partition=greedy_partition, local_optimizer=local_optimizer,
                        zero1_step=zero1_step, install_zero2=install_zero2)
    ref = single_process()
    psi_bytes = FP32 * ref["n_params"]
    out: dict[str, Any] = {"learner": {}, "library": {}, "n_params": ref["n_params"]}
    for n in world_sizes:
        res = run_learner(what, zero_worker, n, "zero2", fns)
        out["learner"][n] = res
        for r, one in enumerate(res):
            owned = [o == r for o in one["owners"]]
            if one["held"] == [True] * len(owned) and not all(owned):
                failed(what, f"{n} ranks, rank {r}: after backward it still holds every gradient "
                             f"({one['gradients']:,} B): a rank that does not own a parameter drops its gradient "
                             "(p.grad = None) once the reduce has sent it to the owner")
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
                    hint = (f"it is {n} x the average: the reduce SUMS the ranks' gradients; divide by N first"
                            if torch.allclose(g, n * want, atol=n * LOSS_TOL, rtol=PARAM_TOL) else
                            "each owner must end backward with the average over the ranks of its gradients")
                    failed(what, f"{n} ranks, rank {r}: its gradient of {k} after backward differs from one "
                                 f"process's: {hint}")
        moved = res[0]["bytes"]
        if "all_reduce" in moved:
            failed(what, f"{n} ranks: the gradients were all-reduced ({moved['all_reduce']:,} B per step): each "
                         "gradient needs to reach its owner only, a reduce to dst=owner moves half as much")
        _compare_with_single(what, n, res, ref,
                             "each gradient must arrive at its owner as the average over ranks (divide by N "
                             "before reducing to dst=owner)")
        if moved.get("reduce", 0) != psi_bytes:
            failed(what, f"{n} ranks: the reduces moved {moved.get('reduce', 0):,} B per step, the gradients are "
                         f"{psi_bytes:,} B: reduce each gradient exactly once per backward")
        out["library"][n] = launch(zero_worker, n, "lib-zero2", None, timeout=120)
    n = max(world_sizes)
    mine = [r["gradients"] + r["optimizer"] for r in out["learner"][n]]
    lib = [r["gradients"] + r["optimizer"] for r in out["library"][n]]
    f = estimate.model_state_bytes_per_device(ref["n_params"], n, 2, padding=False)
    steps = sum(r["owned_tensors"] for r in out["learner"][n]) * FP32
    passed(what, f"one process's parameters at {', '.join(map(str, world_sizes))} ranks; {n} ranks, gradients + "
                 f"optimizer per rank: yours {', '.join(f'{b:,}' for b in mine)} B (sum {sum(mine):,} = N x formula "
                 f"{n * (f['gradients'] + f['optimizer']):,.0f} + {steps} B of steps), minifsdp.zero "
                 f"{', '.join(f'{b:,}' for b in lib)} B; moved reduce Ψ + broadcast Ψ = "
                 f"{sum(out['learner'][n][0]['bytes'].values()):,} B per step (2Ψ, Ψ = {psi_bytes:,} B)")
    results[what] = out


def predict_model_states(fn: Callable[[int, int, int, int], dict[str, int]], runs: dict[str, dict[int, list]],
                         n_params: int) -> None:
    """The learner's byte-exact prediction against every rank of ``runs[strategy][n]`` (tracker books).

    ``runs`` maps "ddp", "zero1", "zero2" to ``{world size: [per-rank dict with "parameters",
    "gradients", "optimizer", "owned_numel", "owned_tensors"]}``."""
    what = "predict_model_states"
    blank(what, predict_model_states=fn)
    stage_of = {"ddp": 0, "zero1": 1, "zero2": 2}
    cats = ("parameters", "gradients", "optimizer")
    checked = 0
    for strategy, by_n in runs.items():
        stage = stage_of[strategy]
        for n, res in by_n.items():
            for r, out in enumerate(res):
                got = fn(stage, n_params, out["owned_numel"], out["owned_tensors"])
                if not isinstance(got, dict) or not set(cats) <= set(got):
                    failed(what, f"return a dict with the keys {cats}, got {got!r}")
                for cat in cats:
                    g = int(got[cat])
                    if g != out[cat]:
                        failed(what, f"stage {stage} ({strategy}), {n} ranks, rank {r}: you predict {g:,} B of "
                                     f"{cat}, the tracker measured {out[cat]:,} B: "
                                     + _diagnose(cat, g, out, n, n_params))
                checked += 1
    passed(what, f"right to the byte on {checked} ranks of {sum(len(v) for v in runs.values())} runs "
                 "(parameters, gradients and AdamW state)")


def _diagnose(cat: str, got: int, out: dict, n: int, n_params: int) -> str:
    """The likely slip behind a wrong prediction, in words."""
    owned, k, want = out["owned_numel"], out["owned_tensors"], out[cat]
    if got * FP32 == want or (cat == "optimizer" and got == 2 * owned + k):
        return "you counted elements: fp32 is 4 bytes per element"
    per_element = {"parameters": FP32, "gradients": FP32, "optimizer": 2 * FP32}[cat]
    if n > 1 and abs(got - per_element * n_params / n) <= FP32 * k + 1:
        return ("you divided all the parameters by N: a rank owns whole parameters, so count owned_numel "
                "(the shards are not equal)")
    if cat == "parameters" and got == FP32 * owned:
        return "stages 0-2 keep every parameter on every rank (sharding them is ZeRO-3)"
    if cat == "gradients" and got == FP32 * owned:
        return "ZeRO-1 keeps every averaged gradient (it all-reduces); only ZeRO-2 shards them"
    if cat == "gradients" and got == FP32 * n_params:
        return "ZeRO-2 keeps only the gradients of the owned parameters"
    if cat == "optimizer" and got == 2 * FP32 * owned:
        return f"you forgot AdamW's 4-byte step counter, one per owned tensor ({k} here)"
    if cat == "optimizer" and got > want and got - want == 2 * FP32 * (n_params - owned):
        return "from stage 1 on, the optimizer state covers the owned parameters only"
    return ("sharded terms count the owned elements, unsharded ones all n_params; AdamW: 2 x 4 B per element "
            "+ 4 B per tensor")


# -- exercise 2b: one flat broadcast bucket per owner (FairScale OSS's broadcast_buffer_size) ----
def owner_buckets(pack: Callable[[list[torch.Tensor], list[int], int], list[torch.Tensor]],
                  unpack: Callable[[torch.Tensor, list[torch.Tensor], list[int], int], None]) -> None:
    """The learner's ``owner_buckets`` / ``unpack_bucket`` on gpt-tiny's parameters (1, 2, 4 ranks) and on
    a case where some ranks own nothing: layout in parameter order, exactly the owned elements, a round trip
    that writes back in place into the owned tensors only. One process: the layout is pure bookkeeping."""
    what = "owner_buckets"
    _learners_own(what, owner_buckets=pack, unpack_bucket=unpack)
    torch.manual_seed(0)
    gpt = [torch.nn.Parameter(torch.randn(p.shape)) for p in models.build_model(MODEL, device="meta").parameters()]
    small = [torch.nn.Parameter(torch.randn(s)) for s in (5, 2)]
    cases = [(gpt, 1), (gpt, 2), (gpt, 4), (small, 4)]
    for tensors, n in cases:
        owners = _lpt([t.numel() for t in tensors], n)
        where = f"{'gpt-tiny' if tensors is gpt else 'two tensors (5, 2 elements)'} on {n} rank(s)"
        want = [torch.cat([t.detach().reshape(-1) for t, o in zip(tensors, owners) if o == r] or [torch.empty(0)])
                for r in range(n)]
        try:
            got = list(pack(tensors, owners, n))
        except NotImplementedError as e:
            failed(what, f"not written yet (NotImplementedError: {e})")
        except Exception as e:   # noqa: BLE001 - the learner's error, in one line
            failed(what, f"owner_buckets raised on {where}: {type(e).__name__}: {e}")
        if len(got) != n:
            failed(what, f"{where}: owner_buckets returned {len(got)} buckets: return one per rank ({n})")
        for r, (g, w) in enumerate(zip(got, want)):
            if not torch.is_tensor(g) or g.dim() != 1:
                failed(what, f"{where}, rank {r}: a bucket is one 1-D tensor (flatten each tensor, then join them)")
            if g.numel() != w.numel():
                hint = (f"it holds every tensor: a bucket carries only the tensors rank {r} owns"
                        if g.numel() == sum(t.numel() for t in tensors) else
                        f"rank {r} owns {w.numel():,} elements: put exactly the tensors it owns in its bucket")
                failed(what, f"{where}, rank {r}: bucket of {g.numel():,} elements; {hint}")
            if not torch.equal(g, w):
                failed(what, f"{where}, rank {r}: the right number of elements in another layout: join the owned "
                             "tensors in parameter (list) order, each flattened, so every rank reads the same layout")
        for r in range(n):
            restored = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
            try:
                unpack(want[r].clone(), restored, owners, r)
            except NotImplementedError as e:
                failed(what, f"unpack_bucket is not written yet (NotImplementedError: {e})")
            except Exception as e:   # noqa: BLE001
                failed(what, f"unpack_bucket raised on {where}, rank {r}: {type(e).__name__}: {e} (a parameter "
                             "is a leaf that requires grad: copy into its .data, or under torch.no_grad())")
            for i, (t, o, orig) in enumerate(zip(restored, owners, tensors)):
                if o != r and t.detach().abs().sum() != 0:
                    failed(what, f"{where}, unpacking rank {r}'s bucket changed tensor {i}, which rank {o} owns: "
                                 "write only into the owned tensors")
                if o == r and not torch.equal(t.detach(), orig.detach()):
                    hint = ("it is untouched: copy into the tensor itself, in place (rebinding a name leaves the "
                            "model's tensor as it was)" if t.detach().abs().sum() == 0 else
                            "its values are wrong: read the bucket in the same order and at the same offsets "
                            "owner_buckets wrote")
                    failed(what, f"{where}, rank {r}: tensor {i} after unpack_bucket differs from the packed one; "
                                 + hint)
    owners4 = _lpt([t.numel() for t in gpt], 4)
    sizes = [sum(t.numel() for t, o in zip(gpt, owners4) if o == r) for r in range(4)]
    passed(what, f"round trip exact on {len(cases)} layouts; gpt-tiny on 4 ranks: {len(gpt)} broadcasts become 4, "
                 f"buckets of {', '.join(f'{s:,}' for s in sizes)} elements")
