"""The knobs of ``fully_shard`` (FSDP2): mixed precision and CPU offload policies.

Names, fields and defaults mirror ``torch.distributed.fsdp.MixedPrecisionPolicy``,
``OffloadPolicy`` and ``CPUOffloadPolicy`` (torch 2.13), so FSDP2 code runs on
minifsdp by changing the import::

    from minifsdp.fsdp import fully_shard, MixedPrecisionPolicy
    fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=torch.float32))

The code that acts on them is ``param_group.py`` (casts on the all-gather and the
reduce-scatter, where the parameters live) and ``fully_shard.py`` (inputs, outputs).
FSDP1's ``MixedPrecision`` (``api.py``) has more fields because it also casts
buffers and has to keep a low-precision copy of a flat shard; FSDP2 casts while
copying the shard into the all-gather buffer, so nothing else is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mixed_precision.policy import check_policy_dtypes

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision: cast at module boundaries, not per op (as autocast would).

    * ``param_dtype``: dtype of the unsharded parameters, hence of the all-gather and of
      forward/backward compute. The sharded parameters (what the optimizer steps) keep
      their own dtype, so fp32 master weights cost nothing extra: they *are* the shards.
    * ``reduce_dtype``: dtype of the gradient reduce-scatter / all-reduce (None: param_dtype).
      bf16 compute with fp32 reduction sums N ranks' gradients without bf16 rounding each add.
    * ``output_dtype``: cast the module's floating outputs to this (None: leave them).
    * ``cast_forward_inputs``: cast the module's floating inputs to ``param_dtype``.

    Bytes per step for Ψ parameters, N ranks, bf16 params and fp32 reduction: all-gathers
    2·2Ψ (forward and backward), reduce-scatter 4Ψ, instead of 3·4Ψ in fp32.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        check_policy_dtypes("MixedPrecisionPolicy", param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                            output_dtype=self.output_dtype)


@dataclass
class OffloadPolicy:
    """No offloading: the sharded parameters, gradients and optimizer state stay on the device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters and gradients on the CPU (and so the optimizer's state and step).

    Each all-gather first copies the shard to the device; each reduced gradient shard is
    copied back to the CPU. ``pin_memory`` pins the CPU shards so those copies can run
    asynchronously on CUDA (ignored on a CPU-only machine, where there is nothing to pin for).
    """

    pin_memory: bool = True
