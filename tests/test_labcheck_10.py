"""The checks of lab 10 (long sequences: context parallel): pass on the solution, fail in words on the rest.

The learner's functions come from the notebook source itself (solutions/src/10_context_parallel.py), executed
into a fresh ``__main__`` namespace (so ``launch`` sends them to the workers by value): as the solution, as the
blank lab (every exercise still raises NotImplementedError), or as the solution with a small edit (a typical
mistake). Each runs through the one-call check of the lab, which must pass, or fail with ``CheckFailed`` and
one sentence naming what is wrong. Every exercise also has library shortcuts, written the way a learner
looking for one would (``minifsdp.context_parallel``'s merge, ring and splits, torch's fused attention): each
must fail with a sentence naming the library, statically or at run time (the wire). Also here: the memory
formula the lab's widget draws (``context_parallel.activation_bytes``) against saved-tensor bytes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from labcheck_helpers import (edits_apply, fails, hints_come_one_at_a_time, lab_tests,
                              load, run_cell, shortcut_fails)
from minifsdp import context_parallel as C
from minifsdp import models
from minifsdp.labcheck import lab10

STEM = "10_context_parallel"


def ns10(*edits: tuple[str, str], blank: bool = False) -> dict:
    edits_apply(STEM, edits)
    return load(STEM, blank=blank, edits=edits)


def ex1(ns: dict) -> tuple:
    return ns["block_attention"], ns["merge"]


def ex2(ns: dict) -> tuple:
    return ns["ring_attention_forward"], ns["naive_chunks"]


def ex3(ns: dict) -> tuple:
    return ns["zigzag_chunks"], ns["shard"], ns["work_per_rank"], ns["ring_attention_forward"]


# ------------------------------------------------------------------------------------ mistakes, as edits
SCALE = (("s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])", "s = q @ k.transpose(-2, -1)"),)
NO_MASK = (("        s = s.masked_fill(mask, float(\"-inf\"))", "        s = s"),)
MASK_UPSIDE_DOWN = (("s.masked_fill(mask, float(\"-inf\"))", "s.masked_fill(~mask, float(\"-inf\"))"),)
KEEPDIM = (("    lse = torch.logsumexp(s, dim=-1)\n    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse",
            "    lse = torch.logsumexp(s, dim=-1, keepdim=True)\n    return torch.exp(s - lse) @ v, lse"),)
BLOCK_OVERFLOW = (("    lse = torch.logsumexp(s, dim=-1)\n", "    lse = torch.exp(s).sum(-1).log()\n"),)
AVERAGE = (("    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b",
            "    out = (out_a + out_b) / 2"),)
LSE_MAX = (("    lse = torch.logaddexp(lse_a, lse_b)", "    lse = torch.maximum(lse_a, lse_b)"),)
LSE_SUM = (("    lse = torch.logaddexp(lse_a, lse_b)", "    lse = lse_a + lse_b"),)
MERGE_OVERFLOW = (("    lse = torch.logaddexp(lse_a, lse_b)", "    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))"),)
UNNORMALISED = (("    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b",
                 "    out = torch.exp(lse_a).unsqueeze(-1) * out_a + torch.exp(lse_b).unsqueeze(-1) * out_b"),)

SKIP = "                if b > a:                       # every key after every query: nothing to compute\n" \
       "                    continue\n"
NO_SKIP = ((SKIP, ""),)
DIAGONAL_UNMASKED = (("mask = diagonal_mask(n, q) if a == b else None", "mask = None"),)
EVERY_STEP_SENDS = (("        if step < cp - 1:                       # the next K/V start travelling now",
                     "        if True:"),
                    ("        if step < cp - 1:\n            for handle in handles:",
                     "        if True:\n            for handle in handles:"))
OWN_KEYS_ONLY = (("    for step in range(cp):\n", "    for step in range(1):\n"),)
WRONG_WAY = (("chunks((rank - step) % cp, cp)", "chunks((rank + step) % cp, cp)"),)
HIDDEN_BLOCKS_COMPUTED = ((SKIP, "                if b > a:\n"
                                 "                    block_attention(q[..., i * n:(i + 1) * n, :], ks[j], vs[j])\n"
                                 "                    continue\n"),)
FULLY_MASKED = ((SKIP, ""), ("mask = diagonal_mask(n, q) if a == b else None",
                             "mask = diagonal_mask(n, q) if a == b else (diagonal_mask(n, q) | True) if b > a else None"))

STRIPED = (("    return (rank, 2 * cp - 1 - rank)", "    return (rank, cp + rank)"),)
COLLIDING = (("    return (rank, 2 * cp - 1 - rank)", "    return (rank, 2 * cp - 2 - rank)"),)
TWO_CHUNKS_ALWAYS = (("    pieces = x.chunk(cp * len(chunks(0, cp)), dim=dim)", "    pieces = x.chunk(2 * cp, dim=dim)"),)
DIAGONAL_WHOLE = (("n * (n + 1) // 2 if b == a", "n * n if b == a"),)
DIAGONAL_WITHOUT_SELF = (("n * (n + 1) // 2 if b == a", "n * (n - 1) // 2 if b == a"),)
FUTURE_COUNTED = (("if b < a else n * (n + 1) // 2 if b == a else 0", "if b < a else n * (n + 1) // 2 if b == a else n * n"),)

EX1_MISTAKES = {SCALE: "1/sqrt(hd)", NO_MASK: "mask was ignored", MASK_UPSIDE_DOWN: "True in the mask means blocked",
                KEEPDIM: "no last dimension of 1", BLOCK_OVERFLOW: "overflows", AVERAGE: "averaged",
                LSE_MAX: "not the larger", LSE_SUM: "normalisers add", MERGE_OVERFLOW: "overflows",
                UNNORMALISED: "stay normalised"}
EX2_MISTAKES = {NO_SKIP: "saw later positions", DIAGONAL_UNMASKED: "diagonal block", EVERY_STEP_SENDS: "every one of",
                OWN_KEYS_ONLY: "only the keys of its own rank", WRONG_WAY: "rank r - s",
                HIDDEN_BLOCKS_COMPUTED: "needs no computing", FULLY_MASKED: "NaN"}
EX3_MISTAKES = {STRIPED: "mirrors", COLLIDING: "held by", TWO_CHUNKS_ALWAYS: "expected",
                DIAGONAL_WHOLE: "counted whole", DIAGONAL_WITHOUT_SELF: "its own position too",
                FUTURE_COUNTED: "count nothing"}

CHECKS = [(lab10.online_softmax, ("block_attention", "merge")),
          (lab10.ring_attention, ("ring_attention_forward", "naive_chunks")),
          (lab10.zigzag, ("zigzag_chunks", "shard", "work_per_rank", "ring_attention_forward"))]
# gpt-tiny-sized ring data (B = 2, T = 32, h·hd = 16, fp32) at cp = 4: 3 K/V messages of 2·2·8·16·4 B
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(STEM, CHECKS, (*EX1_MISTAKES, *EX2_MISTAKES, *EX3_MISTAKES),
              words=("yours 6,144 B, target 6,144 B, library 6,144 B", "yours [64, 128, 192, 256]",
                     "[144, 144, 144, 144]", "work per rank [132, 132, 132, 132] (naive [36, 100, 164, 228])",
                     "scores up to 1,000"))


def test_results_for_the_plots(capsys):
    ns = ns10()
    lab10.ring_attention(*ex2(ns))
    lab10.zigzag(*ex3(ns))
    assert lab10.results["ring_attention"]["scores"] == [64, 128, 192, 256]       # naive: r + 1 blocks of 8²
    assert lab10.results["zigzag"]["scores"] == [144] * 4                          # zig-zag: 2cp + 1 blocks of 4²
    assert lab10.results["zigzag"]["send"] == lab10.results["ring_attention"]["send"] == 6144


def test_hints_come_one_at_a_time(capsys):
    names = ("block_attention", "merge", "ring_attention_forward", "zigzag_chunks", "shard", "work_per_rank")
    hints_come_one_at_a_time(lab10.hint, names, capsys)


# ------------------------------------------------------------------------------------ exercise 1 (in this process)
@pytest.mark.parametrize("edits", list(EX1_MISTAKES), ids=list(EX1_MISTAKES.values()))
def test_online_softmax_mistakes(edits):
    fails(lab10.online_softmax, *ex1(ns10(*edits)), words=EX1_MISTAKES[edits])


MERGE_ALIAS = """
from minifsdp.context_parallel import merge_partials as combine


def merge(out_a, lse_a, out_b, lse_b):
    return combine(out_a, lse_a, out_b, lse_b)
"""
HIDDEN_MERGE = """
def merge(out_a, lse_a, out_b, lse_b):
    import importlib
    return getattr(importlib.import_module("minifsdp.context_" + "parallel"), "merge_" + "partials")(
        out_a, lse_a, out_b, lse_b)
"""
HIDDEN_SDPA = """
def block_attention(q, k, v, mask=None):
    fused = getattr(torch.nn.functional, "scaled_dot_" + "product_attention")      # torch's fused attention
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return fused(q, k, v, attn_mask=None if mask is None else ~mask), torch.logsumexp(s, dim=-1)
"""


def test_online_softmax_library_shortcuts():
    message = shortcut_fails(lab10.online_softmax, *ex1(run_cell(ns10(), MERGE_ALIAS)))      # refused statically
    assert "merge_partials" in message, message
    message = shortcut_fails(lab10.online_softmax, *ex1(run_cell(ns10(), HIDDEN_MERGE)))     # only the wire sees it
    assert "merge_partials" in message, message
    message = shortcut_fails(lab10.online_softmax, *ex1(run_cell(ns10(), HIDDEN_SDPA)))      # a C function: the wire
    assert "scaled_dot_product_attention" in message, message


# ------------------------------------------------------------------------------------ exercise 2 (2 and 4 ranks)
@pytest.mark.parametrize("edits", list(EX2_MISTAKES), ids=list(EX2_MISTAKES.values()))
def test_ring_attention_mistakes(edits):
    fails(lab10.ring_attention, *ex2(ns10(*edits)), words=EX2_MISTAKES[edits])


ALL_GATHER = """
def ring_attention_forward(q, k, v, chunks):
    rank, cp = dist.rank(), dist.world_size()
    kv = torch.stack([k, v]).contiguous()
    every = kv.new_empty(cp * 2, *k.shape)
    comm.all_gather_into_tensor(every, kv)             # every rank's K/V at once: right values, not a ring
    n = q.shape[-2]
    out = lse = None
    for src in range(cp):
        if src > rank:
            continue
        o, l = block_attention(q, every[2 * src], every[2 * src + 1], diagonal_mask(n, q) if src == rank else None)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    return out
"""


def test_a_gather_is_not_a_ring():
    fails(lab10.ring_attention, *ex2(run_cell(ns10(), ALL_GATHER)), words="all_gather")


RING_ALIAS = """
from minifsdp.context_parallel import ring_attention as _ring


def ring_attention_forward(q, k, v, chunks):
    return _ring(q, k, v, split="naive")
"""
HIDDEN_RING_STEP = """
def ring_attention_forward(q, k, v, chunks):
    import importlib
    ring = getattr(importlib.import_module("minifsdp.context_" + "parallel.ring"), "Ri" + "ng")()   # the library's step
    rank, cp = dist.rank(), dist.world_size()
    kv, out, lse = torch.stack([k, v]), None, None
    n = q.shape[-2]
    for step in range(cp):
        transfer = ring.pass_along(kv) if step < cp - 1 else None
        src = (rank - step) % cp
        if src <= rank:
            o, l = block_attention(q, kv[0], kv[1], diagonal_mask(n, q) if src == rank else None)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        if transfer is not None:
            kv = transfer.wait()
    return out
"""


def test_ring_attention_library_shortcuts():
    message = shortcut_fails(lab10.ring_attention, *ex2(run_cell(ns10(), RING_ALIAS)))        # refused statically
    assert "ring_attention" in message, message
    message = shortcut_fails(lab10.ring_attention, *ex2(run_cell(ns10(), HIDDEN_RING_STEP)))  # only the wire
    assert "Ring" in message, message
    message = shortcut_fails(lab10.ring_attention, *ex2(run_cell(ns10(), HIDDEN_MERGE)))      # its merge: the wire
    assert "merge_partials" in message, message


# ------------------------------------------------------------------------------------ exercise 3
@pytest.mark.parametrize("edits", list(EX3_MISTAKES), ids=list(EX3_MISTAKES.values()))
def test_zigzag_mistakes(edits):
    fails(lab10.zigzag, *ex3(ns10(*edits)), words=EX3_MISTAKES[edits])


CHUNKS_ALIAS = """
from minifsdp.context_parallel import chunks_of as _held


def zigzag_chunks(rank, cp):
    return _held(rank, cp, "zigzag")
"""
HIDDEN_WORK = """
def work_per_rank(seq_len, cp, chunks):
    import importlib
    split = importlib.import_module("minifsdp.context_" + "parallel.split")
    return getattr(split, "attention_" + "work")(seq_len, cp, "naive" if len(chunks(0, cp)) == 1 else "zigzag")
"""
HIDDEN_SHARD = """
def shard(x, rank, cp, chunks, dim=-2):
    import importlib
    split = importlib.import_module("minifsdp.context_" + "parallel.split")
    name = "naive" if len(chunks(0, cp)) == 1 else "zigzag"
    return getattr(split, "shard_" + "sequence")(x, cp, rank, name, dim=dim)
"""


def test_zigzag_library_shortcuts():
    message = shortcut_fails(lab10.zigzag, *ex3(run_cell(ns10(), CHUNKS_ALIAS)))     # refused statically
    assert "chunks_of" in message, message
    message = shortcut_fails(lab10.zigzag, *ex3(run_cell(ns10(), HIDDEN_SHARD)))     # only the wire sees it
    assert "shard_sequence" in message, message
    message = shortcut_fails(lab10.zigzag, *ex3(run_cell(ns10(), HIDDEN_WORK)))      # only the wire sees it
    assert "attention_work" in message, message


# ------------------------------------------------------------------------------------ the widget's formula
@pytest.mark.parametrize("name, batch, seq", [("gpt-tiny", 2, 32), ("gpt-tiny", 3, 16)])
def test_activation_bytes_at_cp_1_equal_the_saved_tensors(name, batch, seq):
    """At cp = 1 (one process, no ring) ContextParallelGPT keeps exactly activation_bytes; lab 10 measures cp = 2, 4."""
    model = C.context_parallel_gpt(models.build_model(name), None, "zigzag")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randint(0, 256, (batch, seq + 1))
    ids, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()      # as shard_sequence gives them
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(model(ids), targets)
    assert sum(seen.values()) == C.activation_bytes(models.MODEL_PRESETS[name], batch, seq, 1)["total"]
    assert C.ring_buffer_bytes(batch, seq, 32, 1) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
