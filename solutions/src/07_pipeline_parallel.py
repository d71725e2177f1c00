# Lab 07 - pipeline parallel. Source of solutions/07_pipeline_parallel.ipynb and
# labs/07_pipeline_parallel.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 07 - Pipeline parallel: GPipe, 1F1B, interleaved, zero bubble
#
# Labs 02-04 split the data (then the model's state) over ranks; each rank still ran
# every layer. **Pipeline parallelism** splits the model *by layers* into **stages**, one
# per rank: activations flow forward, gradients flow back. Ranks idle while they wait -
# the **bubble** - and the **schedule** (the order of a rank's forwards F and backwards
# B of each **micro-batch**) decides how much.
#
# **You will be able to**: write the 1F1B, interleaved 1F1B and zero-bubble schedules as
# data, on their bubble and memory targets; write the executor that runs a plan on
# ranks with one process's gradients; read a bubble off a trace.
#
# **Prerequisites**: labs 00 (ranks, send/recv) and 01 (activation memory).
# **Time**: about 60 minutes of work; about a minute of compute on a laptop (2 CPU
# ranks), as long on a GPU VM (2 ranks on any machine).

# %% [markdown]
# **Exercises**: 1. 1F1B as data · 2. an executor that runs your plan · 3. interleaved
# 1F1B · 4. a zero-bubble schedule. Each states its goal and its target; when stuck,
# `check.hint("my_1f1b")` (the exercise's function name) prints the next hint, one at a time.
#
# Symbols: p = pipeline stages (ranks), m = micro-batches per step, v = stages per rank
# (interleaved). In plans, `"1F3"` is stage 1's forward of micro-batch 3 (torch's notation).

# %%
import contextlib
import time

import ipywidgets as widgets
import torch
from IPython.display import display

from minifsdp import comm, data, dist, estimate, launch, models, plot, trace
from minifsdp.labcheck import lab07 as check
from minifsdp.memory import MemoryTracker
from minifsdp.pipeline import (Action, Plan, PipelineStage, ScheduleFromPlan, make_plan, measured_bubble, split_gpt,
                               validate)

torch.set_num_threads(1)
notebook_start = time.perf_counter()
P = 2     # ranks that run (2 GPUs, or 2 CPU processes where the machine has fewer); plans on paper go to p = 8
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


# %% [markdown]
# **Predict first**: on 2 ranks, with one micro-batch and a backward that costs about two
# forwards, what fraction of the rank-time is idle? Then run it:

# %%
# FIGURE
naive = launch(run_pipeline, P, [make_plan("gpipe", P, 1)], timeout=120)
traces = [rank_result[0][0] for rank_result in naive]
plot.timeline(traces, title=f"naive model parallel: {MODEL} cut in {P}, one micro-batch")

# %% [markdown]
# The top lane of each rank is compute, the bottom one communication: a long `recv`
# is a rank waiting for its neighbour. *Takeaway: with one micro-batch only one rank
# works at a time.*
#
# The **measured bubble** is the idle fraction of rank-time: from the first forward or
# backward of any rank to the last, times the number of ranks, minus the time spent
# computing, over that total. Waiting in a `recv` counts as idle; the formula for p
# stages and m micro-batches is (p-1)/(m+p-1).

# %%
print(f"naive model parallel on {P} ranks: measured bubble {measured_bubble(traces):.0%} "
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
# Now measured: GPipe on P ranks at m = 1, 2, 4, 8, the measured bubble of each trace
# beside the plan's and the formula's.

# %%
# FIGURE
MS = (1, 2, 4, 8)
gpipe_runs = launch(run_pipeline, P, [make_plan("gpipe", P, m) for m in MS], timeout=180)
print(f"{'m':>3}  {'measured':>9}  {'plan':>6}  {'formula':>8}")
for k, m in enumerate(MS):
    measured = measured_bubble([rank_result[k][0] for rank_result in gpipe_runs])
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
# 1F1B (PipeDream-Flush; torch's `Schedule1F1B`) runs each backward as soon as it can,
# so that a micro-batch's activations are freed early. Each rank goes through three
# phases: a **warm-up** of forwards only, while no gradient can have come back to it
# yet; a **steady state** where every forward is paired with a backward, the oldest
# micro-batch in flight first; a **cool-down** that finishes the backwards still owed.
# The last rank needs no warm-up; the first rank the longest one.

# %% [markdown]
# ### Exercise 1: write 1F1B as data
#
# **Goal**: `my_1f1b(p, m)` returns the 1F1B plan, `{rank: [action, ...]}` for ranks
# 0 … p-1, one stage per rank (stage r on rank r); an action is the string
# `f"{stage}F{mb}"` or `f"{stage}B{mb}"`. Leave out the messages: `validate` inserts each
# receive before the action that needs it and each send after the one that produced it.
#
# **Target**: a valid plan (every m, including m < p) with GPipe's bubble (p-1)/(m+p-1),
# where rank r never holds more than min(m, p - r) micro-batches at once (GPipe: m).
#
# Stuck? `check.hint("my_1f1b")` gives the next hint; run it again for the one after.

# %%
def my_1f1b(p: int, m: int) -> dict[int, list[str]]:
    """The 1F1B plan: per rank, the ordered compute actions ("0F1", "0B0", ...)."""
    order = {}
    for r in range(p):
        # BEGIN SOLUTION
        # HINT: warm-up, one F / one B, cool-down, per rank. check.hint("my_1f1b") for more
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
# ### Exercise 2: run a plan yourself
#
# A plan is a list; running it is a loop. `plan.with_comms()` is the plan with its
# messages: `RECV_F` (an activation from the previous rank) before a forward that needs
# it, `SEND_F` (to the next rank) after it; `RECV_B` (the gradient of this stage's
# output, from the next rank) before a backward, `SEND_B` (the gradient of its input, to
# the previous rank) after it.
#
# **Goal**: `my_run_plan(stage_module, actions, x, y, m)` runs one rank's list for one
# step and returns the last rank's m losses in micro-batch order (`[]` elsewhere).
# Building blocks: `comm.recv(buffer, src)` fills a buffer (blocking),
# `comm.isend(tensor, dst)` returns a handle to wait on, `models.lm_loss(logits, targets)`.
#
# **Target**: on 2 ranks, GPipe's and 1F1B's gradients equal one process's on the whole
# batch (relative difference < 1e-5), and under 1F1B rank 0's activations peak below
# 0.9 × GPipe's. `check.hint("my_run_plan")` gives the next hint.

# %%
def my_run_plan(stage_module, actions, x, y, m):
    """Run this rank's lowered actions for one step; return the m losses on the last rank, else []."""
    rank, p = dist.rank(), dist.world_size()
    xs, ys = x.chunk(m), y.chunk(m)
    shape = (x.shape[0] // m, x.shape[1], stage_module.config.n_embd)  # what travels between stages
    inputs, outputs, grads, losses, sends = {}, {}, {}, [], []
    # BEGIN SOLUTION
    # HINT: one small step per action kind, then the step's gradient. check.hint("my_run_plan")
    for a in actions:
        i = a.mb
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
    for handle in sends:
        handle.wait()
    for q in stage_module.parameters():
        q.grad /= m
    # END SOLUTION
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
# FIGURE
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
# *Takeaway: the same gradients as one process, the same bubble as GPipe, and rank 0
# holds p micro-batches instead of m - the tracker's peak shows it.* And your 1F1B's
# measured bubble at m = 1, 2, 4, 8, beside GPipe's from section 2:

# %%
def my_plan(m):
    return Plan("my 1F1B", P, m, 1, {r: [Action.parse(a) for a in acts] for r, acts in my_1f1b(P, m).items()})


one_f_runs = launch(run_pipeline, P, [my_plan(m) for m in MS], timeout=180)
print(f"{'m':>3}  {'your 1F1B':>9}  {'GPipe':>6}  {'plan':>6}  {'formula':>8}   (measured, measured, both plans)")
for k, m in enumerate(MS):
    mine_measured = measured_bubble([rank_result[k][0] for rank_result in one_f_runs])
    gpipe_measured = measured_bubble([rank_result[k][0] for rank_result in gpipe_runs])
    print(f"{m:>3}  {mine_measured:9.1%}  {gpipe_measured:6.1%}  {my_plan(m).bubble():6.1%}  "
          f"{estimate.pipeline_bubble_fraction(P, m):8.1%}")

# %% [markdown]
# ## 4. Interleaved 1F1B: more, smaller stages per rank
#
# Megatron-LM's interleaved schedule gives each rank v stages: rank r holds stages
# r, r + p, …, r + (v-1)·p, its **chunks** 0 … v-1. The pipeline is v times deeper but
# each stage v times shorter, so warm-up and cool-down shrink: bubble (p-1)/(v·m+p-1),
# paid for with v times more messages. The order that gets there is **depth first**:
# micro-batches move in rounds of p, and a round goes through all of a rank's chunks
# before the next round starts, so the first gradients come back early. Backwards come
# back from the last stage, so a rank meets its chunks in reverse.

# %% [markdown]
# ### Exercise 3: interleaved 1F1B as data
#
# **Goal**: `my_interleaved(p, m, v)` returns `{rank: [action, ...]}` with actions
# `f"{stage}F{mb}"` / `f"{stage}B{mb}"`, rank r running stages r, r + p, … (m is a
# multiple of p here).
#
# **Target**: valid for every (p, m, v) the check tries, the bubble (p-1)/(v·m+p-1), and
# no rank holding more micro-batches' worth of its layers than the library's plan does.
# `check.hint("my_interleaved")` gives the next hint.

# %%
def my_interleaved(p: int, m: int, v: int) -> dict[int, list[str]]:
    """Interleaved 1F1B: rank r runs stages r, r + p, ...; per rank, f"{stage}F{mb}" / f"{stage}B{mb}" actions."""
    order = {}
    for r in range(p):
        # BEGIN SOLUTION
        # HINT: forwards and backwards in order, paced like 1F1B. check.hint("my_interleaved")
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
# Your plan on paper (hatched: a rank's second stage), then on the ranks: the GPT cut
# into 2P stages, two per rank, at m = 2P, beside your 1F1B at the same m.

# %%
# NBVAL_CHECK_OUTPUT
def my_interleaved_plan(p, m, v):
    return Plan("my interleaved", p, m, v,
                {r: [Action.parse(a) for a in acts] for r, acts in my_interleaved(p, m, v).items()})


print(my_interleaved_plan(4, 8, 2).table())
print(f"bubble {my_interleaved_plan(4, 8, 2).bubble():.1%}, 1F1B's {make_plan('1f1b', 4, 8).bubble():.1%}")

# %%
# FIGURE
inter_runs = launch(run_pipeline, P, [my_interleaved_plan(P, 2 * P, 2)], timeout=120)
worst = max(((g - ref[n].grad).norm() / ref[n].grad.norm()).item() for rank_result in inter_runs
            for n, g in rank_result[0][1].items())
k = MS.index(2 * P) if 2 * P in MS else None
print(f"your interleaved 1F1B on {P} ranks (v=2, m={2 * P}): largest relative gradient difference {worst:.1e}; "
      f"measured bubble {measured_bubble([rr[0][0] for rr in inter_runs]):.1%}"
      + (f", your 1F1B's {measured_bubble([rr[k][0] for rr in one_f_runs]):.1%}" if k is not None else ""))
plot.pipeline_schedule(my_interleaved_plan(P, 2 * P, 2), [rr[0][0] for rr in inter_runs],
                       title="your interleaved 1F1B: planned (top) and measured (bottom)")

# %% [markdown]
# *Takeaway: on paper interleaving divides the bubble by v. Measured on CPU the gain is
# smaller: each stage is half as long but sends as many messages, and a message costs real
# time here; on GPUs with fast links the measured figure sits closer to the paper's.*

# %% [markdown]
# ## 5. Zero bubble: split the backward
#
# A backward computes two things: the gradient of the stage's **input** (I), which the
# previous stage is waiting for, and the gradient of its **weights** (W), which nobody
# needs before the optimizer step. Zero-bubble pipelines (Qi et al. 2024) run I where B
# ran and move each W into a slot where the rank would otherwise wait. On paper
# F = I = W = 1 unit. A micro-batch's activations are freed only by its W, so a W held
# back costs memory. (The executor runs I as one autograd pass to the stage input and to
# each layer's output, and W per layer with `autograd.grad`, which walks only that
# layer's own nodes.)

# %% [markdown]
# ### Exercise 4: a zero-bubble schedule
#
# **Goal**: `my_zero_bubble(p, m)` returns `{rank: [action, ...]}` with actions
# `f"{stage}F{mb}"`, `f"{stage}I{mb}"`, `f"{stage}W{mb}"` (one stage per rank): 1F1B's
# order of forwards and input gradients, and every W placed by you.
#
# **Target**: valid; a bubble below 1F1B's for every m, and for m ≥ p at ZB-H1's
# (p-1)/(3m+p-1), a third of 1F1B's; no rank holding more micro-batches at once than
# 1F1B's rank 0 (p). A W right after its I is valid but fills no idle slot.
# `check.hint("my_zero_bubble")` gives the next hint.

# %%
def my_zero_bubble(p: int, m: int) -> dict[int, list[str]]:
    """1F1B's order with B split into I (in B's place) and W (placed to fill idle slots), per rank."""
    order = {}
    for r in range(p):
        # BEGIN SOLUTION
        # HINT: 1F1B with I for B; each W goes where the rank would idle. check.hint("my_zero_bubble")
        w = min(p - 1 - r, m)
        acts = [f"{r}F{i}" for i in range(w)]
        steady = [[f"{r}F{w + i}", f"{r}I{i}"] for i in range(m - w)] + [[f"{r}I{i}"] for i in range(m - w, m)]
        for i, group in enumerate(steady):
            acts += group + ([f"{r}W{i - r}"] if i >= r else [])
        acts += [f"{r}W{i}" for i in range(max(0, m - r), m)]
        order[r] = acts
        # END SOLUTION
    return order


# %%
# CHECK: my_zero_bubble is valid, splits B into I and W, beats 1F1B's bubble within 1F1B's memory
check.zero_bubble(my_zero_bubble)

# %%
# FIGURE
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
# ## 6. Every schedule, every knob
#
# Move the knobs: the diagram, the bubble and the peak activations come from the plan
# alone (hatched bars: a rank's second stage). A slider redraws when you let go of it.

# %%
def explore(schedule="interleaved", p=4, m=8, v=2):
    """Draw the library's plan; print its bubble beside the formula and its peak activations per rank."""
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


def _slider(label, value, low, high):
    return widgets.IntSlider(value, low, high, description=label, continuous_update=False,
                             style={"description_width": "initial"}, layout=widgets.Layout(width="560px"))


def _draw(**knobs):
    fig = explore(**knobs)
    if fig is not None:
        display(fig)


knobs = {"schedule": widgets.Dropdown(options=["gpipe", "1f1b", "interleaved", "zero-bubble"], value="interleaved",
                                      description="schedule", style={"description_width": "initial"}),
         "p": _slider("p (ranks)", 4, 1, 8), "m": _slider("m (micro-batches)", 8, 1, 32),
         "v": _slider("v (stages per rank)", 2, 1, 4)}
display(widgets.VBox(list(knobs.values())), widgets.interactive_output(_draw, knobs))

# %%
# FIGURE
explore("interleaved", p=4, m=8, v=2)

# %% [markdown]
# *Takeaway: interleaving divides the bubble by v and zero bubble fills the cool-down with
# W's; for m < p no schedule hides the bubble.*

# %% [markdown]
# ## 7. The same API as `torch.distributed.pipelining`
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
