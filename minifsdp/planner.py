"""The planner: for a GPT and a (dp x pp x tp x cp, ep) layout, bytes per device by category and bytes moved per step.

Layer 4 (leaves): plain arithmetic on top of ``estimate`` (which holds the
formulas for one device and for data parallelism); no processes, no model
built. ``widgets.planner`` puts sliders on it; lab 09 holds it against runs.

What each dimension divides (Ψ = parameters, L layers, b*s tokens per rank,
h = hidden size, V = vocabulary; Megatron-LM, ZeRO and GPipe papers; each
dimension's formulas are in ``parallel_bytes.py``, re-exported here):

    tp   weights of every block, embeddings and head / tp; attention and MLP
         activations / tp (layer-norm inputs too with sequence parallel);
         costs per block 2 all-reduces of b*s*h forward + 2 backward
    pp   the blocks / pp; activations of up to pp micro-batches in flight (1F1B);
         costs a send of b*s*h per boundary and micro-batch, each way
    dp   the batch / dp; with ZeRO stage 1/2/3 the optimizer state / gradients /
         parameters / dp; costs the data-parallel collectives of ``estimate``
    cp   every activation / cp (each rank holds T/cp positions of every sequence),
         and ring attention keeps no T^2 probabilities (its output and log-sum-exp
         instead); costs per layer the ring's K/V, (cp-1) messages of
         2*b*(T/cp)*h forward and 2(cp-1) backward (K/V again, dK/dV home), sent
         and as many received (``cp_comm_bytes``); the gradients are averaged over
         dp x cp
    ep   (inside dp) the experts of every MoE layer / ep; costs per MoE layer 4
         all-to-alls of the rank's b*s*k token assignments (dispatch, combine, and
         their reverses) and one of E counts per forward (``ep_comm_bytes``); the
         replicated gradients are averaged over dp, the experts' summed over the
         dp/ep ranks holding the same experts

    >>> p = plan("gpt-tiny", batch=8, seq_len=32, tp=2)
    >>> p.params_per_device, p.comm["tp"]["all_reduce"]        # 22,176 of 42,880; (8L+4)*N*h*4 + 6*N*4
    (22176, 661504)

The byte counts are exactly what the tracer records for the trainer's ``tp``,
``fsdp+tp`` and ``cp`` strategies (tests/test_planner.py). ``ep``'s all-to-alls
depend on where the router sends the tokens: the plan assumes the uniform
routing, under which each rank receives as many rows as it sends (``tokens*k``
per all-to-all, of which ``tokens*k*(ep-1)/ep`` leave the rank); the dispatch and
its backward reverse are exact whatever the routing (dropless: every assignment
leaves once), the combine and its reverse carry what the rank's experts received,
so a run's mean over the ep ranks equals the plan exactly and each rank differs
by its routing (``moe_all_to_all_volume`` of the measured counts is exact, rank
by rank). The memory is a model (states exact, activations from ``estimate``'s
saved-tensor count, scaled).

    >>> p = plan("gpt-tiny", batch=8, seq_len=32, dp=1, cp=2)
    >>> p.comm["cp"]                          # 2 layers x 3 x (cp-1) x 2*8*16*32*4 B
    {'send': 196608, 'recv': 196608}
    >>> plan("gpt-moe-tiny", batch=8, dp=2, ep=2).comm["ep"]   # 1 MoE layer: 8 counts x 8 B + 4 x 128*2 rows x 128 B
    {'all_to_all': 131136}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import estimate
from .layout import Layout
from .models import MODEL_PRESETS, GPTConfig
from .parallel_bytes import (cp_comm_bytes, ep_comm_bytes, moe_all_to_all_volume, moe_blocks, moe_param_counts,
                             pp_comm_bytes, tp_comm_bytes, tp_param_counts)
from .step_time import Calibration, StepTime, predict_gpt

__all__ = ["Plan", "plan", "tp_param_counts", "tp_comm_bytes", "pp_comm_bytes", "cp_comm_bytes", "ep_comm_bytes",
           "moe_param_counts", "moe_all_to_all_volume"]

_PRECISION = {"fp32": (4, False), "bf16": (2, True), "fp16": (2, True)}


@dataclass
class Plan:
    """Per-device bytes by category (the most loaded device), bytes per step by mesh dimension and, given a
    calibration, the predicted step time and MFU (``step_time``)."""

    config: GPTConfig
    layout: dict[str, Any]
    params_per_device: int
    memory: dict[str, float]
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    time: StepTime | None = None

    @property
    def total_memory(self) -> float:
        """The peak: states, plus the larger of the activations (end of forward) and the gradients
        (end of backward; with ep, and the flat copy its all-reduce makes of them). Measured peaks of the
        trainer's runs sit a few % above it (temporaries)."""
        m = self.memory
        return (m["parameters"] + m["optimizer"] + m.get("gathered parameters", 0) + m.get("gradient buckets", 0)
                + max(m["activations"], m["gradients"] + m.get("flat gradients", 0)))

    def fits(self, cap_bytes: float) -> bool:
        return self.total_memory <= cap_bytes

    def __str__(self) -> str:
        lay = ", ".join(f"{k}={v}" for k, v in self.layout.items())
        lines = [f"plan: {lay}", f"  parameters per device: {self.params_per_device:,}"]
        for k, v in self.memory.items():
            lines.append(f"  {k:<20} {estimate.format_bytes(v):>12}")
        lines.append(f"  {'peak':<20} {estimate.format_bytes(self.total_memory):>12}")
        for dim, ops in self.comm.items():
            txt = ", ".join(f"{op} {estimate.format_bytes(b)}" for op, b in ops.items()) or "nothing"
            lines.append(f"  moved per step over {dim}: {txt}")
        if self.time is not None:
            lines.append(f"  {self.time}")
        return "\n".join(lines)


def plan(model: str | GPTConfig, *, batch: int, seq_len: int | None = None, dp: int = 1, tp: int = 1,
         pp: int = 1, micro_batches: int = 1, precision: str = "fp32", checkpointing: bool = False,
         zero_stage: int = 0, sequence_parallel: bool = False, devices: int | None = None,
         layout: Layout | None = None, cp: int = 1, ep: int = 1, cp_split: str = "zigzag",
         calibration: Calibration | None = None) -> Plan:
    """Predict one device's memory and the bytes each mesh dimension moves per optimizer step.

    ``batch`` is the global batch (sequences per step). ``zero_stage`` applies
    over dp (x cp: 3 = FSDP FULL_SHARD, blocks as units). ``devices`` (optional)
    must equal dp*pp*tp*cp. Peak activations: one micro-batch without a pipeline
    (``micro_batches`` is then gradient accumulation's), up to ``pp`` in flight on the
    first stage with one (1F1B). ``cp`` splits every sequence (``cp_split``'s rule:
    zig-zag cuts 2*cp chunks, naive cp); ``ep`` (a divisor of dp) spreads a MoE GPT's
    experts. ``layout`` (a ``layout.Layout``): its dp, pp, tp, cp and ep instead of the
    keywords, as the trainer runs them. ``calibration`` (``step_time.Calibration.load()``): ``Plan.time``
    predicts the step (``step_time.predict_gpt``).
    """
    if layout is not None:
        dp, pp, tp, cp, ep = layout.dp, layout.pp, layout.tp, layout.cp, layout.ep
    config = MODEL_PRESETS[model] if isinstance(model, str) else model
    seq_len = seq_len or config.block_size
    if min(dp, tp, pp, cp, ep, micro_batches) < 1:
        raise ValueError(f"dp, tp, pp, cp, ep and micro_batches must be >= 1, got {dp}, {tp}, {pp}, {cp}, {ep}, "
                         f"{micro_batches}")
    if devices is not None and devices != dp * tp * pp * cp:
        what = "dp*pp*tp" + ("*cp" if cp > 1 else "")
        raise ValueError(f"{devices} devices but {what} = {dp * pp * tp * cp}; choose sizes whose product is {devices}")
    _check_context_and_experts(config, seq_len, dp, pp, tp, cp, ep, cp_split, zero_stage)
    if batch % (dp * micro_batches):
        raise ValueError(f"batch {batch} must split into dp x micro_batches = {dp * micro_batches}")
    if precision not in _PRECISION:
        raise ValueError(f"precision must be one of {', '.join(_PRECISION)}, got {precision!r}")
    for name, n in (("n_head", config.n_head), ("vocab_size", config.vocab_size)):
        if n % tp:
            raise ValueError(f"{name}={n} is not divisible by tp={tp}; choose a tp that divides {n}")
    if config.n_layer % pp:
        raise ValueError(f"n_layer={config.n_layer} is not divisible by pp={pp}; choose a pp that divides it")
    elem, mixed = _PRECISION[precision]

    blocks, rest = moe_param_counts(config, ep) if config.n_expert else tp_param_counts(config, tp)
    stage_blocks = blocks[: config.n_layer // pp]
    local = sum(stage_blocks) + (rest if pp == 1 else rest - (config.vocab_size * config.n_embd // tp
                                                              if not config.tie_embeddings else 0))
    # the gradients are averaged (and ZeRO shards) over dp x cp: every rank of both holds the same weights
    states = estimate.model_state_bytes_per_device(stage_blocks + [local - sum(stage_blocks)], dp * cp, zero_stage,
                                                   mixed_precision=mixed)
    micro = batch // (dp * micro_batches)
    acts = _activation_bytes(config, micro, seq_len, tp, sequence_parallel, elem, len(stage_blocks), checkpointing,
                             cp)
    in_flight = min(pp, micro_batches) if pp > 1 else 1
    memory = {"parameters": states["parameters"], "gradients": states["gradients"],
              "optimizer": states["optimizer"], "activations": acts * in_flight}
    if cp > 1 and zero_stage == 0:  # the trainer's cp runs DDP, whose flat buckets hold a copy of the gradients
        memory["gradient buckets"] = states["gradients"]
    experts = config.n_expert // ep * _moe_expert_numel(config) * len(moe_blocks(config))  # on this rank
    if ep > 1:  # after backward, the replicated gradients (then the experts') are all-reduced as one flat copy
        memory["flat gradients"] = max(local - experts, experts if dp // ep > 1 else 0) * elem
    if zero_stage == 3 and dp * cp > 1:  # FULL_SHARD keeps the root gathered, and a block plus the prefetched next
        memory["gathered parameters"] = (local - sum(stage_blocks) + 2 * stage_blocks[0]) * (2 if mixed else 4)

    tokens = batch // dp * seq_len
    comm: dict[str, dict[str, float]] = {}
    if tp > 1:
        comm["tp"] = tp_comm_bytes(dataclasses.replace(config, n_layer=len(stage_blocks)), tokens, tp,
                                   sequence_parallel, elem, micro_batches)
    if pp > 1:
        comm["pp"] = {"send": 2 * tokens * config.n_embd * elem, "recv": 2 * tokens * config.n_embd * elem}
    if cp > 1:
        comm["cp"] = cp_comm_bytes(config, batch // dp, seq_len, cp, elem)
    if ep > 1:
        comm["ep"] = ep_comm_bytes(config, tokens, ep, elem, forwards=micro_batches)
    if ep > 1 and dp > 1:  # replicated gradients averaged over dp, the experts' summed over the dp/ep holding them
        comm["dp"] = {"all_reduce": 2 * (local - experts) * elem + (2 * experts * elem if dp // ep > 1 else 0)}
    elif dp * cp > 1:
        strategy = {0: "ddp", 1: "zero1", 2: "zero2", 3: "full_shard"}[zero_stage]
        units = stage_blocks if zero_stage == 3 else sum(stage_blocks)
        root = local - sum(stage_blocks)
        # DDP (and ZeRO-1 on it) broadcasts the buffers before each forward: GPT's causal masks, 1 byte a cell
        # (a context-parallel GPT has none: ring attention keeps no mask)
        buffers = config.n_layer * config.block_size ** 2 if zero_stage in (0, 1) and cp == 1 else 0
        dpc = estimate.comm_bytes_per_step(units, dp * cp, strategy, "fp32" if elem == 4 else "bf16", root_numel=root,
                                           buffer_bytes=buffers)
        dpc.pop("total", None)
        comm["dp"] = {op: b for op, b in dpc.items() if b}
    time = None if calibration is None else predict_gpt(
        calibration, config, batch=batch, seq_len=seq_len, comm=comm, params_per_device=local, dp=dp, tp=tp, pp=pp,
        cp=cp, ep=ep, micro_batches=micro_batches, virtual_stages=layout.virtual_stages if layout else 1,
        precision=precision, checkpoint="full" if checkpointing else "none", zero_stage=zero_stage)
    layout = {"dp": dp, "pp": pp, "tp": tp, **{k: n for k, n in (("cp", cp), ("ep", ep)) if n > 1},
              "micro_batches": micro_batches, "precision": precision, "checkpointing": checkpointing,
              "zero_stage": zero_stage, "sequence_parallel": sequence_parallel}
    return Plan(config, layout, local, memory, comm, time)


def _moe_expert_numel(config: GPTConfig) -> int:
    d = config.n_embd
    return 8 * d * d + (5 * d if config.bias else 0)


def _check_context_and_experts(config: GPTConfig, seq_len: int, dp: int, pp: int, tp: int, cp: int, ep: int,
                               split: str, zero_stage: int) -> None:
    """One-line errors naming the fix for the cp and ep layouts the planner (and the trainer) run."""
    if (cp > 1 or ep > 1 or config.n_expert) and (pp > 1 or tp > 1):
        what = "cp" if cp > 1 else "ep" if ep > 1 else "a mixture-of-experts model"
        raise ValueError(f"{what} is planned with data parallel only (pp = tp = 1), got pp={pp}, tp={tp}; use "
                         "pp=1, tp=1")
    if cp > 1 and (ep > 1 or config.n_expert):
        raise ValueError("context parallel with a mixture-of-experts model is not built (the router's loss balances "
                         "whole sequences); use cp=1 or a dense model")
    if cp > 1 and seq_len % (2 * cp if split == "zigzag" else cp):
        n = 2 * cp if split == "zigzag" else cp
        raise ValueError(f"seq_len {seq_len} is not divisible by {n} (the {split} split cuts {n} chunks); use a "
                         f"multiple of {n}")
    if ep > 1 and not config.n_expert:
        raise ValueError("ep needs a mixture-of-experts model (n_expert > 0): use gpt-moe-tiny or gpt-moe-small")
    if ep > 1 and (config.n_expert % ep or dp % ep):
        raise ValueError(f"ep={ep} must divide n_expert={config.n_expert} and dp={dp} (E/ep experts a rank, ep groups "
                         "inside dp); choose an ep that divides both")
    if ep > 1 and zero_stage:
        raise ValueError("ep is planned with replicated non-expert states (zero_stage=0), as the trainer runs it")


def _activation_bytes(config: GPTConfig, micro: int, seq_len: int, tp: int, sp: bool, elem: int, layers: int,
                      checkpointing: bool, cp: int = 1) -> float:
    """Saved-for-backward bytes of one micro-batch on one rank: ``estimate``'s per-tensor count,
    each tensor divided by tp where tensor parallel splits it (heads, 4h hidden units; with SP the
    layer-norm inputs and statistics). With checkpointing each block keeps only its input
    (b*s*h, / tp with SP) and one block's activations exist during its recompute. With cp every
    term is taken at T/cp positions, and ring attention keeps its output and log-sum-exp
    (b*(T/cp)*h + b*heads*(T/cp)) instead of the probabilities. A MoE block's MLP terms are
    ``_moe_activation_bytes``'s."""
    dtype = "fp32" if elem == 4 else "bf16"
    seq_len //= cp
    per_tensor = estimate.gpt_layer_activation_breakdown(config, micro, seq_len, dtype)
    if cp > 1:
        per_tensor["attention probs"] = 0
        per_tensor["ring attention output, lse"] = micro * seq_len * (config.n_embd + config.n_head) * elem
    split = {"q, k, v", "attention probs", "attn c_proj input", "gelu input", "mlp c_proj input"}
    if sp:
        split |= {"ln_1 input", "ln_1 mean/rstd", "ln_2 input", "ln_2 mean/rstd"}
    layer = sum(v / tp if k in split else v for k, v in per_tensor.items())
    moe = len(moe_blocks(config)) if config.n_expert else 0
    mlp = sum(per_tensor[k] for k in ("c_fc input", "gelu input", "mlp c_proj input"))
    moe_layer = layer - mlp + _moe_activation_bytes(config, micro, seq_len, elem) if moe else layer
    if checkpointing:
        block_input = micro * seq_len * config.n_embd * elem / (tp if sp else 1)
        blocks = layers * block_input + max(layer, moe_layer)
    else:
        blocks = (layers - moe) * layer + moe * moe_layer
    whole = estimate.gpt_activation_bytes(config, micro, seq_len, dtype)
    head = whole["final"] + whole["embedding"] + whole["loss"] / tp
    return blocks + head


def _moe_activation_bytes(config: GPTConfig, batch: int, seq_len: int, elem: int) -> float:
    """What a MoE layer saves for backward on one rank (in place of a FeedForward's 9*b*s*h values), for the
    uniform routing: its ``N = b*s`` tokens make ``A = N*k`` assignments, and its experts receive as many rows.

    The router: its input (N*h), the softmax (N*E), top-k's indices (int64) and weights and their sum
    (N*(k + 1)), and the load-balancing loss's per-sequence fractions (b*E). Each row an expert runs: its input
    (h), GELU's input and the projection's (4h each), its output and the weighted output (2h), its weight,
    and its index (int64; the expert-parallel layer keeps its sort and inverse permutations instead of the
    one process's per-expert masks): ``A * (11h*elem + elem + 8)`` plus ``(E + 1) * A`` bytes of masks.
    Measured with ``saved_tensors_hooks`` on gpt-moe-tiny (one process): the count to the byte."""
    N, h, E, k = batch * seq_len, config.n_embd, config.n_expert, config.top_k
    A = N * k
    router = (N * h + N * E + N * k + N + batch * E) * elem + N * k * 8
    return router + A * (11 * h * elem + elem + 8) + (E + 1) * A
