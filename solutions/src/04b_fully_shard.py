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
    padded = [F.pad(g.reshape(g.shape[0], -1), (0, 0, 0, world * r - g.shape[0])) for g, r in zip(grads, rows)]
    send = torch.cat([p.reshape(world, -1) for p in padded], dim=1)      # row r: rank r's rows of every gradient
    recv = send.new_empty(send.shape[1])
    comm.reduce_scatter_tensor(recv, send.reshape(-1))
    pieces = recv.div_(world).split([p.shape[0] // world * p.shape[1] for p in padded])
    return [piece.view(r, *g.shape[1:])[:real_rows(g.shape[0], rank, world)]
            for piece, g, r in zip(pieces, grads, rows)]
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
