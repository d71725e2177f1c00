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
* Communication per optimizer step: ``comm_bytes_per_step`` is exact (padding,
  FSDP's root rule; what ``minifsdp.comm`` records, to the byte, for every
  strategy: ``python -m minifsdp.bench`` and tests/test_bytes_agree.py hold
  it to that), ``fully_shard_comm_bytes`` the same for per-parameter sharding
  (FSDP2, padded per parameter), ``paper_comm_bytes`` the ZeRO paper's k·4Ψ
  bytes (section 7).
* Activation memory of ``models.GPT``, counted from the tensors that autograd
  saves for backward in *this* implementation (compare Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models",
  which derives 34*s*b*h + 5*a*s^2*b bytes per layer for Megatron's GPT).
* Pipeline bubble fraction (Huang et al. 2019, GPipe; Narayanan et al.
  2021, Megatron-LM interleaved schedule).

Read first: ``models.py`` (what is counted); then this file top to bottom.
The labs (01 memory, 03 ZeRO, 04 FSDP) hold these numbers against measurement.
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
    "optimizer_state_bytes_for",
    "padded_numel",
    "shard_numel",
    "zero_stage",
    "model_state_bytes_per_device",
    "gpt_param_count",
    "gpt_layer_activation_breakdown",
    "gpt_activation_bytes",
    "gpt_checkpoint_activation_bytes",
    "comm_bytes_per_step",
    "paper_comm_bytes",
    "fsdp_unit_numels",
    "fully_shard_padded_numel",
    "fully_shard_group_shapes",
    "fully_shard_comm_bytes",
    "COMM_STRATEGIES",
    "ZERO_PAPER_PSI",
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


def format_bytes(n: float, digits: int = 2) -> str:
    """Binary units, as memory tools print them; the package's one byte formatter.

    >>> format_bytes(14753792), format_bytes(4 * 2**20, digits=1), format_bytes(512), format_bytes(-1536)
    ('14.07 MiB', '4.0 MiB', '512 B', '-1.50 KiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def param_bytes(n_params: int, dtype: DType = torch.float32) -> int:
    """Bytes of the parameters: ``param_bytes(212) == 848`` (fp32)."""
    return int(n_params) * dtype_bytes(dtype)


def grad_bytes(n_params: int, dtype: DType = torch.float32) -> int:
    """Bytes of the gradients: one per parameter, same dtype as the parameters."""
    return int(n_params) * dtype_bytes(dtype)


def optimizer_state_bytes_for(
    n_params: int, optimizer: str = "adamw", dtype: DType = torch.float32
) -> int:
    """Bytes of optimizer state predicted for ``n_params`` parameters (measured: ``zero.local_state_bytes``).

    AdamW keeps ``exp_avg`` and ``exp_avg_sq`` (2 per element), SGD with
    momentum one buffer, plain SGD nothing: ``optimizer_state_bytes_for(212) ==
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
        k = optimizer_state_bytes_for(1, optimizer, param_dtype)
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


def gpt_checkpoint_activation_bytes(
    config: "GPTConfig",
    batch: int,
    seq_len: int,
    dtype: DType = torch.float32,
    checkpoint: str = "full",
    checkpointed_layers: int | None = None,
    include_loss: bool = True,
) -> dict[str, int]:
    """``gpt_activation_bytes`` with activation checkpointing of ``checkpointed_layers`` blocks (all: None).

    A checkpointed block keeps, until backward, only what its recompute
    starts from. ``"full"``: its input, B*T*d values. ``"selective"`` (keep
    the linear layers' outputs, recompute the rest; ``minifsdp.checkpoint``'s
    LINEAR_OPS): its input and the outputs of c_attn (3*B*T*d), the
    attention projection (B*T*d), c_fc (4*B*T*d) and the MLP projection
    (B*T*d): 10*B*T*d. ``"none"``: nothing changes. The B*h*T^2 attention
    probabilities are recomputed in both cases.

    Worked example, gpt-tiny (d=32, L=2), B=8, T=32, fp32: per layer
    593,920 B without checkpointing, 32,768 B (full; 5.5 %) or 327,680 B
    (selective); total 1,521,924 -> 399,620 (full). Measured by the memory
    tracker after the forward: the same drop to the byte (tests/test_checkpoint.py).
    """
    if checkpoint not in ("none", "full", "selective"):
        raise ValueError(f"checkpoint must be 'none', 'full' or 'selective', got {checkpoint!r}")
    out = gpt_activation_bytes(config, batch, seq_len, dtype, include_loss)
    k = config.n_layer if checkpointed_layers is None else int(checkpointed_layers)
    if not 0 <= k <= config.n_layer:
        raise ValueError(f"checkpointed_layers must be between 0 and n_layer={config.n_layer}, got {k}")
    btd = batch * seq_len * config.n_embd * dtype_bytes(dtype)
    kept = {"none": out["per_layer"], "full": btd, "selective": 10 * btd}[checkpoint]
    out["per_checkpointed_layer"] = kept
    out["layers"] = k * kept + (config.n_layer - k) * out["per_layer"]
    out["total"] = out["embedding"] + out["layers"] + out["final"] + out["loss"]
    return out


# --------------------------------------------------------------------------
# Communication per optimizer step: the one formula bench, tests and labs use
# --------------------------------------------------------------------------

# What each strategy's collectives are, in ``comm``'s volume convention (an
# all-reduce of S bytes counts 2S, every other collective S). P = parameter bytes (4Ψ for Ψ fp32 parameters).
COMM_STRATEGIES = ("ddp", "zero1", "zero2", "full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
_COMM_ALIASES = {"ddp-naive": "ddp", "oss": "zero1", "zero3": "full_shard", "fsdp": "full_shard"}
# The ZeRO paper's count (section 7), in multiples of the parameter bytes P: its ZeRO-1 and ZeRO-2
# both reduce-scatter gradients and all-gather parameters (2P); stage 3 gathers twice.
ZERO_PAPER_PSI = {"ddp": 2, "no_shard": 2, "zero1": 2, "zero2": 2, "shard_grad_op": 2, "full_shard": 3}


def _comm_strategy(strategy: str) -> str:
    key = strategy.lower()
    key = _COMM_ALIASES.get(key, key)
    if key not in COMM_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(COMM_STRATEGIES)} "
                         f"(or {', '.join(_COMM_ALIASES)})")
    return key


def comm_bytes_per_step(
    n_params: int | Sequence[int],
    world_size: int,
    strategy: str,
    dtype: DType = torch.float32,
    ring: bool = False,
    *,
    root_numel: int = 0,
    buffer_bytes: int = 0,
    shard_size: int | None = None,
    grad_dtype: DType | None = None,
) -> dict[str, float]:
    """Bytes minifsdp's collectives move per optimizer step and rank, by collective, exactly.

    The keys are ``comm``'s op names and the values what the tracer records
    (``Trace.bytes_by_op``), so a measured step can be compared to the byte;
    ``"total"`` sums them. ``n_params`` is the parameter count, or for FSDP
    the sizes of the wrapped units *other than the root*; ``root_numel`` is
    the root unit's (what no wrapped unit holds: embeddings, final norm, head).
    With P = parameter bytes, root included (P = 4Ψ for Ψ fp32 parameters):

    ==============  =====================================================  =====
    strategy        collectives per step                                   total
    ==============  =====================================================  =====
    ddp             all_reduce gradients 2P (+ broadcast buffers)          2P
    zero1           all_reduce 2P, owners broadcast parameters P (+ bufs)  3P
    zero2           reduce each gradient to its owner P, broadcast P       2P
    full_shard      all_gather 2P − P_root, reduce_scatter P               3P − P_root
    shard_grad_op   all_gather P, reduce_scatter P                         2P
    no_shard        all_reduce 2P                                          2P
    hybrid_shard    full_shard in groups of S, all_reduce 2P/S across them
    ==============  =====================================================  =====

    * ``zero1``/``"oss"`` is FairScale's OSS (and torch's
      ZeroRedundancyOptimizer) on DDP: whole gradients all-reduced, then
      parameters broadcast: 3Ψ, not the paper's 2Ψ (``paper_comm_bytes``).
    * FSDP pads every unit to a multiple of its shard group (``padded_numel``);
      DDP, ZeRO-1/2 and NO_SHARD move unpadded tensors.
    * The root rule: FULL_SHARD (and HYBRID_SHARD) keep the root unit
      unsharded from forward to backward (backward needs it first), so the
      root is gathered once and every other unit twice.
    * ``buffer_bytes``: DDP (and zero1, which runs on it) broadcasts the
      module's buffers before each forward (torch's ``broadcast_buffers``).
    * ``hybrid_shard`` needs ``shard_size`` (ranks per shard group, S); the
      replicas all-reduce each rank's padded shard, 2·Ψ/S. S = 1 shards
      nothing: all_reduce 2Ψ.
    * ``dtype`` is the parameters' (what is gathered or broadcast: FSDP's
      ``param_dtype``), ``grad_dtype`` the gradients' (what is reduced:
      ``MixedPrecision.reduce_dtype``; default ``dtype``). DDP and ZeRO with a
      bf16 ``reduce_dtype`` keep fp32 parameters: ``dtype`` fp32, ``grad_dtype``
      bf16, so ZeRO-2 reduces Ψ/2 and still broadcasts Ψ. Buffers are counted
      as given (``buffer_bytes``, in their own dtype).

    ``ring=True`` gives what each rank *sends* with ring algorithms instead:
    (G-1)/G of each op's volume, G its group size (``comm``'s ``ring_bytes``).
    A world of one moves nothing.

    gpt-tiny under the Block wrap policy (two blocks of 12,704 parameters, root
    17,472, fp32), 2 ranks, FULL_SHARD: gather 2·101,632 + 69,888, scatter 171,520:

    >>> comm_bytes_per_step([12704, 12704], 2, "full_shard", root_numel=17472)
    {'all_gather': 273152, 'reduce_scatter': 171520, 'total': 444672}
    >>> comm_bytes_per_step(42880, 2, "zero2")
    {'reduce': 171520, 'broadcast': 171520, 'total': 343040}
    >>> comm_bytes_per_step(42880, 2, "zero2", grad_dtype=torch.bfloat16)   # bf16 gradients, fp32 parameters
    {'reduce': 85760, 'broadcast': 171520, 'total': 257280}
    """
    key, n, b = _comm_strategy(strategy), world_size, dtype_bytes(dtype)
    g = dtype_bytes(grad_dtype) if grad_dtype is not None else b
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    units = [int(n_params)] if isinstance(n_params, int) else [int(x) for x in n_params]
    numel = sum(units) + root_numel
    psi, grads = numel * b, numel * g  # parameter bytes Ψ, gradient bytes
    by_op: dict[str, int] = {}
    group = {}  # op -> the size of the group it runs in (for ring=True)
    if n > 1 and key in ("ddp", "zero1", "no_shard"):
        by_op["all_reduce"] = 2 * grads
        bcast = (psi if key == "zero1" else 0) + (buffer_bytes if key != "no_shard" else 0)
        by_op["broadcast"] = bcast
    elif n > 1 and key == "zero2":
        by_op.update(reduce=grads, broadcast=psi)
    elif n > 1:  # FSDP's sharded strategies
        if key == "hybrid_shard":
            if shard_size is None or shard_size < 1 or n % shard_size:
                raise ValueError(f"hybrid_shard needs shard_size= (ranks per shard group) dividing world_size "
                                 f"{n}, got {shard_size!r}")
            s = shard_size
        else:
            if shard_size not in (None, n):
                raise ValueError(f"shard_size is for hybrid_shard; {key} shards over the whole world ({n})")
            s = n
        padded_units = sum(padded_numel(x, s) for x in units)
        padded_all = padded_units + (padded_numel(root_numel, s) if root_numel else 0)
        if s > 1:
            twice = key in ("full_shard", "hybrid_shard")  # resharded after forward: gathered again
            by_op["all_gather"] = (padded_all + (padded_units if twice else 0)) * b
            by_op["reduce_scatter"] = padded_all * g
            group.update(all_gather=s, reduce_scatter=s)
        if n // s > 1:  # HYBRID: each rank's gradient shard all-reduced across the replicas
            by_op["all_reduce"] = 2 * padded_all * g // s
            group["all_reduce"] = n // s
    out: dict[str, float] = {op: v for op, v in by_op.items() if v}
    if ring:
        out = {op: v * (group.get(op, n) - 1) / group.get(op, n) for op, v in out.items()}
    out["total"] = sum(out.values())
    return out


def paper_comm_bytes(n_params: int, strategy: str, dtype: DType = torch.float32) -> int:
    """The ZeRO paper's volume per step (section 7), k·P: ``ZERO_PAPER_PSI[strategy]`` × the parameter bytes.

    The textbook number that ``comm_bytes_per_step`` refines: the paper's
    ZeRO-1 reduce-scatters gradients and gathers parameters (2P, P = 4Ψ bytes
    for Ψ fp32 parameters) where FairScale's OSS all-reduces then broadcasts
    (3P), and it neither pads nor keeps the root unit gathered.

    >>> paper_comm_bytes(1000, "full_shard"), paper_comm_bytes(1000, "oss")   # 3Ψ, 2Ψ
    (12000, 8000)
    """
    key = _comm_strategy(strategy)
    if key not in ZERO_PAPER_PSI:
        raise ValueError(f"the ZeRO paper has no count for {strategy!r}; use comm_bytes_per_step")
    return ZERO_PAPER_PSI[key] * int(n_params) * dtype_bytes(dtype)


def fsdp_unit_numels(model: torch.nn.Module, unit_types: tuple[type, ...]) -> tuple[list[int], int]:
    """Parameters of each FSDP unit under ``ModuleWrapPolicy(unit_types)``: ``([unit, ...], root)``.

    Each outermost module of one of ``unit_types`` is a unit; the root holds
    every parameter no unit does. Feed the result to ``comm_bytes_per_step``:

    >>> net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> fsdp_unit_numels(net, (torch.nn.Linear,))          # gpt-tiny, (Block,): ([12704, 12704], 17472)
    ([20, 10], 40)
    """
    units: list[int] = []
    inside: set[int] = set()
    for m in model.modules():
        if isinstance(m, unit_types) and id(m) not in inside and m is not model:
            units.append(sum(p.numel() for p in m.parameters()))
            inside.update(id(sub) for sub in m.modules())
    return units, sum(p.numel() for p in model.parameters()) - sum(units)


# --------------------------------------------------------------------------
# Per-parameter sharding (FSDP2, ``fully_shard``): padding per parameter, not per unit
# --------------------------------------------------------------------------

Shape = Sequence[int]


def fully_shard_padded_numel(shape: Shape, world_size: int) -> int:
    """Elements one parameter takes in ``fully_shard``'s all-gather over N ranks: N·ceil(d0/N)·(numel/d0).

    FSDP2 cuts each parameter along dim 0 into N pieces of ceil(d0/N) rows (``torch.chunk``'s
    cut) and pads every piece to that many rows, so each rank sends the same bytes. The
    padding is up to N − 1 *rows per parameter*; a flat FSDP unit (``padded_numel``) pads up
    to N − 1 *elements per unit*.

    >>> fully_shard_padded_numel((5, 3), 4)   # 2 rows per rank: 8 rows, 3 of them padding (fsdp_param.py)
    24
    >>> fully_shard_padded_numel((32, 32), 3), padded_numel(32 * 32, 3)   # per parameter: one row; flat: 2
    (1056, 1026)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(shape) == 0:
        raise ValueError("fully_shard shards along dim 0: a scalar parameter has none")
    rows, row_numel = int(shape[0]), math.prod(int(d) for d in shape[1:])
    return world_size * math.ceil(rows / world_size) * row_numel


def fully_shard_group_shapes(model: torch.nn.Module,
                             unit_types: tuple[type, ...]) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]]:
    """Parameter shapes of each ``fully_shard`` group: ``([group, ...], root)``, as ``fsdp_unit_numels`` counts.

    ``fully_shard`` on every outermost module of ``unit_types``, then on the model: each such
    module is a group (one all-gather, one reduce-scatter); the root holds every parameter
    no group does. Feed the result to ``fully_shard_comm_bytes``:

    >>> net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> fully_shard_group_shapes(net, (torch.nn.Linear,))
    ([[(4, 4), (4,)], [(2, 4), (2,)]], [(10, 4)])
    """
    groups: list[list[tuple[int, ...]]] = []
    inside: set[int] = set()
    for m in model.modules():
        if isinstance(m, unit_types) and id(m) not in inside and m is not model:
            groups.append([tuple(p.shape) for p in m.parameters()])
            inside.update(id(p) for p in m.parameters())
    return groups, [tuple(p.shape) for p in model.parameters() if id(p) not in inside]


def fully_shard_comm_bytes(
    groups: Sequence[Sequence[Shape]],
    world_size: int,
    dtype: DType = torch.float32,
    *,
    root: Sequence[Shape] = (),
    reshard_after_forward: bool | None = None,
    shard_size: int | None = None,
    grad_dtype: DType | None = None,
    micro_batches: int = 1,
) -> dict[str, int]:
    """Bytes ``fully_shard`` (FSDP2) moves per optimizer step and rank, by collective, exactly.

    ``groups`` holds each non-root group's parameter shapes, ``root`` the root's
    (``fully_shard_group_shapes``). A group of S shard ranks gathers
    G = Σ S·ceil(d0/S)·(numel/d0) elements (``fully_shard_padded_numel``) in one
    all-gather and reduce-scatters G gradient elements in one reduce-scatter. Per step:

    * all_gather: every group in each forward, and again in each backward for a group
      resharded after forward. ``reshard_after_forward`` None (FSDP2's default, FULL_SHARD)
      reshards every group but the root (backward needs the root first); True the root
      too; False (SHARD_GRAD_OP) none. With ``micro_batches`` m (gradient accumulation
      without sync) the gathers happen m times: each backward reshards.
    * reduce_scatter: every gradient once, in ``grad_dtype`` (``reduce_dtype``; default ``dtype``).
    * HSDP (``shard_size`` S < ``world_size``, a 2-D mesh replicate × shard): the above
      within the shard group of S ranks, then each rank's reduced piece (G/S elements)
      all-reduced across the N/S replicas: 2·G/S in ``comm``'s all-reduce convention.

    ``dtype`` is what is gathered (``param_dtype``). A group of one rank moves nothing.

    gpt-tiny (two blocks, then the root), 3 ranks, fp32, FULL_SHARD. Every tensor of 32,
    128 or 256 rows gets a padding row (33, 129, 258 rows; 96 splits evenly): a block's
    12,704 parameters take 12,903 elements, the root's 17,472 take 17,634 (a flat unit:
    12,705 and 17,472). Gathered: 2 · 2 · 12,903 + 17,634 = 69,246 elements; reduced 43,440:

    >>> block = [(32,), (32,), (96, 32), (96,), (32, 32), (32,), (32,), (32,), (128, 32), (128,), (32, 128), (32,)]
    >>> root = [(256, 32), (32, 32), (32,), (32,), (256, 32)]
    >>> fully_shard_comm_bytes([block, block], 3, root=root)
    {'all_gather': 276984, 'reduce_scatter': 173760, 'total': 450744}
    """
    n, b = world_size, dtype_bytes(dtype)
    g = dtype_bytes(grad_dtype) if grad_dtype is not None else b
    s = n if shard_size is None else shard_size
    if n < 1 or s < 1 or n % s:
        raise ValueError(f"shard_size {shard_size} must divide world_size {n} (both >= 1)")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    sizes = [sum(fully_shard_padded_numel(shape, s) for shape in group) for group in groups]
    root_size = sum(fully_shard_padded_numel(shape, s) for shape in root)
    every = sum(sizes) + root_size
    resharded = (sum(sizes) if reshard_after_forward is not False else 0) + \
        (root_size if reshard_after_forward is True else 0)
    by_op: dict[str, int] = {}
    if s > 1:
        by_op["all_gather"] = micro_batches * (every + resharded) * b
        by_op["reduce_scatter"] = every * g
    if n // s > 1:
        by_op["all_reduce"] = 2 * every // s * g
    out = {op: v for op, v in by_op.items() if v}
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
