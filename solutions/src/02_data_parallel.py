# Lab 02 - data parallel. Source of solutions/02_data_parallel.ipynb and
# labs/02_data_parallel.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 02 - Data parallel: one model, many batches
#
# Every rank keeps a **full copy of the model** and gets a **different slice of the batch**;
# the gradients are **averaged** across ranks, so every copy takes the same step.
#
# **You will be able to**: build the mechanism of PyTorch's `DistributedDataParallel` -
# gradient hooks, then buckets whose asynchronous all-reduce overlaps backward; prove it
# equals one process; count its bytes; accumulate gradients with `no_sync()`.
#
# **Prerequisites**: lab 00 (collectives, `launch`, the tracer), lab 01 (Ψ, gradients).
#
# **Time**: about 75 minutes of work. The cells compute for about 1 minute on a laptop
# (2-4 CPU ranks, gloo), about as long on GPUs (more ranks than GPUs run on the CPU).
#
# **Symbols**: Ψ = the number of parameters; fp32 gradients take 4Ψ bytes, and one
# all-reduce of them moves 2·4Ψ bytes (ring: 2(N-1)/N ≈ 2 times the buffer). N = the world size.

# %%
import contextlib
import statistics
import tempfile
import time

import ipywidgets as widgets
import torch
from IPython.display import display

from minifsdp import comm, data, dist, launch, models, plot, trace
from minifsdp.ddp import DistributedDataParallel
from minifsdp.labcheck import lab02 as check
from minifsdp.train import TrainConfig, train

# Small models: one compute thread per process is as fast as several and does not
# slow to a crawl when several processes share the cores (launch() does the same in ranks).
torch.set_num_threads(1)
notebook_start = time.perf_counter()
MiB = 2**20
N2 = 2  # the lessons' runs use 2 ranks; with fewer GPUs, launch runs them on the CPU and says so

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
# because the gradient is linear. So each rank computes the gradient of *its own* mean
# loss, an **all-reduce** sums the N gradients on every rank, and dividing by N gives every
# rank the gradient of the whole batch. That holds only if every rank computed its gradient
# **at the same weights**: the ranks must start from the same parameters (a **broadcast**
# from rank 0), and then they stay equal because they all take the same step.

# %% [markdown]
# ### Exercise 1: data parallel from gradient hooks
#
# PyTorch's DDP leaves your training loop alone: it hooks into autograd.
# `p.register_post_accumulate_grad_hook(fn)` makes autograd call `fn(p)` as soon as `p.grad`
# is complete in a backward pass.
#
# **Goal**: `make_data_parallel(model)` returns `model`, changed so that the plain loop -
# `lm_loss(model(x), y).backward()` on each rank's slice - leaves on every rank the gradient
# one process computes on the whole batch. Each rank built its model with its own seed, as
# independent programs would.
#
# **Target**: the single-process gradients (to fp32 rounding) at 2 and 4 ranks, and
# **2·4Ψ bytes** all-reduced per step, inside backward. Use `comm.broadcast(t, src=0)` and
# `comm.all_reduce(t)` (a sum, in place) from lab 00: the tracer counts what they send.
#
# Stuck? `check.hint("make_data_parallel")` prints the next hint, one at a time (every
# exercise has them).

# %%
def make_data_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Returns ``model``, with rank 0's weights on every rank and every gradient averaged over ranks
    by autograd hooks as backward produces it."""
    world = dist.world_size()
    # BEGIN SOLUTION
    # HINT: same weights everywhere, gradients averaged from hooks. More: check.hint('make_data_parallel')
    with torch.no_grad():
        for p in model.parameters():
            comm.broadcast(p, src=0)

    def average_gradient(p: torch.Tensor) -> None:
        comm.all_reduce(p.grad)
        p.grad.div_(world)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average_gradient)
    # END SOLUTION
    return model


# %%
# CHECK: your hooks give every rank the single-process gradient, with 2·4Ψ bytes all-reduced per step
check.hook_ddp(make_data_parallel)

# %% [markdown]
# That is `minifsdp.ddp.NaiveDataParallel` (picotron's `DataParallelNaive` is the
# same). It moves the minimum - every gradient once, 2·4Ψ bytes - but each all-reduce
# is **blocking**: backward stops while one small tensor is on the wire, once per
# parameter tensor, and every message pays a fixed latency (lab 00's α in α + S/B).
#
# ## 2. Buckets, and communication overlapped with backward
#
# PyTorch's DDP (Li et al., *PyTorch Distributed*, VLDB 2020) makes two changes:
#
# * **buckets**: gradients are packed into flat buffers of about `bucket_cap_mb` MiB and
#   all-reduced one bucket at a time: a few large messages instead of many small ones;
# * **overlap**: buckets are filled in **reverse** parameter order, because backward
#   produces the last layer's gradients first. When a bucket is full its all-reduce
#   starts *asynchronously* (`async_op=True` returns a handle at once) and backward goes
#   on computing earlier layers; after backward, DDP only waits for the handles.

# %% [markdown]
# ### Exercise 2: the bucket layout
#
# **Goal**: `bucket_layout(params, cap_bytes)` returns the buckets as a list of lists of
# parameter indices, laid out by torch's rule:
#
# * every index is in exactly one bucket, and the first bucket holds the **last** parameters
#   (the order in which backward produces their gradients);
# * a bucket is closed as soon as its gradients' bytes **reach** `cap_bytes`, so it
#   overshoots the cap by less than its last tensor; the last bucket may be smaller.
#
# **Target**: torch's layout of `gpt-mini`'s parameters at five caps, from 1 B to 100 MiB.

# %%
def bucket_layout(params: list, cap_bytes: int) -> list[list[int]]:
    """Returns the buckets, each a list of indices into ``params``, by torch's rule: reverse order,
    a bucket closed when its bytes reach ``cap_bytes``."""
    # BEGIN SOLUTION
    # HINT: buckets of about cap_bytes, last parameters first. More: check.hint('bucket_layout')
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


mini = models.build_model("gpt-mini", seed=0)
mini_names = [n for n, _ in mini.named_parameters()]
for cap in (0.25, 1.0, 4.0):
    layout = bucket_layout(list(mini.parameters()), int(cap * MiB))
    print(f"cap {cap:>4} MiB: {len(layout):>2} buckets; the first holds {[mini_names[i] for i in layout[0]][:3]}")

# %%
# CHECK: your layout equals torch's rule at five bucket caps
check.bucket_layout(bucket_layout)

# %% [markdown]
# ### Exercise 3: buckets whose all-reduce overlaps backward
#
# `BucketedDDP(model, bucket_cap_mb)` comes with its skeleton: the constructor broadcasts
# the weights, lays out the buckets with your `bucket_layout`, and hooks every parameter to
# call `grad_ready(i)` when its gradient is complete. The loop calls
# `finish_gradient_sync()` after `backward()`. You write:
#
# * `__init__`: what `slice_of` reads - `self.flat[k]`, bucket `k`'s flat fp32 buffer, on
#   `dist.device()` (NCCL takes GPU tensors only), and `self.offset[i]`;
# * `grad_ready(i)`: the gradient into its bucket; a bucket's all-reduce **starts** the moment
#   the bucket is complete (`async_op=True` returns a handle), without waiting for it;
# * `finish_gradient_sync()`: returns when every `p.grad` holds the average over ranks, with
#   the object ready for the next step.
#
# **Target**: the single-process gradients at 2 and 4 ranks, **2·4Ψ bytes** and **one
# all-reduce per bucket** per step, every bucket launched before backward ends.

# %%
class BucketedDDP:
    """Gradients averaged in buckets; each bucket's async all-reduce starts when its last gradient arrives."""

    def __init__(self, model: torch.nn.Module, bucket_cap_mb: float):
        self.params = list(model.parameters())
        self.world = dist.world_size()
        with torch.no_grad():
            for p in self.params:
                comm.broadcast(p, src=0)
        self.buckets = bucket_layout(self.params, int(bucket_cap_mb * MiB))
        self.bucket_of = {i: k for k, bucket in enumerate(self.buckets) for i in bucket}
        self.pending = [len(bucket) for bucket in self.buckets]  # gradients still missing, per bucket
        self.handles = []                                         # (bucket, handle) in flight
        # BEGIN SOLUTION
        # HINT: self.flat (a buffer per bucket) and self.offset. More: check.hint('BucketedDDP')
        self.flat = [torch.zeros(sum(self.params[i].numel() for i in bucket), device=dist.device())
                     for bucket in self.buckets]
        self.offset = {}
        for bucket in self.buckets:
            start = 0
            for i in bucket:
                self.offset[i] = start
                start += self.params[i].numel()
        # END SOLUTION
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self.grad_ready(i))

    def slice_of(self, i: int) -> torch.Tensor:
        """Parameter i's slice of its bucket's flat buffer, shaped like the parameter (a view)."""
        p, start = self.params[i], self.offset[i]
        return self.flat[self.bucket_of[i]][start:start + p.numel()].view_as(p)

    @torch.no_grad()
    def grad_ready(self, i: int) -> None:
        """Autograd finished parameter i's gradient: it goes into its bucket; a complete bucket's async
        all-reduce starts now. Returns None."""
        # BEGIN SOLUTION
        # HINT: into the bucket; a complete bucket starts its all-reduce. More: check.hint('BucketedDDP')
        k = self.bucket_of[i]
        self.slice_of(i).copy_(self.params[i].grad)
        self.pending[k] -= 1
        if self.pending[k] == 0:
            self.handles.append((k, comm.all_reduce(self.flat[k], async_op=True)))
        # END SOLUTION

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """After backward: returns when every p.grad holds the average over ranks, ready for the next step."""
        # BEGIN SOLUTION
        # HINT: averages into every p.grad, ready for the next step. More: check.hint('BucketedDDP')
        for k, handle in self.handles:
            handle.wait()
            self.flat[k].div_(self.world)
            for i in self.buckets[k]:
                self.params[i].grad.copy_(self.slice_of(i))
        self.handles = []
        self.pending = [len(bucket) for bucket in self.buckets]
        # END SOLUTION


# %%
# CHECK: single-process gradients at 2 and 4 ranks, 2·4Ψ bytes per step, buckets launched during backward
# FIGURE: your timeline above the library's
check.bucketed_ddp(BucketedDDP)

# %% [markdown]
# On your timeline (top; time in ms), each bucket's `all_reduce` bar starts inside `backward` -
# the moment its last gradient arrived - and ends in `sync`, where `finish_gradient_sync`
# waited for it: the network had work while backward was still computing. The library's
# `DistributedDataParallel` (bottom) does the same, its wait labelled `ddp.wait`.
# Takeaway: the same bytes as the naive version, in a few messages that travel while
# backward computes.

# %% [markdown]
# ### Bucket size against overlap
#
# Move the slider and press **run**: two ranks run three steps of `gpt-mini` with your
# `BucketedDDP` at that cap, and the timeline shows the last step. One tiny bucket per
# tensor pays the per-message cost many times; one huge bucket cannot start before the whole
# backward is done, so nothing overlaps. (On a 2-core CPU, compute and gloo's threads share
# the cores, so times here are noisy and the gain is modest; on GPUs NCCL runs on its own
# stream and the overlap hides most of the communication.)

# %%
def explore_bucket_size(bucket_cap_mb: float = 1.0) -> plot.Figure:
    """Your BucketedDDP on gpt-mini, N2 ranks, 3 steps at this cap: prints its overlap, returns the last step's timeline."""
    rep, fig = check.bucket_run(BucketedDDP, bucket_cap_mb, N2, steps=3, model_name="gpt-mini", batch=GLOBAL_BATCH)
    print(f"cap {bucket_cap_mb:g} MiB: {rep['all_reduces']} all-reduces per step, {rep['launched_in_backward']} "
          f"launched during backward, {rep['in_flight_at_backward_end']} still in flight when it ended; "
          f"step {rep['step_ms']:.0f} ms, backward {rep['backward_ms']:.0f} ms (rank 0)")
    return fig


cap_slider = widgets.FloatLogSlider(value=1.0, base=2, min=-4, max=5, step=1, description="bucket cap (MiB)",
                                    style={"description_width": "initial"}, layout=widgets.Layout(width="520px"))
run_button = widgets.Button(description="run")
run_output = widgets.Output()


def show_run(_button=None) -> None:
    with run_output:
        run_output.clear_output(wait=True)
        display(explore_bucket_size(cap_slider.value))


run_button.on_click(show_run)
widgets.VBox([cap_slider, run_button, run_output])

# %% [markdown]
# The same function, called plainly (what the slider runs):

# %%
# FIGURE
explore_bucket_size(0.25)

# %% [markdown]
# Takeaway: with a middle-sized cap most buckets leave during backward; at a 32 MiB cap
# (larger than gpt-mini's 13 MiB of gradients) there is one bucket, launched only when
# backward is over.
#
# ## 3. Gradient accumulation and `no_sync()`
#
# To train with a batch larger than fits in memory, run k micro-batches, let the gradients
# add up in `p.grad`, and step once. With data parallel, all-reducing after every
# micro-batch is wasted work: averaging is linear, so *one* all-reduce of the accumulated
# sum, after the last micro-batch, gives the same result for 1/k of the traffic.
#
# `model.no_sync()` is a context manager that turns the DDP's all-reduce off for what runs
# inside it. The catch: PyTorch's DDP decides **in `forward`** whether the coming backward
# will synchronise, and `minifsdp.ddp.DistributedDataParallel` copies that behaviour.

# %% [markdown]
# ### Exercise 4: accumulate with one all-reduce per step
#
# **Goal**: `accumulation_step(model, micro_batches)` - `model` is a
# `DistributedDataParallel`, `micro_batches` a list of k `(x, y)` pairs, one forward each -
# returns None and leaves in every `p.grad` the gradient of the mean loss over the whole
# global batch: all k micro-batches on all ranks.
#
# **Target**: exactly one all-reduce of the gradients per step, **2·4Ψ bytes**, sent by the
# model itself (its buckets), and the single-process gradient. The check runs it on 2 and 4
# ranks with k = 4 and counts the bytes with the tracer.

# %%
ACCUM, ACC_BATCH = 4, 16   # micro-batches per step; global batch (2 ranks x 4 micro-batches x 2 sequences)


def accumulation_step(model: DistributedDataParallel, micro_batches: list) -> None:
    """One step's backward over k micro-batches: returns None; afterwards every p.grad holds the gradient
    of the mean loss over all micro-batches of all ranks, after one all-reduce of the gradients."""
    k = len(micro_batches)
    # BEGIN SOLUTION
    # HINT: the whole batch's gradient, one all-reduce in all. More: check.hint('accumulation_step')
    with model.no_sync():
        for x, y in micro_batches[:-1]:
            (models.lm_loss(model(x), y) / k).backward()
    x, y = micro_batches[-1]
    (models.lm_loss(model(x), y) / k).backward()
    # END SOLUTION


# %%
# CHECK: one all-reduce (2·4Ψ bytes) for k micro-batches, and the gradient of the whole global batch
check.accumulation(accumulation_step, ACCUM, ACC_BATCH)

# %% [markdown]
# What goes wrong with the other ways of writing the loop? Four loops on 2 ranks, each run
# with `minifsdp`'s DDP and with PyTorch's. For ours, the tracer counts the all-reduce
# bytes of each micro-step; PyTorch's DDP does not go through `comm`, so we count its
# bytes with a **communication hook** (`register_comm_hook`, the official way to see or
# replace what DDP sends): the hook sees each bucket, records its size, and calls
# PyTorch's default all-reduce hook. Bytes are in the ZeRO paper's units for both (2x the bucket).
# (This cell shows the exercise's answer among its variants: it comes after the check.)

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


accum_runs = {name: launch(accumulate, N2, v, ACCUM, ACC_BATCH, SEQ, timeout=120) for name, v in VARIANTS.items()}

# %%
# NBVAL_CHECK_OUTPUT
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4   # fp32: the all-reduce adds per-rank means in another order
acc_ref = models.build_model("gpt-tiny", seed=0)   # one process, the whole global batch of 16 sequences
xa, ya = data.get_batch(0, ACC_BATCH, SEQ)
models.lm_loss(acc_ref(xa), ya).backward()
acc_ref_grads = {n: p.grad for n, p in acc_ref.named_parameters()}
psi = models.count_parameters(acc_ref)   # Ψ, the number of parameters


def same(a, b):
    return all(torch.allclose(a[n], b[n], atol=GRAD_ATOL, rtol=GRAD_RTOL) for n in a)


KiB = 1024
print(f"{N2} ranks, {ACCUM} micro-batches. Ψ = {psi:,} parameters: one all-reduce of every fp32 gradient "
      f"moves 2·4Ψ = {2 * 4 * psi / KiB:.1f} KiB")
print(f"{'loop':<37} {'impl':<8} {'all-reduce KiB per micro-step':<30} {'= 1 process?':>12} {'ranks agree?':>12}")
for name, res in accum_runs.items():
    for impl in ("minifsdp", "torch"):
        mine, other = res[0][impl], res[1][impl]
        kib = "[" + ", ".join(f"{b / KiB:.1f}" for b in mine["bytes"]) + "]"
        print(f"{name if impl == 'minifsdp' else '':<37} {impl:<8} {kib:<30} "
              f"{str(same(mine['grads'], acc_ref_grads)):>12} {str(same(mine['grads'], other['grads'])):>12}")

# %% [markdown]
# * Syncing every micro-batch is *correct* (the result equals one process) but moves
#   2·4Ψ bytes per micro-batch: k times the traffic.
# * Forward and backward inside `no_sync()` for all but the last: one 2·4Ψ all-reduce per
#   step, same gradients.
# * Only `backward()` inside: the forward had already armed the all-reduce, so every
#   micro-batch pays 2·4Ψ anyway. Nothing is wrong with the numbers; the step is just slow.
# * The last forward inside `no_sync()`: no all-reduce ever happens, each rank keeps its
#   own gradient, and the replicas silently drift apart from the first optimizer step.
#   Nothing raises: only a gradient or parameter check like the ones in this lab catches it.
#
# PyTorch's DDP rows match ours line for line: the same bytes in the same micro-steps,
# and the same gradients.

# %% [markdown]
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
CMP_STEPS, CMP_MODEL = 5, "gpt-mini"
strategies = ["single", "ddp-naive", "ddp", "torch-ddp"]
metrics = {}
for s in strategies:
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(strategy=s, world_size=1 if s == "single" else N2, model=CMP_MODEL, steps=CMP_STEPS,
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
# FIGURE: the loss curves and step times of the four strategies
# The trainer's parity contract, asserted
LOSS_TOL = 1e-5   # fp32, per step, after AdamW steps (tests/test_train.py uses the same kind of bound)
for s in strategies[1:]:
    diff = max(abs(a - b) for a, b in zip(metrics[s]["losses"], metrics["single"]["losses"]))
    assert diff < LOSS_TOL, f"{s} drifted from the single-process losses by {diff:.2e} (tolerance {LOSS_TOL})"
print(f"all strategies reproduce the single-process losses within {LOSS_TOL}")

fig, (ax1, ax2) = plot.column_figure(ncols=2, height=3.4)
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
fig

# %% [markdown]
# Takeaway (left: loss in nats per token against the step; right: median step time in ms):
# every data-parallel strategy follows the single-process loss curve step by step.
# The losses agree to float rounding (the cell above printed the largest difference).
# Compare the step times printed above with care: `single` uses one process for the
# whole batch, the others two processes on a shared CPU, and the smaller the model the
# more the fixed per-message cost of communication weighs.

# %% [markdown]
# ## What you have seen
#
# * Data parallel = same weights everywhere (broadcast once) + a different slice of the
#   batch per rank + the **average** of the gradients (all-reduce, then / N). It is exact:
#   the gradients equal one process on the whole batch to float rounding.
# * It costs 2·4Ψ bytes of communication per step, and a full copy of parameters, gradients and
#   optimizer state on every rank (lab 01). Lab 03 (ZeRO) removes those copies.
# * Buckets turn many small messages into a few large ones, and reverse-order buckets
#   let the all-reduce run while backward is still computing.
# * `no_sync()` must wrap forward **and** backward of every micro-batch but the last.

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
