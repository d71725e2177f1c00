"""Ring attention: causal self-attention over a sequence split across the cp group, forward and backward.

Layer 5 (techniques). Liu et al. 2023 ("Ring attention with blockwise
transformers"); the causal zig-zag version follows zhuzilin/ring-flash-attention
(``zigzag_ring_flash_attn``), which picotron and torchtitan build on. Each rank
holds the queries, keys and values of its share of the sequence (``split.py``).
Its queries must meet every earlier key, so the keys and values go round the
ring (``ring.py``): at step ``s`` rank ``r`` holds the K/V of rank ``r - s``,
computes its queries against them (``online_softmax.partial_attention``) and
merges the result into what it has (``merge_partials``), while the next K/V is
already travelling (``comm.isend``/``irecv`` posted before the compute, waited
after it). After ``cp`` steps every query has met every key: the output and its
log-sum-exp are exact.

Which chunk pairs a rank computes, cp = 2, zig-zag (rank 0 holds chunks 0 and 3,
rank 1 chunks 1 and 2; ``q3.k1`` = chunk 3's queries against chunk 1's keys;
F full block, D diagonal block (lower triangle), - skipped)::

                     K/V held      queries' first chunk   queries' second chunk   unmasked pairs (m = T/4)
    step 0  rank 0   chunks 0, 3   q0.k0 D   q0.k3 -      q3.k0 F   q3.k3 D       m^2 + m(m+1)
            rank 1   chunks 1, 2   q1.k1 D   q1.k2 -      q2.k1 F   q2.k2 D       m^2 + m(m+1)
    step 1  rank 0   chunks 1, 2   q0.k1 -   q0.k2 -      q3.k1 F   q3.k2 F       2 m^2
            rank 1   chunks 0, 3   q1.k0 F   q1.k3 -      q2.k0 F   q2.k3 -       2 m^2

Both ranks: 3 m^2 + m(m+1). The naive split (rank 0 chunk 0, rank 1 chunk 1,
``n = T/2``) gives rank 0 one diagonal block, ``n(n+1)/2``, and rank 1 a
diagonal and a full one, ``n^2 + n(n+1)/2``: about 3x the work.

Backward, written out (not autograd through the loop), FlashAttention-2 style:
the forward saves only ``q, k, v, out, lse``; the backward turns the ring once
more. At step ``s`` rank ``r`` holds rank ``r - s``'s K/V again, recomputes each
block's probabilities from the saved final ``lse``
(``online_softmax.partial_attention_backward``), adds the block's dQ to its own
and computes that K/V chunk's dK, dV *from its queries*. Those belong to rank
``r - s``: they travel round the ring as an accumulator, each rank adding its
share, until they reach their owner. Rank ``r`` keeps the step-0 share of its
own chunk and receives the rest at the end (``cp - 1`` hops, not ``cp``).

Bytes (the tracer's ``send`` spans; ``recv`` the same), one rank, one
attention layer, with ``kv = 2 * B * (T/cp) * d * element_size`` (K and V of
the local share travel as one message; ``d`` = heads x head_dim)::

    forward:   (cp - 1) * kv            K/V, steps 0 .. cp-2
    backward:  2 * (cp - 1) * kv        K/V again, and dK/dV (cp - 1 hops)

``ring_attention_bytes`` computes it. Work: each block computed opens a trace
span ``ring_attention.block`` with ``pairs`` = its unmasked query-key pairs
(per sample and head; ``split.attention_work`` predicts them) and ``scores`` = the
scores it computed (a diagonal block computes all ``n^2`` and masks half), so a
tracer measures each rank's work. Zig-zag computes ``2 cp + 1`` blocks of
``(T/2cp)^2`` scores on every rank; naive, ``r + 1`` blocks of ``(T/cp)^2`` on rank ``r``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch.distributed import ProcessGroup

from .. import comm, dist, trace
from .online_softmax import merge_partials, partial_attention, partial_attention_backward
from .ring import Ring
from .split import check_sequence_length, chunks_of, pair_kind, pair_work

__all__ = ["ring_attention", "RingAttention", "ring_attention_bytes"]

_KV, _DKV = 1, 2  # p2p tags: K/V and their gradient may be in flight to the same rank at once


def _pairs(mine: tuple[int, ...], theirs: tuple[int, ...]) -> Iterator[tuple[int, int, str]]:
    """(my query piece, their key piece, kind) for every chunk pair the causal mask does not hide."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            kind = pair_kind(a, b)
            if kind != "skip":
                yield i, j, kind


@contextlib.contextmanager
def _labels(label: str | None, phase: str) -> Iterator[None]:
    """Label this layer's ring traffic (``unit``, ``phase``) on the tracer's comm spans."""
    with comm.annotate(phase=phase, **({"unit": label} if label else {})):
        yield


class RingAttention(torch.autograd.Function):
    """``forward(q, k, v, group, split, scale, label) -> out``; all ``(B, h, T_local, head_dim)``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup | None,
                split: str, scale: float, label: str | None) -> torch.Tensor:
        ring = Ring(group)
        mine = chunks_of(ring.rank, ring.size, split)
        n = q.shape[-2] // len(mine)
        diagonal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)  # True: blocked
        qs = q.chunk(len(mine), dim=-2)
        outs: list[Any] = [None] * len(mine)
        lses: list[Any] = [None] * len(mine)
        kv = torch.stack([k, v])  # one message per step: (2, B, h, T_local, head_dim)
        with _labels(label, "forward"):
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                # The next step's K/V start travelling now; this step computes on the ones held.
                transfer = ring.pass_along(kv, _KV) if step < ring.size - 1 else None
                ks, vs = kv[0].chunk(len(mine), dim=-2), kv[1].chunk(len(mine), dim=-2)
                for i, j, kind in _pairs(mine, chunks_of(src, ring.size, split)):
                    with trace.span("ring_attention.block", phase="forward", step=step, block=kind,
                                    pairs=pair_work(kind, n), scores=n * n):
                        o, lse = partial_attention(qs[i], ks[j], vs[j], diagonal if kind == "diagonal" else None,
                                                   scale)
                    # Step 0 holds every piece's diagonal block, so each piece starts there.
                    outs[i], lses[i] = (o, lse) if outs[i] is None else merge_partials(outs[i], lses[i], o, lse)
                if transfer is not None:
                    kv = transfer.wait()
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.split, ctx.scale, ctx.label = group, split, scale, label
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, split, scale = Ring(ctx.group), ctx.split, ctx.scale
        mine = chunks_of(ring.rank, ring.size, split)
        pieces, n = len(mine), q.shape[-2] // len(mine)
        diagonal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # rowsum(dO * O): softmax's backward term, once per query
        qs, dos = q.chunk(pieces, dim=-2), dout.chunk(pieces, dim=-2)
        lses, deltas = lse.chunk(pieces, dim=-1), delta.chunk(pieces, dim=-1)
        dq = torch.zeros_like(q)
        dqs = dq.chunk(pieces, dim=-2)  # views: added into in place
        kv = torch.stack([k, v])
        own = incoming = None
        with _labels(ctx.label, "backward"):
            for step in range(ring.size):
                src = (ring.rank - step) % ring.size
                transfer = ring.pass_along(kv, _KV) if step < ring.size - 1 else None
                ks, vs = kv[0].chunk(pieces, dim=-2), kv[1].chunk(pieces, dim=-2)
                dkv = torch.zeros_like(kv)  # dK, dV of rank src's keys, from my queries
                dks, dvs = dkv[0].chunk(pieces, dim=-2), dkv[1].chunk(pieces, dim=-2)
                for i, j, kind in _pairs(mine, chunks_of(src, ring.size, split)):
                    with trace.span("ring_attention.block", phase="backward", step=step, block=kind,
                                    pairs=pair_work(kind, n), scores=n * n):
                        gq, gk, gv = partial_attention_backward(qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i],
                                                                diagonal if kind == "diagonal" else None, scale)
                    dqs[i].add_(gq)
                    dks[j].add_(gk)
                    dvs[j].add_(gv)
                if step == 0:
                    own = dkv  # my chunk, from my queries: the other ranks' shares arrive at the end
                else:
                    if step >= 2:  # ranks src+1 .. r-1 have added theirs; add mine, pass it on
                        dkv += incoming.wait()
                    incoming = ring.pass_along(dkv, _DKV)
                if transfer is not None:
                    kv = transfer.wait()
            if incoming is not None:  # every other rank's share of my chunk's dK, dV, home after cp - 1 hops
                own += incoming.wait()
        return dq, own[0], own[1], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup | None = None,
                   split: str = "zigzag", *, is_causal: bool = True, attn_mask: torch.Tensor | None = None,
                   scale: float | None = None, label: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's share of the sequence against the whole sequence.

    ``q, k, v``: ``(B, h, T/cp, head_dim)``, this rank's share laid out by
    ``split.shard_sequence(..., split)`` (``torch.nn.functional.scaled_dot_product_attention``'s
    layout). Returns this rank's share of ``softmax(q k^T * scale + causal mask) v``,
    differentiable in ``q``, ``k``, ``v``. Every rank of ``group`` (default: the world)
    calls it together. ``label`` names the layer on the tracer's spans (``unit``).
    Only the causal mask: anything else is refused with the fix.
    """
    if attn_mask is not None or not is_causal:
        what = "an attn_mask tensor" if attn_mask is not None else "is_causal=False"
        raise ValueError(f"ring attention computes the causal mask only, not {what} (its chunk-pair rule and the "
                         "zig-zag balance are the causal mask's); pass is_causal=True without attn_mask, or run "
                         "this attention without context parallelism (cp=1)")
    cp = dist.world_size(group)
    check_sequence_length(q.shape[-2] * cp, cp, split)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring attention takes q, k, v of one shape (B, heads, T/cp, head_dim); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q, k, v, group, split, scale, label)


def ring_attention_bytes(batch: int, seq_len: int, width: int, cp: int, element_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends (and as many it receives) for one attention layer, forward and backward.

    ``width`` is heads x head_dim of K (``n_embd`` for a whole GPT). Worked
    example, gpt-tiny (d = 32), B = 2, T = 32, cp = 4, fp32: the K/V message is
    2 * 2 * 8 * 32 * 4 = 4096 B; forward 3 * 4096, backward 6 * 4096.

    >>> ring_attention_bytes(2, 32, 32, 4)
    {'forward': 12288, 'backward': 24576}
    """
    kv = 2 * batch * (seq_len // cp) * width * element_size
    return {"forward": (cp - 1) * kv, "backward": 2 * (cp - 1) * kv}
