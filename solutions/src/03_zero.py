# Lab 03 - ZeRO. Source of solutions/03_zero.ipynb and labs/03_zero.ipynb:
# edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 03 — ZeRO: shard the optimizer state, then the gradients
#
# Data parallelism (lab 02) keeps the parameters, gradients and AdamW state on every
# rank. ZeRO (Rajbhandari et al. 2020) removes that redundancy in stages.
#
# **You will be able to**: predict each ZeRO stage's bytes per rank and per step;
# build ZeRO-1 (ownership, a sharded AdamW, the owners' broadcast) and ZeRO-2's
# reduce-to-owner gradient hook, and show they train the same model as one process.
#
# **Prerequisites**: labs 00, 01 and 02.
#
# **Time**: about 60 minutes of work; about 20 s of compute on a laptop (CPU, 2 and 4
# `gloo` ranks) and about as long on a GPU VM (tiny models).
#
# **Exercises**: 1. ownership · 2. ZeRO-1 · 3. ZeRO-2's hook · 4. bytes per rank and per step.
#
# **Symbols**: `Ψ` = the number of parameters; `N` = the world size; bytes are `k·Ψ`
# with `k` bytes per parameter (fp32: `4Ψ`).

# %%
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch

import minifsdp
from minifsdp import comm, dist, estimate, models, plot
from minifsdp.labcheck import lab03 as check

# Small tensors: one compute thread per process is as fast, and several processes
# share the cores without OpenMP threads spinning against each other.
torch.set_num_threads(1)
MiB, GB, FP32 = 2**20, 1e9, 4
N4 = 4   # a machine with fewer GPUs runs the 4 ranks on the CPU (launch says so in one line)
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. The paper's picture: model states per device
#
# | stage | each rank keeps | FairScale / PyTorch name |
# |---|---|---|
# | ZeRO-1 | the optimizer state of the parameters it *owns* | `fairscale.optim.OSS`, `torch.distributed.optim.ZeroRedundancyOptimizer` |
# | ZeRO-2 | ... and only those parameters' gradients | `fairscale.nn.data_parallel.ShardedDataParallel`, FSDP `SHARD_GRAD_OP` |
# | ZeRO-3 | ... and only its shard of the parameters | FSDP `FULL_SHARD` (lab 04) |
#
# The paper trains in mixed precision: fp16 parameters and gradients (`k = 2`, so
# `2Ψ` bytes each) and `K = 12` bytes of optimizer state per parameter (fp32 master
# weights, momentum and variance).

# %% [markdown]
# Bytes on one rank (fp16 parameters and gradients, `k = 2`):
#
# | | parameters | gradients | optimizer state | total |
# |---|---|---|---|---|
# | DDP (stage 0) | `2Ψ` | `2Ψ` | `KΨ` | `(4 + K) Ψ` |
# | ZeRO-1 | `2Ψ` | `2Ψ` | `KΨ / N` | `4Ψ + KΨ / N` |
# | ZeRO-2 | `2Ψ` | `2Ψ / N` | `KΨ / N` | `2Ψ + (2 + K) Ψ / N` |
# | ZeRO-3 | `2Ψ / N` | `2Ψ / N` | `KΨ / N` | `(4 + K) Ψ / N` |
#
# In plain fp32 (what we run below) `k = 4` and AdamW's `K = 8` (two moments).
# `estimate.model_state_bytes_per_device` implements the table; here it is for a
# GPT-3 6.7B-shaped model (32 layers, width 4096) on 64 GPUs.

# %%
# NBVAL_CHECK_OUTPUT
big = models.GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)
PSI = estimate.gpt_param_count(big)
N_BIG, K = 64, 12
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
CATS = ("parameters", "gradients", "optimizer")


def model_states(stage: int, n: int) -> dict[str, float]:
    """The paper's setting: mixed-precision Adam, K = 12, no padding."""
    return estimate.model_state_bytes_per_device(PSI, n, stage, mixed_precision=True, padding=False)


big_rows = {name: model_states(stage, N_BIG) for stage, name in STAGES.items()}
print(f"Ψ = {PSI:,} parameters, N = {N_BIG} ranks, mixed-precision Adam (K = {K})")
print(f"{'':8}{'params GB':>11}{'grads GB':>10}{'optim GB':>10}{'total GB':>10}{'vs DDP':>8}")
for name, m in big_rows.items():
    print(f"{name:8}" + "".join(f"{m[c] / GB:>10.1f}" for c in CATS)
          + f"{m['total'] / GB:>10.1f}{m['total'] / big_rows['DDP']['total']:>8.1%}")

# %% [markdown]
# Left: where the bytes go at 64 ranks. Right: the total per device as the number of
# ranks grows, against the memory of one 80 GB accelerator (model states only:
# activations and temporaries come on top).

# %%
# FIGURE
ns = [2**i for i in range(11)]   # 1 .. 1024 ranks
fig, (ax_bar, ax_n) = plt.subplots(1, 2, figsize=(10, 3.6))
left = np.zeros(len(big_rows))
for cat in CATS:
    widths = np.array([m[cat] / GB for m in big_rows.values()])
    ax_bar.barh(list(big_rows), widths, left=left, color=plot.color_for(cat), label=cat)
    left += widths
ax_bar.invert_yaxis()
ax_bar.set_xlabel("model-state bytes per device (GB = 1e9 B)")
ax_bar.set_title(f"{PSI / 1e9:.1f}B parameters, N = {N_BIG}")
ax_bar.legend(fontsize=8)
for stage, name in STAGES.items():
    ax_n.plot(ns, [model_states(stage, n)["total"] / GB for n in ns], "o-", ms=3, label=name)
ax_n.axhline(80, color="k", ls="--", lw=1)
ax_n.text(2**5, 58, "80 GB: one accelerator", fontsize=8)
ax_n.set_xscale("log", base=2)
ax_n.set_yscale("log")
ax_n.set_xlabel("data-parallel ranks N")
ax_n.set_ylabel("model-state bytes per device (GB)")
ax_n.set_title("mixed-precision Adam, K = 12")
ax_n.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# *Takeaway: only ZeRO-3's curve keeps falling with `N`; every other stage flattens
# at the part it does not shard.*

# %%
# NBVAL_CHECK_OUTPUT
for stage, name in STAGES.items():
    fits = [n for n in ns if model_states(stage, n)["total"] <= 80 * GB]
    floor = {0: 16 * PSI, 1: 4 * PSI, 2: 2 * PSI, 3: 0}[stage]   # what N cannot divide
    print(f"{name:7} fits in 80 GB from N = {fits[0] if fits else 'never':>5};"
          f"  the part N does not divide: {floor / GB:6.1f} GB")

# %% [markdown]
# DDP never fits, however many ranks you add: every term is replicated. ZeRO-1
# removes the biggest term but flattens at the `2Ψ + 2Ψ` bytes of fp16 parameters
# and gradients every rank still holds; ZeRO-2 flattens at the `2Ψ` of fp16 parameters;
# only ZeRO-3 keeps falling.
#
# **Communication.** In the paper's accounting (section 7) ZeRO-1 and -2 move no
# more than DDP. DDP's all-reduce is a reduce-scatter plus an all-gather: `2·4Ψ`
# bytes of volume per step in fp32 (`2·2Ψ` in fp16). The paper's ZeRO reduce-scatters
# the gradients (`4Ψ`) and all-gathers the updated parameters (`4Ψ`): the same
# `2·4Ψ`. The ZeRO-1 you build below is FairScale's `OSS` on unchanged DDP: it
# all-reduces every gradient (`2·4Ψ`), *then* broadcasts each parameter from its
# owner (`4Ψ`): `3·4Ψ`, 1.5× DDP. Its ZeRO-2 sends each gradient to its owner only
# (`4Ψ`): back to `2·4Ψ`. Exercise 4 predicts these to the byte.

# %% [markdown]
# **Try it**: move the sliders (stage, world size); the bars are the bytes one rank
# holds, the dashed line one 80 GB accelerator. The cell after it makes the same
# call without the widget.

# %%
def zero_bytes_per_rank(stage: int = 2, world_size: int = 64) -> dict[str, float]:
    """Draw every stage's bytes per rank at ``world_size``, ``stage`` highlighted; return that stage's row."""
    rows = {name: model_states(s, world_size) for s, name in STAGES.items()}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = np.zeros(len(rows))
    for cat in CATS:
        widths = np.array([m[cat] / GB for m in rows.values()])
        bars = ax.barh(list(rows), widths, left=left, color=plot.color_for(cat), label=cat)
        for s, bar in zip(STAGES, bars):
            bar.set_alpha(1.0 if s == stage else 0.25)
        left += widths
    ax.axvline(80, color="k", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("model-state bytes per rank (GB, log scale)")
    mine = rows[STAGES[stage]]
    ax.set_title(f"{STAGES[stage]} on N = {world_size}: {mine['total'] / GB:.1f} GB per rank "
                 f"({'fits' if mine['total'] <= 80 * GB else 'does not fit'} in 80 GB)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    plt.tight_layout()
    plt.show()
    return mine


WIDE = {"style": {"description_width": "initial"}, "layout": widgets.Layout(width="480px")}
widgets.interact(zero_bytes_per_rank,
                 stage=widgets.IntSlider(value=2, min=0, max=3, description="ZeRO stage", **WIDE),
                 world_size=widgets.SelectionSlider(options=ns, value=64, description="world size N", **WIDE));

# %%
# FIGURE
row = zero_bytes_per_rank(stage=2, world_size=64)   # the same function, called plainly
print(f"ZeRO-2, N = 64: {row['total'] / GB:.1f} GB per rank")

# %% [markdown]
# *Takeaway: at 64 ranks ZeRO-2 brings this 6.9B-parameter model from ~110 GB to
# ~15 GB per rank; ZeRO-3 to under 2 GB.*

# %% [markdown]
# ## 2. ZeRO-1: who owns what
#
# One ZeRO-1 step, as FairScale's `OSS` does it, on every rank:
#
# ```
# backward                  the gradient of this rank's slice of the batch
# all-reduce, / N           every averaged gradient, as in DDP
# optimizer step            AdamW on the parameters this rank OWNS, only
# broadcast from owners     every copy of each parameter = its owner's
# ```
#
# Every rank must agree on the owners without talking: each runs the same
# deterministic rule on the same list of sizes. The rule is greedy ("longest
# processing time first"): the biggest parameter first, each to the rank that owns
# the fewest elements so far; ties go to the lower index and the lower rank. Whole
# parameters move, so a shard is only *about* `Ψ/N`.

# %% [markdown]
# Sending each parameter in its own broadcast pays the latency `α` once per tensor
# (`α + S/B` per message, lab 00), dozens of times a step. FairScale packs what one
# rank owns into one flat buffer: one broadcast per owner, whose layout every rank
# must again compute on its own.

# %% [markdown]
# ### Exercise 1: ownership and the owners' buckets
#
# * `greedy_partition(sizes, world_size) -> list[int]`: the owner of each parameter.
# * `owner_buckets(tensors, owners, world_size) -> list[Tensor]`: one 1-D tensor per
#   rank with the elements of the tensors it owns, in list order (0 elements if it
#   owns none; the tensors' dtype and device).
# * `unpack_bucket(bucket, tensors, owners, rank) -> None`: write `rank`'s bucket back,
#   in place, into the tensors `rank` owns (the model holds those very tensors).
#
# Target: the library's owners on every case (gpt-tiny on 2-4 ranks included); a
# round trip that restores every value and touches nothing else. `check.hint("name")`
# prints the next hint for the exercise `name` (e.g. `check.hint("owner_buckets")`).

# %%
def greedy_partition(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each parameter: biggest first, each onto the least-loaded rank.

    >>> greedy_partition([10, 7, 5, 4], 2)   # rank 0: 10 + 4 = 14, rank 1: 7 + 5 = 12
    [0, 1, 1, 0]
    """
    # BEGIN SOLUTION
    # HINT: biggest first, each to the least-loaded rank; more: check.hint("greedy_partition")
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = load.index(min(load))
        owners[i] = r
        load[r] += sizes[i]
    return owners
    # END SOLUTION


def owner_buckets(tensors: list[torch.Tensor], owners: list[int], world_size: int) -> list[torch.Tensor]:
    """One flat tensor per rank: the elements of the tensors it owns, in list order."""
    # BEGIN SOLUTION
    # HINT: one flat tensor per rank, its tensors in list order; more: check.hint("owner_buckets")
    buckets = []
    for r in range(world_size):
        mine = [t.detach().reshape(-1) for t, o in zip(tensors, owners) if o == r]
        buckets.append(torch.cat(mine) if mine else tensors[0].new_empty(0))
    return buckets
    # END SOLUTION


def unpack_bucket(bucket: torch.Tensor, tensors: list[torch.Tensor], owners: list[int], rank: int) -> None:
    """Copy ``rank``'s flat bucket back, in place, into the tensors ``rank`` owns."""
    # BEGIN SOLUTION
    # HINT: rank's slices back into its tensors, in place; more: check.hint("unpack_bucket")
    offset = 0
    for t, o in zip(tensors, owners):
        if o == rank:
            n = t.numel()
            t.data.copy_(bucket[offset:offset + n].view_as(t))
            offset += n
    # END SOLUTION

# %%
# CHECK: your owners against the library's rule; the buckets' round trip on gpt-tiny, 1 to 4 owners
check.ownership(greedy_partition, owner_buckets, unpack_bucket)

# %% [markdown]
# ### Exercise 2: the sharded optimizer, its step, its checkpoint
#
# The check trains `gpt-tiny` for 3 steps (AdamW) on 2 and then 4 ranks with your
# functions; its worker runs this loop on every rank:
#
# ```python
# owners = greedy_partition([p.numel() for p in params], N)
# optimizer = local_optimizer(params, owners, rank, lr=..., weight_decay=..., eps=...)
# for step in range(3):
#     lm_loss(model(x_rank), y_rank).backward()
#     for p in params: p.grad.div_(N); comm.all_reduce(p.grad)     # DDP's average
#     zero1_step(params, owners, optimizer)
#     model.zero_grad(set_to_none=True)
# checkpoint = consolidate_state(params, owners, optimizer)
# ```

# %% [markdown]
# * `local_optimizer(params, owners, rank, **adamw_kwargs) -> Optimizer`: an AdamW
#   that keeps state for, and steps, only `rank`'s parameters.
# * `zero1_step(params, owners, optimizer) -> None`: after the average, leave every
#   rank with the same updated model.
# * `consolidate_state(params, owners, optimizer) -> list[dict] | None`: a checkpoint
#   needs the whole optimizer state in one place, yet no rank holds it. On rank 0,
#   one dict per parameter, in order, with its `"exp_avg"` and `"exp_avg_sq"`; `None`
#   on the other ranks (FairScale's `OSS.consolidate_state_dict`).
#
# Target: one process's parameters on the whole batch (within `1e-4`: the ranks add
# the average in another order); each rank's AdamW state exactly the bytes of what it
# owns (`2·4` B per owned element, plus a 4-byte step per owned tensor); `4Ψ` bytes
# broadcast per step in at most `N` broadcasts; rank 0's moments equal one process's.

# %%
def local_optimizer(params: list[torch.Tensor], owners: list[int], rank: int,
                    **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over the parameters that `rank` owns, and no others."""
    # BEGIN SOLUTION
    # HINT: an AdamW that sees this rank's parameters only; more: check.hint("local_optimizer")
    mine = [p for p, owner in zip(params, owners) if owner == rank]
    return torch.optim.AdamW(mine, **adamw_kwargs)
    # END SOLUTION


def zero1_step(params: list[torch.Tensor], owners: list[int], optimizer: torch.optim.Optimizer) -> None:
    """On every rank, after the gradients are averaged: step the shard, then re-assemble the model."""
    # BEGIN SOLUTION
    # HINT: step, then every rank gets each owner's parameters; more: check.hint("zero1_step")
    optimizer.step()
    n = dist.world_size()
    buckets = owner_buckets(params, owners, n)
    for r in range(n):
        if buckets[r].numel():
            comm.broadcast(buckets[r], src=r)
            unpack_bucket(buckets[r], params, owners, r)
    # END SOLUTION


def consolidate_state(params: list[torch.Tensor], owners: list[int],
                      optimizer: torch.optim.Optimizer) -> list[dict] | None:
    """On rank 0: [{"exp_avg": ..., "exp_avg_sq": ...} for each parameter], from the owners; None elsewhere."""
    # BEGIN SOLUTION
    # HINT: bring every parameter's moments from its owner to rank 0; more: check.hint("consolidate_state")
    state = []
    for p, owner in zip(params, owners):
        mine = optimizer.state[p] if dist.rank() == owner else {}
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            t = mine[key].clone() if key in mine else torch.empty_like(p)
            comm.broadcast(t, src=owner)
            moments[key] = t
        state.append(moments)
    return state if dist.rank() == 0 else None
    # END SOLUTION

# %%
# CHECK: ZeRO-1 with your functions at 2 and 4 ranks against one process and minifsdp.zero.OSS
check.zero1(greedy_partition, local_optimizer, zero1_step, consolidate_state)

# %% [markdown]
# Each rank's share of the AdamW state in the check's runs:

# %%
# NBVAL_CHECK_OUTPUT
z1 = check.results["ZeRO-1"]
ref = z1["single"]
full_state = ref["state_bytes"]
print(f"{'ranks':>5}  {'your AdamW state per rank (B)':<40}{'largest / (full/N)':>19}  {'OSS, largest (B)':>17}")
for n, res in z1["learner"].items():
    states = [r["optimizer"] for r in res]
    lib = z1["library"] if n == max(z1["learner"]) else None
    print(f"{n:>5}  {', '.join(f'{s:,}' for s in states):<40}{max(states) / (full_state / n):>19.3f}"
          f"  {max(r['optimizer'] for r in lib) if lib else '':>17}")
print(f"one process: {full_state:,} B of AdamW state for Ψ = {ref['n_params']:,} parameters")

# %% [markdown]
# Each rank holds about `1/N` of the state; the largest share is a little above
# `1/N` because whole parameters cannot be split (the greedy rule guarantees at most
# `Ψ/N` plus the largest parameter). The price is the broadcast of the parameters,
# `4Ψ` bytes per step in fp32, on top of DDP's `2·4Ψ` all-reduce. `minifsdp.zero.OSS`
# is this exercise made into a `torch.optim.Optimizer` (param groups, LR schedulers,
# gradient clipping, state dicts).

# %% [markdown]
# ## 3. ZeRO-2: each gradient goes to its owner only
#
# After the all-reduce every rank holds every averaged gradient, yet its optimizer
# reads only the ones it owns. ZeRO-2 sends each gradient only where it is needed, as
# soon as backward has produced it, and every other rank frees its copy *during*
# backward. After backward a rank holds only the gradients of what it owns, and the
# gradients cost `4Ψ` bytes on the wire instead of the all-reduce's `2·4Ψ`.
#
# The moment "backward has produced this gradient" is a hook (lab 02):
# `p.register_post_accumulate_grad_hook(fn)` calls `fn(p)` once `p.grad` holds this
# backward's whole gradient.

# %% [markdown]
# ### Exercise 3: the reduce-to-owner hook
#
# `install_zero2(params, owners) -> None` registers your hooks. The check's worker
# runs the loop of exercise 2 without the all-reduce (your hooks replace it), then
# your `zero1_step`, at 2 and 4 ranks.
#
# Target: one process's parameters; after backward, each rank holds the *average*
# gradient of every parameter it owns and no other gradient (`4` B per owned
# element); `4Ψ` bytes of gradient traffic per step, plus your `4Ψ` of broadcasts.

# %%
def install_zero2(params: list[torch.Tensor], owners: list[int]) -> None:
    """Register on each parameter a hook that averages its gradient onto its owner and frees it elsewhere."""
    # BEGIN SOLUTION
    # HINT: each gradient, averaged, to its owner; freed elsewhere; more: check.hint("install_zero2")
    rank, n = dist.rank(), dist.world_size()

    def reduce_to_owner(p: torch.Tensor, owner: int) -> None:
        p.grad.div_(n)
        comm.reduce(p.grad, dst=owner)
        if owner != rank:
            p.grad = None            # not ours: the owner holds the average now

    for p, owner in zip(params, owners):
        p.register_post_accumulate_grad_hook(lambda p, owner=owner: reduce_to_owner(p, owner))
    # END SOLUTION

# %%
# CHECK: ZeRO-2 with your hook at 2 and 4 ranks: one process's parameters, exactly the owned gradients, bytes
check.zero2(greedy_partition, local_optimizer, zero1_step, install_zero2)

# %% [markdown]
# Which rank holds which gradient after backward, in your run at 4 ranks (columns:
# the parameters of `gpt-tiny` in model order; dark: the rank owns the parameter
# and holds its gradient):

# %%
# FIGURE
z2 = check.results["ZeRO-2"]
z2_n = max(z2["learner"])
names = list(dict(models.build_model("gpt-tiny", device="meta").named_parameters()))
grid = np.array([[2 if h and o == r else 1 if h else 0 for h, o in zip(out["held"], out["owners"])]
                 for r, out in enumerate(z2["learner"][z2_n])])
fig, ax = plt.subplots(figsize=(10, 2.4))
ax.imshow(grid, cmap="Blues", vmin=0, vmax=2.4, aspect="auto")
ax.set_yticks(range(len(grid)), [f"rank {r}" for r in range(len(grid))])
ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
ax.set_xlabel("parameter of gpt-tiny (model order)")
ax.set_title(f"your ZeRO-2, {z2_n} ranks: gradients held after backward (dark: owned)", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# *Takeaway: every gradient survives backward on exactly one rank, its owner.*
#
# Your rank 0's memory during the last step, beside `minifsdp.zero`'s ZeRO-2 on the
# same model (`MemoryTracker`, lab 01; time in ms from the step's start):

# %%
# FIGURE
fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), sharey=True)
for ax, who in zip(axes, ("learner", "library")):
    plot.memory(z2[who][z2_n][0]["samples"], ax=ax, unit="KiB",
                title=f"{'your ZeRO-2' if who == 'learner' else 'minifsdp.zero ZeRO-2'}, rank 0 of {z2_n}")
axes[0].get_legend().remove()
axes[1].set_ylabel("")
axes[0].set_ylim(0, 1.15 * max(z2[w][z2_n][0]["peak"] for w in ("learner", "library")) / 1024)
plt.show()
mine, lib = (z2[w][z2_n][0]["peak"] for w in ("learner", "library"))
print(f"peak of the step, rank 0: yours {mine / 1024:.1f} KiB, minifsdp.zero {lib / 1024:.1f} KiB")

# %% [markdown]
# *Takeaway: gradients (orange) rise and fall during backward instead of piling up:
# each non-owned one is gone as soon as its reduce returns.*

# %% [markdown]
# ### Optional deep dive: the library's hook
#
# `minifsdp.zero.ShardedDataParallel` is FairScale's `ShardedDataParallel`: the same
# hook, with the reduce *asynchronous* (backward goes on computing while gradients
# travel) and a bound on the bytes of other ranks' gradients in flight
# (`max_inflight_bytes`), so overlap does not bring back the memory you just saved.
# The next cell shows its source once your own hook has passed its check.

# %%
check.library_hook()

# %% [markdown]
# ## 4. Measured: memory per rank and bytes per step, 1 to 4 ranks
#
# Now a model whose states are megabytes: `gpt-mini` (Ψ ≈ 3.3M parameters). At each
# world size `N` in 1, 2, 4, `check.strategy_runs` trains two steps with each of the
# library's strategies — DDP (all-reduce after backward, plain AdamW), ZeRO-1 and
# ZeRO-2 (`minifsdp.zero.wrap_zero`) — under a `MemoryTracker` and a `Tracer`. It
# reads the tracker's books after backward (parameters, gradients) and after the
# optimizer step (optimizer state), and counts the bytes of every collective.

# %%
MEM_MODEL = "gpt-mini"
STRATEGIES = ("ddp", "zero1", "zero2")
WORLDS = (1, 2, N4)   # one rank for comparison; the 4 ranks run on the CPU where GPUs are fewer

t0 = time.perf_counter()
mem_runs = check.strategy_runs(WORLDS, MEM_MODEL)
psi_mini = models.count_parameters(models.build_model(MEM_MODEL, device="meta"))
print(f"{MEM_MODEL}: Ψ = {psi_mini:,} parameters; {len(WORLDS)} world sizes x 3 strategies x 2 steps "
      f"in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# Memory over the second step, every rank at `N = 4`, one panel per strategy (rank 0
# stacked by category, the other ranks' totals as lines):

# %%
# FIGURE
fig, axes = plt.subplots(1, 3, figsize=(11, 3.0), sharey=True)
for ax, strategy in zip(axes, STRATEGIES):
    ranks = mem_runs[strategy][N4]
    plot.memory(ranks[0]["samples"], ax=ax, unit="MiB", title=f"{strategy}, N = {N4}")
    for r, out in enumerate(ranks[1:], start=1):
        t0_r = out["samples"][0].time
        ax.plot([(m.time - t0_r) * 1e3 for m in out["samples"]], [m.total / MiB for m in out["samples"]],
                lw=0.8, label=f"rank {r} total")
    if strategy != "zero2":
        ax.get_legend().remove()
    ax.set_ylabel("live MiB" if strategy == "ddp" else "")
axes[-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
axes[0].set_ylim(0, 1.15 * max(o["peak"] for s in STRATEGIES for o in mem_runs[s][N4]) / MiB)
plt.show()

# %% [markdown]
# *Takeaway: all three hold the same parameters (blue); ZeRO-1 cuts the optimizer
# state (green) to about a quarter per rank, ZeRO-2 also the gradients (orange),
# which now fall during backward instead of staying until the step.*
#
# **Bytes per step.** `comm` records each collective's *volume*, the ZeRO paper's
# unit (section 7): an all-reduce of `S` bytes counts `2S` (a reduce-scatter plus an
# all-gather); a reduce, a broadcast or an all-gather counts `S`. What a rank *sends*
# with ring algorithms is `(N-1)/N` of that.

# %% [markdown]
# ### Exercise 4: each rank's bytes, exactly
#
# The formula divides by `N`; a real rank holds what it *owns*, whole parameters.
# Write `predict_model_states(stage, n_params, owned_numel, owned_tensors, world_size)`
# for the runs above (stage 0: DDP, 1: ZeRO-1 as `OSS` on DDP, 2: ZeRO-2), fp32,
# AdamW. `owned_numel` and `owned_tensors` describe the parameters this rank's
# optimizer steps (for DDP, all of them). Return a dict of bytes on one rank:
# `"parameters"`, `"gradients"` (after backward), `"optimizer"` (after a step), and
# `"moved"`, the volume of the step's collectives.
#
# Target: every rank of every run above to the byte (the tracker's books, `comm`'s
# count), and a few cases the check makes up.

# %%
def predict_model_states(stage: int, n_params: int, owned_numel: int, owned_tensors: int,
                         world_size: int) -> dict[str, int]:
    """Bytes of one rank: {"parameters", "gradients", "optimizer", "moved" (volume per step)}; fp32, AdamW."""
    # BEGIN SOLUTION
    # HINT: bytes per rank and per step; more: check.hint("predict_model_states")
    grads = owned_numel if stage >= 2 else n_params      # ZeRO-2: only the owned gradients survive
    all_reduce = 2 * FP32 * n_params if stage < 2 else 0   # DDP's average (OSS sits on DDP)
    reduce = FP32 * n_params if stage == 2 else 0          # each gradient to its owner
    broadcast = FP32 * n_params if stage >= 1 else 0       # each parameter from its owner
    return {"parameters": FP32 * n_params,                 # stages 0-2 never shard the parameters
            "gradients": FP32 * grads,
            "optimizer": 2 * FP32 * owned_numel + FP32 * owned_tensors,   # exp_avg, exp_avg_sq; step
            "moved": all_reduce + reduce + broadcast if world_size > 1 else 0}
    # END SOLUTION

# %%
# CHECK: predict_model_states against every rank of every run of section 4, and made-up cases
check.predict_model_states(predict_model_states, mem_runs, psi_mini)

# %% [markdown]
# Three numbers per category on the rank that holds the most (the one that decides
# whether a model fits): **measured** (the tracker's books), **formula**
# (`estimate.model_state_bytes_per_device(Ψ, N, stage, padding=False)`, fp32:
# `4Ψ + 4Ψ + 2·4Ψ` bytes, each term divided by `N` where the stage shards it) and
# **exact** (your `predict_model_states`, from what the rank owns).

# %%
# NBVAL_CHECK_OUTPUT
STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2}


def exact_bytes(strategy: str, n: int, out: dict) -> dict[str, int]:
    return predict_model_states(STAGE_OF[strategy], psi_mini, out["owned_numel"], out["owned_tensors"], n)


print(f"{'':8}{'N':>2}" + "".join(f"{c + ' (MiB)':>27}" for c in CATS))
print(f"{'':10}" + f"{'measured  formula  exact':>27}" * 3)
mem_table = {}
for strategy in STRATEGIES:
    for n, results in mem_runs[strategy].items():
        worst = max(results, key=lambda o: sum(o[c] for c in CATS))
        formula = estimate.model_state_bytes_per_device(psi_mini, n, STAGE_OF[strategy], padding=False)
        mem_table[strategy, n] = (worst, formula)
        print(f"{strategy:8}{n:>2}" + "".join(
            f"{worst[c] / MiB:>12.2f}{formula[c] / MiB:>8.2f}{exact_bytes(strategy, n, worst)[c] / MiB:>7.2f}"
            for c in CATS))

# %%
# FIGURE
fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), sharey=True)
width = 0.26
for ax, strategy in zip(axes, STRATEGIES):
    for i, cat in enumerate(CATS):
        xs = np.arange(len(WORLDS)) + (i - 1) * width
        measured = [mem_table[strategy, n][0][cat] / MiB for n in WORLDS]
        formula = [mem_table[strategy, n][1][cat] / MiB for n in WORLDS]
        ax.bar(xs, measured, width, color=plot.color_for(cat), label=f"{cat} (measured)")
        ax.hlines(formula, xs - 0.6 * width, xs + 0.6 * width, color="k", lw=2,
                  label="formula (estimate)" if i == 0 else None)
    ax.set_xticks(range(len(WORLDS)), [f"N = {n}" for n in WORLDS])
    ax.set_title({"ddp": "DDP", "zero1": "ZeRO-1 (OSS)", "zero2": "ZeRO-2 (ShardedDataParallel)"}[strategy],
                 fontsize=10)
axes[0].set_ylabel("bytes on the largest rank (MiB)")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
fig.suptitle(f"{MEM_MODEL} (Ψ = {psi_mini:,} parameters), fp32 AdamW: model states per rank, measured",
             fontsize=10)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# *Takeaway: where the formula divides by `N`, the measured bars sit a hair above
# the black marks — whole parameters cannot be split evenly, and AdamW keeps a
# 4-byte step per tensor; your "exact" column is met to the byte.* FSDP (lab 04)
# flattens the parameters into one vector, pads it to a multiple of `N` and gives
# each rank an equal slice, so its shards are exact.
#
# The bytes per step, measured (each collective's volume) beside your prediction:

# %%
# NBVAL_CHECK_OUTPUT
print(f"Ψ = {psi_mini:,} parameters; 4Ψ = {FP32 * psi_mini / MiB:.2f} MiB in fp32")
print(f"{'':8}{'N':>2}  {'by collective (MiB)':<36}{'volume MiB':>11}{'yours MiB':>10}{'in 4Ψ':>8}")
for strategy in STRATEGIES:
    for n in WORLDS[1:]:
        out = mem_runs[strategy][n][0]
        volume = sum(out["bytes"].values())
        yours = exact_bytes(strategy, n, out)["moved"]
        ops = ", ".join(f"{op} {b / MiB:.2f}" for op, b in sorted(out["bytes"].items()))
        print(f"{strategy:8}{n:>2}  {ops:<36}{volume / MiB:>11.2f}{yours / MiB:>10.2f}"
              f"{volume / (FP32 * psi_mini):>7.0f}x")

# %% [markdown]
# DDP and ZeRO-2 move the same `2·4Ψ` bytes per step; FairScale-style ZeRO-1 moves
# `3·4Ψ`. None of it depends on `N`. So ZeRO-2 is the better deal: DDP's traffic for
# `1/N` of the gradient and optimizer memory. What neither can divide is the `4Ψ`
# bytes of fp32 parameters every rank still holds: lab 04 shards those too (ZeRO-3,
# FSDP), at the price of gathering them before each use, `3·4Ψ` bytes per step.

# %% [markdown]
# ## 5. Optional deep dive: PyTorch's ZeRO-1 on the same steps
#
# PyTorch ships ZeRO-1 as `torch.distributed.optim.ZeroRedundancyOptimizer`, used
# with its own DDP. The check's three `gpt-tiny` steps on 4 ranks with it:

# %%
def torch_zero1_worker(steps: int, global_batch: int, seq_len: int) -> dict:
    """PyTorch's DDP + ZeroRedundancyOptimizer: final parameters and this rank's state bytes."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from minifsdp import data

    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    module = models.build_model("gpt-tiny").to(device)
    model = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=check.LR, weight_decay=check.WD, eps=check.EPS)
    for step in range(steps):
        x, y = data.get_batch(step, global_batch, seq_len, rank=rank, world_size=n)
        models.lm_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"state_bytes": sum(t.nbytes for s in opt.optim.state.values() for t in s.values()
                               if torch.is_tensor(t)),   # opt.optim: the local shard's AdamW
            "params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}


torch_runs = minifsdp.launch(torch_zero1_worker, N4, 3, 8, 32, timeout=120)
theirs = [r["state_bytes"] for r in torch_runs]
yours = [r["optimizer"] for r in check.results["ZeRO-1"]["learner"][N4]]
ref = check.results["ZeRO-1"]["single"]
worst = max((r["params"][k] - want).abs().max().item() for r in torch_runs for k, want in ref["params"].items())
print(f"optimizer state per rank, ZeroRedundancyOptimizer: {theirs}")
print(f"optimizer state per rank, your ZeRO-1:             {yours}")
print(f"ZeroRedundancyOptimizer's parameters vs one process: max |diff| {worst:.1e} (<= 1e-4: {worst <= 1e-4})")

# %% [markdown]
# PyTorch's shards hold the same bytes as yours (its partition is the same greedy
# rule; `tests/test_zero.py` also compares the optimizer states element by element).

# %% [markdown]
# ## Summary
#
# ZeRO-1 gives each rank the optimizer state of the parameters it owns (a
# deterministic greedy partition, agreed without communication) and re-assembles the
# model with one broadcast per owner per step. ZeRO-2 also sends each gradient only to
# its owner, with a reduce from a gradient hook, and frees the rest during backward.
# Both train the very same model as one process; the memory was measured to the byte
# and matches the partition exactly and the `Ψ/N` formula up to the last whole
# parameter. FairScale's ZeRO-1 moves `3·4Ψ` bytes per step, its ZeRO-2 and DDP
# `2·4Ψ`. From a shell, the trainer runs every strategy:
# `python -m minifsdp.train --strategy zero2 --world-size 2 --model gpt-mini`.

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
