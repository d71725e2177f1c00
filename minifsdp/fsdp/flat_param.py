"""Flat parameters: a unit's tensors become one flat, padded tensor, sharded across ranks.

Mirrors ``FlatParameter`` / ``FlatParamHandle`` of PyTorch FSDP (Zhao et al.
2023, "PyTorch FSDP", section 3.2) and FairScale's ``FlattenParamsWrapper``.
Why flatten at all? One all-gather of one big tensor per unit instead of one
per parameter (collectives have a fixed cost each), and sharding becomes
trivial: rank r keeps the r-th equal slice.

Worked example: a unit holds ``w [2, 3]``, ``b [3]`` and ``s [1]`` (10
elements), N = 4 ranks. Concatenated and padded to 12 (a multiple of 4),
every rank keeps 3 elements::

    flat   = [w w w w w w b b b s 0 0]
    rank 0   [w w w]          rank 2   [b b b]
    rank 1   [w w w]          rank 3   [s 0 0]   <- padding, never used

``s`` is smaller than the world size: that is fine, it is just a slice of
the flat tensor. Padding costs at most N - 1 elements per unit.

What lives where (one ``FlatParamHandle``):

* ``flat_param`` -- an ``nn.Parameter`` of ``numel / N`` elements: the shard.
  It is what ``model.parameters()`` yields, so ``torch.optim.AdamW(
  model.parameters())`` built *after* wrapping steps on shards only.
* ``_full`` -- the unsharded flat tensor (compute dtype, compute device), an
  autograd leaf. Its storage is allocated by ``unshard()`` (filled by an
  all-gather) and freed by ``reshard()`` with ``storage.resize_(0)``: the
  tensor object survives, so the views autograd saved in forward point at
  the right memory again once backward re-gathers it.
* the original attributes (``linear.weight``) are plain tensors, views into
  ``_full``: gradients flow through the views into ``_full.grad``, which
  ``reduce_grad()`` reduce-scatters into ``flat_param.grad``.

The original ``nn.Parameter`` objects are emptied (their data becomes a
0-element tensor) and marked, so an optimizer built before wrapping is caught
(see ``options.install_optimizer_check``). With ``use_orig_params=True``
they live on instead: at rest each is a 1-D view of *its* elements of the
shard (``w``: 3 on rank 0, 3 on rank 1, none on ranks 2 and 3 above), its
``.grad`` a view of the gradient shard; in forward and backward the module
sees views of ``_full`` as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from .. import comm, dist, memory, trace

__all__ = ["FlatParamHandle", "ParamInfo", "FLATTENED_MARK", "RETIRED_MARK", "UNSHARDED_PARAMS", "UNSHARDED_GRADS",
           "label"]

FLATTENED_MARK = "_minifsdp_flattened_into"  # on original parameters once flattened: the unit's name
RETIRED_MARK = "_minifsdp_retired"  # on original parameters FSDP emptied (use_orig_params=False)
# Memory-tracker categories for FSDP's own buffers (the shards are "parameters" / "gradients").
UNSHARDED_PARAMS, UNSHARDED_GRADS = "unsharded_params", "unsharded_grads"


@dataclass
class ParamInfo:
    """Where one original parameter lives inside the flat tensor."""

    fqn: str              # name relative to the unit's module, e.g. "0.weight"
    module: nn.Module     # the module that owned it
    attr: str             # its attribute name there, e.g. "weight"
    shape: torch.Size
    numel: int
    offset: int           # first element in the (unpadded) flat tensor
    shared_with: int | None = None  # index of the first info of the same tensor (tied weights)


def label(t: torch.Tensor | None, category: str) -> None:
    """Tell every active ``memory.MemoryTracker`` what ``t``'s bytes are (no-op without one)."""
    if t is not None:
        for tracker in memory.active_trackers():
            tracker.register(t, category)


class FlatParamHandle:
    """One flat parameter: flatten + pad + shard, gather/free, views, gradient reduction.

    ``params`` are ``(fqn, module, attr, parameter)``; all must share dtype and
    ``requires_grad``. ``shard_group`` is the group the flat tensor is split
    across (None: not split, NO_SHARD); ``replicate_group`` the group the
    shard is replicated across (gradients all-reduced there; None: none).
    """

    def __init__(self, params: list[tuple[str, nn.Module, str, nn.Parameter]], *, unit: str,
                 shard_group: ProcessGroup | None, replicate_group: ProcessGroup | None,
                 device: torch.device, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, offload: bool = False, use_orig_params: bool = False,
                 keep_low_precision_grads: bool = False):
        self.unit = unit
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_size = dist.world_size(shard_group) if shard_group is not None else 1
        self.shard_rank = dist.rank(shard_group) if shard_group is not None else 0
        self.replicate_size = dist.world_size(replicate_group) if replicate_group is not None else 1
        self.device = device
        self.infos, unique = self._describe(params)
        dtypes = sorted({str(p.dtype) for p in unique})
        if len(dtypes) > 1:
            raise ValueError(f"FSDP unit {unit or 'root'!r} mixes parameter dtypes {dtypes}: one flat parameter "
                             "holds one dtype; cast the model (model.float()) or wrap those modules separately")
        self.dtype = unique[0].dtype
        self.compute_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.keep_low_precision_grads = keep_low_precision_grads  # grads stay in reduce_dtype for the optimizer
        self.numel = sum(p.numel() for p in unique)
        self.padded_numel = math.ceil(self.numel / self.shard_size) * self.shard_size
        self.shard_numel = self.padded_numel // self.shard_size

        with torch.no_grad():
            flat = self.flatten([p.detach().to(device) for p in unique])
            shard = flat[self.shard_rank * self.shard_numel:(self.shard_rank + 1) * self.shard_numel].clone()
            del flat  # before the unsharded buffer below exists: wrapping's transient is flat or buffer, not both
        requires_grad = unique[0].requires_grad
        self.flat_param = nn.Parameter(shard.to("cpu" if offload else device), requires_grad=requires_grad)
        # Without sharding, low precision or offload, the "unsharded" tensor can
        # share the shard's storage: nothing to gather, nothing to free (DDP-like).
        self.aliased = self.shard_size == 1 and self.compute_dtype == self.dtype and not offload
        if self.aliased:
            self._full = self.flat_param.detach()
        else:
            self._full = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
            self._full.untyped_storage().resize_(0)  # sharded at rest
        self._full.requires_grad_(requires_grad)
        self._pending: comm.Handle | None = None  # an async all-gather in flight
        # use_orig_params=True keeps the original Parameter objects, as views of their piece of the shard
        self.orig_params = unique if use_orig_params else None
        for p in unique:
            setattr(p, FLATTENED_MARK, self.unit or "root")
            p.grad = None
        if self.orig_params is not None:
            self.use_sharded_views()
        else:
            self._retire_originals(unique)

    # -- construction --------------------------------------------------------
    @staticmethod
    def _describe(params: list) -> tuple[list[ParamInfo], list[nn.Parameter]]:
        """ParamInfos in order; a tensor seen twice (tied weights) is stored once."""
        infos: list[ParamInfo] = []
        unique: list[nn.Parameter] = []
        first: dict[int, int] = {}
        offset = 0
        for fqn, module, attr, p in params:
            if id(p) in first:  # tied: a second name for the same elements
                i = first[id(p)]
                infos.append(ParamInfo(fqn, module, attr, p.shape, p.numel(), infos[i].offset, shared_with=i))
                continue
            first[id(p)] = len(infos)
            infos.append(ParamInfo(fqn, module, attr, p.shape, p.numel(), offset))
            unique.append(p)
            offset += p.numel()
        return infos, unique

    def _retire_originals(self, unique: list[nn.Parameter]) -> None:
        """Remove the original parameters from their modules and free their memory."""
        for info in self.infos:
            info.module._parameters.pop(info.attr, None)
        self._stand_ins()
        for p in unique:
            setattr(p, RETIRED_MARK, True)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _stand_ins(self) -> None:
        """While sharded, shape-only (meta) tensors under the original names, so ``repr(model)``
        and ``layer_norm.bias is not None`` read as on the unwrapped model (torch leaves views of
        the freed flat parameter there); the next forward puts views of ``_full`` in their place."""
        for info in self.infos:
            info.module.__dict__[info.attr] = torch.empty(info.shape, dtype=self.compute_dtype, device="meta")

    def use_sharded_views(self) -> None:
        """use_orig_params=True at rest: each original Parameter (and its ``.grad``) is a 1-D view of
        the elements of the shard that belong to it -- possibly none -- so an optimizer over
        ``model.parameters()`` (per-parameter groups allowed) updates the shard in place."""
        for info, p in zip(self.unique_infos, self.orig_params):
            lo, hi = self._shard_slice(info)
            p.data = self.flat_param.detach()[lo:hi]  # (its .grad is set where gradients are reduced)
        for info in self.infos:
            info.module.__dict__.pop(info.attr, None)
            info.module._parameters[info.attr] = self.orig_params[self._unique_index(info)]

    def _shard_slice(self, info: ParamInfo) -> tuple[int, int]:
        """``local_piece(info)`` in the shard's coordinates: ``flat_param[lo:hi]``."""
        start, end = self.local_piece(info)
        lo = self.shard_rank * self.shard_numel - info.offset
        return start - lo, end - lo

    def _unique_index(self, info: ParamInfo) -> int:
        first = self.infos[info.shared_with] if info.shared_with is not None else info
        return self.unique_infos.index(first)

    @property
    def sharded_params(self) -> list[nn.Parameter]:
        """What the optimizer sees: the flat shard, or the original parameters viewing it."""
        return self.orig_params if self.orig_params is not None else [self.flat_param]

    @property
    def unique_infos(self) -> list[ParamInfo]:
        return [i for i in self.infos if i.shared_with is None]

    @property
    def requires_grad(self) -> bool:
        return self.flat_param.requires_grad

    # -- flat <-> original layout (also used by the state dicts) ---------------
    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Concatenate one tensor per unique parameter and zero-pad: the full flat layout."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.padded_numel - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def unflatten(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``full`` shaped like the original parameters, one per info (tied ones repeat).

        Made by one ``split`` rather than one slice per parameter, for backward's
        memory: autograd's backward of a slice is a zero-filled tensor as large as
        ``full`` with the slice's gradient written in, so k slices meant k full-size
        temporaries (summed pairwise, three alive at once). ``split``'s backward
        concatenates the k gradients once into one full-size gradient (torch's FSDP
        makes its views with ``split`` too). The padding is the last, unused piece.
        """
        sizes = [i.numel for i in self.unique_infos]
        pieces = torch.split(full, sizes + [full.numel() - sum(sizes)])
        unique = iter(pieces)
        views: list[torch.Tensor] = []
        for i in self.infos:
            views.append(views[i.shared_with] if i.shared_with is not None else next(unique).view(i.shape))
        return views

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full flat tensor."""
        start = self.shard_rank * self.shard_numel
        return full[start:start + self.shard_numel]

    def local_piece(self, info: ParamInfo) -> tuple[int, int]:
        """``(start, end)`` of ``info``'s flattened elements that this rank's shard holds (may be empty)."""
        lo = self.shard_rank * self.shard_numel
        start, end = max(info.offset, lo), min(info.offset + info.numel, lo + self.shard_numel)
        return (start - info.offset, max(end, start) - info.offset)

    # -- unshard / reshard ------------------------------------------------------
    def is_unsharded(self) -> bool:
        return self.aliased or self._full.untyped_storage().nbytes() > 0

    def unshard(self, async_op: bool = False) -> None:
        """Make ``_full`` hold the whole flat tensor: allocate, then all-gather the shards into it."""
        if self._pending is None and not self.is_unsharded():
            self._full.untyped_storage().resize_(self.padded_numel * self._full.element_size())
            label(self._full, UNSHARDED_PARAMS)
            # Write through ``.data``: a fresh version counter, so autograd does not
            # mistake the refill for an in-place change of the tensors it saved.
            out = self._full.data
            # The shard goes straight into its own slot of ``out`` (cast to the compute dtype,
            # moved if offloaded) and is gathered in place from there, as torch's FSDP2 does.
            # A separate low-precision copy of the shard (FSDP1's ``_mp_shard``) would stay
            # alive while a prefetched all-gather is in flight: one shard per unit more memory.
            mine = self.shard_of(out)
            mine.copy_(self.flat_param.detach())
            if self.shard_size > 1:
                with comm.annotate(unit=self.unit):  # the unit's name on the collective's trace span
                    handle = comm.all_gather_into_tensor(out, mine, group=self.shard_group, async_op=True)
                self._pending = handle
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def reshard(self) -> None:
        """Free the unsharded flat tensor (the ``storage.resize_(0)`` trick); the shard stays."""
        if not self.aliased and self.is_unsharded():
            self.wait()
            nbytes = self._full.untyped_storage().nbytes()
            with trace.span(f"reshard {self.unit or 'root'}", unit=self.unit, bytes=nbytes):
                self._full.untyped_storage().resize_(0)
        if self.orig_params is not None:
            self.use_sharded_views()

    def use_unsharded_views(self) -> None:
        """Point the modules' attributes at views of ``_full`` (recorded by autograd in forward)."""
        views = self.unflatten(self._full)
        for info, view in zip(self.infos, views):
            info.module._parameters.pop(info.attr, None)  # use_orig_params: the Parameter steps aside
            setattr(info.module, info.attr, views[info.shared_with] if info.shared_with is not None else view)

    # -- full copies for summon_full_params and state dicts ---------------------
    def gather_full(self, shard: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh full flat tensor gathered from ``shard`` (default: the parameter shard)."""
        shard = (self.flat_param if shard is None else shard).detach().to(self.device, dtype or self.dtype)
        if self.shard_size == 1:
            return shard.clone()
        out = shard.new_empty(self.padded_numel)
        with comm.annotate(unit=self.unit):
            comm.all_gather_into_tensor(out, shard.contiguous(), group=self.shard_group)
        return out

    def expose_params(self, full: torch.Tensor, full_grad: torch.Tensor | None = None) -> None:
        """Register views of ``full`` as ``nn.Parameter``s under the original names (summon)."""
        params: list[nn.Parameter] = []
        grads = self.unflatten(full_grad) if full_grad is not None else [None] * len(self.infos)
        for info, view, grad in zip(self.infos, self.unflatten(full), grads):
            p = params[info.shared_with] if info.shared_with is not None else nn.Parameter(
                view, requires_grad=self.requires_grad)
            if info.shared_with is None:
                p.grad = grad
            params.append(p)
            info.module.__dict__.pop(info.attr, None)
            info.module._parameters[info.attr] = p

    def hide_params(self) -> None:
        """Back to rest after ``expose_params``: nothing (flat) or the sharded views (use_orig_params)."""
        for info in self.infos:
            info.module._parameters.pop(info.attr, None)
        if self.orig_params is not None:
            self.use_sharded_views()
        else:
            self._stand_ins()

    def write_shard(self, full: torch.Tensor) -> None:
        """Copy this rank's slice of ``full`` back into the shard (summon's writeback, loading)."""
        with torch.no_grad():
            self.flat_param.copy_(self.shard_of(full).to(self.flat_param.device, self.flat_param.dtype))

    # -- gradients --------------------------------------------------------------
    def reduce_grad(self, dp_size: int,
                    comm_hook: tuple[object, Callable] | None = None) -> Callable[[], None] | None:
        """Start averaging ``_full.grad`` over all data-parallel ranks into ``flat_param.grad``.

        reduce-scatter inside the shard group (each rank receives the sum of
        its slice), then all-reduce that slice across the replicate group
        (HYBRID_SHARD; NO_SHARD is the special case of a shard group of one).
        The first collective runs async; the returned ``finish()`` waits for
        it and stores the result (the caller decides when: overlap).
        ``comm_hook`` = (state, hook) from ``register_comm_hook`` replaces both
        collectives and the averaging: ``hook(state, grad, shard)`` fills the
        shard (``hook(state, grad)`` reduces in place when nothing is sharded).
        """
        grad = self._full.grad
        self._full.grad = None
        if grad is None:
            return None
        label(grad, UNSHARDED_GRADS)
        grad = grad.to(self.reduce_dtype)
        if comm_hook is None:
            grad.div_(dp_size)  # average, like DDP/FSDP: every rank saw 1/dp_size of the batch
        with comm.annotate(unit=self.unit):
            if comm_hook is not None:  # the user's reduction, synchronous (as torch calls it)
                state, hook = comm_hook
                out, first = (grad.new_empty(self.shard_numel), None) if self.shard_size > 1 else (grad, None)
                hook(state, grad, out) if self.shard_size > 1 else hook(state, grad)
            elif self.shard_size > 1:
                out = grad.new_empty(self.shard_numel)
                first = comm.reduce_scatter_tensor(out, grad, group=self.shard_group, async_op=True)
            else:
                out, first = grad, None
                if self.replicate_size > 1:
                    first = comm.all_reduce(out, group=self.replicate_group, async_op=True)

        def finish() -> None:
            nonlocal first
            if first is not None:
                first.wait()
                # The collective's work object may still hold its input, the unsharded gradient
                # (gloo's does): drop it before the fp32 copy below is made, or a unit's full
                # gradient and its fp32 shard are alive together (torch frees the former first).
                first = None
            if self.shard_size > 1 and self.replicate_size > 1 and comm_hook is None:  # HYBRID: across replicas
                with comm.annotate(unit=self.unit):
                    comm.all_reduce(out, group=self.replicate_group)
            # fp32 for the optimizer (the master shard's dtype), or reduce_dtype with keep_low_precision_grads
            grad_dtype = self.reduce_dtype if self.keep_low_precision_grads else self.flat_param.dtype
            if grad_dtype != self.flat_param.dtype:
                self.flat_param.grad_dtype = grad_dtype  # torch >= 2.10 lets a parameter hold a grad of another dtype
            reduced = out.to(self.flat_param.device, grad_dtype)
            if self.orig_params is not None and all(p.grad is None for p in self.orig_params):
                self.flat_param.grad = None  # optimizer.zero_grad() cleared the views: start afresh
            if self.flat_param.grad is None:
                self.flat_param.grad = reduced
            else:  # accumulating over micro-batches without no_sync()
                self.flat_param.grad += reduced
            label(self.flat_param.grad, memory.GRADIENTS)
            if self.orig_params is not None:
                for info, p in zip(self.unique_infos, self.orig_params):
                    lo, hi = self._shard_slice(info)
                    if grad_dtype != p.dtype:
                        p.grad_dtype = grad_dtype
                    p.grad = self.flat_param.grad[lo:hi]
        return finish
