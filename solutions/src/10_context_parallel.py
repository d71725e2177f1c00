# Lab 10 - long sequences: context parallel. Source of solutions/10_context_parallel.ipynb and
# labs/10_context_parallel.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 10 — Long sequences: context parallel (ring attention)
#
# **You will be able to** say why a long sequence overflows one device (lab 01's terms
# against T), merge partial attention results exactly (the online softmax), write one
# forward of ring attention that equals full attention, remove the causal imbalance of
# the naive split with the zig-zag split, and size T and cp for memory per rank.
#
# **Prerequisites**: labs 00 (send, receive, the ring) and 01 (activation bytes).
#
# **Time**: 60–75 minutes of work; about 20 seconds of compute on a laptop (CPU, `gloo`)
# or a GPU VM (launches of more ranks than GPUs use CPU ranks).
#
# **Exercises**: 1. the online-softmax merge · 2. ring attention's forward · 3. the zig-zag split.
#
# **Symbols**: B, T, d, h, L as in lab 01; `hd` = d / h, the head width; `cp` = the ranks
# that share one sequence (the context-parallel group).

# %%
import math
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as tdist

import minifsdp
from minifsdp import comm, data, dist, estimate, models, plot, trace
from minifsdp.context_parallel import (activation_bytes, context_parallel_gpt, ring_attention_bytes, ring_buffer_bytes,
                                       shard_sequence)
from minifsdp.labcheck import lab10 as check
from minifsdp.memory import ACTIVATIONS, MemoryTracker

# Small tensors: one compute thread per process is as fast, and several ranks share the cores.
torch.set_num_threads(1)
GB = 1e9
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. Why activations grow with T
#
# Lab 01: one block keeps `16·B·T·d + 4·B·T` values for backward that grow with T, and
# the `B·h·T²` attention probabilities that grow with its square. Take lab 03's 6.7B GPT
# shape (32 layers, d = 4096, h = 32) with one sequence (B = 1) in bf16 (2 B a value)
# and let T grow to the lengths long-context models train on.

# %%
# FIGURE
BIG = models.GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)   # lab 03's
TS = [2**k for k in range(11, 18)]                         # T = 2,048 ... 131,072 tokens


def probabilities_and_rest(T: int) -> tuple[float, float]:
    """Lab 01's activation bytes of one BIG forward, B = 1, bf16: the T² probabilities, and everything else."""
    probs = BIG.n_layer * estimate.gpt_layer_activation_breakdown(BIG, 1, T, "bf16")["attention probs"]
    return probs, estimate.gpt_activation_bytes(BIG, 1, T, "bf16")["total"] - probs


terms = np.array([probabilities_and_rest(T) for T in TS]) / GB
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.plot(TS, terms.sum(1), "ko-", label="all activations (lab 01)")
ax.plot(TS, terms[:, 0], "s--", label="attention probabilities, L·B·h·T²")
ax.plot(TS, terms[:, 1], "^--", label="the rest: linear in T")
ax.axhline(80, color="red", lw=1, label="one 80 GB accelerator")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequence length T (tokens)")
ax.set_ylabel("activations, one device (GB)")
ax.set_title("6.7B GPT, B = 1, bf16: what one forward keeps for backward", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
over = next(T for T, rest in zip(TS, terms[:, 1]) if rest > 80)
print(f"T = {TS[-1]:,}: probabilities {terms[-1, 0]:,.0f} GB, the rest {terms[-1, 1]:,.0f} GB; "
      f"the linear terms alone pass 80 GB from T = {over:,}")
assert terms[0, 0] < terms[0, 1] and terms[-1, 0] > 10 * terms[-1, 1], "the text below says the T² term takes over"

# %% [markdown]
# *Takeaway: past a few thousand tokens the T² probabilities dominate, and even without
# them the linear terms overflow a device.* FlashAttention never stores the probabilities:
# it computes attention block by block with the **online softmax** (section 2), and so
# does ring attention. The linear terms remain: the only way down is to give each rank
# a share of the sequence, `T/cp` positions (sections 3–5).

# %% [markdown]
# ## 2. Attention over keys that arrive in pieces
#
# One query row's attention is `Σ_j p_j v_j` with `p_j = exp(s_j) / Σ_k exp(s_k)` and
# scores `s_j = q·k_j / √hd`: the denominator needs every score of the row. Ring
# attention sees the keys one piece at a time, so it keeps, for the keys of a set A, a
# **partial result**: the attention over A alone, normalised over A only, and the log of
# that normaliser, the log-sum-exp (`lse`):
#
# ```
# out_A = Σ_{j in A} exp(s_j − lse_A) v_j          lse_A = log Σ_{j in A} exp(s_j)
# ```
#
# Two partial results over disjoint sets A and B hold all that A ∪ B needs: no score is
# computed again (Milakov & Gimelshein 2018; FlashAttention's inner loop).

# %% [markdown]
# ### Exercise 1: a block's partial result, and the merge
#
# * `block_attention(q, k, v, mask=None) -> (out, lse)`: the partial result of the
#   queries `q` (`(..., Tq, hd)`) over the keys `k` and values `v` (`(..., Tk, hd)`);
#   `mask` (`Tq x Tk`, True = blocked, as lab 01's causal mask) hides some keys;
#   `lse` has one number per query row, `(..., Tq)`;
# * `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the partial result over A ∪ B.
#
# Target: one softmax over every key, to 1e-5, with the keys in 3 pieces merged in any
# order, one piece causal-masked, and rows whose scores reach 1,000 (`exp(89)` is already
# beyond float32). `check.hint("merge")` prints the next hint, idea first.

# %%
def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): attention of q over these keys alone, normalised over them; lse (..., Tq)."""
    # BEGIN SOLUTION
    # HINT: scaled scores, blocked at -inf, their log-sum-exp, weights times v. check.hint("block_attention")
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse
    # END SOLUTION


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint key sets -> the partial result over their union."""
    # BEGIN SOLUTION
    # HINT: the union's normaliser is the sum of both; each part keeps its share. check.hint("merge")
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse
    # END SOLUTION

# %%
# CHECK: 3 pieces of keys merged in any order against one softmax; a causal piece; scores of 1,000
check.online_softmax(block_attention, merge)

# %% [markdown]
# ## 3. The ring
#
# Cut every sequence into chunks of equal length and give each of the `cp` ranks its
# share; every layer but attention works position by position, on the share alone.
# Attention needs every earlier key: the keys and values go **round the ring**. At step
# `s` rank `r` holds the K/V of rank `r − s`: it computes its queries against them while
# the next K/V travel (`comm.isend` to `r + 1`, `comm.irecv` from `r − 1`, as in lab 00),
# and merges. After `cp` steps every query has met every key.
#
# ```
# cp = 3, naive split      step 0   step 1   step 2        (K/V held: rank r − step)
#          rank 0 holds     K/V 0    K/V 2    K/V 1
#          rank 1           K/V 1    K/V 0    K/V 2
#          rank 2           K/V 2    K/V 1    K/V 0
# ```

# %% [markdown]
# **Predict first**: between a chunk of queries `a` and a chunk of keys `b`, the causal
# mask leaves one of three things. Which, and when?

# ### Exercise 2: one forward of ring attention
#
# `ring_attention_forward(q, k, v, chunks)`: this rank's share of causal attention over the
# whole sequence. `q, k, v` are `(B, h, T/cp, hd)`: the chunks `chunks(rank, cp)` holds, in
# that order (the naive split below gives rank `r` chunk `r`; exercise 3 writes another).
# Use your `block_attention` and `merge`; a block is one chunk of queries against one chunk
# of keys, and `diagonal_mask(n, q)` is the mask of a chunk against itself.
#
# Target, on 2 and on 4 ranks: one process's causal attention, to 1e-5; bytes sent per
# rank `(cp − 1)·2·B·(T/cp)·d·4` (K and V of the share, fp32, once a step but the last);
# no block the mask hides entirely. `check.hint("ring_attention_forward")` when stuck.

# %%
def naive_chunks(rank: int, cp: int) -> tuple[int, ...]:
    """The naive split: cp chunks, rank r holds chunk r."""
    return (rank,)


def diagonal_mask(n: int, like: torch.Tensor) -> torch.Tensor:
    """The causal mask of a chunk of n positions against itself: True above the diagonal (blocked)."""
    return torch.ones(n, n, dtype=torch.bool, device=like.device).triu(1)


def ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks) -> torch.Tensor:
    """This rank's share of causal attention over the whole sequence: (B, h, T/cp, hd), like q."""
    rank, cp = dist.rank(), dist.world_size()
    mine = chunks(rank, cp)                     # the chunk numbers this rank holds, in order
    n = q.shape[-2] // len(mine)                # positions in a chunk
    # BEGIN SOLUTION
    # HINT: cp steps: compute on the K/V you hold while the next travel. check.hint("ring_attention_forward")
    kv = torch.stack([k, v])                    # one message a step
    outs, lses = [None] * len(mine), [None] * len(mine)
    for step in range(cp):
        if step < cp - 1:                       # the next K/V start travelling now
            arriving = torch.empty_like(kv)
            if rank % 2 == 0:                   # even ranks send first, odd ranks receive first (NCCL)
                handles = [comm.isend(kv, (rank + 1) % cp), comm.irecv(arriving, (rank - 1) % cp)]
            else:
                handles = [comm.irecv(arriving, (rank - 1) % cp), comm.isend(kv, (rank + 1) % cp)]
        ks, vs = kv[0].split(n, dim=-2), kv[1].split(n, dim=-2)
        for i, a in enumerate(mine):
            for j, b in enumerate(chunks((rank - step) % cp, cp)):
                if b > a:                       # every key after every query: nothing to compute
                    continue
                mask = diagonal_mask(n, q) if a == b else None
                o, lse = block_attention(q[..., i * n:(i + 1) * n, :], ks[j], vs[j], mask)
                outs[i], lses[i] = (o, lse) if outs[i] is None else merge(outs[i], lses[i], o, lse)
        if step < cp - 1:
            for handle in handles:
                handle.wait()
            kv = arriving
    return torch.cat(outs, dim=-2)
    # END SOLUTION

# %%
# CHECK: 2 and 4 ranks (naive split) against one process's causal attention; bytes sent; blocks computed
check.ring_attention(ring_attention_forward, naive_chunks)

# %% [markdown]
# Your ring at `cp = 4`, as the check measured it: the scores each rank computed (per
# sample and head; a diagonal block computes all of its `n²` and masks half).

# %%
# NBVAL_CHECK_OUTPUT
naive_run = check.results["ring_attention"]
print(f"naive split, cp = {naive_run['cp']}, T = {naive_run['T']}: scores computed per rank, yours "
      f"{naive_run['scores']}, library {naive_run['library_scores']}")
print(f"the busiest rank computes {max(naive_run['scores']) / min(naive_run['scores']):.0f}x the scores of the idlest")

# %% [markdown]
# Rank 0's queries come first: they need only chunk 0's keys. The last rank's need every
# key. Each ring step waits for its slowest rank, so the whole attention takes as long as
# the busiest rank's share: most of the group idles.

# %% [markdown]
# ## 4. The zig-zag split
#
# Cut the sequence into `2·cp` chunks instead and give rank `r` one chunk from the cheap
# front and its mirror image from the expensive back (Brandon et al. 2023; the split
# torchtitan and picotron use):
#
# ```
# T = 8, cp = 2      positions 0 1 | 2 3 | 4 5 | 6 7        chunks 0 1 2 3
# naive:    rank 0 holds 0 1 2 3        rank 1 holds 4 5 6 7
# zig-zag:  rank 0 holds 0 1 6 7        rank 1 holds 2 3 4 5
# ```
#
# Your ring needs no change: it takes any split, as `chunks`.

# %% [markdown]
# ### Exercise 3: the zig-zag split and the work per rank
#
# * `zigzag_chunks(rank, cp)`: the two chunks rank `rank` holds, out of `2·cp`;
# * `shard(x, rank, cp, chunks, dim)`: the rank's share of `x` along `dim` (its chunks, in
#   its order): what each rank reads of the ids, the targets and the positions;
# * `work_per_rank(seq_len, cp, chunks)`: the unmasked query-key pairs each rank computes
#   in the ring, per sample and head (a query sees every key up to its own position).
#
# Target: the library's split and counts at 12 (T, cp) pairs for both splits; your ring
# with your zig-zag equal to one process's attention on 4 ranks, every rank computing the
# same scores. `check.hint("work_per_rank")` when stuck.

# %%
def zigzag_chunks(rank: int, cp: int) -> tuple[int, ...]:
    """The zig-zag split: 2·cp chunks; rank r holds one from the front and its mirror from the back."""
    # BEGIN SOLUTION
    # HINT: which chunk mirrors chunk r, counting from the end? check.hint("zigzag_chunks")
    return (rank, 2 * cp - 1 - rank)
    # END SOLUTION


def shard(x: torch.Tensor, rank: int, cp: int, chunks, dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s share of x along dim: the chunks it holds, in its order, one after the other."""
    # BEGIN SOLUTION
    # HINT: as many equal chunks as the ranks hold together; keep this rank's. check.hint("shard")
    pieces = x.chunk(cp * len(chunks(0, cp)), dim=dim)
    return torch.cat([pieces[c] for c in chunks(rank, cp)], dim=dim)
    # END SOLUTION


def work_per_rank(seq_len: int, cp: int, chunks) -> list[int]:
    """Unmasked query-key pairs each rank computes in the ring (per sample and head), rank 0 first."""
    # BEGIN SOLUTION
    # HINT: sum over this rank's query chunks and every key chunk. check.hint("work_per_rank")
    total = cp * len(chunks(0, cp))
    n = seq_len // total
    work = []
    for rank in range(cp):
        pairs = 0
        for a in chunks(rank, cp):
            for b in range(total):
                pairs += n * n if b < a else n * (n + 1) // 2 if b == a else 0
        work.append(pairs)
    return work
    # END SOLUTION

# %%
# CHECK: the split, the shares and the work against the library; your ring with your zig-zag on 4 ranks
check.zigzag(zigzag_chunks, shard, work_per_rank, ring_attention_forward)

# %% [markdown]
# The positions each rank holds at `T = 16`, `cp = 4`, from your `shard`; then your
# `work_per_rank` at a realistic length and the scores your ring computed, measured.

# %%
# NBVAL_CHECK_OUTPUT
positions = torch.arange(16)
for name, chunks in (("naive", naive_chunks), ("zig-zag", zigzag_chunks)):
    print(f"{name:8}" + "   ".join(f"rank {r}: {shard(positions, r, 4, chunks, dim=0).tolist()}" for r in range(4)))

# %%
# FIGURE
CP, T_LONG = 8, 131072
zig_run = check.results["zigzag"]
fig, (ax_w, ax_m) = plt.subplots(1, 2, figsize=(11, 3.2))
x, width = np.arange(CP), 0.4
for i, (name, chunks) in enumerate((("naive", naive_chunks), ("zig-zag", zigzag_chunks))):
    work = np.array(work_per_rank(T_LONG, CP, chunks))
    ax_w.bar(x + (i - 0.5) * width, work / 1e9, width, label=f"{name}: busiest / idlest = {work.max() / work.min():.1f}")
ax_w.set_xticks(x)
ax_w.set_xlabel("rank")
ax_w.set_ylabel("unmasked query-key pairs (10⁹)")
ax_w.set_title(f"your work_per_rank: T = {T_LONG:,}, cp = {CP}", fontsize=10)
ax_w.legend(fontsize=8)
x = np.arange(zig_run["cp"])
for i, (name, run) in enumerate((("naive", naive_run), ("zig-zag", zig_run))):
    ax_m.bar(x + (i - 0.5) * width, run["scores"], width, label=name)
    ax_m.plot(x + (i - 0.5) * width, run["library_scores"], "k_", ms=16, mew=2, label="library's ring" if i else None)
ax_m.set_xticks(x)
ax_m.set_xlabel("rank")
ax_m.set_ylabel("scores computed, per sample and head")
ax_m.set_title(f"your ring, measured: T = {zig_run['T']}, cp = {zig_run['cp']}", fontsize=10)
ax_m.legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"your ring, cp = {zig_run['cp']}: naive {naive_run['scores']}, zig-zag {zig_run['scores']} scores per rank")
assert len(set(zig_run["scores"])) == 1 and len(set(naive_run["scores"])) == zig_run["cp"], "the text says so"

# %% [markdown]
# *Takeaway: zig-zag gives every rank the same work, the naive split gives the last rank
# about `2·cp − 1` times the first's.* The total is the same (`T(T+1)/2` pairs): only its
# spread changes, so the ring's steps no longer wait on one busy rank. Both splits send the
# same bytes.

# %% [markdown]
# ## 5. Memory per rank
#
# A rank of `context_parallel_gpt` runs every layer on `T/cp` positions, and its ring
# attention keeps its output and `lse` instead of the probabilities.
# `minifsdp.context_parallel.activation_bytes(config, B, T, cp)` is lab 01's formula at
# `T/cp` with that change. Measured first: `gpt-tiny`, B = 2, T = 32, four CPU ranks as
# four groups of `cp = 1`, two of `cp = 2` and one of `cp = 4` (the memory tracker counts
# exactly on the CPU; on a GPU it rounds to the allocator's 512-B blocks).

# %%
MODEL, B_TINY, T_TINY = "gpt-tiny", 2, 32


def measure_activations(model_name: str, batch: int, seq_len: int) -> dict:
    """Activation bytes after one forward of context_parallel_gpt, for cp = 1, 2, 4 over 4 ranks; ring bytes."""
    rank, world = dist.rank(), dist.world_size()
    x, y = data.get_batch(0, batch, seq_len)
    out = {"activations": {}, "bytes": {}}
    for cp in (1, 2, 4):
        groups = [tdist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]   # every rank makes all
        model = context_parallel_gpt(models.build_model(model_name), groups[rank // cp], "zigzag")
        tracker = MemoryTracker()
        tracker.track_model(model)
        with tracker, trace.Tracer(rank=rank) as tracer:
            ids, targets = (shard_sequence(t.clone(), cp, rank % cp) for t in (x, y))
            loss = model.loss(model(ids), targets)
            out["activations"][cp] = tracker.snapshot("forward")[ACTIVATIONS]
            loss.backward()
        tracker.close()
        sent = [s for s in tracer.trace.comm_spans() if s.name == "send" and s.args.get("unit") == "blocks.0.attn"]
        out["bytes"][cp] = {phase: sum(s.args["bytes"] for s in sent if s.args["phase"] == phase)
                            for phase in ("forward", "backward")}
    return out


t0 = time.perf_counter()
memory_runs = minifsdp.launch(measure_activations, 4, MODEL, B_TINY, T_TINY, backend="gloo")
print(f"one forward and backward at cp = 1, 2, 4 on 4 CPU ranks: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
tiny = models.MODEL_PRESETS[MODEL]
print(f"{MODEL}, B = {B_TINY}, T = {T_TINY}: activations per rank after forward, rank 0")
print(f"{'cp':>4}{'measured B':>13}{'activation_bytes B':>20}{'diff B':>8}")
for cp, got in memory_runs[0]["activations"].items():
    want = activation_bytes(tiny, B_TINY, T_TINY, cp)["total"]
    print(f"{cp:>4}{got:>13,}{want:>20,}{got - want:>8}")
    assert all(r["activations"][cp] - want == 4 for r in memory_runs), "every rank: the formula + the 4-B loss"

# %% [markdown]
# Exact on every rank but for the 4-byte loss, a forward's output rather than something
# kept for backward (as in lab 01). Now the knobs at scale: the 6.7B GPT of section 1,
# B = 1, bf16 activations, and its model states sharded by FSDP over the `cp` ranks
# (mixed-precision AdamW, `16Ψ/cp` bytes: lab 03). The bars are one rank; the red line is one
# 80 GB accelerator. The cell after the widget makes the same call without it.

# %%
PSI = estimate.gpt_param_count(BIG)
CPS = [1, 2, 4, 8, 16, 32]


def one_rank(T: int, cp: int) -> dict[str, float]:
    """One rank's bytes for BIG at (T, cp): model states sharded over the cp ranks, activations, ring buffers."""
    return {"model states (FSDP over cp)": estimate.model_state_bytes_per_device(
                PSI, cp, 3, mixed_precision=True, padding=False)["total"],
            "activations": activation_bytes(BIG, 1, T, cp, "bf16")["total"],
            "ring K/V buffers": ring_buffer_bytes(1, T, BIG.n_embd, cp, element_size=2)}


def memory_per_rank(seq_len: int = 131072, cp: int = 8) -> dict[str, float]:
    """Draw one rank's memory at (T, cp) and the activations per rank against T; return that rank's bytes."""
    mine = one_rank(seq_len, cp)
    fig, (ax_bar, ax_t) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [1, 2]})
    bottom = 0.0
    for (name, value), color in zip(mine.items(), ("tab:blue", "tab:orange", "tab:green")):
        ax_bar.bar(0, value / GB, bottom=bottom, color=color, width=0.5, label=f"{name}: {value / GB:,.1f} GB")
        bottom += value / GB
    ax_bar.axhline(80, color="red", lw=1, label="80 GB")
    ax_bar.set_xlim(-0.5, 0.5)
    ax_bar.set_ylim(0, 1.6 * max(bottom, 80))
    ax_bar.set_xticks([])
    ax_bar.set_ylabel("GB, one rank")
    ax_bar.set_title(f"T = {seq_len:,}, cp = {cp}: {bottom:,.1f} GB", fontsize=10)
    ax_bar.legend(fontsize=7, loc="upper center")
    for n in CPS:
        ax_t.plot(TS, [one_rank(T, n)["activations"] / GB for T in TS], "o-" if n == cp else "-",
                  lw=2.5 if n == cp else 1, label=f"cp = {n}")
    ax_t.plot(TS, [estimate.gpt_activation_bytes(BIG, 1, T, "bf16")["total"] / GB for T in TS], "k:",
              label="cp = 1, T² probabilities kept (lab 01)")
    ax_t.axhline(80, color="red", lw=1)
    ax_t.plot([seq_len], [mine["activations"] / GB], "k*", ms=12)
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("sequence length T (tokens)")
    ax_t.set_ylabel("activations per rank (GB)")
    ax_t.set_title("ring attention: activations per rank", fontsize=10)
    ax_t.legend(fontsize=7, ncol=2)
    plt.tight_layout()
    plt.show()
    return mine


WIDE = {"style": {"description_width": "initial"}, "layout": widgets.Layout(width="480px")}
widgets.interact(memory_per_rank,
                 seq_len=widgets.SelectionSlider(options=TS, value=TS[-1], description="sequence length T", **WIDE),
                 cp=widgets.SelectionSlider(options=CPS, value=8, description="cp (ranks per sequence)", **WIDE));

# %%
# FIGURE
rows = {cp: one_rank(TS[-1], cp) for cp in CPS}
fits = next(cp for cp, row in rows.items() if sum(row.values()) < 80 * GB)
memory_per_rank(TS[-1], fits)                       # the same function, called plainly
print(f"T = {TS[-1]:,}, GB per rank:{'cp':>4}{'model states':>15}{'activations':>14}{'ring K/V':>11}{'in all':>9}")
for cp, row in rows.items():
    print(f"{'':25}{cp:>4}" + "".join(f"{v / GB:>{w},.2f}" for v, w in zip(row.values(), (15, 14, 11)))
          + f"{sum(row.values()) / GB:>9,.1f}")
assert fits == 16 and rows[1]["activations"] / rows[16]["activations"] > 15.9, "the text below says so"
assert 650 * GB < sum(rows[1].values()) < 750 * GB, "the text below says about 700 GB"
assert all(r["ring K/V buffers"] < r["activations"] / 100 for r in rows.values()), "the text says the buffers are small"

# %% [markdown]
# *Takeaway: cp divides the activations per rank by cp (every term is per position); the
# ring's K/V buffers stay under 1 % of them.* At 128k tokens one device would need about
# 700 GB; `cp = 16`, with FSDP sharding the model states over the same ranks, is the
# smallest group whose every rank fits in 80 GB (lab 06's checkpointing would cut the
# activations further). What cp does not change is the work: each rank still computes
# about `T²/(2·cp)` query-key pairs per head. It is split, not reduced.

# %% [markdown]
# ## 6. Optional deep dive: backward, and the bytes of a layer
#
# `minifsdp.context_parallel.ring_attention` is the library's version of your forward, with
# a backward. It saves only `q, k, v, out, lse`; backward turns the ring once more: at
# each step it recomputes a block's probabilities from the saved final `lse`
# (FlashAttention-2) and computes that K/V chunk's `dK, dV` from this rank's queries.
# Those belong to the K/V's owner: they travel on round the ring as an accumulator, each
# rank adding its share, until they reach home. So backward sends the K/V again and the
# gradients once: twice forward's bytes. The tracer, on one layer of the measured run:

# %%
# NBVAL_CHECK_OUTPUT
for cp, moved in memory_runs[0]["bytes"].items():
    want = ring_attention_bytes(B_TINY, T_TINY, tiny.n_embd, cp)
    print(f"cp = {cp}: sent by rank 0 for blocks.0.attn, forward {moved['forward']:,} B, backward "
          f"{moved['backward']:,} B; ring_attention_bytes {want['forward']:,} / {want['backward']:,} B")
    assert moved == want

# %% [markdown]
# PyTorch's own `torch.distributed.tensor.experimental.context_parallel` replaces the CUDA
# attention kernels with the same ring; on the CPU it does not run (torch 2.13), so this lab
# compares with full attention instead. With data parallel as well, FSDP shards over
# dp × cp together (torchtitan's `dp_shard_cp`): the cp ranks of one sample average their
# gradients exactly as data-parallel ranks do.

# %% [markdown]
# ## Summary
#
# Activations grow with T (lab 01's terms), the attention probabilities with T². The
# online softmax merges partial results `(out, lse)` exactly, so attention can be computed
# over keys that arrive in pieces and the probabilities are never stored. Ring attention
# gives each of `cp` ranks a share of the sequence and passes the K/V round the ring:
# `(cp − 1)` K/V messages per layer forward, one process's result. The causal mask makes
# the naive split unbalanced; the zig-zag split gives every rank the same work. Activations
# per rank fall by `cp`; with FSDP over the same ranks, a 128k-token sequence of a GPT
# of 6.7B's shape fits on 80 GB devices at `cp = 16`.

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
