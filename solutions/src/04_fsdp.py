# Lab 04 - FSDP. Source of solutions/04_fsdp.ipynb and labs/04_fsdp.ipynb:
# edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 04 — FSDP: shard the parameters too (ZeRO-3)
#
# **You will be able to** build FSDP's per-unit cycle on a GPT (a flat padded shard
# per unit, gathered just before the unit computes, freed after, gathered again for
# backward, its gradient reduce-scattered), show that it trains like one process
# moving exactly `3·4Ψ` bytes per step, and choose a sharding strategy, wrap policy
# and prefetch.
#
# **Prerequisites**: labs 00–03 (collectives, memory anatomy, data parallel, ZeRO).
#
# **Time**: 75 minutes of work; the cells compute for about half a minute on a
# laptop (CPU, `gloo`) and about as long on a GPU VM (tiny models; launches needing
# more ranks than GPUs use CPU ranks).
#
# **Exercises**: 1. the flat shard and its memory · 2. forward: units, gather
# before, free after · 3. backward: gather again, reduce-scatter, free.
#
# `Ψ` = the number of parameters, `N` = the world size; fp32 parameters take `4Ψ` B.

# %%
import functools
import math
import os
import tempfile
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F

import minifsdp
from minifsdp import comm, data, dist, estimate, memory, models, plot, trace
from minifsdp.fsdp import (BackwardPrefetch, FullOptimStateDictConfig, FullStateDictConfig, ModuleWrapPolicy,
                           ShardingStrategy, StateDictType, size_based_auto_wrap_policy)
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.labcheck import lab04 as check
from minifsdp.train import TrainConfig, train

# Small tensors: one compute thread per process is as fast, and several ranks can
# share the cores without OpenMP threads spinning against each other.
torch.set_num_threads(1)
MiB, FP32 = 2**20, 4
# The lessons launch 2 and 4 ranks: one per GPU where the machine has that many, else CPU ranks (gloo).
N2, N4 = 2, 4
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. Build it: FSDP's per-unit cycle
#
# Lab 03 sharded the optimizer state and the gradients; every rank still held all
# the parameters. FSDP (ZeRO stage 3: Rajbhandari et al. 2020; PyTorch FSDP: Zhao
# et al. 2023) removes that last copy:
#
# ```
# keep:      one flat, padded 1/N shard of each unit's parameters (what the optimizer sees)
# forward:   all-gather the unit's shards -> full weights -> compute -> free them
# backward:  all-gather again -> compute gradients -> reduce-scatter them -> free
# step:      each rank updates its own shard, with its own 1/N of the optimizer state
# ```
#
# A **unit** is a group of parameters gathered together. Here every `Block` of the
# GPT is a unit and the **root** unit holds the rest (embeddings, final LayerNorm,
# head). A unit is named by its module path, as `model.named_modules()` gives it:
# `gpt-tiny` has three units, `blocks.0`, `blocks.1` and `root`.

# %% [markdown]
# **The flat shard.** FSDP concatenates a unit's tensors into **one flat vector**,
# pads it with zeros to a multiple of `N`, and gives rank `r` the `r`-th of `N`
# equal chunks. A `Linear(6, 5)` and a `Linear(5, 3)` hold 30 + 5 + 15 + 3 = 53
# numbers; with `N = 4`, chunks of 14:
#
# ```
# flat   = [w1 x30 | b1 x5 | w2 x15 | b2 x3 | 0 0 0]   53 numbers + 3 zeros of padding = 56
# rank 0 = flat[ 0:14]   the first 14 numbers of w1
# rank 1 = flat[14:28]   the next 14 of w1
# rank 2 = flat[28:42]   the last 2 of w1, all of b1, the first 7 of w2
# rank 3 = flat[42:56]   the last 8 of w2, b2 and the padding
# ```
#
# Equal chunks are not a nicety: all-gather and reduce-scatter need the same size
# on every rank.

# %% [markdown]
# **Memory that comes and goes.** Each unit has a tensor `full` of the padded size,
# where its shards are gathered. In forward, autograd saves views of it (a `Linear`
# keeps its weight to compute its input's gradient). If `full` were a new tensor
# each time, those saved views would point at memory that no longer exists. So
# `full` is created once and never replaced: FSDP releases only its *storage*, the
# memory under the tensor (`tensor.untyped_storage()`, which can be resized in
# place), and refills that same storage before backward.

# %% [markdown]
# ### Exercise 1: the flat shard, and memory that comes and goes
#
# * `shard_flat(params, rank, world) -> Tensor`: this rank's chunk of the padded flat
#   vector, a tensor of its own with no autograd history (the unit's `nn.Parameter`
#   is made from it);
# * `free(unit)`, `allocate(unit)`, `is_gathered(unit) -> bool`, for a unit with a
#   flat tensor `unit.full` of `unit.padded_numel` numbers: release all the memory
#   behind `full` (the tensor object stays), give it back (any contents), say whether
#   it holds memory now. `allocate` also names those bytes for memory plots:
#   `register(unit.full, "unsharded_params")` on every tracker in
#   `memory.active_trackers()`.
#
# Target: shards of 27, 18 and 14 numbers at `N` = 2, 3, 4, chunk `r` on rank `r`;
# `full` at 0 bytes after `free`, at its padded size in bytes after `allocate`, in
# fp32 and in bf16. Stuck? `check.hint("flat_shard")` prints the next hint (the idea
# first, never the code); each exercise has its own.

# %%
def shard_flat(params: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """Chunk `rank` of `world` of the parameters, flattened in order and zero-padded; a detached copy.

    >>> shard_flat([torch.arange(3.), torch.tensor([3., 4.])], 1, 2)   # [0 1 2 3 4 | pad 0]
    tensor([3., 4., 0.])
    """
    # BEGIN SOLUTION
    # HINT: this rank's chunk of the flat, zero-padded parameters. check.hint('flat_shard')
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    padded = math.ceil(flat.numel() / world) * world
    flat = F.pad(flat, (0, padded - flat.numel()))
    return flat.chunk(world)[rank].clone()
    # END SOLUTION


def free(unit: "Unit") -> None:
    """Release all the memory behind `unit.full`; the tensor object stays."""
    # BEGIN SOLUTION
    # HINT: no memory left behind unit.full, same tensor object. check.hint('flat_shard')
    unit.full.untyped_storage().resize_(0)
    # END SOLUTION


def allocate(unit: "Unit") -> None:
    """Memory for `unit.padded_numel` numbers behind `unit.full` again, named "unsharded_params"."""
    # BEGIN SOLUTION
    # HINT: memory for padded_numel numbers behind unit.full; name it. check.hint('flat_shard')
    unit.full.untyped_storage().resize_(unit.padded_numel * unit.full.element_size())
    for tracker in memory.active_trackers():
        tracker.register(unit.full, "unsharded_params")
    # END SOLUTION


def is_gathered(unit: "Unit") -> bool:
    """Does `unit.full` hold memory now?"""
    # BEGIN SOLUTION
    # HINT: True when memory is behind unit.full. check.hint('flat_shard')
    return unit.full.untyped_storage().nbytes() > 0
    # END SOLUTION

# %%
# CHECK: shard_flat at N = 2, 3, 4 on a 53-parameter MLP; free / allocate / is_gathered in fp32 and bf16
check.flat_shard(shard_flat, free, allocate, is_gathered)

# %% [markdown]
# ### The scaffolding: a unit
#
# `Unit(name, module, params)` holds one unit's state on one rank. `params` are
# `(module, attribute name, parameter)` triples: the module that holds each
# parameter and its name there. The unit keeps its `shard` (an `nn.Parameter` made
# by your `shard_flat`: the optimizer sees only shards), `full` (freed at rest by
# your `free`), the parameters' `sizes`, `numel` and `padded_numel`, and the `slots`
# where the parameters lived, `(module, attribute name, shape)`. The original
# parameters leave their modules: until the unit is gathered, its modules have no
# weights at all.

# %%
class Unit:
    """One FSDP unit on this rank: a flat padded shard, the slots of its parameters, and `full`."""

    def __init__(self, name: str, module: nn.Module, params: list[tuple[nn.Module, str, nn.Parameter]]):
        self.name, self.module = name, module
        self.rank, self.world = dist.rank(), dist.world_size()
        self.slots = [(m, attr, p.shape) for m, attr, p in params]
        self.sizes = [p.numel() for _, _, p in params]
        self.numel = sum(self.sizes)
        self.padded_numel = math.ceil(self.numel / self.world) * self.world
        device = dist.device()
        self.shard = nn.Parameter(shard_flat([p.to(device) for _, _, p in params], self.rank, self.world))
        self.full = torch.empty(self.padded_numel, device=device, requires_grad=True)
        free(self)                           # at rest: no memory behind `full` (your free)
        for m, attr, _ in params:            # the original parameters leave their modules
            del m._parameters[attr]


# %% [markdown]
# ### Exercise 2: forward — gather before, free after
#
# A unit's full weights should exist only while it computes. torch says when,
# through hooks (signatures in torch's docs): `Module.register_forward_pre_hook`,
# `Module.register_forward_hook`, `Tensor.register_hook` (called with the tensor's
# gradient once it is computed) and `Tensor.register_post_accumulate_grad_hook`
# (called once a leaf's `.grad` is complete). Which one tells you a unit's forward
# starts? That it ended? That **this unit's backward is next** (whose gradient is
# computed just before it)? That its whole gradient is ready?
#
# * `shard_model(model, unit_types) -> list[Unit]`: each submodule of `unit_types`
#   is a unit named by its module path, inner ones first; the root (`"root"`, last)
#   takes every parameter left; each unit's hooks installed;
# * `gather(unit)`: `unit.full` holds every rank's shard, rank `r`'s at position `r`;
# * `pre_forward(unit)`, `post_forward(unit, output)`, `install_hooks(unit)`: the
#   hooks' work; after forward, backward must still call `pre_backward(unit)`
#   (exercise 3) before it needs this unit's weights.

# %% [markdown]
# Target, on 2 and 3 ranks: one process's logits; after forward every unit freed
# and every unit's output hooked; all-gathered bytes `4 B x` the padded `Ψ`, each
# unit once. `gpt-tiny` has `Ψ` = 42,880 parameters, so 171,520 B at 2 ranks; at 3
# ranks each block (12,704 parameters) pads by one number and the root (17,472)
# divides evenly: 8 B more. `check.hint("fsdp_forward")` when stuck.

# %%
def shard_model(model: nn.Module, unit_types: set[type]) -> list[Unit]:
    """A Unit for each submodule of `unit_types` (innermost first, named by path), the root last; hooks on."""
    # BEGIN SOLUTION
    # HINT: one Unit per Block (path names), root last with the rest. check.hint('fsdp_forward')
    candidates = [(name, m) for name, m in model.named_modules() if name and isinstance(m, tuple(unit_types))]
    taken, units = set(), []
    for name, m in candidates[::-1] + [("root", model)]:
        params = [(owner, attr, p) for owner in m.modules() for attr, p in owner.named_parameters(recurse=False)
                  if id(p) not in taken]
        taken.update(id(p) for _, _, p in params)
        unit = Unit(name, m, params)
        install_hooks(unit)
        units.append(unit)
    return units
    # END SOLUTION


def gather(unit: Unit) -> None:
    """`unit.full` holds every rank's shard, rank r's at position r (nothing to do if already gathered)."""
    # BEGIN SOLUTION
    # HINT: every rank's shard into unit.full, once. check.hint('fsdp_forward')
    if is_gathered(unit):
        return
    allocate(unit)
    comm.all_gather_into_tensor(unit.full.data, unit.shard.detach())
    # END SOLUTION


def pre_forward(unit: Unit) -> None:
    """Before the unit's forward: its modules hold their parameters again, as pieces of `unit.full`."""
    # BEGIN SOLUTION
    # HINT: full weights, and each module's parameter a piece of them. check.hint('fsdp_forward')
    gather(unit)
    pieces = torch.split(unit.full, unit.sizes + [unit.padded_numel - unit.numel])
    for (module, attr, shape), piece in zip(unit.slots, pieces):
        setattr(module, attr, piece.view(shape))
    # END SOLUTION


def post_forward(unit: Unit, output: torch.Tensor) -> None:
    """After the unit's forward: free it; backward must call pre_backward(unit) before this unit's backward."""
    # BEGIN SOLUTION
    # HINT: free the unit, and make backward gather it first. check.hint('fsdp_forward')
    free(unit)
    if output.requires_grad:
        output.register_hook(lambda grad: pre_backward(unit))
    # END SOLUTION


def install_hooks(unit: Unit) -> None:
    """The unit's hooks: pre_forward and post_forward around its forward, post_backward once its gradient is whole."""
    # BEGIN SOLUTION
    # HINT: three hooks, each calling your function. check.hint('fsdp_forward')
    unit.module.register_forward_pre_hook(lambda module, args: pre_forward(unit))
    unit.module.register_forward_hook(lambda module, args, output: post_forward(unit, output))
    unit.full.register_post_accumulate_grad_hook(lambda full: post_backward(unit))
    # END SOLUTION


def pre_backward(unit: Unit) -> None:   # exercise 3 (defined here so the forward can run first)
    raise NotImplementedError("exercise 3: write pre_backward below")


def post_backward(unit: Unit) -> None:  # exercise 3
    raise NotImplementedError("exercise 3: write post_backward below")

# %%
# CHECK: a forward through your units on 2 and 3 ranks: one process's logits, units freed and hooked, 4Ψ B once
check.fsdp_forward(shard_model, gather, pre_forward, post_forward, install_hooks)

# %% [markdown]
# ### Exercise 3: backward — gather again, reduce-scatter, free
#
# * `pre_backward(unit)`: this unit's backward is next. Autograd saved views of
#   `unit.full` in forward; they read whatever memory `full` has now.
# * `post_backward(unit)`: `unit.full.grad` holds this rank's gradient of the whole
#   unit, in the padded flat layout. Each rank must end with its own chunk of that
#   gradient **averaged over the ranks**, in `unit.shard.grad`, added to what is
#   already there (two backward passes before a step add up, as torch's `.grad`
#   does). Afterwards the unit holds no full-size tensor: no weights, no gradient.
#   `comm.reduce_scatter_tensor(output, input)` *sums* over ranks and leaves chunk `r`
#   on rank `r`.

# %% [markdown]
# The check trains `gpt-tiny` for 3 steps (AdamW; two backward passes before the
# first step) on 2, 3 and 4 ranks, then `gpt-mini` for a step on 2 ranks under the
# memory tracker. Targets: one process's gradients and parameters (`1e-5` + `1e-4`
# relative); bytes per step exactly `3 x 4 B x` the padded `Ψ` (gathered in forward,
# gathered again in backward, reduce-scattered); the peak within 25 % of
# `minifsdp.fsdp.FullyShardedDataParallel`'s. `check.hint("fsdp_backward")` when
# stuck.

# %%
def pre_backward(unit: Unit) -> None:
    """This unit's backward is next: its full parameters must be back."""
    # BEGIN SOLUTION
    # HINT: the weights this unit's backward reads. check.hint('fsdp_backward')
    gather(unit)
    # END SOLUTION


def post_backward(unit: Unit) -> None:
    """The unit's full gradient is complete: this rank's averaged chunk into shard.grad (added); free the unit."""
    # BEGIN SOLUTION
    # HINT: this rank's averaged chunk into shard.grad; nothing full left. check.hint('fsdp_backward')
    grad, unit.full.grad = unit.full.grad, None
    chunk = torch.empty_like(unit.shard)
    comm.reduce_scatter_tensor(chunk, grad.div_(unit.world))
    if unit.shard.grad is None:
        unit.shard.grad = chunk
    else:
        unit.shard.grad += chunk
    free(unit)
    # END SOLUTION

# %%
# CHECK: whole steps on 2, 3, 4 ranks against one process; 3·4Ψ bytes a step; the peak beside minifsdp's FSDP
check.fsdp_backward(shard_model, pre_backward, post_backward)

# %% [markdown]
# **Your sawtooth.** Memory over one training step of `gpt-mini` (4 blocks + root)
# on rank 0, measured by the check with `MemoryTracker` (lab 01): your units, then
# `minifsdp.fsdp` with FULL_SHARD (what you built, plus prefetch) and with
# SHARD_GRAD_OP (units kept gathered from forward to backward). The other rank's
# total is the thin line.
#
# **Predict first**: at the peak of your step, how many of the five units hold
# their full weights? Note your guess; the table under the figure answers.

# %%
# FIGURE
cyc = check.results["fsdp_backward"]
fig, axes = plt.subplots(1, 3, figsize=(11, 3.0), sharey=True)
for ax, (who, label) in zip(axes, (("learner", "yours"), ("FULL_SHARD", "minifsdp FULL_SHARD"),
                                   ("SHARD_GRAD_OP", "minifsdp SHARD_GRAD_OP"))):
    ranks = cyc["memory"][who]
    plot.memory(ranks[0]["samples"], ax=ax, unit="MiB", title=label)
    for r, out in enumerate(ranks[1:], start=1):
        t0_r = out["samples"][0].time
        ax.plot([(m.time - t0_r) * 1e3 for m in out["samples"]], [m.total / MiB for m in out["samples"]],
                lw=0.8, color="gray", label=f"rank {r} total")
    if who != "SHARD_GRAD_OP":
        ax.get_legend().remove()
    ax.set_ylabel("live MiB" if who == "learner" else "")
axes[-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
axes[0].set_ylim(0, 1.15 * max(o["peak"] for w in cyc["memory"] for o in cyc["memory"][w]) / MiB)
fig.suptitle(f"gpt-mini, one training step on rank 0 of {cyc['world_size']} (grey: the other rank's total)",
             fontsize=10)
plt.tight_layout()
plt.show()
block_b, root_b = cyc["unit_bytes"]["blocks.0"], cyc["unit_bytes"]["root"]
print(f"{'':16}{'peak MiB':>9}{'unsharded params at the peak':>30}   units full at the peak")
for who in ("learner", "FULL_SHARD", "SHARD_GRAD_OP"):
    top = max(cyc["memory"][who], key=lambda o: o["peak"])
    unsh = top["peak_by_category"].get("unsharded_params", 0)
    with_root = unsh >= root_b and (unsh - root_b) % block_b == 0
    blocks = (unsh - root_b * with_root) // block_b
    print(f"{who:<16}{top['peak'] / MiB:>9.2f}{unsh / MiB:>26.2f} MiB   "
          f"{blocks} block(s){' + the root' if with_root else ''}")

# %% [markdown]
# *Takeaway: every unit's full weights (the `unsharded_params` teeth) exist only
# while the unit computes, in forward and again in backward; SHARD_GRAD_OP keeps
# them from forward to backward, so its peak holds the whole model.*
#
# Why your plot shows gradient shards as *temporary* during backward and the
# library's as *gradients*: the tracker books a new tensor made inside backward as
# temporary until something names it. The library names each gradient shard the
# moment it stores it (as your `allocate` names `full`); yours are named at the
# tracker's snapshot after backward.
#
# Your bytes, unit by unit: each unit moved its padded size three times.

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'unit':<10}{'parameters':>12}{'padded':>9}{'shard':>8}")
for name, numel, padded, shard in cyc["units"]:
    print(f"{name:<10}{numel:>12,}{padded:>9,}{shard:>8,}")
padded_b = FP32 * sum(p for _, _, p, _ in cyc["units"])
print(f"{cyc['bytes_world_size']} ranks, one step: {cyc['bytes']} = 3 x {padded_b:,} B (4 B x padded Ψ): "
      f"{sum(cyc['bytes'].values()) == 3 * padded_b}")

# %% [markdown]
# The library keeps this same cycle, minus every option, in `minifsdp/fsdp/naive.py`
# (`NaiveFullyShardedDataParallel`, tested against one process in
# `tests/test_fsdp_naive.py`): compare it with yours now that your check has passed.
# `fsdp/flat_param.py` and `fsdp/fully_sharded.py` add the strategies, prefetch,
# mixed precision and state dicts.

# %% [markdown]
# ## 2. `minifsdp.fsdp` on a GPT: four sharding strategies
#
# `minifsdp.fsdp.FullyShardedDataParallel` is the real thing, with PyTorch's
# arguments: one flat parameter per **unit** (here: each transformer `Block`, and the
# root for the rest), hooks that gather a unit just before it computes and free it
# just after, gradients reduce-scattered while backward continues: your cycle, plus
# prefetch, mixed precision, state dicts. Its `sharding_strategy`:

# %% [markdown]
# | strategy | parameters between steps | after forward | gradients | collectives per step |
# |---|---|---|---|---|
# | `FULL_SHARD` (ZeRO-3) | shard | freed | reduce-scattered | all-gather x2, reduce-scatter |
# | `SHARD_GRAD_OP` (ZeRO-2) | shard | kept until backward | reduce-scattered | all-gather, reduce-scatter |
# | `NO_SHARD` (DDP) | full | full | all-reduced | all-reduce |
# | `HYBRID_SHARD` | shard within a group of `S` ranks | freed | reduce-scattered in the group, then all-reduced across groups | as FULL_SHARD in the group, + all-reduce |
#
# HYBRID_SHARD is for many machines: shard within a node (fast links), replicate
# across nodes, so only the all-reduce of a shard crosses the slow network. Here
# `S = 2` of 4 ranks.

# %% [markdown]
# The trainer (`python -m minifsdp.train` from a shell) runs each one on `gpt-mini`
# (3.3M parameters, 4 blocks) at 4 ranks (CPU ranks on a VM with fewer GPUs), with
# the memory tracker of lab 01 and the tracer.

# %%
GPT_MODEL, WORLD, STEPS, BATCH, SEQ = "gpt-mini", N4, 2, 4, 16
# HYBRID_SHARD needs two groups of at least two ranks
STRATEGY_NAMES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] + (["HYBRID_SHARD"] if WORLD >= 4 else [])


def run_trainer(strategy: str = "fsdp", world_size: int = WORLD, **options) -> dict:
    """train() with this section's model and batch, in a throw-away output folder."""
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # matplotlib layout notes from the saved plots
        cfg = TrainConfig(strategy=strategy, world_size=world_size, model=GPT_MODEL, steps=STEPS,
                          batch_size=BATCH, seq_len=SEQ, out=out, quiet=True, timeout=120, write_plots=False,
                          **options)
        return train(cfg)


# %%
t0 = time.perf_counter()
runs = {"single": run_trainer("single", world_size=1)}
for s in STRATEGY_NAMES:
    runs[s] = run_trainer(sharding_strategy=s)
print(f"single + {len(STRATEGY_NAMES)} strategies x {WORLD} ranks x {STEPS} steps: {time.perf_counter() - t0:.1f} s")
for s in STRATEGY_NAMES:
    diff = max(abs(a - b) for a, b in zip(runs[s]["losses"], runs["single"]["losses"]))
    print(f"{s:<14} max |loss - single| = {diff:.1e}")
    assert diff <= 1e-5, f"{s} trained a different model than one process"

# %% [markdown]
# Memory at the peak of the step, on the rank with the highest peak, split by what
# the tracker saw live at that moment. `unsharded_params` / `unsharded_grads` are
# FSDP's full flat tensors of the units being computed; `activations` and
# `temporary` are forward's saved tensors and backward's scratch.

# %%
CATS = ["parameters", "gradients", "optimizer", "unsharded_params", "unsharded_grads", "activations",
        "temporary"]


def peak_row(m: dict) -> tuple[int, dict]:
    """(peak bytes, bytes by category at that moment) of the rank with the highest peak."""
    r = max(range(len(m["peak_bytes"])), key=lambda i: m["peak_bytes"][i])
    return m["peak_bytes"][r], m["peak_by_category"][r]


SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "unsharded_params": "unsh.params",
         "unsharded_grads": "unsh.grads", "activations": "activ.", "temporary": "temp."}
print("MiB at the peak of a step (rank with the highest peak)")
print(f"{'':<14}{'peak':>7}" + "".join(f" {SHORT[c]:>11}" for c in CATS) + f" {'step ms':>8}")
for s in ["single"] + STRATEGY_NAMES:
    peak, cats = peak_row(runs[s])
    print(f"{s:<14}{peak / MiB:>7.1f}" + "".join(f" {cats.get(c, 0) / MiB:>11.2f}" for c in CATS)
          + f" {1e3 * runs[s]['median_step_time_s'][0]:>8.0f}")

# %%
# FIGURE
fig, ax = plt.subplots(figsize=(10, 3.2))
names = ["single"] + STRATEGY_NAMES
left = np.zeros(len(names))
for c in CATS + ["other"]:
    widths = np.array([peak_row(runs[s])[1].get(c, 0) / MiB for s in names])
    ax.barh(names, widths, left=left, color=plot.color_for(c), label=c)
    left += widths
ax.invert_yaxis()
ax.set_xlabel("live memory at the peak of a step, per rank (MiB)")
ax.set_title(f"{GPT_MODEL}, AdamW fp32, batch {BATCH}x{SEQ}; {WORLD} ranks (single: 1 process, whole batch)")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
plt.tight_layout()
plt.show()

# %% [markdown]
# *Takeaway: sharding divides the parameter and optimizer bars by N; what is left at
# the peak is the units unsharded at that moment, activations and scratch.*
#
# Reading the bars: NO_SHARD is DDP behind FSDP's API, every rank holding the full
# parameters, gradients and AdamW state (its peak, like one process's, comes in the
# optimizer step, whose scratch counts as `optimizer`). The sharded strategies keep
# `1/N` of the parameters and of the optimizer state (HYBRID_SHARD `1/S`); on top of
# that their peak holds the units unsharded at that moment and backward's scratch.
# How many units were unsharded at the peak, in the cell below, tells the
# strategies apart.

# %%
block_b = FP32 * models.count_parameters(models.build_model(GPT_MODEL).blocks[0])
root_full_b = runs["FULL_SHARD"]["n_params"] * FP32 - 4 * block_b
for s in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"):
    unsh = peak_row(runs[s])[1].get("unsharded_params", 0)
    print(f"{s:<14} unsharded params at the peak {unsh / MiB:5.2f} MiB = root ({root_full_b / MiB:.2f}) "
          f"+ {(unsh - root_full_b) / block_b:.1f} blocks of {block_b / MiB:.2f} MiB")

# %% [markdown]
# SHARD_GRAD_OP keeps every unit's full weights from forward to backward, so at its
# peak the whole model is unsharded; FULL_SHARD frees each block after its forward
# and holds only the blocks in flight in backward (the one computing and the one
# prefetched, section 4) next to the root. On a big model that whole-model copy is
# what runs SHARD_GRAD_OP out of memory first.

# %% [markdown]
# ### Bytes per step: measured against `3·4Ψ` and `2·4Ψ`
#
# `estimate.paper_comm_bytes(Ψ, strategy)` is the ZeRO paper's count (section 7), in
# multiples of the fp32 parameter bytes `4Ψ`: FULL_SHARD 3, SHARD_GRAD_OP 2, NO_SHARD
# 2 (an all-reduce moves about twice its buffer). HYBRID_SHARD with groups of `S`
# ranks: 3 inside the group, plus an all-reduce of a `1/S` shard across groups,
# `2·4Ψ/S` bytes. `estimate.comm_bytes_per_step` is the exact count (each unit
# padded; the root rule, below). The measured column is what `comm` recorded inside
# the training steps.

# %%
# NBVAL_CHECK_OUTPUT
psi = runs["single"]["n_params"]
psi_b = FP32 * psi
S = WORLD // 2
block_numels, root_numel = estimate.fsdp_unit_numels(models.build_model(GPT_MODEL, device="meta"), (models.Block,))
print(f"Ψ = {psi:,} parameters (4Ψ = {psi_b / MiB:.2f} MiB in fp32); root unit {root_numel:,} parameters")
print(f"{'':14}{'measured MiB':>13}{'in 4Ψ':>8}{'paper':>7}{'exact MiB':>11}   by collective (MiB)")
for s in STRATEGY_NAMES:
    moved = runs[s]["bytes_per_step"][0]
    total = sum(moved.values())
    exact = estimate.comm_bytes_per_step(block_numels, WORLD, s.lower(), root_numel=root_numel,
                                         shard_size=S if s == "HYBRID_SHARD" else None)["total"]
    paper = f"{estimate.paper_comm_bytes(psi, s.lower()) // psi_b}x" if s != "HYBRID_SHARD" else "-"
    ops = ", ".join(f"{op} {b / MiB:.2f}" for op, b in sorted(moved.items()))
    print(f"{s:<14}{total / MiB:>13.2f}{total / psi_b:>7.2f}x{paper:>7}{exact / MiB:>11.2f}   {ops}"
          f"{'' if total == exact else '   <- differs from the exact count'}")

# %% [markdown]
# Every strategy meets `estimate.comm_bytes_per_step` to the byte (padding included).
# SHARD_GRAD_OP and NO_SHARD meet the paper's `2·4Ψ` too. FULL_SHARD (and
# HYBRID_SHARD) measure slightly *less* than `3·4Ψ` because of **the root rule**: the
# root unit (embeddings, final norm, head) is the first one backward needs, so FSDP
# does not free it after forward, exactly as PyTorch does, and it is gathered once
# per step instead of twice. (Your version in section 1 frees the root too, and
# moves exactly `3·4Ψ`, padding aside.) HYBRID_SHARD moves the most bytes in total,
# but only its all-reduce crosses between groups: on real machines that is the part
# that travels over the slow network, `2·4Ψ/S` bytes, not `2·4Ψ`.

# %% [markdown]
# ## 3. Optional deep dive: wrap policies, what becomes a unit
#
# A unit is what FSDP gathers at once. The `auto_wrap_policy` decides, module by
# module, which submodules get their own FSDP wrapper (the names mirror
# `torch.distributed.fsdp.wrap`):
#
# * `"block"`: `ModuleWrapPolicy({Block})` (PyTorch's `transformer_auto_wrap_policy`),
#   one unit per transformer layer;
# * `"size"`: `size_based_auto_wrap_policy(min_num_params=100_000)`, a module becomes a
#   unit once the parameters left unwrapped under it reach 100k;
# * `"none"`: no policy, the whole model is one unit.
#
# Each rank's units, with their sizes and this rank's shard:

# %%
POLICIES = {"block": ModuleWrapPolicy({models.Block}),
            "size": functools.partial(size_based_auto_wrap_policy, min_num_params=100_000),
            "none": None}


def units_worker(model_name: str, policies: dict) -> dict:
    """For each policy: the FSDP units of the wrapped model (name, numel, padded, shard)."""
    out = {}
    for name, policy in policies.items():
        model = FSDP(models.build_model(model_name), auto_wrap_policy=policy)
        rows = []
        for path, m in model.named_modules():
            if isinstance(m, FSDP):
                h = m._handles[0]                     # its FlatParamHandle (fsdp/flat_param.py)
                unit = path.replace("_fsdp_wrapped_module.", "") or "root"
                tensors = [info.fqn for info in h.infos]   # the original tensors it flattened
                rows.append((unit, h.numel, h.padded_numel, h.shard_numel, tensors))
        out[name] = rows
    return out


unit_runs = minifsdp.launch(units_worker, WORLD, GPT_MODEL, POLICIES, timeout=60)

# %%
# NBVAL_CHECK_OUTPUT
def short(names: list[str], width: int = 60) -> str:
    text = ", ".join(names)
    return text if len(text) <= width else text[:width - 5].rsplit(",", 1)[0] + ", ..."


for name in POLICIES:
    rows = unit_runs[0][name]
    assert sum(r[1] for r in rows) == psi, "the units must hold every parameter exactly once"
    assert all(u[name] == rows for u in unit_runs), "every rank must have the same units"
    print(f"wrap={name!r}: {len(rows)} unit(s)          parameters     padded   shard/rank   tensors")
    for unit, n_el, padded, shard, tensors in rows:
        print(f"   {unit:<20}{n_el:>12,}{padded:>11,}{shard:>13,}   {len(tensors):>2}: {short(tensors)}")

# %% [markdown]
# The size policy looks inside each block (790k parameters): the attention's `c_attn`
# and the MLP's `c_fc` and `c_proj` pass 100k on their own and become units; what is
# left of the block (the LayerNorms and the attention's 65k `c_proj`) never reaches
# 100k, so it stays with the root. Now the same training run with the whole model as
# one unit (`"none"`, FULL_SHARD, 4 ranks; `"block"` is section 2's run). The
# `"size"` run is one line away (`wrap="size"`) if you want its peak too.

# %%
t0 = time.perf_counter()
wrap_runs = {"block": runs["FULL_SHARD"]}
for name in ("none",):
    wrap_runs[name] = run_trainer(sharding_strategy="FULL_SHARD", wrap=name)
print(f"1 more run: {time.perf_counter() - t0:.1f} s")
print(f"{'wrap':<7}{'units':>6}{'largest unit':>14}{'peak MiB':>10}{'unsharded params':>18}"
      f"{'all_gather MiB':>16}{'step ms':>9}")
for name, m in wrap_runs.items():
    peak, cats = peak_row(m)
    rows = unit_runs[0][name]
    print(f"{name:<7}{len(rows):>6}{max(r[1] for r in rows):>14,}{peak / MiB:>10.1f}"
          f"{cats.get('unsharded_params', 0) / MiB:>18.2f}{m['bytes_per_step'][0]['all_gather'] / MiB:>16.2f}"
          f"{1e3 * m['median_step_time_s'][0]:>9.0f}")
    assert max(abs(a - b) for a, b in zip(m["losses"], runs["single"]["losses"])) <= 1e-5
one_peak, one_cats = peak_row(wrap_runs["none"])
vs_block = one_peak / peak_row(wrap_runs["block"])[0]
vs_ddp = one_peak / peak_row(runs["NO_SHARD"])[0]
print(f"wrap='none': full parameters at the peak {one_cats['unsharded_params'] / MiB:.2f} MiB (4Ψ = "
      f"{psi_b / MiB:.2f} MiB); peak = {vs_block:.2f} x wrap='block', {vs_ddp:.2f} x NO_SHARD (section 2)")
assert one_cats["unsharded_params"] == psi_b, "with one unit the whole model should be full at the peak"
assert vs_block > 1.5, f"the text below says one unit peaks far above one unit per block: {vs_block:.2f}x"

# %% [markdown]
# With one unit (`"none"`) the whole model is gathered at once: at the peak every
# parameter is full (the last line: exactly `4Ψ` bytes) and backward builds the full
# gradient beside it, so the peak is far above the per-block run's. What still
# keeps it under NO_SHARD (plain DDP) is only the sharded optimizer state: for the
# parameters and gradients, one unit buys nothing at the peak. Since the root is
# never freed between forward and backward, the one unit is gathered once per step
# (`4Ψ` bytes of all-gather, not `2·4Ψ`). Smaller units lower the unsharded part of
# the peak (at most the unit computing plus the one being prefetched); each unit
# costs its own collectives, so on real hardware units that are too small lose to
# latency. Both runs train the same model (losses within `1e-5` of one
# process).

# %% [markdown]
# ## 4. Optional deep dive: prefetch, when the next all-gather starts
#
# In backward the units run in reverse order, and each needs its full weights
# again. If FSDP asks for them only when the unit starts, every unit waits for
# its all-gather. `backward_prefetch` asks earlier:
#
# * `BACKWARD_PRE` (the default): when unit `i` **starts** its backward, start the
#   all-gather of the unit that comes next (`i - 1`); it overlaps `i`'s gradient
#   computation. Two units are full at once.
# * `BACKWARD_POST`: when unit `i` **has finished** its gradients; less overlap, less
#   memory.
# * `None`: on demand, in the unit's own pre-backward hook.
#
# `forward_prefetch=True` does the same in forward: while a unit computes, gather the
# one that ran next in the previous step. `limit_all_gathers=True` (the rate limiter,
# on by default) bounds how many units are unsharded at once. PyTorch's limiter never
# skips an all-gather: before issuing one it makes the CPU thread wait until the GPU
# has freed the unit gathered two all-gathers earlier, so a CPU running far ahead of
# the GPU cannot fill the memory with gathered units. minifsdp simplifies: its steps
# run on one thread with no GPU to wait for (waiting there would never end), so it
# **skips** a prefetch while 2 non-root units are unsharded and that unit is gathered
# on demand instead. The worker runs 2 steps under each setting on 2 ranks and
# returns the traces.

# %%
NESTED = ModuleWrapPolicy({models.Block, models.FeedForward})   # each block, and each block's MLP inside it
PF_CONFIGS = {"BACKWARD_PRE": dict(backward_prefetch=BackwardPrefetch.BACKWARD_PRE),
              "BACKWARD_POST": dict(backward_prefetch=BackwardPrefetch.BACKWARD_POST),
              "none": dict(backward_prefetch=None),
              "forward_prefetch": dict(forward_prefetch=True),
              "nested units + forward_prefetch": dict(units=NESTED, forward_prefetch=True),
              "nested units + forward_prefetch, no limit": dict(units=NESTED, forward_prefetch=True,
                                                                limit_all_gathers=False)}


def prefetch_worker(model_name: str, batch: int, seq_len: int, configs: dict, steps: int = 2) -> dict:
    """Per setting: this rank's trace of `steps` FSDP training steps and the root's prefetch stats."""
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    out = {}
    for name, kwargs in configs.items():
        kwargs = dict(kwargs)
        policy = kwargs.pop("units", ModuleWrapPolicy({models.Block}))
        model = FSDP(models.build_model(model_name), auto_wrap_policy=policy, **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        with trace.Tracer(rank=rank) as tracer:
            for step in range(steps):
                x, y = data.get_batch(step, batch, seq_len, rank=rank, world_size=n)
                with trace.span("step", step=step):
                    with trace.span("forward", step=step):
                        loss = models.lm_loss(model(x.to(device)), y.to(device))
                    with trace.span("backward", step=step):
                        loss.backward()
                    with trace.span("optimizer", step=step):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
        out[name] = {"trace": tracer.trace, "stats": dict(model.stats), "losses": losses}
    return out


t0 = time.perf_counter()
pf_runs = minifsdp.launch(prefetch_worker, N2, GPT_MODEL, BATCH, SEQ, PF_CONFIGS, timeout=120)
print(f"{len(PF_CONFIGS)} settings x 2 steps on {N2} ranks: {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# Where did each backward all-gather start? For every unit after the first in
# backward order, compared with the unit computed just before it (`prev`), on rank
# 0 in the second step:

# %%
# NBVAL_CHECK_OUTPUT
def backward_gathers(tr: trace.Trace, step: int = 1) -> list[tuple[str, str]]:
    """(unit, when its all-gather was issued) for the backward of `step`."""
    bwd = next(s for s in tr.compute_spans() if s.name == "backward" and s.args.get("step") == step)
    spans = [s for s in tr.spans if bwd.start <= s.start <= bwd.end]
    pre = {s.args["unit"]: s for s in spans if s.name.startswith("pre_backward")}
    post = {s.args["unit"]: s for s in spans if s.name.startswith("post_backward")}
    gathers = {s.args.get("unit"): s for s in spans if s.name == "all_gather"}
    order = sorted(post, key=lambda u: post[u].start)          # backward order of the units
    rows = []
    for prev, unit in zip(order, order[1:]):
        g = gathers.get(unit)
        if g is None:
            when = "no all-gather: never freed after forward (the root)"
        elif g.start < post[prev].start:
            when = f"all-gather issued while {prev} computes its gradients"
        elif g.start < pre[unit].start:
            when = f"all-gather issued after {prev}'s gradients, before its own backward"
        else:
            when = "all-gather issued on demand, in its own pre-backward hook"
        rows.append((unit, when))
    return rows


for name in ("BACKWARD_PRE", "BACKWARD_POST", "none"):
    print(f"backward_prefetch={name}:")
    for unit, when in backward_gathers(pf_runs[0][name]["trace"]):
        print(f"   {unit:<9} {when}")

# %% [markdown]
# The same, drawn: ranks 0 and 1 during the backward of the second step, one panel
# per setting. To keep the picture readable, `backward_view` keeps the backward span,
# one bar per block from the end of its pre-backward hook to the start of its
# post-backward hook (that block's gradient computation), and the all-gathers (the
# reduce-scatters are in the trace too, left out of this picture).

# %%
# FIGURE
def backward_view(tr: trace.Trace, step: int = 1) -> trace.Trace:
    """A trace of `step`'s backward only: the backward span, each block's gradient compute, the all-gathers."""
    bwd = next(s for s in tr.compute_spans() if s.name == "backward" and s.args.get("step") == step)
    inside = [s for s in tr.spans if bwd.start <= s.start <= bwd.end]
    pre = {s.args["unit"]: s for s in inside if s.name.startswith("pre_backward")}
    post = {s.args["unit"]: s for s in inside if s.name.startswith("post_backward")}
    blocks = [trace.Span(f"{u} grads", trace.COMPUTE, pre[u].end, post[u].start, {"unit": u})
              for u in pre if u != "root" and u in post]
    return trace.Trace(rank=tr.rank, spans=[bwd] + blocks + [s for s in inside if s.name == "all_gather"])


fig, axes = plt.subplots(3, 1, figsize=(10, 6.6))
for ax, name in zip(axes, ("BACKWARD_PRE", "BACKWARD_POST", "none")):
    views = [backward_view(r[name]["trace"]) for r in pf_runs]
    t_zero = min(s.start for v in views for s in v.spans)      # plot.timeline's time zero
    bwd_ms = [((v.spans[0].start - t_zero) * 1e3, (v.spans[0].end - t_zero) * 1e3) for v in views]
    plot.timeline(views, ax=ax, window=(min(a for a, _ in bwd_ms) - 1, max(b for _, b in bwd_ms) + 1),
                  title=f"backward_prefetch={name}: backward of step 2 ({GPT_MODEL}, FULL_SHARD, {N2} ranks)")
fig.tight_layout()
plt.show()

# %% [markdown]
# *Takeaway: the earlier the prefetch, the more of each all-gather hides under the
# previous block's gradient computation.*
#
# An all-gather's bar runs from the moment it is issued to the moment its unit waits
# for it (the first one, blocks.3's, is prefetched by the root as backward begins).
# With `BACKWARD_PRE` each block's all-gather starts under the previous block's
# gradient bar; with `BACKWARD_POST` only once that bar has ended; with none when the
# block itself is reached, and the block waits for it. On a GPU the all-gather runs
# on its own stream and hides behind compute; on CPU gloo works in a background
# thread, so the overlap is partial.
#
# The rate limiter, counted by the root (`model.stats`). The last two settings nest
# units: each block's MLP is a unit of its own inside the block's unit, so while the
# MLP computes, its block is unsharded too.

# %%
print(f"{'setting':<43}{'prefetches':>11}{'skipped':>9}{'most non-root units unsharded':>31}")
for name, run in pf_runs[0].items():
    st = run["stats"]
    print(f"{name:<43}{st['prefetches']:>11}{st['prefetches_skipped']:>9}{st['peak_unsharded_units']:>31}")
same = all(r[name]["losses"] == r["BACKWARD_PRE"]["losses"] for r in pf_runs for name in PF_CONFIGS)
print("prefetch changes when bytes move, never the numbers: bit-identical losses in every setting, every rank:",
      same)
assert same

# %% [markdown]
# With one unit per block, resharded right after its forward (FULL_SHARD), at most
# the block computing and the one being prefetched are full: two, the limit, so the
# limiter has nothing to skip. With nested units, the MLP's forward would prefetch
# the next block while the MLP *and* its block are full: the limiter skips those
# prefetches (the next block is then gathered on demand) and keeps the count at two;
# without it, three units are full at once. On GPUs the limiter matters more: the
# CPU issues work far ahead of the GPU, and without a bound it could start the
# all-gathers of many units and fill the memory with them before the GPU gets there
# (PyTorch's limiter makes the CPU wait there; minifsdp's skips the prefetch).

# %% [markdown]
# ## 5. Optional deep dive: checkpoints, save a full state dict and resume in a fresh launch
#
# `FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, ...)` makes
# `model.state_dict()` gather every unit and return the *unwrapped* model's keys
# and shapes (`blocks.0.attn.c_attn.weight`, ...), so the file loads into a plain model
# or into FSDP at any world size. `rank0_only=True` keeps the gathered copy on rank 0
# only (the one that writes the file); `FSDP.optim_state_dict` does the same for
# AdamW's moments. PyTorch's API, unchanged.
#
# Run A trains steps 0-3 without stopping and saves a checkpoint before step 2. Run
# B is a fresh launch: it builds the model with a *different* seed, loads the
# checkpoint and trains steps 2-3. Run C does the same on 4 ranks instead of 2.

# %%
CK_STEPS, CK_SAVE_AT = 4, 2


def checkpoint_worker(path: str, resume: bool) -> dict:
    """Train gpt-mini with FSDP; save a FULL checkpoint before step CK_SAVE_AT, or resume from it."""
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    model = FSDP(models.build_model(GPT_MODEL, seed=7 if resume else 0),
                 auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    first, out = 0, {"losses": {}}
    if resume:
        ckpt = torch.load(path, map_location=device, weights_only=False)   # every rank reads the whole file
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(ckpt["model"])                # each rank keeps its shard of it
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
        first = ckpt["step"]
    for step in range(first, CK_STEPS):
        if not resume and step == CK_SAVE_AT:
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                      FullOptimStateDictConfig(rank0_only=True)):
                full = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt), "step": step}
            if rank == 0:
                torch.save(full, path)
                out["keys"] = len(full["model"])
                out["first_key"] = next(iter(full["model"]))
            out["held_bytes"] = sum(t.nbytes for t in full["model"].values())   # 0 off rank 0
        x, y = data.get_batch(step, BATCH, SEQ, rank=rank, world_size=n)
        loss = models.lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().reshape(1)
        tdist.all_reduce(total)
        out["losses"][step] = total.item() / n
    return out


# %%
t0 = time.perf_counter()
with tempfile.TemporaryDirectory() as ck_dir:
    ck_path = os.path.join(ck_dir, "full.pt")
    run_a = minifsdp.launch(checkpoint_worker, N2, ck_path, False, timeout=120)
    ck_size = os.path.getsize(ck_path)
    run_b = minifsdp.launch(checkpoint_worker, N2, ck_path, True, timeout=120)
    run_c = minifsdp.launch(checkpoint_worker, N4, ck_path, True, timeout=120)
print(f"3 launches in {time.perf_counter() - t0:.1f} s; checkpoint file {ck_size / MiB:.2f} MiB "
      f"({run_a[0]['keys']} tensors, first key {run_a[0]['first_key']!r}); "
      f"gathered bytes held by rank 0: {run_a[0]['held_bytes']:,}, rank 1: {run_a[1]['held_bytes']:,}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'step':>4}{'A: 2 ranks, no stop':>22}{'B: resumed, 2 ranks':>22}{'C: resumed, 4 ranks':>22}")
for step in range(CK_STEPS):
    b, c = run_b[0]["losses"].get(step), run_c[0]["losses"].get(step)
    print(f"{step:>4}{run_a[0]['losses'][step]:>22.6f}" + (f"{b:>22.6f}{c:>22.6f}" if b is not None else
                                                          f"{'(before the save)':>22}{'':>22}"))
resumed = range(CK_SAVE_AT, CK_STEPS)
diff_b = max(abs(run_b[0]["losses"][s] - run_a[0]["losses"][s]) for s in resumed)
diff_c = max(abs(run_c[0]["losses"][s] - run_a[0]["losses"][s]) for s in resumed)
print(f"max |B - A| = {diff_b:.1e} (bit-exact: same world size, same order of every sum)")
print(f"max |C - A| <= 1e-5: {diff_c <= 1e-5} (4 ranks add the gradients in another order)")
assert diff_b == 0.0 and diff_c <= 1e-5

# %% [markdown]
# Run B continues exactly where A was: the same losses to the last bit, although its
# model started from other weights. The full checkpoint does not remember the world
# size, so run C resumed it on 4 ranks. (`SHARDED_STATE_DICT` writes one file per
# rank with no communication, which is what you want for big models; it reloads
# at the same world size. `minifsdp.fsdp.save_sharded` / `load_sharded` write a
# sharded folder, model and optimizer, that loads at any world size.
# `tests/test_fsdp_state_dict.py` covers all three.)
#
# ## 6. Optional deep dive: the same run with PyTorch's FSDP
#
# `strategy="torch-fsdp"` wraps the same model with
# `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1, which runs on CPU with
# `device_id=cpu`), the same `transformer_auto_wrap_policy` on `Block`, FULL_SHARD,
# BACKWARD_PRE, 4 ranks: the configuration of section 2's FULL_SHARD run.

# %%
t0 = time.perf_counter()
torch_run = run_trainer("torch-fsdp", sharding_strategy="FULL_SHARD")
print(f"torch FSDP, {WORLD} ranks x {STEPS} steps: {time.perf_counter() - t0:.1f} s")
ours = runs["FULL_SHARD"]
print(f"{'step':>4}{'single':>12}{'minifsdp':>12}{'torch FSDP':>12}")
for step in range(STEPS):
    print(f"{step:>4}" + "".join(f"{m['losses'][step]:>12.6f}" for m in (runs["single"], ours, torch_run)))
diff = max(abs(a - b) for a, b in zip(ours["losses"], torch_run["losses"]))
ratio = ours["median_step_time_s"][0] / torch_run["median_step_time_s"][0]
print(f"max |minifsdp - torch FSDP| = {diff:.1e}")
print(f"median step time, rank 0: minifsdp {1e3 * ours['median_step_time_s'][0]:.0f} ms, torch FSDP "
      f"{1e3 * torch_run['median_step_time_s'][0]:.0f} ms: ratio {ratio:.2f}")
print(f"peak memory, rank 0: minifsdp {ours['peak_bytes'][0] / MiB:.1f} MiB, "
      f"torch FSDP {torch_run['peak_bytes'][0] / MiB:.1f} MiB")
ours_moved, torch_moved = (sum(m["bytes_per_step"][0].values()) for m in (ours, torch_run))
print(f"bytes moved per step, rank 0: minifsdp {ours_moved / MiB:.2f} MiB, torch FSDP {torch_moved / MiB:.2f} MiB")
assert diff <= 1e-5, "minifsdp and torch FSDP trained different models"
assert ours_moved == torch_moved, "minifsdp and torch FSDP should move the same bytes per step"

# %% [markdown]
# Both train the same model as one process, to within `1e-5`. The cell above
# measured the step-time ratio on this machine: a few steps of a small model on
# shared CPU cores, so it is noisy (repeat it, or run `python -m minifsdp.bench`);
# the trainer counts PyTorch's collectives too
# (`minifsdp.torch_reference.count_collectives`), and the bytes agree (line above).

# %% [markdown]
# ## Summary
#
# FSDP keeps `1/N` of every parameter, gradient and optimizer state per rank, in
# one flat padded shard per unit, and gathers a unit only while it computes: you
# built that cycle with four hooks on a multi-unit GPT and matched one process on 2
# to 4 ranks, moving exactly `3·4Ψ` bytes per step. The sharding strategies trade
# memory for bytes (`3·4Ψ` FULL_SHARD, `2·4Ψ` SHARD_GRAD_OP and NO_SHARD, measured to
# the byte, the root's single gather included), the wrap policy decides how much is
# full at once, prefetch decides when the next gather starts, and a full state dict
# resumes bit-exactly at the same world size and within `1e-5` at another.

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
