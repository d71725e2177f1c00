"""``ZeroRedundancyOptimizer``: torch's name and signature for ZeRO-1, on top of ``OSS``.

Layer 5 (techniques). Mirrors ``torch.distributed.optim.ZeroRedundancyOptimizer``
(itself modelled on FairScale's OSS): code written for torch runs by changing
the import::

    from minifsdp.zero import ZeroRedundancyOptimizer
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    loss.backward()                    # gradients averaged by DDP, as with torch's
    opt.step()                         # step this rank's shard, then broadcast from the owners
    opt.consolidate_state_dict(to=0)   # every rank; then opt.state_dict() on rank 0

The mechanism is ``OSS`` (same partition, same 3P per step with DDP, P = parameter bytes); this file
only translates the arguments. Read first: ``oss.py``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed import ProcessGroup

from .oss import OSS

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(OSS):
    """``ZeroRedundancyOptimizer(params, optimizer_class, process_group=None,
    parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults)``, as in torch.

    The two torch options that change *how* the work is laid out are not
    implemented and raise, naming why; leaving them False gives torch's results.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer],
                 process_group: ProcessGroup | None = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False, **defaults: Any):
        if parameters_as_bucket_view:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(parameters_as_bucket_view=True) is not implemented: minifsdp keeps "
                "each parameter in its own storage and broadcasts them in packed buckets "
                "(OSS.broadcast_buffer_size) instead; leave it False (the results are the same)")
        if overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not implemented: it needs a DDP comm hook "
                "that steps each bucket's shard as its all-reduce ends, and minifsdp's DDP has no comm hooks; "
                "leave it False and call step() after backward")
        super().__init__(params, optim=optimizer_class, group=process_group, **defaults)
        self.process_group = process_group

    def consolidate_state_dict(self, to: int = 0) -> None:  # torch's argument name
        """Gather every rank's shard on rank ``to`` of the group; call on every rank."""
        super().consolidate_state_dict(recipient_rank=to)
