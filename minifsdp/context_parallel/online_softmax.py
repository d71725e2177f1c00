"""Attention over keys that arrive in pieces: partial results and the online-softmax rule that merges them.

Layer 5 (techniques), no communication. Attention of one query row is
``out = sum_j p_j v_j`` with ``p_j = exp(s_j) / sum_k exp(s_k)``: the
denominator needs *every* score of the row. Ring attention sees the keys one
chunk at a time, so it cannot normalise at once. It keeps, for each query row,
the partial result over the keys seen so far, normalised over those keys only,
and the log of their normaliser, the log-sum-exp::

    out_A = sum_{j in A} exp(s_j - lse_A) v_j,      lse_A = log sum_{j in A} exp(s_j)

Two partial results over disjoint key sets A and B merge exactly (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"; the rule inside
FlashAttention and ring attention)::

    lse = log(exp(lse_A) + exp(lse_B))                   (torch.logaddexp: no overflow)
    out = exp(lse_A - lse) * out_A + exp(lse_B - lse) * out_B

Each weight is the share of the whole normaliser its set holds, so the merge is
the full softmax over A and B, whatever the order of the pieces. Worked
example, one query, values 1 and 3 with scores 0 and 0 (set A), value 5 with
score log 2 (set B): out_A = 2, lse_A = log 2; out_B = 5, lse_B = log 2;
lse = log 4, weights 1/2 and 1/2, out = 3.5. The naive way, concatenating the
scores (0, 0, log 2) and taking one softmax, gives probabilities 1/4, 1/4, 1/2
and 1/4 + 3/4 + 5/2 = 3.5::

    >>> q = torch.ones(1, 1)                              # one query, head_dim 1, scale 1
    >>> out_a, lse_a = partial_attention(q, torch.zeros(2, 1), torch.tensor([[1.], [3.]]), scale=1.0)
    >>> out_b, lse_b = partial_attention(q, torch.tensor([[math.log(2)]]), torch.tensor([[5.]]), scale=1.0)
    >>> merge_partials(out_a, lse_a, out_b, lse_b)[0]
    tensor([[3.5000]])
    >>> softmax_attention(q, torch.tensor([[0.], [0.], [math.log(2)]]), torch.tensor([[1.], [3.], [5.]]), scale=1.0)
    tensor([[3.5000]])

Backward (FlashAttention-2, Dao 2023, algorithm 2): with the *final* lse of a
row saved, one block's probabilities are recomputed exactly, ``P = exp(S -
lse)``, without the other blocks; ``partial_attention_backward`` gives that
block's share of dQ and its whole dK, dV.
"""

from __future__ import annotations

import math

import torch

__all__ = ["partial_attention", "merge_partials", "softmax_attention", "partial_attention_backward"]


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    # The same op order as models.causal_attention: (q k^T) * scale, then the mask.
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the keys ``k`` alone: ``(out, lse)``, normalised over these keys only.

    ``q`` is ``(..., Tq, hd)``, ``k`` and ``v`` ``(..., Tk, hd)``; ``mask`` (``Tq x Tk``,
    True = blocked, as ``models._future_mask``) must leave every row at least one key
    (ring attention skips fully masked blocks). Returns ``out (..., Tq, hd)`` and
    ``lse (..., Tq)``. ``scale`` defaults to ``1/sqrt(hd)``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results over disjoint key sets -> the result over their union (the rule above)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """The naive way, for the lesson: every key at once, one softmax (what one process computes)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(_scores(q, k, mask, scale), dim=-1) @ v


def partial_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                               lse: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor | None = None,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's gradients, recomputed from the final ``lse`` (FlashAttention-2's backward).

    ``dout`` is dL/d(out) of the *whole* attention for these queries, ``lse`` its
    final log-sum-exp and ``delta = (dout * out).sum(-1)`` (``out`` the final output).
    Returns this block's share of dQ and the dK, dV of these keys from these queries::

        P  = exp(S - lse)                the block of the true probabilities
        dV = P^T dO
        dP = dO V^T
        dS = P * (dP - delta)            softmax's backward: delta = rowsum(P * dP) over *all* keys
        dQ = dS K * scale,   dK = dS^T Q * scale
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = torch.exp(_scores(q, k, mask, scale) - lse.unsqueeze(-1))   # masked entries: exp(-inf) = 0
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv
