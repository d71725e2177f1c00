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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "CausalSelfAttention",
    "causal_attention",
    "FeedForward",
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

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if min(self.n_layer, self.n_head, self.n_embd, self.block_size, self.vocab_size) < 1:
            raise ValueError(f"every size in {self} must be positive")


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


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).

    The unit that wrap policies (``transformer_auto_wrap_policy``) and
    activation checkpointing target.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

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
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence."""
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
