"""The capacity factor under expert parallel: dropped where routed, never sent, counted over the group.

Layer 5 (techniques). With ``capacity_factor=cf`` every expert takes at most
``C = models.expert_capacity(T, k, E, cf) = ceil(cf * T * k / E)`` assignments from each sequence of T
tokens: the first C in position order (``models.capacity_mask``; token t before t+1, a token's slots
best first). The others are dropped: they contribute nothing, and the block's residual carries their
token on. Worked example, T = 16, k = 2, E = 8, cf = 1.0: C = 4, so a sequence's 32 assignments fit
exactly when spread evenly, and an expert asked 6 times by one sequence drops the last 2 of them.

Under expert parallel:

* **Where it is decided**: at the source, before the dispatch, from the routing alone. A rank holds
  whole sequences, so it needs nothing from its peers, and a dropped assignment never crosses the
  network: the dispatch and the combine (and both backward) shrink by its row.
* **The same as one process**: capacity per *sequence* (GShard's groups, one sequence each) does not
  depend on how the batch is split over ranks or micro-batches, so with a capacity factor the layer
  still equals one process (tests/test_expert_parallel.py runs both). Per-batch capacity (Switch
  Transformer's per-core batches, Megatron-LM's per micro-batch) would drop other tokens at every ep.
* **What it buys**: a bound known before routing. An expert receives at most ``sequences * C`` rows
  from the whole group whatever the router does (dropless: up to every token, ``sequences * T``), so
  its buffer and the all-to-all's worst case can be sized in advance (``max_rows_per_expert``). GShard
  and DeepSpeed-MoE go further and pad every expert to exactly C, so the all-to-all has fixed shapes and
  needs no counts; here the counts still travel and only real rows are sent.
* **Counted**: each layer keeps ``tokens_per_expert`` (asked for) and ``dropped_per_expert`` (over
  capacity) for this rank's tokens of the last forward; ``routing_stats(model, group)`` sums them over
  the group, layer by layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist, models
from ..models import capacity_mask, expert_capacity

__all__ = ["expert_capacity", "capacity_mask", "max_rows_per_expert", "routing_stats"]


def max_rows_per_expert(sequences: int, seq_len: int, k: int, n_expert: int,
                        capacity_factor: float | None = None) -> int:
    """Most rows one expert can receive from ``sequences`` sequences of ``seq_len`` tokens.

    >>> max_rows_per_expert(8, 16, 2, 8, 1.0), max_rows_per_expert(8, 16, 2, 8)   # 8 * C, 8 * T
    (32, 128)
    """
    if capacity_factor is None:  # a token picks an expert at most once
        return sequences * seq_len
    return sequences * min(seq_len, expert_capacity(seq_len, k, n_expert, capacity_factor))


@torch.no_grad()
def routing_stats(model: nn.Module, group: ProcessGroup | None = None) -> dict[str, dict[str, list[int]]]:
    """``{layer: {"routed": per expert, "dropped": per expert}}`` of the last forward, summed over ``group``.

    One all-reduce for all layers (none without a process group). ``sum(stats[layer]["dropped"])`` is the
    layer's dropped assignments over the ep group's batch, the number one process counts for it.
    """
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, models.MoE) and m.tokens_per_expert is not None}
    if not layers:
        return {}
    counts = torch.stack([torch.stack([m.tokens_per_expert, m.dropped_per_expert]) for m in layers.values()])
    if dist.is_initialized() and dist.world_size(group) > 1:
        comm.all_reduce(counts, group=group)
    return {name: {"routed": c[0].tolist(), "dropped": c[1].tolist()} for name, c in zip(layers, counts)}
