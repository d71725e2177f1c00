"""An expert-parallel MoE layer: the router replicated, ``E / ep`` experts on each rank of the ep group.

Layer 5 (techniques). ``ExpertParallelMoE(moe, group)`` is ``models.MoE`` with one step replaced: the
routing (router, top-k, load-balancing loss, capacity) is inherited unchanged and runs on this rank's
tokens; ``apply_experts`` sends each assignment to its expert's rank instead of looping over local
experts (Megatron-LM's ``MoELayer`` with the "alltoall" token dispatcher; torchtitan's expert parallel):

    assignments (token, expert, weight)      sorted by expert: contiguous per destination rank
      -> counts all-to-all                   how many rows come from each rank, for each local expert
      -> dispatch all-to-all                 x[token] rows to their expert's rank
      -> local experts                       rows grouped by expert, each expert runs once
      -> combine all-to-all                  output rows back (split sizes swapped)
      -> out[token] += weight * output       the router's weights mix them, as in models.MoE

Dropless: every assignment is computed, so the layer's output equals ``models.MoE`` on the same tokens
(up to the order of floating-point sums; tests/test_expert_parallel.py holds it to 1e-5). The rows an
expert receives come source rank by source rank, each in token order: with the ranks holding
consecutive slices of the batch, that is the global batch's token order, the order the single process
feeds each expert.

``dispatcher="all_gather"`` swaps in the naive exchange of ``naive.py`` (every token to every rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist, models
from .dispatch import all_to_all, exchange_counts, local_expert_ids
from .naive import all_gather_apply_experts

__all__ = ["ExpertParallelMoE", "DISPATCHERS"]

DISPATCHERS = ("all_to_all", "all_gather")


class ExpertParallelMoE(models.MoE):
    """``models.MoE`` holding only this rank's experts (``experts["e"]`` for its global ids e).

    ``ExpertParallelMoE(moe, group)`` takes ``moe``'s router and this rank's experts (the same modules,
    so the same parameters); the other experts are left to the other ranks. Parameter names stay those of
    the single-process layer (``experts.2.c_fc.weight`` is expert 2 on every rank that holds it), so a
    rank's state dict is a subset of the full model's.
    """

    def __init__(self, moe: models.MoE, group: ProcessGroup | None = None, dispatcher: str = "all_to_all",
                 label: str | None = None) -> None:
        # nn.Module's constructor, not MoE's: MoE would build all E experts; the routing fields are moe's.
        nn.Module.__init__(self)
        ep, ep_rank = dist.world_size(group), dist.rank(group)
        check_divisible(moe.n_expert, ep)
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={dispatcher!r} is not one of {DISPATCHERS}")
        self.n_expert, self.top_k = moe.n_expert, moe.top_k
        self.aux_loss_coef, self.capacity_factor = moe.aux_loss_coef, moe.capacity_factor
        self.group, self.ep, self.ep_rank, self.n_local = group, ep, ep_rank, moe.n_expert // ep
        self.dispatcher, self.label = dispatcher, label
        self.router = moe.router  # replicated: every rank routes its own tokens
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in local_expert_ids(moe.n_expert, ep, ep_rank)})
        self.aux_loss = self.tokens_per_expert = self.dropped_per_expert = None

    def extra_repr(self) -> str:
        return f"ep={self.ep}, ep_rank={self.ep_rank}, n_expert={self.n_expert}, top_k={self.top_k}, " \
               f"dispatcher={self.dispatcher!r}"

    def apply_experts(self, x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
        """``out[t] = sum of weight[i] * expert[i](x[t])`` over the assignments of token t (see models.MoE),
        each expert running on the rank that holds it."""
        if self.dispatcher == "all_gather":
            return all_gather_apply_experts(self, x, token, expert, weight)
        labels = {"unit": self.label} if self.label else {}
        # Sorted by expert, hence by destination rank; stable, so each expert's rows stay in token order.
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.n_expert)          # (E,) rows for each expert
        with comm.annotate(**labels, phase="forward", exchange="counts"):
            received = exchange_counts(counts, self.group)                # (ep, E/ep) rows from s for my l
        send = counts.view(self.ep, self.n_local).sum(dim=1).tolist()     # rows to rank j
        recv = received.sum(dim=1).tolist()                               # rows from rank s
        x_in = all_to_all(x[token], recv, send, self.group, **labels, exchange="dispatch")
        y_in = self.run_local_experts(x_in, received)
        y = all_to_all(y_in, send, recv, self.group, **labels, exchange="combine")
        return x.new_zeros(x.shape).index_add(0, token, (y * weight[:, None]).to(x.dtype))

    def run_local_experts(self, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received; the outputs in the rows' order (for the combine).

        ``rows`` arrive source by source, each source's block expert by expert: ``received[s, l]`` rows
        from rank s for local expert l. A stable sort groups them by expert (Megatron-LM's
        ``sort_chunks_by_idxs``: every expert one contiguous chunk, as a grouped GEMM wants), each expert
        runs once, and the inverse permutation puts the outputs back. Worked example, rank 0 of the picture
        in ``__init__.py``: ``received = [[2, 1], [0, 1]]``, rows [a b b | c] (from rank 0 | rank 1), local
        experts of the rows [0 0 1 | 1]: expert 0 runs on [a, b], expert 1 on [b, c].
        """
        expert_of_row = torch.arange(self.n_local, device=rows.device).repeat(self.ep)
        expert_of_row = expert_of_row.repeat_interleave(received.reshape(-1))
        by_expert = torch.argsort(expert_of_row, stable=True)
        chunks = rows[by_expert].split(received.sum(dim=0).tolist())
        outputs = torch.cat([ffn(chunk) for ffn, chunk in zip(self.experts.values(), chunks)])
        return outputs[torch.argsort(by_expert)]


def check_divisible(n_expert: int, ep: int) -> None:
    """One line naming the fix when ``n_expert`` experts cannot be spread evenly over ``ep`` ranks."""
    if n_expert % ep:
        raise ValueError(f"n_expert={n_expert} is not divisible by ep={ep} (each rank holds n_expert/ep experts); "
                         f"choose an ep that divides {n_expert}, or a multiple of {ep} experts")
