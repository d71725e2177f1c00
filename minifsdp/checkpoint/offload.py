"""Activation offloading: what autograd saves for backward waits in CPU memory.

The other way to take activations off the accelerator (torch's
``torch.autograd.graph.save_on_cpu`` and ``offload_wrapper``; ZeRO-Offload
and ZeRO-Infinity do it for activations checkpoints too): no recompute, but
every saved tensor crosses the host link twice (device -> host in forward,
host -> device in backward). Two saved-tensor hooks do it:

    pack(t)    forward:  copy t into (pinned) host memory, remember its device
    unpack(p)  backward: copy it back to that device

On a CPU-only machine there is nothing to move (the tensors already live in
host memory), so the hooks pass tensors through and memory is unchanged:
this is a lesson for a GPU, shown honestly on a laptop.

    >>> with offload_saved_tensors():
    ...     loss = model(x).sum()      # saved activations now in host memory
    >>> loss.backward()                # each brought back when its node runs
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["offload_saved_tensors"]


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it are kept on the CPU."""

    def __init__(self, pin_memory: bool = True) -> None:
        pin = pin_memory and torch.cuda.is_available()  # pinning needs a CUDA build (and helps only there)

        def pack(t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
            if t.device.type == "cpu":
                return t.device, t  # already in host memory
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return t.device, host

        def unpack(packed: tuple[torch.device, torch.Tensor]) -> Any:
            device, t = packed
            return t.to(device, non_blocking=pin)

        super().__init__(pack, unpack)
