"""``DistributedDataParallel``: torch's signature and options on top of ``BucketedDataParallel``.

Layer 5 (techniques). Mirrors the installed
``torch.nn.parallel.DistributedDataParallel`` (torch 2.13): same parameters,
order and defaults, so code written for torch runs here by changing the
import. The mechanism is ``bucketed.py``'s; this file adds only what the
options need: ``find_unused_parameters`` and ``gradient_as_bucket_view`` (as
overrides of the core's hooks), the buffer flags, the device checks,
``mixed_precision``'s all-reduce dtype, and one-line errors for the options
that are not implemented.

Read first: ``bucketed.py`` (the core this subclasses). Next: ``zero/``
(sharding the optimizer state of this data parallel training).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist
from ..mixed_precision.policy import MixedPrecision
from .bucketed import Bucket, BucketedDataParallel
from .common import _check_same_model_everywhere, broadcast_coalesced

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(BucketedDataParallel):
    """``BucketedDataParallel`` with the arguments of the installed ``torch.nn.parallel.DistributedDataParallel``.

    Same parameters, order and defaults (a positional argument lands in
    torch's slot, ``process_group`` included; tests/test_ddp.py compares the
    signatures). What each does here:

    * ``device_ids`` - ``None`` for CPU modules; ``[i]`` (or ``None``) for a module on ``cuda:i``.
      ``output_device``, ``dim`` - outputs are not moved (``dim`` must be 0).
    * ``broadcast_buffers`` (deprecated in torch 2.13, as here) / ``forward_sync_buffers`` -
      broadcast rank 0's buffers before every forward (e.g. BatchNorm stats). As in torch,
      ``broadcast_buffers=False`` also leaves the buffers out of the broadcast at wrap time;
      ``forward_sync_buffers=False`` does not.
    * ``init_sync=False`` - no shape check and no broadcast at wrap time (ranks must already agree).
    * ``bucket_cap_mb`` - see ``bucket_assignment``; ``None``: 25 MiB with a 1 MiB first bucket.
    * ``find_unused_parameters`` - parameters without a gradient are marked ready at the end of
      backward (their slot holds ``p.grad`` or zeros), and one small all-reduce of "used" flags
      tells which were unused on *every* rank: their ``.grad`` is left untouched (``None`` stays
      ``None``), as torch does. That flag all-reduce (4 bytes x 2 per parameter tensor) is the
      only traffic beyond 2·4Ψ. If only *some* ranks miss a gradient without this option, those
      ranks raise and the others wait in vain: under ``launch`` the error still surfaces.
    * ``gradient_as_bucket_view`` - ``p.grad`` *is* the bucket slice: no copy in or out, one
      gradient-sized buffer saved.
    * ``device_mesh`` - a 1-D mesh; its group is the process group.
    * ``static_graph``, ``batched_grad_copy`` - accepted; they change nothing here (there is no
      graph search to skip, and gradients are already copied in one pass per bucket).
      ``check_reduction`` - deprecated in torch; warns like torch.
    * ``mixed_precision`` - a ``minifsdp.mixed_precision.MixedPrecision`` whose ``reduce_dtype``
      (bf16/fp16) is the all-reduce's dtype: half the bytes, fp32 gradients for the optimizer.
      Compute in 16 bits with ``torch.autocast`` (``param_dtype``/``buffer_dtype`` raise: DDP
      keeps one fp32 copy of the model per rank, and casting it is autocast's job).
    * ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``,
      ``skip_all_reduce_unused_params``, ``bucket_cap_mb_list`` - raise ``NotImplementedError``
      saying why.
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list: list[int] | None = None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None):
        dist.require_module(module, "DistributedDataParallel")
        _reject_unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce,
                            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                            bucket_cap_mb_list=bucket_cap_mb_list)
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                          "Please avoid using it.", FutureWarning, stacklevel=2)
        process_group = _group_of(process_group, device_mesh)
        _check_devices(module, device_ids, output_device, dim)
        forward_sync, self._init_sync_buffers = _buffer_sync_flags(broadcast_buffers, forward_sync_buffers)
        self._init_sync = init_sync
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._reduce_dtype = _reduce_dtype_of(mixed_precision, gradient_as_bucket_view)
        super().__init__(module, process_group, bucket_cap_mb)
        self.forward_sync_buffers = forward_sync
        self.device_ids, self.output_device, self.dim = device_ids, output_device, dim
        self.static_graph = static_graph
        self._locally_used = [False] * len(self._params)   # since the last sync (find_unused only)
        self._globally_unused: set[int] = set()

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name for ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    def _sync_module_states(self) -> None:
        if not self._init_sync:
            return  # the user vouches that every rank already holds the same model
        _check_same_model_everywhere(self._params, self.process_group, type(self).__name__)
        buffers = self._module_buffers if self._init_sync_buffers else []
        broadcast_coalesced(list(self.module.parameters()) + buffers, dist.global_rank(self.process_group, 0),
                            self.process_group)

    # -- find_unused_parameters and gradient_as_bucket_view, on the core's hooks ------
    def _grad_ready(self, param: torch.Tensor, i: int) -> None:
        if self.find_unused_parameters:
            self._locally_used[i] = True
        if self.gradient_as_bucket_view and self._armed and not self._ready[i]:
            self._grad_into_view(param, self._views[i])
        super()._grad_ready(param, i)

    @staticmethod
    @torch.no_grad()
    def _grad_into_view(p: torch.Tensor, view: torch.Tensor) -> None:
        """gradient_as_bucket_view: make ``p.grad`` the bucket slice (after zero_grad(set_to_none) it is new)."""
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _pack_one(self, i: int) -> None:
        if not self.gradient_as_bucket_view:  # with it the gradient is in its slot already: _pack scales the bucket
            super()._pack_one(i)

    def _pack(self, bk: Bucket) -> None:
        if not self.gradient_as_bucket_view:
            return super()._pack(bk)
        if self._world > 1:
            bk.buffer.mul_(1.0 / self._world)  # the gradients are already in the bucket

    def _complete_buckets(self) -> None:
        """With find_unused_parameters: send the incomplete buckets, then learn which were unused everywhere."""
        self._globally_unused = set()
        if not self.find_unused_parameters:
            return super()._complete_buckets()
        missing = [i for i, r in enumerate(self._ready) if not r]
        for i in missing:  # ready now: their slot holds p.grad (from no_sync steps) or zeros
            p, view = self._params[i], self._views[i]
            if self.gradient_as_bucket_view:
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)  # do not re-point p.grad yet: it may be unused everywhere
                elif p.grad is None:
                    view.zero_()
            self.buckets[self._bucket_of[i]].pending -= 1
        self._launch_ready_buckets()
        used = torch.tensor(self._locally_used, dtype=torch.int32, device=self._params[0].device)
        comm.all_reduce(used, group=self.process_group)  # how many ranks used each parameter
        self._globally_unused = {i for i, count in enumerate(used.tolist()) if count == 0}
        self._locally_used = [False] * len(self._params)

    def _copy_back(self) -> None:
        if not (self.find_unused_parameters or self.gradient_as_bucket_view):
            return super()._copy_back()
        dst, src = [], []
        for i, (p, view) in enumerate(zip(self._params, self._views)):
            if i in self._globally_unused:
                continue  # torch leaves the .grad of a parameter no rank used untouched
            if self.gradient_as_bucket_view or p.grad is None:
                p.grad = view if self.gradient_as_bucket_view else view.clone()
            else:
                dst.append(p.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)


_UNSUPPORTED = {
    "delay_all_reduce_named_params": "delaying chosen parameters' all-reduce to another parameter's hook",
    "param_to_hook_all_reduce": "delaying chosen parameters' all-reduce to another parameter's hook",
    "skip_all_reduce_unused_params": "skipping unused parameters' all-reduce (find_unused_parameters=True "
                                     "reduces them)",
    "bucket_cap_mb_list": "a size per bucket (bucket_cap_mb sets one size for all)",
}


def _reduce_dtype_of(mp: Any, gradient_as_bucket_view: bool) -> torch.dtype | None:
    """DDP's share of a precision policy: the dtype of the gradient all-reduce (one-line errors otherwise)."""
    if mp is None:
        return None
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mixed_precision must be a minifsdp.mixed_precision.MixedPrecision, got {type(mp).__name__}; "
                        "pass e.g. MixedPrecision(reduce_dtype=torch.bfloat16)")
    if mp.param_dtype is not None or mp.buffer_dtype is not None:
        raise NotImplementedError("DistributedDataParallel's mixed_precision sets only reduce_dtype (the all-reduce's "
                                  "dtype); compute in 16 bits with torch.autocast (minifsdp.mixed_precision.autocast)")
    if gradient_as_bucket_view and mp.reduce_dtype is not None:
        raise ValueError("gradient_as_bucket_view=True makes p.grad the bucket, which would then be "
                         f"{mp.reduce_dtype}; drop one of the two")
    return mp.reduce_dtype


def _reject_unsupported(**given: Any) -> None:
    for name, value in given.items():
        if value not in (None, False):
            raise NotImplementedError(f"DistributedDataParallel({name}=...) is not implemented in minifsdp: "
                                      f"{_UNSUPPORTED[name]}; leave it at its default")


def _group_of(process_group: ProcessGroup | None, device_mesh: Any) -> ProcessGroup | None:
    """torch's rule: a 1-D ``device_mesh`` gives the group; not both."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("DistributedDataParallel: pass process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"DistributedDataParallel: only a 1-D device mesh is supported, got {device_mesh}; "
                           "pass device_mesh[dim_name] for the data-parallel dimension")
    return device_mesh.get_group(mesh_dim=0)


def _buffer_sync_flags(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.13's rule: ``(sync buffers before each forward, include buffers in the wrap-time broadcast)``."""
    if broadcast_buffers is not None:
        warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                      "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init."
                      if forward_sync_buffers is None else
                      "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` "
                      "is deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                      FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = broadcast_buffers if broadcast_buffers is not None else True
    return effective, effective


def _check_devices(module: nn.Module, device_ids: list | None, output_device: Any, dim: int) -> None:
    devices = {p.device for p in module.parameters() if p.requires_grad}
    if len(devices) > 1:
        raise ValueError(f"DistributedDataParallel: parameters live on several devices {sorted(map(str, devices))}; "
                         "move the whole module to one device (dist.device()) first")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu" and (device_ids or output_device is not None):
        raise ValueError(f"DistributedDataParallel: device_ids must be None for a module on the CPU (got "
                         f"device_ids={device_ids}, output_device={output_device}); pass device_ids=None")
    if device_ids:
        wanted = [torch.device(device.type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
        if wanted != [device]:
            raise ValueError(f"DistributedDataParallel: device_ids={device_ids} does not match the module's "
                             f"device {device}; pass device_ids=[{device.index}] or None")
    if dim != 0:
        raise ValueError(f"DistributedDataParallel: dim={dim} is not supported (no scatter of inputs here); "
                         "split the batch yourself and pass dim=0")
