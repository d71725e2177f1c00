"""The naive dispatch, beside the all-to-all: every token to every rank, each rank's share of the sum back.

Layer 5 (techniques). ``ExpertParallelMoE(..., dispatcher="all_gather")`` (Megatron-LM's "allgather"
token dispatcher). No counts, no split sizes, the same shapes on every rank:

    rank r: x (N, d); gates (N, E): the router's weight of expert e for token t (0: not chosen or dropped)
      all-gather x and gates          -> every rank holds all ep*N tokens and their weights
      each local expert e             partial[t] += gates[t, e] * expert_e(x[t])  for the tokens chosen for e
      reduce-scatter partial          -> (N, d): the sum over ranks (over experts) for this rank's tokens
    backward: the all-gathers' reverse is a reduce-scatter, the reduce-scatter's an all-gather.

The price is the bytes: a rank receives all ``(ep - 1) * N`` other tokens whatever the routing, and sends
as many partial sums back, ``2 (ep-1) N d`` elements forward against the all-to-all's ``2 (ep-1)/ep N k d``
for a balanced routing: ``ep / k`` times more (4x at ep = 8, k = 2), plus the gates. It also needs every
rank to hold the same number of tokens (the same micro-batch shape). Its use here: an independent second
path the all-to-all must agree with.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from .dispatch import local_expert_ids

__all__ = ["all_gather_apply_experts"]


class _AllGather(torch.autograd.Function):
    """Rows of every rank, concatenated in rank order; backward: sum the gradients, keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, label: dict[str, Any]) -> torch.Tensor:
        ctx.group, ctx.label = group, label
        with comm.annotate(**label, phase="forward"):
            return comm.all_gather(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with comm.annotate(**ctx.label, phase="backward"):
            return comm.reduce_scatter(grad.contiguous(), group=ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """Sum over ranks, keep this rank's rows; backward: every rank's rows' gradient is the one it sent."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, label: dict[str, Any]) -> torch.Tensor:
        ctx.group, ctx.label = group, label
        with comm.annotate(**label, phase="forward"):
            return comm.reduce_scatter(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with comm.annotate(**ctx.label, phase="backward"):
            return comm.all_gather(grad.contiguous(), group=ctx.group), None, None


def all_gather_apply_experts(layer: Any, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                             weight: torch.Tensor) -> torch.Tensor:
    """``ExpertParallelMoE.apply_experts`` by all-gather and reduce-scatter (``layer`` gives the group, the
    experts and the label). Same arguments and result as ``models.MoE.apply_experts``."""
    N, E = x.shape[0], layer.n_expert
    labels = {"unit": layer.label} if layer.label else {}
    # GShard's combine tensor, dense (N, E): a token's kept assignments as weights, zeros elsewhere.
    gates = x.new_zeros(N, E).index_put((token, expert), weight.to(x.dtype))
    chosen = x.new_zeros(N, E).index_put((token, expert), x.new_ones(token.shape))  # which entries are real
    x_all = _AllGather.apply(x, layer.group, dict(labels, exchange="tokens"))
    gates_all = _AllGather.apply(gates, layer.group, dict(labels, exchange="gates"))
    with torch.no_grad(), comm.annotate(**labels, phase="forward", exchange="chosen"):
        chosen_all = comm.all_gather(chosen, group=layer.group)
    partial = x_all.new_zeros(x_all.shape)
    for e, ffn in zip(local_expert_ids(E, layer.ep, layer.ep_rank), layer.experts.values()):
        rows = chosen_all[:, e].nonzero().squeeze(1)  # every rank's tokens for expert e, in batch order
        partial = partial.index_add(0, rows, ffn(x_all[rows]) * gates_all[rows, e, None])
    return _ReduceScatter.apply(partial, layer.group, dict(labels, exchange="outputs"))
