"""What one rank of a cp group holds: the activations of its share of the sequence, and the ring's K/V buffers.

Layer 5 (techniques), formulas only. Lab 01's terms for one ``Block`` on ``[B, T, d]``
(``estimate.gpt_layer_activation_breakdown``) are ``16·B·T·d + 4·B·T`` values that
grow with T, and ``B·h·T²`` attention probabilities that grow with its square.
A rank of ``context_parallel_gpt`` runs every layer on ``T/cp`` positions, so
each of those terms is taken at ``T/cp``; and its attention is ring attention,
which never keeps the probabilities (the online softmax recomputes them in
backward from the saved log-sum-exp). In their place ``RingAttention`` keeps its
output (``B·(T/cp)·d`` values: ``c_proj`` keeps a contiguous copy of it as well)
and one lse per query row and head (``B·h·T/cp``)::

    per layer, one rank:   17·B·(T/cp)·d + 4·B·(T/cp) + B·h·(T/cp)        (no T² term)
    full attention, cp=1:  16·B·T·d      + 4·B·T      + B·h·T²            (lab 01)

Outside the blocks (ids, positions, ``ln_f``, the head's input, the loss's
log-probabilities and targets) every term is lab 01's at ``T/cp``. Worked
example, gpt-tiny (d = 32, h = 2, L = 2, V = 256), B = 2, T = 32, cp = 2, fp32:
per layer 4·(17·1024 + 128 + 64) = 70,400 B; embedding 384, final 8,448, loss
33,028; total 182,660 B per rank, what ``saved_tensors_hooks`` sees (the tests
and lab 10 measure it with the memory tracker).

The ring: while a rank computes on the K/V it holds, the next rank's arrive, so
it needs room for two K/V pairs of its share, ``2 · 2·B·(T/cp)·d`` values, one
layer at a time (``ring_buffer_bytes``; none at cp = 1).

    >>> from minifsdp.models import MODEL_PRESETS
    >>> activation_bytes(MODEL_PRESETS["gpt-tiny"], 2, 32, 2)["total"]
    182660
    >>> ring_buffer_bytes(2, 32, 32, 2)
    16384
"""

from __future__ import annotations

from ..estimate import DType, dtype_bytes, gpt_activation_bytes
from ..models import GPTConfig
from .split import check_sequence_length

__all__ = ["activation_bytes", "ring_buffer_bytes"]


def activation_bytes(config: GPTConfig, batch: int, seq_len: int, cp: int, dtype: DType = "fp32",
                     split: str = "zigzag") -> dict[str, int]:
    """Bytes one rank of ``context_parallel_gpt`` keeps for backward, by part (``estimate.gpt_activation_bytes``'s
    keys, each for the rank's ``seq_len / cp`` positions, ring attention's terms in ``per_layer``)."""
    check_sequence_length(seq_len, cp, split)
    b, t = dtype_bytes(dtype), seq_len // cp
    out = gpt_activation_bytes(config, batch, t, dtype)
    probabilities = batch * config.n_head * t * t * b           # kept by softmax: not by ring attention
    ring = (batch * t * config.n_embd + batch * config.n_head * t) * b   # RingAttention's output and lse
    out["per_layer"] += ring - probabilities
    out["layers"] = config.n_layer * out["per_layer"]
    out["total"] = out["embedding"] + out["layers"] + out["final"] + out["loss"]
    return out


def ring_buffer_bytes(batch: int, seq_len: int, width: int, cp: int, element_size: int = 4) -> int:
    """Room for the K/V pair a rank computes on and the pair arriving: ``2 x 2·B·(T/cp)·width`` elements."""
    if cp == 1:
        return 0
    return 2 * 2 * batch * (seq_len // cp) * width * element_size
