# Lab 11 - mixture of experts: expert parallel. Source of solutions/11_experts.ipynb and labs/11_experts.ipynb:
# edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 11 — Mixture of experts: expert parallel
#
# **You will be able to** route each token to k of E experts, spread the experts over
# ranks and move every token to its experts and back with all-to-all (counts, split sizes,
# the permutation back), match one process's MoE layer and training step, count the bytes
# against the formula, and measure load imbalance and what a capacity factor drops.
#
# **Prerequisites**: labs 00 (collectives, `launch`), 01 (model states, `16Ψ`), 02
# (averaging gradients) and 08 (autograd Functions around collectives).
#
# **Time**: 60 minutes of work; the cells compute for about 15 seconds on a laptop (CPU,
# `gloo`) and about as long on a GPU VM (launches needing more ranks than GPUs use CPU ranks).
#
# **Exercises**: 1. the router's top-k and the split sizes · 2. the dispatch · 3. the
# combine and the gradients. Stuck? `check.hint("route")` (any exercise's name).

# %% [markdown]
# `E` experts per MoE layer, `k` experts per token, `ep` ranks in the expert-parallel
# group, `d` the width, `T` the sequence length, `Ψ` the number of parameters.

# %%
import dataclasses
import time
from typing import Any

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn as nn

import minifsdp
from minifsdp import comm, data, dist, models, trace
from minifsdp import expert_parallel as EP
from minifsdp.expert_parallel.cost import layer_bytes, model_states
from minifsdp.labcheck import lab11 as check

# Small tensors: one compute thread per process is as fast, and several ranks share the cores.
torch.set_num_threads(1)
KiB, MiB = 2**10, 2**20
EP2, EP4 = 2, 4               # launches of 2 and 4 ranks: one per GPU where there are that many, else CPU ranks
MODEL, LAYERS = "gpt-moe-tiny", 4     # E = 8, k = 2, d = 32; 4 blocks: blocks 1 and 3 are MoE blocks
BATCH, SEQ = 8, 32                    # the global batch: 8 sequences of 32 tokens
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. A mixture of experts, in one process
#
# A MoE layer replaces a block's MLP by `E` MLPs, the **experts**, and a **router** (a
# `Linear(d, E)`). Each token goes to its `k` best experts; its output is their outputs,
# mixed by the router's weights. `E` times the MLP's parameters for `k` times its FLOPs.
# `models.MoE` is the one-process layer; `gpt-moe-tiny` has one every other block.

# %%
# NBVAL_CHECK_OUTPUT
gpt = models.build_model(MODEL, n_layer=LAYERS)
moe = gpt.blocks[1].mlp
expert_psi = sum(p.numel() for m in gpt.modules() if isinstance(m, models.MoE) for p in m.experts.parameters())
psi = models.count_parameters(gpt)
print(f"{MODEL} with {LAYERS} blocks: Ψ = {psi:,} parameters, {expert_psi:,} of them in "
      f"{2 * moe.n_expert} experts ({expert_psi / psi:.0%}); E = {moe.n_expert}, k = {moe.top_k}")
x, _ = data.get_batch(0, BATCH, SEQ)
with torch.no_grad():
    gpt(x)
print(f"assignments per expert, block 1, {BATCH * SEQ} tokens x k = {BATCH * SEQ * moe.top_k}:",
      moe.tokens_per_expert.tolist())

# %% [markdown]
# ### Exercise 1: the router's top-k, and where the rows go
#
# * `route(logits, k) -> (probs, expert_idx, weights)`: the router's softmax over the `E`
#   experts; each token's `k` best experts, best first; their mixing weights. With `k > 1`
#   the `k` probabilities are renormalised to sum to 1 (Mixtral, GShard); with `k = 1` the
#   weight is the raw probability (Switch Transformer).
# * `split_sizes(expert, n_expert, ep) -> (order, counts, send)`: `expert` lists a rank's
#   assignments, token by token. `order` sorts them by expert, each expert's assignments
#   still in token order; `counts[e]` is how many go to expert `e` (all `E` of them);
#   `send[j]` how many go to rank `j`, which holds experts `j·E/ep … (j+1)·E/ep − 1`: a
#   list of ints, the all-to-all's split sizes.

# %% [markdown]
# Target: torch's top-k of the softmax on 6 cases (`k` = 1 to 4), the gradient reaching
# the logits through the weights; the split sizes for `ep` = 1, 2, 4, 8.

# %%
def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs (..., E), expert_idx (..., k) best first, weights (..., k)) from the router's logits (..., E)."""
    # BEGIN SOLUTION
    # HINT: a softmax, the k largest, their weights (k = 1 is special). check.hint('route')
    probs = torch.softmax(logits, dim=-1)
    weights, expert_idx = probs.topk(k, dim=-1)
    if k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, expert_idx, weights
    # END SOLUTION


def split_sizes(expert: torch.Tensor, n_expert: int, ep: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(order, counts (E,), send: rows to each of the ep ranks) for a rank's assignments ``expert`` (M,)."""
    # BEGIN SOLUTION
    # HINT: sort by expert (stably), count per expert, add up each rank's experts. check.hint('route')
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_expert)
    send = counts.view(ep, n_expert // ep).sum(dim=1).tolist()
    return order, counts, send
    # END SOLUTION

# %%
# CHECK: top-k routing on 6 cases against torch's (weights and their gradient); split sizes for ep = 1, 2, 4, 8
check.route(route, split_sizes)

# %% [markdown]
# ## 2. Expert parallel: every token travels to its experts
#
# The `ep` ranks are data-parallel ranks too: each holds its own sequences, the router
# and the rest of the model whole, and `E/ep` experts. At each MoE layer a rank routes
# its own tokens, then sends each assignment to its expert's rank. With `ep = 2`, `E = 4`,
# `k = 2` (rank 0 holds experts 0, 1; rank 1 experts 2, 3):

# %% [markdown]
# ```
#                     rank 0                              rank 1
# assignments         (a,0) (a,2) (b,1) (b,0)             (c,3) (c,1) (d,2) (d,3)
# sorted by expert    a b b | a    experts 0 0 1 | 2      c | d c d    experts 1 | 2 3 3
# counts, send        [2, 1, 1, 0], send [3, 1]           [0, 1, 1, 2], send [1, 3]
# counts all-to-all   recv [[2, 1], [0, 1]]: [3, 1]       recv [[1, 0], [1, 2]]: [1, 3]
# rows all-to-all     [a b b | c]  from r0 | from r1      [a | d c d]  from r0 | from r1
# grouped by expert   e0: a b    e1: b c                  e2: a d    e3: c d
# ```

# %% [markdown]
# ### Exercise 2: the dispatch
#
# * `AllToAll`: an autograd Function. Forward: `comm.all_to_all_single` of `x`'s rows,
#   `input_split_sizes[j]` rows to rank `j`, `output_split_sizes[s]` rows from rank `s`.
#   Backward: the gradient of each received row belongs to the rank that sent it.
# * `dispatch(x, token, expert, n_expert, group)`: every kept assignment's row
#   `x[token]` to the rank of its expert. Each rank must first learn how many rows it will
#   receive: one all-to-all of the counts. Return `rows` grouped by local expert (expert
#   `l`'s rows together, `l = 0, 1, …`, each source rank's in token order, rank 0's first),
#   `per_expert` (a list: rows for each local expert) and a `plan`: whatever `combine`
#   will need for the way back.

# %% [markdown]
# Target, at 2 ranks with uneven splits and an expert nobody picks: one process's rows for
# each expert; `x`'s gradient through your backward; one all-to-all of `E` int64 counts and
# one of rows forward, one backward, each rank's bytes equal to the formula.

# %%
class AllToAll(torch.autograd.Function):
    """AllToAll.apply(x, output_split_sizes, input_split_sizes, group): rows to every rank; differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                group: Any) -> torch.Tensor:
        # BEGIN SOLUTION
        # HINT: room for what arrives, then one all-to-all. check.hint('dispatch')
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        # BEGIN SOLUTION
        # HINT: each row's gradient goes back to where the row came from. check.hint('dispatch')
        output_split_sizes, input_split_sizes = ctx.splits
        grad_in = grad_out.new_empty((sum(input_split_sizes), *grad_out.shape[1:]))
        comm.all_to_all_single(grad_in, grad_out.contiguous(), input_split_sizes, output_split_sizes,
                               group=ctx.group)
        return grad_in, None, None, None
        # END SOLUTION


def dispatch(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, n_expert: int, group: Any = None
             ) -> tuple[torch.Tensor, list[int], Any]:
    """(rows for this rank's experts, grouped by local expert; per_expert: how many each; plan for combine)."""
    # BEGIN SOLUTION
    # HINT: sort, tell every rank what it gets, send, group what came by expert. check.hint('dispatch')
    ep = dist.world_size(group)
    order, counts, send = split_sizes(expert, n_expert, ep)
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts, group=group)
    received = received.view(ep, n_expert // ep)            # [s, l]: rows from rank s for my expert l
    recv = received.sum(dim=1).tolist()
    rows = AllToAll.apply(x[token[order]], recv, send, group)
    local = torch.arange(n_expert // ep, device=rows.device).repeat(ep).repeat_interleave(received.reshape(-1))
    by_expert = torch.argsort(local, stable=True)
    return rows[by_expert], received.sum(dim=0).tolist(), (order, send, recv, by_expert)
    # END SOLUTION

# %%
# CHECK: 2 ranks, uneven routing: rows per expert against one process, x's gradient, bytes against the formula
check.dispatch(dispatch, AllToAll)

# %% [markdown]
# ### The scaffolding: an expert-parallel MoE layer
#
# `ExpertParallelLayer` is `models.MoE` holding only this rank's experts (under their
# global names, so its parameters are named as in one process): your `route`, the
# load-balancing loss and the capacity factor as in one process, your `dispatch`, each
# local expert once on its rows, then your `combine`. `expert_parallel(model)` swaps it
# in for every MoE layer of a GPT.

# %%
class ExpertParallelLayer(models.MoE):
    """models.MoE on an ep group: the router on every rank, this rank's E/ep experts; your three functions."""

    def __init__(self, moe: models.MoE, group: Any = None):
        nn.Module.__init__(self)                       # not MoE's: it would build all E experts
        self.group, self.ep, rank = group, dist.world_size(group), dist.rank(group)
        self.n_expert, self.top_k, self.n_local = moe.n_expert, moe.top_k, moe.n_expert // self.ep
        self.aux_loss_coef, self.capacity_factor = moe.aux_loss_coef, moe.capacity_factor
        self.router = moe.router                       # replicated: every rank routes its own tokens
        self.experts = nn.ModuleDict({str(e): moe.experts[e]
                                      for e in range(rank * self.n_local, (rank + 1) * self.n_local)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        probs, expert_idx, weights = route(self.router(x), self.top_k)                  # exercise 1
        self.aux_loss = self.aux_loss_coef * models.load_balancing_loss(probs, expert_idx)
        keep = torch.ones_like(expert_idx, dtype=torch.bool)
        if self.capacity_factor is not None:           # at most C assignments per expert and sequence
            C = models.expert_capacity(T, self.top_k, self.n_expert, self.capacity_factor)
            keep = models.capacity_mask(expert_idx, self.n_expert, C)
        self.tokens_per_expert = torch.bincount(expert_idx.reshape(-1), minlength=self.n_expert)
        self.dropped_per_expert = torch.bincount(expert_idx[~keep], minlength=self.n_expert)
        token = torch.arange(B * T, device=x.device).repeat_interleave(self.top_k)[keep.reshape(-1)]
        rows, per_expert, plan = dispatch(x.reshape(B * T, d), token, expert_idx[keep], self.n_expert,
                                          self.group)                                   # exercise 2
        self.rows_per_expert = per_expert
        outputs = torch.cat([ffn(chunk) for ffn, chunk in zip(self.experts.values(), rows.split(per_expert))])
        return combine(outputs, plan, token, weights[keep], B * T, self.group).view(B, T, d)   # exercise 3


def expert_parallel(model: models.GPT, group: Any = None) -> models.GPT:
    """Every MoE layer of ``model`` becomes an ExpertParallelLayer holding this rank's experts (in place)."""
    for block in model.blocks:
        if isinstance(block.mlp, models.MoE):
            block.mlp = ExpertParallelLayer(block.mlp, group)
    return model

# %% [markdown]
# ### Exercise 3: the combine, and the gradients
#
# * `combine(outputs, plan, token, weight, n_tokens, group) -> y (n_tokens, d)`:
#   `outputs` are the experts' outputs, in the order `dispatch` returned the rows. Each goes
#   back to the rank its token lives on, where `y[t]` = the sum over token `t`'s kept
#   assignments of `weight × output` (`token[i]`, `weight[i]`: assignment `i`, as you were
#   given them). Autograd must carry the gradients to the experts and the router.
# * `sync_gradients(model, group)`: after backward, every rank holds the global batch's
#   gradient (the mean over the ranks of their losses), as one process computes it.
#   Which gradients cover only this rank's sequences, and which already hold every rank's?
#
# Target, at 2 ranks: one process's MoE layer (outputs and gradients, dropless and with a
# capacity factor) and two AdamW steps of `gpt-moe-tiny`; each rank's all-to-all bytes per
# step equal to the formula from the routing.

# %%
def combine(outputs: torch.Tensor, plan: Any, token: torch.Tensor, weight: torch.Tensor, n_tokens: int,
            group: Any = None) -> torch.Tensor:
    """y (n_tokens, d): every output row back home, y[t] = sum over t's assignments of weight * output."""
    # BEGIN SOLUTION
    # HINT: undo the grouping, send every row home, mix by weight. check.hint('combine')
    order, send, recv, by_expert = plan
    arrived = torch.empty_like(by_expert)
    arrived[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    home = AllToAll.apply(outputs[arrived], send, recv, group)          # in the order dispatch sent them
    y = home.new_zeros(n_tokens, home.shape[1])
    return y.index_add(0, token[order], home * weight[order, None])
    # END SOLUTION


def sync_gradients(model: nn.Module, group: Any = None) -> None:
    """The global batch's gradients on every rank of the ep group."""
    # BEGIN SOLUTION
    # HINT: not every gradient needs the same treatment. check.hint('combine')
    ep = dist.world_size(group)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".experts." not in name:                  # replicated: this rank's sequences only
            comm.all_reduce(p.grad, group=group)
        p.grad /= ep
    # END SOLUTION

# %%
# CHECK: 2 ranks: a MoE layer and 2 AdamW steps of gpt-moe-tiny against one process; bytes against the formula
check.combine(expert_parallel, combine, sync_gradients)

# %% [markdown]
# The library's expert parallel is `minifsdp.expert_parallel` (its `__init__.py` gives the
# reading order): `dispatch.py` (the counts and the differentiable all-to-all),
# `moe_layer.py` (`ExpertParallelMoE`, your three pieces), `gpt.py` (the gradients, one
# flat all-reduce), `capacity.py` and `naive.py`, an all-gather dispatch beside yours.
# Compare them with yours now that your checks pass.

# %% [markdown]
# ## 3. Bytes per layer: your all-to-all, and the all-gather beside it
#
# The naive dispatch (`naive.py`) sends every token to every rank and reduce-scatters the
# experts' partial sums back: no counts, no split sizes, but every token travels whatever
# its experts. One training step of `gpt-moe-tiny` on `ep` = 2 and 4 ranks (the same 8
# sequences), your layers and then the library's all-gather dispatch, measured by the
# tracer, each MoE layer's bytes beside `cost.layer_bytes` (a balanced routing) and
# `moe_all_to_all_bytes` (this routing).
#
# **Predict first**: which grows with `ep`, and how fast?

# %%
DISPATCHES = ("yours (all-to-all)", "library all-gather")


def bytes_worker(model_name: str, layers: int, batch: int, seq: int) -> dict:
    """One step on this rank's sequences per dispatch: ring bytes of each MoE layer, kept counts, Ψ here."""
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    x, y = (t.to(device) for t in data.get_batch(0, batch, seq, rank=rank, world_size=n))
    out = {}
    for dispatch_kind in DISPATCHES:
        model = models.build_model(model_name, n_layer=layers)
        if dispatch_kind == DISPATCHES[0]:
            model = expert_parallel(model)
        else:
            model = EP.expert_parallel_gpt(model, dispatcher="all_gather")
        model = model.to(device)
        with trace.Tracer(rank=rank) as tracer:
            (models.lm_loss(model(x), y) + model.aux_loss()).backward()
        moes = [m for m in model.modules() if isinstance(m, models.MoE)]
        out[dispatch_kind] = {"ring": sum(s.args["ring_bytes"] for s in tracer.trace.comm_spans()) / len(moes),
                              "kept": [(m.tokens_per_expert - m.dropped_per_expert).cpu() for m in moes],
                              "psi": models.count_parameters(model)}
    return out


t0 = time.perf_counter()
byte_runs = {ep: minifsdp.launch(bytes_worker, ep, MODEL, LAYERS, BATCH, SEQ, timeout=120) for ep in (EP2, EP4)}
print(f"{len(DISPATCHES)} dispatches x one step on {EP2} and {EP4} ranks: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
config = models.build_model(MODEL, n_layer=LAYERS, device="meta").config
E, K, D = config.n_expert, config.top_k, config.n_embd
print(f"ring bytes per MoE layer per step (forward and backward), rank 0, {BATCH}x{SEQ} tokens in all")
print(f"{'ep':>3}{'yours':>9}{'this routing':>14}{'balanced':>10}{'all-gather':>12}{'formula':>9}"
      f"{'Ψ on rank 0':>13}{'formula':>9}")
for ep, runs in byte_runs.items():
    mine, naive = runs[0][DISPATCHES[0]], runs[0][DISPATCHES[1]]
    tokens = BATCH // ep * SEQ
    routed = [EP.moe_all_to_all_bytes(torch.stack([r[DISPATCHES[0]]["kept"][i] for r in runs]), 0, D)
              for i in range(len(mine["kept"]))]
    exact = sum(b["counts"] + 2 * (b["dispatch"] + b["combine"]) for b in routed) / len(routed)
    states = model_states(config, ep)["parameters"]
    print(f"{ep:>3}{mine['ring'] / KiB:>8.1f}K{exact / KiB:>13.1f}K"
          f"{layer_bytes(tokens, K, D, E, ep)['total'] / KiB:>9.1f}K{naive['ring'] / KiB:>11.1f}K"
          f"{layer_bytes(tokens, K, D, E, ep, 'all_gather')['total'] / KiB:>8.1f}K{mine['psi']:>13,}{states:>9,}")
    assert mine["ring"] == exact and naive["ring"] == layer_bytes(tokens, K, D, E, ep, "all_gather")["total"]
    assert mine["psi"] == states == naive["psi"]

# %% [markdown]
# Your layers moved exactly what the routing predicts, and the all-gather exactly its
# formula: it never depends on the routing. Rank 0 holds fewer parameters as `ep` grows:
# `E/ep` experts per layer, the rest replicated. Across `ep` (formula lines; the dots are
# the runs above):

# %%
# FIGURE
EPS = [1, 2, 4, 8]
fig, ax = plt.subplots(figsize=(7, 3.0))
for kind, marker in (("all_to_all", "o"), ("all_gather", "s")):
    ax.plot(EPS, [layer_bytes(BATCH * SEQ // ep, K, D, E, ep, kind)["total"] / KiB for ep in EPS], marker + "--",
            mfc="none", label=f"formula, {kind.replace('_', '-')} (balanced)")
for kind, marker in zip(DISPATCHES, ("o", "s")):
    ax.plot(list(byte_runs), [byte_runs[ep][0][kind]["ring"] / KiB for ep in byte_runs], "k" + marker,
            label=f"measured, {kind}")
ax.set_xscale("log", base=2)
ax.set_xlabel("ep (ranks holding the experts)")
ax.set_ylabel("KiB sent per MoE layer and step")
ax.set_title(f"{MODEL}: bytes one rank sends per MoE layer ({BATCH}x{SEQ} tokens over the ep ranks, k = {K})",
             fontsize=9)
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
a2a8, ag8 = (layer_bytes(BATCH * SEQ // 8, K, D, E, 8, kind)["tokens"] for kind in ("all_to_all", "all_gather"))
print(f"at ep = 8: the all-gather sends {ag8 / a2a8:.1f}x the all-to-all's token bytes (ep / k = {8 / K:.0f})")
assert ag8 / a2a8 == 8 / K

# %% [markdown]
# *Takeaway: with a fixed global batch a rank's all-to-all bytes fall as `ep` grows (fewer
# tokens per rank, of which `(ep−1)/ep` leave), while the all-gather's grow: each rank
# receives every other rank's tokens, `ep/k` times the all-to-all's token bytes.* On GPUs the all-to-all
# crosses every link at once, so `ep` usually stays inside a node (NVLink), as tensor
# parallel does.

# %% [markdown]
# ## 4. Load imbalance and the capacity factor, measured
#
# A router is not balanced: some experts are asked for more than `T·k/E` assignments per
# sequence, and their rank receives more rows. A **capacity factor** `cf` caps each expert
# at `C = ceil(cf·T·k/E)` per sequence; the rest is **dropped** (the block's residual
# carries the token on). Dropless (`cf = None`) computes every assignment. One forward of
# your layers on 2 ranks per `cf`: assignments asked for and dropped, and the most rows an
# expert received, beside the bound `sequences × C` (`capacity.max_rows_per_expert`).
#
# **Predict first**: does anything drop at `cf = 1.0`?

# %%
CFS = (None, 2.0, 1.5, 1.25, 1.0, 0.75, 0.5)


def capacity_worker(model_name: str, layers: int, batch: int, seq: int, cfs: tuple) -> dict:
    """One forward per capacity factor on this rank's sequences: per MoE layer, asked / dropped per expert
    (summed over the ranks), the most rows an expert received on this rank, and the dispatch's bytes."""
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    x, _ = (t.to(device) for t in data.get_batch(0, batch, seq, rank=rank, world_size=n))
    model = expert_parallel(models.build_model(model_name, n_layer=layers)).to(device)
    moes = [m for m in model.modules() if isinstance(m, models.MoE)]
    out = {}
    for cf in cfs:
        for m in moes:
            m.capacity_factor = cf
        with torch.no_grad(), trace.Tracer(rank=rank) as tracer:
            model(x)
        stats = EP.routing_stats(model)
        out[cf] = {"stats": stats, "max_rows": max(max(m.rows_per_expert) for m in moes),
                   "ring": sum(s.args["ring_bytes"] for s in tracer.trace.comm_spans()) / len(moes)}
    return out


t0 = time.perf_counter()
cap_runs = minifsdp.launch(capacity_worker, EP2, MODEL, LAYERS, BATCH, SEQ, CFS, timeout=120)
print(f"{len(CFS)} forwards on {EP2} ranks: {time.perf_counter() - t0:.1f} s")

# %%
# FIGURE
first = cap_runs[0]
layers = list(first[None]["stats"])
asked = {cf: sum(sum(v["routed"]) for v in first[cf]["stats"].values()) for cf in CFS}
dropped = {cf: sum(sum(v["dropped"]) for v in first[cf]["stats"].values()) for cf in CFS}
max_rows = {cf: max(r[cf]["max_rows"] for r in cap_runs) for cf in CFS}
bound = {cf: EP.max_rows_per_expert(BATCH, SEQ, K, E, cf) for cf in CFS}
balanced = BATCH * SEQ * K / E
fig, (ax_l, ax_c) = plt.subplots(1, 2, figsize=(11, 3.0))
width = 0.8 / len(layers)
for i, layer in enumerate(layers):
    ax_l.bar(np.arange(E) + (i - 0.5) * width, first[None]["stats"][layer]["routed"], width, label=layer)
ax_l.axhline(balanced, color="k", ls="--", lw=1, label=f"balanced: {balanced:.0f}")
ax_l.set_xlabel("expert")
ax_l.set_ylabel("assignments asked for")
ax_l.set_title(f"load per expert, dropless ({BATCH}x{SEQ} tokens, k = {K})", fontsize=9)
ax_l.legend(fontsize=7)
shown = [cf for cf in CFS if cf is not None][::-1]
ax_c.plot(shown, [100 * dropped[cf] / asked[cf] for cf in shown], "o-", label="assignments dropped (%)")
ax_c.set_xlabel("capacity factor cf")
ax_c.set_ylabel("dropped (%)")
rows_ax = ax_c.twinx()
rows_ax.plot(shown, [max_rows[cf] for cf in shown], "s-", color="tab:red", label="most rows an expert received")
rows_ax.plot(shown, [bound[cf] for cf in shown], ":", color="tab:red", label="bound: sequences x C")
rows_ax.axhline(max_rows[None], color="tab:red", lw=0.8, ls="--", label=f"dropless: {max_rows[None]}")
rows_ax.set_ylabel("rows (one expert, one rank)")
ax_c.set_title("what the capacity factor drops, and the buffer it bounds", fontsize=9)
handles = [h for a in (ax_c, rows_ax) for h in a.get_legend_handles_labels()[0]]
ax_c.legend(handles, [h.get_label() for h in handles], fontsize=6.5, loc="upper center")
plt.tight_layout()
plt.show()
print(f"{'cf':>6}{'dropped':>9}{'of':>6}{'most rows':>11}{'bound':>7}{'KiB sent':>10}")
for cf in CFS:
    print(f"{str(cf):>6}{dropped[cf]:>9,}{asked[cf]:>6,}{max_rows[cf]:>11}{bound[cf]:>7}{first[cf]['ring'] / KiB:>10.1f}")
assert dropped[None] == 0 < dropped[1.0] and all(max_rows[cf] <= bound[cf] for cf in CFS)
assert all(dropped[a] <= dropped[b] for a, b in zip(shown[1:], shown[:-1])), "drops fall as cf grows"

# %% [markdown]
# *Takeaway: even at `cf = 1.0`, room for a perfectly balanced routing, an unbalanced router
# drops assignments; a larger `cf` drops fewer and lets the busiest expert's buffer grow.*
# Dropless routing (Megatron-LM's default, MegaBlocks) needs no cap but no buffer size
# known in advance; a capacity bounds the rows and the all-to-all before routing, at the
# price of dropped tokens. The load-balancing loss (`model.aux_loss()`) trains the router
# towards the dashed line.

# %% [markdown]
# ## 5. Explore: E, k and ep against memory and bytes
#
# `cost.model_states` and `cost.layer_bytes` (checked above against your runs) for
# `gpt-moe-small` (d = 384, 3 MoE layers), 8 sequences of 128 tokens per rank: model
# states per rank (AdamW in fp32, `16Ψ`), and the bytes one rank sends per MoE layer
# and step. Move `E`, `k` and `ep`; the next cell makes the same call without the widget.

# %%
SMALL = models.MODEL_PRESETS["gpt-moe-small"]


def moe_costs(E: int = 8, k: int = 2, ep: int = 4, rows: int = 8) -> dict:
    """Model states per rank and bytes per MoE layer against ep, for gpt-moe-small with E experts and top-k."""
    if k > E or E % ep:
        print(f"not possible: k = {k} must be at most E = {E}, and ep = {ep} must divide E")
        return {}
    config = dataclasses.replace(SMALL, n_expert=E, top_k=k)
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if E % e == 0]
    states = {e: model_states(config, e) for e in eps}
    tokens = rows * config.block_size
    traffic = {kind: [layer_bytes(tokens, k, config.n_embd, E, e, kind)["total"] / MiB for e in eps]
               for kind in ("all_to_all", "all_gather")}
    fig, (ax_m, ax_b) = plt.subplots(1, 2, figsize=(11, 3.0))
    ax_m.bar([str(e) for e in eps], [16 * states[e]["replicated"] / MiB for e in eps], label="replicated")
    ax_m.bar([str(e) for e in eps], [16 * states[e]["experts"] / MiB for e in eps],
             bottom=[16 * states[e]["replicated"] / MiB for e in eps], label=f"experts: E/ep of {E} per layer")
    ax_m.set_xlabel("ep")
    ax_m.set_ylabel("model states per rank (MiB)")
    ax_m.legend(fontsize=7)
    for kind, style in (("all_to_all", "o-"), ("all_gather", "s-")):
        ax_b.plot([str(e) for e in eps], traffic[kind], style, label=kind.replace("_", "-"))
    ax_b.plot([str(ep)], [traffic["all_to_all"][eps.index(ep)]], "k*", ms=12, label=f"ep = {ep}")
    ax_b.set_xlabel("ep")
    ax_b.set_ylabel("MiB sent per MoE layer and step")
    ax_b.legend(fontsize=7)
    mine = states[ep]
    ax_m.set_title(f"{tokens} tokens per rank; AdamW fp32, 16 B per parameter", fontsize=9)
    fig.suptitle(f"gpt-moe-small, E = {E}, k = {k}, ep = {ep}: {mine['bytes'] / MiB:.0f} MiB of model states, "
                 f"{traffic['all_to_all'][eps.index(ep)]:.1f} MiB per MoE layer per rank", fontsize=10)
    plt.tight_layout()
    plt.show()
    return {"states_MiB": mine["bytes"] / MiB, "all_to_all_MiB": traffic["all_to_all"][eps.index(ep)],
            "eps": eps, "states": [16 * states[e]["parameters"] / MiB for e in eps], **traffic}


WIDE = {"style": {"description_width": "initial"}, "layout": widgets.Layout(width="420px")}
widgets.interact(moe_costs,
                 E=widgets.SelectionSlider(options=[4, 8, 16, 32, 64], value=8, description="E experts", **WIDE),
                 k=widgets.IntSlider(value=2, min=1, max=4, description="k per token", **WIDE),
                 ep=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=4, description="ep", **WIDE),
                 rows=widgets.fixed(8));

# %%
# FIGURE
row = moe_costs(E=64, k=2, ep=8)   # the same function, called plainly
print(f"E = 64, k = 2, ep = 8: {row['states_MiB']:.0f} MiB of model states per rank, "
      f"{row['all_to_all_MiB']:.1f} MiB per MoE layer")
print("ep:                 " + "".join(f"{e:>8}" for e in row["eps"]))
print("model states (MiB): " + "".join(f"{m:>8.0f}" for m in row["states"]))
print("all-to-all (MiB):   " + "".join(f"{b:>8.1f}" for b in row["all_to_all"]))
print("all-gather (MiB):   " + "".join(f"{b:>8.1f}" for b in row["all_gather"]))
a2a = row["all_to_all"]
assert a2a[-1] < 2 * a2a[1] and row["all_gather"][-1] > 4 * row["all_gather"][2], "the text below says so"

# %% [markdown]
# *Takeaway: more experts cost memory, not FLOPs; `ep` divides the experts' memory, while a
# rank's all-to-all bytes grow only from half to all of `4·tokens·k` rows (the `(ep−1)/ep`
# that leave), and `k` multiplies them.* The all-gather's bytes grow with `ep`: every rank
# receives every other rank's tokens.

# %% [markdown]
# ## Summary
#
# A MoE layer sends each token to `k` of `E` experts: `E` times the parameters for `k`
# times the FLOPs. Expert parallel keeps the router and the rest replicated and gives each
# rank `E/ep` experts. You built its exchange: the router's top-k, the split sizes, a
# counts all-to-all, the rows' all-to-all and its reverse as an autograd Function, the
# grouping by expert and the permutation back, the weighted combine, and the gradients
# (replicated ones averaged; an expert's already complete on its rank), and matched one
# process. The bytes follow the routing exactly, `(ep−1)/ep` of `4·tokens·k` rows per
# layer when balanced, `ep/k` times less than the all-gather. An unbalanced router
# drops assignments even at `cf = 1.0`; dropless routing pays instead in buffers.

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
