"""The precision policy: which dtype each tensor of a training step lives in.

Mirrors ``torch.distributed.fsdp.MixedPrecision`` (FSDP1) and FairScale's
``mixed_precision`` / ``compute_dtype`` / ``fp32_reduce_scatter`` flags, which
follow the recipe of Micikevicius et al. 2018, "Mixed Precision Training":
keep a full-precision *master* copy of the weights for the optimizer, run
forward and backward in a 16-bit copy, and cast the gradients back.

The three 16/32-bit formats (``format_table()`` prints them)::

    dtype     exponent  mantissa  largest   smallest normal  step at 1.0 (eps)
    float32   8 bits    23 bits   3.4e38    1.2e-38          1.2e-7
    bfloat16  8 bits     7 bits   3.4e38    1.2e-38          7.8e-3
    float16   5 bits    10 bits   65504     6.1e-5           9.8e-4

bf16 keeps fp32's range with fewer digits: nothing underflows that fp32
would keep, so it needs no loss scaling. fp16 has more digits but a narrow
range: gradients below ~6e-8 (its smallest subnormal) become 0, which is
what the gradient scaler (``grad_scaler.py``) prevents.

Two ways to compute in low precision, and when to use which:

* **Parameter casting** (this policy, applied by FSDP/DDP/ZeRO): the module's
  weights *are* bf16/fp16 during forward and backward, so every op runs in
  that dtype, all-gathers move half the bytes, and the unsharded parameters
  and their gradients take half the memory. Numerically sensitive ops
  (softmax, LayerNorm statistics, the loss) see low-precision inputs too.
* **``torch.autocast``** (per op): weights stay fp32; a list of ops (matmul,
  linear, conv) casts its inputs to the autocast dtype, while sensitive ops
  (softmax, log_softmax, layer_norm, losses) run in fp32. Safer numerics,
  but no communication or parameter-memory saving; ``autocast(device)``
  below picks the dtype (CPU: bf16; CUDA: bf16 where supported, else fp16).
  The two compose: FSDP with ``param_dtype=bf16`` inside an autocast region.

Read this file first, then ``grad_scaler.py``; ``fsdp/``, ``ddp/`` and
``zero/`` apply the policy.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map

__all__ = ["MixedPrecision", "LOW_PRECISION", "from_fairscale", "resolve", "cast_floating", "keep_fp32",
           "check_dtype_supported", "autocast", "autocast_dtype", "needs_loss_scaling", "format_info",
           "format_table", "PRECISIONS", "policy_for", "warn_if_unnecessary_scaler",
           "check_policy_dtypes"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class MixedPrecision:
    """Compute in low precision, keep a full-precision sharded master copy (torch's fields and defaults).

    * ``param_dtype``: the shard is cast to it *before* the all-gather, so the
      gather moves half the bytes and forward/backward run in it.
    * ``reduce_dtype``: gradients are reduced (reduce-scatter / all-reduce) in
      it; default ``param_dtype``. ``torch.float32`` trades bytes for accuracy.
    * ``buffer_dtype``: floating buffers are cast to it at the first forward.
    * ``keep_low_precision_grads``: False (default): the optimizer gets fp32
      gradients on the fp32 master shard. True: it gets them in ``reduce_dtype``
      (half the gradient memory; the optimizer must cope with 16-bit grads).
    * ``cast_forward_inputs``: every unit casts its floating inputs to
      ``param_dtype``; ``cast_root_forward_inputs`` (default) only the root.
    * ``_module_classes_to_ignore``: with an auto-wrap policy, modules of these
      classes (BatchNorm: its running statistics drift in 16 bits) get their
      own unit in full precision, inputs cast to fp32 and outputs back.

    >>> MixedPrecision(torch.bfloat16).reduce_dtype is None   # "same as param_dtype"
    True
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)

    def __post_init__(self) -> None:
        check_policy_dtypes("MixedPrecision", param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                            buffer_dtype=self.buffer_dtype)

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``reduce_dtype``, else ``param_dtype``)."""
        return self.reduce_dtype or self.param_dtype


def check_policy_dtypes(policy: str, **dtypes: Any) -> None:
    """A policy's dtypes are floating ``torch.dtype``s or None: one line naming the fix at construction,
    instead of a failure at the first cast (a string such as "bf16", an integer dtype)."""
    for name, dtype in dtypes.items():
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"{policy}({name}={dtype!r}): a policy dtype is a floating torch.dtype or None; pass "
                            f"e.g. {name}=torch.bfloat16")


def from_fairscale(mixed_precision: bool = False, fp32_reduce_scatter: bool = False,
                   compute_dtype: torch.dtype | None = None,
                   buffer_dtype: torch.dtype | None = None) -> MixedPrecision | None:
    """FairScale's FSDP precision flags, with FairScale's meaning, as a ``MixedPrecision``.

    FairScale: ``mixed_precision=True`` computes *and communicates* in
    ``compute_dtype`` (default fp16) with an fp32 master shard; gradients are
    reduce-scattered in fp16 unless ``fp32_reduce_scatter``; buffers default to
    ``compute_dtype``. Without ``mixed_precision`` everything stays fp32.

    >>> from_fairscale(True)
    MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16, ...)
    >>> from_fairscale(True, fp32_reduce_scatter=True).reduce_dtype
    torch.float32
    """
    if fp32_reduce_scatter and not mixed_precision:
        raise ValueError("fp32_reduce_scatter=True requires mixed_precision=True (as in FairScale)")
    if not mixed_precision:
        if compute_dtype not in (None, torch.float32):
            raise ValueError(f"compute_dtype={compute_dtype} without mixed_precision=True is FairScale's pure "
                             "low-precision mode; cast the model yourself (model.half()) or pass mixed_precision=True")
        return None if buffer_dtype in (None, torch.float32) else MixedPrecision(buffer_dtype=buffer_dtype)
    compute = compute_dtype or torch.float16
    return MixedPrecision(param_dtype=compute, reduce_dtype=torch.float32 if fp32_reduce_scatter else compute,
                          buffer_dtype=buffer_dtype or compute)


def resolve(mp: MixedPrecision | bool | None) -> MixedPrecision | None:
    """The ``mixed_precision=`` argument as a policy: ``True`` is FairScale's (fp16 compute and reduction)."""
    if mp is True:
        return from_fairscale(True)
    if mp is False or mp is None:
        return None
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mixed_precision must be a MixedPrecision, True or None, got {type(mp).__name__}; pass "
                        "e.g. MixedPrecision(param_dtype=torch.bfloat16)")
    return mp


def policy_for(precision: str) -> MixedPrecision | None:
    """The trainer's ``--precision fp32|bf16|fp16`` as a policy (fp32 master, 16-bit compute and reduction)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    return None if dtype == torch.float32 else MixedPrecision(dtype, dtype, dtype)


# -- casting helpers ------------------------------------------------------------------
def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating-point tensor in a nested structure (args, kwargs, outputs) to ``dtype``.

    Integer tensors (token ids, labels) and non-tensors pass through untouched.

    >>> cast_floating((torch.ones(2), {"ids": torch.arange(2)}), torch.bfloat16)[0].dtype
    torch.bfloat16
    """
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.dtype != dtype else t, tree)


def _to_fp32_hook(module: nn.Module, args: tuple) -> tuple:
    module.__dict__["_mp_input_dtype"] = next(
        (t.dtype for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return cast_floating(args, torch.float32)


def _back_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    return cast_floating(output, module.__dict__.get("_mp_input_dtype"))


def keep_fp32(module: nn.Module) -> nn.Module:
    """Run ``module`` in fp32 inside a low-precision model: inputs up, outputs back to the input dtype.

    What torch FSDP does for ``MixedPrecision._module_classes_to_ignore``
    (BatchNorm by default): the module gets its own unit without mixed
    precision, and these two hooks let it sit between bf16/fp16 neighbours.
    Idempotent.
    """
    if not module.__dict__.get("_mp_keep_fp32", False):
        module.register_forward_pre_hook(_to_fp32_hook)
        module.register_forward_hook(_back_hook)
        module.__dict__["_mp_keep_fp32"] = True
    return module


# -- can this device compute in this dtype? ----------------------------------------------
@functools.lru_cache(maxsize=None)
def _can_compute(dtype: torch.dtype, device_type: str) -> bool:
    """Try the ops a training step needs (matmul, its backward, softmax) in ``dtype``."""
    try:
        device = torch.device(device_type)
        if device_type == "cuda":
            if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                return False
            if dtype == torch.float16 and torch.cuda.get_device_capability() < (5, 3):
                return False  # no native fp16 arithmetic before Maxwell (sm_53)
        a = torch.ones(4, 4, dtype=dtype, device=device, requires_grad=True)
        (a @ a).softmax(-1).sum().backward()
        return bool(torch.isfinite(a.grad).all())
    except (RuntimeError, TypeError, AssertionError):
        return False


def check_dtype_supported(dtype: torch.dtype | None, device: torch.device | str) -> None:
    """Raise a one-line error naming the fix when ``device`` cannot compute in ``dtype``."""
    if dtype is None or dtype == torch.float32:
        return
    device_type = torch.device(device).type
    if not _can_compute(dtype, device_type):
        other = "bf16" if dtype == torch.float16 else "fp16"
        raise ValueError(f"{device_type} cannot compute in {dtype} here (its matmul/backward fails or is "
                         f"missing); use precision fp32 or {other}, or run on a device that supports {dtype}")


def needs_loss_scaling(dtype: torch.dtype | None) -> bool:
    """fp16 needs a loss scaler (5-bit exponent: small gradients underflow); bf16 and fp32 do not."""
    return dtype == torch.float16


def autocast_dtype(device: torch.device | str) -> torch.dtype:
    """The autocast dtype to use on ``device``: CPU bf16; CUDA bf16 where supported (no scaler), else fp16."""
    device_type = torch.device(device).type
    if device_type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def autocast(device: torch.device | str, dtype: torch.dtype | None = None,
             enabled: bool = True) -> torch.autocast:
    """``torch.autocast`` for ``device`` with the dtype ``autocast_dtype`` picks (checked, one-line errors).

    >>> with autocast("cpu"):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype        # matmul: autocast's dtype
    torch.bfloat16
    """
    device_type = torch.device(device).type
    dtype = dtype or autocast_dtype(device_type)
    if enabled and dtype not in LOW_PRECISION:  # torch.autocast would only warn and run everything in fp32
        raise ValueError(f"autocast computes in torch.bfloat16 or torch.float16, got {dtype}; pass one of them, or "
                         "enabled=False to run in fp32")
    if enabled:
        check_dtype_supported(dtype, device_type)
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled)


def warn_if_unnecessary_scaler(dtype: torch.dtype | None) -> None:
    """A gradient scaler with bf16 is harmless but unnecessary: say why, once."""
    if dtype == torch.bfloat16:
        warnings.warn("GradScaler with bfloat16 is unnecessary: bf16 has fp32's 8-bit exponent, so gradients "
                      "do not underflow; drop the scaler (GradScaler(enabled=False)) or use fp16", stacklevel=3)


# -- number formats, for the lab's pictures --------------------------------------------------
def format_info(dtype: torch.dtype) -> dict[str, float | int]:
    """Range and precision of a floating dtype: the numbers behind the table in the module docstring.

    ``tiny`` is the smallest *subnormal*: anything smaller in magnitude rounds to 0.

    >>> format_info(torch.float16)["max"]
    65504.0
    """
    fi = torch.finfo(dtype)
    return {"bits": fi.bits, "mantissa_bits": -round(torch.log2(torch.tensor(fi.eps)).item()),
            "max": fi.max, "smallest_normal": fi.smallest_normal, "tiny": fi.smallest_normal * fi.eps,
            "eps": fi.eps}


def format_table(dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16)) -> str:
    """The formats side by side, as printed text."""
    rows = [f"{'dtype':9} {'mantissa':>8} {'max':>9} {'min normal':>11} {'min subnormal':>14} {'eps':>9}"]
    for dt in dtypes:
        i = format_info(dt)
        rows.append(f"{str(dt).replace('torch.', ''):9} {i['mantissa_bits']:>8} {i['max']:>9.3g} "
                    f"{i['smallest_normal']:>11.3g} {i['tiny']:>14.3g} {i['eps']:>9.3g}")
    return "\n".join(rows)
