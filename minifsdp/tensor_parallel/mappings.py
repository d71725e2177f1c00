"""The conjugate operators f and g: how activations enter and leave the model-parallel region.

Layer 5 (techniques). Megatron-LM (Shoeybi et al. 2019, section 3) splits an
MLP ``Y = GeLU(X A)``, ``Z = Y B`` as: ``A`` by columns (each rank computes
its own slice of ``Y``, no communication), ``B`` by rows (each rank computes a
partial ``Z``; the sum over ranks is the answer). Two operators glue it:

    X --f--> [ X A_r -> GeLU -> Y_r B_r ] --g--> Z        (one rank r of tp)

    f  forward: identity (every rank already holds X)
       backward: all-reduce (dL/dX is the sum of every rank's contribution)
    g  forward: all-reduce (Z = sum_r Y_r B_r)
       backward: identity (dL/dZ is the same on every rank)

f and g are *conjugate*: each one's backward is the other's forward. Per
transformer block (attention + MLP) that is 2 all-reduces of ``b*s*h``
elements forward and 2 backward. Two more pairs split and join along a
dimension (FairScale's names):

    scatter_to_model_parallel_region    fwd: keep my slice of the last dim   bwd: all-gather it
    gather_from_model_parallel_region   fwd: all-gather the last dim         bwd: keep my slice

Sequence parallel (Korthikanti et al. 2022) shards the layer-norm/dropout
region along the sequence instead of replicating it, and replaces each
all-reduce by its two halves (``all_reduce == reduce_scatter + all_gather``):

    scatter_to_sequence_parallel_region         fwd: keep my slice of the sequence  bwd: all-gather
    gather_from_sequence_parallel_region        fwd: all-gather the sequence        bwd: reduce-scatter
    reduce_scatter_to_sequence_parallel_region  fwd: reduce-scatter the sequence    bwd: all-gather

Every collective goes through ``minifsdp.comm``, so the tracer counts it. With
a model-parallel group of one rank every operator is the identity, as in
FairScale. The sequence dimension is dim -2 (``[B, T, d]`` activations).
"""

from __future__ import annotations

import torch

from .. import comm
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size

__all__ = ["copy_to_model_parallel_region", "reduce_from_model_parallel_region",
           "scatter_to_model_parallel_region", "gather_from_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "split_along", "gather_along"]

SEQ_DIM = -2


# --------------------------------------------------------------------------
# Collectives along one dimension (comm's work along dim 0, moved)
# --------------------------------------------------------------------------
def split_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    n, r = get_model_parallel_world_size(), get_model_parallel_rank()
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} model-parallel ranks; "
                         f"make it divisible by {n}")
    return x.chunk(n, dim=dim)[r].contiguous()


def gather_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order (one all-gather)."""
    moved = x.movedim(dim, 0).contiguous()
    return comm.all_gather(moved, group=get_model_parallel_group()).movedim(0, dim).contiguous()


def _reduce_scatter_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ranks, then keep this rank's slice along ``dim`` (one reduce-scatter)."""
    moved = x.movedim(dim, 0).contiguous()
    return comm.reduce_scatter(moved, group=get_model_parallel_group()).movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()  # out of place: autograd may still need x
    comm.all_reduce(out, group=get_model_parallel_group())
    return out


def _single() -> bool:
    return get_model_parallel_world_size() == 1


# --------------------------------------------------------------------------
# Tensor parallel: f, g and the split/join pair
# --------------------------------------------------------------------------
class _CopyToModelParallelRegion(torch.autograd.Function):
    """f. Forward: identity. Backward: all-reduce the gradient over the model-parallel group."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad if _single() else _all_reduce(grad)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g. Forward: all-reduce over the model-parallel group. Backward: identity."""

    @staticmethod
    def forward(ctx, x):
        return x if _single() else _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x):
        return x if _single() else split_along(x, -1)

    @staticmethod
    def backward(ctx, grad):
        return grad if _single() else gather_along(grad, -1)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice of it."""

    @staticmethod
    def forward(ctx, x):
        return x if _single() else gather_along(x, -1)

    @staticmethod
    def backward(ctx, grad):
        return grad if _single() else split_along(grad, -1)


# --------------------------------------------------------------------------
# Sequence parallel: the all-reduce cut in two
# --------------------------------------------------------------------------
class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence. Backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x):
        return x if _single() else split_along(x, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return grad if _single() else gather_along(grad, SEQ_DIM)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather the sequence. Backward: reduce-scatter it (each rank's full-sequence
    gradient is a partial sum: it only covers this rank's columns of the next layer)."""

    @staticmethod
    def forward(ctx, x):
        return x if _single() else gather_along(x, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return grad if _single() else _reduce_scatter_along(grad, SEQ_DIM)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter the sequence (sum the partial outputs, keep my slice).
    Backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x):
        return x if _single() else _reduce_scatter_along(x, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return grad if _single() else gather_along(grad, SEQ_DIM)


def copy_to_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Split the last dim forward (keep my slice), all-gather it backward."""
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-gather the last dim forward, split it backward."""
    return _GatherFromModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Split the sequence (dim -2) forward, all-gather it backward."""
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-gather the sequence forward, reduce-scatter it backward."""
    return _GatherFromSequenceParallelRegion.apply(input_)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter the sequence forward, all-gather it backward."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_)
