"""Cut a GPT into pipeline stages: by a ``balance`` list (torchgpipe) or by parameter count.

A GPT is a sequence of ``n_layer + 2`` layers: the embedding (token +
position), the blocks, and the head (final LayerNorm + vocabulary
projection). ``balance=[2, 2]`` gives the first two layers to stage 0 and
the next two to stage 1, as in torchgpipe's ``GPipe(model, balance=...)``::

    gpt-tiny (2 blocks): [embed, block 0, block 1, head]
    balance [2, 2]   ->  stage 0: embed, block 0      stage 1: block 1, head

Without a balance, ``balance_by_params`` picks the contiguous cut that makes
the largest stage smallest (each layer weighs its parameter count; the
embedding and the head are large in a small GPT, so they often get a stage
to themselves). A stage keeps its layers under their original names
(``blocks.3.attn.c_attn.weight``), so its gradients and state dict line up
with the whole model's name for name.
"""

from __future__ import annotations

from torch import nn

from .. import models

__all__ = ["GPTStage", "gpt_layers", "balance_by_params", "split_gpt"]


class GPTStage(nn.Module):
    """Layers ``[lo, hi)`` of ``gpt_layers(model)``, sharing the model's modules (no copy)."""

    def __init__(self, model: models.GPT, lo: int, hi: int) -> None:
        super().__init__()
        n = len(model.blocks)
        self.config = model.config
        self.has_embed, self.has_head = lo == 0, hi == n + 2
        if self.has_embed:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        # ModuleDict keyed by the block's index keeps the name "blocks.<j>...".
        self.blocks = nn.ModuleDict({str(j): model.blocks[j] for j in range(max(lo - 1, 0), min(hi - 1, n))})
        if self.has_head:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x):
        # GPT.embed / GPT.unembed read only config, tok_emb, pos_emb, ln_f, head and
        # self.training, which this stage has under the same names: reuse, don't copy.
        h = models.GPT.embed(self, x) if self.has_embed else x
        for block in self.blocks.values():
            h = block(h)
        return models.GPT.unembed(self, h) if self.has_head else h


def gpt_layers(model: models.GPT) -> list[tuple[str, int]]:
    """``[(name, parameter count)]`` of the layers a GPT is cut between."""
    def count(*mods: nn.Module) -> int:
        return sum(p.numel() for m in mods for p in m.parameters())
    return ([("embed", count(model.tok_emb, model.pos_emb))]
            + [(f"blocks.{j}", count(b)) for j, b in enumerate(model.blocks)]
            + [("head", count(model.ln_f, model.head))])


def balance_by_params(sizes: list[int], num_stages: int) -> list[int]:
    """Contiguous cut of ``sizes`` into ``num_stages`` non-empty parts minimising the largest part.

    >>> balance_by_params([8, 1, 1, 1, 1, 8], 3)
    [1, 4, 1]
    """
    n = len(sizes)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages: use between 1 and {n} stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: smallest possible largest part when the first i layers form k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    balance, i = [], n
    for k in range(num_stages, 0, -1):
        balance.append(i - cut[k][i])
        i = cut[k][i]
    return balance[::-1]


def split_gpt(model: models.GPT, num_stages: int, balance: list[int] | None = None) -> list[GPTStage]:
    """Cut ``model`` into ``num_stages`` ``GPTStage`` modules (by ``balance``, else by parameter count)."""
    layers = gpt_layers(model)
    n = len(layers)
    if num_stages > n:
        raise ValueError(f"{num_stages} stages but the model has only {n} layers (embed, {n - 2} blocks, head): "
                         f"use at most {n} stages, or a model with more layers (n_layer)")
    if balance is None:
        balance = balance_by_params([c for _, c in layers], num_stages)
    balance = [int(b) for b in balance]
    if len(balance) != num_stages or sum(balance) != n or min(balance) < 1:
        raise ValueError(f"balance {balance} must have {num_stages} positive entries summing to the {n} layers "
                         f"(embed, {n - 2} blocks, head), e.g. {balance_by_params([c for _, c in layers], num_stages)}")
    if model.config.tie_embeddings and num_stages > 1:
        raise ValueError("the head's weight is tied to the embedding, which would live on two stages: "
                         "build the model with tie_embeddings=False for pipeline parallelism")
    bounds = [sum(balance[:k]) for k in range(num_stages + 1)]
    return [GPTStage(model, bounds[k], bounds[k + 1]) for k in range(num_stages)]
