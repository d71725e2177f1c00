# Lab 02 - data parallel. Source of solutions/02_data_parallel.ipynb and
# labs/02_data_parallel.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 02 - Data parallel: one model, many batches
#
# The simplest way to train on N devices: every rank keeps a **full copy of the
# model**, each rank gets a **different slice of the batch**, and the gradients are
# **averaged** across ranks before the optimizer step, so every copy takes exactly the
# same step and the copies never drift apart.
#
# In this lab you will
#
# 1. **build** data parallel yourself: broadcast the weights, run your slice, all-reduce
#    and average every gradient, and prove it equals one process on the whole batch;
# 2. make it fast the way PyTorch's `DistributedDataParallel` does: gradients packed in
#    **buckets** whose all-reduce starts **while backward is still running** (you will
#    see it on a timeline, and count it);
# 3. accumulate gradients over micro-batches with `no_sync()`, and meet its pitfall;
# 4. run `minifsdp`'s versions and PyTorch's own DDP through one trainer: same losses,
#    and their step times.
#
# Everything runs on CPU processes with the `gloo` backend; the same code runs on GPUs.
# Every number in this notebook is measured by the cells that print it.

# %%
import contextlib
import statistics
import tempfile
import time

import matplotlib.pyplot as plt
import torch

from minifsdp import comm, data, dist, launch, models, plot, trace
from minifsdp.ddp import DistributedDataParallel, NaiveDataParallel, bucket_assignment
from minifsdp.train import TrainConfig, train

# Small models: one compute thread per process is as fast as several and does not
# slow to a crawl when several processes share the cores (launch() does the same in ranks).
torch.set_num_threads(1)
notebook_start = time.perf_counter()
MiB = 2**20

# %% [markdown]
# ## 1. Why averaging gradients is exact
#
# `data.get_batch(step, global_batch_size, seq_len, rank=r, world_size=N)` cuts the
# global batch of a step into N equal, contiguous slices, one per rank. Stacked back
# together they are exactly the batch one process would see:

# %%
# NBVAL_CHECK_OUTPUT
GLOBAL_BATCH, SEQ = 8, 32          # sequences per step, tokens per sequence (gpt-tiny's block size)
x_all, y_all = data.get_batch(0, GLOBAL_BATCH, SEQ)
for world in (2, 4):
    slices = [data.get_batch(0, GLOBAL_BATCH, SEQ, rank=r, world_size=world)[0] for r in range(world)]
    print(f"{world} ranks x {slices[0].shape[0]} sequences, stacked, equal 1 rank x {GLOBAL_BATCH}:",
          torch.equal(torch.cat(slices), x_all))

# %% [markdown]
# The loss is a mean over the batch. With N equal slices of b sequences each,
#
# $$L = \frac{1}{Nb}\sum_{i=1}^{Nb} \ell_i = \frac{1}{N}\sum_{r=1}^{N} \underbrace{\frac{1}{b}\sum_{i \in \text{slice } r}\ell_i}_{L_r}
# \qquad\Rightarrow\qquad \nabla L = \frac{1}{N}\sum_{r=1}^{N} \nabla L_r$$
#
# because the gradient is linear. So: each rank computes the gradient of *its own*
# mean loss, an **all-reduce** sums the N gradients on every rank, and dividing by N
# gives every rank the gradient of the whole batch. That holds only if every rank
# computed its gradient **at the same weights**: the ranks must start from the same
# parameters (a **broadcast** from rank 0), and then they stay equal because they all
# take the same step.
#
# The yardstick, computed here in the notebook: one process, the whole batch.

# %%
reference = models.build_model("gpt-tiny", seed=0)
reference_loss = models.lm_loss(reference(x_all), y_all)
reference_loss.backward()
ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
n_params = models.count_parameters(reference)
print(f"gpt-tiny: {len(ref_grads)} parameter tensors, {n_params:,} parameters; "
      f"single-process loss on the whole batch {reference_loss.item():.6f}")

# %% [markdown]
# ### Exercise 1: naive data parallel
#
# Complete the worker below. It runs on every rank. Each process builds its own model
# **with its own seed** (`seed=rank`), as independent programs would, and gets its own
# slice of the batch. Your part, in three steps:
#
# 1. make every rank's weights equal to rank 0's;
# 2. forward and backward on the local slice, the loss in a variable named `loss`
#    (`models.lm_loss(logits, targets)` is the mean next-token cross-entropy);
# 3. turn each rank's gradient into the **average** of all ranks' gradients, in `p.grad`.
#
# The collectives you need, from `minifsdp.comm` (same names and signatures as
# `torch.distributed`, lab 00): `comm.broadcast(tensor, src=0)` and `comm.all_reduce(tensor)`
# (a **sum**, in place). Use `comm`, not `torch.distributed`: `comm` records every call on
# the tracer, and the cell after the check counts them. Change tensors that autograd
# tracks under `torch.no_grad()`. The check cell runs your worker on 1, 2 and 4 ranks and
# compares with the single-process gradients above.

# %%
def naive_data_parallel(global_batch, seq_len):
    rank, world = dist.rank(), dist.world_size()
    model = models.build_model("gpt-tiny", seed=rank).to(dist.device())   # different weights per rank!
    x, y = data.get_batch(0, global_batch, seq_len, rank=rank, world_size=world)
    x, y = x.to(dist.device()), y.to(dist.device())
    with trace.Tracer() as tracer:
        # BEGIN SOLUTION
        # HINT: broadcast every parameter from rank 0 (comm.broadcast(p.data, src=0) under torch.no_grad()), compute loss = models.lm_loss(model(x), y) and call loss.backward(), then comm.all_reduce(p.grad) for every parameter and divide p.grad by world.
        with torch.no_grad():
            for p in model.parameters():
                comm.broadcast(p.data, src=0)
        loss = models.lm_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                comm.all_reduce(p.grad)
                p.grad.div_(world)
        # END SOLUTION
    return {"loss": loss.item(),
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()},
            "trace": tracer.trace}

# %%
# CHECK: naive data parallel gives every rank the single-process, whole-batch gradient
# Tolerances (fp32): the all-reduce adds N per-rank means in another order than one process
# sums the whole batch, so the last bits differ; the largest difference is printed below.
GRAD_ATOL, GRAD_RTOL, LOSS_ATOL = 1e-6, 1e-4, 1e-6


def check_data_parallel(results, world):
    """Raise AssertionError with the most likely mistake, in words."""
    for r, res in enumerate(results):
        for n, p in res["params"].items():
            assert torch.equal(p, ref_params[n]), (
                f"with {world} ranks, rank {r}'s parameter {n!r} is not rank 0's initial value: ranks started "
                "from different weights. Broadcast every parameter from rank 0 (comm.broadcast(p.data, src=0)) "
                "BEFORE the forward pass, and do not change the weights (no optimizer step here).")
        missing = [n for n, g in res["grads"].items() if g is None]
        assert not missing, f"rank {r}: parameters {missing[:3]} have no .grad: did you call loss.backward()?"
    for r, res in enumerate(results[1:], start=1):
        for n, g in res["grads"].items():
            assert torch.allclose(g, results[0]["grads"][n], atol=1e-7, rtol=0), (
                f"with {world} ranks, rank {r} and rank 0 hold different gradients for {n!r}: the gradients "
                "were not summed across ranks. comm.all_reduce(p.grad) every parameter's gradient.")
    grads = results[0]["grads"]
    dot = sum((grads[n] * ref_grads[n]).sum() for n in grads)
    ratio = (dot / sum((g * g).sum() for g in ref_grads.values())).item()   # least-squares scale
    assert not (world > 1 and abs(ratio - world) < 0.05 * world), (
        f"with {world} ranks your gradients are {world}x too large: all_reduce SUMS the gradients of the "
        f"{world} ranks; divide each p.grad by the world size ({world}) to get the average.")
    assert not (world > 1 and abs(ratio - 1 / world) < 0.05 / world), (
        f"with {world} ranks your gradients are {world}x too small: divide by the world size once, "
        "after the all-reduce (or before it), not twice.")
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    for n in grads:
        assert torch.allclose(grads[n], ref_grads[n], atol=GRAD_ATOL, rtol=GRAD_RTOL), (
            f"with {world} rank(s) the gradient of {n!r} differs from the single-process one by up to {worst:.2e} "
            f"(tolerance atol {GRAD_ATOL}, rtol {GRAD_RTOL}). Likely causes: the broadcast came after the "
            "forward (every rank must compute its gradient at rank 0's weights: broadcast first), or the loss "
            "is not the mean loss of this rank's slice, models.lm_loss(model(x), y).")
    mean_loss = sum(res["loss"] for res in results) / world
    assert abs(mean_loss - reference_loss.item()) < LOSS_ATOL, (
        f"with {world} rank(s) the mean of the rank losses is {mean_loss:.6f}, the single-process loss "
        f"{reference_loss.item():.6f}: return the local mean loss of each rank's own slice.")
    return worst


naive_runs = {}
for world in (1, 2, 4):
    naive_runs[world] = launch(naive_data_parallel, world, GLOBAL_BATCH, SEQ, timeout=120)
    worst = check_data_parallel(naive_runs[world], world)
    print(f"{world} rank(s): gradients equal the single-process ones (largest difference {worst:.1e})")
print("Correct: your data parallel step computes the whole-batch gradient on every rank.")

# %% [markdown]
# What did that cost? The tracer saw every collective of your worker. Each rank sent one
# broadcast per parameter tensor at the start and one all-reduce per gradient. In the
# ZeRO paper's units an all-reduce of a Ψ-byte gradient moves 2Ψ (a reduce-scatter
# plus an all-gather), so data parallel costs **2Ψ per step**, Ψ = 4 bytes x parameters here:

# %%
# NBVAL_CHECK_OUTPUT
psi = 4 * n_params
for world in (2, 4):
    spans = naive_runs[world][0]["trace"].comm_spans()
    calls = {op: sum(s.name == op for s in spans) for op in ("broadcast", "all_reduce")}
    moved = {op: sum(s.args["bytes"] for s in spans if s.name == op) for op in ("broadcast", "all_reduce")}
    print(f"{world} ranks, rank 0: {calls['broadcast']} broadcasts ({moved['broadcast']:,} B), "
          f"{calls['all_reduce']} all-reduces ({moved['all_reduce']:,} B = {moved['all_reduce'] / psi:.0f} x Psi, "
          f"Psi = {psi:,} B)")

# %% [markdown]
# `minifsdp.ddp.NaiveDataParallel` is this idea packaged as a wrapper (picotron's
# `DataParallelNaive` does the same): it broadcasts in its constructor and all-reduces
# each gradient from a hook the moment autograd has finished it, so the training loop is
# the plain single-process loop. Each of those all-reduces is **blocking**: backward stops
# while one small tensor is on the wire, once per parameter tensor. Section 2 fixes that.
#
# ## 2. Buckets, and communication overlapped with backward
#
# PyTorch's DDP (Li et al., *PyTorch Distributed*, VLDB 2020) makes two changes:
#
# * **buckets**: gradients are packed into flat buffers of about `bucket_cap_mb` MiB and
#   all-reduced one bucket at a time: a few large messages instead of many small ones
#   (every message pays a fixed latency);
# * **overlap**: buckets are filled in **reverse** parameter order, because backward
#   produces the last layer's gradients first. When a bucket is full its all-reduce
#   starts *asynchronously* and backward goes on computing earlier layers; at the end of
#   backward, DDP only waits for what has not finished yet.
#
# `bucket_assignment` is the layout `minifsdp.ddp.DistributedDataParallel` uses. On
# `gpt-mini` (4 layers, width 256):

# %%
# NBVAL_CHECK_OUTPUT
mini = models.build_model("gpt-mini", seed=0)
mini_params = list(mini.parameters())
mini_names = [n for n, _ in mini.named_parameters()]
print(f"gpt-mini: {len(mini_params)} parameter tensors, {4 * models.count_parameters(mini) / MiB:.2f} MiB of fp32 gradients")
for cap in (0.25, 1.0, 4.0, 25.0):
    layout = bucket_assignment(mini_params, cap)
    print(f"bucket_cap_mb={cap:>5}: {len(layout):>2} buckets; the first holds {[mini_names[i] for i in layout[0]][:3]}"
          + (" ..." if len(layout[0]) > 3 else ""))
del mini

# %% [markdown]
# Now train. One worker runs a few steps of `gpt-mini` in each configuration, on 2 ranks:
# `NaiveDataParallel` (one blocking all-reduce per tensor) and `DistributedDataParallel`
# with several bucket sizes. Each configuration gets its own tracer, and the training
# loop opens `forward` / `backward` / `optimizer` spans; DDP adds `ddp.backward` (from the
# first gradient hook to the end of backward) and `ddp.wait` (waiting for the buckets
# still in flight at the end of backward, and copying the averages back).

# %%
BUCKET_CAPS = [0.25, 1.0, 4.0, 25.0]   # MiB
DP_STEPS, DP_WARMUP = 5, 1              # steps per configuration; the first is a warm-up, not timed
DP_BATCH, DP_SEQ = 8, 32                # global batch, sequence length


def one_step(model, optimizer, step, batch, seq_len):
    """The single-process training step, with spans for the timeline; returns its time (s)."""
    rank, world = dist.rank(), dist.world_size()
    x, y = data.get_batch(step, batch, seq_len, rank=rank, world_size=world)
    x, y = x.to(dist.device()), y.to(dist.device())
    start = time.perf_counter()
    with trace.span("step", step=step):
        with trace.span("forward"):
            loss = models.lm_loss(model(x), y)
        with trace.span("backward"):
            loss.backward()
        with trace.span("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def compare_bucket_sizes(caps, steps, batch, seq_len):
    configs = [("naive", None)] + [("ddp", cap) for cap in caps]
    runs = []
    for kind, cap in configs:
        model = models.build_model("gpt-mini", seed=0).to(dist.device())
        tracer = trace.Tracer()
        with tracer:
            wrapped = NaiveDataParallel(model) if kind == "naive" else DistributedDataParallel(model, bucket_cap_mb=cap)
        runs.append({"kind": kind, "cap": cap, "step_times": [], "trace": tracer.trace,
                     "model": wrapped, "optimizer": torch.optim.AdamW(wrapped.parameters(), lr=1e-3),
                     "tracer": tracer})
    # Interleave the configurations step by step (in a rotating order): a machine that gets
    # busier or quieter during the run then slows every configuration alike.
    for step in range(steps):
        for i in range(len(runs)):
            r = runs[(i + step) % len(runs)]
            with r["tracer"]:
                r["step_times"].append(one_step(r["model"], r["optimizer"], step, batch, seq_len))
    return [{k: v for k, v in r.items() if k not in ("model", "optimizer", "tracer")} for r in runs]


t = time.perf_counter()
bucket_runs = launch(compare_bucket_sizes, 2, BUCKET_CAPS, DP_STEPS, DP_BATCH, DP_SEQ, timeout=120)
print(f"{len(bucket_runs[0])} configurations x {DP_STEPS} steps on 2 ranks in {time.perf_counter() - t:.1f} s")

# %% [markdown]
# First the naive version: one step of both ranks. Each gradient's `all_reduce` (comm
# lane) runs *inside* `backward` and blocks it: backward cannot go on until that one
# small tensor has been summed, once per parameter tensor (the table further down counts
# the all-reduces of each step from the trace).

# %%
def spans_of_step(tr, step):
    """(the 'step' span, every span that starts inside it) of one trace."""
    step_span = next(s for s in tr.spans if s.name == "step" and s.args.get("step") == step)
    inside = [s for s in tr.spans if step_span.start <= s.start <= step_span.end]
    return step_span, inside


def run_of(runs, kind, cap=None):
    return next(r for r in runs if r["kind"] == kind and r["cap"] == cap)


def step_timeline(traces, step, title):
    """plot.timeline zoomed on one step of every rank (5 ms margins)."""
    t0 = min(s.start for tr in traces for s in tr.spans)
    first = min(spans_of_step(tr, step)[0].start for tr in traces)
    last = max(spans_of_step(tr, step)[0].end for tr in traces)
    return plot.timeline(traces, title=title, window=((first - t0) * 1e3 - 5, (last - t0) * 1e3 + 5))


SHOW_STEP = DP_STEPS - 1
step_timeline([run_of(rank_runs, "naive")["trace"] for rank_runs in bucket_runs], SHOW_STEP,
              f"NaiveDataParallel, gpt-mini, step {SHOW_STEP}, 2 ranks")

# %% [markdown]
# Now `DistributedDataParallel` with 1 MiB buckets, the same step. The compute lane shows
# `backward` and, inside it, DDP's `ddp.backward` then `ddp.wait`; the comm lane shows
# each bucket's `all_reduce`, from the moment its bucket filled up to the moment DDP's
# wait saw it finished (the bars stack where several buckets are in flight at once).
# The `broadcast` at the start of `forward` is DDP's `broadcast_buffers=True`: rank 0's
# buffers (here GPT's causal mask) are re-sent before every forward, as torch does; it
# also makes the faster rank wait for the slower one.

# %%
traces_1mib = [run_of(rank_runs, "ddp", 1.0)["trace"] for rank_runs in bucket_runs]
step_timeline(traces_1mib, SHOW_STEP, f"DistributedDataParallel, bucket_cap_mb=1, gpt-mini, step {SHOW_STEP}, 2 ranks")

# %% [markdown]
# ### Counting the overlap
#
# From the spans of one step: how many bucket all-reduces were *issued* before backward
# ended (`ddp.backward` ends when autograd has computed the last gradient), and how long
# before its end the first one went out: from then on the network had work while backward
# was still computing. (On CPU, gloo runs each asynchronous collective on a thread of its
# own; on GPUs, NCCL runs it on a stream of its own.) A comm span ends when DDP's wait
# confirmed it, not when its data arrived: CPU collectives do not report that moment. What
# was *not* hidden is the time DDP still spends in `ddp.wait` after backward.

# %%
def overlap_report(tr, step):
    """How the bucket all-reduces of one step of one rank's trace overlap DDP's backward."""
    _, spans = spans_of_step(tr, step)
    backward = next(s for s in spans if s.name == "ddp.backward")
    issued = [s.start for s in spans if s.kind == trace.COMM and s.name == "all_reduce"]
    return {"buckets": len(issued), "issued_in_backward": sum(t < backward.end for t in issued),
            "first_issue_before_end_ms": 1e3 * (backward.end - min(issued)),
            "backward_ms": 1e3 * backward.duration,
            "wait_ms": 1e3 * sum(s.duration for s in spans if s.name == "ddp.wait")}


for rank, rank_runs in enumerate(bucket_runs):
    rep = overlap_report(run_of(rank_runs, "ddp", 1.0)["trace"], SHOW_STEP)
    print(f"rank {rank}: {rep['issued_in_backward']} of {rep['buckets']} bucket all-reduces issued while backward was "
          f"still computing, the first {rep['first_issue_before_end_ms']:.0f} ms before the end of its "
          f"{rep['backward_ms']:.0f} ms; then waited {rep['wait_ms']:.1f} ms for them (ddp.wait)")

# %% [markdown]
# Two things to read in those numbers. The bucket all-reduces go out during backward and
# travel while it computes: that is the overlap. And an all-reduce can only finish
# once **every** rank has contributed its bucket: a rank whose backward ends first sits
# in `ddp.wait` until the slower rank catches up. Part of the exposed wait is therefore
# not the network but imbalance between the ranks (on this shared 2-core machine the two
# processes rarely run at the same speed; compare the two ranks' backward times).

# %% [markdown]
# And the bucket size, measured: all-reduces per step, median step time, median backward
# time (which includes the naive version's blocking all-reduces), how long before the end
# of backward the first bucket went out, and DDP's exposed wait.
# Medians over the timed steps of rank 0; this machine is shared, so expect noise of
# several percent between runs.

# %%
def bucket_table(runs):
    rows = []
    for r in runs:
        timed = range(DP_WARMUP, DP_STEPS)
        reps = [overlap_report(r["trace"], s) for s in timed] if r["kind"] == "ddp" else None
        steps = [spans_of_step(r["trace"], st)[1] for st in timed]
        # the loop's backward span: for the naive version it includes the blocking all-reduces
        backward = [1e3 * next(s for s in spans if s.name == "backward").duration for spans in steps]
        messages = {sum(s.name == "all_reduce" for s in spans) for spans in steps}
        assert len(messages) == 1, "every step sends the same all-reduces"
        rows.append({"config": "naive (per tensor)" if r["kind"] == "naive" else f"ddp, cap {r['cap']} MiB",
                     "messages": messages.pop(), "step_ms": 1e3 * statistics.median(r["step_times"][DP_WARMUP:]),
                     "backward_ms": statistics.median(backward),
                     "wait_ms": statistics.median(x["wait_ms"] for x in reps) if reps else float("nan"),
                     "lead_ms": statistics.median(x["first_issue_before_end_ms"] for x in reps) if reps else float("nan")})
    return rows


bucket_rows = bucket_table(bucket_runs[0])
def ms(x):
    return "-" if x != x else f"{x:.1f}"   # nan: the naive version has no async all-reduce and no wait


print(f"{'configuration':<20} {'all-reduces/step':>16} {'step ms':>8} {'backward ms':>12} "
      f"{'1st issue before end ms':>24} {'ddp.wait ms':>12}")
for row in bucket_rows:
    print(f"{row['config']:<20} {row['messages']:>16} {row['step_ms']:>8.1f} {row['backward_ms']:>12.1f} "
          f"{ms(row['lead_ms']):>24} {ms(row['wait_ms']):>12}")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.2))
ddp_rows = [r for r in bucket_rows if r["config"].startswith("ddp")]
ax.plot([r["messages"] for r in ddp_rows], [r["step_ms"] for r in ddp_rows], "o-", label="DistributedDataParallel")
naive_row = bucket_rows[0]
ax.plot([naive_row["messages"]], [naive_row["step_ms"]], "s", color="C3", label="NaiveDataParallel")
for r in bucket_rows:
    ax.annotate(r["config"].replace("ddp, ", ""), (r["messages"], r["step_ms"]), textcoords="offset points",
                xytext=(4, 4), fontsize=8)
ax.set_xscale("log")
ax.set_xlabel("all-reduce messages per step (log scale)")
ax.set_ylabel("median step time (ms)")
ax.set_title("gpt-mini, 2 ranks: step time vs number of gradient messages")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)

# %% [markdown]
# Reading it: one bucket per parameter tensor pays a fixed per-message cost many times
# and blocks backward each time; one huge bucket cannot start before the *whole*
# backward is done, so nothing overlaps (its `ddp.wait` is the whole all-reduce). A
# middle size starts sending early and sends few messages. PyTorch's default is 25 MiB
# with a smaller 1 MiB first bucket, tuned for GPU networks. On a 2-core CPU the compute
# and the gloo threads compete for the same cores, so differences here are modest and
# noisy: run the training cell again and see how much the table moves.
#
# ## 3. Gradient accumulation and `no_sync()`
#
# To train with a batch larger than fits in memory, run k micro-batches, let the
# gradients add up in `p.grad`, and step once; dividing each micro-batch's mean loss by
# k makes the sum the gradient of the mean over all k micro-batches. With data parallel,
# all-reducing after every micro-batch is wasted work: averaging is linear, so *one*
# all-reduce of the accumulated sum, after the last micro-batch, gives the same result
# for 1/k of the traffic. `model.no_sync()` is a context manager that turns the
# all-reduce off for what runs inside it.
#
# The catch: PyTorch's DDP decides **in `forward`** whether the coming backward will
# synchronise (`minifsdp.ddp.DistributedDataParallel` copies that behaviour). So the
# *forward and the backward* of micro-batches 0 .. k-2 belong inside `no_sync()`, and
# the last micro-batch, forward included, outside.
#
# ### Exercise 2: accumulate with one all-reduce per step
#
# Write `accumulation_step(model, micro_batches)`: `model` is a `DistributedDataParallel`,
# `micro_batches` a list of k `(x, y)` pairs. Afterwards `p.grad` must hold the gradient
# of the mean loss over all k micro-batches and all ranks, and exactly one all-reduce
# of the gradients (2Ψ bytes) may have happened. The check runs it on 2 and 4 ranks with
# k = 4 and counts the bytes with the tracer.

# %%
ACCUM, ACC_BATCH = 4, 16   # micro-batches per step; global batch (2 ranks x 4 micro-batches x 2 sequences)


def accumulation_step(model, micro_batches):
    k = len(micro_batches)
    # BEGIN SOLUTION
    # HINT: for the first k-1 micro-batches run loss = models.lm_loss(model(x), y) / k and loss.backward() both inside `with model.no_sync():`; run the last micro-batch (forward and backward) outside it.
    with model.no_sync():
        for x, y in micro_batches[:-1]:
            (models.lm_loss(model(x), y) / k).backward()
    x, y = micro_batches[-1]
    (models.lm_loss(model(x), y) / k).backward()
    # END SOLUTION


def accumulation_worker(accum, batch, seq_len):
    rank, world = dist.rank(), dist.world_size()
    model = DistributedDataParallel(models.build_model("gpt-tiny", seed=0).to(dist.device()))
    micro_batches = [tuple(t.to(dist.device()) for t in data.get_batch(
        0, batch, seq_len, rank=rank, world_size=world, micro_step=m, grad_accum=accum)) for m in range(accum)]
    with trace.Tracer() as tracer:
        accumulation_step(model, micro_batches)
    return {"all_reduce_bytes": tracer.trace.bytes_by_op().get("all_reduce", 0),
            "grads": {n: None if p.grad is None else p.grad.cpu() for n, p in model.module.named_parameters()}}


# the single-process gradient of the whole global batch of 16 sequences
acc_ref = models.build_model("gpt-tiny", seed=0)
xa, ya = data.get_batch(0, ACC_BATCH, SEQ)
models.lm_loss(acc_ref(xa), ya).backward()
acc_ref_grads = {n: p.grad for n, p in acc_ref.named_parameters()}

# %%
# CHECK: one all-reduce per step, and the gradient of the whole global batch
for world in (2, 4):
    res = launch(accumulation_worker, world, ACCUM, ACC_BATCH, SEQ, timeout=120)
    moved = res[0]["all_reduce_bytes"]
    assert moved != ACCUM * 2 * psi, (
        f"with {world} ranks every micro-batch was all-reduced ({moved:,} B = {ACCUM} x 2 Psi): run the forward "
        "AND the backward of micro-batches 0..k-2 inside `with model.no_sync():` (the forward matters: DDP "
        "decides in forward whether the coming backward all-reduces)")
    assert moved != 0, (
        f"with {world} ranks nothing was all-reduced: the last micro-batch (its forward included) must run "
        "OUTSIDE no_sync(), so that its backward all-reduces the accumulated gradients")
    assert moved == 2 * psi, (
        f"with {world} ranks {moved:,} B were all-reduced, expected exactly one all-reduce of every gradient "
        f"(2 Psi = {2 * psi:,} B): only the last micro-batch may run outside no_sync()")
    grads = res[0]["grads"]
    assert all(g is not None for g in grads.values()), "some parameters have no .grad: call backward() on each loss"
    ratio = (sum((grads[n] * acc_ref_grads[n]).sum() for n in grads)
             / sum((g * g).sum() for g in acc_ref_grads.values())).item()
    assert abs(ratio - ACCUM) > 0.05 * ACCUM, (
        f"with {world} ranks the gradients are {ACCUM}x too large: divide each micro-batch's loss by k = "
        "len(micro_batches), so that the sum of the k gradients is the gradient of their mean")
    for n in grads:
        assert torch.allclose(grads[n], acc_ref_grads[n], atol=GRAD_ATOL, rtol=GRAD_RTOL), (
            f"with {world} ranks the accumulated gradient of {n!r} is not the single-process gradient of the "
            f"whole batch (atol {GRAD_ATOL}, rtol {GRAD_RTOL}): run every micro-batch once, each loss divided by k")
    for r in range(1, world):
        assert all(torch.equal(res[r]["grads"][n], grads[n]) for n in grads), f"rank {r}'s gradients differ from rank 0's"
    print(f"{world} ranks: one all-reduce ({moved:,} B = 2 Psi) for {ACCUM} micro-batches; gradients = single process")

# %% [markdown]
# What goes wrong with the other ways of writing the loop? Four loops on 2 ranks, each run
# with `minifsdp`'s DDP and with PyTorch's. For ours, the tracer counts the all-reduce
# bytes of each micro-step; PyTorch's DDP does not go through `comm`, so we count its
# bytes with a **communication hook** (`register_comm_hook`, the official way to see or
# replace what DDP sends): the hook sees each bucket, records its size, and calls
# PyTorch's default all-reduce hook. Bytes are in the ZeRO paper's units for both (2x the bucket).

# %%
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

VARIANTS = {
    "no no_sync (sync every micro-batch)": "none",
    "forward+backward in no_sync (right)": "both",
    "only backward in no_sync (pitfall)": "backward",
    "forward in no_sync, backward outside": "forward",
}


def counting_allreduce_hook(sizes, bucket):
    """A DDP comm hook: note the bucket's bytes, then all-reduce and average as torch's default does."""
    sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    return default_hooks.allreduce_hook(None, bucket)


def accumulate(variant, accum, batch, seq_len):
    """One step of `accum` micro-batches, for both DDPs; `variant` says what runs inside no_sync()."""
    rank, world = dist.rank(), dist.world_size()
    out = {}
    for impl in ("minifsdp", "torch"):
        module = models.build_model("gpt-tiny", seed=0).to(dist.device())
        bucket_sizes = []   # torch: filled by the comm hook
        if impl == "torch":
            model = TorchDDP(module)
            model.register_comm_hook(bucket_sizes, counting_allreduce_hook)
        else:
            model = DistributedDataParallel(module)
        per_micro = []
        with trace.Tracer() as tracer:
            for m in range(accum):
                x, y = data.get_batch(0, batch, seq_len, rank=rank, world_size=world, micro_step=m, grad_accum=accum)
                x, y = x.to(dist.device()), y.to(dist.device())
                last = m == accum - 1
                forward_inside = (variant == "both" and not last) or variant == "forward"   # "forward": every one
                backward_inside = variant in ("both", "backward") and not last
                seen = len(bucket_sizes)
                with trace.span("micro", micro=m) as span:
                    with model.no_sync() if forward_inside else contextlib.nullcontext():
                        loss = models.lm_loss(model(x), y) / accum
                    with model.no_sync() if backward_inside else contextlib.nullcontext():
                        loss.backward()
                if impl == "torch":     # the buckets the hook saw in this micro-step
                    per_micro.append(2 * sum(bucket_sizes[seen:]))
                else:                   # the all-reduces the tracer saw start inside this micro-step
                    per_micro.append(sum(c.args["bytes"] for c in tracer.trace.comm_spans()
                                         if c.name == "all_reduce" and span.start <= c.start <= span.end))
        out[impl] = {"bytes": per_micro, "grads": {n: p.grad.cpu() for n, p in module.named_parameters()}}
    return out


accum_runs = {name: launch(accumulate, 2, v, ACCUM, ACC_BATCH, SEQ, timeout=120) for name, v in VARIANTS.items()}

# %%
# NBVAL_CHECK_OUTPUT
def same(a, b):
    return all(torch.allclose(a[n], b[n], atol=GRAD_ATOL, rtol=GRAD_RTOL) for n in a)


KiB = 1024
print(f"2 ranks, {ACCUM} micro-batches. Psi = {psi:,} B = {psi / KiB:.1f} KiB: one all-reduce of every gradient "
      f"moves 2 Psi = {2 * psi / KiB:.1f} KiB")
print(f"{'loop':<37} {'impl':<8} {'all-reduce KiB per micro-step':<30} {'= 1 process?':>12} {'ranks agree?':>12}")
for name, res in accum_runs.items():
    for impl in ("minifsdp", "torch"):
        mine, other = res[0][impl], res[1][impl]
        kib = "[" + ", ".join(f"{b / KiB:.1f}" for b in mine["bytes"]) + "]"
        print(f"{name if impl == 'minifsdp' else '':<37} {impl:<8} {kib:<30} "
              f"{str(same(mine['grads'], acc_ref_grads)):>12} {str(same(mine['grads'], other['grads'])):>12}")

# %% [markdown]
# * Syncing every micro-batch is *correct* (the result equals one process) but moves
#   2Ψ per micro-batch: k times the traffic.
# * Forward and backward inside `no_sync()` for all but the last: one 2Ψ all-reduce per
#   step, same gradients.
# * Only `backward()` inside: the forward had already armed the all-reduce, so every
#   micro-batch pays 2Ψ anyway. Nothing is wrong with the numbers; the step is just slow.
# * The last forward inside `no_sync()`: no all-reduce ever happens, each rank keeps its
#   own gradient, and the replicas silently drift apart from the first optimizer step.
#   Nothing raises: only a gradient or parameter check like the ones in this lab catches it.
#
# PyTorch's DDP rows match ours line for line: the same bytes in the same micro-steps,
# and the same gradients.
#
# ## 4. Against PyTorch's DDP, through one trainer
#
# `minifsdp.train.train(TrainConfig(strategy=...))` runs the same training loop for every
# strategy (`python -m minifsdp.train` from a shell). Four strategies on the same seed,
# model and global batch: `single` (one process, the whole batch), `ddp-naive`, `ddp` and
# `torch-ddp` (`torch.nn.parallel.DistributedDataParallel`), the last three on 2 ranks.
# The trainer's loss of a step is the mean over the global batch. Both DDPs get 1 MiB
# buckets (`bucket_cap_mb=1.0`), the size that overlapped well in section 2; with an
# explicit cap, torch too uses it for every bucket.

# %%
CMP_STEPS, CMP_MODEL = 8, "gpt-mini"
strategies = ["single", "ddp-naive", "ddp", "torch-ddp"]
metrics = {}
for s in strategies:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(strategy=s, world_size=1 if s == "single" else 2, model=CMP_MODEL, steps=CMP_STEPS,
                          batch_size=8, seq_len=32, bucket_cap_mb=1.0, out=out, quiet=True, track_memory=False,
                          timeout=120)
        metrics[s] = train(cfg)

# %%
print(f"{'step':>4}  " + "  ".join(f"{s:>10}" for s in strategies))
for step in range(CMP_STEPS):
    print(f"{step:>4}  " + "  ".join(f"{metrics[s]['losses'][step]:>10.6f}" for s in strategies))
for s in strategies[1:]:
    diff = max(abs(a - b) for a, b in zip(metrics[s]["losses"], metrics["single"]["losses"]))
    print(f"max |loss({s}) - loss(single)| over {CMP_STEPS} steps: {diff:.2e}")
print(f"\n{'strategy':<10} {'ranks':>5} {'median step ms':>15} {'(min - max)':>16} {'comm bytes/step':>16}  (rank 0)")
for s in strategies:
    m = metrics[s]
    times = [1e3 * t for t in m["step_time_s"][0]]
    moved = sum(m["bytes_per_step"][0].values())
    moved_txt = f"{moved / MiB:.2f} MiB" if moved else "0"
    print(f"{s:<10} {m['world_size']:>5} {statistics.median(times):>15.1f} {f'({min(times):.0f} - {max(times):.0f})':>16} "
          f"{moved_txt:>16}")

# %%
# The trainer's parity contract, asserted
LOSS_TOL = 1e-5   # fp32, per step, after AdamW steps (tests/test_train.py uses the same kind of bound)
for s in strategies[1:]:
    diff = max(abs(a - b) for a, b in zip(metrics[s]["losses"], metrics["single"]["losses"]))
    assert diff < LOSS_TOL, f"{s} drifted from the single-process losses by {diff:.2e} (tolerance {LOSS_TOL})"
print(f"all strategies reproduce the single-process losses within {LOSS_TOL}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
for i, s in enumerate(strategies):
    ax1.plot(range(CMP_STEPS), metrics[s]["losses"], marker="os^v"[i], ms=5, lw=1, alpha=0.8, label=s)
ax1.set_xlabel("step")
ax1.set_ylabel("training loss (nats / token)")
worst_loss_diff = max(abs(a - b) for s in strategies[1:] for a, b in zip(metrics[s]["losses"], metrics["single"]["losses"]))
ax1.set_title(f"{CMP_MODEL}: training loss, largest difference to single {worst_loss_diff:.1e}")
ax1.legend(fontsize=8)
ax1.grid(alpha=0.3)
ax2.bar(strategies, [1e3 * metrics[s]["median_step_time_s"][0] for s in strategies], color=["C0", "C3", "C1", "C2"])
ax2.set_ylabel("median step time (ms), rank 0")
ax2.set_title("step time, measured on this machine")
ax2.grid(axis="y", alpha=0.3)
fig.tight_layout()

# %% [markdown]
# The losses agree to float rounding (the cell above printed the largest difference).
# Compare the step times printed above with care: `single` uses one process for the
# whole batch, the others two processes on a shared CPU, and the smaller the model the
# more the fixed per-message cost of communication weighs.
#
# ## What you have seen
#
# * Data parallel = same weights everywhere (broadcast once) + a different slice of the
#   batch per rank + the **average** of the gradients (all-reduce, then / N). It is exact:
#   the gradients equal one process on the whole batch to float rounding.
# * It costs 2Ψ of communication per step, and a full copy of parameters, gradients and
#   optimizer state on every rank (lab 01). Lab 03 (ZeRO) removes those copies.
# * Buckets turn many small messages into a few large ones, and reverse-order buckets
#   let the all-reduce run while backward is still computing.
# * `no_sync()` must wrap forward **and** backward of every micro-batch but the last.

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
