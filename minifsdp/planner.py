"""The planner: for a GPT and a (dp x pp x tp) layout, bytes per device by category and bytes moved per step.

Layer 4 (leaves): plain arithmetic on top of ``estimate`` (which holds the
formulas for one device and for data parallelism); no processes, no model
built. ``widgets.planner`` puts sliders on it; lab 09 holds it against runs.

What each dimension divides (Ψ = parameters, L layers, b*s tokens per rank,
h = hidden size, V = vocabulary; Megatron-LM, ZeRO and GPipe papers):

    tp   weights of every block, embeddings and head / tp; attention and MLP
         activations / tp (layer-norm inputs too with sequence parallel);
         costs per block 2 all-reduces of b*s*h forward + 2 backward
    pp   the blocks / pp; activations of up to pp micro-batches in flight (1F1B);
         costs a send of b*s*h per boundary and micro-batch, each way
    dp   the batch / dp; with ZeRO stage 1/2/3 the optimizer state / gradients /
         parameters / dp; costs the data-parallel collectives of ``estimate``

    >>> p = plan("gpt-tiny", batch=8, seq_len=32, tp=2)
    >>> p.params_per_device, p.comm["tp"]["all_reduce"]        # 22,176 of 42,880; (8L+4)*N*h*4 + 6*N*4
    (22176, 661504)

The byte counts are exactly what the tracer records for the trainer's ``tp``
and ``fsdp+tp`` strategies (tests/test_planner.py); the memory is a model
(states exact, activations from ``estimate``'s saved-tensor count, scaled).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import estimate
from .layout import Layout
from .models import MODEL_PRESETS, GPTConfig

__all__ = ["Plan", "plan", "tp_param_counts", "tp_comm_bytes", "pp_comm_bytes"]

_PRECISION = {"fp32": (4, False), "bf16": (2, True), "fp16": (2, True)}


def tp_param_counts(config: GPTConfig, tp: int) -> tuple[list[int], int]:
    """Parameters one tensor-parallel rank holds: ``([per block] * L, the rest)`` (FSDP's units and root).

    Per block: the four matrices and the column-parallel biases split, the two
    row-parallel biases and the layer norms whole: ``(12h^2 + 7h)/tp + 6h``.
    """
    d, V = config.n_embd, config.vocab_size
    biases = config.bias
    block = (12 * d * d + (7 * d if biases else 0)) // tp + (6 * d if biases else 2 * d)
    rest = V * d // tp + config.block_size * d + (2 * d if biases else d) + (0 if config.tie_embeddings else V * d // tp)
    return [block] * config.n_layer, rest


def tp_comm_bytes(config: GPTConfig, tokens: int, tp: int, sequence_parallel: bool = False,
                  elem: int = 4, micro_steps: int = 1, forward_elem: int | None = None) -> dict[str, int]:
    """Bytes ``minifsdp.tensor_parallel``'s collectives record per step on one rank (``comm``'s volume).

    ``tokens`` = sequences x length this rank processes per step (N). TP:
    per block 4 all-reduces of N*h (volume 2x): the two row-parallel linears'
    outputs in forward (g) and the two column-parallel inputs' gradients in
    backward (f); then the embedding's g forward, the head's f backward, and the
    cross-entropy's all-reduces of N (max) and 2N (sums). SP: each block
    all-reduce becomes an all-gather + reduce-scatter of N*h, the embedding's
    output is scattered (all-gather backward), the head gathers (reduce-scatter
    backward), and every layer norm's and row bias's gradient is all-reduced
    (h each: 6 per block, 2 for ln_f) once per backward, i.e. ``micro_steps``
    times per step with gradient accumulation.

    Element sizes: ``elem`` for activations, their gradients and the parameters'
    (4 fp32; 2 when the parameters themselves are 16-bit, FSDP's MixedPrecision
    policy). ``forward_elem`` (default ``elem``) for what the blocks' row-parallel
    linears produce: under autocast (``tp --precision bf16``) those outputs are
    bf16 (2) while layer norms, the embedding and every gradient flowing into an
    fp32 tensor stay fp32, so the forward g's carry 2 B and the backward f's 4 B
    (with SP: the forward reduce-scatters and their backward all-gathers). The
    cross-entropy's all-reduces are 4 B always: the loss is computed in fp32.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> tiny = MODEL_PRESETS["gpt-tiny"]                        # L = 2, h = 32; N = 8 x 32 tokens
    >>> tp_comm_bytes(tiny, 256, 2)                             # (8L+4) N h 4 + 6 N 4
    {'all_reduce': 661504}
    >>> tp_comm_bytes(tiny, 256, 2, forward_elem=2)             # autocast: 4L N h 2 + (4L+4) N h 4 + 6 N 4
    {'all_reduce': 530432}
    >>> tp_comm_bytes(tiny, 256, 2, sequence_parallel=True, forward_elem=2)   # the tracer's count, too
    {'all_gather': 262144, 'reduce_scatter': 229376, 'all_reduce': 75264}
    """
    if tp == 1:
        return {}
    L, h, N = config.n_layer, config.n_embd, tokens
    fwd = elem if forward_elem is None else forward_elem
    ce = 2 * N * 4 + 2 * 2 * N * 4
    if not sequence_parallel:
        return {"all_reduce": 4 * L * N * h * fwd + (4 * L + 4) * N * h * elem + ce}
    ln_params = 6 if config.bias else 2  # per block: ln_1, ln_2 (w, b) and two row biases
    final = 2 if config.bias else 1
    # per block: 2 gathers of layer-norm outputs (elem) + 2 of the row outputs' gradients (fwd), and the reverse
    return {"all_gather": (2 * L + 2) * N * h * elem + 2 * L * N * h * fwd,
            "reduce_scatter": (2 * L + 1) * N * h * elem + 2 * L * N * h * fwd,
            "all_reduce": 2 * N * h * elem + 2 * (ln_params * L + final) * h * elem * micro_steps + ce}


def pp_comm_bytes(config: GPTConfig, tokens: int, stages: int, holds: list[int], elem: int = 4) -> dict[str, int]:
    """Bytes a pipeline rank holding stages ``holds`` (of ``stages``) sends and receives per step.

    Every cut between stage s and s + 1 carries the ``(tokens, h)`` activations
    forward and their gradient back, over all micro-batches together: the rank
    holding s sends ``tokens*h*elem`` and receives as much, and so does the one
    holding s + 1 (``comm`` records each side's tensor once). A rank holding
    both sides of a cut moves nothing over it.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> pp_comm_bytes(MODEL_PRESETS["gpt-tiny"], 8 * 32, 2, [0])   # 256 tokens x 32 x 4 B each way
    {'send': 32768, 'recv': 32768}
    """
    one_way = tokens * config.n_embd * elem
    cuts = sum((s in holds) != (s + 1 in holds) for s in range(stages - 1))
    return {"send": cuts * one_way, "recv": cuts * one_way} if cuts else {}


@dataclass
class Plan:
    """Per-device bytes by category (the most loaded device) and bytes per step by mesh dimension."""

    config: GPTConfig
    layout: dict[str, Any]
    params_per_device: int
    memory: dict[str, float]
    comm: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total_memory(self) -> float:
        """The peak: states, plus the larger of the activations (end of forward) and the gradients
        (end of backward). Measured peaks of the trainer's runs sit a few % above it (temporaries)."""
        m = self.memory
        return (m["parameters"] + m["optimizer"] + m.get("gathered parameters", 0)
                + max(m["activations"], m["gradients"]))

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
        return "\n".join(lines)


def plan(model: str | GPTConfig, *, batch: int, seq_len: int | None = None, dp: int = 1, tp: int = 1,
         pp: int = 1, micro_batches: int = 1, precision: str = "fp32", checkpointing: bool = False,
         zero_stage: int = 0, sequence_parallel: bool = False, devices: int | None = None,
         layout: Layout | None = None) -> Plan:
    """Predict one device's memory and the bytes each mesh dimension moves per optimizer step.

    ``batch`` is the global batch (sequences per step). ``zero_stage`` applies
    over dp (3 = FSDP FULL_SHARD, blocks as units). ``devices`` (optional)
    must equal dp*pp*tp. Peak activations: one micro-batch without a pipeline,
    up to ``pp`` in flight on the first stage with one (1F1B). ``layout`` (a ``layout.Layout``): its
    dp, pp and tp instead of the keywords, as the trainer runs them.
    """
    if layout is not None:
        dp, pp, tp = layout.dp, layout.pp, layout.tp
    config = MODEL_PRESETS[model] if isinstance(model, str) else model
    seq_len = seq_len or config.block_size
    if min(dp, tp, pp, micro_batches) < 1:
        raise ValueError(f"dp, tp, pp and micro_batches must be >= 1, got {dp}, {tp}, {pp}, {micro_batches}")
    if devices is not None and devices != dp * tp * pp:
        raise ValueError(f"{devices} devices but dp*pp*tp = {dp * pp * tp}; choose sizes whose product is {devices}")
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

    blocks, rest = tp_param_counts(config, tp)
    stage_blocks = blocks[: config.n_layer // pp]
    local = sum(stage_blocks) + (rest if pp == 1 else rest - (config.vocab_size * config.n_embd // tp
                                                              if not config.tie_embeddings else 0))
    states = estimate.model_state_bytes_per_device(stage_blocks + [local - sum(stage_blocks)], dp, zero_stage,
                                                   mixed_precision=mixed)
    micro = batch // (dp * micro_batches)
    acts = _activation_bytes(config, micro, seq_len, tp, sequence_parallel, elem, len(stage_blocks), checkpointing)
    in_flight = min(pp, micro_batches) if pp > 1 else 1
    memory = {"parameters": states["parameters"], "gradients": states["gradients"],
              "optimizer": states["optimizer"], "activations": acts * in_flight}
    if zero_stage == 3 and dp > 1:  # FULL_SHARD keeps the root gathered, and a block plus the prefetched next
        memory["gathered parameters"] = (local - sum(stage_blocks) + 2 * stage_blocks[0]) * (2 if mixed else 4)

    tokens = batch // dp * seq_len
    comm: dict[str, dict[str, float]] = {}
    if tp > 1:
        comm["tp"] = tp_comm_bytes(dataclasses.replace(config, n_layer=len(stage_blocks)), tokens, tp,
                                   sequence_parallel, elem, micro_batches)
    if pp > 1:
        comm["pp"] = {"send": 2 * tokens * config.n_embd * elem, "recv": 2 * tokens * config.n_embd * elem}
    if dp > 1:
        strategy = {0: "ddp", 1: "zero1", 2: "zero2", 3: "full_shard"}[zero_stage]
        units = stage_blocks if zero_stage == 3 else sum(stage_blocks)
        root = local - sum(stage_blocks)
        # DDP (and ZeRO-1 on it) broadcasts the buffers before each forward: GPT's causal masks, 1 byte a cell
        buffers = config.n_layer * config.block_size ** 2 if zero_stage in (0, 1) else 0
        dpc = estimate.comm_bytes_per_step(units, dp, strategy, "fp32" if elem == 4 else "bf16", root_numel=root,
                                           buffer_bytes=buffers)
        dpc.pop("total", None)
        comm["dp"] = dpc
    layout = {"dp": dp, "pp": pp, "tp": tp, "micro_batches": micro_batches, "precision": precision,
              "checkpointing": checkpointing, "zero_stage": zero_stage, "sequence_parallel": sequence_parallel}
    return Plan(config, layout, local, memory, comm)


def _activation_bytes(config: GPTConfig, micro: int, seq_len: int, tp: int, sp: bool, elem: int, layers: int,
                      checkpointing: bool) -> float:
    """Saved-for-backward bytes of one micro-batch on one rank: ``estimate``'s per-tensor count,
    each tensor divided by tp where tensor parallel splits it (heads, 4h hidden units; with SP the
    layer-norm inputs and statistics). With checkpointing each block keeps only its input
    (b*s*h, / tp with SP) and one block's activations exist during its recompute."""
    dtype = "fp32" if elem == 4 else "bf16"
    per_tensor = estimate.gpt_layer_activation_breakdown(config, micro, seq_len, dtype)
    split = {"q, k, v", "attention probs", "attn c_proj input", "gelu input", "mlp c_proj input"}
    if sp:
        split |= {"ln_1 input", "ln_1 mean/rstd", "ln_2 input", "ln_2 mean/rstd"}
    layer = sum(v / tp if k in split else v for k, v in per_tensor.items())
    if checkpointing:
        block_input = micro * seq_len * config.n_embd * elem / (tp if sp else 1)
        blocks = layers * block_input + layer
    else:
        blocks = layers * layer
    whole = estimate.gpt_activation_bytes(config, micro, seq_len, dtype)
    head = whole["final"] + whole["embedding"] + whole["loss"] / tp
    return blocks + head
