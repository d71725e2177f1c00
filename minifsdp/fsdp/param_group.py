"""The parameters of one ``fully_shard`` call: one all-gather in, one reduce-scatter out.

Mirrors ``FSDPParamGroup`` and ``foreach_all_gather`` / ``foreach_reduce`` of
torch's FSDP2 (``torch.distributed.fsdp._fully_shard``). Sharding is per
parameter (``fsdp_param.py``), but communication is per module: a collective
has a fixed cost, so a block's dozen parameters travel in one all-gather, not
a dozen. The price is a copy in and a copy out of one flat buffer.

All-gather, a block with ``w [5, 3]`` and ``b [5]`` on N = 2 ranks (3 rows each;
``.`` is padding)::

    copy in   rank 0:  [w0 w1 w2 | b0 b1 b2]      rank 1: [w3 w4 . | b3 b4 .]
    gather    both:    [w0 w1 w2 b0 b1 b2 | w3 w4 . b3 b4 .]     (rank-major)
    copy out  w = rows of each rank's w piece = [w0 .. w4];  b = [b0 .. b4]

The copy-in writes straight into the rank's own slot of the gather's output (an
in-place all-gather, as torch's): no separate input buffer is ever allocated.

Reduce-scatter of the gradients is the same picture backwards: each rank packs
its full gradients rank-major (padding rows are zeros), the reduce-scatter sums
piece r from every rank onto rank r, and each rank keeps the real rows of its
piece as the DTensor gradient. Divided by the data-parallel size, it is the
average over the global batch, as one process would compute it.

HSDP (a 2-D mesh, replicate × shard): the all-gather and reduce-scatter run in
the shard group; the reduced piece is then all-reduced across the replicas.
``reshard_after_forward=k``: after forward each rank keeps the rows of the k-rank
group it belongs to (N/k pieces instead of 1), so the backward's all-gather runs
among k ranks (e.g. within a machine) instead of N.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed import ProcessGroup

from .. import comm, dist
from .fsdp_param import FSDPParam, ShardLayout

__all__ = ["FSDPParamGroup"]


class FSDPParamGroup:
    """``params`` of one module, gathered and reduced together over ``shard_group`` (and ``replicate_group``).

    ``post_forward`` is ``(group, k)`` for ``reshard_after_forward=k`` (None: free everything).
    """

    def __init__(self, params: list[FSDPParam], name: str, *, shard_group: ProcessGroup | None,
                 replicate_group: ProcessGroup | None, reduce_dtype: torch.dtype | None,
                 device: torch.device):
        dtypes = sorted({str(p.compute_dtype) for p in params})
        if len(dtypes) > 1:
            raise ValueError(f"fully_shard({name}) would all-gather parameters of dtypes {dtypes} in one buffer; "
                             "cast the module to one dtype first or set MixedPrecisionPolicy(param_dtype=...)")
        self.params, self.name, self.device = params, name, device
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_size = dist.world_size(shard_group) if shard_group is not None else 1
        self.shard_rank = dist.rank(shard_group) if shard_group is not None else 0
        self.replicate_size = dist.world_size(replicate_group) if replicate_group is not None else 1
        self.compute_dtype = params[0].compute_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        self.divide_factor: float | None = None  # set_gradient_divide_factor; None: the data-parallel size
        self.post_forward: tuple[ProcessGroup | None, int] | None = None
        self._gather: tuple | None = None  # an all-gather in flight: (handle, output, members, layouts)
        self._post_forward_shard: torch.Tensor | None = None  # reshard_after_forward=k's rows
        self._accumulated: dict[FSDPParam, torch.Tensor] = {}  # unsynced gradients, reduce_dtype
        self._ready: set[FSDPParam] = set()
        self._needs_grad = [p for p in params if p.requires_grad]
        self.on_all_grads_ready: Callable[[], None] = lambda: None  # set by fully_shard's state
        for p in self._needs_grad:
            p.grad_ready = self._grad_ready

    # -- all-gather --------------------------------------------------------------
    def is_unsharded(self) -> bool:
        return all(p.is_unsharded() for p in self.params)

    @torch.no_grad()
    def unshard(self, async_op: bool = False) -> None:
        """Start gathering every parameter (one collective); ``wait_for_unshard`` finishes it."""
        if self._gather is None and not self.is_unsharded():
            if self._post_forward_shard is not None:  # reshard_after_forward=k: gather among k ranks
                group, members = self.post_forward
                layouts = [self._post_forward_layout(p) for p in self.params]
                mine = self._post_forward_shard
                out = mine.new_empty(members * mine.numel())
            else:
                group, members = self.shard_group, self.shard_size
                layouts = [p.layout for p in self.params]
                numel = sum(lay.numel for lay in layouts)
                # in place, as torch: the copy-in writes this rank's slot of the output, no input buffer
                out = torch.empty(members * numel, dtype=self.compute_dtype, device=self.device)
                mine = out[self.shard_rank * numel:(self.shard_rank + 1) * numel]
                for p, piece in zip(self.params, _split(mine, layouts)):
                    local = p.local_shard().reshape(-1)  # cast to the compute dtype by the copy (mixed precision)
                    piece[:local.numel()].copy_(local)
                    piece[local.numel():].zero_()
            handle = None
            if members > 1:
                with comm.annotate(unit=self.name):
                    handle = comm.all_gather_into_tensor(out, mine, group=group, async_op=True)
            self._gather = (handle, out, members, layouts)
        if not async_op:
            self.wait_for_unshard()

    @torch.no_grad()
    def wait_for_unshard(self) -> None:
        """Wait for the all-gather, then copy each parameter's real rows out of the rank-major buffer."""
        if self._gather is None:
            return
        handle, out, members, layouts = self._gather
        self._gather = None
        if handle is not None:
            handle.wait()
        for p, layout, piece in zip(self.params, layouts, _split_columns(out.view(members, -1), layouts)):
            layout.unpack_all(piece, p.alloc_unsharded())
        self._post_forward_shard = None

    def use_unsharded(self) -> None:
        for p in self.params:
            p.use_unsharded()

    # -- reshard -----------------------------------------------------------------
    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds the sharded DTensors again."""
        self.wait_for_unshard()  # a prefetched gather still writes into its buffer: finish it first
        for p in self.params:
            p.free_unsharded()
            p.use_sharded()
        self._post_forward_shard = None

    @torch.no_grad()
    def reshard_after_forward(self) -> None:
        """Free after forward: everything (True), or all but this rank's k-group piece (int k)."""
        if self.post_forward is None or not self.is_unsharded():
            self.reshard()
            return
        group, members = self.post_forward
        member = self.shard_rank % members  # k-groups are runs of k consecutive shard ranks
        layouts = [self._post_forward_layout(p) for p in self.params]
        keep = torch.empty(sum(lay.numel for lay in layouts), dtype=self.compute_dtype, device=self.device)
        for p, layout, piece in zip(self.params, layouts, _split(keep, layouts)):
            layout.pack(p.unsharded_param.data, member, piece)
        self.reshard()
        self._post_forward_shard = keep

    def _post_forward_layout(self, p: FSDPParam) -> ShardLayout:
        members = self.post_forward[1]
        per_member = p.layout.rows_per_member * (self.shard_size // members)
        return ShardLayout(p.layout.rows, p.layout.row_numel, members, per_member)

    # -- gradients ---------------------------------------------------------------
    def _grad_ready(self, p: FSDPParam) -> None:
        self._ready.add(p)
        if len(self._ready) == len(self._needs_grad):
            self.on_all_grads_ready()

    def grads_pending(self) -> bool:
        """Some gradient arrived in this backward but the group's post-backward has not run yet."""
        return bool(self._ready)

    @torch.no_grad()
    def accumulate_unsynced(self) -> None:
        """Without gradient sync: keep this micro-batch's gradients, summed in ``reduce_dtype`` (as torch)."""
        self._ready.clear()
        for p in self._needs_grad:
            grad = p.take_unsharded_grad()
            if grad is not None:
                grad = grad.to(self.reduce_dtype)
                if p in self._accumulated:
                    self._accumulated[p] += grad
                else:
                    self._accumulated[p] = grad

    @torch.no_grad()
    def reduce_grads(self) -> Callable[[], None] | None:
        """Start the reduce-scatter of every gradient (one collective); return ``finish()`` (waits, stores).

        Each rank packs its full gradients rank-major, divided by the data-parallel size: the
        reduce-scatter's sum of those averages is the global-batch mean, rank r's piece on rank r.
        """
        self._ready.clear()
        grads = []
        for p in self._needs_grad:
            grad, earlier = p.take_unsharded_grad(), self._accumulated.pop(p, None)
            if earlier is not None:
                grad = earlier if grad is None else earlier.add_(grad)
            if grad is not None:
                grads.append((p, grad))
        if not grads:
            return None
        owners, layouts = [p for p, _ in grads], [p.layout for p, _ in grads]
        packed = torch.empty(self.shard_size, sum(lay.numel for lay in layouts), dtype=self.reduce_dtype,
                             device=self.device)
        for (p, grad), piece in zip(grads, _split_columns(packed, layouts)):
            p.layout.pack_all(grad, piece)
        del grads  # the unsharded gradients: only the packed copy is needed from here
        packed.div_(self.divide_factor or self.shard_size * self.replicate_size)
        if self.shard_size == 1:
            out, handle = packed.view(-1), None
        else:
            out = packed.new_empty(packed.shape[1])
            with comm.annotate(unit=self.name):
                handle = comm.reduce_scatter_tensor(out, packed.view(-1), group=self.shard_group, async_op=True)

        def finish() -> None:
            nonlocal handle, packed
            if handle is not None:
                handle.wait()
                handle = None  # gloo's work object holds its input: drop the packed gradients first
            packed = None
            if self.replicate_size > 1:  # HSDP: average the piece across the replicas too
                with comm.annotate(unit=self.name):
                    comm.all_reduce(out, group=self.replicate_group)
            for p, piece in zip(owners, _split(out, layouts)):
                p.set_sharded_grad(piece)

        return finish


def _split(flat: torch.Tensor, layouts: list[ShardLayout]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive pieces of ``layout.numel`` elements."""
    return list(torch.split(flat, [lay.numel for lay in layouts]))


def _split_columns(block: torch.Tensor, layouts: list[ShardLayout]) -> list[torch.Tensor]:
    """``block`` (``[members, total]``, rank-major) cut into each parameter's ``[members, numel]`` columns."""
    return list(torch.split(block, [lay.numel for lay in layouts], dim=1))
