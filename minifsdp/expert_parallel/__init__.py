"""Expert parallelism: a mixture-of-experts GPT's experts spread over ranks, tokens sent to them by all-to-all.

A MoE layer (``models.MoE``) has E experts but each token uses only k of them: E times the MLP's
parameters for k times its FLOPs. Expert parallelism (GShard, Lepikhin et al. 2020; Switch Transformer,
Fedus et al. 2021; DeepSpeed-MoE; Megatron-LM's ``--expert-model-parallel-size``; torchtitan) gives each
rank of an ep group ``E / ep`` experts and keeps the rest of the model replicated; the ranks are also
data-parallel ranks, each with its own sequences. At every MoE layer each rank routes its own tokens,
sends every (token, expert) assignment to the rank holding the expert, runs its experts on what it
received, and sends the outputs back, where the router's weights mix them.

Read in this order:

1. ``models.MoE`` - the single-process reference: router, top-k, the load-balancing loss, the capacity
   factor, and ``apply_experts``, a loop over the experts (the step expert parallel replaces).
2. ``dispatch.py`` - the counts all-to-all, the differentiable token all-to-all (backward: the reverse
   all-to-all, written out), the bytes of one layer from the routing.
3. ``moe_layer.py`` - ``ExpertParallelMoE``: sort by expert, counts, dispatch, local experts, combine, mix.
4. ``naive.py`` - the all-gather dispatch beside it: every token to every rank; simpler, ep/k x the bytes.
5. ``capacity.py`` - the capacity factor under ep: dropped at the source per sequence, counted.
6. ``gpt.py`` - ``expert_parallel_gpt``, the data layout, the gradients (replicated averaged, experts
   complete), the trainer's API.

The dispatch for ep = 2, E = 4, k = 2 (rank 0 holds experts 0 and 1, rank 1 holds 2 and 3; rank 0 has
tokens a, b and rank 1 c, d; the replicated router picks a -> 0, 2   b -> 1, 0   c -> 3, 1   d -> 2, 3)::

                        rank 0                              rank 1
    assignments         (a,0) (a,2) (b,1) (b,0)             (c,3) (c,1) (d,2) (d,3)
    sorted by expert    a b b | a      (experts 0 0 1 | 2)  c | d c d      (experts 1 | 2 3 3)
    counts per expert   [2, 1, 1, 0]   send [3, 1]          [0, 1, 1, 2]   send [1, 3]
    counts all-to-all   [[2, 1], [0, 1]]   recv [3, 1]      [[1, 0], [1, 2]]   recv [1, 3]

    dispatch            [a b b | a]  a b b stay, a -> r1    [c | d c d]  c -> r0, d c d stay
    received            [a b b | c]  (from r0 | from r1)    [a | d c d]  (from r0 | from r1)
    local experts       e0(a) e0(b) | e1(b) e1(c)           e2(a) e2(d) | e3(c) e3(d)
    combine             the same all-to-all, split sizes swapped: every output row goes home
    back home           [e0(a) e0(b) e1(b) | e2(a)]         [e1(c) | e2(d) e3(c) e3(d)]
    mix                 y_a = w_a0 e0(a) + w_a2 e2(a)       y_c = w_c3 e3(c) + w_c1 e1(c)
                        y_b = w_b1 e1(b) + w_b0 e0(b)       y_d = w_d2 e2(d) + w_d3 e3(d)

Each rank sends one row each way (rank 0: a out, e1(c) back) and keeps three for its own experts;
backward runs the two all-to-alls again in reverse (output gradients to the experts, input gradients
home). Per layer over the group: 4 all-to-alls of the tokens x k x d assignments, less what stays local.

API for a trainer (gpt.py has the data layout)::

    model = expert_parallel_gpt(build_model("gpt-moe-tiny"), ep_group)   # in place: this rank's experts
    loss = lm_loss(model(x_r), y_r) + model.aux_loss()                    # x_r: this rank's sequences
    loss.backward()
    all_reduce_gradients(model, ep_group)          # replicated averaged, experts / ep
    opt.step()
    global_loss(loss, ep_group); routing_stats(model, ep_group)   # logging: mean loss, dropped tokens
"""

from .capacity import capacity_mask, expert_capacity, max_rows_per_expert, routing_stats
from .dispatch import AllToAll, all_to_all, exchange_counts, local_expert_ids, moe_all_to_all_bytes
from .gpt import (all_reduce_gradients, check_expert_parallel, expert_parallel_gpt, expert_parameters, global_loss,
                  replicated_parameters)
from .moe_layer import DISPATCHERS, ExpertParallelMoE, check_divisible
from .naive import all_gather_apply_experts

__all__ = ["expert_parallel_gpt", "ExpertParallelMoE", "check_expert_parallel", "check_divisible", "DISPATCHERS",
           "all_reduce_gradients", "global_loss", "expert_parameters", "replicated_parameters",
           "all_to_all", "AllToAll", "exchange_counts", "local_expert_ids", "moe_all_to_all_bytes",
           "all_gather_apply_experts", "expert_capacity", "capacity_mask", "max_rows_per_expert", "routing_stats"]
