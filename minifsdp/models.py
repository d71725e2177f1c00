"""Workload models: a small GPT and a toy MLP, both plain ``torch.nn``.

Layer 4 (leaves): no ``torch.distributed`` here. Every technique in minifsdp
(DDP, ZeRO, FSDP, pipeline, tensor parallel) is checked against these models
run in a single process, so they must be deterministic and easy to cut apart.

``GPT`` follows the GPT-2 architecture (Radford et al. 2019) in the shape
popularised by Karpathy's nanoGPT: learned token and position embeddings, a
stack of pre-LayerNorm transformer ``Block``s, a final LayerNorm and a
vocabulary projection. Differences from nanoGPT, each for a lesson:

* the attributes are ``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f``, ``head``
  so pipeline stages can take ``embed`` / ``blocks[i:j]`` / ``unembed``;
* ``forward`` returns logits only; the loss is the module-level ``lm_loss``,
  so a pipeline's last stage and a vocab-parallel loss can replace it;
* attention is an explicit ``softmax(q k^T / sqrt(d_h) + mask) v``, one
  function (``causal_attention``) that the tensor-parallel models call on
  their share of the heads. It is deterministic on CPU, and it keeps the
  B*h*T*T attention probabilities as a visible saved tensor, which is what
  ``estimate.gpt_activation_bytes`` counts (a fused
  ``scaled_dot_product_attention`` would hide them);
* the causal mask is a non-persistent buffer (absent from state dicts).

Parameter count, worked example for ``gpt-tiny`` (V=256, d=32, L=2, block 32):
token embedding V*d = 8192, position embedding 32*d = 1024, each block
12*d^2 + 13*d = 12704 (two LayerNorms 4d, qkv 3d^2+3d, attention projection
d^2+d, MLP 4d^2+4d and 4d^2+d), final LayerNorm 2d = 64, head V*d = 8192
(no bias, like GPT-2): 8192 + 1024 + 2*12704 + 64 + 8192 = 42880.

Mixture of experts (``n_expert > 0``; presets ``gpt-moe-tiny``, ``gpt-moe-small``):
every ``moe_every``-th block's MLP becomes a ``MoE`` layer, a router (Linear
d -> E, no bias) sending each token to ``top_k`` of ``n_expert`` FeedForwards.
``gpt-moe-tiny`` (gpt-tiny with E=8, k=2, block 1 of 0-1 a MoE block): the MoE
block holds 4d + 4d^2+4d (attention) + E*d (router) + E*(8d^2+5d) = 128 + 4224 +
256 + 8*8352 = 71424, so 8192 + 1024 + 12704 + 71424 + 64 + 8192 = 101600.
The load-balancing loss is ``model.aux_loss()``: train on
``lm_loss(model(x), y) + model.aux_loss()``. ``minifsdp.expert_parallel``
spreads the experts over ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "CausalSelfAttention",
    "causal_attention",
    "FeedForward",
    "MoE",
    "top_k_routing",
    "load_balancing_loss",
    "expert_capacity",
    "capacity_mask",
    "Block",
    "GPT",
    "ToyMLP",
    "lm_loss",
    "MODEL_PRESETS",
    "MLP_PRESETS",
    "build_model",
    "init_weights",
    "count_parameters",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``vocab_size=256`` matches the byte tokenizer in data.py."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # longest sequence the position embedding covers
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2 has them)
    tie_embeddings: bool = False  # head.weight is tok_emb.weight (GPT-2 ties)
    # Mixture of experts (class MoE). n_expert=0: every block has one dense MLP, as GPT-2.
    n_expert: int = 0  # E experts in each MoE block
    top_k: int = 2  # experts per token (k)
    moe_every: int = 2  # blocks moe_every-1, 2*moe_every-1, ... are MoE (2: every other block, GShard/Switch)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Switch Transformer's alpha)
    capacity_factor: float | None = None  # None: dropless; else expert_capacity() per expert per sequence

    def __post_init__(self) -> None:
        sizes = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
        bad = [f"{name}={getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        if bad:
            raise ValueError(f"GPTConfig sizes must be positive integers, got {', '.join(bad)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head} (each head gets "
                             f"n_embd / n_head features); choose n_head among {_divisors(self.n_embd)}")
        if not 0.0 <= self.dropout < 1.0:  # nn.Dropout would refuse it later, inside the model's constructor
            raise ValueError(f"dropout={self.dropout} must be in [0, 1): the probability of zeroing an activation")
        if self.n_expert < 0:
            raise ValueError(f"n_expert={self.n_expert} must be >= 0 (0: a dense GPT, every block one MLP)")
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be >= 1 (1: every block a MoE, 2: every other block)")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_expert={self.n_expert} (a token picks k "
                             f"distinct experts); choose top_k <= {self.n_expert} or more experts")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0, or None for dropless routing")

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` has a ``MoE`` layer instead of a FeedForward (the last of every ``moe_every``)."""
        return self.n_expert > 0 and (i + 1) % self.moe_every == 0


def _divisors(n: int) -> list[int]:
    """The head counts that split ``n`` features evenly (for the error message)."""
    return [d for d in range(1, n + 1) if n % d == 0]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection.

    Names follow Megatron-LM's split for tensor parallelism: ``c_attn`` is
    column-parallel (its 3*d output features split across ranks, so each rank
    owns whole heads) and ``c_proj`` is row-parallel (its d input features
    split, outputs summed by an all-reduce).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # True above the diagonal: position i must not see j > i. Stored in
        # the "blocked" sense so masked_fill gets a view of the buffer rather
        # than a fresh ~mask tensor that autograd would have to save.
        # Non-persistent: a derived constant has no business in a checkpoint.
        self.register_buffer("future_mask", _future_mask(config.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        y = causal_attention(self.c_attn(x), self.n_embd // self.n_head, self.future_mask, dropout)
        y = self.c_proj(y)
        if dropout > 0.0:
            y = F.dropout(y, p=dropout)
        return y


def causal_attention(
    qkv: torch.Tensor, head_dim: int, future_mask: torch.Tensor, dropout: float = 0.0
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d_h) + mask) v`` for every head in ``qkv``, heads side by side.

    ``qkv`` is ``(B, T, 3 * h * head_dim)``, laid out ``[q; k; v]`` with each of
    the three holding ``h`` heads of ``head_dim`` features: the output of
    ``CausalSelfAttention.c_attn``, or of a tensor-parallel rank's slice of it
    (``h = n_head / tp``), which is why ``h`` is read from the shape. Returns
    ``(B, T, h * head_dim)``, the input of ``c_proj``. ``future_mask`` is the
    blocked-above-the-diagonal buffer (``_future_mask``); ``dropout`` is applied
    to the probabilities (pass 0.0 outside training).

    The one attention forward of minifsdp: the full model, the tensor-parallel
    model (``tensor_parallel/gpt.py``) and torch's DTensor tensor parallel
    (``tensor_parallel/torch_tp.py``) all call it, so their parity is a
    statement about the split, not about three copies of the math.
    """
    B, T, three_local = qkv.shape
    h = three_local // (3 * head_dim)
    # (B, T, h * hd) -> (B, h, T, hd): each head attends independently.
    q, k, v = (t.view(B, T, h, head_dim).transpose(1, 2) for t in qkv.split(h * head_dim, dim=2))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
    scores = scores.masked_fill(future_mask[:T, :T], float("-inf"))
    probs = F.softmax(scores, dim=-1)
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout)
    y = probs @ v
    return y.transpose(1, 2).contiguous().view(B, T, h * head_dim)  # heads side by side


class FeedForward(nn.Module):
    """Position-wise MLP, d -> 4d -> d with GELU (Megatron: c_fc column-,
    c_proj row-parallel, so the 4d hidden activation never needs a gather)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.dropout = config.dropout
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c_proj(self.gelu(self.c_fc(x)))
        if self.dropout > 0.0 and self.training:
            y = F.dropout(y, p=self.dropout)
        return y


def top_k_routing(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs, expert_idx, weights)``: the router's softmax, each token's k experts and their mixing weights.

    ``logits`` is ``(..., E)``; ``expert_idx`` and ``weights`` are ``(..., k)``, best expert first. With
    k > 1 the k probabilities are renormalised to sum to 1 (Mixtral; GShard's top-2); with k = 1 the weight
    is the raw probability (Switch Transformer: a renormalised single weight is always 1, and the router
    would then learn from the auxiliary loss alone).

    >>> probs, idx, w = top_k_routing(torch.tensor([0.1, 0.5, 0.3, 0.1]).log(), 2)
    >>> idx.tolist(), [round(v, 3) for v in w.tolist()]     # 0.5 / 0.8 and 0.3 / 0.8
    ([1, 2], [0.625, 0.375])
    """
    probs = F.softmax(logits, dim=-1)
    weights, expert_idx = probs.topk(k, dim=-1)
    if k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, expert_idx, weights


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
    """Switch / GShard load-balancing loss, one group per sequence, averaged over sequences: 1.0 when balanced.

    ``probs`` ``(..., T, E)``, ``expert_idx`` ``(..., T, k)``. For each sequence (GShard's *group*, Lepikhin
    et al. 2020, Algorithm 1) of T tokens: ``f_e`` = the fraction of its T*k assignments that went to
    expert e (counted: no gradient), ``P_e`` = the mean router probability of e, loss = ``E * sum_e f_e P_e``
    (Fedus et al. 2021, eq. 4; Megatron divides the counts by k as here). The gradient reaches the router
    through P and lowers the probability of the experts that get more than their share. Per sequence, not
    per batch, so any split of a batch into whole sequences (data / expert parallel ranks, micro-batches)
    averages to the same number.

    Worked example, E = 2, k = 1, one sequence of two tokens with probs [0.8, 0.2] and [0.7, 0.3]: both go
    to expert 0, f = [1, 0], P = [0.75, 0.25], loss = 2 * 0.75 = 1.5; with [0.8, 0.2] and [0.4, 0.6]:
    f = [0.5, 0.5], P = [0.6, 0.4], loss = 2 * (0.3 + 0.2) = 1.0.
    """
    E, T, k = probs.shape[-1], probs.shape[-2], expert_idx.shape[-1]
    f = F.one_hot(expert_idx, E).sum(dim=(-3, -2)).to(probs.dtype) / (T * k)   # (..., E)
    P = probs.mean(dim=-2)                                                    # (..., E)
    return E * (f * P).sum(dim=-1).mean()


def expert_capacity(tokens: int, k: int, n_expert: int, capacity_factor: float) -> int:
    """Most assignments an expert takes from one sequence of ``tokens``: ``ceil(cf * tokens * k / E)``.

    The factor is read as written (``Fraction(str(cf))``: in floats 1.1 * 10 is 11.000000000000002).

    >>> expert_capacity(16, 2, 8, 1.0), expert_capacity(16, 2, 8, 1.25), expert_capacity(10, 1, 1, 1.1)
    (4, 5, 11)
    """
    return math.ceil(Fraction(str(capacity_factor)) * tokens * k / n_expert)


def capacity_mask(expert_idx: torch.Tensor, n_expert: int, capacity: int) -> torch.Tensor:
    """Which assignments fit: each expert keeps its first ``capacity`` of every sequence, in position order.

    ``expert_idx`` ``(..., T, k)`` -> ``keep`` of the same shape. Order: token t before token t+1, and a
    token's slots best first (Megatron-LM's ``moe_token_drop_policy="position"``). A dropped assignment
    contributes nothing; the block's residual carries its token on. Deterministic: it depends on the
    routing only. Worked example, E = 2, k = 1, capacity 2, experts [0, 0, 1, 0] -> keep [T, T, T, F]
    (expert 0's third token is dropped).
    """
    *lead, T, k = expert_idx.shape
    onehot = F.one_hot(expert_idx.reshape(*lead, T * k), n_expert)      # (..., T*k, E)
    place = (onehot.cumsum(dim=-2) * onehot).sum(dim=-1)                # 1-based place in its expert's queue
    return (place <= capacity).view(*lead, T, k)


class MoE(nn.Module):
    """Mixture of experts in place of the MLP: each token goes to ``top_k`` of ``n_expert`` FeedForwards.

        x (B, T, d) -> router Linear(d, E) -> softmax -> top-k experts, weights  (top_k_routing)
        y_t = sum over t's kept assignments (e, w) of  w * expert_e(x_t)

    Worked example, E = 4, k = 2, two tokens with router probabilities [0.1, 0.5, 0.3, 0.1] and
    [0.4, 0.1, 0.1, 0.4]: token 0 goes to experts 1 and 2 with weights 0.625 and 0.375, token 1 to 0 and 3
    with 0.5 each; so expert 0 sees token 1, expert 1 token 0, expert 2 token 0, expert 3 token 1, and
    ``y_0 = 0.625 expert_1(x_0) + 0.375 expert_2(x_0)``. Each expert runs once, on its tokens only:
    2 of the 4 experts' FLOPs per token, 4 experts' parameters.

    ``capacity_factor`` (None: dropless) caps each expert at ``expert_capacity`` assignments per sequence
    (``capacity_mask``). After each forward the layer holds ``aux_loss`` (``aux_loss_coef`` times
    ``load_balancing_loss``; ``GPT.aux_loss()`` sums them), ``tokens_per_expert`` (E,) (assignments the
    router asked for) and ``dropped_per_expert`` (E,) (those over capacity).

    ``apply_experts`` is the one step ``expert_parallel.ExpertParallelMoE`` replaces (experts on other
    ranks); the routing above stays replicated there.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_expert, self.top_k = config.n_expert, config.top_k
        self.aux_loss_coef, self.capacity_factor = config.aux_loss_coef, config.capacity_factor
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts: nn.Module = nn.ModuleList(FeedForward(config) for _ in range(config.n_expert))
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        probs, expert_idx, weights = top_k_routing(self.router(x), self.top_k)   # (B,T,E), (B,T,k), (B,T,k)
        self.aux_loss = self.aux_loss_coef * load_balancing_loss(probs, expert_idx)
        if self.capacity_factor is None:
            keep = torch.ones_like(expert_idx, dtype=torch.bool)
        else:
            capacity = expert_capacity(T, self.top_k, self.n_expert, self.capacity_factor)
            keep = capacity_mask(expert_idx, self.n_expert, capacity)
        self.tokens_per_expert = torch.bincount(expert_idx.reshape(-1), minlength=self.n_expert)
        self.dropped_per_expert = torch.bincount(expert_idx[~keep], minlength=self.n_expert)
        # The kept assignments as three flat lists, token by token (a token's slots best first).
        token = torch.arange(B * T, device=x.device).repeat_interleave(self.top_k)
        keep = keep.reshape(-1)
        y = self.apply_experts(x.reshape(B * T, d), token[keep], expert_idx.reshape(-1)[keep],
                               weights.reshape(-1)[keep])
        return y.view(B, T, d)

    def apply_experts(self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum of weight[i] * experts[expert[i]](x[t])`` over the assignments i with ``token[i] == t``.

        ``x`` ``(N, d)``; ``token``, ``expert``, ``weight`` ``(M,)``, one entry per kept assignment. The
        readable loop: each expert gathers its tokens, runs once on them, and adds its weighted output back.
        """
        out = x.new_zeros(x.shape)
        for e, ffn in enumerate(self.experts):
            mine = expert == e                  # this expert's assignments, in token order
            rows = token[mine]
            out = out.index_add(0, rows, (ffn(x[rows]) * weight[mine, None]).to(out.dtype))
        return out


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).

    The unit that wrap policies (``transformer_auto_wrap_policy``) and
    activation checkpointing target. ``moe=True``: ``mlp`` is a ``MoE`` layer.
    """

    def __init__(self, config: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp: nn.Module = MoE(config) if moe else FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2-style language model: ``forward(idx[B, T]) -> logits[B, T, V]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, config.is_moe_block(i)) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # No bias on the vocabulary projection, as in GPT-2; tying then shares
        # exactly one tensor between the first and the last layer.
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``head.weight`` with ``tok_emb.weight`` if the config asks.

        Called again by ``init_weights``: ``Module.to_empty`` (deferred init
        from the meta device) gives each module its own new tensor and so
        silently unties them.
        """
        if self.config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embedding: ``[B, T]`` ids -> ``[B, T, d]``."""
        T = idx.shape[-1]
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}; "
                "use shorter sequences or build the model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)
        h = self.tok_emb(idx) + self.pos_emb(pos)
        if self.config.dropout > 0.0 and self.training:
            h = F.dropout(h, p=self.config.dropout)
        return h

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and vocabulary projection: ``[B, T, d] -> [B, T, V]``."""
        return self.head(self.ln_f(h))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.unembed(h)

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing losses of the last forward, summed over MoE layers (each already times
        ``aux_loss_coef``); 0 for a dense GPT. Train on ``lm_loss(model(x), y) + model.aux_loss()``."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE) and m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else self.head.weight.new_zeros(())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence (a MoE GPT adds
    ``model.aux_loss()``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ToyMLP(nn.Module):
    """A tiny multi-layer perceptron whose numbers can be checked by hand.

    ``ToyMLP(dims=(8, 16, 16, 4))`` is Linear(8,16) -> act -> Linear(16,16)
    -> act -> Linear(16,4); the layers live in ``self.layers`` (a ModuleList
    of ``nn.Linear``) so wrap policies and sharding lessons can point at them.
    """

    def __init__(
        self, dims: Sequence[int] = (8, 16, 16, 4), activation: str = "relu", bias: bool = True
    ) -> None:
        super().__init__()
        dims = tuple(int(d) for d in dims)
        if len(dims) < 2 or min(dims) < 1:
            raise ValueError(f"dims needs at least two positive sizes, got {dims}")
        acts = {"relu": nn.ReLU, "tanh": nn.Tanh}
        if activation not in acts:
            raise ValueError(f"activation must be one of {sorted(acts)}, got {activation!r}")
        self.dims = dims
        self.layers = nn.ModuleList(
            nn.Linear(i, o, bias=bias) for i, o in zip(dims[:-1], dims[1:])
        )
        self.act = acts[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:  # no activation after the output layer
                x = self.act(x)
        return x


def _future_mask(n: int) -> torch.Tensor:
    """``mask[i, j]`` is True where position i may NOT attend to j (j > i)."""
    return torch.ones(n, n, dtype=torch.bool).triu(1)


MODEL_PRESETS: dict[str, GPTConfig] = {
    # Unit tests and multi-rank parity checks: milliseconds per step.
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
    # Labs: big enough that communication and memory show up (~3.3M params).
    "gpt-mini": GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64),
    # Benchmarks and demos (~10.9M params).
    "gpt-small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128),
    # Mixture of experts: the two above with every other MLP replaced by 8 experts, top-2 (Mixtral's k).
    "gpt-moe-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, n_expert=8, top_k=2),
    "gpt-moe-small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=128, n_expert=8, top_k=2),
}

MLP_PRESETS: dict[str, dict[str, Any]] = {
    "mlp": {"dims": (8, 16, 16, 4), "activation": "relu", "bias": True},
}


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """(Re)initialise ``model`` in place from ``seed`` alone; returns it.

    Uses a private ``torch.Generator`` and visits parameters in
    ``named_parameters()`` order, so the same seed gives bit-identical weights
    in every process and the caller's global RNG state is left alone. Works
    after ``model.to_empty(device=...)`` of a meta-device model (deferred
    init), and also refills the causal-mask buffers that ``to_empty`` leaves
    uninitialised.

    GPT: GPT-2's scheme - N(0, 0.02) for Linear and Embedding weights, zero
    biases, LayerNorm weight 1 and bias 0, and the two residual projections
    (``c_proj``) scaled by 1/sqrt(2 * n_layer) (GPT-2 paper, section 2.3),
    since each block adds two outputs to the residual stream.
    Other models (ToyMLP): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for Linear
    weights and biases, the distribution ``nn.Linear`` uses; N(0, 0.02) else.
    """
    if isinstance(model, GPT):
        model.tie_weights()
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    config = getattr(model, "config", None)
    n_layer = config.n_layer if isinstance(config, GPTConfig) else None
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():
        owner = owners[id(p)]
        # Draw on CPU with the private generator, then copy: identical values
        # whatever device the model lives on.
        if isinstance(owner, nn.LayerNorm):
            value = torch.ones(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
        elif n_layer is not None:
            if name.endswith("bias"):
                value = torch.zeros(p.shape)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                value = torch.empty(p.shape).normal_(0.0, std, generator=gen)
        elif isinstance(owner, nn.Linear):
            bound = 1.0 / math.sqrt(owner.in_features)
            value = torch.empty(p.shape).uniform_(-bound, bound, generator=gen)
        else:
            value = torch.empty(p.shape).normal_(0.0, 0.02, generator=gen)
        p.copy_(value.to(p.dtype))
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.future_mask.copy_(_future_mask(m.future_mask.shape[0]))
    return model


def build_model(
    name: str, seed: int = 0, *, device: torch.device | str = "cpu", **overrides: Any
) -> nn.Module:
    """Build a preset model with deterministic weights.

    ``name`` is a key of ``MODEL_PRESETS`` (GPT) or ``MLP_PRESETS``;
    ``overrides`` replace config fields (``build_model("gpt-tiny", n_layer=4)``,
    ``build_model("mlp", dims=(8, 4))``). ``device="meta"`` returns an
    uninitialised model for deferred init: call ``model.to_empty(device=...)``
    and then ``init_weights(model, seed)``.
    """
    device = torch.device(device)
    if name in MODEL_PRESETS:
        try:
            config = dataclasses.replace(MODEL_PRESETS[name], **overrides)
        except TypeError as e:
            fields = [f.name for f in dataclasses.fields(GPTConfig)]
            raise ValueError(f"bad override for {name!r} ({e}); GPTConfig fields: {fields}") from None
        make = lambda: GPT(config)  # noqa: E731
    elif name in MLP_PRESETS:
        kwargs = {**MLP_PRESETS[name], **overrides}
        unknown = set(kwargs) - {"dims", "activation", "bias"}
        if unknown:
            raise ValueError(f"bad override(s) {sorted(unknown)} for {name!r}; use dims, activation, bias")
        make = lambda: ToyMLP(**kwargs)  # noqa: E731
    else:
        valid = sorted(MODEL_PRESETS) + sorted(MLP_PRESETS)
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(valid)}")
    # Build on the meta device (no memory, no RNG draws), then materialise and
    # initialise from the seed: fast, and the caller's RNG is never touched.
    with torch.device("meta"):
        model = make()
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    return init_weights(model, seed)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    # named_parameters() already de-duplicates shared tensors by identity.
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
