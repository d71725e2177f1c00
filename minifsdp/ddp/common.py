"""What every data-parallel wrapper needs before and around its gradient sync.

Layer 5 (techniques), ``minifsdp.ddp``'s shared helpers:

* ``broadcast_coalesced`` - rank 0's parameters and buffers on every rank, in
  ONE broadcast per device (torch DDP's ``_sync_module_states`` packs them the
  same way), so every replica starts from the same weights;
* ``_check_same_model_everywhere`` - a wrong model on one rank fails at wrap
  time, on every rank, instead of hanging a later all-reduce;
* ``_weak_hook`` - a gradient hook that does not keep a replaced wrapper alive.

The source of a group's broadcast is ``dist.global_rank(group, 0)``.

Read first: ``ddp/__init__.py`` (the idea and the order of the files). Used by
``naive.py``, ``bucketed.py`` and ``distributed.py``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed import ProcessGroup

from .. import comm, dist

__all__ = ["broadcast_coalesced"]


@torch.no_grad()
def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, group: ProcessGroup | None = None,
                        reuse: dict[torch.device, torch.Tensor] | None = None) -> None:
    """Make every rank's ``tensors`` equal to rank ``src``'s with ONE broadcast per device.

    Tensors of any dtype are viewed as raw bytes and packed into one uint8
    buffer (torch's ``_sync_module_states`` coalesces the same way): one large
    message instead of many small ones.

    >>> broadcast_coalesced([model.weight, model.bias])   # rank 1 now holds rank 0's values

    ``reuse``: a dict that keeps each device's packed buffer for the next call, for a caller that syncs the
    same tensors every step (DDP's buffers before each forward): packed in place, not allocated again.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group_tensors in by_device.items():
        as_bytes = [t.detach().reshape(-1).view(torch.uint8) for t in group_tensors]
        flat = (reuse or {}).get(device)
        if flat is not None and flat.numel() == sum(b.numel() for b in as_bytes):
            torch.cat(as_bytes, out=flat)
        else:
            flat = torch.cat(as_bytes)
            if reuse is not None:
                reuse[device] = flat
        comm.broadcast(flat, src=src, group=group)
        for t, chunk in zip(group_tensors, flat.split([b.numel() for b in as_bytes])):
            t.copy_(chunk.view(t.dtype).view_as(t))


def _weak_hook(owner: Any, method: str, *args: Any):
    """A gradient hook that calls ``owner.method(*args)`` while ``owner`` is alive.

    The hook lives on the parameter, which outlives a wrapper that a notebook
    replaces (``model = DistributedDataParallel(m)`` run twice): a strong
    reference would keep the old wrapper alive and all-reducing too.
    """
    ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            getattr(live, method)(param, *args)
    return hook


def require_trainable(params: list[Any], who: str) -> None:
    """A wrapper of a frozen module would synchronise nothing: say so before any collective runs."""
    if not params:
        raise ValueError(f"{who}: the module has no parameter that requires a gradient; there is nothing to "
                         "synchronise (do not wrap it)")


def _check_same_model_everywhere(params: list[torch.Tensor], group: ProcessGroup | None, who: str) -> None:
    """Fail loudly (on every rank) if ranks wrapped different models: else a later all-reduce hangs.

    One tiny all-reduce(MAX) of a shape signature and its negation gives max and min at once.
    """
    shapes_sig = sum((i + 1) * (p.numel() % 1_000_003) for i, p in enumerate(params))
    sig = torch.tensor([len(params), sum(p.numel() for p in params), shapes_sig], dtype=torch.float64)
    both = torch.cat([sig, -sig]).to(dist.device())
    comm.all_reduce(both, op=comm.ReduceOp.MAX, group=group)
    both = both.cpu()
    if not (torch.equal(both[:3], sig) and torch.equal(-both[3:], sig)):
        raise ValueError(f"{who}: ranks wrapped different models (parameter count/shapes differ); build the "
                         "same model on every rank before wrapping it")
