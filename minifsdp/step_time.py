"""Predicted step time: compute over measured FLOP/s, collectives through α–β, and a stated overlap rule.

Layer 4 (leaves): arithmetic on a ``Calibration`` (what ``python -m
minifsdp.calibrate`` measured on this machine, a small JSON) and on the
planner's bytes; no processes. ``planner.plan(..., calibration=...)`` and the
trainer's ``calibrate.predict_run`` call ``predict_gpt``.

The model (Hockney's α–β for messages, the roofline split of compute, the FLOP
count of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters", 2021, with the full T x T attention this GPT computes):

* **matmuls** — per token and block, forward: 2·12h² (q, k, v, projection and
  the 4h MLP; a MoE block 2·(4h² + 8h²·k + hE)) plus 4·T·h (scores and
  probs @ v); the head 2·h·V. Backward is twice the forward. Full
  checkpointing recomputes each block's forward, selective its attention
  matmuls (it keeps the linear layers' outputs). tp divides them all, pp
  divides the blocks; time = FLOPs / the matmul FLOP/s measured at the size
  of the model's typical GEMM (tokens x h x 4h), in the compute dtype.
* **the other ops** — a block's layer norms, masked softmax, residual adds
  and GELU are bound by memory, not FLOPs: their time is the bytes autograd
  saves for them (``elementwise_bytes``: ln inputs, the probabilities, GELU's
  input; the head's log-softmax) at the rate the calibration measured for the
  same ops, forward and backward (bytes per second); recompute adds their
  forward again (a third). AdamW at its measured seconds per parameter, over
  the parameters this rank steps (its shard under ZeRO / FSDP).
* **dispatch** — every op PyTorch runs costs a fixed time on the host (the
  dispatcher, autograd's bookkeeping, a kernel launch), whatever its size:
  the ops of a step (``gpt_op_count``: counted once on a miniature of the
  model, forward, backward and AdamW) at the calibrated seconds per op. It
  decides small models' steps. On CUDA the host runs ahead of the device, so
  a step's compute is the larger of the two, not their sum.
* **pipeline bubble** — compute x (v·m + p - 1) / (v·m) (GPipe, 1F1B; the
  interleaved schedule's v; zero bubble counted as interleaved).
* **collectives** — each op of each mesh dimension: α·calls + β·bytes, with
  α, β fitted per collective and group size (``fit_alpha_beta``) and bytes
  in ``comm``'s volume units (an all-reduce of S bytes is 2S), exactly what
  the planner counts. A group size not calibrated takes the nearest one's
  α, β scaled by the ring's (n-1)/n.
* **overlap** — CPU (gloo): none. The ranks' compute and gloo's transfer
  threads share the same cores, so the step is compute + every collective.
  CUDA (NCCL): the data-parallel dimension's gradient and parameter
  collectives run on their own stream behind the compute (DDP's buckets,
  FSDP's prefetch): step = max(compute, dp collectives) + the rest (tensor,
  pipeline, context and expert parallel wait for their collectives).

MFU (PaLM's definition): the model's FLOPs (no recompute) per second, over the
device's peak; peak here is the best matmul rate the calibration measured.

    >>> fit_alpha_beta([0, 1000, 2000], [1e-4, 2e-4, 3e-4])   # t = α + β·bytes
    (0.0001, 1e-07)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .models import GPT, GPTConfig, lm_loss

__all__ = ["Calibration", "StepTime", "OpCounter", "fit_alpha_beta", "gpt_matmul_flops", "elementwise_bytes",
           "gpt_op_count", "predict_gpt", "OPS", "DEFAULT_PATH"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send")
DEFAULT_PATH = os.path.join("runs", "calibration.json")
_P2P = {"recv": "send", "reduce": "reduce_scatter"}   # timed as another: a recv as its peer's send, a reduce to
# one owner (ZeRO-2) as a reduce-scatter of the same volume
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce call per bucket


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least squares of ``seconds = α + β·nbytes`` in relative error: each point weighs 1/t², so a 4 KiB
    message (which sets α) counts as much as a 16 MiB one (which sets β). Closed form; a negative α
    (noise) is refitted as β alone, and a negative β as α alone."""
    n = len(nbytes)
    if n < 2 or len(seconds) != n or len(set(nbytes)) < 2 or min(seconds) <= 0:
        raise ValueError(f"fit_alpha_beta needs >= 2 distinct sizes with a positive time each, got {nbytes}, "
                         f"{seconds}")
    w = [1 / t**2 for t in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, nbytes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, nbytes))
    beta = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, nbytes, seconds)) / sxx
    alpha = my - beta * mx
    if alpha < 0:  # a line through the origin: no negative latency
        alpha = 0.0
        beta = sum(wi * x * y for wi, x, y in zip(w, nbytes, seconds)) / sum(wi * x * x for wi, x in zip(w, nbytes))
    if beta < 0:  # noise made larger messages look faster: a latency-only line (their weighted mean time)
        alpha, beta = my, 0.0
    return round(alpha, 15), round(beta, 18)


@dataclass
class Calibration:
    """What ``minifsdp.calibrate`` measured. ``compute[world_size]``: per rank while ``world_size`` ranks run at
    once, ``{"matmul_flops": {dtype: [[n, FLOP/s], ...]}, "elementwise_bytes_per_s": B, "optimizer_s_per_param": o}``;
    ``collectives[op][group_size]``: ``{"alpha_s", "beta_s_per_byte", "points": [[bytes, s], ...]}``."""

    device: str = "cpu"
    backend: str = "gloo"
    compute: dict[int, dict[str, Any]] = field(default_factory=dict)
    collectives: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str = DEFAULT_PATH) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str = DEFAULT_PATH) -> "Calibration":
        if not os.path.exists(path):
            raise FileNotFoundError(f"no calibration at {path}: run python -m minifsdp.calibrate first")
        with open(path) as f:
            raw = json.load(f)
        return cls(raw["device"], raw["backend"], {int(k): v for k, v in raw["compute"].items()},
                   {op: {int(g): v for g, v in by.items()} for op, by in raw["collectives"].items()},
                   raw.get("notes", {}))

    def merge(self, other: "Calibration") -> "Calibration":
        """This calibration with ``other``'s world sizes and group sizes added (``other`` wins)."""
        coll = {op: {**self.collectives.get(op, {}), **by} for op, by in other.collectives.items()}
        return Calibration(other.device, other.backend, {**self.compute, **other.compute},
                           {**self.collectives, **coll}, {**self.notes, **other.notes})

    def _compute(self, world_size: int) -> dict[str, Any]:
        if not self.compute:
            raise ValueError("the calibration has no compute measurement: run python -m minifsdp.calibrate")
        return self.compute[min(self.compute, key=lambda w: (abs(w - world_size), w))]

    def matmul_flops(self, world_size: int, dtype: str = "fp32", call_flops: float | None = None) -> float:
        """One rank's matmul FLOP/s with ``world_size`` ranks running: interpolated (log-log) at a GEMM of
        ``call_flops`` between the measured square sizes (2n³ a GEMM); the best rate when None."""
        table = self._compute(world_size)["matmul_flops"]
        points = sorted((2 * n**3, r) for n, r in table.get(dtype) or table["fp32"])
        if call_flops is None:
            return max(r for _, r in points)
        if call_flops <= points[0][0]:
            return points[0][1]
        for (f0, r0), (f1, r1) in zip(points, points[1:]):
            if call_flops <= f1:
                w = math.log(call_flops / f0) / math.log(f1 / f0)
                return math.exp((1 - w) * math.log(r0) + w * math.log(r1))
        return points[-1][1]

    def elementwise_rate(self, world_size: int) -> float:
        """Bytes of saved activations a block's non-matmul ops get through per second, forward and backward."""
        return self._compute(world_size)["elementwise_bytes_per_s"]

    def op_seconds(self, world_size: int) -> float:
        """Host time of one dispatched op (a tiny one: what every op costs before its work)."""
        return self._compute(world_size).get("op_s", 0.0)

    def optimizer_s_per_param(self, world_size: int) -> float:
        return self._compute(world_size)["optimizer_s_per_param"]

    def alpha_beta(self, op: str, group_size: int) -> tuple[float, float]:
        """``(α, β)`` of ``op`` in a group of ``group_size``; the nearest calibrated group scaled by the ring's
        (n-1)/n where that size was not measured."""
        op = _P2P.get(op, op)
        by_group = self.collectives.get(op)
        if not by_group:
            raise ValueError(f"the calibration has no {op!r}: run python -m minifsdp.calibrate")
        g = min(by_group, key=lambda n: (abs(n - group_size), n))
        alpha, beta = by_group[g]["alpha_s"], by_group[g]["beta_s_per_byte"]
        if g == group_size or op == "send":
            return alpha, beta
        ring = ((group_size - 1) / group_size) / ((g - 1) / g)
        return alpha * (group_size - 1) / (g - 1), beta * ring

    def collective_seconds(self, op: str, nbytes: float, group_size: int, calls: int = 1) -> float:
        """α·calls + β·bytes (``comm``'s volume) for ``op`` moving ``nbytes`` per step in ``calls`` calls."""
        if not nbytes or group_size < 2:
            return 0.0
        alpha, beta = self.alpha_beta(op, group_size)
        return alpha * calls + beta * nbytes


@dataclass
class StepTime:
    """One rank's predicted step, in seconds, by part; ``comm`` by mesh dimension and op."""

    matmul_s: float
    memory_s: float
    optimizer_s: float
    dispatch_s: float            # ops x seconds per op on the host
    bubble_s: float
    comm: dict[str, dict[str, float]]
    overlapped_s: float          # collective time hidden behind compute (0 on CPU)
    model_flops: float           # per rank, no recompute
    peak_flops: float
    world_size: int

    device: str = "cpu"

    @property
    def compute_s(self) -> float:
        """CPU: the host does the work and dispatches it, one after the other; CUDA: the host runs ahead."""
        work = self.matmul_s + self.memory_s + self.optimizer_s
        return (work + self.dispatch_s if self.device == "cpu" else max(work, self.dispatch_s)) + self.bubble_s

    @property
    def comm_s(self) -> float:
        return sum(s for ops in self.comm.values() for s in ops.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s - self.overlapped_s

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_s / self.peak_flops

    def __str__(self) -> str:
        comm = ", ".join(f"{dim} {op} {s * 1e3:.1f}" for dim, ops in self.comm.items() for op, s in ops.items())
        return (f"predicted step {self.step_s * 1e3:.1f} ms (matmuls {self.matmul_s * 1e3:.1f}, memory-bound "
                f"{self.memory_s * 1e3:.1f}, optimizer {self.optimizer_s * 1e3:.1f}, dispatch "
                f"{self.dispatch_s * 1e3:.1f}, bubble {self.bubble_s * 1e3:.1f}"
                f", collectives {comm or 'none'}, hidden {self.overlapped_s * 1e3:.1f}), MFU {self.mfu:.1%}")


def gpt_matmul_flops(config: GPTConfig, tokens: int, seq_len: int, checkpoint: str = "none") -> dict[str, float]:
    """Matmul FLOPs of one training step on ``tokens`` tokens of sequences ``seq_len`` long (forward, backward
    and recompute), for the whole model: ``{"blocks", "head", "recompute", "model", "total"}``.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> f = gpt_matmul_flops(MODEL_PRESETS["gpt-tiny"], 256, 32)   # 3 x (2 x (24 h^2 + 4 T h) + 2 h V) x 256
    >>> f["model"], f["total"]
    (56623104, 56623104)
    """
    h, T, L, V = config.n_embd, seq_len, config.n_layer, config.vocab_size
    moe = sum(config.is_moe_block(i) for i in range(L)) if config.n_expert else 0
    mlp = 16 * h * h
    linear = (L - moe) * (8 * h * h + mlp) + moe * (8 * h * h + mlp * config.top_k + 2 * h * config.n_expert)
    attention = L * 4 * T * h
    forward = {"blocks": (linear + attention) * tokens, "head": 2 * h * V * tokens}
    recompute = {"none": 0, "full": forward["blocks"], "selective": attention * tokens}[checkpoint]
    out = {k: 3 * v for k, v in forward.items()}
    out.update(recompute=recompute, model=out["blocks"] + out["head"])
    out["total"] = out["model"] + recompute
    return out


def elementwise_bytes(config: GPTConfig, sequences: int, seq_len: int, tp: int = 1, cp: int = 1,
                      elem: int = 4) -> dict[str, float]:
    """Bytes autograd saves for the non-matmul ops of one rank's step (``sequences`` of ``seq_len``, split by
    tp and cp): per block the two layer norms' inputs, the attention probabilities (T/cp queries against T
    keys, heads / tp) and GELU's input (4h / tp; k of them for a MoE block's tokens); the final norm's
    input and the loss's log-softmax (V / tp). What ``calibrate`` times the same ops on.

    >>> from minifsdp.models import MODEL_PRESETS
    >>> elementwise_bytes(MODEL_PRESETS["gpt-tiny"], 8, 32)     # 4 B x 2 x (2 bTh + b heads T^2 + 4 bTh); 4 bT(h + V)
    {'blocks': 524288, 'head': 294912}
    """
    b, T, h, L = sequences, seq_len // cp, config.n_embd, config.n_layer
    moe = sum(config.is_moe_block(i) for i in range(L)) if config.n_expert else 0
    gelu = ((L - moe) + moe * config.top_k) * 4 * b * T * h // tp
    per_block = 2 * b * T * h + b * config.n_head // tp * T * seq_len
    return {"blocks": elem * (L * per_block + gelu), "head": elem * b * T * (h + config.vocab_size // tp)}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside ``with OpCounter() as c:`` (``c.n``), autograd's backward too."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


@functools.lru_cache(maxsize=64)
def gpt_op_count(config: GPTConfig) -> dict[str, int]:
    """Ops one training step of ``config``'s GPT dispatches: ``{"forward", "backward", "optimizer"}`` (AdamW's
    second step, the for-loop implementation CPU tensors get). Sizes do not change the count, so it is
    counted on a miniature (the same layers and heads, 4 features a head, 8 tokens, vocabulary 8)."""
    mini = dataclasses.replace(config, n_embd=4 * config.n_head, vocab_size=8, block_size=4, dropout=0.0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(mini)
        ids = torch.randint(0, 8, (2, 4))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    lm_loss(model(ids), ids).backward()
    opt.step()  # the first step creates AdamW's state
    counts = {}
    for phase in ("forward", "backward", "optimizer"):
        with OpCounter() as c:
            if phase == "forward":
                loss = lm_loss(model(ids), ids)
            elif phase == "backward":
                loss.backward()
            else:
                opt.step()
        counts[phase] = c.n
    return counts


def _calls(dim: str, op: str, nbytes: float, layers: int, micro: int, zero_stage: int, cp: int) -> int:
    """Calls per step (α is paid once each): one per DDP bucket, one per FSDP unit and pass, one per block's
    collective for tensor / context / expert parallel, two per micro-batch for a pipeline's cut."""
    if dim == "dp":
        if op == "all_reduce":
            return max(1, math.ceil(nbytes / 2 / BUCKET_BYTES))
        passes = 2 if op == "all_gather" and zero_stage == 3 else 1
        return passes * layers + 1
    if dim == "tp":
        return (4 * layers + 4) * micro
    if dim == "pp":
        return 2 * micro
    if dim == "cp":
        return 3 * (cp - 1) * layers * micro
    return 5 * layers * micro  # ep: counts, dispatch, combine and their reverses per MoE layer


def predict_gpt(cal: Calibration, config: GPTConfig, *, batch: int, seq_len: int, comm: dict[str, dict[str, float]],
                params_per_device: int, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                micro_batches: int = 1, virtual_stages: int = 1, precision: str = "fp32", autocast: bool = False,
                checkpoint: str = "none", zero_stage: int = 0, group_sizes: dict[str, int] | None = None) -> StepTime:
    """One rank's predicted step for a GPT on a layout. ``batch`` is global (sequences per optimizer step),
    ``comm`` the planner's bytes per mesh dimension and op, ``params_per_device`` the parameters this rank holds
    (the planner's); ``micro_batches`` a pipeline's or gradient accumulation's. ``group_sizes``: a dimension's
    group size per op where not the dimension's degree (HYBRID_SHARD: its all-reduce across replicas)."""
    world = dp * tp * pp * cp
    tokens = batch // dp * seq_len // cp                       # this rank's tokens per step
    flops = gpt_matmul_flops(config, tokens, seq_len, checkpoint)
    blocks_share = 1 / (tp * pp)
    matmul = (flops["blocks"] + flops["recompute"]) * blocks_share + flops["head"] / (tp * pp)
    model = flops["model"] / (tp * pp)
    dtype = "bf16" if precision != "fp32" or autocast else "fp32"
    micro_tokens = tokens // micro_batches
    gemm = 2 * micro_tokens * config.n_embd * 4 * config.n_embd / tp          # the MLP's c_fc, a typical call
    matmul_s = matmul / cal.matmul_flops(world, dtype, gemm)
    acts = elementwise_bytes(config, batch // dp, seq_len, tp, cp, 4 if dtype == "fp32" else 2)
    recompute = 4 / 3 if checkpoint != "none" else 1.0     # the blocks' forward again
    memory_s = (acts["blocks"] * recompute + acts["head"]) / pp / cal.elementwise_rate(world)
    stepped = params_per_device / (dp * cp if zero_stage >= 1 else 1)
    optimizer_s = stepped * cal.optimizer_s_per_param(world)
    ops = gpt_op_count(config)
    passes = micro_batches * (ops["forward"] * (2 if checkpoint != "none" else 1) + ops["backward"])
    dispatch_s = (passes + ops["optimizer"]) / pp * cal.op_seconds(world)
    bubble_s = 0.0
    if pp > 1:
        bubble_s = (matmul_s + memory_s + dispatch_s) * (pp - 1) / (virtual_stages * micro_batches)
    degree = {"dp": dp * cp, "tp": tp, "pp": 2, "cp": 2, "ep": ep}
    layers = config.n_layer // pp
    seconds: dict[str, dict[str, float]] = {}
    for dim, ops in comm.items():
        for op, nbytes in ops.items():
            group = (group_sizes or {}).get(op, degree[dim]) if dim == "dp" else degree[dim]
            calls = _calls(dim, op, nbytes, layers, micro_batches, zero_stage, cp)
            seconds.setdefault(dim, {})[op] = cal.collective_seconds(op, nbytes, group, calls)
    work = matmul_s + memory_s + optimizer_s
    compute = (work + dispatch_s if cal.device == "cpu" else max(work, dispatch_s)) + bubble_s
    overlapped = 0.0
    if cal.device != "cpu":  # NCCL: the data-parallel collectives run on their own stream, behind compute
        overlapped = min(compute, sum(s for op, s in seconds.get("dp", {}).items() if op != "broadcast"))
    return StepTime(matmul_s, memory_s, optimizer_s, dispatch_s, bubble_s, seconds, overlapped, model,
                    cal.matmul_flops(world, dtype), world, cal.device)
