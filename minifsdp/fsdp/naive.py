"""The smallest FSDP that works: one flat shard per unit, four hooks, nothing else.

Layer 5 (techniques). This is the cycle lab 04's learner writes, kept beside
the full implementation (``fully_sharded.py`` + ``flat_param.py``) the way
``ddp/`` keeps ``naive.py`` beside the bucketed DDP. It is ZeRO
stage 3 (Rajbhandari et al. 2020) as FairScale's and PyTorch's FSDP1 (Zhao et
al. 2023) do it, minus every option: no prefetch, no strategies, no mixed
precision, no state dicts. Read it first; then read ``flat_param.py``.

A *unit* is a module whose parameters are gathered together (here: every
module of one of ``unit_types``, e.g. each transformer ``Block``, and the root
for whatever is left). Each unit keeps one flat, zero-padded ``1/N`` shard of
its parameters (an ``nn.Parameter``: what the optimizer sees) and one flat
``full`` tensor whose memory exists only while the unit computes::

    forward   pre-forward hook    all-gather the shards into full; the module's
                                  weights become views of full
              post-forward hook   free full (storage.resize_(0)); hook the outputs
    backward  hook on an output   (its gradient is ready: this unit's backward is
              = pre-backward      next) all-gather into full again
              post-accumulate     full.grad is complete: reduce-scatter it (sum of
              hook on full        the ranks' gradients, chunk r to rank r), / N,
              = post-backward     into shard.grad; free full
    step      a plain torch optimizer over model.parameters() (the shards)

Why ``resize_(0)`` rather than ``del``: autograd saved the views of ``full``
that forward used (a Linear saves its weight for the input's gradient). The
tensor object must survive so those saved views see the memory again once the
pre-backward gather refills the same storage. Refills go through ``.data`` so
the version counter autograd checks does not move.

Bytes per step (comm's volume convention, P = parameter bytes, padded): P
all-gathered in forward, P again in backward, P reduce-scattered: **3P**, the
root included. (``FullyShardedDataParallel`` keeps the root gathered from
forward to backward, as torch does, and so moves ``3P - P_root``.)

    >>> model = NaiveFullyShardedDataParallel(build_model("gpt-tiny"), unit_types={Block})  # in launch(fn, N)
    >>> opt = torch.optim.AdamW(model.parameters())        # after wrapping: the shards
    >>> lm_loss(model(x), y).backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .. import comm, dist, memory

__all__ = ["NaiveFullyShardedDataParallel", "FlatUnit", "pre_forward", "post_forward", "pre_backward",
           "post_backward", "UNSHARDED_PARAMS"]

UNSHARDED_PARAMS = "unsharded_params"  # memory-tracker category of a gathered ``full`` (as fsdp/flat_param.py)


class FlatUnit:
    """One unit: its parameters as one flat, padded shard, and the ``full`` tensor they are gathered into.

    ``params`` are ``(module, attribute name, parameter)``. On construction the
    parameters are flattened in order, padded with zeros to a multiple of N,
    and this rank keeps chunk ``rank``; the originals are removed from their
    modules (their memory is released).
    """

    def __init__(self, name: str, module: nn.Module, params: list[tuple[nn.Module, str, nn.Parameter]],
                 device: torch.device):
        self.name, self.module = name, module
        self.rank, self.world = dist.rank(), dist.world_size()
        self.slots = [(m, attr, p.shape) for m, attr, p in params]
        self.sizes = [p.numel() for _, _, p in params]
        self.numel = sum(self.sizes)
        self.padded_numel = math.ceil(self.numel / self.world) * self.world
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(device) for _, _, p in params])
            flat = torch.cat([flat, flat.new_zeros(self.padded_numel - self.numel)])
            self.shard = nn.Parameter(flat.chunk(self.world)[self.rank].clone())
        self.full = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=device, requires_grad=True)
        self.full.untyped_storage().resize_(0)  # sharded at rest
        self.full.register_post_accumulate_grad_hook(lambda _: post_backward(self))
        for m, attr, p in params:  # the originals leave; views of full take their place in forward
            del m._parameters[attr]
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def gather(self) -> None:
        """Allocate ``full`` and all-gather every rank's shard into it (rank r's chunk at position r)."""
        if self.is_gathered():
            return
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        for tracker in memory.active_trackers():  # name its bytes in memory plots
            tracker.register(self.full, UNSHARDED_PARAMS)
        comm.all_gather_into_tensor(self.full.data, self.shard.detach())

    def free(self) -> None:
        """Release ``full``'s memory; the tensor object (and the views autograd saved) stays."""
        self.full.untyped_storage().resize_(0)

    def use_full_views(self) -> None:
        """Point each module attribute at its piece of ``full`` (one ``split``: one backward node)."""
        pieces = torch.split(self.full, self.sizes + [self.padded_numel - self.numel])
        for (m, attr, shape), piece in zip(self.slots, pieces):
            setattr(m, attr, piece.view(shape))

    def reduce_scatter_grad(self) -> None:
        """``shard.grad`` (+)= this rank's chunk of the gradient summed over ranks, / N."""
        grad, self.full.grad = self.full.grad, None
        out = torch.empty_like(self.shard)
        comm.reduce_scatter_tensor(out, grad.div_(self.world))
        if self.shard.grad is None:
            self.shard.grad = out
        else:  # a second backward before zero_grad(): accumulate, as plain torch does
            self.shard.grad += out


# -- the four hooks: the whole of FSDP's schedule -------------------------------------
def pre_forward(unit: FlatUnit) -> None:
    unit.gather()
    unit.use_full_views()


def post_forward(unit: FlatUnit, output: Any) -> None:
    unit.free()
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: pre_backward(unit))


def pre_backward(unit: FlatUnit) -> None:
    unit.gather()  # a no-op when another output of the unit already gathered it


def post_backward(unit: FlatUnit) -> None:
    unit.reduce_scatter_grad()
    unit.free()


class NaiveFullyShardedDataParallel(nn.Module):
    """Shard ``module`` into units (each submodule of ``unit_types``, and the root) and train it as FSDP does.

    ``model.parameters()`` yields the shards only (one per unit), so an
    optimizer built after wrapping updates this rank's ``1/N``. Every rank must
    build the same model (same seed). Tied weights are not supported here (use
    ``FullyShardedDataParallel``).
    """

    def __init__(self, module: nn.Module, unit_types: Iterable[type] = ()):
        super().__init__()
        dist.require_initialized("NaiveFullyShardedDataParallel")
        types = tuple(unit_types)
        seen: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                raise ValueError(f"{seen[id(p)]} and {name} are one tied tensor; NaiveFullyShardedDataParallel "
                                 "does not share parameters across names: use minifsdp.fsdp.FullyShardedDataParallel")
            seen[id(p)] = name
        self.module = module
        device = dist.device()
        # Innermost units first, so a unit inside another unit keeps its own parameters; the root takes the rest.
        candidates = [(n, m) for n, m in module.named_modules() if n and types and isinstance(m, types)]
        taken: set[int] = set()
        self.units: list[FlatUnit] = []
        for name, m in candidates[::-1] + [("root", module)]:
            params = [(owner, attr, p) for owner in m.modules() for attr, p in owner.named_parameters(recurse=False)
                      if id(p) not in taken]
            if not params:
                continue
            taken.update(id(p) for *_, p in params)
            unit = FlatUnit(name, m, params, device)
            m.register_forward_pre_hook(lambda _m, _args, u=unit: pre_forward(u))
            m.register_forward_hook(lambda _m, _args, out, u=unit: post_forward(u, out))
            self.units.append(unit)
        self.shards = nn.ParameterList([u.shard for u in self.units])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
