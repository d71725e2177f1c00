"""Cross-entropy over a vocabulary split across ranks, without ever building the full logits.

Layer 5 (techniques). The head is a ``ColumnParallelLinear(d, V,
gather_output=False)``: rank ``r`` holds logits ``z[..., r*V/tp:(r+1)*V/tp]``.
Gathering them would cost ``b*s*V`` floats per rank (for GPT-2's V = 50257
and 8 x 1024 tokens: 1.6 GB in fp32). The loss only needs three numbers per
token, each a reduction over the vocabulary that splits into per-rank parts
(Megatron-LM's ``vocab_parallel_cross_entropy``, FairScale's name):

    m      = max_v z_v                     all-reduce(MAX) of each rank's max      b*s floats
    S      = sum_v exp(z_v - m)            all-reduce(SUM) of each rank's sum      b*s floats
    z_t - m  (the target's shifted logit)  all-reduce(SUM): only its owner adds it b*s floats
    loss   = log S - (z_t - m)

The last two ride in one all-reduce of ``2*b*s`` floats. Backward needs no
communication: ``dloss/dz_v = softmax_v - [v == t]`` and each rank has its own
``softmax_v = exp(z_v - m) / S``.

Unlike FairScale's, the input logits are not modified in place. Memory: the
softmax is computed in place on the one ``(..., V/tp)`` copy the function
owns and is all it keeps for backward, beside the caller's ``target`` (the
per-token target mask is recomputed in backward: as torch's ``loss_parallel``,
no per-token buffer survives the forward); backward scales its one gradient
buffer in place.
"""

from __future__ import annotations

import torch

from .. import comm
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .layers import local_vocab_ids

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        group, tp = get_model_parallel_group(), get_model_parallel_world_size()
        vocab_local = logits.shape[-1]
        start = get_model_parallel_rank() * vocab_local

        logits_max = logits.max(dim=-1).values
        if tp > 1:
            comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # a new tensor: the input stays as it was

        local_target, outside = local_vocab_ids(target, start, vocab_local)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # in place on our own copy: one (..., V/tp) buffer less at the peak
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        if tp > 1:
            comm.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), target)  # softmax, in exp's storage
        ctx.start = start
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, target = ctx.saved_tensors
        local_target, outside = local_vocab_ids(target, ctx.start, softmax.shape[-1])
        grad = softmax.clone()  # not in place: a retained graph may run backward again
        # subtract 1 at the target, on the rank that owns it
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss (``shape == target.shape``, no reduction, the same on every rank).

    ``vocab_parallel_logits``: this rank's contiguous vocabulary slice ``(..., V/tp)``;
    ``target``: global token ids. Take ``.mean()`` for the usual LM loss.
    """
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must be the logits' shape without the last dim "
                         f"{tuple(vocab_parallel_logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
