"""``models.GPT`` with its sequence split across a cp group: ring attention inside, everything else local.

Layer 5 (techniques). ``context_parallel_gpt(model, cp_group, split)`` returns a
``ContextParallelGPT`` over the *same* parameters as ``model`` (no copy; the same
names, so state dicts, DDP and FSDP see a GPT). Its forward takes this rank's
share of the ids (``shard_sequence``) and returns the logits of those positions::

    tok_emb, pos_emb   local: the share's ids, and its *global* positions (sequence_positions)
    per block:
      ln_1, ln_2, mlp  local: position by position, nothing to exchange
      attn             c_attn and c_proj local; between them ring_attention over the cp group
    ln_f, head, loss   local: the mean cross-entropy of the share's positions

Gradients. Every rank holds every parameter (replicated), and each rank's
backward yields the gradient of *its* positions' loss (ring attention's backward
sends each K/V share's gradient home, so the cross-rank terms land on the right
rank). With equal shares the whole sequence's mean loss is the mean of the
ranks' mean losses, so the true gradient is the *average* over the cp group of
the ranks' gradients: an all-reduce, exactly data parallel's. Three ways:

    all_reduce_gradients(cp_model, cp_group)                  after backward (one flat all-reduce)
    DistributedDataParallel(cp_model, process_group=group)    minifsdp.ddp: bucketed, overlapped
    FullyShardedDataParallel(cp_model, process_group=group)   minifsdp.fsdp: sharded over the same ranks

With data parallel as well, reduce over the dp x cp group (every rank of both:
torchtitan's ``dp_shard_cp`` mesh dimension, whose FSDP shards over dp and cp
together): the cp ranks of one sample and the dp ranks of other samples all
average alike. Data side: every rank of a cp group reads the *same* batch and
keeps its share, ``shard_sequence(x, cp, cp_rank, split)`` for the ids and the
targets alike.

    >>> cp_model = context_parallel_gpt(build_model("gpt-tiny"), group, "zigzag")   # doctest: +SKIP
    >>> x_local = shard_sequence(x, cp, cp_rank, "zigzag")                           # doctest: +SKIP
    >>> loss = cp_model.loss(cp_model(x_local), shard_sequence(y, cp, cp_rank, "zigzag"))  # doctest: +SKIP
    >>> loss.backward(); all_reduce_gradients(cp_model, group); optimizer.step()    # doctest: +SKIP

Dropout must be 0 (ring attention has no dropout; per-rank random streams are
not built), and the attention mask must be the causal one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup, ReduceOp

from .. import comm, dist, models
from .ring_attention import ring_attention
from .split import SPLITS, check_sequence_length, sequence_positions

__all__ = ["ContextParallelAttention", "ContextParallelBlock", "ContextParallelGPT", "context_parallel_gpt",
           "check_context_parallel", "all_reduce_gradients", "global_loss"]


class ContextParallelAttention(nn.Module):
    """``CausalSelfAttention`` on this rank's share: local projections, ring attention between them."""

    def __init__(self, full: models.CausalSelfAttention, group: ProcessGroup | None, split: str,
                 label: str | None = None) -> None:
        super().__init__()
        self.c_attn, self.c_proj = full.c_attn, full.c_proj  # shared with the full model
        self.head_dim = full.n_embd // full.n_head
        self.group, self.split, self.label = group, split, label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_local, _ = x.shape
        qkv = self.c_attn(x)
        h = qkv.shape[-1] // (3 * self.head_dim)  # from the shape, as models.causal_attention (tensor parallel)
        q, k, v = (t.view(B, T_local, h, self.head_dim).transpose(1, 2) for t in qkv.split(h * self.head_dim, 2))
        y = ring_attention(q, k, v, self.group, self.split, label=self.label)   # (B, h, T/cp, head_dim)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T_local, h * self.head_dim))


class ContextParallelBlock(nn.Module):
    """``models.Block`` with ring attention; the layer norms and the MLP are the block's own."""

    def __init__(self, full: models.Block, group: ProcessGroup | None, split: str, label: str | None = None) -> None:
        super().__init__()
        self.ln_1, self.ln_2, self.mlp = full.ln_1, full.ln_2, full.mlp
        self.attn = ContextParallelAttention(full.attn, group, split, label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ContextParallelGPT(nn.Module):
    """``forward(idx_local[B, T/cp]) -> logits_local[B, T/cp, V]`` for this rank's share of the sequence."""

    def __init__(self, full: models.GPT, group: ProcessGroup | None = None, split: str = "zigzag") -> None:
        super().__init__()
        check_context_parallel(full, split)
        dist.require_group(group, "context_parallel_gpt's cp_group")
        self.config, self.group, self.split = full.config, group, split
        self.cp, self.cp_rank = dist.world_size(group), dist.rank(group)
        self.tok_emb, self.pos_emb, self.ln_f, self.head = full.tok_emb, full.pos_emb, full.ln_f, full.head
        self.blocks = nn.ModuleList(ContextParallelBlock(b, group, split, label=f"blocks.{i}.attn")
                                    for i, b in enumerate(full.blocks))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1] * self.cp  # the whole sequence's length
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} (cp={self.cp} shares of {idx.shape[-1]}) exceeds "
                             f"block_size={self.config.block_size}; use shorter sequences or a larger block_size")
        check_sequence_length(T, self.cp, self.split)
        pos = sequence_positions(T, self.cp, self.cp_rank, self.split, device=idx.device)  # global positions
        h = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    @staticmethod
    def loss(logits_local: torch.Tensor, targets_local: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of this rank's positions (``global_loss`` averages it over the group)."""
        return models.lm_loss(logits_local, targets_local)


def check_context_parallel(model: nn.Module, split: str) -> None:
    """One-line errors, naming the fix, for a model ring attention cannot run."""
    if not isinstance(model, models.GPT):
        raise TypeError(f"context_parallel_gpt takes a minifsdp.models.GPT, got {type(model).__name__}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (zig-zag balances the causal mask), got {split!r}")
    if model.config.n_expert:  # each rank would balance its experts over its chunk, not the whole sequence
        raise ValueError(f"context parallel is built for dense GPTs, and this one has n_expert="
                         f"{model.config.n_expert}: its load-balancing loss needs whole sequences; use a dense model "
                         "(gpt-tiny, gpt-small) or train this one with expert parallel (expert_parallel_gpt)")
    if model.config.dropout > 0:
        raise ValueError(f"context parallel here needs dropout=0 (got {model.config.dropout}): ring attention has "
                         "no dropout and per-rank random streams are not built")
    for i, block in enumerate(model.blocks):
        mask = block.attn.future_mask
        if not torch.equal(mask.cpu(), models._future_mask(mask.shape[0])):
            raise ValueError(f"blocks.{i}.attn has a non-causal mask: ring attention computes the causal mask only "
                             "(its chunk-pair rule and the zig-zag balance are the causal mask's); keep the causal "
                             "mask or train this model without context parallelism (cp=1)")


def context_parallel_gpt(model: models.GPT, cp_group: ProcessGroup | None = None,
                         split: str = "zigzag") -> ContextParallelGPT:
    """This rank's context-parallel view of ``model`` (same parameters) over ``cp_group`` (default: the world)."""
    return ContextParallelGPT(model, cp_group, split)


@torch.no_grad()
def all_reduce_gradients(module: nn.Module, group: ProcessGroup | None = None) -> None:
    """Average every parameter's gradient over ``group`` (the cp group, or dp x cp), in one flat all-reduce."""
    if dist.world_size(group) > 1:
        comm.all_reduce_flat([p.grad for p in module.parameters() if p.grad is not None], group, average=True)


@torch.no_grad()
def global_loss(local_loss: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The whole sequence's mean loss (for logging): the average of the group's local mean losses."""
    out = local_loss.detach().clone()
    comm.all_reduce(out, ReduceOp.SUM, group=group)
    return out / dist.world_size(group)
