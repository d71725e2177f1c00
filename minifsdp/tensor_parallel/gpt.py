"""``models.GPT`` split across a model-parallel group (Megatron-LM), with optional sequence parallel.

Layer 5 (techniques). ``tensor_parallel_gpt(model)`` returns a ``ParallelGPT``
holding this rank's slices of ``model``'s weights, so its losses and gradients
are the single-process model's (tests/test_tensor_parallel.py):

    tok_emb   VocabParallelEmbedding        rows of the vocabulary          g: all-reduce fwd
    pos_emb   replicated
    per block:
      ln_1    replicated
      attn    c_attn ColumnParallelLinear   whole heads per rank (stride 3: q, k, v slices)
              c_proj RowParallelLinear      f/g: 1 all-reduce fwd, 1 bwd
      ln_2    replicated
      mlp     c_fc   ColumnParallelLinear   4d/tp hidden units per rank
              c_proj RowParallelLinear      f/g: 1 all-reduce fwd, 1 bwd
    ln_f      replicated
    head      ColumnParallelLinear(gather_output=False) -> logits (B, T, V/tp)
    loss      vocab_parallel_cross_entropy  (the full logits never exist)

Per block: 2 all-reduces of ``b*s*h`` elements forward and 2 backward.

Sequence parallel (Korthikanti et al. 2022, ``sequence_parallel=True``): the
layer norms (and the residual stream around them) work on this rank's ``T/tp``
positions, so their activations are ``1/tp`` the size. Entering attention or
the MLP, an all-gather of the sequence replaces f (its backward is a
reduce-scatter); leaving, a reduce-scatter replaces g (backward all-gather).
The same bytes as the all-reduces, since ``all_reduce = reduce_scatter +
all_gather``. The layer norms' weights and the row-parallel biases now see
only some positions, so their gradients are summed over the group (f on the
parameter: one small all-reduce each, backward).

Dropout must be 0: a tensor-parallel dropout needs per-region random streams
(Megatron's RNG tracker), which minifsdp does not build.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import models
from .cross_entropy import vocab_parallel_cross_entropy
from .initialize import get_model_parallel_world_size
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, divide
from .mappings import copy_to_model_parallel_region, scatter_to_sequence_parallel_region

__all__ = ["ParallelAttention", "ParallelMLP", "ParallelBlock", "ParallelGPT", "tensor_parallel_gpt",
           "check_divisible", "local_slices"]


class _LayerNorm(nn.Module):
    """A replicated LayerNorm; under sequence parallel its gradients are summed over the group."""

    def __init__(self, full: nn.LayerNorm, sequence_parallel: bool) -> None:
        super().__init__()
        self.normalized_shape, self.eps = full.normalized_shape, full.eps
        self.weight = nn.Parameter(full.weight.detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:  # this rank's positions only: all-reduce the gradient (f)
            w = copy_to_model_parallel_region(w)
            b = copy_to_model_parallel_region(b) if b is not None else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class ParallelAttention(nn.Module):
    """Causal self-attention with ``n_head / tp`` heads on each rank."""

    def __init__(self, full: models.CausalSelfAttention, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = get_model_parallel_world_size()
        self.n_head_local = divide(full.n_head, tp, "n_head")
        self.head_dim = full.n_embd // full.n_head
        self.c_attn = ColumnParallelLinear.from_linear(full.c_attn, stride=3, gather_output=False,
                                                       sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear.from_linear(full.c_proj, input_is_parallel=True,
                                                    sequence_parallel=sequence_parallel)
        self.register_buffer("future_mask", full.future_mask.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)                            # (B, T, 3 * d/tp): [q_r, k_r, v_r]
        y = models.causal_attention(qkv, self.head_dim, self.future_mask)  # this rank's heads
        return self.c_proj(y)


class ParallelMLP(nn.Module):
    """d -> 4d/tp -> d on each rank: column- then row-parallel, one all-reduce forward."""

    def __init__(self, full: models.FeedForward, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear.from_linear(full.c_fc, gather_output=False,
                                                     sequence_parallel=sequence_parallel)
        self.c_proj = RowParallelLinear.from_linear(full.c_proj, input_is_parallel=True,
                                                    sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class ParallelBlock(nn.Module):
    def __init__(self, full: models.Block, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ln_1 = _LayerNorm(full.ln_1, sequence_parallel)
        self.attn = ParallelAttention(full.attn, sequence_parallel)
        self.ln_2 = _LayerNorm(full.ln_2, sequence_parallel)
        self.mlp = ParallelMLP(full.mlp, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelGPT(nn.Module):
    """``forward(idx[B, T]) -> logits[B, T, V/tp]`` (this rank's vocabulary slice); ``loss`` is
    the mean vocab-parallel cross-entropy."""

    def __init__(self, full: models.GPT, sequence_parallel: bool = False) -> None:
        super().__init__()
        config = full.config
        check_divisible(config, get_model_parallel_world_size())
        self.config, self.sequence_parallel = config, sequence_parallel
        self.tok_emb = VocabParallelEmbedding.from_embedding(full.tok_emb)
        self.pos_emb = nn.Embedding.from_pretrained(full.pos_emb.weight.detach().clone(), freeze=False)
        self.blocks = nn.ModuleList(ParallelBlock(b, sequence_parallel) for b in full.blocks)
        self.ln_f = _LayerNorm(full.ln_f, sequence_parallel)
        self.head = ColumnParallelLinear.from_linear(full.head, gather_output=False,
                                                     sequence_parallel=sequence_parallel)
        if config.tie_embeddings:  # both hold vocabulary rows [r*V/tp, (r+1)*V/tp): tie the slices
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        h = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        if self.sequence_parallel:
            tp = get_model_parallel_world_size()
            if T % tp:
                raise ValueError(f"sequence parallel splits the sequence: length {T} is not divisible by tp={tp}; "
                                 f"use a sequence length that is a multiple of {tp}")
            h = scatter_to_sequence_parallel_region(h)   # (B, T/tp, d) from here to the head
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    @staticmethod
    def loss(logits_parallel: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, as ``models.lm_loss``, from this rank's logits slice."""
        return vocab_parallel_cross_entropy(logits_parallel, targets).mean()


def check_divisible(config: models.GPTConfig, tp: int, seq_len: int | None = None,
                    sequence_parallel: bool = False) -> None:
    """One-line errors, naming the fix, for a GPT that cannot be split ``tp`` ways."""
    for name, n in (("n_head", config.n_head), ("n_embd (hidden size)", config.n_embd),
                    ("vocab_size", config.vocab_size)):
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by tp={tp}; choose a tp that divides {n}")
    if config.dropout > 0:
        raise ValueError(f"tensor parallel here needs dropout=0 (got {config.dropout}): per-region random "
                         "streams are not built")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallel splits the sequence: length {seq_len} is not divisible by tp={tp}; "
                         f"use a sequence length that is a multiple of {tp}")


def tensor_parallel_gpt(model: models.GPT, sequence_parallel: bool = False) -> ParallelGPT:
    """This rank's tensor-parallel copy of ``model`` (call ``initialize_model_parallel`` first)."""
    if not isinstance(model, models.GPT):
        raise TypeError(f"tensor_parallel_gpt takes a minifsdp.models.GPT, got {type(model).__name__}")
    if model.config.n_expert:  # ParallelMLP splits a FeedForward; a MoE layer has none to split
        raise ValueError(f"tensor parallel is built for dense GPTs, and this one has n_expert={model.config.n_expert}; "
                         "use a dense model (gpt-tiny, gpt-small) or split the experts with expert_parallel_gpt")
    return ParallelGPT(model, sequence_parallel)


def local_slices(parallel: nn.Module, full: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """For every parameter of ``parallel`` (a tensor-parallel copy), the matching slice of ``full``'s
    parameter (or of its gradient with ``grads=True``): what this rank should hold."""
    from .layers import _local_slice

    full_params = dict(full.named_parameters())
    owners = {id(p): m for m in parallel.modules() for p in m.parameters(recurse=False)}
    out = {}
    for name, p in parallel.named_parameters():
        ref = full_params[name].grad if grads else full_params[name].detach()
        owner, leaf = owners[id(p)], name.rsplit(".", 1)[-1]
        if isinstance(owner, (ColumnParallelLinear, VocabParallelEmbedding)):
            ref = _local_slice(ref, 0, getattr(owner, "stride", 1))
        elif isinstance(owner, RowParallelLinear) and leaf == "weight":
            ref = _local_slice(ref, 1)
        out[name] = ref
    return out
