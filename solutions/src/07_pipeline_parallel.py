# Lab 07 - pipeline parallel. Source of solutions/07_pipeline_parallel.ipynb and
# labs/07_pipeline_parallel.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 07 - Pipeline parallel: GPipe, 1F1B, interleaved, zero bubble
#
# Labs 02-04 split the *data* (and then the model's state) across ranks; every rank
# still ran every layer. **Pipeline parallelism** splits the model *by layers*: rank 0
# holds the first layers (a **stage**), rank 1 the next, and activations flow forward
# from stage to stage while gradients flow back. The catch is idle time - the
# **bubble** - and the whole art is the **schedule**: in which order each rank runs
# the forward (F) and backward (B) of each **micro-batch**.
#
# **You will be able to**: measure the idle time of naive model parallelism from a
# trace; explain why micro-batches shrink the bubble to (p-1)/(m+p-1); **write the
# 1F1B schedule as data** (warm-up, steady state, cool-down) and run it on real ranks
# with the same gradients as one process; **write interleaved 1F1B** (several stages per
# rank, depth first); **write a zero-bubble schedule** that splits each backward into
# input and weight gradients; and use `minifsdp.pipeline` exactly like
# `torch.distributed.pipelining`.
#
# **Prerequisites**: lab 00 (ranks, send/recv), lab 01 (activation memory).
# **Time**: about 60 minutes of work; the cells compute for about a minute on a laptop
# (2 CPU ranks), the same on a 2-GPU VM.
#
# **Exercises**: 1. the measured bubble of a trace · 2. 1F1B as data · 3. an executor that
# runs your plan · 4. interleaved 1F1B · 5. a zero-bubble schedule.
#
# Symbols: p = pipeline stages (ranks), m = micro-batches per step, v = stages per rank
# (interleaved). In plans, `"1F3"` is stage 1's forward of micro-batch 3 (torch's notation).

# %%
import contextlib
import time

import ipywidgets as widgets
import torch

from minifsdp import comm, data, dist, estimate, launch, models, plot, trace
from minifsdp.labcheck import lab07 as check
from minifsdp.memory import MemoryTracker
from minifsdp.pipeline import (Action, Plan, PipelineStage, ScheduleFromPlan, make_plan, simulate, split_gpt,
                               validate)

torch.set_num_threads(1)
notebook_start = time.perf_counter()
P = dist.lab_world_size(2)     # ranks that run: 2 CPU processes (or 2 GPUs); plans below go to p = 8 on paper
MODEL, BATCH, SEQ = "gpt-mini", 16, 64
MiB = 2**20

# %% [markdown]
# ## 1. Naive model parallel: one batch, one stage at a time
#
# Cut the GPT in two by layers (`split_gpt`: embedding + first blocks on rank 0,
# last blocks + head on rank 1). With the whole batch as one micro-batch, rank 1
# waits while rank 0 runs its forward, then rank 0 waits while rank 1 runs forward
# and backward, and so on. `run_pipeline` below runs one training step of any plan
# on `P` ranks with `minifsdp.pipeline`'s executor, traced: every forward/backward is
# a span, every message a `send`/`recv` span. (A first step runs untraced: it pays
# for one-off costs such as the shape handshake.)

# %%
def run_pipeline(plans, steps=2, batch=BATCH, track_memory=False):
    """On each rank: build this rank's stage of the GPT, run each plan for `steps` steps,
    return per plan (trace of the last step, grads, losses, peak activation bytes)."""
    rank, p = dist.rank(), dist.world_size()
    x, y = data.get_batch(0, batch, SEQ)
    x, y = x.to(dist.device()), y.to(dist.device())
    out = []
    for plan in plans:
        model = models.build_model(MODEL, seed=0).to(dist.device())
        parts = split_gpt(model, p * plan.v)             # v stages per rank: rank r holds r, r + p, ...
        stages = [PipelineStage(parts[s], s, p * plan.v, dist.device()) for s in plan.stages_of(rank)]
        schedule = ScheduleFromPlan(stages, plan, loss_fn=models.lm_loss)
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            tracer, tracker, losses = trace.Tracer(rank=rank), MemoryTracker(), []
            last = {"target": y, "losses": losses, "return_outputs": False} if rank == p - 1 else {}
            with tracer, (tracker if track_memory and step == steps - 1 else contextlib.nullcontext()):
                schedule.step(*((x,) if rank == 0 else ()), **last)
        grads = {n: q.grad.cpu() for st in stages for n, q in st.submod.named_parameters()}
        peak = tracker.peak_by_category["activations"] if track_memory else None
        out.append((tracer.trace, grads, [l.item() for l in losses], peak))
    return out


naive = launch(run_pipeline, P, [make_plan("gpipe", P, 1)], timeout=120)
traces = [rank_result[0][0] for rank_result in naive]
plot.timeline(traces, title=f"naive model parallel: {MODEL} cut in {P}, one micro-batch")

# %% [markdown]
# The top lane of each rank is compute, the bottom one communication: a long `recv`
# is a rank waiting for its neighbour. *Takeaway: with one micro-batch only one rank
# works at a time.*
#
# ### Exercise 1: the measured bubble
#
# The **bubble** is the idle fraction of rank-time during the step: take the window
# from the first pipeline compute span (any rank) to the last, times the number of
# ranks; subtract the time spent in compute spans; divide. Pipeline compute spans are
# named `forward`, `backward`, `backward_input`, `backward_weight` (a `trace.Span` has
# `.name`, `.kind`, `.start`, `.end` in seconds; a `trace.Trace` has `.spans`).

# %%
PIPELINE_WORK = ("forward", "backward", "backward_input", "backward_weight")


def my_measured_bubble(traces) -> float:
    """Idle fraction of rank-time between the first and last pipeline compute span of any rank."""
    # BEGIN SOLUTION
    # HINT: Keep only spans whose name is pipeline work (communication waits are idle, and a
    # HINT: span around the whole step is not work). Busy = the sum of their durations over all
    # HINT: ranks; total = (latest end - earliest start) x number of traces.
    work = [s for tr in traces for s in tr.spans if s.name in PIPELINE_WORK]
    window = (max(s.end for s in work) - min(s.start for s in work)) * len(traces)
    busy = sum(s.end - s.start for s in work)
    return (window - busy) / window
    # END SOLUTION


# %%
# CHECK: my_measured_bubble gives the exact idle fraction of hand-made traces
check.measured_bubble(my_measured_bubble)

# %%
print(f"naive model parallel on {P} ranks: measured bubble {my_measured_bubble(traces):.0%} "
      f"(formula (p-1)/(m+p-1) = {estimate.pipeline_bubble_fraction(P, 1):.0%})")

# %% [markdown]
# ## 2. GPipe: micro-batches fill the pipeline
#
# GPipe (Huang et al. 2019) cuts the batch into m micro-batches: while rank 1 runs
# micro-batch 0, rank 0 already runs micro-batch 1. All forwards, then all backwards;
# gradients accumulate over the micro-batches (the executor divides by m, so a mean
# loss gives exactly the whole batch's gradient). A schedule is **plain data** -
# for each rank, the ordered list of its actions - so we can print and draw it before
# anything runs. On paper a forward takes 1 unit and a backward 2 (two matmuls per
# weight instead of one); a blank cell is the bubble:

# %%
# NBVAL_CHECK_OUTPUT
plan = make_plan("gpipe", 4, 4)
print(plan)
print(plan.table())
print(f"bubble on paper {plan.bubble():.1%}; formula (p-1)/(m+p-1) = {estimate.pipeline_bubble_fraction(4, 4):.1%}")

# %% [markdown]
# Now measured: GPipe on P ranks at m = 1, 2, 4, 8, your bubble function on each
# trace beside the plan's and the formula's.

# %%
MS = (1, 2, 4, 8)
gpipe_runs = launch(run_pipeline, P, [make_plan("gpipe", P, m) for m in MS], timeout=180)
print(f"{'m':>3}  {'measured':>9}  {'plan':>6}  {'formula':>8}")
for k, m in enumerate(MS):
    measured = my_measured_bubble([rank_result[k][0] for rank_result in gpipe_runs])
    print(f"{m:>3}  {measured:9.1%}  {make_plan('gpipe', P, m).bubble():6.1%}  "
          f"{estimate.pipeline_bubble_fraction(P, m):8.1%}")
plot.pipeline_schedule(make_plan("gpipe", P, 4), [rank_result[2][0] for rank_result in gpipe_runs],
                       title="GPipe, m = 4: planned (top) and measured (bottom)")

# %% [markdown]
# *Takeaway: more micro-batches, smaller bubble - measured as on paper, give or take
# the cost of the messages (on CPU a send is a memory copy through a socket; on GPUs
# the measured and planned figures sit closer). But GPipe runs every forward before
# any backward, so every rank holds the activations of all m micro-batches at once.*
#
# ## 3. 1F1B: the same bubble, a fraction of the memory
#
# 1F1B (PipeDream-Flush; torch's `Schedule1F1B`) starts each backward as soon as it
# can. Rank r (0-based, p ranks) runs
#
# * **warm-up**: forwards of micro-batches 0 … w-1, with w = min(p-1-r, m): the ones
#   in flight while micro-batch 0 travels to the last stage and its gradient back;
# * **steady state**: for each remaining micro-batch, its forward, then the backward
#   of the *oldest* micro-batch in flight;
# * **cool-down**: the backwards still owed.
#
# So rank r never holds more than p - r micro-batches, whatever m is.
#
# ### Exercise 2: write 1F1B as data
#
# Return `{rank: [action, ...]}` for p ranks and m micro-batches, one stage per rank
# (stage r on rank r). An action is the string `f"{stage}F{mb}"` or `f"{stage}B{mb}"`.
# Leave out the messages: `validate` inserts each receive just before the action that
# needs it and each send just after the one that produced it.

# %%
def my_1f1b(p: int, m: int) -> dict[int, list[str]]:
    """The 1F1B plan: per rank, warm-up forwards, then one forward / one backward, then cool-down."""
    order = {}
    for r in range(p):
        # BEGIN SOLUTION
        # HINT: Count the warm-up forwards first (min(p - 1 - r, m)). In the steady state the
        # HINT: forward runs the next micro-batch not yet started and the backward the oldest one
        # HINT: not yet finished; the cool-down finishes the rest in order.
        w = min(p - 1 - r, m)
        acts = [f"{r}F{i}" for i in range(w)]
        for i in range(m - w):
            acts += [f"{r}F{w + i}", f"{r}B{i}"]
        acts += [f"{r}B{i}" for i in range(m - w, m)]
        order[r] = acts
        # END SOLUTION
    return order


# %%
# CHECK: my_1f1b is valid, has the formula bubble and holds at most p - r micro-batches on rank r
check.one_f_one_b(my_1f1b)

# %% [markdown]
# Your plan on paper, then on the ranks. `validate` returns its timeline (the
# same bubble as GPipe's) and the activations each rank holds at its peak:

# %%
# NBVAL_CHECK_OUTPUT
mine = Plan("my 1F1B", 4, 8, 1, {r: [Action.parse(a) for a in acts] for r, acts in my_1f1b(4, 8).items()})
timeline = validate(mine)
print(timeline.table())
print(f"bubble {timeline.bubble:.1%}; micro-batches held at the peak, per rank: {timeline.peak_activations} "
      f"(GPipe: {make_plan('gpipe', 4, 8).peak_activations()})")

# %% [markdown]
# ### Exercise 3: run a plan yourself
#
# A plan is just a list; running it is a loop. `validate(plan).lowered` (or
# `plan.with_comms()`) is the plan with its messages: `RECV_F` before a forward that
# needs a neighbour's activation, `SEND_F` after it, `RECV_B` / `SEND_B` the same for
# gradients. Write the loop body for one rank: a received activation becomes a leaf
# that requires grad (so backward leaves the gradient for the previous rank in its
# `.grad`); the last rank's forward ends in the loss; a backward starts from the loss
# on the last rank and from the received gradient elsewhere. Use `comm.recv(buffer,
# src)` (blocking) and `comm.isend(tensor, dst)` (keep the handle in `sends`), and let
# go of a micro-batch's tensors once its backward and sends are done.

# %%
def my_run_plan(stage_module, actions, x, y, m):
    """Run this rank's lowered actions for one step; return the m losses on the last rank, else []."""
    rank, p = dist.rank(), dist.world_size()
    xs, ys = x.chunk(m), y.chunk(m)
    shape = (x.shape[0] // m, x.shape[1], stage_module.config.n_embd)  # what travels between stages
    inputs, outputs, grads, losses, sends = {}, {}, {}, [], []
    for a in actions:
        i = a.mb
        # BEGIN SOLUTION
        # HINT: One branch per a.kind. RECV_* fill a fresh torch.empty(shape) from the neighbour (rank - 1
        # HINT: for activations, rank + 1 for gradients); F keeps its input and output (the loss on the
        # HINT: last rank); B pops the output and runs backward; SEND_B sends the input's .grad upstream.
        if a.kind == "RECV_F":
            inputs[i] = torch.empty(shape, device=dist.device())
            comm.recv(inputs[i], rank - 1)
            inputs[i].requires_grad_()
        elif a.kind == "F":
            out = stage_module(xs[i] if rank == 0 else inputs[i])
            if rank == p - 1:
                out = models.lm_loss(out, ys[i])
                losses.append(out.detach())
            outputs[i] = out
        elif a.kind == "SEND_F":
            sends.append(comm.isend(outputs[i].detach(), rank + 1))
        elif a.kind == "RECV_B":
            grads[i] = torch.empty(shape, device=dist.device())
            comm.recv(grads[i], rank + 1)
        elif a.kind == "B":
            outputs.pop(i).backward(grads.pop(i) if rank < p - 1 else None)
        elif a.kind == "SEND_B":
            sends.append(comm.isend(inputs.pop(i).grad, rank - 1))
        # END SOLUTION
    for handle in sends:
        handle.wait()
    for q in stage_module.parameters():
        q.grad /= m  # the mean over micro-batches: the whole batch's gradient
    return losses


# %%
# CHECK: my_run_plan runs 1F1B and GPipe on 2 ranks with one process's gradients, 1F1B in less memory
check.executor(my_run_plan)

# %% [markdown]
# The library's executor is the same loop, plus the zero-bubble actions, shapes learned
# at the first step and a trace span per action: `ScheduleFromPlan([stage], plan, loss_fn)`. Here
# your 1F1B and the library's GPipe at m = 2p on P ranks, the memory tracker on, and
# your gradients against one process running the whole batch:

# %%
m = 2 * P
yours = {r: [Action.parse(a) for a in acts] for r, acts in my_1f1b(P, m).items()}
runs = launch(run_pipeline, P, [Plan("my 1F1B", P, m, 1, yours), make_plan("gpipe", P, m)], 2, BATCH, True,
              timeout=180)

reference = models.build_model(MODEL, seed=0)
x_all, y_all = data.get_batch(0, BATCH, SEQ)
models.lm_loss(reference(x_all), y_all).backward()
ref = dict(reference.named_parameters())
worst = max(((g - ref[n].grad).norm() / ref[n].grad.norm()).item() for rank_result in runs
            for n, g in rank_result[0][1].items())
print(f"your 1F1B on {P} ranks, m={m}: largest relative gradient difference to one process {worst:.1e}")
for r, rank_result in enumerate(runs):
    print(f"rank {r}: peak activations {rank_result[0][3] / MiB:6.1f} MiB with your 1F1B, "
          f"{rank_result[1][3] / MiB:6.1f} MiB with GPipe")
plot.pipeline_schedule(Plan("my 1F1B", P, m, 1, yours), [rank_result[0][0] for rank_result in runs],
                       title="your 1F1B: planned (top) and measured (bottom)")

# %% [markdown]
# And your 1F1B's measured bubble at m = 1, 2, 4, 8, beside GPipe's from section 2:

# %%
def my_plan(m):
    return Plan("my 1F1B", P, m, 1, {r: [Action.parse(a) for a in acts] for r, acts in my_1f1b(P, m).items()})


one_f_runs = launch(run_pipeline, P, [my_plan(m) for m in MS], timeout=180)
print(f"{'m':>3}  {'your 1F1B':>9}  {'GPipe':>6}  {'plan':>6}  {'formula':>8}   (measured, measured, both plans)")
for k, m in enumerate(MS):
    mine_measured = my_measured_bubble([rank_result[k][0] for rank_result in one_f_runs])
    gpipe_measured = my_measured_bubble([rank_result[k][0] for rank_result in gpipe_runs])
    print(f"{m:>3}  {mine_measured:9.1%}  {gpipe_measured:6.1%}  {my_plan(m).bubble():6.1%}  "
          f"{estimate.pipeline_bubble_fraction(P, m):8.1%}")

# %% [markdown]
# *Takeaway: the same gradients as one process, the same bubble as GPipe, and rank 0
# holds p micro-batches instead of m - the tracker's peak shows it.*
#
# ## 4. Interleaved 1F1B: more, smaller stages per rank
#
# Megatron-LM's interleaved schedule gives each rank v stages: rank r holds stages
# r, r + p, …, r + (v-1)·p, its **chunks** 0 … v-1. The pipeline is v times deeper but
# each stage v times shorter, so warm-up and cool-down shrink: bubble (p-1)/(v·m+p-1),
# paid for with v times more messages.
#
# ### Exercise 4: interleaved 1F1B as data
#
# Order of a rank's forwards: micro-batches go in **rounds of p**; a rank runs the
# round's p forwards on chunk 0, then the same p on chunk 1, …, then the next round
# (depth first: a round reaches the last stage early, so gradients come back early).
# Its backwards walk the same rounds with the chunks in **reverse** (the last stage's
# gradients come first). Then the 1F1B pattern: a warm-up of forwards, one forward / one
# backward, a cool-down. The warm-up must cover the rank's other chunks of the first
# round plus the trip of the first gradient back to it. Here m is a multiple of p.
# Target: the formula's bubble, and no rank holding more micro-batches than the
# library's plan does.

# %%
def my_interleaved(p: int, m: int, v: int) -> dict[int, list[str]]:
    """Interleaved 1F1B: rank r runs stages r, r + p, ...; per rank, f"{stage}F{mb}" / f"{stage}B{mb}" actions."""
    order = {}
    for r in range(p):
        # BEGIN SOLUTION
        # HINT: Number the rank's forwards j = 0 ... v*m - 1 and write which (chunk, micro-batch) the j-th one
        # HINT: is; the j-th backward is the same with the chunks counted from the last. Then reuse 1F1B's
        # HINT: warm-up / steady / cool-down loop; too short a warm-up shows up as a backward before its forward.
        def chunk_and_mb(j):
            return j // p % v, j // (p * v) * p + j % p
        fwd = [f"{r + k * p}F{i}" for k, i in map(chunk_and_mb, range(v * m))]
        bwd = [f"{r + (v - 1 - k) * p}B{i}" for k, i in map(chunk_and_mb, range(v * m))]
        w = min(v * m, (v - 1) * p + 2 * (p - 1 - r))
        acts = fwd[:w]
        for j in range(v * m - w):
            acts += [fwd[w + j], bwd[j]]
        order[r] = acts + bwd[v * m - w:]
        # END SOLUTION
    return order


# %%
# CHECK: my_interleaved is valid, has the bubble (p-1)/(v*m+p-1) and holds no more than the library's plan
check.interleaved(my_interleaved)

# %% [markdown]
# Your plan on paper (`a` = a rank's first stage, `b` its second), then on the ranks: the
# GPT cut into 2P stages, two per rank, at m = 2P, beside your 1F1B at the same m.

# %%
# NBVAL_CHECK_OUTPUT
def my_interleaved_plan(p, m, v):
    return Plan("my interleaved", p, m, v,
                {r: [Action.parse(a) for a in acts] for r, acts in my_interleaved(p, m, v).items()})


print(my_interleaved_plan(4, 8, 2).table())
print(f"bubble {my_interleaved_plan(4, 8, 2).bubble():.1%}, 1F1B's {make_plan('1f1b', 4, 8).bubble():.1%}")

# %%
inter_runs = launch(run_pipeline, P, [my_interleaved_plan(P, 2 * P, 2)], timeout=120)
worst = max(((g - ref[n].grad).norm() / ref[n].grad.norm()).item() for rank_result in inter_runs
            for n, g in rank_result[0][1].items())
k = MS.index(2 * P) if 2 * P in MS else None
print(f"your interleaved 1F1B on {P} ranks (v=2, m={2 * P}): largest relative gradient difference {worst:.1e}; "
      f"measured bubble {my_measured_bubble([rr[0][0] for rr in inter_runs]):.1%}"
      + (f", your 1F1B's {my_measured_bubble([rr[k][0] for rr in one_f_runs]):.1%}" if k is not None else ""))
plot.pipeline_schedule(my_interleaved_plan(P, 2 * P, 2), [rr[0][0] for rr in inter_runs],
                       title="your interleaved 1F1B: planned (top) and measured (bottom)")

# %% [markdown]
# *Takeaway: on paper interleaving divides the bubble by v. Measured on CPU the gain is
# smaller: each stage is half as long but sends as many messages, and a message costs real
# time here; on GPUs with fast links the measured figure sits closer to the paper's.*
#
# Move the knobs of any schedule: the diagram, the bubble and the peak activations come
# from the plan alone (hatched bars: a rank's second stage).

# %%
def explore(schedule="interleaved", p=4, m=8, v=2):
    """Draw a plan; print its bubble beside the formula and its peak activations per rank."""
    v = v if schedule in ("interleaved", "zero-bubble") else 1
    try:
        plan = make_plan(schedule, p, m, v)
    except ValueError as err:
        print(err)
        return None
    formula = estimate.pipeline_bubble_fraction(p, m, v)
    print(f"{schedule}: bubble {plan.bubble():.1%} (formula (p-1)/(v*m+p-1) = {formula:.1%}); "
          f"peak activations per rank, in micro-batches of a whole rank's layers: {plan.peak_activations()}")
    return plot.pipeline_schedule(plan)


widgets.interact(explore, schedule=["gpipe", "1f1b", "interleaved", "zero-bubble"],
                 p=widgets.IntSlider(4, 1, 8), m=widgets.IntSlider(8, 1, 32), v=widgets.IntSlider(2, 1, 4));

# %%
explore("interleaved", p=4, m=8, v=2)

# %% [markdown]
# *Takeaway: interleaving divides the bubble by v; for m < p no schedule hides it.*
#
# ## 5. Zero bubble: split the backward
#
# A backward computes two things: the gradient of the stage's **input** (I), which the
# previous stage is waiting for, and the gradient of its **weights** (W), which nobody
# needs before the optimizer step. Zero-bubble pipelines (Qi et al. 2024) run I at B's
# place and move each W into a slot where the rank would otherwise wait. On paper
# F = I = W = 1 unit. The executor implements the split: I is one autograd pass to the
# stage input *and* to each layer's output; W is `autograd.grad(layer_output,
# layer.weights, grad)` per layer, which walks only that layer's own nodes.
#
# ### Exercise 5: a zero-bubble schedule
#
# Start from 1F1B with each `B` replaced by `I`; every `I` now owes a `W` of the same
# micro-batch. Place the W's so that the bubble is below 1F1B's while no rank holds more
# micro-batches than 1F1B's rank 0 does (p): a micro-batch's activations are freed by
# its W. Target, for m >= p: ZB-H1's (p-1)/(3m+p-1), a third of 1F1B's. (Running each W
# right after its I already helps a little - the previous stage gets I sooner - but
# fills no idle slot.)

# %%
def my_zero_bubble(p: int, m: int) -> dict[int, list[str]]:
    """1F1B's order with B split into I (in B's place) and W (deferred), per rank."""
    order = {}
    for r in range(p):
        # BEGIN SOLUTION
        # HINT: In the cool-down rank 0 waits longest for each I from downstream, and the last rank
        # HINT: never waits. Which ranks have idle slots to fill, and how many W's should each keep
        # HINT: in hand to fill them? A rank may hold up to p micro-batches (1F1B's rank 0 does).
        w = min(p - 1 - r, m)
        acts = [f"{r}F{i}" for i in range(w)]
        steady = [[f"{r}F{w + i}", f"{r}I{i}"] for i in range(m - w)] + [[f"{r}I{i}"] for i in range(m - w, m)]
        for i, group in enumerate(steady):
            acts += group + ([f"{r}W{i - r}"] if i >= r else [])  # rank r runs each W r micro-batches late
        acts += [f"{r}W{i}" for i in range(max(0, m - r), m)]
        order[r] = acts
        # END SOLUTION
    return order


# %%
# CHECK: my_zero_bubble is valid, splits B into I and W, beats 1F1B's bubble within 1F1B's memory
check.zero_bubble(my_zero_bubble)

# %%
zb = Plan("my zero bubble", P, 2 * P, 1,
          {r: [Action.parse(a) for a in acts] for r, acts in my_zero_bubble(P, 2 * P).items()})
print(validate(zb).table())
zb_runs = launch(run_pipeline, P, [zb], timeout=120)
worst = max(((g - ref[n].grad).norm() / ref[n].grad.norm()).item() for rank_result in zb_runs
            for n, g in rank_result[0][1].items())
print(f"your zero-bubble plan on {P} ranks: largest relative gradient difference to one process {worst:.1e}")
plot.pipeline_schedule(zb, [rank_result[0][0] for rank_result in zb_runs],
                       title="your zero bubble: planned (top) and measured (bottom)")

# %% [markdown]
# *Takeaway: W fills what was the cool-down bubble; on CPU the measured gain is smaller
# than on paper because W is cheaper than a third of a backward here and the messages
# cost real time.*
#
# ## 6. The same API as `torch.distributed.pipelining`
#
# `minifsdp.pipeline` takes PyTorch's names and arguments, so a script written for
# `torch.distributed.pipelining` runs by changing one import:
#
# ```python
# from minifsdp.pipeline import PipelineStage, Schedule1F1B   # was: torch.distributed.pipelining
# stage = PipelineStage(stage_module, rank, world_size, device)
# schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
# schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
# ```
#
# `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B(stages, ...)`,
# `ScheduleInterleavedZeroBubble(stages, ...)`; the trainer runs them too:
# `python -m minifsdp.train --strategy pp --pp 2 --micro-batches 8 --schedule zero-bubble`,
# and `--strategy pp+dp --pp 2 --dp 2` for pipelines inside data-parallel replicas.
# The tests run one script both ways and compare losses and gradients.

# %%
print(f"notebook compute time: {time.perf_counter() - notebook_start:.0f} s")
