# Lab 08 - tensor parallel. Source of solutions/08_tensor_parallel.ipynb and labs/08_tensor_parallel.ipynb:
# edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 08 - Tensor parallel: splitting every layer across ranks (Megatron-LM)
#
# Data parallelism (labs 02-04) gives every rank the whole model; FSDP gathers each layer
# whole before it runs. **Tensor parallelism** (Shoeybi et al. 2019, Megatron-LM)
# splits the layers themselves: each rank holds a slice of every weight matrix and
# computes a slice of every layer's output.
#
# **You will be able to**: split a matrix product by columns and by rows; write the two
# operators, f and g, that glue the slices together; build Megatron's parallel MLP and
# attention, equal to the full layers; compute the cross-entropy over a split vocabulary;
# and measure what sequence parallelism saves.
#
# **Prerequisites**: lab 00 (collectives, `launch`), lab 01 (the memory tracker), lab 06
# (autograd Functions, what autograd saves). **Time**: about 60 minutes of work; the cells
# compute for under a minute on a laptop (2 CPU ranks) and on a GPU VM.

# %% [markdown]
# **Exercises**: 1. f and g · 2. the parallel MLP and attention · 3. vocab-parallel
# cross-entropy · 4. sequence parallel's two operators.
#
# **Symbols**: B = batch (sequences), T = sequence length, d = model width, V =
# vocabulary, tp = ranks in the tensor-parallel group, r = this rank's index in it. Sizes
# are in fp32 values: B·T·d values = 4·B·T·d bytes.
#
# Every exercise is checked on 2 ranks. On a VM with fewer GPUs, `launch` runs the ranks
# on the CPU (gloo) and says so in one line; nothing else changes.

# %%
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from minifsdp import comm, dist, launch, models, planner, plot, trace
from minifsdp import tensor_parallel as tpl
from minifsdp.estimate import format_bytes
from minifsdp.labcheck import lab08 as check
from minifsdp.memory import ACTIVATIONS, MemoryTracker
from minifsdp.tensor_parallel import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size

torch.set_num_threads(1)  # small tensors: one thread is as fast, and steady when cores are shared
notebook_start = time.perf_counter()
TP = 2                    # ranks per tensor-parallel group in this lab (every cell works with 4 too)

# %% [markdown]
# ## 1. A matrix product, split two ways
#
# `Y = X A` with `A` of shape (d_in, d_out). Split `A` by **columns** and each rank
# computes some of Y's columns from the whole X: concatenate to get Y. Split `A` by
# **rows**, and X by the matching columns, and each rank computes a *partial* Y of full
# shape: **sum** them. Megatron's MLP, `GeLU(X A) B`, uses both: A by columns (GeLU acts
# on each column alone, so it needs no communication), then B by rows, so the hidden
# activation never has to be gathered. One sum at the end.

# %%
gen = torch.Generator().manual_seed(0)
X, A, Bm = torch.randn(4, 6, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(8, 6, generator=gen)
by_columns = torch.cat([X @ part for part in A.chunk(TP, dim=1)], dim=1)
by_rows = sum(x_part @ a_part for x_part, a_part in zip(X.chunk(TP, dim=1), A.chunk(TP, dim=0)))
mlp_slices = sum(F.gelu(X @ a) @ b for a, b in zip(A.chunk(TP, dim=1), Bm.chunk(TP, dim=0)))
print(f"columns, concatenated: max error {(by_columns - X @ A).abs().max():.1e}")
print(f"rows, summed:          max error {(by_rows - X @ A).abs().max():.1e}")
print(f"MLP, A by columns then B by rows, one sum: max error {(mlp_slices - F.gelu(X @ A) @ Bm).abs().max():.1e}")

# %% [markdown]
# ## 2. Exercise 1: f and g
#
# On `tp` ranks the MLP becomes `X --f--> [ GeLU(X A_r) B_r ] --g--> Z`. Inside the
# brackets each rank works alone; **f** (entering) and **g** (leaving) are the only
# places where ranks talk.
#
# **Goal**: with f and g in place, every rank computes what one process computes: after
# g each rank holds the full Z, and after backward each rank holds the full dL/dX. For
# each operator, forward and backward, ask: is the tensor already the same on every
# rank, or is each rank's only a part of a sum? Where a sum is missing, add it with
# `comm.all_reduce(t, group=get_model_parallel_group())` (it sums `t` in place).
#
# Write both as `torch.autograd.Function`s (lab 06). **Target**: outputs and gradients
# equal one process's on 2 ranks, one all-reduce per operator (the check builds the
# group). `check.hint("f_and_g")` prints the next hint, idea first; every exercise has them.

# %%
class CopyToTP(torch.autograd.Function):
    """f: enters the tensor-parallel region, before a column-parallel layer. x: (..., d), the same on every rank."""

    @staticmethod
    def forward(ctx, x):
        # BEGIN SOLUTION
        # HINT: f forward: what must the layer see? check.hint('f_and_g')
        return x
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION
        # HINT: f backward: one process's dL/dx; check.hint('f_and_g')
        grad = grad.clone()
        comm.all_reduce(grad, group=get_model_parallel_group())
        return grad
        # END SOLUTION


class ReduceFromTP(torch.autograd.Function):
    """g: leaves the tensor-parallel region, after a row-parallel product. x: (..., d), this rank's partial result."""

    @staticmethod
    def forward(ctx, x):
        # BEGIN SOLUTION
        # HINT: g forward: the full output on every rank; check.hint('f_and_g')
        out = x.clone()
        comm.all_reduce(out, group=get_model_parallel_group())
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION
        # HINT: g backward: one process's dL/dx; check.hint('f_and_g')
        return grad
        # END SOLUTION

# %%
# CHECK: on 2 ranks, outputs and gradients equal one process's; target: one all-reduce per operator
check.f_and_g(CopyToTP, ReduceFromTP)

# %% [markdown]
# ## 3. Exercise 2: the parallel MLP and attention
#
# `models.FeedForward` is `c_proj(GeLU(c_fc(x)))` with `c_fc: d -> 4d` and
# `c_proj: 4d -> d`. On `tp` ranks, rank r owns the r-th of tp equal blocks of the 4d
# hidden units: `c_fc` is column-parallel (its output features are split), `c_proj`
# row-parallel (its input features are split), and each rank holds only its hidden
# units' weights. An `nn.Linear` stores its weight as (out, in).
#
# **Attention** splits the same way: `c_attn` (the q/k/v projection) column-parallel,
# `c_proj` row-parallel, and between them each rank runs **whole heads**: rank r owns the
# r-th of tp blocks of heads, which need nothing from the other heads. One catch:
# `c_attn.weight`, (3d, d), stacks the three projections `[q; k; v]`, and a rank needs
# its heads' rows of each.

# %% [markdown]
# The scaffolding builds the smaller layers. Write:
#
# * `ParallelMLP`: copy this rank's slices of `full`'s weights, and the forward;
# * `shard_qkv(t, r, tp)`: the rows of `c_attn`'s weight (3d, d) or bias (3d,) that
#   rank r keeps, shape (3d/tp, ...), its heads' q rows, then k, then v;
# * `ParallelAttention`: load its slices (with `shard_qkv`), and the forward, which is
#   `models.CausalSelfAttention.forward` on this rank's `n_head / tp` heads.
#
# Each forward takes the full (B, T, d) input and returns the full (B, T, d) output on
# every rank, using your f and g. **Target**: output, input gradient and weight
# gradients equal the full layer's (the weights' as this rank's slices); each rank holds
# 1/tp of the weights plus `c_proj`'s bias; one all-reduce of B·T·d values forward and
# one backward per layer. Hints: `check.hint("ParallelMLP")`, `"shard_qkv"`,
# `"ParallelAttention"`.

# %%
class ParallelMLP(torch.nn.Module):
    """Megatron's MLP on this rank of the tensor-parallel group: forward(x) == full(x), x of shape (B, T, d)."""

    def __init__(self, full: models.FeedForward):
        super().__init__()
        r, tp = get_model_parallel_rank(), get_model_parallel_world_size()
        d, hidden = full.c_fc.in_features, full.c_fc.out_features
        device = full.c_fc.weight.device
        self.c_fc = torch.nn.Linear(d, hidden // tp, device=device)      # this rank's hidden units
        self.c_proj = torch.nn.Linear(hidden // tp, d, device=device)    # ... and their part of the projection
        with torch.no_grad():
            # BEGIN SOLUTION
            # HINT: this rank's slices of full; check.hint('ParallelMLP')
            part = slice(r * hidden // tp, (r + 1) * hidden // tp)
            self.c_fc.weight.copy_(full.c_fc.weight[part])
            self.c_fc.bias.copy_(full.c_fc.bias[part])
            self.c_proj.weight.copy_(full.c_proj.weight[:, part])
            self.c_proj.bias.copy_(full.c_proj.bias)
            # END SOLUTION

    def forward(self, x):
        # BEGIN SOLUTION
        # HINT: full(x) on every rank, via f and g; check.hint('ParallelMLP')
        h = F.gelu(self.c_fc(CopyToTP.apply(x)))
        return ReduceFromTP.apply(F.linear(h, self.c_proj.weight)) + self.c_proj.bias
        # END SOLUTION


def shard_qkv(t, r, tp):
    """The rows of c_attn's stacked [q; k; v] weight (3d, d) or bias (3d,) that rank r keeps: (3d/tp, ...)."""
    # BEGIN SOLUTION
    # HINT: rank r's heads' rows of q, of k, of v; check.hint('shard_qkv')
    q, k, v = t.chunk(3)
    return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])
    # END SOLUTION


class ParallelAttention(torch.nn.Module):
    """Causal self-attention with this rank's n_head / tp heads: forward(x) == full(x), x of shape (B, T, d)."""

    def __init__(self, full: models.CausalSelfAttention):
        super().__init__()
        r, tp = get_model_parallel_rank(), get_model_parallel_world_size()
        d = full.n_embd
        self.n_head, self.head_dim = full.n_head // tp, d // full.n_head
        self.c_attn = torch.nn.Linear(d, 3 * d // tp, device=full.c_attn.weight.device)  # this rank's q, k, v
        self.c_proj = torch.nn.Linear(d // tp, d, device=full.c_attn.weight.device)
        self.register_buffer("future_mask", full.future_mask.clone(), persistent=False)
        with torch.no_grad():
            # BEGIN SOLUTION
            # HINT: as in ParallelMLP; check.hint('ParallelAttention')
            self.c_attn.weight.copy_(shard_qkv(full.c_attn.weight, r, tp))
            self.c_attn.bias.copy_(shard_qkv(full.c_attn.bias, r, tp))
            self.c_proj.weight.copy_(full.c_proj.weight.chunk(tp, dim=1)[r])
            self.c_proj.bias.copy_(full.c_proj.bias)
            # END SOLUTION

    def forward(self, x):
        B, T, _ = x.shape
        h, hd = self.n_head, self.head_dim
        # BEGIN SOLUTION
        # HINT: full(x) from this rank's heads; check.hint('ParallelAttention')
        qkv = self.c_attn(CopyToTP.apply(x))
        q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in qkv.split(h * hd, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        probs = F.softmax(scores.masked_fill(self.future_mask[:T, :T], float("-inf")), dim=-1)
        y = (probs @ v).transpose(1, 2).reshape(B, T, h * hd)
        return ReduceFromTP.apply(F.linear(y, self.c_proj.weight)) + self.c_proj.bias
        # END SOLUTION

# %%
# CHECK: q/k/v rows for tp = 2 and 4; both layers equal the full ones on 2 ranks, all-reduces counted
check.parallel_layers(ParallelMLP, shard_qkv, ParallelAttention)

# %% [markdown]
# The library's `ParallelBlock` puts attention and MLP together (`ColumnParallelLinear(...,
# stride=3)`, `RowParallelLinear(input_is_parallel=True)`). Run it on 2 ranks beside the
# full block, and count a whole block's collectives: attention and MLP each bring one
# all-reduce forward (g) and one backward (f).

# %%
def block_vs_full(tp, batch=2, seq=8):
    tpl.initialize_model_parallel(tp)
    full = models.build_model("gpt-tiny", seed=3).blocks[0].to(dist.device())
    block = tpl.ParallelBlock(full)
    x = torch.randn(batch, seq, full.ln_1.normalized_shape[0], generator=torch.Generator().manual_seed(4))
    x = x.to(dist.device())
    tracer = trace.Tracer()
    with tracer:
        with trace.span("forward"):
            y = block(x)
        with trace.span("backward"):
            y.sum().backward()
    heads = block.attn.n_head_local
    calls = [(s.name, s.args["numel"]) for s in tracer.trace.comm_spans()]
    return heads, (y - full(x)).abs().max().item(), calls


heads, error, calls = launch(block_vs_full, TP, TP)[0]
bsd = 2 * 8 * models.MODEL_PRESETS["gpt-tiny"].n_embd
print(f"{heads} of {models.MODEL_PRESETS['gpt-tiny'].n_head} heads per rank; block output vs full: max error {error:.1e}")
print(f"one block's collectives: {calls}  (target: 4 all-reduces of B*T*d = {bsd} values, 2 forward + 2 backward)")

# %% [markdown]
# ## 4. Exercise 3: cross-entropy over a split vocabulary
#
# The head is column-parallel too: rank r computes the logits of vocabulary ids
# `[r·V/tp, (r+1)·V/tp)`. Gathering them would move B·T·V values per step, the largest
# tensor of a language model (GPT-2: V = 50,257). Yet per token the loss is
#
# `loss = log Σ_v exp(z_v − m) − (z_target − m)`, with `m = max_v z_v` (so `exp`
# cannot overflow):
#
# a few numbers per token, each a reduction over the whole vocabulary.
#
# **Goal**: `vocab_parallel_loss(logits_local, target)` returns the per-token loss, shape
# `target.shape`, equal to `F.cross_entropy` of the full logits on every rank, and leaves
# `logits_local` unchanged. Forward only (the library adds the backward). A max across
# ranks is `comm.all_reduce(t, op=comm.ReduceOp.MAX, group=...)`. **Target**: bytes
# moved independent of V, far below gathering the logits (the check prints both).
# `check.hint("vocab_parallel_loss")` for hints.

# %%
def vocab_parallel_loss(logits_local, target):
    """Per-token cross-entropy from this rank's slice of the logits (..., V/tp) and global target ids (...)."""
    group, r = get_model_parallel_group(), get_model_parallel_rank()
    v_local = logits_local.shape[-1]
    start = r * v_local                       # this rank holds ids [start, start + v_local)
    # BEGIN SOLUTION
    # HINT: reductions over the vocabulary; check.hint('vocab_parallel_loss')
    m = logits_local.max(dim=-1).values
    comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)
    shifted = logits_local - m.unsqueeze(-1)
    mine = (target >= start) & (target < start + v_local)
    local_target = (target - start).clamp(0, v_local - 1)
    target_logit = torch.where(mine, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
    sums = torch.stack([shifted.exp().sum(dim=-1), target_logit])
    comm.all_reduce(sums, group=group)
    return torch.log(sums[0]) - sums[1]
    # END SOLUTION

# %%
# CHECK: equals F.cross_entropy of the full logits on 2 ranks; bytes moved beside gathering the logits
check.vocab_parallel_loss(vocab_parallel_loss)

# %% [markdown]
# In bytes, for a real model: per token your loss moves a few floats whatever V is,
# while the full logits cost V floats per token on every rank.

# %%
tokens = 8 * 1024                                   # a batch of 8 sequences of 1024 tokens
for name, V in (("gpt-tiny", 256), ("GPT-2", 50257), ("Llama 3", 128256)):
    print(f"{name:>8}: full logits {format_bytes(4 * tokens * V):>10} per rank;  the three reductions move "
          f"{format_bytes(comm.collective_bytes('all_reduce', 3 * 4 * tokens, TP)['bytes']):>9}")

# %% [markdown]
# ## 5. Sequence parallel: the rest of the block, split along the sequence
#
# Tensor parallel leaves the layer norms, the residual stream and dropout **replicated**:
# every rank computes and stores them whole. Sequence parallelism (Korthikanti et al.
# 2022) gives each rank T/tp positions of those regions instead. It costs no extra
# bytes, because `all_reduce = reduce_scatter + all_gather`: the operators at the
# borders of the attention and MLP change, not the traffic. The activations outside
# attention and the MLP shrink by tp. The layer norms' weights now see only some
# positions, so their gradients are summed over the group (a small all-reduce each).

# %% [markdown]
# ### Exercise 4: SP's two operators
#
# * `GatherSequence` replaces f before a column-parallel layer: it takes this rank's
#   positions, (B, T/tp, d), and gives every position, (B, T, d), in rank order.
# * `ReduceScatterSequence` replaces g after a row-parallel layer: it takes this rank's
#   partial sums, (B, T, d), and gives the summed output at this rank's positions,
#   (B, T/tp, d).
#
# Backward gives each input the gradient one process would compute for it. `comm.all_gather(t,
# group=...)` concatenates every rank's `t` along **dim 0**; `comm.reduce_scatter(t,
# group=...)` sums and keeps this rank's chunk of **dim 0**. **Target**: values and
# gradients right on 2 ranks, and the bytes equal to the two all-reduces of f and g.
# `check.hint("sequence_parallel")` for hints.

# %%
class GatherSequence(torch.autograd.Function):
    """(B, T/tp, d) this rank's positions -> (B, T, d) every rank's positions, in rank order."""

    @staticmethod
    def forward(ctx, x):
        # BEGIN SOLUTION
        # HINT: every position, from every rank; check.hint('sequence_parallel')
        gathered = comm.all_gather(x.transpose(0, 1).contiguous(), group=get_model_parallel_group())
        return gathered.transpose(0, 1).contiguous()
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION
        # HINT: one process's dL/d(my positions); check.hint('sequence_parallel')
        summed = comm.reduce_scatter(grad.transpose(0, 1).contiguous(), group=get_model_parallel_group())
        return summed.transpose(0, 1).contiguous()
        # END SOLUTION


class ReduceScatterSequence(torch.autograd.Function):
    """(B, T, d) this rank's partial sums -> (B, T/tp, d) the summed output at this rank's positions."""

    @staticmethod
    def forward(ctx, x):
        # BEGIN SOLUTION
        # HINT: the sum over ranks, my positions; check.hint('sequence_parallel')
        summed = comm.reduce_scatter(x.transpose(0, 1).contiguous(), group=get_model_parallel_group())
        return summed.transpose(0, 1).contiguous()
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # BEGIN SOLUTION
        # HINT: one process's dL/dx; check.hint('sequence_parallel')
        gathered = comm.all_gather(grad.transpose(0, 1).contiguous(), group=get_model_parallel_group())
        return gathered.transpose(0, 1).contiguous()
        # END SOLUTION

# %%
# CHECK: outputs and gradients on 2 ranks; target: the bytes of the two all-reduces they replace
check.sequence_parallel_ops(GatherSequence, ReduceScatterSequence)

# %% [markdown]
# Measure it: the activations a whole `gpt-mini` keeps after its forward, in one process,
# with TP and with TP + SP, beside the planner's prediction (`minifsdp.planner`, which
# lab 09 builds on).

# %%
B_SP, T_SP = 4, 64


def activations_after_forward(tp, sequence_parallel):
    tpl.initialize_model_parallel(tp)
    full = models.build_model("gpt-mini", seed=5).to(dist.device())
    model = tpl.tensor_parallel_gpt(full, sequence_parallel) if tp > 1 else full
    x = torch.randint(0, 256, (B_SP, T_SP), generator=torch.Generator().manual_seed(6)).to(dist.device())
    tracker = MemoryTracker()
    tracker.track_model(model)
    tracer = trace.Tracer()
    with tracker, tracer:
        logits = model(x)
        loss = tpl.ParallelGPT.loss(logits, x) if tp > 1 else models.lm_loss(logits, x)
        kept = tracker.snapshot("forward")[ACTIVATIONS] - loss.nbytes
    tracker.close()
    return kept, tracer.trace.bytes_by_op()


measured = {"1 rank": launch(activations_after_forward, 1, 1, False)[0][0]}
for sp in (False, True):
    kept, moved = launch(activations_after_forward, TP, TP, sp)[0]
    measured[f"TP={TP}" + (" + SP" if sp else "")] = kept
    print(f"TP={TP}{' + SP' if sp else '     '}: forward moved {moved}")
predicted = {"1 rank": planner.plan("gpt-mini", batch=B_SP, seq_len=T_SP).memory["activations"],
             f"TP={TP}": planner.plan("gpt-mini", batch=B_SP, seq_len=T_SP, tp=TP).memory["activations"],
             f"TP={TP} + SP": planner.plan("gpt-mini", batch=B_SP, seq_len=T_SP, tp=TP,
                                           sequence_parallel=True).memory["activations"]}
for name in measured:
    print(f"{name:>10}: activations measured {format_bytes(measured[name]):>10}, predicted "
          f"{format_bytes(predicted[name]):>10} ({measured[name] / predicted[name]:.3f})")
saving = 1 - measured[f"TP={TP} + SP"] / measured[f"TP={TP}"]
print(f"sequence parallel saves {saving:.1%} of TP's activations here (predicted "
      f"{1 - predicted[f'TP={TP} + SP'] / predicted[f'TP={TP}']:.1%})")

# %%
# FIGURE: activations one rank keeps after the forward, measured beside the planner's prediction
fig, ax = plot.column_figure(height=3)
names = list(measured)
ax.bar([i - 0.2 for i in range(3)], [measured[n] / 2**20 for n in names], width=0.4, label="measured")
ax.bar([i + 0.2 for i in range(3)], [predicted[n] / 2**20 for n in names], width=0.4, label="predicted (planner)")
ax.set_xticks(range(3), names)
ax.set_xlabel("layout (ranks in the tensor-parallel group)")
ax.set_ylabel("activations after forward (MiB)")
ax.set_title(f"gpt-mini, B={B_SP}, T={T_SP}: activations one rank keeps for backward")
ax.legend()
fig

# %% [markdown]
# Takeaway: TP divides the attention and MLP activations by tp; SP also divides the layer
# norms' inputs, and only the all-gathered inputs of the matmuls stay whole (Megatron
# can re-gather them in backward instead; minifsdp keeps them).
#
# ## Summary
#
# * A layer splits by columns (outputs concatenated) or by rows (outputs summed);
#   column-then-row needs one sum per pair, so a transformer block costs 2 all-reduces of
#   B·T·d forward and 2 backward, **every block, every micro-batch**: tensor parallel
#   lives on fast links (the GPUs of one machine).
# * f and g are those all-reduces as autograd functions, each the other's mirror.
# * Attention splits by heads; q, k and v must each be cut.
# * The loss needs only per-token reductions: the full logits never exist.
# * Sequence parallel turns each all-reduce into reduce-scatter + all-gather, the same
#   bytes, and shards what TP replicated.

# %% [markdown]
# The library: `minifsdp.tensor_parallel` (FairScale's names: `initialize_model_parallel`,
# `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`,
# `vocab_parallel_cross_entropy`), and `python -m minifsdp.train --strategy tp --tp 2`
# (add `--sequence-parallel`).

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
