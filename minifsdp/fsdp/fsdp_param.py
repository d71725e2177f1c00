"""One parameter sharded on its own along dim 0: FSDP2's ``FSDPParam``.

Mirrors ``torch.distributed.fsdp._fully_shard._fsdp_param`` (FSDP2, the
per-parameter design that replaced FSDP1's flat parameter). Where FSDP1
(``flat_param.py``) concatenates a unit's tensors into one flat buffer and cuts
*that* into N slices, FSDP2 cuts *each parameter* into N pieces along its first
dimension, as ``torch.chunk`` does, and pads each piece to the same number of
rows so every rank sends equal bytes to the all-gather.

Worked example: ``w`` of shape ``[5, 3]`` on N = 4 ranks. ``ceil(5 / 4) = 2``
rows per rank; rank 2 holds one real row, rank 3 none::

    w rows   0 1 | 2 3 | 4 . | . .        (. = a padding row of zeros)
    rank       0     1     2     3
    to_local()   [2, 3]  [2, 3]  [1, 3]  [0, 3]     <- torch.chunk's pieces
    padded       [2, 3]  [2, 3]  [2, 3]  [2, 3]     <- what the all-gather sends

The sharded parameter is a ``torch.distributed.tensor.DTensor`` with placement
``Shard(0)``: ``p.to_local()`` is this rank's real rows, ``p.full_tensor()``
the whole ``[5, 3]``, and ``model.parameters()`` yields these DTensors, so a stock
``torch.optim.AdamW`` steps on the shards. Padding costs at most N - 1 rows *per
parameter* (FSDP1: at most N - 1 elements per unit); in exchange a parameter
keeps its identity, its shape, its dtype and its ``requires_grad`` — no flat
buffer to map back to names, which is why FSDP2 replaced FSDP1.

What lives where (one ``FSDPParam``):

* ``sharded_param`` -- the DTensor ``nn.Parameter``, registered on the module at rest.
* ``unsharded_param`` -- the full ``nn.Parameter`` in the compute dtype, registered
  during forward and backward. Its storage is allocated by ``alloc_unsharded()``
  and freed by ``free_unsharded()`` (``storage.resize_(0)``): the object survives, so
  the tensors autograd saved in forward see the re-gathered values in backward.
  Autograd accumulates the gradient into ``unsharded_param.grad``.

The all-gather and reduce-scatter of a whole module's parameters at once (one
collective each) are in ``param_group.py``; this file only copies this
parameter's rows in and out of those collectives' buffers.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .flat_param import UNSHARDED_GRADS, UNSHARDED_PARAMS, label

__all__ = ["FSDPParam", "ShardLayout"]


class ShardLayout:
    """How a tensor of ``rows`` rows splits over ``members`` ranks: ``rows_per_member`` each, padded.

    ``members`` is the shard group (N ranks) for the sharded parameter, or the smaller
    group of ``reshard_after_forward=k`` (k ranks, each then holding N/k of the N pieces).
    """

    def __init__(self, rows: int, row_numel: int, members: int, rows_per_member: int):
        self.rows, self.row_numel = rows, row_numel
        self.members, self.rows_per_member = members, rows_per_member
        self.numel = rows_per_member * row_numel  # elements one member sends (padding included)
        self.whole = rows // rows_per_member if rows_per_member else members  # members with no padding row

    def real_rows(self, member: int) -> tuple[int, int]:
        """``(first, end)`` of the real rows ``member`` holds (empty past the last row)."""
        first = min(member * self.rows_per_member, self.rows)
        return first, min(first + self.rows_per_member, self.rows)

    def pack(self, full: torch.Tensor, member: int, out: torch.Tensor) -> None:
        """``out`` (``numel`` elements) = ``member``'s rows of ``full``, zeros after them."""
        first, end = self.real_rows(member)
        n = (end - first) * self.row_numel
        out[:n].copy_(full.reshape(-1)[first * self.row_numel:end * self.row_numel])
        out[n:].zero_()

    def pack_all(self, full: torch.Tensor, block: torch.Tensor) -> None:
        """``block`` is ``[members, numel]`` (a strided view): row m = member m's padded piece of ``full``."""
        flat, whole = full.reshape(-1), self.whole
        block[:whole].copy_(flat[:whole * self.numel].view(whole, self.numel))
        if whole < self.members:
            self.pack(full, whole, block[whole])
            block[whole + 1:].zero_()

    def unpack_all(self, block: torch.Tensor, full: torch.Tensor) -> None:
        """The inverse of ``pack_all``: the real rows of every member's piece, in order, into ``full``."""
        flat, whole = full.view(-1), self.whole
        flat[:whole * self.numel].view(whole, self.numel).copy_(block[:whole])
        if whole < self.members:
            tail = flat.numel() - whole * self.numel
            flat[whole * self.numel:].copy_(block[whole, :tail])


class FSDPParam:
    """``param`` sharded over ``shard_size`` ranks (this is ``shard_rank``), as a ``Shard(0)`` DTensor.

    ``uses`` are the ``(module, attribute)`` pairs that hold the parameter (more than one
    when it is tied inside the module); ``placements`` are the DTensor placements on
    ``mesh`` (``(Shard(0),)``, or ``(Replicate(), Shard(0))`` for HSDP).
    """

    def __init__(self, param: nn.Parameter, fqn: str, uses: list[tuple[nn.Module, str]], *, mesh, placements,
                 shard_size: int, shard_rank: int, device: torch.device, param_dtype: torch.dtype | None,
                 offload: bool = False, pin_memory: bool = False):
        if param.dim() == 0:
            raise ValueError(f"fully_shard cannot shard the scalar parameter {fqn!r} along dim 0; "
                             "make it a 1-D tensor of one element (torch's fully_shard refuses it too)")
        self.fqn, self.uses = fqn, uses
        self.mesh, self.placements = mesh, placements
        self.shape, self.dtype, self.requires_grad = param.shape, param.dtype, param.requires_grad
        self.compute_dtype = param_dtype or param.dtype
        self.device, self.offload = device, offload
        self.shard_rank = shard_rank
        row_numel = math.prod(param.shape[1:])
        self.layout = ShardLayout(param.shape[0], row_numel, shard_size, math.ceil(param.shape[0] / shard_size))
        first, end = self.layout.real_rows(shard_rank)
        with torch.no_grad():
            local = param.detach()[first:end].to(device).clone()  # torch.chunk's piece, unpadded
            if offload:
                local = local.cpu()
                if pin_memory and torch.cuda.is_available():
                    local = local.pin_memory()
            sharded = DTensor.from_local(local, mesh, placements, run_check=False,
                                         shape=param.shape, stride=_contiguous_stride(param.shape))
        self.sharded_param = nn.Parameter(sharded, requires_grad=param.requires_grad)
        self.unsharded_param: nn.Parameter | None = None  # made at the first unshard, then kept
        # Set by the param group: called once autograd has accumulated this parameter's gradient.
        self.grad_ready: Callable[[FSDPParam], None] = lambda _: None

    # -- the sharded side ---------------------------------------------------------
    def local_shard(self) -> torch.Tensor:
        """This rank's real rows (``to_local()``), read at every all-gather: what the optimizer last wrote."""
        return self.sharded_param.to_local()

    def set_sharded_grad(self, padded: torch.Tensor) -> None:
        """``padded`` is this rank's reduced piece (``layout.numel`` elements): keep its real rows as the grad."""
        first, end = self.layout.real_rows(self.shard_rank)
        rows = padded[:(end - first) * self.layout.row_numel].view(end - first, *self.shape[1:])
        rows = rows.to("cpu" if self.offload else rows.device, self.dtype)
        grad = DTensor.from_local(rows, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=_contiguous_stride(self.shape))
        if self.sharded_param.grad is None:
            self.sharded_param.grad = grad
        else:  # micro-batches reduced one by one accumulate here, as a plain .grad would
            self.sharded_param.grad += grad

    # -- the unsharded side -------------------------------------------------------
    def alloc_unsharded(self) -> torch.Tensor:
        """Give ``unsharded_param`` its storage back (values still to be written); return its data."""
        if self.unsharded_param is None:
            full = torch.empty(self.shape, dtype=self.compute_dtype, device=self.device)
            self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)
            self.unsharded_param.register_post_accumulate_grad_hook(lambda _: self.grad_ready(self))
        else:
            storage = self.unsharded_param.untyped_storage()
            storage.resize_(self.unsharded_param.numel() * self.unsharded_param.element_size())
        label(self.unsharded_param, UNSHARDED_PARAMS)
        # Written through ``.data``: a fresh version counter, so autograd does not mistake the
        # refill for an in-place change of a tensor it saved in forward (as flat_param.py).
        return self.unsharded_param.data

    def free_unsharded(self) -> None:
        """Drop the unsharded values (the storage.resize_(0) trick); the object and its shape stay."""
        if self.is_unsharded():
            self.unsharded_param.untyped_storage().resize_(0)

    def is_unsharded(self) -> bool:
        return self.unsharded_param is not None and self.unsharded_param.untyped_storage().nbytes() > 0

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient autograd accumulated into the unsharded parameter, removed from it."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is not None:
            self.unsharded_param.grad = None
            label(grad, UNSHARDED_GRADS)
        return grad

    # -- which object the module holds ----------------------------------------------
    def use_sharded(self) -> None:
        for module, attr in self.uses:
            module._parameters[attr] = self.sharded_param  # direct: nn.Module's setattr checks types

    def use_unsharded(self) -> None:
        for module, attr in self.uses:
            module._parameters[attr] = self.unsharded_param


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what the full parameter has)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))
