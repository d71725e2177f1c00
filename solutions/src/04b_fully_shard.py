# Lab 04b - per-parameter sharding (FSDP2's fully_shard). Source of solutions/04b_fully_shard.ipynb and
# labs/04b_fully_shard.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 04b — Per-parameter sharding: FSDP2's `fully_shard`
#
# **You will be able to** shard each parameter along its first dimension as PyTorch's
# FSDP2 does (padding included), gather a block with one all-gather and reduce-scatter its
# gradients with one call, measure gradient accumulation with and without sync, compare
# bytes, padding and peak memory with lab 04's flat unit, and run FSDP2 code written for
# PyTorch on minifsdp by changing one import.
#
# **Prerequisites**: labs 00–04.
#
# **Time**: 60 minutes of work; the cells compute for about 20 seconds on a laptop (CPU,
# `gloo`) and about as long on a GPU VM (launches needing more ranks than GPUs use CPU ranks).
#
# **Exercises**: 1. a parameter's `Shard(0)` piece · 2. unshard: one all-gather per group ·
# 3. one reduce-scatter for a group's gradients · 4. post-backward, with and without sync.
#
# `Ψ` = the number of parameters, `N` = the world size; fp32 parameters take `4Ψ` B.

# %%
import contextlib
import gc
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import minifsdp
from minifsdp import comm, data, dist, memory, models, plot, trace
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import ModuleWrapPolicy
from minifsdp.labcheck import lab04b as check

# Small tensors: one compute thread per process is as fast, and several ranks share the cores.
torch.set_num_threads(1)
MiB, KiB, FP32 = 2**20, 2**10, 4
# Launches of 2 and 3 ranks: one per GPU where the machine has that many, else CPU ranks (gloo).
N2, N3 = 2, 3
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. Build it: one parameter, one shard
#
# Lab 04's unit concatenated a block's tensors into one flat vector and cut *that* into
# `N` pieces. PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) cuts **each
# parameter** along its first dimension instead, as `torch.chunk` does: `ceil(n/N)` rows
# per rank until the rows run out. Every piece is then padded with zero rows to
# `ceil(n/N)` rows, so that each rank sends the same bytes to the all-gather. A `[5, 3]`
# weight on `N = 4` ranks:
#
# ```
# rows        0 1 | 2 3 | 4 . | . .     (. = a padding row of zeros)
# rank          0     1     2     3
# real rows     2     2     1     0     <- rank 3 holds no row of this parameter
# padded        2     2     2     2     <- what every rank sends
# ```

# %% [markdown]
# The sharded parameter keeps its name, its shape (a `DTensor` of shape `[5, 3]` with
# placement `Shard(0)`), its dtype and its `requires_grad`: the optimizer, the state dict
# and your code see the real parameter, with no flat buffer to map back.

# %% [markdown]
# ### Exercise 1: a parameter's `Shard(0)` piece
#
# * `shard_param(param, rank, world) -> Tensor`: rank `rank`'s rows of `param` (dim 0 cut
#   as `torch.chunk` cuts it), then zero rows up to `ceil(n/N)` rows, where `n` is the
#   size of dim 0; a tensor of its own, with no autograd history;
# * `real_rows(n, rank, world) -> int`: how many of those rows are real.
#
# Target: torch's own `Shard(0)` split (`torch.distributed.tensor`), on 6 shapes at
# `N` = 2, 3, 4, 8, ranks holding no real row included. Stuck? `check.hint("shard_param")`
# prints the next hint (the idea first, never the code); each exercise has its own.

# %%
def shard_param(param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of `param` (torch.chunk's piece), zero-padded to ceil(n / world) rows; a copy.

    >>> shard_param(torch.arange(5.), 2, 4)   # rows [0 1 | 2 3 | 4 . | . .]
    tensor([4., 0.])
    """
    # BEGIN SOLUTION
    # HINT: this rank's rows of dim 0, then zero rows up to ceil(n / world). check.hint('shard_param')
    rows = math.ceil(param.shape[0] / world)
    mine = param.detach()[rank * rows:(rank + 1) * rows]
    shard = param.new_zeros((rows, *param.shape[1:]))
    shard[:mine.shape[0]] = mine
    return shard
    # END SOLUTION


def real_rows(n: int, rank: int, world: int) -> int:
    """How many rows of rank `rank`'s padded piece are rows of the parameter (dim 0 of size n)."""
    # BEGIN SOLUTION
    # HINT: the rows left for this rank, never below 0 or above ceil(n / world). check.hint('shard_param')
    rows = math.ceil(n / world)
    return max(0, min(rows, n - rank * rows))
    # END SOLUTION

# %%
# CHECK: 6 shapes at N = 2, 3, 4, 8 against torch's Shard(0) split, padding and empty ranks included
check.shard_param(shard_param, real_rows)

# %% [markdown]
# ### The scaffolding: a group, and FSDP2's recipe
#
# FSDP2's user code is `fully_shard(block)` for every block, then `fully_shard(model)` for
# what is left. `shard_model(model)` does the same with a `Group` per call. For each of its
# parameters a group keeps `padded` (your `shard_param`), `sharded` (the `nn.Parameter`
# the optimizer steps: your `real_rows` of `padded`, sharing its memory), `unsharded` (a
# full-size `nn.Parameter` whose memory is freed at rest, like lab 04's `full`) and `slots`,
# where the parameter lives: `(module, attribute name)`.
#
# The hooks: before a group's forward, `unshard(group)`; after it, `reshard(group)`, and the
# output hooked so that backward unshards the group again first; once autograd has
# accumulated the gradient of every unsharded parameter of the group, `post_backward(group)`.
# You write those three next. `model.set_requires_gradient_sync(flag)` sets every
# group's `sync`, as FSDP2's method of that name does.

# %%
class Group:
    """One FSDP2 parameter group on this rank: a module's parameters, each sharded on its own along dim 0."""

    def __init__(self, module: nn.Module, params: list[tuple[nn.Module, str, nn.Parameter]]):
        self.module, self.rank, self.world = module, dist.rank(), dist.world_size()
        device = dist.device()
        self.slots = [(m, attr) for m, attr, _ in params]
        self.padded = [shard_param(p.detach().to(device), self.rank, self.world) for *_, p in params]
        self.sharded = [nn.Parameter(s[:real_rows(p.shape[0], self.rank, self.world)])   # shares s's memory
                        for s, (*_, p) in zip(self.padded, params)]
        self.unsharded = [nn.Parameter(torch.empty(p.shape, device=device)) for *_, p in params]
        self.sync, self.ready = True, 0
        for u in self.unsharded:
            u.register_post_accumulate_grad_hook(self._grad_ready)
        reshard(self)        # at rest: the modules hold the sharded parameters, nothing unsharded (your reshard)

    def allocate(self) -> None:
        """Memory behind every unsharded parameter again (any contents), named for the memory plots."""
        for u in self.unsharded:
            u.untyped_storage().resize_(u.numel() * u.element_size())
            for tracker in memory.active_trackers():
                tracker.register(u, "unsharded_params")

    def free(self) -> None:
        """No memory behind the unsharded parameters; the objects stay (autograd saved them in forward)."""
        for u in self.unsharded:
            u.untyped_storage().resize_(0)

    def _grad_ready(self, u: nn.Parameter) -> None:
        for tracker in memory.active_trackers():
            tracker.register(u.grad, "unsharded_grads")
        self.ready += 1
        if self.ready == len(self.unsharded):     # the group's whole gradient is accumulated
            self.ready = 0
            post_backward(self)
            for tracker in memory.active_trackers():   # name the sharded gradients for the memory plots
                tracker.register([p.grad for p in self.sharded if p.grad is not None], "gradients")


def shard_model(model: nn.Module) -> list[Group]:
    """FSDP2's recipe, fully_shard(block) for every Block, then fully_shard(model): a hooked Group for each."""
    groups, taken = [], set()
    for module in [m for m in model.modules() if isinstance(m, models.Block)] + [model]:
        params = [(m, attr, p) for m in module.modules() for attr, p in m._parameters.items()
                  if p is not None and id(p) not in taken]
        group = Group(module, params)
        taken.update(id(p) for p in group.sharded)     # the root takes only what no Block took
        groups.append(group)
        module.register_forward_pre_hook(lambda m, args, g=group: unshard(g))
        module.register_forward_hook(lambda m, args, output, g=group: after_forward(g, output))

    def set_requires_gradient_sync(sync: bool) -> None:
        for g in groups:
            g.sync = sync
    model.set_requires_gradient_sync = set_requires_gradient_sync
    return groups


def after_forward(group: Group, output: torch.Tensor) -> None:
    reshard(group)
    if output.requires_grad:                       # backward reaches this group next: gather it first
        output.register_hook(lambda grad: unshard(group))

# %% [markdown]
# ### Exercise 2: unshard — one all-gather for the whole group
#
# * `unshard(group)`: every unsharded parameter holds its full values, gathered from all
#   ranks with **one** `comm.all_gather_into_tensor` for the group, and the modules
#   compute with the unsharded parameters. `group.allocate()` gives them memory first.
# * `reshard(group)`: the modules hold the sharded parameters again, and `group.free()`.
#
# An all-gather takes one tensor per rank, of the same size on every rank: copy the
# padded shards into one buffer first (FSDP2's *copy-in*), then take each parameter out
# of the gathered result, without its padding rows (*copy-out*). Autograd saved the
# unsharded parameters in forward: write their values without autograd seeing the write.
#
# Target, at 3 ranks: one process's logits on `gpt-tiny` and on a small MLP where rank 2
# holds no row of some parameters; one all-gather per group, `4 B x` the padded `Ψ` in
# all. `check.hint("unshard")` when stuck.

# %%
def unshard(group: Group) -> None:
    """One all-gather for the group: each unsharded parameter holds its full values; the modules use them."""
    # BEGIN SOLUTION
    # HINT: one buffer in, one all-gather, each parameter out without padding. check.hint('unshard')
    group.allocate()
    send = torch.cat([s.reshape(-1) for s in group.padded])              # copy-in
    recv = send.new_empty(group.world * send.numel())
    comm.all_gather_into_tensor(recv, send)
    pieces = recv.view(group.world, -1).split([s.numel() for s in group.padded], dim=1)
    for u, piece in zip(group.unsharded, pieces):                        # copy-out: rank order = row order
        u.data.copy_(piece.reshape(-1, *u.shape[1:])[:u.shape[0]])
    for (module, attr), u in zip(group.slots, group.unsharded):
        module._parameters[attr] = u
    # END SOLUTION


def reshard(group: Group) -> None:
    """The modules hold the sharded parameters again; the unsharded ones hold no memory."""
    # BEGIN SOLUTION
    # HINT: swap the modules back to the sharded parameters, then free. check.hint('unshard')
    for (module, attr), p in zip(group.slots, group.sharded):
        module._parameters[attr] = p
    group.free()
    # END SOLUTION

# %%
# CHECK: forwards on 3 ranks (gpt-tiny, and an MLP with an empty rank) against one process; one all-gather per group
check.unshard(shard_model, unshard, reshard)

# %% [markdown]
# ### Exercise 3: one reduce-scatter for a group's gradients
#
# After backward every rank holds its own full gradient of each parameter of the group.
# `reduce_scatter_grads(grads) -> list[Tensor]` returns, for each gradient, this rank's
# real rows of the **average over the ranks**, with **one** `comm.reduce_scatter_tensor`
# for the group. A reduce-scatter *sums* over ranks and gives rank `r` the `r`-th of `N`
# equal pieces of its input: which layout of that input puts every gradient's rows of
# rank `r` into piece `r`?
#
# Target, at 3 ranks, 5 gradients of awkward shapes (rank 2 holds no row of two of them):
# the average of the ranks' gradients, rank `r`'s rows; one reduce-scatter of `4 B x` the
# padded size. `check.hint("reduce_scatter_grads")` when stuck.

# %%
def reduce_scatter_grads(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One reduce-scatter for the group: this rank's real rows of each gradient, averaged over the ranks."""
    # BEGIN SOLUTION
    # HINT: input piece r = rank r's padded rows of every gradient. check.hint('reduce_scatter_grads')
    world, rank = dist.world_size(), dist.rank()
    rows = [math.ceil(g.shape[0] / world) for g in grads]
    sizes = [r * g[0].numel() for g, r in zip(grads, rows)]             # one rank's padded piece of each
    send = grads[0].new_empty(world, sum(sizes))                        # row r: rank r's pieces, side by side
    for g, r, columns in zip(grads, rows, send.split(sizes, dim=1)):
        columns.copy_(F.pad(g.reshape(g.shape[0], -1), (0, 0, 0, world * r - g.shape[0])).view(world, -1))
    recv = send.new_empty(send.shape[1])
    comm.reduce_scatter_tensor(recv, send.view(-1))
    recv /= world
    return [piece.view(r, *g.shape[1:])[:real_rows(g.shape[0], rank, world)]
            for g, r, piece in zip(grads, rows, recv.split(sizes))]
    # END SOLUTION

# %%
# CHECK: 5 gradients on 3 ranks: the average, rank r's real rows, in one reduce-scatter
check.reduce_scatter_grads(reduce_scatter_grads)

# %% [markdown]
# ### Exercise 4: post-backward, with and without sync
#
# Gradient accumulation: several micro-batches, one optimizer step. FSDP2's
# `model.set_requires_gradient_sync(False)` skips the reduce-scatter: the gradients add up
# in the **unsharded** parameters' `.grad` until a backward with sync reduce-scatters their
# sum, once. Fewer bytes, more memory.
#
# * `post_backward(group)`: the group's gradient is complete (`.grad` of each unsharded
#   parameter). With `group.sync`: this rank's averaged rows **added** to each sharded
#   parameter's `.grad`, and no full-size gradient left behind; without: keep them. Then
#   reshard.
# * `train_step(model, opt, batches, sync_every_micro_batch)`: a backward of
#   `models.lm_loss` for each `(x, y)` in `batches` (their gradients add up, unscaled),
#   then one optimizer step; sync after every micro-batch, or after the last only.

# %% [markdown]
# The check trains `gpt-tiny` on 3 ranks for two steps of 2 micro-batches: the first syncs
# after every micro-batch, the second after the last only. Targets: one process's
# gradients and parameters; per step `2 x 2` all-gathers of the padded parameters
# (forward and backward of each micro-batch) and 2 reduce-scatters with sync every
# micro-batch, 1 without; between micro-batches, with sync no full-size gradient is held,
# without sync exactly `4Ψ` bytes of them. `check.hint("post_backward")` when stuck.

# %%
def post_backward(group: Group) -> None:
    """The group's gradient is complete: with sync, reduce-scatter it into the sharded .grad (added); reshard."""
    # BEGIN SOLUTION
    # HINT: sync or not decides where the gradient stays until the step. check.hint('post_backward')
    if group.sync:
        reduced = reduce_scatter_grads([u.grad for u in group.unsharded])
        for p, g in zip(group.sharded, reduced):
            p.grad = g if p.grad is None else p.grad + g
        for u in group.unsharded:
            u.grad = None
    reshard(group)
    # END SOLUTION


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batches: list, sync_every_micro_batch: bool) -> None:
    """One optimizer step over the micro-batches; reduce-scatter after each one, or after the last only."""
    # BEGIN SOLUTION
    # HINT: FSDP2 code: say before each backward whether it syncs. check.hint('post_backward')
    for i, (x, y) in enumerate(batches):
        model.set_requires_gradient_sync(sync_every_micro_batch or i == len(batches) - 1)
        models.lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # END SOLUTION

# %%
# CHECK: two accumulation steps on 3 ranks against one process; bytes and held gradients with and without sync
check.post_backward(shard_model, post_backward, train_step)

# %% [markdown]
# The library's per-parameter FSDP is `minifsdp.fsdp.fully_shard` (`fsdp/fully_shard.py`,
# `fsdp_param.py`, `param_group.py`): your four pieces, plus prefetch, mixed precision,
# CPU offload and `reshard_after_forward=int`. Compare it with yours now that your checks
# pass. One difference: `fully_shard`, like PyTorch's, keeps the root unsharded from
# forward to backward (the root computes first in backward), so it gathers the root once
# per step, not twice; lab 04's flat FSDP does the same (section 2's bytes).

# %% [markdown]
# ## 2. Per-parameter beside the flat unit (lab 04)
#
# Lab 04's flat unit pads once per unit, by fewer than `N` numbers; FSDP2 pads every
# parameter, by up to `N - 1` rows. Both move `4 B x` their padded `Ψ` per all-gather and
# per reduce-scatter. One training step of `gpt-mini` (4 blocks) on 3 ranks, after a
# first step that made the optimizer state: your groups, then
# `minifsdp.fsdp.FullyShardedDataParallel` with lab 04's units (one per block, FULL_SHARD),
# measured by the tracer and the memory tracker of lab 01.

# %%
GPT_MODEL, ROWS, SEQ = "gpt-mini", 2, 32     # ROWS sequences per rank and micro-batch
LAYOUTS = ("per-parameter (yours)", "flat units (lab 04)")


def layout_worker(model_name: str, rows: int, seq: int) -> dict:
    """Per layout, on this rank: the second training step's bytes by collective, peak and memory curve."""
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    x, y = (t.to(device) for t in data.get_batch(0, rows * n, seq, rank=rank, world_size=n))
    out = {}
    for layout in LAYOUTS:
        model = models.build_model(model_name).to(device)
        if layout == LAYOUTS[0]:
            shard_model(model)
        else:
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = memory.MemoryTracker()
        for step in range(2):                       # the second step is measured
            measured = step == 1
            if measured:
                tracker.track_model(model)
                tracker.track_optimizer(opt)
            with trace.Tracer(rank=rank) as tracer, (tracker if measured else contextlib.nullcontext()):
                models.lm_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        tracker.close()
        out[layout] = {"bytes": tracer.trace.bytes_by_op(), "peak": tracker.peak_total,
                       "at_peak": dict(tracker.peak_by_category), "samples": list(tracker.samples)}
    return out


t0 = time.perf_counter()
layout_runs = minifsdp.launch(layout_worker, N3, GPT_MODEL, ROWS, SEQ, timeout=120)
print(f"{len(LAYOUTS)} layouts x 2 steps of {GPT_MODEL} on {N3} ranks: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
psi = models.count_parameters(models.build_model(GPT_MODEL, device="meta"))
print(f"{GPT_MODEL}: Ψ = {psi:,} parameters (4Ψ = {FP32 * psi / MiB:.2f} MiB); {N3} ranks, rank 0, one step")
print(f"{'':24}{'all-gather MiB':>15}{'reduce-scatter MiB':>20}{'padding (numbers)':>19}")
padding = {}
for layout in LAYOUTS:
    moved = layout_runs[0][layout]["bytes"]
    padding[layout] = moved["reduce_scatter"] // FP32 - psi      # each parameter reduce-scattered once a step
    print(f"{layout:<24}{moved['all_gather'] / MiB:>15.2f}{moved['reduce_scatter'] / MiB:>20.2f}"
          f"{padding[layout]:>19,}")
assert padding[LAYOUTS[0]] > padding[LAYOUTS[1]] >= 0, "the text below says per-parameter pads more"

# %% [markdown]
# Both layouts reduce-scatter every parameter once per step: the difference between the
# two reduce-scatters is padding alone. Your groups all-gather more: they gather the
# root twice per step, the flat FSDP once (its root rule).
#
# **Predict first**: which layout peaks higher? How many blocks does each hold gathered
# at its peak? Note your guesses; the table under the figure answers.

# %%
# FIGURE
fig, axes = plt.subplots(1, 2, figsize=(11, 3.0), sharey=True)
for ax, layout in zip(axes, LAYOUTS):
    plot.memory(layout_runs[0][layout]["samples"], ax=ax, unit="MiB", title=f"{layout}, rank 0")
axes[0].get_legend().remove()
axes[1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
axes[1].set_ylabel("")
fig.suptitle(f"{GPT_MODEL}, one training step on {N3} ranks (AdamW, {ROWS}x{SEQ} tokens per rank)", fontsize=10)
plt.tight_layout()
plt.show()
meta = models.build_model(GPT_MODEL, device="meta")
block_b = FP32 * models.count_parameters(meta.blocks[0])
root_b = FP32 * psi - len(meta.blocks) * block_b
print(f"{'':24}{'peak MiB':>9}{'blocks gathered at the peak':>29}   the rest at the peak, MiB")
peaks, gathered = {}, {}
for layout in LAYOUTS:
    run = max((r[layout] for r in layout_runs), key=lambda o: o["peak"])
    peaks[layout] = run["peak"]
    gathered[layout] = round((run["at_peak"].get("unsharded_params", 0) - root_b) / block_b, 1)
    rest = ", ".join(f"{c} {b / MiB:.2f}" for c, b in run["at_peak"].items()
                     if b >= MiB / 100 and c != "unsharded_params")
    print(f"{layout:<24}{run['peak'] / MiB:>9.2f}{gathered[layout]:>20} + root   {rest}")
assert abs(peaks[LAYOUTS[0]] / peaks[LAYOUTS[1]] - 1) < 0.25, "the text below says the peaks are close"
assert gathered[LAYOUTS[1]] > gathered[LAYOUTS[0]], "the text below says the flat FSDP holds more blocks gathered"

# %% [markdown]
# *Takeaway: the same shards of parameters, gradients and optimizer state on every rank,
# and peaks close to each other; what differs is what sits beside them at the peak.* The
# flat FSDP holds the next block gathered too (its backward prefetch); your step holds
# one block's full gradients (`unsharded_grads`) and the reduce-scatter's input beside
# them: FSDP2's copy-in, which the flat unit does not need (its gradient is already one
# flat tensor). In exchange each parameter keeps its shape, its name and its dtype, and a
# stock optimizer steps it.
#
# **Padding against the world size.** Your `shard_param` says how many numbers each
# layout moves per collective on `N` ranks (rank 0's piece is as long as any rank's),
# and the flat unit pads each unit to a multiple of `N`. The measured point at 3 ranks is
# the table above.

# %%
# FIGURE
WORLDS = [2, 3, 4, 8, 16, 64, 256, 1024]
meta = models.build_model(GPT_MODEL, device="meta")
shapes = [p.shape for p in meta.parameters()]
units = [models.count_parameters(b) for b in meta.blocks]
units.append(psi - sum(units))                                  # the root: what no block holds
per_param = [w * sum(shard_param(torch.zeros(s), 0, w).numel() for s in shapes) for w in WORLDS]
flat = [sum(math.ceil(u / w) * w for u in units) for w in WORLDS]
assert per_param[WORLDS.index(N3)] - psi == padding[LAYOUTS[0]] and flat[WORLDS.index(N3)] - psi == padding[LAYOUTS[1]]
fig, ax = plt.subplots(figsize=(7, 3.0))
ax.plot(WORLDS, [p / psi for p in per_param], "o-", label="per-parameter (your shard_param)")
ax.plot(WORLDS, [f / psi for f in flat], "s-", label="flat units (lab 04)")
ax.plot([N3], [(psi + padding[LAYOUTS[0]]) / psi], "k*", ms=12, label=f"measured at {N3} ranks")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("world size N (ranks)")
ax.set_ylabel("numbers moved per collective / Ψ")
ax.set_title(f"{GPT_MODEL}: padded size of every all-gather and reduce-scatter, relative to Ψ", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print("N:          " + "".join(f"{w:>9}" for w in WORLDS))
print("per-param:  " + "".join(f"{p / psi:>9.3f}" for p in per_param))
print("flat units: " + "".join(f"{f / psi:>9.3f}" for f in flat))
assert per_param[-1] > 2 * psi and flat[-1] < 1.01 * psi, "the text below says per-parameter padding explodes"

# %% [markdown]
# *Takeaway: per-parameter padding stays small while `N` is small against a parameter's
# first dimension and explodes past it; the flat unit never pads a unit by more than
# `N - 1` numbers.* At 1024 ranks a 256-row weight gives one row to each of 256 ranks and
# a padding row to every other rank. Jobs that large shard within a group of ranks and
# replicate across groups (HSDP, lab 09's meshes), and FSDP2's `shard_placement_fn` can
# cut a parameter along another dimension.

# %% [markdown]
# ## 3. FSDP2 code written for PyTorch, run by changing the import
#
# The worker below is FSDP2 code as PyTorch's documentation writes it: `fully_shard` on
# every block, then on the model, a stock `AdamW` on `model.parameters()` (the sharded
# `DTensor`s), and your `train_step` from exercise 4. Only the import of `fully_shard`
# differs between `torch.distributed.fsdp` and `minifsdp.fsdp`; your groups run beside
# them. Each trains `gpt-tiny` on 2 ranks: a first step, then a step of 4 micro-batches
# that syncs after each (step 1), then one that syncs once (step 2); the loss on a
# held-out batch after each step.

# %%
ACCUM, SOURCES, SMALL = 4, ("torch.distributed.fsdp", "minifsdp.fsdp", "yours"), "gpt-tiny"


def fsdp2_steps(source: str, model_name: str, rows: int, seq: int, micro: int) -> dict:
    """FSDP2 code as written for PyTorch, with fully_shard from `source` (or your shard_model): 3 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    if source == "torch.distributed.fsdp":
        from torch.distributed.fsdp import fully_shard
    elif source == "minifsdp.fsdp":
        from minifsdp.fsdp import fully_shard                    # <- the one line that changes
    from minifsdp.torch_reference import count_collectives      # torch's collectives, seen by the tracer
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    model = models.build_model(model_name).to(device)
    if source == "yours":
        shard_model(model)
    else:
        mesh = init_device_mesh(device.type, (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    held_out = [t.to(device) for t in data.get_batch(999, rows * n, seq, rank=rank, world_size=n)]
    counted = count_collectives if source.startswith("torch") else contextlib.nullcontext
    out = {"losses": [], "bytes": [], "peak": [], "at_peak": []}
    for step, (k, sync_every) in enumerate(((1, True), (micro, True), (micro, False))):
        batches = [tuple(t.to(device) for t in data.get_batch(10 * step + m, rows * n, seq, rank=rank, world_size=n))
                   for m in range(k)]
        tracker = memory.MemoryTracker()
        tracker.track_model(model)
        tracker.track_optimizer(opt)
        gc.collect()
        gc.disable()        # freed by reference counts only: the curve no longer depends on when the collector runs
        with trace.Tracer(rank=rank) as tracer, counted(), (tracker if step else contextlib.nullcontext()):
            train_step(model, opt, batches, sync_every)
        gc.enable()
        tracker.close()
        out["bytes"].append(tracer.trace.bytes_by_op())
        out["peak"].append(tracker.peak_total)
        out["at_peak"].append(dict(tracker.peak_by_category))
        with torch.no_grad():
            loss = models.lm_loss(model(held_out[0]), held_out[1]).reshape(1)
        if hasattr(model, "reshard"):
            model.reshard()          # FSDP2 keeps the root gathered for a backward; this forward has none
        comm.all_reduce(loss)
        out["losses"].append(loss.item() / n)
    return out


def fsdp2_worker(sources: tuple[str, ...], *args) -> dict:
    return {source: fsdp2_steps(source, *args) for source in sources}


t0 = time.perf_counter()
fsdp2_runs = minifsdp.launch(fsdp2_worker, N2, SOURCES, SMALL, ROWS, SEQ, ACCUM, timeout=120)
print(f"{len(SOURCES)} sources x 3 steps of {SMALL} on {N2} ranks: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
first = fsdp2_runs[0]
print(f"{SMALL}, {N2} ranks, rank 0; step 1 syncs after each of {ACCUM} micro-batches, step 2 once")
print(f"{'fully_shard from':<24}{'held-out loss after step 0, 1, 2':>34}{'reduce-scatter KiB, step 1 / 2':>34}")
for source in SOURCES:
    run = first[source]
    rs = [b.get("reduce_scatter", 0) / KiB for b in run["bytes"][1:]]
    print(f"{source:<24}{'':4}" + "".join(f"{x:>10.6f}" for x in run["losses"]) + f"{rs[0]:>24.1f} / {rs[1]:.1f}")
for source in SOURCES[1:]:
    diff = max(abs(a - b) for a, b in zip(first[source]["losses"], first[SOURCES[0]]["losses"]))
    print(f"max |loss({source}) - loss(torch)| = {diff:.1e}: within 1e-5 {diff <= 1e-5}")
    assert diff <= 1e-5, f"{source} trained another model than torch's fully_shard"
for source in SOURCES:
    sync_each, once = (first[source]["bytes"][s]["reduce_scatter"] for s in (1, 2))
    assert sync_each == ACCUM * once == ACCUM * first[SOURCES[0]]["bytes"][2]["reduce_scatter"]

# %% [markdown]
# The same model, step for step, whichever `fully_shard` runs it: the losses agree and the
# reduce-scatters move the same bytes (FSDP2's layout, padding included). The rest of
# FSDP2's API (`reshard_after_forward`, `MixedPrecisionPolicy`, `CPUOffloadPolicy`,
# prefetch) works the same way; `tests/test_fully_shard.py` holds minifsdp to torch on it.
#
# ### Gradient accumulation, measured
#
# **Predict first**: syncing once instead of after each of the 4 micro-batches divides
# the reduce-scatter bytes by 4. What happens to the peak, and by how much at most?

# %%
# FIGURE
fig, (ax_b, ax_m) = plt.subplots(1, 2, figsize=(11, 3.0))
x, width = np.arange(len(SOURCES)), 0.38
for i, (step, label) in enumerate(((1, "sync after every micro-batch"), (2, "sync once, after the last"))):
    rs = [first[s]["bytes"][step]["reduce_scatter"] / KiB for s in SOURCES]
    peak = [max(r[s]["peak"][step] for r in fsdp2_runs) / KiB for s in SOURCES]
    ax_b.bar(x + (i - 0.5) * width, rs, width, label=label)
    ax_m.bar(x + (i - 0.5) * width, peak, width, label=label)
for ax, what in ((ax_b, "reduce-scattered per step (KiB, rank 0)"), (ax_m, "peak of the step (KiB, highest rank)")):
    ax.set_xticks(x, SOURCES, fontsize=8)
    ax.set_title(what, fontsize=9)
ax_m.set_ylim(0.8 * min(r[s]["peak"][1] for r in fsdp2_runs for s in SOURCES) / KiB, None)
ax_m.legend(fontsize=7, loc="lower right")
fig.suptitle(f"{SMALL}, {N2} ranks, {ACCUM} micro-batches per step: gradient accumulation with and without sync",
             fontsize=10)
plt.tight_layout()
plt.show()
psi_small = models.count_parameters(models.build_model(SMALL, device="meta"))
bound = FP32 * psi_small * (1 - 1 / N2)
for s in SOURCES:
    every, once = (max(r[s]["peak"][step] for r in fsdp2_runs) for step in (1, 2))
    print(f"{s:<24} peak {every / KiB:7.1f} -> {once / KiB:7.1f} KiB: +{(once - every) / KiB:5.1f} KiB "
          f"(4Ψ(1 - 1/N) = {bound / KiB:.1f} KiB)")
    assert once > every, "the text below says the peak rises without sync"

# %% [markdown]
# *Takeaway: without sync the reduce-scatter runs once per step instead of once per
# micro-batch, and every rank keeps the full-size gradients (`4Ψ`) from the first
# micro-batch to the last instead of its `4Ψ/N` rows: the peak rises, by up to about
# `4Ψ(1 - 1/N)`.* Your check measured those held gradients exactly (`4Ψ` between
# micro-batches). On a real model with `N` in the hundreds that is the whole gradient
# back in memory: FSDP2 users sync once per step when the network is the bottleneck and
# memory allows, and sync every micro-batch when it does not.

# %% [markdown]
# ## Summary
#
# FSDP2 shards each parameter on its own: `torch.chunk`'s rows, padded to `ceil(n/N)` per
# rank, a `DTensor` with `Shard(0)` that keeps its name and shape. You built its step on
# a GPT, one all-gather per group with a copy-in and a copy-out, one reduce-scatter per
# group with every rank's rows side by side, and its post-backward with and without sync,
# and matched one process and PyTorch's own FSDP2 to the byte. Against lab 04's flat
# unit it moves the same bytes up to padding, which stays small until `N` nears a
# parameter's rows, and pays for its copy-in and copy-out buffers. Code written for
# PyTorch's `fully_shard` runs on `minifsdp.fsdp` unchanged but for one import.

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
