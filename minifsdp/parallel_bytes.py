"""What each parallel dimension holds and moves: the per-dimension formulas that the planner adds up.

Layer 4 (leaves): plain arithmetic on a ``GPTConfig``; no processes, no model built. One function per
dimension, each exactly what the tracer records for the trainer's strategy (tests/test_planner.py,
tests/test_tensor_parallel_train.py, tests/test_train_cp_ep.py):

    tp   ``tp_param_counts`` (a rank's share of every block), ``tp_comm_bytes`` (Megatron's all-reduces,
         or sequence parallel's all-gathers and reduce-scatters)
    pp   ``pp_comm_bytes`` (the activations and their gradients over each cut between stages)
    cp   ``cp_comm_bytes`` (ring attention's K/V, and dK/dV home)
    ep   ``moe_param_counts`` (a rank's experts), ``ep_comm_bytes`` (the MoE all-to-alls under the uniform
         routing), ``moe_all_to_all_volume`` (exact, for a measured routing)

``planner.plan`` composes them with ``estimate``'s data-parallel formulas; ``planner`` re-exports them, so
``planner.tp_comm_bytes`` and the rest keep their names there.
"""

from __future__ import annotations

from typing import Any

from .models import GPTConfig

__all__ = ["tp_param_counts", "tp_comm_bytes", "pp_comm_bytes", "cp_comm_bytes", "moe_blocks", "moe_param_counts",
           "ep_comm_bytes", "moe_all_to_all_volume"]


def tp_param_counts(config: GPTConfig, tp: int) -> tuple[list[int], int]:
    """Parameters one tensor-parallel rank holds: ``([per block] * L, the rest)`` (FSDP's units and root).

    Per block: the four matrices and the column-parallel biases split, the two
    row-parallel biases and the layer norms whole: ``(12h^2 + 7h)/tp + 6h``.
    """
    d, V = config.n_embd, config.vocab_size
    biases = config.bias
    block = (12 * d * d + (7 * d if biases else 0)) // tp + (6 * d if biases else 2 * d)
    rest = V * d // tp + config.block_size * d + (2 * d if biases else d) + (0 if config.tie_embeddings else V * d // tp)
    return [block] * config.n_layer, rest


def tp_comm_bytes(config: GPTConfig, tokens: int, tp: int, sequence_parallel: bool = False,
                  elem: int = 4, micro_steps: int = 1, forward_elem: int | None = None) -> dict[str, int]:
    """Bytes ``minifsdp.tensor_parallel``'s collectives record per step on one rank (``comm``'s volume).

    ``tokens`` = sequences x length this rank processes per step (N). TP:
    per block 4 all-reduces of N*h (volume 2x): the two row-parallel linears'
    outputs in forward (g) and the two column-parallel inputs' gradients in
    backward (f); then the embedding's g forward, the head's f backward, and the
    cross-entropy's all-reduces of N (max) and 2N (sums). SP: each block
    all-reduce becomes an all-gather + reduce-scatter of N*h, the embedding's
    output is scattered (all-gather backward), the head gathers (reduce-scatter
    backward), and every layer norm's and row bias's gradient is all-reduced
    (h each: 6 per block, 2 for ln_f) once per backward, i.e. ``micro_steps``
    times per step with gradient accumulation.

    Element sizes: ``elem`` for activations, their gradients and the parameters'
    (4 fp32; 2 when the parameters themselves are 16-bit, FSDP's MixedPrecision
    policy). ``forward_elem`` (default ``elem``) for what the blocks' row-parallel
    linears produce: under autocast (``tp --precision bf16``) those outputs are
    bf16 (2) while layer norms, the embedding and every gradient flowing into an
    fp32 tensor stay fp32, so the forward g's carry 2 B and the backward f's 4 B
    (with SP: the forward reduce-scatters and their backward all-gathers). The
    cross-entropy's all-reduces are 4 B always: the loss is computed in fp32.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> tiny = MODEL_PRESETS["gpt-tiny"]                        # L = 2, h = 32; N = 8 x 32 tokens
    >>> tp_comm_bytes(tiny, 256, 2)                             # (8L+4) N h 4 + 6 N 4
    {'all_reduce': 661504}
    >>> tp_comm_bytes(tiny, 256, 2, forward_elem=2)             # autocast: 4L N h 2 + (4L+4) N h 4 + 6 N 4
    {'all_reduce': 530432}
    >>> tp_comm_bytes(tiny, 256, 2, sequence_parallel=True, forward_elem=2)   # the tracer's count, too
    {'all_gather': 262144, 'reduce_scatter': 229376, 'all_reduce': 75264}
    """
    if tp == 1:
        return {}
    L, h, N = config.n_layer, config.n_embd, tokens
    fwd = elem if forward_elem is None else forward_elem
    ce = 2 * N * 4 + 2 * 2 * N * 4
    if not sequence_parallel:
        return {"all_reduce": 4 * L * N * h * fwd + (4 * L + 4) * N * h * elem + ce}
    ln_params = 6 if config.bias else 2  # per block: ln_1, ln_2 (w, b) and two row biases
    final = 2 if config.bias else 1
    # per block: 2 gathers of layer-norm outputs (elem) + 2 of the row outputs' gradients (fwd), and the reverse
    return {"all_gather": (2 * L + 2) * N * h * elem + 2 * L * N * h * fwd,
            "reduce_scatter": (2 * L + 1) * N * h * elem + 2 * L * N * h * fwd,
            "all_reduce": 2 * N * h * elem + 2 * (ln_params * L + final) * h * elem * micro_steps + ce}


def pp_comm_bytes(config: GPTConfig, tokens: int, stages: int, holds: list[int], elem: int = 4) -> dict[str, int]:
    """Bytes a pipeline rank holding stages ``holds`` (of ``stages``) sends and receives per step.

    Every cut between stage s and s + 1 carries the ``(tokens, h)`` activations
    forward and their gradient back, over all micro-batches together: the rank
    holding s sends ``tokens*h*elem`` and receives as much, and so does the one
    holding s + 1 (``comm`` records each side's tensor once). A rank holding
    both sides of a cut moves nothing over it.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> pp_comm_bytes(MODEL_PRESETS["gpt-tiny"], 8 * 32, 2, [0])   # 256 tokens x 32 x 4 B each way
    {'send': 32768, 'recv': 32768}
    """
    one_way = tokens * config.n_embd * elem
    cuts = sum((s in holds) != (s + 1 in holds) for s in range(stages - 1))
    return {"send": cuts * one_way, "recv": cuts * one_way} if cuts else {}


def cp_comm_bytes(config: GPTConfig, batch: int, seq_len: int, cp: int, elem: int = 4) -> dict[str, int]:
    """Bytes one rank's ring attention sends (and as many it receives) per step, every layer, ``batch`` its sequences.

    Per layer (``context_parallel.ring_attention_bytes``): the K/V of the rank's share,
    ``kv = 2 * batch * (T/cp) * h * elem``, travels ``cp - 1`` times forward and
    ``2 (cp - 1)`` times backward (K/V again, then dK/dV back to their owner); the
    same whatever the split (both give every rank T/cp positions) and the number of
    micro-batches (they split ``batch``).

    >>> from minifsdp.models import MODEL_PRESETS
    >>> cp_comm_bytes(MODEL_PRESETS["gpt-tiny"], 2, 32, 4)       # 2 layers x 9 x 4096
    {'send': 73728, 'recv': 73728}
    """
    if cp == 1:
        return {}
    kv = 2 * batch * (seq_len // cp) * config.n_embd * elem
    one_way = config.n_layer * 3 * (cp - 1) * kv
    return {"send": one_way, "recv": one_way}


def moe_blocks(config: GPTConfig) -> list[int]:
    """The indices of the MoE blocks (``GPTConfig.moe_every``)."""
    return [i for i in range(config.n_layer) if config.is_moe_block(i)]


def moe_param_counts(config: GPTConfig, ep: int = 1) -> tuple[list[int], int]:
    """Parameters one rank of an ep group holds: ``([per block], the rest)``, a MoE block with its router
    and ``E / ep`` experts (each a FeedForward, ``8h^2 + 5h`` with biases) in place of the MLP.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> blocks, rest = moe_param_counts(MODEL_PRESETS["gpt-moe-tiny"], ep=2)   # block 1: + router + 3 experts
    >>> blocks, sum(blocks) + rest                                             # 101,600 at ep = 1
    ([12704, 38016], 68192)
    """
    blocks, rest = tp_param_counts(config, 1)
    d = config.n_embd
    mlp = 8 * d * d + (5 * d if config.bias else 0)
    for i in moe_blocks(config):
        blocks[i] += config.n_expert * d + (config.n_expert // ep - 1) * mlp
    return blocks, rest


def ep_comm_bytes(config: GPTConfig, tokens: int, ep: int, elem: int = 4, forwards: int = 1,
                  ring: bool = False) -> dict[str, int]:
    """Bytes one rank's MoE all-to-alls record per step under the uniform routing, ``tokens`` its tokens per step.

    Per MoE layer and forward, the counts all-to-all sends E int64; the dispatch hands
    over the rank's ``tokens * k`` assignments (dropless), the combine the rows its
    experts received, and backward reverses both: 4 all-to-alls of ``tokens * k`` rows
    of h values under the uniform routing (``comm``'s volume: the input, the rows a
    rank keeps for its own experts included). ``ring=True``: what leaves the rank,
    ``(E - E/ep)`` counts and ``tokens * k * (ep-1)/ep`` rows per all-to-all.
    ``forwards``: forwards per step (gradient accumulation's micro-batches).
    """
    if ep == 1 or not config.n_expert:
        return {}
    E, k, h, layers = config.n_expert, config.top_k, config.n_embd, len(moe_blocks(config))
    if ring:
        counts, rows = (E - E // ep) * 8 * forwards, 4 * tokens * k * (ep - 1) * h * elem // ep
    else:
        counts, rows = E * 8 * forwards, 4 * tokens * k * h * elem
    return {"all_to_all": layers * (counts + rows)}


def moe_all_to_all_volume(counts: Any, rank: int, hidden: int, elem: int = 4, forwards: int = 1) -> int:
    """Exactly what rank ``rank``'s all-to-alls of one MoE layer record (``comm``'s volume) for a routing.

    ``counts[s, e]`` ``(ep, E)``: the assignments rank s of the ep group kept for expert e, summed over
    ``forwards`` forwards. The dispatch and the combine's backward reverse hand over the rank's own
    assignments (``A = counts[rank].sum()`` rows), the combine and the dispatch's reverse the rows its
    experts received (``R``, from every rank of the group); each forward adds E int64 counts:
    ``forwards * E * 8 + 2 (A + R) * hidden * elem``. Under the uniform routing R = A (``ep_comm_bytes``).

    >>> import torch
    >>> moe_all_to_all_volume(torch.tensor([[2, 1, 1, 0], [0, 1, 1, 2]]), 0, hidden=8)   # A = 4, R = 4: 32 + 2 x 8 x 32
    544
    """
    ep, E = counts.shape
    mine = counts[:, rank * (E // ep):(rank + 1) * (E // ep)]
    return int(forwards * E * 8 + 2 * (int(counts[rank].sum()) + int(mine.sum())) * hidden * elem)
