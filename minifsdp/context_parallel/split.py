"""Who holds which positions: the naive and the zig-zag sequence splits, and the causal work they give each rank.

Layer 5 (techniques), no communication. Context parallelism cuts the sequence
of every sample into pieces, one share per rank of the cp group. Every layer
except attention works position by position, so it runs on the local share
alone; attention needs every earlier position, which ``ring_attention.py``
brings round the ring. How the sequence is cut decides how much attention work
each rank does, because the causal mask hides the future:

naive: ``cp`` contiguous chunks, rank ``r`` holds chunk ``r``. Rank 0's queries
see only chunk 0's keys; the last rank's see everything. With ``n = T / cp``
positions a chunk, rank ``r`` computes ``r * n^2 + n(n+1)/2`` unmasked
query-key pairs: cp = 4, T = 16 gives 10, 26, 42, 58 (5.8x between the
extremes).

zig-zag (Brandon et al. 2023, "Striped attention", and the zigzag variant of
zhuzilin/ring-flash-attention that torchtitan and picotron use): ``2 * cp``
chunks, rank ``r`` holds chunk ``r`` and chunk ``2*cp - 1 - r``, one from the
cheap front and its mirror from the expensive back. With ``m = T / (2 cp)``
every rank computes ``(2cp - 1) m^2 + m(m+1)`` pairs, exactly the same number:
cp = 4, T = 16 gives 34 on every rank (the total, 136 = 16*17/2, as before)::

    T = 8, cp = 2                      positions 0 1 | 2 3 | 4 5 | 6 7
    naive:   rank 0: 0 1 2 3           chunks    0     1     2     3
             rank 1: 4 5 6 7
    zig-zag: rank 0: 0 1 6 7   (chunks 0, 3)
             rank 1: 2 3 4 5   (chunks 1, 2)

Between one chunk of queries ``a`` and one chunk of keys ``b`` (``pair_kind``),
the causal mask leaves: everything (``a > b``: every key is earlier), the lower
triangle (``a == b``, the diagonal block) or nothing (``a < b``: skipped, never
computed).

    >>> shard_sequence(torch.arange(8), cp=2, rank=0, split="zigzag", dim=0)
    tensor([0, 1, 6, 7])
    >>> attention_work(16, cp=4, split="naive"), attention_work(16, cp=4, split="zigzag")
    ([10, 26, 42, 58], [34, 34, 34, 34])
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SPLITS", "num_chunks", "chunks_of", "check_sequence_length", "shard_sequence", "unshard_sequence",
           "sequence_positions", "pair_kind", "pair_work", "attention_work", "imbalance"]

SPLITS = ("zigzag", "naive")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (zig-zag balances the causal mask), got {split!r}")


def num_chunks(cp: int, split: str) -> int:
    """How many equal chunks the sequence is cut into: ``2 * cp`` for zig-zag, ``cp`` for naive."""
    _check_split(split)
    return 2 * cp if split == "zigzag" else cp


def chunks_of(rank: int, cp: int, split: str = "zigzag") -> tuple[int, ...]:
    """The chunk numbers rank ``rank`` holds, in the order it stores them.

    >>> chunks_of(0, 4), chunks_of(3, 4), chunks_of(3, 4, "naive")
    ((0, 7), (3, 4), (3,))
    """
    _check_split(split)
    return (rank, 2 * cp - 1 - rank) if split == "zigzag" else (rank,)


def check_sequence_length(seq_len: int, cp: int, split: str = "zigzag") -> None:
    """A one-line error, naming the fix, for a length the split cannot cut into equal chunks."""
    n = num_chunks(cp, split)
    if seq_len % n:
        if split == "zigzag":
            raise ValueError(f"context parallel (zig-zag split) cuts the sequence into 2*cp = {n} chunks: length "
                             f"{seq_len} is not divisible by {n}; use a sequence length that is a multiple of {n}")
        raise ValueError(f"context parallel (naive split) cuts the sequence into cp = {n} chunks: length {seq_len} "
                         f"is not divisible by {n}; use a sequence length that is a multiple of {n}")


def shard_sequence(x: torch.Tensor, cp: int, rank: int, split: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim`` (default 1: ``[B, T, ...]`` batches): its chunks, concatenated.

    The data side of context parallelism: ids, targets and positions are all cut
    this way, so position ``i`` of the local share is the same token everywhere.
    """
    check_sequence_length(x.shape[dim], cp, split)
    pieces = x.chunk(num_chunks(cp, split), dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, cp, split)], dim=dim).contiguous()


def unshard_sequence(shards: Sequence[torch.Tensor], split: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The inverse of ``shard_sequence``: every rank's share (in rank order) back to the whole sequence.

    >>> unshard_sequence([torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])], dim=0)
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    cp = len(shards)
    by_chunk: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        held = chunks_of(rank, cp, split)
        for c, piece in zip(held, shard.chunk(len(held), dim=dim)):
            by_chunk[c] = piece
    return torch.cat([by_chunk[c] for c in range(num_chunks(cp, split))], dim=dim)


def sequence_positions(seq_len: int, cp: int, rank: int, split: str = "zigzag",
                       device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of this rank's share: what the position embedding must be given.

    >>> sequence_positions(8, 2, 1)
    tensor([2, 3, 4, 5])
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, split, dim=0)


def pair_kind(q_chunk: int, k_chunk: int) -> str:
    """What the causal mask leaves of chunk ``q_chunk``'s queries against chunk ``k_chunk``'s keys.

    ``"full"`` (every key earlier), ``"diagonal"`` (the same chunk: the lower triangle) or ``"skip"``.

    >>> pair_kind(3, 1), pair_kind(2, 2), pair_kind(0, 3)
    ('full', 'diagonal', 'skip')
    """
    return "full" if q_chunk > k_chunk else "diagonal" if q_chunk == k_chunk else "skip"


def pair_work(kind: str, n: int) -> int:
    """Unmasked query-key pairs of one ``n x n`` chunk pair: n^2 full, n(n+1)/2 diagonal, 0 skipped."""
    return {"full": n * n, "diagonal": n * (n + 1) // 2, "skip": 0}[kind]


def attention_work(seq_len: int, cp: int, split: str = "zigzag") -> list[int]:
    """Unmasked query-key pairs each rank computes (per sample and head), from the chunk pairs it holds.

    Every rank sees every key chunk once as the ring turns, so rank ``r``'s work
    is the sum over its query chunks and all key chunks of ``pair_work``.
    ``ring_attention`` records the same numbers as it runs (trace spans'
    ``pairs``), which is how the tests measure them.
    """
    check_sequence_length(seq_len, cp, split)
    chunks = num_chunks(cp, split)
    n = seq_len // chunks
    return [sum(pair_work(pair_kind(a, b), n) for a in chunks_of(r, cp, split) for b in range(chunks))
            for r in range(cp)]


def imbalance(work: Sequence[float]) -> float:
    """The busiest rank's work over the least busy one's, minus 1 (0.0: perfectly balanced).

    >>> imbalance([10, 26, 42, 58]), imbalance([34, 34, 34, 34])
    (4.8, 0.0)
    """
    return max(work) / min(work) - 1.0
