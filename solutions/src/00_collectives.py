# Lab 00 source (jupytext percent format). Build: python tools/make_labs.py
# Writes solutions/00_collectives.ipynb and labs/00_collectives.ipynb.

# %% [markdown]
# # 00 — Collectives: how ranks talk to each other
#
# Every technique in this course is single-device PyTorch glued together by
# **collectives**: calls all processes of a group make together to move or combine tensors.
#
# **You will be able to**: launch ranks from a cell; say what `all_reduce`,
# `all_gather`, `reduce_scatter` and `broadcast` leave on each rank; **build** a ring
# all-gather, reduce-scatter and all-reduce from messages and count their bytes; draw
# your ring's timeline; read a bandwidth curve.
#
# **Prerequisites**: none (PyTorch tensors). **Time**: about 60 minutes of work; the
# cells compute for about 1 minute on a laptop or a GPU VM. Lessons use 2 and 4
# ranks: with fewer GPUs, `launch` runs CPU ranks and says so.
#
# **Exercises**: 1. ring all-gather · 2. ring reduce-scatter · 3. ring all-reduce,
# its bytes, bus bandwidth · 4. your ring's timeline.
#
# N = world size (ranks); S = bytes of one tensor.

# %%
import os
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.distributed.constants import default_pg_timeout

from minifsdp import LaunchTimeout, WorkerError, comm, dist, launch, plot, trace
from minifsdp.labcheck import lab00 as check

N2, N4 = 2, 4  # the lessons' world sizes; with fewer GPUs than ranks, launch runs CPU ranks (and says so)
print(f"torch {torch.__version__}, {os.cpu_count()} CPU core(s), CUDA available: {torch.cuda.is_available()}")

# %% [markdown]
# ## 1. Ranks, and launching from a cell
#
# A distributed job is *N copies of the same program*, each in its own process.
# Each copy is a **rank**, numbered `0 … N-1`; `N` is the **world size**. They
# find each other once (the *rendezvous*), forming a **process group**; from then
# on they can call collectives.
#
# `launch(fn, world_size, *args, timeout=...)` does that for a function defined in
# a cell: it starts `world_size` processes, initialises `torch.distributed` in each,
# runs `fn(*args)`, and returns the return values, indexed by rank. Inside `fn`,
# `minifsdp.dist` answers "who am I?":
#
# | call | meaning |
# |---|---|
# | `dist.rank()` | this process's number, `0 … world_size-1` |
# | `dist.world_size()` | how many ranks there are |
# | `dist.device()` | where this rank computes: `cuda:LOCAL_RANK` on GPUs, else `cpu` |
# | `dist.backend()` | the library that moves the bytes: `nccl` between GPUs, `gloo` on CPU |

# %%
# NBVAL_CHECK_OUTPUT
def who_am_i():
    return {"rank": dist.rank(), "world_size": dist.world_size(), "device": str(dist.device()),
            "backend": dist.backend(), "pid": os.getpid()}


results = launch(who_am_i, N4, timeout=60)
for res in results:
    print(f"rank {res['rank']} of {res['world_size']}: device={res['device']}, backend={res['backend']}")
print(f"{N4} different processes:", len({res["pid"] for res in results}) == N4)
print("and this notebook is none of them:", os.getpid() not in {res["pid"] for res in results},
      f"(here dist.rank()={dist.rank()}, dist.world_size()={dist.world_size()})")

# %% [markdown]
# Why return values instead of printing? Every rank writes to the same
# output, so the lines of several ranks **interleave in a random order**.
# Return what you want to look at and print it here, in rank order.
#
# ### When a rank fails
#
# If one rank raises, its peers are usually stuck in a collective, waiting
# for a message that never comes. `launch` collects every rank's outcome,
# re-raises the **root cause** as a `WorkerError` — one short message: the error
# once, which ranks raised it, and the line of *your* code — instead of the
# peers' "connection reset by peer", and stops the other ranks. Each rank's full
# traceback is one attribute away: `err.tracebacks[rank]`.

# %%
# NBVAL_CHECK_OUTPUT
def fails_on_last_rank():
    x = torch.ones(3, device=dist.device())
    if dist.rank() == dist.world_size() - 1:
        raise ValueError("the last rank found a corrupt batch")
    comm.all_reduce(x)  # the other ranks wait here for the last one, which never arrives
    return x


try:
    launch(fails_on_last_rank, N2, timeout=30)
except WorkerError as err:
    print(err)
    print("failed ranks:", err.ranks)
    print("the original exception:", repr(err.__cause__))
    last = err.ranks[-1]  # the failing rank (the last one here): its full traceback is err.tracebacks[last]
    print(f"last line of rank {last}'s full traceback:", err.tracebacks[last].strip().splitlines()[-1])

# %% [markdown]
# A *hang* is worse than an error: a rank waiting for a message nobody sends
# waits for the process group's timeout (PyTorch's default is printed below).
# `launch` gives the whole run a deadline (`timeout=` seconds, the same for the
# process group) and, when it passes, says which ranks were still running and
# *where* they were (`LaunchTimeout`); sometimes gloo, inside a waiting rank,
# notices the same deadline a moment earlier and the run ends with a
# `WorkerError` that says "Timed out". Here rank 0 waits for a message rank 1
# never sends:

# %%
def waits_for_a_message_never_sent():
    if dist.rank() == 0:
        inbox = torch.zeros(1, device=dist.device())
        comm.recv(inbox, src=dist.world_size() - 1)  # rank 1 never calls send: this blocks forever
    return dist.rank()


print(f"PyTorch's default process-group timeout: {default_pg_timeout} (h:mm:ss)")
start = time.perf_counter()
try:
    launch(waits_for_a_message_never_sent, N2, timeout=3)
except LaunchTimeout as err:  # launch's deadline passed: it says who was still running, and where
    print(f"LaunchTimeout after {time.perf_counter() - start:.1f} s; ranks still running: {err.running}")
    print(str(err).split("\n", 1)[1])  # where each rank was (most recent call first)
except WorkerError as err:  # the same deadline, noticed first by gloo inside a waiting rank
    print(f"WorkerError after {time.perf_counter() - start:.1f} s: {str(err).splitlines()[0]}")

# %% [markdown]
# ## 2. The four collectives
#
# A collective is called by **every rank of the group**, each with a tensor
# of the **same shape**. The pictures below show who holds what before and
# after, on 4 ranks. Each rank's tensor is cut into 4 **chunks**; rank *r*'s
# chunk *c* holds the number `10r + c + 1`, so the tens digit tells you which
# rank a value came from. The real runs below use the same numbers.
#
# ### all_reduce: everyone gets the sum
#
# The workhorse of data parallelism: each rank computed gradients on its own
# part of the batch, and `all_reduce` leaves every rank with their sum.

# %%
# FIGURE
plot.collective_diagram("all_reduce", 4)

# %%
# NBVAL_CHECK_OUTPUT
def chunks_of_rank(n):
    """Rank r's tensor: n chunks of one element each, chunk c holds 10r + c + 1."""
    return torch.arange(n, dtype=torch.float32, device=dist.device()) + 10 * dist.rank() + 1


def run_all_reduce():
    x = chunks_of_rank(dist.world_size())
    before = x.clone()
    comm.all_reduce(x)  # in place: x becomes the sum over ranks
    return before.cpu(), x.cpu()  # plain CPU tensors travel back to the notebook


def show(results):
    """Print what every rank held before and after (values are small integers)."""
    for r, (before, after) in enumerate(results):
        print(f"rank {r}: {before.int().tolist()!s:<20} -> {after.int().tolist()}")


show(launch(run_all_reduce, N4, timeout=60))

# %% [markdown]
# Takeaway: every rank ends with the same sums (64 = 1 + 11 + 21 + 31).
#
# ### all_gather: everyone gets everyone's chunk, in rank order
#
# FSDP keeps only a *shard* (1/N) of each parameter on each rank, and
# all-gathers the full parameter just before a layer needs it.

# %%
# FIGURE
plot.collective_diagram("all_gather", 4)

# %%
# NBVAL_CHECK_OUTPUT
def run_all_gather():
    r = dist.rank()
    shard = chunks_of_rank(dist.world_size())[r:r + 1]  # rank r holds only its chunk r
    return shard.cpu(), comm.all_gather(shard).cpu()    # a new tensor, world_size times longer


show(launch(run_all_gather, N4, timeout=60))

# %% [markdown]
# Takeaway: every rank ends with the same N chunks, chunk i from rank i.
#
# ### reduce_scatter: sum, then rank *i* keeps chunk *i*
#
# The mirror image of all_gather. ZeRO-2 and FSDP use it for gradients: each
# rank only updates its own shard of the parameters, so it only needs the
# summed gradient *of that shard*.

# %%
# FIGURE
plot.collective_diagram("reduce_scatter", 4)

# %%
# NBVAL_CHECK_OUTPUT
def run_reduce_scatter():
    x = chunks_of_rank(dist.world_size())
    return x.cpu(), comm.reduce_scatter(x).cpu()  # a new tensor, world_size times shorter


show(launch(run_reduce_scatter, N4, timeout=60))

# %% [markdown]
# Takeaway: each rank ends with one summed chunk, its own: rank i holds the sum of chunk i.
#
# ### broadcast: everyone gets one rank's tensor
#
# DDP and FSDP broadcast rank 0's initial weights, so that every replica
# starts from the same model. Here the source is the last rank (rank 3 of 4 in the drawing).

# %%
# FIGURE
plot.collective_diagram("broadcast", 4, src=3)

# %%
# NBVAL_CHECK_OUTPUT
def run_broadcast(src):
    x = chunks_of_rank(dist.world_size())
    before = x.clone()
    comm.broadcast(x, src=src)  # in place
    return before.cpu(), x.cpu()


show(launch(run_broadcast, N4, N4 - 1, timeout=60))

# %% [markdown]
# Takeaway: every rank ends with the source rank's tensor (here rank 3's: 31 … 34).

# %% [markdown]
# ### all_reduce = reduce_scatter + all_gather
#
# Look at the pictures again: reduce-scatter leaves each rank with one summed
# chunk; all-gathering those chunks gives every rank every summed chunk —
# exactly all-reduce's result. This identity is the whole trick of ZeRO and
# FSDP: split the all-reduce in two, and do useful work (the optimizer step
# on your shard only) *in between*, on 1/N of the data. It also costs the
# same: the tracer records, for each call, `ring_bytes`, what one rank sends
# with a ring algorithm (we derive it in section 3).
#
# Below, each rank draws random numbers, reduces them both ways, and returns
# the largest difference and the bytes the tracer saw. (The two ways add the
# same numbers in a different order, so float results may differ in the last
# bit: we compare within a tolerance.)

# %%
# NBVAL_CHECK_OUTPUT
def both_ways(numel):
    torch.manual_seed(dist.rank())
    x = torch.randn(numel, device=dist.device())
    with trace.Tracer() as tracer:
        summed = x.clone()
        comm.all_reduce(summed)
        split = comm.all_gather(comm.reduce_scatter(x))
    ring = {s.name: s.args["ring_bytes"] for s in tracer.trace.comm_spans()}
    return (summed - split).abs().max().item(), ring


TOLERANCE = 1e-5  # fp32 sums of 4 standard normals: order-dependent rounding is ~1e-7
for n in (N2, N4):
    results = launch(both_ways, n, 1024, timeout=60)
    worst = max(diff for diff, _ in results)
    assert worst < TOLERANCE, f"all_reduce and reduce_scatter+all_gather differ by {worst}"
    ring = results[0][1]
    print(f"{n} ranks, a 4 KiB tensor: equal within {TOLERANCE:g} on every rank; bytes sent per rank: "
          f"all_reduce {ring['all_reduce']}, reduce_scatter {ring['reduce_scatter']} "
          f"+ all_gather {ring['all_gather']} = {ring['reduce_scatter'] + ring['all_gather']}")

# %% [markdown]
# ## 3. Exercise: build collectives out of messages
#
# Collectives are built from **point-to-point** messages: `comm.isend(t, dst)`
# starts sending tensor `t` to rank `dst`, `comm.irecv(t, src)` starts receiving
# into `t` from rank `src`; each returns a handle whose `.wait()` blocks until that
# transfer is done.
#
# The classic algorithm is the **ring**: rank *r* only ever sends to its right
# neighbour `(r + 1) % N` and receives from its left neighbour `(r - 1) % N`. The
# tensor is cut into N chunks; in each of N - 1 steps every rank sends one chunk
# and receives one, at the same time, so every link is always busy. Start
# the send *and* the receive before waiting on either: if every rank first waited
# for its send, nobody would be receiving (a deadlock).
#
# Stuck on an exercise? `check.hint("my_all_gather")` prints its next hint (the idea
# first, then the layout; never the code).

# %% [markdown]
# ### Exercise 1: `my_all_gather`
#
# **Goal**: every rank returns every rank's `x`, concatenated in rank order (what
# `comm.all_gather` returns), built from `comm.isend` / `comm.irecv` only. Rank *r*
# starts with its own chunk; in a ring, each rank passes on to the right what it
# received in the previous step, so after N - 1 steps every chunk has reached every
# rank.
#
# **Target**: each rank sends N - 1 chunks of `x`'s size, one per step, and nothing
# else. The check runs your function on 2 and 4 ranks beside `comm.all_gather`,
# counts the bytes your sends recorded, and says which chunk went where if one is
# misplaced. (Zero-padding `x` and calling `all_reduce` gives the right values at
# twice the bytes: the check refuses the library's collectives.)

# %%
def my_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D ``x`` concatenated in rank order (n * x.numel() elements), built from isend / irecv."""
    n, r = dist.world_size(), dist.rank()
    # BEGIN SOLUTION
    # HINT: n - 1 ring steps: isend right, irecv from the left. More: check.hint('my_all_gather')
    out = x.new_empty(n * x.numel())
    chunks = out.chunk(n)  # views into out, one per rank
    chunks[r].copy_(x)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        sending = comm.isend(chunks[(r - step) % n], right)
        receiving = comm.irecv(chunks[(r - step - 1) % n], left)
        sending.wait()
        receiving.wait()
    # END SOLUTION
    return out


# %%
# CHECK: my_all_gather gives comm.all_gather's result on every rank, at world sizes 2 and 4
check.ring_all_gather(my_all_gather)

# %% [markdown]
# ### Exercise 2: `my_reduce_scatter`
#
# **Goal**: rank *r* returns chunk *r* of the sum over all ranks of `x` (what
# `comm.reduce_scatter` returns), built from `comm.isend` / `comm.irecv` only,
# leaving the caller's `x` unchanged. The same ring, but instead of *copying* what
# arrives, a rank **adds** it into its own copy of that chunk and passes the growing
# partial sum on. Each chunk's sum must visit every rank and arrive, complete, at its
# owner in the last step: which chunk must a rank send first for that to happen?
#
# **Target**: N - 1 sends of S / N bytes per rank. The check's inputs are chosen so
# that the digits of a sum tell which ranks were added: it says which chunk ended
# on the wrong rank, or whose contribution is missing or counted twice.

# %%
def my_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """Chunk ``rank`` (x.numel() / n elements) of the sum over ranks of the 1-D ``x``, built from isend / irecv."""
    n, r = dist.world_size(), dist.rank()
    if x.numel() % n:
        raise ValueError(f"my_reduce_scatter: x has {x.numel()} elements, not a multiple of the "
                         f"world size {n}; pad it first (comm.pad_to_multiple)")
    # BEGIN SOLUTION
    # HINT: the ring again, adding what arrives; end with chunk r. More: check.hint('my_reduce_scatter')
    acc = x.clone()        # our running partial sums; we must not modify the caller's tensor
    chunks = acc.chunk(n)  # views into acc
    incoming = torch.empty_like(chunks[0])
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        sending = comm.isend(chunks[(r - step - 1) % n], right)
        receiving = comm.irecv(incoming, left)
        sending.wait()
        receiving.wait()
        chunks[(r - step - 2) % n].add_(incoming)
    # END SOLUTION
    return chunks[r].clone()


# %%
# CHECK: my_reduce_scatter gives comm.reduce_scatter's result on every rank, at world sizes 2 and 4
check.ring_reduce_scatter(my_reduce_scatter)

# %% [markdown]
# ### Exercise 3: a ring all-reduce, what it sends, and bus bandwidth
#
# * `my_all_reduce(x)`: the sum over ranks of a 1-D `x` of **any** length, on every
#   rank, from your two ring functions (section 2's identity). Zeros do not change a
#   sum. Target: equal to `comm.all_reduce` within 1e-5.
# * `ring_bytes_sent(S, N)`: the bytes one rank sends in your ring all-reduce of an
#   S-byte tensor. Target: the bytes the tracer records for your ring's sends.
# * `bus_bandwidth(op, S, t, N)`: nccl-tests' **bus bandwidth** of one call of `op`
#   (`"all_reduce"`; `"all_gather"`, S its output; `"reduce_scatter"`, S its input)
#   that took `t` seconds: the bytes one rank puts on its link per second with a
#   ring. The *algorithm bandwidth* S / t says how fast your tensor got done; bus
#   bandwidth compares across collectives, world sizes and the hardware's link speed.
#   Target: the library's ring bytes per second, for all three collectives.

# %%
def my_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of the 1-D ``x`` (any number of elements), on every rank."""
    # BEGIN SOLUTION
    # HINT: your two ring functions, in the right order. More: check.hint('my_all_reduce')
    padded = comm.pad_to_multiple(x, dist.world_size())
    summed = my_all_gather(my_reduce_scatter(padded))
    return summed[:x.numel()]
    # END SOLUTION


def ring_bytes_sent(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` tensor over ``world_size`` ranks."""
    # BEGIN SOLUTION
    # HINT: count one rank's sends and their size. More: check.hint('ring_bytes_sent')
    return 2 * (world_size - 1) * nbytes // world_size
    # END SOLUTION


def bus_bandwidth(op: str, nbytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth (bytes/s) of one call of ``op`` on a tensor of ``nbytes`` that took ``seconds``."""
    # BEGIN SOLUTION
    # HINT: S / t, scaled by the share of S one rank sends. More: check.hint('bus_bandwidth')
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}[op]
    algbw = nbytes / seconds
    return algbw * factor
    # END SOLUTION


# %%
# CHECK: my_all_reduce sums like comm.all_reduce (padded sizes too); ring_bytes_sent and bus_bandwidth count right
check.ring_all_reduce(my_all_reduce, ring_bytes_sent, bus_bandwidth)

# %% [markdown]
# Notice: the bytes a rank sends, `2(N-1)/N · S`, *barely depend on N*: just
# under `2S` however many ranks there are. That is why ring all-reduce scales:
# adding ranks adds steps, not bytes per link.
#
# How does your ring compare with the library's all-reduce (gloo's C++ code,
# or NCCL's on GPUs)? Same bytes, but yours pays Python overhead and waits at
# each of its 2(N-1) steps. Timed on 4 ranks, median of a few calls:

# %%
def time_my_ring_and_library(numel, repeats):
    def synchronize():  # CUDA runs asynchronously: wait for it before reading the clock
        if dist.device().type == "cuda":
            torch.cuda.synchronize()

    x = torch.randn(numel, device=dist.device())
    seconds = {"my_all_reduce": [], "comm.all_reduce": []}
    for rep in range(repeats + 1):  # rep 0 warms up
        for name in seconds:
            comm.barrier()
            start = time.perf_counter()
            if name == "my_all_reduce":
                my_all_reduce(x)
            else:
                comm.all_reduce(x.clone())
            synchronize()
            if rep:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in seconds.items()}


for numel in (1024, 256 * 1024):  # 4 KiB and 1 MiB of fp32
    timed = launch(time_my_ring_and_library, N4, numel, 5, timeout=60)
    mine, library = (max(t[name] for t in timed) for name in ("my_all_reduce", "comm.all_reduce"))
    print(f"{plot.human_bytes(numel * 4):>8}, {N4} ranks: my_all_reduce {mine * 1e3:6.2f} ms, "
          f"comm.all_reduce {library * 1e3:6.2f} ms ({mine / library:.1f}x)")

# %% [markdown]
# ### Exercise 4: draw your ring
#
# The tracer recorded every `send` of your ring as a span (`name`, `start` and `end`
# in seconds from `time.perf_counter`, `args["bytes"]`). **Goal**: draw them, one
# row per rank (y = rank), one horizontal bar per send from its start to its end, in
# **milliseconds after `t0`**, the first send of any rank; colour the reduce-scatter
# half of a rank's sends apart from the all-gather half, label the x axis with its
# unit and name the rows.
#
# **Target**: one bar per send span, at the tracer's times. The check runs your
# `my_all_reduce` on 4 ranks, calls your function with the four traces and an empty
# `ax`, compares each bar with the spans, and draws the library's `plot.timeline` of
# the same run under yours.

# %%
def draw_ring_timeline(traces: list, ax) -> None:
    """One row per rank (y = rank), one bar per send span: x in ms after t0, reduce-scatter vs all-gather coloured."""
    sends = {tr.rank: [s for s in tr.comm_spans() if s.name == "send"] for tr in traces}
    t0 = min(s.start for spans in sends.values() for s in spans)
    # BEGIN SOLUTION
    # HINT: a bar per send, in ms after t0, on its rank's row. More: check.hint('draw_ring_timeline')
    for rank, spans in sends.items():
        half = len(spans) // 2
        for i, s in enumerate(spans):
            phase = "reduce_scatter" if i < half else "all_gather"
            ax.barh(rank, (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3, height=0.6,
                    color=plot.color_for(phase), edgecolor="k", linewidth=0.5,
                    label=phase if rank == 0 and i in (0, half) else None)
            ax.text((s.start - t0) * 1e3, rank + 0.35, f"{i}", fontsize=7, va="bottom")
    ax.set_yticks(list(sends), [f"rank {r}" for r in sends])
    ax.invert_yaxis()
    ax.set_xlabel("time after the first send (ms)")
    ax.set_title("my ring all-reduce: one bar per send (number = step)")
    ax.legend(fontsize=8, loc="lower right")
    # END SOLUTION


# %%
# CHECK: one bar per send of your ring, at the tracer's times, one row per rank; the library's drawing below
# FIGURE
check.ring_timeline(draw_ring_timeline, my_all_reduce)

# %% [markdown]
# Takeaway: every step of the ring waits for its slowest link — a send can only
# start once the previous step's receive has arrived — so the ring is as fast as
# its slowest rank, 2(N-1) times over.

# %% [markdown]
# ## 4. What a collective costs
#
# A simple model (α-β, or *latency-bandwidth*): a call that moves S bytes takes
#
# $$ t(S) \approx \alpha + S / B $$
#
# with α a fixed latency per call (software, synchronisation, the first byte's
# trip) and B a bandwidth in bytes per second. Small messages are
# **latency-bound** (t barely changes with S), large ones **bandwidth-bound** (t
# grows with S).
#
# nccl-tests reports two bandwidths, and so do we: the **algorithm bandwidth**
# `algbw = S / t` (S the full tensor: the all-reduce buffer, the all-gather output,
# the reduce-scatter input), which changes with the collective and with N even on
# the same wires, and your **bus bandwidth** from exercise 3, the bytes one rank
# puts on its link per second, which does not.

# %% [markdown]
# The cell below times the three collectives from 4 KiB to 16 MiB on 2 and 4 ranks,
# from the tracer's comm spans. A barrier lines the ranks up before each timed call,
# so that we time the collective and not the wait for a late rank; a call's time is
# the slowest rank's, and we keep the median over repeats. On a VM with fewer GPUs
# than ranks, the larger world runs CPU ranks: the cell prints each world's backend.

# %%
SIZES = [4 * 1024 * 4 ** k for k in range(7)]  # 4 KiB ... 16 MiB, bytes of fp32
OPS = ("all_reduce", "all_gather", "reduce_scatter")
REPEATS = 5


def time_collectives(sizes, repeats):
    """This rank's backend, and the trace of ``repeats`` timed calls of each collective at each size."""
    n = dist.world_size()
    tracer = trace.Tracer()
    for nbytes in sizes:
        full = torch.ones(nbytes // 4, device=dist.device())
        shard = torch.ones(nbytes // 4 // n, device=dist.device())
        for rep in range(repeats + 1):  # rep 0 is a warm-up (buffers, connections), not recorded
            for op in OPS:
                comm.barrier()
                with (tracer if rep else trace.Tracer()):
                    if op == "all_reduce":
                        comm.all_reduce(full)
                    elif op == "all_gather":
                        comm.all_gather_into_tensor(full, shard)
                    else:
                        comm.reduce_scatter_tensor(shard, full)
    return dist.backend(), tracer.trace


WORLDS = (N2, N4)
rows = []  # one per timed call: op, world size, S, ring bytes, seconds (slowest rank)
for n in WORLDS:
    backend, traces = zip(*launch(time_collectives, n, SIZES, REPEATS, timeout=120))
    print(f"{n} ranks: {backend[0]}")
    calls = [[s for s in tr.comm_spans() if s.name in OPS] for tr in traces]
    for same_call in zip(*calls):  # the i-th call of every rank
        s = same_call[0]
        rows.append({"op": s.name, "world_size": n, "bytes": s.args["numel"] * 4,
                     "ring_bytes": s.args["ring_bytes"], "seconds": max(c.duration for c in same_call)})
print(f"{len(rows)} timed calls")

# %%
# FIGURE
plot.bandwidth(rows, title="time per call vs tensor size S (dotted: constant algbw = S / t)",
               xlabel="tensor size S (bytes)")

# %% [markdown]
# Takeaway: below some size a call costs the same whatever S (latency-bound); above it, time grows with S
# (bandwidth-bound).

# %%
def median_row(op, n, nbytes):
    times = [r["seconds"] for r in rows if (r["op"], r["world_size"], r["bytes"]) == (op, n, nbytes)]
    ring = next(r["ring_bytes"] for r in rows if (r["op"], r["world_size"], r["bytes"]) == (op, n, nbytes))
    return statistics.median(times), ring


print(f"{'collective':<15}{'ranks':>6}{'S':>10}{'time':>11}{'algbw':>12}{'busbw':>12}")
for op in OPS:
    for n in WORLDS:
        for nbytes in (SIZES[0], SIZES[-1]):
            t, ring = median_row(op, n, nbytes)
            print(f"{op:<15}{n:>6}{plot.human_bytes(nbytes):>10}{t * 1e3:>9.2f} ms"
                  f"{nbytes / t / 1e9:>8.3f} GB/s{bus_bandwidth(op, nbytes, t, n) / 1e9:>8.3f} GB/s")

# %% [markdown]
# The same medians as bus bandwidth: with the ring factor taken out, the three
# collectives can be compared with each other and across world sizes.

# %%
# FIGURE
fig, ax = plt.subplots(figsize=(8, 4))
for op in OPS:
    for n, style in zip(WORLDS, ("-o", "--s")):
        medians = [median_row(op, n, nbytes) for nbytes in SIZES]
        ax.plot(SIZES, [bus_bandwidth(op, nbytes, t, n) / 1e9 for nbytes, (t, _) in zip(SIZES, medians)], style,
                color=plot.color_for(op),
                label=f"{op}, {n} ranks")
ax.set(xscale="log", yscale="log", xlabel="tensor size S (bytes)", ylabel="bus bandwidth (GB/s)",
       title="busbw = ring bytes sent per rank / time (median)")
ax.set_xticks(SIZES, [plot.human_bytes(nbytes) for nbytes in SIZES])
ax.minorticks_off()
ax.grid(alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Takeaway: with the ring factor taken out, the collectives and world sizes fall near
# one curve (the link's bandwidth) once messages are large.
#
# How to read the curves:
#
# * On the time plot, a line parallel to the dotted diagonals is bandwidth-bound, a
#   flat one latency-bound. Where does each curve bend? On the bus-bandwidth plot the
#   same bend is where the curves level off.
# * On a laptop the "network" is gloo's TCP over loopback, and the ranks share the
#   CPU cores: with more ranks than cores, ranks wait for a core and small messages
#   get slower.
# * On GPUs with NVLink, nccl-tests reports bus bandwidths close to the link speed
#   for large messages: the number to compare with the hardware's spec.
# * FSDP all-gathers one layer's parameters at a time: where on this curve is that,
#   for a small model? This is why FSDP groups parameters into *flat* buffers.

# %% [markdown]
# ### Optional deep dive: fitting the α-β model
#
# Fitting t = α + S/B to the all-reduce points (least squares on the measured
# medians, S the ring bytes a rank sends, weighted by 1/t so that small messages
# count as much as large ones) gives this machine's latency per call and bus
# bandwidth:

# %%
for n in WORLDS:
    x = np.array([median_row("all_reduce", n, s)[1] for s in SIZES], dtype=float)  # ring bytes
    t = np.array([median_row("all_reduce", n, s)[0] for s in SIZES])
    inv_bw, alpha = np.polyfit(x, t, 1, w=1 / t)
    bw = f"{1 / inv_bw / 1e9:.2f} GB/s" if inv_bw > 0 else "not measurable (no growth with size)"
    print(f"all_reduce, {n} ranks: alpha = {max(alpha, 0) * 1e6:.0f} us per call, bus bandwidth B = {bw}")
print(f"(this machine: {os.cpu_count()} CPU core(s), shared by all the ranks)")

# %% [markdown]
# ## 5. A run's timeline
#
# The tracer records compute spans too (`trace.span("forward")`). Here is a
# toy data-parallel step on 2 ranks: forward, backward, all-reduce the
# gradient, optimizer step. To make the picture interesting, rank 1 gets 3
# times as much data as rank 0. A first, untraced step warms up (the first
# call of anything in a fresh process is slow), and a barrier lines the ranks
# up before the traced steps.

# %%
def toy_data_parallel(steps, dim, rows):
    torch.manual_seed(0)  # the same initial weights on every rank
    w = torch.randn(dim, dim, device=dist.device(), requires_grad=True)
    batches = [torch.randn(rows * (1 + 2 * dist.rank()), dim, device=dist.device())
               for _ in range(steps + 1)]  # uneven on purpose
    tracer = trace.Tracer()
    for step, x in enumerate(batches):
        if step == 1:
            comm.barrier()  # start the traced steps together
        with (tracer if step else trace.Tracer()):  # step 0: warm-up, not recorded
            with trace.span("forward", step=step):
                loss = (x @ w).tanh().square().mean()
            with trace.span("backward", step=step):
                loss.backward()
            comm.all_reduce(w.grad)  # sum of the gradients of all ranks
            with trace.span("optimizer", step=step):
                with torch.no_grad():
                    w -= 0.01 * w.grad / dist.world_size()
                w.grad = None
    return tracer.trace


# FIGURE
traces = launch(toy_data_parallel, N2, 3, 256, 1024, timeout=60)
fig, ax = plot.column_figure(height=2.8)
plot.timeline(traces, ax=ax, title=f"toy data parallel, {N2} ranks, 3 steps (rank 1 has 3x the data); time in ms")

# %% [markdown]
# Takeaway: the rank with less work reaches `all_reduce` first and waits there for the other.

# %%
for tr in traces:
    compute = sum(s.duration for s in tr.compute_spans())
    inside = sum(s.duration for s in tr.comm_spans() if s.name == "all_reduce")
    print(f"rank {tr.rank}: compute {compute * 1e3:6.1f} ms, inside all_reduce {inside * 1e3:6.1f} ms")

# %% [markdown]
# A collective ends for everyone only when the *slowest* rank has arrived: the
# ranks with less work spend their spare time inside `all_reduce`, waiting
# (compare the two columns above). A comm span measures waiting plus moving.
# Balanced work across ranks matters as much as fast links.
#
# ### Open it in Perfetto
#
# The same traces export to the Chrome trace-event format: one process per
# rank, a compute lane and a comm lane each. Open the file at
# <https://ui.perfetto.dev> ("Open trace file") or in `chrome://tracing`,
# zoom with W/S, click a span to see its bytes and group size.

# %%
# NBVAL_CHECK_OUTPUT
out_dir = Path("runs") / "00_collectives"  # runs/ is git-ignored
out_dir.mkdir(parents=True, exist_ok=True)
path = trace.save_chrome_trace(traces, out_dir / "trace.json")
events = trace.to_chrome_trace(traces)["traceEvents"]
spans = [e for e in events if e["ph"] == "X"]
print(f"wrote {path}: {len(spans)} spans from {len({e['pid'] for e in spans})} ranks")
for name in ("forward", "backward", "all_reduce", "optimizer"):  # 3 steps x 2 ranks
    print(f"  {name}: {sum(e['name'] == name for e in spans)} spans")

# %% [markdown]
# ## Summary
#
# * `launch(fn, N)` runs `fn` on N ranks and returns their results; errors
#   come back with the failing rank's traceback, hangs end at the timeout.
# * all_reduce (everyone gets the sum), all_gather (everyone gets every
#   chunk), reduce_scatter (everyone gets one summed chunk), broadcast
#   (everyone gets one rank's tensor).
# * all_reduce = reduce_scatter + all_gather, at the same cost: a ring sends
#   `2(N-1)/N · S` bytes per rank for an all-reduce, `(N-1)/N · S` for each half.
# * A call of S bytes takes about α + S/B (latency plus bytes over bandwidth);
#   bus bandwidth is the number that compares with the wires.
# * Past one machine, the same worker code runs under `torchrun`: call
#   `minifsdp.dist.init()` once at the top of the script (it reads torchrun's
#   environment), then `comm` works as it does here.
#
# Next: **01 — memory anatomy**, where the bytes of a training step live.
