"""Back-of-the-envelope formulas that the labs hold against measurement.

Layer 4 (leaves): pure functions, no ``torch.distributed``. Every result is a
number of bytes (or a fraction); ``format_bytes`` makes it readable.

* Model-state memory per device for data parallelism and ZeRO stages 1-3 /
  FSDP, after Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models" (section 5): with Psi parameters, N
  data-parallel ranks and mixed-precision Adam, parameters cost 2*Psi bytes
  (fp16), gradients 2*Psi and optimizer state K*Psi with K = 12 (fp32 master
  copy, momentum, variance). In plain fp32 training parameters and gradients
  cost 4*Psi each and Adam's two moments K = 8 bytes per parameter.
* Communication volume per optimizer step (ZeRO paper, section 7).
* Activation memory of ``models.GPT``, counted from the tensors that autograd
  saves for backward in *this* implementation (compare Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models",
  which derives 34*s*b*h + 5*a*s^2*b bytes per layer for Megatron's GPT).
* Pipeline bubble fraction (Huang et al. 2019, GPipe; Narayanan et al.
  2021, Megatron-LM interleaved schedule).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence, Union

import torch

if TYPE_CHECKING:  # only for type hints; estimate never builds a model
    from minifsdp.models import GPTConfig

__all__ = [
    "dtype_bytes",
    "format_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "padded_numel",
    "shard_numel",
    "zero_stage",
    "model_state_bytes_per_device",
    "gpt_param_count",
    "gpt_layer_activation_breakdown",
    "gpt_activation_bytes",
    "comm_bytes_per_step",
    "pipeline_bubble_fraction",
    "pipeline_peak_microbatches",
]

DType = Union[torch.dtype, str]
_DTYPE_NAMES = {
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
# Optimizer state elements kept per parameter element (torch.optim layout).
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}


def dtype_bytes(dtype: DType) -> int:
    """Bytes per element: ``dtype_bytes(torch.bfloat16) == dtype_bytes("bf16") == 2``."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        dtype = _DTYPE_NAMES[dtype.lower()]
    return dtype.itemsize


def format_bytes(n: float) -> str:
    """Binary units, as memory tools print them: ``format_bytes(14753792) == '14.07 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def param_bytes(n_params: int, dtype: DType = torch.float32) -> int:
    """Bytes of the parameters: ``param_bytes(212) == 848`` (fp32)."""
    return int(n_params) * dtype_bytes(dtype)


def grad_bytes(n_params: int, dtype: DType = torch.float32) -> int:
    """Bytes of the gradients: one per parameter, same dtype as the parameters."""
    return int(n_params) * dtype_bytes(dtype)


def optimizer_state_bytes(
    n_params: int, optimizer: str = "adamw", dtype: DType = torch.float32
) -> int:
    """Bytes of optimizer state for ``n_params`` parameters.

    AdamW keeps ``exp_avg`` and ``exp_avg_sq`` (2 per element), SGD with
    momentum one buffer, plain SGD nothing: ``optimizer_state_bytes(212) ==
    1696``. torch's Adam also keeps a scalar ``step`` tensor per parameter
    *tensor*; a few bytes, ignored here.
    """
    key = optimizer.lower()
    if key not in _OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(_OPTIMIZER_STATES)}")
    return _OPTIMIZER_STATES[key] * int(n_params) * dtype_bytes(dtype)


def padded_numel(numel: int, world_size: int) -> int:
    """Length of a flat parameter padded to a multiple of ``world_size``.

    FSDP flattens each wrapped unit's parameters into one 1-D tensor and pads
    it with zeros so it splits into ``world_size`` equal shards (collectives
    need equal sizes): ``padded_numel(10, 4) == 12``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return math.ceil(numel / world_size) * world_size


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each rank owns of a padded flat parameter: ``shard_numel(10, 4) == 3``."""
    return padded_numel(numel, world_size) // world_size


_STAGES = {
    "ddp": 0, "no_shard": 0, "zero0": 0,
    "zero1": 1, "oss": 1,
    "zero2": 2, "shard_grad_op": 2,
    "zero3": 3, "fsdp": 3, "full_shard": 3,
}


def zero_stage(stage: int | str) -> int:
    """Map 0-3 or a name ("ddp", "zero2", "shard_grad_op", "full_shard", ...) to 0-3."""
    if isinstance(stage, str):
        if stage.lower() not in _STAGES:
            raise ValueError(f"unknown stage {stage!r}; use 0-3 or one of {sorted(_STAGES)}")
        return _STAGES[stage.lower()]
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    return int(stage)


def model_state_bytes_per_device(
    n_params: int | Sequence[int],
    world_size: int = 1,
    stage: int | str = 0,
    param_dtype: DType | None = None,
    optimizer: str = "adamw",
    mixed_precision: bool = False,
    padding: bool = True,
) -> dict[str, float]:
    """Parameters, gradients and optimizer state held by one rank, in bytes.

    Stage 0 (DDP) replicates everything; stage 1 shards the optimizer state,
    stage 2 also the gradients, stage 3 (FSDP FULL_SHARD) also the
    parameters (steady state between steps; a unit is gathered while it
    runs). ``n_params`` may be a list of flat-parameter sizes, one per FSDP
    unit: with ``padding=True`` each is padded to a multiple of
    ``world_size`` as FSDP does; ``padding=False`` divides exactly, as the
    ZeRO paper does.

    ``mixed_precision=True`` is the ZeRO paper's setting: parameters and
    gradients in ``param_dtype`` (default fp16, 2 bytes) and an fp32 master
    copy inside the optimizer state, so K = 4 + 4*states (12 for Adam).
    Otherwise everything is in ``param_dtype`` (default fp32) and K = 8.

    ZeRO paper, Figure 1 (Psi = 7.5B, N = 64, K = 12), in GB (1e9 bytes):
    stage 0: 16*Psi = 120; stage 1: 4*Psi + 12*Psi/N = 31.4;
    stage 2: 2*Psi + 14*Psi/N = 16.6; stage 3: 16*Psi/N = 1.9.
    """
    s = zero_stage(stage)
    sizes = [int(n_params)] if isinstance(n_params, int) else [int(n) for n in n_params]
    full = sum(sizes)
    if padding:
        shard: float = sum(shard_numel(n, world_size) for n in sizes)
    else:
        shard = full / world_size
    if param_dtype is None:
        param_dtype = torch.float16 if mixed_precision else torch.float32
    pb = dtype_bytes(param_dtype)
    if mixed_precision:
        k = 4 + 4 * _OPTIMIZER_STATES[optimizer.lower()]  # fp32 master + fp32 states
    else:
        k = optimizer_state_bytes(1, optimizer, param_dtype)
    out = {
        "parameters": (shard if s >= 3 else full) * pb,
        "gradients": (shard if s >= 2 else full) * pb,
        "optimizer": (shard if s >= 1 else full) * k,
    }
    out["total"] = out["parameters"] + out["gradients"] + out["optimizer"]
    return out


def gpt_param_count(config: "GPTConfig") -> int:
    """Parameters of ``models.GPT(config)`` from the formula, no model built.

    Per block: 12*d^2 (qkv 3d^2, projection d^2, MLP 8d^2) plus 13*d of biases
    and LayerNorm affine (2*d without biases); embeddings V*d + block_size*d;
    final LayerNorm 2*d (d without bias); head V*d unless tied.
    """
    d, v, L = config.n_embd, config.vocab_size, config.n_layer
    per_block = 12 * d * d + (13 * d if config.bias else 2 * d)
    ln_f = 2 * d if config.bias else d
    head = 0 if config.tie_embeddings else v * d
    return v * d + config.block_size * d + L * per_block + ln_f + head


def gpt_layer_activation_breakdown(
    config: "GPTConfig", batch: int, seq_len: int, dtype: DType = torch.float32
) -> dict[str, int]:
    """Bytes each saved-for-backward tensor of one ``Block`` holds.

    Read ``Block.forward`` top to bottom (B = batch, T = seq_len, d = width,
    h = heads) and note what each op keeps for its backward:
    LayerNorm keeps its input and per-row mean and 1/std; a Linear keeps its
    input; ``q @ k^T`` and ``probs @ v`` keep q, k, v (copied to contiguous
    3-D batches by ``matmul``); softmax keeps its output, the B*h*T*T
    probabilities (the only term quadratic in T); GELU keeps its input. The
    scale, the mask fill and the residual adds keep nothing (the mask is a
    view of a buffer). Assumes ``dropout == 0`` (the presets): dropout would
    add masks and copies. LayerNorm statistics are in ``dtype`` as on CPU
    (CUDA keeps them in fp32: a negligible 4*B*T bytes per LayerNorm).
    """
    b = dtype_bytes(dtype)
    B, T, d, h = batch, seq_len, config.n_embd, config.n_head
    btd = B * T * d * b
    return {
        "ln_1 input": btd,
        "ln_1 mean/rstd": 2 * B * T * b,
        "c_attn input": btd,
        "q, k, v": 3 * btd,
        "attention probs": B * h * T * T * b,
        "attn c_proj input": btd,
        "ln_2 input": btd,
        "ln_2 mean/rstd": 2 * B * T * b,
        "c_fc input": btd,
        "gelu input": 4 * btd,
        "mlp c_proj input": 4 * btd,
    }


def gpt_activation_bytes(
    config: "GPTConfig",
    batch: int,
    seq_len: int,
    dtype: DType = torch.float32,
    include_loss: bool = True,
) -> dict[str, int]:
    """Bytes autograd saves for backward in one forward of ``models.GPT``.

    Per layer: (16*B*T*d + B*h*T^2 + 4*B*T) * bytes(dtype), see
    ``gpt_layer_activation_breakdown``. Embedding: the int64 token ids
    (B*T*8) and positions (T*8). Final: ln_f input and stats, head input.
    Loss (``lm_loss``): the log-softmax output B*T*V, the int64 targets and
    one scalar.

    Worked example, gpt-tiny (d=32, h=2, L=2, V=256), B=8, T=32, fp32:
    per layer 4*(16*8192 + 2*8*1024 + 4*256) = 593,920; embedding
    2048 + 256; final 4*(2*8192 + 512) = 67,584; loss 4*(65536 + 1) + 2048
    = 264,196; total 1,521,924 bytes (1.45 MiB). The bytes measured with
    ``torch.autograd.graph.saved_tensors_hooks`` match exactly (ratio 1.000,
    tests/test_estimate.py).
    """
    b = dtype_bytes(dtype)
    B, T, d = batch, seq_len, config.n_embd
    per_layer = sum(gpt_layer_activation_breakdown(config, B, T, dtype).values())
    out = {
        "embedding": B * T * 8 + T * 8,
        "per_layer": per_layer,
        "layers": config.n_layer * per_layer,
        "final": (2 * B * T * d + 2 * B * T) * b,
        "loss": (B * T * config.vocab_size + 1) * b + B * T * 8 if include_loss else 0,
    }
    out["total"] = out["embedding"] + out["layers"] + out["final"] + out["loss"]
    return out


def comm_bytes_per_step(
    n_params: int | Sequence[int],
    world_size: int,
    strategy: str,
    dtype: DType = torch.float32,
    ring: bool = True,
) -> dict[str, float]:
    """Bytes of collective traffic per optimizer step, per rank.

    ``ring=False`` gives the ZeRO paper's accounting (section 7) in units of
    the model size Psi*bytes: an all-reduce moves 2*Psi (a reduce-scatter
    plus an all-gather), so DDP = 2*Psi, ZeRO-1/2 = 2*Psi (reduce-scatter
    gradients, all-gather updated parameters), ZeRO-3/FSDP FULL_SHARD = 3*Psi
    (all-gather in forward, again in backward, reduce-scatter of gradients),
    FSDP SHARD_GRAD_OP = 2*Psi (parameters kept from forward to backward).

    ``ring=True`` gives what each rank actually *sends* with ring
    algorithms: an all-gather or reduce-scatter of a tensor of S bytes sends
    (N-1)/N * S per rank, an all-reduce twice that. Sharded strategies move
    padded flat parameters (``padded_numel``). Example: DDP, Psi = 1M fp32
    parameters, N = 4: 2 * 3/4 * 4 MB = 6 MB sent per rank per step.

    ``"oss"`` is FairScale's OSS with DDP-style gradients, as minifsdp.zero
    does it: all-reduce the full gradients (2*Psi), then each rank
    broadcasts its updated shard (Psi in total): 3*Psi, more than ZeRO-1 in
    the paper. Gradient accumulation with ``no_sync`` divides all of this by
    the number of micro-steps for DDP-like strategies only.
    """
    b = dtype_bytes(dtype)
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    sizes = [int(n_params)] if isinstance(n_params, int) else [int(x) for x in n_params]
    full = sum(sizes) * b
    padded = sum(padded_numel(x, n) for x in sizes) * b
    kinds = {  # strategy -> (all_reduce, all_gather, reduce_scatter, broadcast) counts
        "ddp": (1, 0, 0, 0), "no_shard": (1, 0, 0, 0),
        "zero1": (0, 1, 1, 0), "zero2": (0, 1, 1, 0),
        "shard_grad_op": (0, 1, 1, 0),
        "zero3": (0, 2, 1, 0), "fsdp": (0, 2, 1, 0), "full_shard": (0, 2, 1, 0),
        "oss": (1, 0, 0, 1),
    }
    key = strategy.lower()
    if key not in kinds:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {sorted(kinds)}")
    ar, ag, rs, bc = kinds[key]
    if ring:
        frac = (n - 1) / n  # each rank sends all but its own 1/N share
        size = full if key in ("ddp", "no_shard", "oss") else padded
        out = {
            "all_reduce": ar * 2 * frac * size,
            "all_gather": ag * frac * size,
            "reduce_scatter": rs * frac * size,
            "broadcast": bc * frac * size,
        }
    else:
        out = {"all_reduce": ar * 2 * full, "all_gather": ag * full,
               "reduce_scatter": rs * full, "broadcast": bc * full}
    out["total"] = sum(out.values())
    return out


def pipeline_bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1) / (v*m + p-1).

    GPipe and 1F1B (v = 1) share the bubble (p-1)/(m+p-1): with p = 4
    stages and m = 8 micro-batches, 3/11 = 27 %. The interleaved schedule
    gives each rank v model chunks and shrinks it by v: 3/35 = 8.6 % for v = 4.
    (Fraction of the step; the ratio bubble/compute is (p-1)/(v*m).)
    """
    p, m, v = stages, microbatches, virtual_stages
    if min(p, m, v) < 1:
        raise ValueError(f"stages, microbatches and virtual_stages must be >= 1, got {p}, {m}, {v}")
    return (p - 1) / (v * m + p - 1)


def pipeline_peak_microbatches(
    stages: int, microbatches: int, schedule: str = "1f1b", stage: int = 0
) -> int:
    """Micro-batches whose activations a stage holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B starts
    backward as soon as possible, so stage s holds at most p - s (stage 0
    the most): why 1F1B's activation memory does not grow with m.
    """
    if schedule.lower() == "gpipe":
        return microbatches
    if schedule.lower() == "1f1b":
        if not 0 <= stage < stages:
            raise ValueError(f"stage must be in [0, {stages}), got {stage}")
        return min(microbatches, stages - stage)
    raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe' or '1f1b'")
