"""The naive data parallel: one blocking all-reduce per gradient, from a hook.

Layer 5 (techniques). ``NaiveDataParallel`` is picotron's ``DataParallelNaive``
idea: a hook on each parameter all-reduces its gradient the moment it is
ready, one blocking collective per tensor. Easy to read; slow (many tiny
messages, and backward stops while each one is on the wire). Same contract as
``torch.nn.parallel.DistributedDataParallel``: wrap, run forward and backward,
step; ``no_sync()`` for gradient accumulation.

Read first: ``ddp/__init__.py`` (the idea and the order of the files) and
``common.py`` (the start-up broadcast, the hook helper). Next: ``bucketed.py``,
the same contract made fast.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist
from .common import _weak_hook, require_trainable

__all__ = ["NaiveDataParallel"]


class NaiveDataParallel(nn.Module):
    """Average each gradient across ranks the moment autograd has accumulated it.

    Choice made here (picotron's DataParallelNaive does the same): the sync
    happens by itself in a per-parameter ``register_post_accumulate_grad_hook``,
    so training code is the same as for torch DDP - no ``sync_gradients()``
    call to forget. Each hook does a *blocking* ``all_reduce`` of one tensor:
    backward waits for the network once per parameter. Compare with
    ``DistributedDataParallel`` (``bucketed.py``) in the timeline.

    ``no_sync()`` is read when each hook runs (at *backward* time), unlike
    torch DDP which decides at forward time (see ``DistributedDataParallel``).

    >>> model = NaiveDataParallel(nn.Linear(4, 2))   # inside launch(fn, 2)
    >>> model(torch.randn(3, 4)).sum().backward()    # 2 all-reduces: weight, bias
    """

    def __init__(self, module: nn.Module, process_group: ProcessGroup | None = None):
        super().__init__()
        dist.require_initialized("NaiveDataParallel")
        dist.require_module(module, "NaiveDataParallel")
        dist.require_group(process_group, "NaiveDataParallel's process_group")
        # before the broadcast below, not after it
        require_trainable([p for p in module.parameters() if p.requires_grad], "NaiveDataParallel")
        self.module = module
        self.process_group = process_group
        self.require_backward_grad_sync = True
        self._world = dist.world_size(process_group)
        # Same starting point everywhere: rank 0's parameters and buffers, one tensor at a time.
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(t.data, src=dist.global_rank(process_group, 0), group=process_group)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_weak_hook(self, "_all_reduce_grad"))

    def _all_reduce_grad(self, param: torch.Tensor) -> None:
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): keep accumulating locally
        with torch.no_grad():
            param.grad.div_(self._world)  # divide first (as torch does): sum of averages = average
            comm.all_reduce(param.grad, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the all-reduce for backward passes run inside; gradients accumulate locally."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)
