"""What a checkpointed forward ran under, captured so that its recompute runs the same.

A recompute in backward must produce *bit-identical* tensors, or the gradients
silently change. Two pieces of global state decide what an op returns besides
its inputs:

* the random number generators: ``F.dropout`` draws a fresh mask each call, so
  the recompute restores the RNG state the forward started from (CPU always;
  CUDA, guarded, for the devices the inputs live on), inside
  ``torch.random.fork_rng`` so the caller's RNG stream is left where backward
  found it;
* autocast: an op under ``torch.autocast`` runs in bf16/fp16, so the recompute
  re-enters the same autocast state (CPU, and CUDA when it exists).

``torch.utils.checkpoint`` does the same (``preserve_rng_state=True``,
``_get_autocast_kwargs``); read ``reentrant.py`` or ``non_reentrant.py`` first,
this file is their helper::

    state = ForwardState(args, preserve_rng_state=True)   # before the forward
    ...
    with state.replay():                                   # in backward
        fn(*args)            # dropout draws the same masks as the forward did
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["ForwardState", "tensors_in"]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists and dicts."""
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _autocast_device_types() -> list[str]:
    # "cuda" is queried only where CUDA exists: asking a CPU build is harmless, entering its
    # autocast is not (it warns that CUDA is unavailable and disables itself).
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


class ForwardState:
    """RNG and autocast state at the start of a checkpointed forward."""

    def __init__(self, inputs: Any, preserve_rng_state: bool = True) -> None:
        self.preserve_rng_state = preserve_rng_state
        self.cpu_rng = torch.get_rng_state() if preserve_rng_state else None
        self.cuda_devices: list[int] = []
        self.cuda_rng: list[torch.Tensor] = []
        # Guarded: only touch CUDA's generators when CUDA is initialised and an input is there
        # (calling torch.cuda.* otherwise would initialise CUDA, or fail on a CPU build).
        if preserve_rng_state and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda_devices = sorted({t.get_device() for t in tensors_in(inputs) if t.is_cuda})
            self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = {dt: (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
                         for dt in _autocast_device_types()}

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the forward's RNG and autocast state; restore the caller's RNG after."""
        with contextlib.ExitStack() as stack:
            if self.preserve_rng_state:
                stack.enter_context(torch.random.fork_rng(devices=self.cuda_devices, enabled=True,
                                                          device_type="cuda"))
                torch.set_rng_state(self.cpu_rng)
                for device, state in zip(self.cuda_devices, self.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield
