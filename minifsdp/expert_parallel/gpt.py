"""A mixture-of-experts GPT on an expert-parallel group: this rank's experts, everything else replicated.

Layer 5 (techniques). ``expert_parallel_gpt(model, ep_group)`` turns every ``models.MoE`` of a MoE GPT
(``gpt-moe-tiny``, ``gpt-moe-small``) into an ``ExpertParallelMoE`` holding this rank's ``E / ep``
experts, in place; the embeddings, attention, layer norms, dense MLPs and routers stay whole on every
rank. The same parameter objects stay, so build the optimizer after the conversion.

Data layout: the ep ranks are also data-parallel ranks (DeepSpeed-MoE, Megatron-LM, torchtitan). Each
holds its own slice of the global batch, whole sequences, the same number on every rank:

    global batch (B sequences)   rank r of ep takes sequences r*B/ep .. (r+1)*B/ep - 1
    forward    replicated layers on its own sequences; at each MoE layer its tokens' assignments go to
               the experts' ranks and come back (dispatch.py)
    loss       lm_loss(logits, y) + model.aux_loss(), this rank's mean; the global batch's loss is the
               mean over ranks (``global_loss``)
    backward   the all-to-alls in reverse carry the output gradients to the experts and the input
               gradients home
    gradients  ``all_reduce_gradients``: replicated parameters averaged over the group (one flat
               all-reduce, as DDP); an expert's gradient is already the sum over every rank's tokens
               routed to it (its own rank's backward received them all), so it is only divided by ep,
               the same 1/ep the average applies (Megatron-LM scales expert gradients by 1/dp likewise)

Then every rank's gradients are those of the global batch's loss, and AdamW steps give the parameters one
process would have (tests/test_expert_parallel.py: ep = 2 and 4, rel 1e-5). With more data-parallel ranks
than ep (dp = ep x edp: the trainer's ``--strategy ep --ep 2 --world-size 4``), pass the dp group and the
expert data-parallel group (the ranks holding the same experts, ``DeviceMesh(dp=4, ep=2)``'s ``edp``):
replicated gradients are averaged over dp, expert gradients summed over edp and divided by dp.

API for a trainer::

    model = expert_parallel_gpt(build_model("gpt-moe-tiny"), ep_group)
    opt = torch.optim.AdamW(model.parameters(), ...)
    x_r, y_r = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]     # b = B / ep sequences per rank
    loss = lm_loss(model(x_r), y_r) + model.aux_loss()
    loss.backward()
    all_reduce_gradients(model, ep_group)
    opt.step(); opt.zero_grad()
    global_loss(loss, ep_group)                                # for logging; routing_stats for drops
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup, ReduceOp

from .. import comm, dist, models
from .moe_layer import DISPATCHERS, ExpertParallelMoE, check_divisible

__all__ = ["expert_parallel_gpt", "check_expert_parallel", "expert_parameters", "replicated_parameters",
           "all_reduce_gradients", "global_loss"]


def check_expert_parallel(config: models.GPTConfig, ep: int) -> None:
    """One-line errors, naming the fix, for a GPT whose experts cannot be spread over ``ep`` ranks.

    (``top_k > n_expert`` is refused earlier, by ``GPTConfig`` itself.)
    """
    if not config.n_expert:
        raise ValueError("expert parallel needs a mixture-of-experts GPT, and this one has n_expert=0; build "
                         "gpt-moe-tiny or gpt-moe-small, or pass n_expert=E")
    check_divisible(config.n_expert, ep)


def expert_parallel_gpt(model: models.GPT, ep_group: ProcessGroup | None = None,
                        dispatcher: str = "all_to_all") -> models.GPT:
    """``model`` with each MoE layer holding only this rank's experts of ``ep_group`` (in place; returned).

    ``dispatcher``: ``"all_to_all"`` (the default) or ``"all_gather"`` (the naive one, naive.py).
    """
    if not isinstance(model, models.GPT):
        raise TypeError(f"expert_parallel_gpt takes a minifsdp.models.GPT, got {type(model).__name__}")
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher={dispatcher!r} is not one of {DISPATCHERS}")
    dist.require_group(ep_group, "expert_parallel_gpt's ep_group")
    check_expert_parallel(model.config, dist.world_size(ep_group))
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, models.MoE) and not isinstance(child, ExpertParallelMoE):
                label = f"{name}.{child_name}" if name else child_name
                setattr(parent, child_name, ExpertParallelMoE(child, ep_group, dispatcher, label=label))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of this rank's experts (different on every rank of the ep group)."""
    return [p for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()]


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter: the same on every rank of the ep group (routers included)."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


@torch.no_grad()
def all_reduce_gradients(model: nn.Module, ep_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None,
                         expert_dp_group: ProcessGroup | None = None) -> None:
    """The global batch's gradients on every rank: replicated ones averaged over ``ep_group`` (one flat
    all-reduce), expert ones divided by ep (they already hold every rank's tokens' contributions).

    ep inside a larger dp: replicated ones averaged over ``dp_group`` (every data-parallel rank), expert
    ones summed over ``expert_dp_group`` (the ranks holding the same experts; one flat all-reduce) and
    divided by dp. There an expert no token reached in its ep group gets a zero gradient before the sum
    (every rank of the edp group must send the same sizes), so one that no token of the whole batch reached
    gets a zero gradient where one process leaves None (AdamW then decays it).
    """
    group = ep_group if dp_group is None else dp_group
    dp = dist.world_size(group)
    if dp == 1:
        return
    comm.all_reduce_flat([p.grad for p in replicated_parameters(model) if p.grad is not None], group, average=True)
    experts = expert_parameters(model)
    if expert_dp_group is not None and dist.world_size(expert_dp_group) > 1:
        for p in experts:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        comm.all_reduce_flat([p.grad for p in experts], expert_dp_group)
    for p in experts:
        if p.grad is not None:
            p.grad /= dp


@torch.no_grad()
def global_loss(local_loss: torch.Tensor, ep_group: ProcessGroup | None = None) -> torch.Tensor:
    """The global batch's mean loss (for logging): the average of the ranks' mean losses."""
    out = local_loss.detach().clone()
    comm.all_reduce(out, ReduceOp.SUM, group=ep_group)
    return out / dist.world_size(ep_group)
