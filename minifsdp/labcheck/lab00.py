"""Checks of lab 00 (collectives): the learner's ring all-gather, reduce-scatter,
all-reduce with its byte count and bus bandwidth, and the timeline they draw of their own ring.

Each check runs the learner's function on 2 and 4 ranks (CPU ranks where the
machine has fewer GPUs: ``launch`` says so in one line) beside ``minifsdp.comm``'s
collective on the same data and says, in one sentence, what differs: the inputs
are chosen so that a wrong value tells where it came from (rank r's all-gather
chunk holds 100 r + k; reduce-scatter element k of rank r is (k + 1) · 10^r, so
the digits of a sum say which ranks were added, and how often).

Whose code ran: the library's collectives (``RING_LIBRARY``) are refused
statically (``refuse_library``: aliases, helpers, module attributes) and at run
time (a ``Wire`` around the learner's code inside every worker); the byte and
bandwidth functions may not reach the library's byte counts (``BYTES_LIBRARY``),
the drawing not ``plot.timeline``. Read ``verdict.py`` first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import comm, dist, estimate, plot, trace
from ..launch import launch
from .verdict import (Hints, Wire, call, failed, figures, passed, refuse_library, require_written, run, uses,
                      watched)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_gather_into_tensor",
               "reduce_scatter_tensor", "reduce")
# The library's implementation of the ring exercises: every collective of minifsdp.comm (the exercise is to
# build them from comm.isend / comm.irecv, which stay allowed).
RING_LIBRARY = tuple(getattr(comm, name) for name in COLLECTIVES)
# What computes the byte counts and bandwidths of exercise 3 for you: comm's per-call counts, the library's
# per-step estimates, or running a real collective (in-process or launched) and reading its recorded bytes.
BYTES_LIBRARY = (comm.collective_bytes, estimate.comm_bytes_per_step, estimate.paper_comm_bytes, launch,
                 *RING_LIBRARY)
DRAW_LIBRARY = (plot.timeline,)
WORLD_SIZES = (2, 4)  # launched as asked: CPU ranks where the machine has fewer GPUs; never 1 (proves nothing)

hint = Hints({
    "my_all_gather": [
        "A ring: in each of n - 1 steps every rank sends one chunk to its right neighbour and receives one "
        "from its left, both at once. After n - 1 steps every chunk has been round the ring.",
        "Make the output (n chunks of x's size) and take its n chunk views: receiving into a view writes into "
        "the output. Your own x goes into chunk r before the first step.",
        "At each step you pass on the chunk you received in the previous step (your own at step 0). The chunk "
        "arriving from the left is the one your left neighbour received a step earlier: one further round.",
        "Start the isend and the irecv, then wait on both: a rank that waits for its send before posting its "
        "receive deadlocks the ring.",
    ],
    "my_reduce_scatter": [
        "The all-gather's ring, but a rank ADDS what arrives into its own copy of that chunk, and passes the "
        "growing partial sum on. Every chunk's sum travels round all n ranks.",
        "Work on a copy of x (the caller's tensor must not change), cut into n chunk views, plus a one-chunk "
        "buffer to receive into. Add the buffer into your chunk only after the irecv's wait().",
        "Chunk r must be the LAST chunk rank r receives, complete: count back n - 1 steps round the ring to "
        "find which chunk a rank sends first.",
        "Rank r sends chunk r - 1 (mod n) first; at every later step it sends the chunk it has just added into.",
    ],
    "my_all_reduce": [
        "Section 2's identity: an all-reduce is a reduce-scatter followed by an all-gather. You wrote both.",
        "Your reduce-scatter needs a multiple of n elements: pad with zeros (they do not change a sum; comm has "
        "a helper for it), and cut the result back to x's length at the end.",
    ],
    "ring_bytes_sent": [
        "Count what one rank sends: how many sends in each half of your all-reduce, and how big is each?",
        "Each half is n - 1 sends of one chunk, S / n bytes; a rank never sends the chunk it keeps.",
    ],
    "bus_bandwidth": [
        "algbw = S / t says how fast your tensor got done. busbw = the bytes ONE rank put on its link per second "
        "with a ring: S / t times the fraction of S a rank sends.",
        "For all_reduce that fraction is ring_bytes_sent(S, n) / S. An all-gather or a reduce-scatter is one "
        "half of the ring all-reduce: what fraction does a rank send there?",
    ],
    "draw_ring_timeline": [
        "One horizontal bar per send span: it starts at the span's start, in ms after t0, is as long as the "
        "span lasted, and sits on the row of its rank (y = rank).",
        "matplotlib's ax.barh draws a horizontal bar from a left edge with a width; span times are seconds.",
        "A rank's first half of sends is the reduce-scatter, the second half the all-gather: colour them apart "
        "(plot.color_for gives the course's colours); label the x axis with its unit.",
    ],
})


def _world_sizes() -> list[int]:
    return list(WORLD_SIZES)


def _refuse_collectives(what: str, *fns: Callable) -> None:
    """Fail when the learner's function reaches a collective of the library instead of sending messages."""
    for fn in fns:
        refuse_library(what, fn, *RING_LIBRARY)
    for fn in fns:
        found = uses(fn, *COLLECTIVES)
        if found:
            failed(what, f"it calls {found[0]}, the library's collective: build it from comm.isend / comm.irecv "
                         "only (that is the exercise)")


def _used_collectives(tracer: trace.Tracer) -> list[str]:
    return sorted({s.name for s in tracer.trace.comm_spans()} & set(COLLECTIVES))


def _sent(tracer: trace.Tracer) -> int:
    return sum(s.args["bytes"] for s in tracer.trace.comm_spans() if s.name == "send")


# ------------------------------------------------------------------ exercise 1: ring all-gather
def _run_all_gather(fn: Callable, numel: int) -> tuple:
    x = torch.arange(numel, dtype=torch.float32, device=dist.device()) + 100 * dist.rank()  # names its rank
    with Wire(*RING_LIBRARY), trace.Tracer() as tracer:  # the learner's part: no library collective may run
        mine = fn(x.clone())
    return (mine.cpu() if isinstance(mine, torch.Tensor) else mine), comm.all_gather(x).cpu(), \
        _used_collectives(tracer), _sent(tracer)


def _all_gather_problem(mine: Any, want: torch.Tensor, rank: int, n: int) -> str | None:
    if not isinstance(mine, torch.Tensor) or mine.shape != want.shape:
        return (f"rank {rank} returned {getattr(mine, 'shape', type(mine).__name__)}, expected shape "
                f"{tuple(want.shape)}: one chunk of x.numel() elements per rank, in rank order")
    got, ref = mine.chunk(n), want.chunk(n)
    for j in range(n):
        if torch.equal(got[j], ref[j]):
            continue
        came_from = [i for i in range(n) if torch.equal(got[j], ref[i])]
        if came_from:
            return (f"rank {rank} holds rank {came_from[0]}'s chunk at position {j}: chunk j must come from "
                    "rank j; the chunk index moves the wrong way round the ring (which chunk do you pass on, "
                    "and which one arrives, at each step?)")
        return (f"rank {rank}: chunk {j} (rank {j}'s data) never arrived: did all n - 1 steps run, and did you "
                "wait() on every irecv before returning?")
    return None


def ring_all_gather(fn: Callable) -> None:
    """``fn(x)`` must return every rank's 1-D ``x`` in rank order, built from isend/irecv only."""
    what = "ring all-gather"
    require_written(what, fn)
    _refuse_collectives(what, fn)
    numel, report = 3, ""
    for n in _world_sizes():
        results = run(what, _run_all_gather, n, fn, numel, timeout=60)
        for r, (mine, want, used, sent) in enumerate(results):
            if used:
                failed(what, f"it called comm.{used[0]}: build it from comm.isend / comm.irecv only")
            problem = _all_gather_problem(mine, want, r, n)
            if problem:
                failed(what, f"at world size {n}, {problem}")
        target = (n - 1) * numel * 4
        if sent != target:
            failed(what, f"at world size {n} rank 0 sent {sent} B with comm.isend; a ring sends each of the other "
                         f"n - 1 chunks once ({target} B): one send per step")
        report = figures(f"{n} ranks, bytes sent per rank", sent, target,
                         comm.collective_bytes("all_gather", n * numel * 4, n)["ring_bytes"], unit="B")
    passed(what, f"equals comm.all_gather at world sizes {_world_sizes()}; {report}")


# ------------------------------------------------------------------ exercise 2: ring reduce-scatter
def _run_reduce_scatter(fn: Callable, numel: int) -> tuple:
    # Element k of rank r is (k + 1) * 10**r: in a sum, the decimal digits say which ranks contributed.
    x = torch.arange(1, numel + 1, dtype=torch.float64, device=dist.device()) * 10 ** dist.rank()
    before = x.clone()
    with Wire(*RING_LIBRARY), trace.Tracer() as tracer:  # the learner's part: no library collective may run
        mine = fn(x)
    return (mine.cpu() if isinstance(mine, torch.Tensor) else mine), comm.reduce_scatter(before).cpu(), \
        _used_collectives(tracer), bool(torch.equal(x, before)), _sent(tracer)


def _contributions(values: torch.Tensor, base: torch.Tensor) -> list[int] | None:
    """Which ranks' data is in ``values``, read from the decimal digits (None if not a clean sum)."""
    ratio = values / base
    if not torch.all(ratio == ratio[0]) or ratio[0] != ratio[0].round() or ratio[0] < 0:
        return None
    return [int(d) for d in reversed(str(int(ratio[0].item())))]  # digit i = times rank i was added


def _reduce_scatter_problem(mine: Any, want: torch.Tensor, rank: int, n: int, numel: int) -> str | None:
    if not isinstance(mine, torch.Tensor) or mine.shape != want.shape:
        return (f"rank {rank} returned {getattr(mine, 'shape', type(mine).__name__)}, expected shape "
                f"{tuple(want.shape)}: this rank's chunk, x.numel() / world_size elements")
    if torch.equal(mine, want):
        return None
    bases = torch.arange(1, numel + 1, dtype=torch.float64).chunk(n)
    for j in [rank] + [j for j in range(n) if j != rank]:
        digits = _contributions(mine, bases[j])
        if digits is None:
            continue
        digits += [0] * (n - len(digits))
        where = f"rank {rank} " + ("" if j == rank else f"holds chunk {j} instead of chunk {rank} (shift the "
                                                          "chunk indices by one step); ")
        if digits == [1] * n:
            return where + "the sum itself is right"
        if digits == [1 if i == rank else 0 for i in range(n)]:
            return where + "has only its own data: nothing was added (n - 1 steps, adding each incoming chunk)"
        missing = [i for i in range(n) if digits[i] == 0]
        twice = [i for i in range(n) if digits[i] > 1]
        problems = []
        if missing:
            problems.append(f"is missing ranks {missing} from the sum"
                            + (" (its own data too: add the incoming chunk into yours, don't overwrite it)"
                               if rank in missing else " (did all n - 1 steps run?)"))
        if twice:
            problems.append(f"counts ranks {twice} more than once (add each incoming chunk once)")
        return where + "; ".join(problems)
    return (f"rank {rank}'s values are not a sum of whole chunks: add what arrived only after waiting on the "
            "irecv, and into the chunk that just arrived")


def ring_reduce_scatter(fn: Callable) -> None:
    """``fn(x)`` must return chunk ``rank`` of the sum over ranks, built from isend/irecv only."""
    what = "ring reduce-scatter"
    require_written(what, fn)
    _refuse_collectives(what, fn)
    numel, report = 8, ""
    for n in _world_sizes():
        results = run(what, _run_reduce_scatter, n, fn, numel, timeout=60)
        for r, (mine, want, used, untouched, _) in enumerate(results):
            if used:
                failed(what, f"it called comm.{used[0]}: build it from comm.isend / comm.irecv only")
            problem = _reduce_scatter_problem(mine, want, r, n, numel)
            if problem:
                failed(what, f"at world size {n}, {problem}")
            if not untouched:
                failed(what, f"rank {r} changed the caller's x: accumulate into a copy of it")
        sent, target = results[0][4], (n - 1) * (numel // n) * 8  # float64 inputs: 8 B per element
        if sent != target:
            failed(what, f"at world size {n} rank 0 sent {sent} B with comm.isend; a ring sends n - 1 chunks of "
                         f"x.numel() / n elements, one per step ({target} B)")
        report = figures(f"{n} ranks, bytes sent per rank", sent, target,
                         comm.collective_bytes("reduce_scatter", numel * 8, n)["ring_bytes"], unit="B")
    passed(what, f"equals comm.reduce_scatter at world sizes {_world_sizes()}, every rank's contribution "
                 f"counted once; {report}")


# ------------------------------------------------------------------ exercise 3: ring all-reduce and its bytes
def _run_all_reduce(fn: Callable, numels: tuple[int, ...]) -> list[tuple]:
    """For each size: (largest difference to comm.all_reduce, bytes the learner's ring sent, collectives used, shape)."""
    out = []
    for numel in numels:
        torch.manual_seed(dist.rank())
        x = torch.randn(numel, device=dist.device())
        with Wire(*RING_LIBRARY), trace.Tracer() as mine_traced:  # the learner's part
            mine = fn(x.clone())
        want = x.clone()
        comm.all_reduce(want)
        sent = sum(s.args["bytes"] for s in mine_traced.trace.comm_spans() if s.name == "send")
        same_shape = isinstance(mine, torch.Tensor) and mine.shape == want.shape
        diff = (mine - want).abs().max().item() if same_shape else float("inf")
        out.append((diff, sent, _used_collectives(mine_traced), getattr(mine, "shape", None)))
    return out


def _bus_problem(bus_fn: Callable) -> str | None:
    """bus_fn(op, S, t, N) against the ring bytes comm records per call, divided by the time."""
    for n in (4, 8, 2):  # 4 first: at 2 ranks the all-gather factor is 1, and algbw = busbw
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            nbytes, seconds = 3 * 2**20, 0.004
            want = comm.collective_bytes(op, nbytes, n)["ring_bytes"] / seconds
            got = float(bus_fn(op, nbytes, seconds, n))
            if abs(got - want) > 1e-6 * want:
                if abs(got - nbytes / seconds) < 1e-6 * want:
                    return f"{op} on {n} ranks: that is algbw = S / t; busbw multiplies it by the ring factor"
                return (f"{op} on {n} ranks, S = {nbytes} B in {seconds} s: {got:.4g} B/s, target {want:.4g} B/s "
                        f"(the ring bytes a rank sends per second): check the factor for {op}")
    return None


def ring_all_reduce(all_reduce_fn: Callable, bytes_fn: Callable, bus_fn: Callable | None = None) -> None:
    """``all_reduce_fn(x)`` sums over ranks (any numel); ``bytes_fn(S, N)`` is what one rank sends;
    ``bus_fn(op, S, t, N)`` the bus bandwidth of a call."""
    what = "ring all-reduce"
    require_written(what, all_reduce_fn, bytes_fn, *([bus_fn] if bus_fn else []))
    _refuse_collectives(what, all_reduce_fn)
    for fn in (bytes_fn, *([bus_fn] if bus_fn else [])):
        refuse_library(what, fn, *BYTES_LIBRARY)
    bytes_fn = watched(bytes_fn, *BYTES_LIBRARY)  # at run time too: the library's counts may not run inside
    bus_fn = watched(bus_fn, *BYTES_LIBRARY) if bus_fn else None
    tolerance = 1e-5  # fp32: the ring adds in another order than gloo
    report = ""
    numels = (3 * 1024, 3 * 1024 + 1)  # divisible by 2, 3, 4; and not
    for n in _world_sizes():
        for r, per_size in enumerate(run(what, _run_all_reduce, n, all_reduce_fn, numels)):
            for numel, (diff, sent_r, used, shape) in zip(numels, per_size):
                where = f"world size {n}, {numel} elements, rank {r}"
                if used:
                    failed(what, f"{where}: it called comm.{used[0]}; use your two ring functions")
                if diff == float("inf"):
                    failed(what, f"{where}: it returned shape {tuple(shape) if shape else shape}, expected "
                                 f"({numel},): cut the padding off again after the all-gather")
                if diff > tolerance:
                    failed(what, f"{where}: differs from comm.all_reduce by {diff:.3g}: reduce-scatter first, then "
                                 "all-gather what it returned")
            if r == 0:
                sent = per_size[0][1]
        numel = numels[0]
        formula = int(call(what, bytes_fn, numel * 4, n))
        if formula == 2 * numel * 4:
            failed(what, f"ring_bytes_sent returned 2S ({formula} B), the all-reduce volume; a rank never sends "
                         "the chunk it keeps: (n - 1) / n of that")
        if formula != sent:
            failed(what, f"ring_bytes_sent({numel * 4}, {n}) says {formula} B but your ring sent {sent} B: count "
                         "n - 1 chunks of S / n bytes in each of the two halves")
        report = figures(f"{n} ranks, S = {numel * 4} B, bytes sent per rank", sent, formula,
                         comm.collective_bytes("all_reduce", numel * 4, n)["ring_bytes"], unit="B")
    if bus_fn is not None:
        problem = call(what, _bus_problem, bus_fn)
        if problem:
            failed(what, f"bus_bandwidth: {problem}")
        report += "; bus_bandwidth = ring bytes / time for the three collectives"
    passed(what, f"equals comm.all_reduce within {tolerance:g}, padded sizes too; {report} (yours measured, "
                 "target your formula, library comm's ring_bytes)")


# ------------------------------------------------------------------ exercise 4: draw your ring
def _traced_ring(all_reduce_fn: Callable, numel: int) -> trace.Trace:
    x = torch.randn(numel, device=dist.device())
    with Wire(*RING_LIBRARY):
        all_reduce_fn(x.clone())  # warm-up: first calls are slow
    comm.barrier()
    with Wire(*RING_LIBRARY), trace.Tracer() as tracer:
        all_reduce_fn(x)
    return tracer.trace


def _bars(ax: Any) -> list[tuple[float, float, float]]:
    """(left, width, y centre) of every bar on ``ax``: barh rectangles and broken_barh collections."""
    from matplotlib.patches import Rectangle

    bars = [(p.get_x(), p.get_width(), p.get_y() + p.get_height() / 2) for p in ax.patches
            if isinstance(p, Rectangle) and p.get_width() > 0]
    for coll in ax.collections:
        for path in coll.get_paths():
            xs, ys = path.vertices[:, 0], path.vertices[:, 1]
            if len(xs) >= 4:
                bars.append((float(xs.min()), float(xs.max() - xs.min()), float((ys.min() + ys.max()) / 2)))
    return bars


def ring_timeline(draw_fn: Callable, all_reduce_fn: Callable) -> plot.Figure:
    """``draw_fn(traces, ax)`` draws one bar per send of the learner's ring: x in ms, one row per rank.

    Returns a figure with the learner's drawing above ``plot.timeline`` of the same traces.
    """
    what = "your ring's timeline"
    require_written(what, draw_fn, all_reduce_fn)
    refuse_library(what, draw_fn, *DRAW_LIBRARY)
    _refuse_collectives(what, all_reduce_fn)
    n = WORLD_SIZES[-1]
    traces = run(what, _traced_ring, n, all_reduce_fn, 64 * 1024)
    fig, (mine_ax, lib_ax) = plot.column_figure(nrows=2, height=5.2)
    call(what, watched(draw_fn, *DRAW_LIBRARY), traces, mine_ax)
    sends = [(tr.rank, s) for tr in traces for s in tr.comm_spans() if s.name == "send"]
    if not sends:
        failed(what, "the tracer recorded no send of your all-reduce: it must be your ring, built from comm.isend")
    t0 = min(s.start for _, s in sends)
    bars = _bars(mine_ax)
    if len(bars) != len(sends):
        failed(what, f"{len(bars)} bars drawn, the tracer recorded {len(sends)} sends ({n} ranks x 2(n - 1) "
                     "steps): one bar per send span of every rank")
    for rank, s in sends:
        start, width = (s.start - t0) * 1e3, s.duration * 1e3
        near = [b for b in bars if abs(b[0] - start) <= 1e-6 + 1e-3 * abs(start) and abs(b[1] - width) <= 1e-6 + 1e-3 * width]
        if not near:
            scaled = [b for b in bars if abs(b[1] * 1e3 - width) <= 1e-3 * width + 1e-6]
            if scaled:
                failed(what, "your bars are 1000x too short: the x axis is in milliseconds (span times are seconds)")
            absolute = [b for b in bars if abs(b[0] - s.start * 1e3) <= 1e-3 * abs(s.start * 1e3)]
            if absolute:
                failed(what, "the bars start at the raw clock reading: measure time from t0, the first send")
            failed(what, f"no bar for rank {rank}'s send at {start:.3f} ms lasting {width:.3f} ms: each bar starts "
                         "at its span's start (ms after t0) and is as long as the span")
        if not any(abs(b[2] - rank) < 0.5 for b in near):
            failed(what, f"rank {rank}'s send at {start:.3f} ms is not on row {rank}: one row per rank, at y = rank")
    if "ms" not in mine_ax.get_xlabel():
        failed(what, "label the x axis with its unit (milliseconds)")
    plot.timeline(traces, ax=lib_ax, title="the same run drawn by minifsdp.plot.timeline")
    slowest = max(sum(s.duration for s in tr.comm_spans() if s.name == "send") for tr in traces)
    passed(what, f"{len(bars)} bars = the tracer's {len(sends)} sends on {n} rows; your ring took "
                 f"{max(s.end for _, s in sends) * 1e3 - t0 * 1e3:.2f} ms, the busiest rank sent for "
                 f"{slowest * 1e3:.2f} ms of it")
    return fig
