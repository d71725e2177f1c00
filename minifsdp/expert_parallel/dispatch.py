"""Token dispatch: every assignment travels to the rank holding its expert, and its output travels back.

Layer 5 (techniques). The experts are spread over an expert-parallel (ep) group: rank j holds experts
``j*E/ep .. (j+1)*E/ep - 1`` (``local_expert_ids``). A rank routes its own tokens (the router is
replicated), so after routing it holds a list of *assignments* (token, expert, weight). Three
collectives move them, all ``all_to_all_single`` (torchtitan's and Megatron-LM's "alltoall" dispatcher):

1. **counts** (``exchange_counts``): rank r sends ``counts[e]`` (its assignments to expert e) to the
   rank holding e, so every rank learns how many rows it will receive from each peer, for each of its
   experts: the split sizes of step 2. E int64 per rank, equal chunks.
2. **dispatch** (``all_to_all``): the assignments, sorted by expert (hence by destination rank), go out:
   ``input_split_sizes[j]`` rows to rank j, ``output_split_sizes[s]`` rows in from rank s.
3. **combine**: after the local experts ran, the same call with the split sizes swapped sends every
   output row back to where its token lives.

``all_to_all`` is an autograd Function whose backward is the all-to-all the other way (the splits
swapped), written out below, so backward costs two more all-to-alls: the combine's reverse (output
gradients to the experts) and the dispatch's reverse (input gradients home).

Bytes of one MoE layer, from the routing alone (``moe_all_to_all_bytes``): with ``S[s, j]`` the
assignments rank s sends to rank j's experts, rank r's dispatch sends ``sum_{j != r} S[r, j]`` rows and
its combine ``sum_{s != r} S[s, r]`` rows (``ring_bytes``: what leaves the rank; rows it keeps for its
own experts never touch the network), each ``d * element_size`` bytes; backward repeats both. Over the
group: 4 all-to-alls of the ``tokens * k`` assignments (less the dropped ones) times d, less what stays
local: ``4 * d * element_size * sum_{s != j} S[s, j]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from .. import comm, dist

__all__ = ["all_to_all", "AllToAll", "exchange_counts", "local_expert_ids", "moe_all_to_all_bytes"]


def local_expert_ids(n_expert: int, ep: int, ep_rank: int) -> range:
    """The experts rank ``ep_rank`` of an ep group holds: a contiguous block of ``n_expert / ep``.

    >>> list(local_expert_ids(8, 4, 1))
    [2, 3]
    """
    n_local = n_expert // ep
    return range(ep_rank * n_local, (ep_rank + 1) * n_local)


def exchange_counts(counts: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``received[s, l]``: assignments rank s sends to this rank's ``l``-th expert, from every rank's ``counts``.

    ``counts`` ``(E,)`` int64 is this rank's assignments per expert; chunk j (rank j's experts) goes to
    rank j. Worked example, ep = 2, E = 4: rank 0 counts [2, 1, 1, 0], rank 1 counts [0, 1, 1, 2] ->
    rank 0 receives [[2, 1], [0, 1]] (3 rows from itself, 1 from rank 1), rank 1 [[1, 0], [1, 2]].
    """
    ep = dist.world_size(group)
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts, group=group)
    return received.view(ep, counts.numel() // ep)


class AllToAll(torch.autograd.Function):
    """``forward(x, output_split_sizes, input_split_sizes, group, label) -> rows received``; differentiable.

    Forward: ``input_split_sizes[j]`` rows of ``x`` to rank j, ``output_split_sizes[s]`` rows from rank s.
    Backward: the gradient of row i of the output belongs to the rank that sent row i, so it goes back
    by the same all-to-all with the split sizes swapped; each rank gets exactly its own rows' gradients.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                group: ProcessGroup | None, label: dict[str, Any]) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.label = (output_split_sizes, input_split_sizes), group, label
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
        with comm.annotate(**label, phase="forward"):
            comm.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_split_sizes, input_split_sizes = ctx.splits
        grad_in = grad_out.new_empty((sum(input_split_sizes),) + tuple(grad_out.shape[1:]))
        with comm.annotate(**ctx.label, phase="backward"):  # the reverse: what came in goes back out
            comm.all_to_all_single(grad_in, grad_out.contiguous(), input_split_sizes, output_split_sizes,
                                   group=ctx.group)
        return grad_in, None, None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
               group: ProcessGroup | None = None, **label: Any) -> torch.Tensor:
    """Rows of ``x`` to the ranks of ``group`` by ``input_split_sizes``; the rows received, in rank order.

    ``label`` (e.g. ``unit="blocks.1.mlp", exchange="dispatch"``) goes on the trace spans of both
    directions (``phase`` forward / backward is added).
    """
    return AllToAll.apply(x, list(output_split_sizes), list(input_split_sizes), group, label)


def moe_all_to_all_bytes(counts: torch.Tensor, rank: int, hidden: int, element_size: int = 4) -> dict[str, int]:
    """What rank ``rank``'s all-to-alls of one MoE layer send (``ring_bytes``), from the routing alone.

    ``counts[s, e]`` ``(ep, E)``: the (kept) assignments rank s routes to expert e. Returns the bytes
    leaving this rank for ``counts`` (E int64 less its own E/ep), ``dispatch`` and ``combine`` forward;
    backward sends ``combine``'s rows for the dispatch's reverse and ``dispatch``'s for the combine's.

    >>> c = torch.tensor([[2, 1, 1, 0], [0, 1, 1, 2]])          # ep = 2, E = 4 (the example above)
    >>> moe_all_to_all_bytes(c, 0, hidden=8)                     # sends a (1 row), receives 1 row
    {'counts': 16, 'dispatch': 32, 'combine': 32}
    >>> moe_all_to_all_bytes(c, 1, hidden=8)                     # sends 1 row, receives 1 row
    {'counts': 16, 'dispatch': 32, 'combine': 32}
    """
    ep, E = counts.shape
    S = counts.view(ep, ep, E // ep).sum(-1)  # S[s, j]: rows rank s sends to rank j
    row = hidden * element_size
    return {"counts": (E - E // ep) * 8,
            "dispatch": int(S[rank].sum() - S[rank, rank]) * row,
            "combine": int(S[:, rank].sum() - S[rank, rank]) * row}
