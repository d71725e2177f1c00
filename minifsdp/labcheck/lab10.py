"""Checks for lab 10 (long sequences: context parallel): the online-softmax merge, one forward of ring attention,
the zig-zag split and the causal work per rank.

The learner writes a block's partial attention ``(out, lse)`` and the rule that merges two of them, then one
forward of ring attention (the K/V of each rank's share of the sequence passed round the ring with
``comm.isend`` / ``comm.irecv``, one block per causal chunk pair, merged), then the zig-zag split, a rank's
share of a tensor and the unmasked query-key pairs each rank computes. Each check runs the learner's code (the
ring on 2 and 4 ranks: CPU ranks where the machine has fewer GPUs; the rest in this process), compares with
one process's causal attention (computed here in float64) and with ``minifsdp.context_parallel``, and prints
one verdict::

    from minifsdp.labcheck import lab10 as check
    check.online_softmax(block_attention, merge)
    check.ring_attention(ring_attention_forward, naive_chunks)
    check.zigzag(zigzag_chunks, shard, work_per_rank, ring_attention_forward)
    check.hint("merge")              # the next hint for an exercise, idea first

Targets: one softmax over every key (relative 1e-5, keys merged in any order, scores up to 1,000); one
process's causal attention (relative 1e-5); bytes sent per rank and layer ``ring_attention_bytes``'s forward,
``(cp - 1) * 2*B*(T/cp)*d*4``; scores computed per rank no more than the library's ring (no block that the
causal mask hides entirely); ``chunks_of``, ``shard_sequence`` and ``attention_work`` of the library.
The scores a rank computed are measured, not trusted: the matmul FLOPs of the learner's ring
(``torch.utils.flop_counter``), ``4 * hd`` per score (``q k^T`` and ``p v``), per sample and head.

Authorship: every check refuses the library's ring attention, online softmax and splits
(``minifsdp.context_parallel``: ``ring_attention``, ``RingAttention``, ``Ring``, ``merge_partials``,
``partial_attention``, ``chunks_of``, ``shard_sequence``, ``attention_work``, ...) and PyTorch's fused
attention (``scaled_dot_product_attention``, which torch's own context parallel also runs through)
statically and at run time (a :class:`~minifsdp.labcheck.authorship.Wire` around the learner's code, in
each worker for the ring).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from .. import context_parallel as C
from .. import dist, trace
from .authorship import Wire, watched
from .verdict import CheckFailed, Hints, call, check_world, failed, figures, passed, require_own, run

__all__ = ["online_softmax", "ring_attention", "zigzag", "hint", "results", "LIBRARY"]

# The library's implementation of each exercise: refused statically, and a wire at run time.
MERGE = (C.partial_attention, C.merge_partials, C.softmax_attention, C.partial_attention_backward,
         F.scaled_dot_product_attention)
RING = (C.ring_attention, C.RingAttention, C.Ring, C.Transfer, C.ContextParallelAttention, C.ContextParallelBlock,
        C.ContextParallelGPT, C.context_parallel_gpt, C.pair_kind, C.pair_work)
SPLIT = (C.chunks_of, C.num_chunks, C.shard_sequence, C.unshard_sequence, C.sequence_positions, C.attention_work,
         C.pair_kind, C.pair_work, C.imbalance)
LIBRARY = MERGE + RING + SPLIT

results: dict[str, Any] = {}   # what the last run of each check measured, for the lab's plots
B, H, HD, T = 2, 2, 8, 32      # the ring's data: T divisible by 2*cp for cp = 2 and 4 (zig-zag)
RING_SIZES = (check_world(2), check_world(4))   # 2: the GPU path on a 2-GPU VM; 4: a ring of more than 2
ZIGZAG_CP = check_world(4)
TOL = 1e-5                     # relative: max |yours - want| / max |want|, fp32 against float64
BIG_SCORES = 1000.0            # exp(89) is beyond float32: a merge must never exponentiate an lse
WORK_CASES = {"naive": ((8, 2), (16, 4), (12, 3), (32, 8), (30, 5), (64, 4)),
              "zigzag": ((8, 2), (16, 4), (24, 3), (32, 8), (40, 5), (64, 4))}

hint = Hints({
    "block_attention": [
        "The scores are q times k transposed, scaled by 1/sqrt(hd): one row per query. A blocked key's score "
        "becomes minus infinity, so exp gives it weight 0.",
        "lse is the log of the sum of exp(score) over the row's keys, one number per row. out weighs each value "
        "by exp(score - lse): those weights sum to 1 over the row.",
        "Take lse with a stable log-sum-exp (it subtracts the row's largest score first): exp(1000) is infinite "
        "in float32, and so would your weights be.",
    ],
    "merge": [
        "Over A and B together a row's normaliser is the sum of A's and B's. Which lse has that sum as its "
        "exponential?",
        "A's values were weighed by exp(s - lse_a); over A and B together they weigh exp(s - lse). Which factor "
        "turns the first into the second? The same for B; then add the two parts.",
        "exp(lse) overflows float32 once lse passes about 88. Take the log of the sum with a stable log-add, and "
        "exponentiate only differences of lse, which are never above 0.",
        "lse has one number per query row, out a row of hd numbers: give each share a last dimension of 1 to "
        "scale out's rows.",
    ],
    "ring_attention_forward": [
        "Step s: you hold the K/V of rank r - s. Start sending them to rank r + 1 and receiving the next ones "
        "from rank r - 1 before you compute; wait for both after.",
        "For each of your query chunks a and each key chunk b you hold: b after a is hidden by the mask, skip it; "
        "b equal to a is the diagonal block, masked; b before a is needed whole.",
        "Keep one partial result (out, lse) per query chunk and merge each block's into it. Step 0 holds your own "
        "chunks, so each query chunk starts with its diagonal block.",
        "cp - 1 sends: after the last step nobody needs your K/V. Receive into a new buffer of their shape; after "
        "the wait it is the K/V you hold.",
        "With NCCL a ring where every rank sends first can stall on large messages: even ranks send first, odd "
        "ranks receive first.",
    ],
    "zigzag_chunks": [
        "2·cp chunks: rank r takes chunk r from the front, and from the back the chunk as far from the end as r "
        "is from the start.",
        "Chunk 0 pairs with the last chunk, chunk 1 with the one before it: each rank's two chunks together cost "
        "the same causal work.",
    ],
    "shard": [
        "Every rank holds as many chunks as the others: cp times that many is the number of equal chunks the "
        "sequence is cut into.",
        "Cut x along dim into that many equal pieces, keep this rank's in the order chunks gives them, and put "
        "them end to end along dim.",
    ],
    "work_per_rank": [
        "The ring brings every key chunk to every rank once: a rank computes each of its query chunks against "
        "every key chunk.",
        "Chunk a's queries against chunk b's keys, n positions each: b before a, all n² pairs; b after a, none; "
        "b equal to a, the lower triangle with its diagonal, n(n+1)/2.",
        "A check of your sum: all ranks together count every (query, same-or-earlier key) pair once, T(T+1)/2.",
    ],
})


# -- the references, computed here (never handed to the learner) --------------------------------------------------
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the relative error of a whole tensor."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def _softmax_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over k, v in float64, ``blocked`` (Tq x Tk) True where a key is hidden."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if blocked is not None:
        s = s.masked_fill(blocked, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v.double(), lse


def _partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _softmax_rows(q, k, v, blocked)
    return out.float(), lse.float()


def _qkv() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10)
    return tuple(torch.randn(B, H, T, HD, generator=g) for _ in range(3))


def _shard(x: torch.Tensor, rank: int, cp: int, chunks: Callable, dim: int = 2) -> torch.Tensor:
    pieces = x.chunk(cp * len(chunks(0, cp)), dim=dim)
    return torch.cat([pieces[c] for c in chunks(rank, cp)], dim=dim)


class _Scores(FlopCounterMode):
    """The attention scores computed inside, measured: matmul FLOPs / (4 hd), per sample and head."""

    def __init__(self) -> None:
        super().__init__(display=False)

    @property
    def count(self) -> int:
        return int(self.get_total_flops() // (4 * HD * B * H))


# -- exercise 1: the block's partial result and the merge, in this process ----------------------------------------------
_OVERFLOW = (f"exp overflows float32 past about 88 (scores here reach {BIG_SCORES:,.0f}); work with differences that "
             "are never above 0 (the log-sum-exp trick)")
_EMPTY_ROW = ("a row whose every key is blocked has nothing to normalise over (0/0): True in the mask means blocked, "
              "the key hidden; the causal mask leaves each query its own position")


def _pair(what: str, name: str, got: Any, shape: tuple[int, ...], nonfinite: str = _OVERFLOW
          ) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        failed(what, f"{name} returned {type(got).__name__}: return the pair (out, lse), two tensors")
    out, lse = got
    if tuple(out.shape) != shape:
        failed(what, f"{name}'s out has shape {tuple(out.shape)}, expected {shape}: one row of hd numbers per query")
    if tuple(lse.shape) != shape[:-1]:
        why = (" (keep no last dimension of 1)" if tuple(lse.shape) == (*shape[:-1], 1) else "")
        failed(what, f"{name}'s lse has shape {tuple(lse.shape)}, expected {shape[:-1]}: one number per query "
                     f"row{why}")
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        failed(what, f"{name} gave inf or NaN: {nonfinite}")
    return out.detach(), lse.detach()


def _block_verdict(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                   out: torch.Tensor, lse: torch.Tensor) -> str | None:
    want_out, want_lse = _softmax_rows(q, k, v, blocked)
    if _rel(out, want_out) <= TOL and (lse.double() - want_lse).abs().max() <= TOL * want_lse.abs().max().clamp_min(1):
        return None
    unscaled = _softmax_rows(q * math.sqrt(q.shape[-1]), k, v, blocked)
    if _rel(out, unscaled[0]) <= TOL or (lse.double() - unscaled[1]).abs().max() <= 1e-4:
        return "the scores are q times k transposed scaled by 1/sqrt(hd), as in every attention"
    if blocked is not None:
        if _rel(out, _softmax_rows(q, k, v, None)[0]) <= TOL:
            return "the mask was ignored: a blocked key's score is minus infinity before the softmax"
        if _rel(out, _softmax_rows(q, k, v, ~blocked)[0]) <= TOL:
            return "the mask is upside down: True means blocked (the key is hidden)"
    if _rel(out, want_out) <= TOL:
        if (lse.double() - want_lse.exp()).abs().max() <= 1e-3 * want_lse.exp().abs().max():
            return "lse is the LOG of the row's normaliser (the sum of exp(scores)), not the sum itself"
        return "out is right but lse is not: lse is the log of the sum of exp(score) over the row's keys"
    return "out differs from softmax(q kᵀ / sqrt(hd)) v over these keys: each value weighs exp(score - lse)"


def _merge_verdict(pa: tuple, pb: tuple, out: torch.Tensor, lse: torch.Tensor, want: tuple) -> str | None:
    (oa, la), (ob, lb) = pa, pb
    if _rel(out, want[0]) <= TOL and (lse.double() - want[1].double()).abs().max() <= 1e-5 * want[1].abs().max():
        return None
    if _rel(out, (oa + ob) / 2) <= TOL:
        return ("you averaged the two outs: a part whose normaliser is larger must weigh more, by its share of the "
                "whole normaliser")
    if (lse - torch.maximum(la, lb)).abs().max() <= 1e-6:
        return "the merged lse is the log of the SUM of both normalisers, not the larger of the two lse"
    if (lse - (la + lb)).abs().max() <= 1e-5 * (la + lb).abs().max():
        return "the normalisers add, not their logs: lse_a + lse_b is the log of their product"
    weights = (la.exp().unsqueeze(-1) * oa + lb.exp().unsqueeze(-1) * ob)
    if _rel(out, weights) <= 1e-4:
        return "out must stay normalised: divide the weighted sum by the normaliser of A and B together"
    if _rel(out, want[0]) <= TOL:
        return "out is right but lse is not: the merged lse is the log of the sum of both normalisers"
    return ("out differs from one softmax over both sets of keys: weigh each part by its share of the whole "
            "normaliser, then add")


def online_softmax(block_attention: Callable, merge: Callable) -> None:
    """``block_attention`` against one softmax (with and without a mask), then ``merge``: 3 pieces of keys in 3
    orders against one softmax over all of them, and rows whose scores reach 1,000."""
    what = "online softmax"
    require_own(what, MERGE, block_attention, merge)
    block_attention, merge = watched(block_attention, *MERGE), watched(merge, *MERGE)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))
    causal = torch.ones(12, 12, dtype=torch.bool).triu(1)
    for blocked, label in ((None, "without a mask"), (causal, "with the causal mask")):
        out, lse = _pair(what, f"block_attention ({label})", call(what, block_attention, q, k, v, blocked),
                         (2, 2, 12, 8), _EMPTY_ROW if blocked is not None else "at scores of a few units")
        why = _block_verdict(q, k, v, blocked, out, lse)
        if why:
            failed(what, f"block_attention ({label}): {why}")
    # 4 queries at positions 8..11 against keys 0..11 in 3 pieces: 0-3 and 4-7 whole, 8-11 the diagonal block
    worst, library = 0.0, 0.0
    q8 = q[..., 8:, :]
    largest = ((q8 @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).abs().max()
    for qs, label in ((q8, ""), (q8 * (BIG_SCORES / largest), f", scores up to {BIG_SCORES:,.0f}")):
        if label:   # exp(89) is beyond float32: the block's own softmax must not overflow either
            out, lse = _pair(what, "block_attention", call(what, block_attention, qs, k[..., :4, :], v[..., :4, :]),
                             (2, 2, 4, 8))
            why = _block_verdict(qs, k[..., :4, :], v[..., :4, :], None, out, lse)
            if why:
                failed(what, f"block_attention ({label[2:]}): {why}")
        pieces = {"A": (0, 4, None), "B": (4, 8, None), "C": (8, 12, causal[8:, 8:])}
        part = {name: _partials(qs, k[..., lo:hi, :], v[..., lo:hi, :], m) for name, (lo, hi, m) in pieces.items()}
        union = _partials(qs, k[..., :8, :], v[..., :8, :], None)
        got = _pair(what, "merge", call(what, merge, *part["A"], *part["B"]), (2, 2, 4, 8))
        why = _merge_verdict(part["A"], part["B"], *got, union)
        if why:
            failed(what, f"merge of keys 0-3 and 4-7{label}: {why}")
        full = _softmax_rows(qs, k, v, causal[8:])
        for order in (("A", "B", "C"), ("C", "B", "A"), ("C", "A", "B")):
            first = _pair(what, "merge", call(what, merge, *part[order[0]], *part[order[1]]), (2, 2, 4, 8))
            out, lse = _pair(what, "merge", call(what, merge, *first, *part[order[2]]), (2, 2, 4, 8))
            err = max(_rel(out, full[0]), (lse.double() - full[1]).abs().max().item() / full[1].abs().max().item())
            if err > TOL:
                failed(what, f"keys in 3 pieces merged in the order {' then '.join(order)}{label}: off by {err:.1e} "
                             "from one softmax over all 12 keys; the merge must not depend on the order")
            worst = max(worst, err)
            ref = C.merge_partials(*C.merge_partials(*part[order[0]], *part[order[1]]), *part[order[2]])
            library = max(library, _rel(ref[0], full[0]))
    passed(what, "one softmax over 12 keys from 3 pieces merged in 3 orders, one piece causal, scores up to "
                 f"{BIG_SCORES:,.0f}; " + figures("largest relative difference", f"{worst:.1e}", f"≤ {TOL:.0e}",
                                                  f"{library:.1e} (merge_partials)"))


# -- exercise 2: one forward of ring attention, on 2 and 4 ranks ------------------------------------------------------------
def _ring_worker(fn: Callable, chunks: Callable, split: str) -> dict:
    """The learner's ring (under a wire) on the check's data, then the library's on the same sequence."""
    torch.set_num_threads(1)
    rank, cp, device = dist.rank(), dist.world_size(), dist.device()
    q, k, v = _qkv()
    local = [_shard(t, rank, cp, chunks).to(device) for t in (q, k, v)]
    with trace.Tracer(rank=rank) as tracer, _Scores() as scores, Wire(*LIBRARY):
        got = fn(*local, chunks)
    out: dict[str, Any] = {"scores": scores.count, "ops": sorted({s.name for s in tracer.trace.comm_spans()})}
    for op in ("send", "recv"):
        out[op] = sum(int(s.args.get("bytes", 0)) for s in tracer.trace.comm_spans() if s.name == op)
    out["out"] = got.detach().cpu().clone() if isinstance(got, torch.Tensor) else type(got).__name__
    lib = [C.shard_sequence(t, cp, rank, split, dim=2).to(device) for t in (q, k, v)]
    with trace.Tracer(rank=rank) as tracer, _Scores() as scores:
        C.ring_attention(*lib, split=split)
    out["library"] = {"scores": scores.count,
                      "send": sum(int(s.args.get("bytes", 0)) for s in tracer.trace.comm_spans() if s.name == "send")}
    return out


def _positions(rank: int, cp: int, chunks: Callable) -> torch.Tensor:
    return _shard(torch.arange(T), rank, cp, chunks, dim=0)


def _ring_problem(res: list, cp: int, chunks: Callable, split: str) -> tuple[str | None, float]:
    """The first thing wrong with the learner's ring outputs on ``cp`` ranks, in words; and the worst error."""
    q, k, v = _qkv()
    keys = torch.arange(T)
    n = T // (cp * len(chunks(0, cp)))
    worst = 0.0
    for r, out in enumerate(res):
        got = out["out"]
        where = f"{cp} ranks ({split} split), rank {r}"
        if not isinstance(got, torch.Tensor):
            return f"{where}: it returned {got}: return this rank's share of the output, a tensor like q", worst
        if tuple(got.shape) != (B, H, T // cp, HD):
            return (f"{where}: output of shape {tuple(got.shape)}, expected {(B, H, T // cp, HD)}: this rank's "
                    "positions only, in the order of its chunks, like q"), worst
        if not torch.isfinite(got).all():
            return (f"{where}: NaN in the output: a block whose every key is hidden by the mask (a key chunk after "
                    "the query chunk) has nothing to normalise over: skip it"), worst
        pos = _positions(r, cp, chunks)

        def rows(blocked: torch.Tensor | None) -> torch.Tensor:
            return _softmax_rows(q[..., pos, :], k, v, blocked)[0]

        causal = keys[None, :] > pos[:, None]
        err = _rel(got, rows(causal))
        if err <= TOL:
            worst = max(worst, err)
            continue
        own = causal | ~torch.isin(keys, pos)[None, :]
        same_chunk = keys[None, :] // n == pos[:, None] // n
        if _rel(got, rows(None)) <= TOL or _rel(got, rows(causal & same_chunk)) <= TOL:
            why = ("your queries saw later positions: skip the key chunks after the query chunk, and mask the "
                   "diagonal block")
        elif _rel(got, rows(keys[None, :] // n > pos[:, None] // n)) <= TOL:
            why = "the diagonal block (a chunk's queries against its own keys) needs the causal mask"
        elif _rel(got, rows(own)) <= TOL:
            why = ("each query met only the keys of its own rank: the K/V must go round the ring, a neighbour's at "
                   "each step, and every block be merged in")
        else:
            why = (f"off by {err:.1e} (relative) from one process's causal attention: at step s you hold the K/V of "
                   "rank r - s (they move one rank on per step); check the merge with exercise 1's check")
        return f"{where}: {why}", worst
    return None, worst


def _ring_run(what: str, fn: Callable, chunks: Callable, split: str, cp: int) -> dict:
    """Run the learner's ring on ``cp`` ranks; fail in words on the result, the bytes or the work."""
    res = run(what, _ring_worker, cp, fn, chunks, split, timeout=60)
    problem, worst = _ring_problem(res, cp, chunks, split)
    if problem:
        failed(what, problem)
    target = C.ring_attention_bytes(B, T, H * HD, cp)["forward"]
    message = 2 * B * (T // cp) * H * HD * 4
    for r, out in enumerate(res):
        other = [op for op in out["ops"] if op not in ("send", "recv")]
        if other:
            failed(what, f"{cp} ranks, rank {r} called {other[0]}: it holds every rank's K/V at once; the ring passes "
                         "one neighbour's at a time with comm.isend / comm.irecv")
        if out["send"] == 0:
            failed(what, f"{cp} ranks, rank {r} sent nothing through comm: pass the K/V with comm.isend / comm.irecv "
                         "(the tracer counts them; torch.distributed's own calls it cannot see)")
        if out["send"] != target:
            why = (f"you sent at every one of the {cp} steps: after the last step nobody needs your K/V"
                   if out["send"] == cp * message else
                   "each step but the last sends the K/V this rank holds, K and V of its share once")
            failed(what, f"{cp} ranks, rank {r} sent {out['send']:,} B, target {target:,} B = (cp - 1) x "
                         f"{message:,} B: {why}")
        if out["scores"] > out["library"]["scores"]:
            failed(what, f"{cp} ranks, rank {r} computed {out['scores']:,} scores per sample and head, the library's "
                         f"ring {out['library']['scores']:,}: a block whose keys all come after its queries needs "
                         "no computing")
    return {"cp": cp, "T": T, "worst": worst, "scores": [o["scores"] for o in res],
            "library_scores": [o["library"]["scores"] for o in res], "send": res[0]["send"], "target": target,
            "library_send": res[0]["library"]["send"]}


def ring_attention(ring_attention_forward: Callable, naive_chunks: Callable) -> None:
    """The learner's ring, naive split, on 2 and on 4 ranks: one process's causal attention, bytes sent per rank,
    scores computed per rank (measured) beside the library's ring."""
    what = "ring attention"
    require_own(what, LIBRARY, ring_attention_forward, naive_chunks)
    runs = [_ring_run(what, ring_attention_forward, naive_chunks, "naive", cp) for cp in RING_SIZES]
    last = runs[-1]
    results["ring_attention"] = last
    worst = max(r["worst"] for r in runs)
    passed(what, f"one process's causal attention on {' and '.join(str(r['cp']) for r in runs)} ranks (max relative "
                 f"difference {worst:.1e}); "
                 + figures(f"bytes sent per rank at cp = {last['cp']}", last["send"], last["target"],
                           last["library_send"], unit="B")
                 + f"; scores computed per rank: yours {last['scores']}, library {last['library_scores']}")


# -- exercise 3: the zig-zag split, a rank's share, the work per rank; the ring with the learner's split -------------------
def _zigzag_problem(zigzag_chunks: Callable, what: str) -> str | None:
    for cp in range(1, 9):
        held: dict[int, list[int]] = {}
        for r in range(cp):
            got = call(what, zigzag_chunks, r, cp)
            if not (isinstance(got, (tuple, list)) and all(isinstance(c, int) for c in got)):
                return f"zigzag_chunks({r}, {cp}) returned {got!r}: return the chunk numbers, a tuple of ints"
            if len(got) != 2:
                return f"zigzag_chunks({r}, {cp}) = {tuple(got)}: zig-zag gives each rank 2 of the 2·cp chunks"
            for c in got:
                held.setdefault(c, []).append(r)
        for c in range(2 * cp):
            if len(held.get(c, [])) != 1:
                whom = f"ranks {held[c]}" if c in held else "no rank"
                return f"cp = {cp}: chunk {c} of {2 * cp} is held by {whom}; every chunk belongs to exactly one rank"
        if set(held) != set(range(2 * cp)):
            return f"cp = {cp}: chunk numbers {sorted(set(held) - set(range(2 * cp)))} do not exist (0 .. 2·cp - 1)"
        for r in range(cp):
            got = tuple(zigzag_chunks(r, cp))
            if sorted(got) != sorted((r, 2 * cp - 1 - r)):
                return (f"cp = {cp}: rank {r} holds chunks {got}: every chunk is held once, but the causal work is "
                        "balanced only when a rank's back chunk mirrors its front one (as far from the end as the "
                        "front one is from the start)")
    return None


def _shard_problem(shard: Callable, chunks: Callable, split: str, what: str) -> str | None:
    g = torch.Generator().manual_seed(3)
    for seq, cp in ((8, 2), (16, 4), (24, 3)):
        cases = ((torch.arange(seq), 0), (torch.arange(2 * seq).view(2, seq), 1),
                 (torch.randn(2, 2, seq, 3, generator=g), -2))
        for x, dim in cases:
            for r in range(cp):
                want = _shard(x, r, cp, chunks, dim)
                got = call(what, shard, x.clone(), r, cp, chunks, dim)
                if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want):
                    continue
                label = f"shard at T = {seq}, cp = {cp} ({split}), rank {r}, dim {dim}"
                if not isinstance(got, torch.Tensor):
                    return f"{label}: it returned {type(got).__name__}, expected a tensor"
                if x.dim() == 1 and got.dim() == 1:
                    return f"{label}: positions {got.tolist()}, expected {want.tolist()} (its chunks, in its order)"
                return f"{label}: shape {tuple(got.shape)} or values differ from its chunks along dim, in its order"
    return None


def _work_problem(work_per_rank: Callable, chunks: Callable, split: str, what: str) -> str | None:
    for seq, cp in WORK_CASES[split]:
        want = C.attention_work(seq, cp, split)
        got = call(what, work_per_rank, seq, cp, chunks)
        if isinstance(got, (list, tuple)) and [int(w) for w in got] == want and len(got) == cp:
            continue
        label = f"work_per_rank({seq}, {cp}, {split} chunks) = {list(got) if isinstance(got, (list, tuple)) else got}"
        if not isinstance(got, (list, tuple)) or len(got) != cp:
            return f"{label}: return one count per rank, rank 0 first"
        total, count = seq * (seq + 1) // 2, sum(got)
        n = seq // (cp * len(chunks(0, cp)))
        diagonals = cp * len(chunks(0, cp))
        if count == total + diagonals * n * (n - 1) // 2:
            why = "the diagonal block was counted whole: a query sees keys up to its own position, n(n+1)/2 pairs"
        elif count == total - diagonals * n:
            why = "a query sees its own position too: the diagonal block has n(n+1)/2 pairs"
        elif count != total:
            why = (f"the ranks together count {count:,} pairs, not T(T+1)/2 = {total:,}: every (query, same-or-"
                   "earlier key) pair once; key chunks after the query chunk count nothing")
        else:
            why = "the total is right, not its spread: count each rank's own query chunks against every key chunk"
        return f"{label}, target {want}: {why}"
    return None


def zigzag(zigzag_chunks: Callable, shard: Callable, work_per_rank: Callable, ring_attention_forward: Callable,
           naive_chunks: Callable | None = None) -> None:
    """The split at cp = 1..8, the shares and the work against the library for both splits; then the learner's
    ring with the learner's zig-zag on 4 ranks: one process's attention, the same scores on every rank."""
    what = "zig-zag split"
    require_own(what, LIBRARY, zigzag_chunks, shard, work_per_rank, ring_attention_forward)
    own_chunks = zigzag_chunks
    zigzag_chunks, shard, work_per_rank = (watched(f, *LIBRARY) for f in (zigzag_chunks, shard, work_per_rank))
    naive = naive_chunks or _naive
    problem = _zigzag_problem(zigzag_chunks, what)
    if problem:
        failed(what, problem)
    for name, chunks in (("naive", naive), ("zig-zag", own_chunks)):
        problem = _shard_problem(shard, chunks, name, what) or \
            _work_problem(work_per_rank, chunks, "naive" if name == "naive" else "zigzag", what)
        if problem:
            failed(what, problem)
    run_ = _ring_run(what, ring_attention_forward, own_chunks, "zigzag", ZIGZAG_CP)
    if len(set(run_["scores"])) != 1:
        failed(what, f"your ring with your zig-zag computed {run_['scores']} scores on the {ZIGZAG_CP} ranks: the "
                     "zig-zag split gives every rank the same work")
    results["zigzag"] = run_
    work = {name: list(work_per_rank(T, ZIGZAG_CP, chunks)) for name, chunks in
            (("zig-zag", own_chunks), ("naive", naive))}
    passed(what, f"the library's split, shares and work for both splits at {len(WORK_CASES['naive'])} (T, cp) pairs "
                 f"each; T = {T}, cp = {ZIGZAG_CP}: work per rank {work['zig-zag']} (naive {work['naive']}); your "
                 f"ring with your zig-zag: one process's attention (max relative difference {run_['worst']:.1e}), "
                 + figures("scores computed per rank", str(run_["scores"]), "the same on every rank",
                           str(run_["library_scores"])))


def _naive(rank: int, cp: int) -> tuple[int, ...]:
    return (rank,)
