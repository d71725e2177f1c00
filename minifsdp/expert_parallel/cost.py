"""What expert parallel costs one rank, from the sizes alone: model states, and bytes per MoE layer.

Layer 5 (techniques). Two formulas (lab 11's widget moves E, k and ep through them; the lab and
tests/test_labcheck_11.py hold them to measured runs):

* **model states** (``model_states``): every rank holds the replicated parameters (embeddings,
  attention, layer norms, dense MLPs, the routers) and ``E / ep`` of each MoE layer's experts.
  Ψ_rank = Ψ_replicated + Ψ_experts / ep; AdamW in fp32 keeps 16 B for each (4 the parameter, 4 its
  gradient, 8 the two moments), the 16Ψ of lab 01.
* **bytes per MoE layer** (``layer_bytes``): what one rank sends (``ring_bytes``: its own rows never
  leave it) in forward and backward, for ``tokens`` tokens on the rank and a *balanced*, dropless
  routing: each of the ``tokens * k`` assignments lands on each of the ep ranks' experts as often.

  all-to-all (dispatch.py)   counts: (E - E/ep) int64 = 8 (E - E/ep) B
                             dispatch, combine, and their two reverses in backward: 4 x tokens k (ep-1)/ep
                             rows of d values
  all-gather (naive.py)      tokens: all-gather x, reduce-scatter the partial sums, and their two
                             reverses: 4 x (ep-1) tokens rows of d values; gates: all-gather the
                             (tokens, E) weights and reduce-scatter their gradient, and the chosen mask
                             (forward only): 3 x (ep-1) tokens rows of E values

  The ratio of the token bytes is ep / k: the all-gather sends every token to every rank, the
  all-to-all only to the ranks of its k experts. A real routing is not balanced: its bytes are
  ``dispatch.moe_all_to_all_bytes`` of the counts it made.

The all-to-all's figures are the planner's for the trainer's ``ep`` strategy (``planner.moe_param_counts``,
``planner.ep_comm_bytes(..., ring=True)``, summed over the MoE layers; tests/test_labcheck_11.py holds
them equal); here they come per layer, split into replicated and expert parameters, beside the
all-gather's, for one MoE layer's lesson.

>>> from minifsdp.models import MODEL_PRESETS
>>> layer_bytes(tokens=128, k=2, d=32, n_expert=8, ep=2)         # 4 counts x 8 B + 4 x 128 rows x 128 B
{'routing': 32, 'tokens': 65536, 'total': 65568}
>>> [layer_bytes(128, 2, 32, 8, 4, x)["tokens"] for x in ("all_to_all", "all_gather")]   # ep / k = 2
[98304, 196608]
>>> model_states(MODEL_PRESETS["gpt-moe-tiny"], ep=2)["parameters"]  # 101,600 less half of 8 x 8,352
68192
"""

from __future__ import annotations

import torch

from .. import models

__all__ = ["model_states", "layer_bytes", "BYTES_PER_PARAMETER"]

BYTES_PER_PARAMETER = 16  # fp32 parameter 4 + gradient 4 + AdamW's two moments 8


def model_states(config: models.GPTConfig, ep: int, bytes_per_parameter: int = BYTES_PER_PARAMETER
                 ) -> dict[str, int]:
    """One rank's parameters and model-state bytes for a MoE GPT on an ep group of ``ep`` ranks.

    Returns ``replicated`` and ``experts`` (parameters on this rank), ``parameters`` (their sum),
    ``experts_total`` (every expert of the model) and ``bytes`` (``bytes_per_parameter`` each).
    """
    if not config.n_expert:
        raise ValueError("model_states needs a mixture-of-experts GPT (n_expert > 0)")
    if config.n_expert % ep:
        raise ValueError(f"n_expert={config.n_expert} is not divisible by ep={ep}")
    with torch.device("meta"):
        model = models.GPT(config)
    experts = sum(p.numel() for m in model.modules() if isinstance(m, models.MoE) for p in m.experts.parameters())
    replicated = sum(p.numel() for p in model.parameters()) - experts
    mine = experts // ep
    return {"replicated": replicated, "experts": mine, "parameters": replicated + mine, "experts_total": experts,
            "bytes": bytes_per_parameter * (replicated + mine)}


def layer_bytes(tokens: int, k: int, d: int, n_expert: int, ep: int, dispatcher: str = "all_to_all",
                element_size: int = 4) -> dict[str, int]:
    """Ring bytes one rank sends for one MoE layer, forward and backward, balanced dropless routing.

    ``tokens``: the tokens on this rank (its sequences x their length). Returns ``counts`` (the
    all-to-all's counts; the all-gather's gates and mask), ``tokens`` (the rows of activations and their
    gradients) and ``total``.
    """
    if n_expert % ep:
        raise ValueError(f"n_expert={n_expert} is not divisible by ep={ep}")
    if dispatcher == "all_to_all":
        side = (n_expert - n_expert // ep) * 8
        rows = 4 * tokens * k * (ep - 1) * d * element_size // ep
    elif dispatcher == "all_gather":
        side = 3 * (ep - 1) * tokens * n_expert * element_size
        rows = 4 * (ep - 1) * tokens * d * element_size
    else:
        raise ValueError(f"dispatcher={dispatcher!r} is not 'all_to_all' or 'all_gather'")
    return {"routing": side, "tokens": rows, "total": side + rows}
