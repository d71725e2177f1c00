"""Megatron's parallel layers under FairScale's names and shapes.

Layer 5 (techniques). With ``r`` = ``get_model_parallel_rank()`` and ``tp`` =
``get_model_parallel_world_size()``:

    ColumnParallelLinear(in, out)   weight (out/tp, in): rows [r*out/tp, (r+1)*out/tp) of the full weight
        X --f--> X W_r^T + b_r  -> (..., out/tp), or all-gathered to (..., out) with gather_output=True
    RowParallelLinear(in, out)      weight (out, in/tp): the matching columns; bias (out,) whole
        X_r  --> X_r W_r^T --g--> + b  -> (..., out) on every rank (input_is_parallel=True takes X_r)
    VocabParallelEmbedding(V, d)    weight (V/tp, d): rows [r*V/tp, (r+1)*V/tp)
        ids -> rows this rank owns (others 0) --g--> (..., d) on every rank

Column then Row is Megatron's MLP: one g per pair, no gather in between. Each
layer takes the full weight the way FairScale's does: a "master" weight of the
full shape is initialised by ``init_method`` on every rank (same seed, same
values) and each rank keeps its slice, so a tensor-parallel model starts from
exactly the single-process model's numbers. ``from_linear`` / ``from_embedding``
use that to load an existing full layer.

``stride`` (FairScale's) splits a fused weight piecewise: ``c_attn``'s weight
stacks [q; k; v], and with ``stride=3`` rank ``r`` keeps its slice of *each*
(so it owns whole heads), not a third of the stack.

``sequence_parallel=True`` (Megatron-LM's keyword; FairScale has none) takes
and returns activations sharded along the sequence (dim -2): Column all-gathers
the sequence before its matmul (reduce-scatter backward), Row reduce-scatters
its output (all-gather backward), and Row's bias, applied to this rank's
positions only, gets its gradient summed over the group (f on the parameter).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .initialize import get_model_parallel_rank, get_model_parallel_world_size
from .mappings import (copy_to_model_parallel_region, gather_from_model_parallel_region,
                       gather_from_sequence_parallel_region, reduce_from_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_model_parallel_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "divide"]

InitMethod = Callable[[torch.Tensor], object]


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator / denominator``, or a one-line error naming the fix when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the model-parallel size {denominator}; "
                         f"choose a tp that divides {numerator}")
    return numerator // denominator


def _local_slice(master: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    """This rank's piece of ``master`` along ``dim``: with ``stride`` s, pieces r, r+tp, ... of s*tp."""
    tp, r = get_model_parallel_world_size(), get_model_parallel_rank()
    pieces = master.chunk(stride * tp, dim=dim)
    return torch.cat(pieces[r::tp], dim=dim).clone()


def _master(shape: tuple[int, int], init_method: InitMethod, dim: int, stride: int,
            keep_master: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    master = torch.empty(shape)
    with torch.no_grad():
        init_method(master)
    return _local_slice(master, dim, stride), (master if keep_master else None)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output features (rows of ``weight``).

    Forward: f (identity; backward all-reduces dL/dX), local matmul, then with
    ``gather_output`` an all-gather of the last dim (backward keeps the slice).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = get_model_parallel_world_size()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.output_size_per_partition = divide(out_features, tp * stride, "out_features (/ stride)") * stride
        weight, self.master_weight = _master((out_features, in_features), init_method, 0, stride,
                                             keep_master_weight_for_test)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None
        self.stride = stride

    @classmethod
    def from_linear(cls, linear: nn.Linear, stride: int = 1, **kwargs) -> "ColumnParallelLinear":
        """The slice of an existing full ``nn.Linear`` (weights copied; same device and dtype)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    init_method=lambda w: w.copy_(linear.weight.detach()), stride=stride, **kwargs)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(_local_slice(linear.bias.detach().cpu(), 0, stride))
        return layer.to(device=linear.weight.device, dtype=linear.weight.dtype)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # input is this rank's slice of the sequence
            x = gather_from_sequence_parallel_region(input_)
        else:
            x = copy_to_model_parallel_region(input_)
        out = F.linear(x, self.weight, self.bias)
        return gather_from_model_parallel_region(out) if self.gather_output else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.output_size_per_partition}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input features (columns of ``weight``).

    Forward: (scatter the last dim of X unless ``input_is_parallel``), local
    matmul giving a partial sum, g (all-reduce; backward identity), then the
    whole bias once. ``bias.grad`` is full and equal on every rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = nn.init.xavier_normal_, stride: int = 1,
                 keep_master_weight_for_test: bool = False, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = get_model_parallel_world_size()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.input_size_per_partition = divide(in_features, tp * stride, "in_features (/ stride)") * stride
        weight, self.master_weight = _master((out_features, in_features), init_method, 1, stride,
                                             keep_master_weight_for_test)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """The slice of an existing full ``nn.Linear`` (weights copied; same device and dtype)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    init_method=lambda w: w.copy_(linear.weight.detach()), **kwargs)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias.detach())
        return layer.to(device=linear.weight.device, dtype=linear.weight.dtype)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        x = input_ if self.input_is_parallel else scatter_to_model_parallel_region(input_)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial)
            # the bias meets only this rank's positions: sum its gradient over the group (f)
            return out + copy_to_model_parallel_region(self.bias) if self.bias is not None else out
        out = reduce_from_model_parallel_region(partial)
        if self.bias is None:
            return out
        if get_model_parallel_world_size() == 1:  # out is partial itself, returned by the Function as it came
            return out + self.bias
        return out.add_(self.bias)  # into the all-reduce's own copy: one B x T x d tensor less per layer and step

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.input_size_per_partition}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


def local_vocab_ids(ids: torch.Tensor, start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``ids`` as rows of the slice ``[start, start + vocab_local)``, 0 where another rank owns them;
    the mask of those ids). The embedding and the vocab-parallel cross-entropy both need it.

    >>> local_vocab_ids(torch.tensor([0, 5, 3]), 2, 2)     # this rank owns ids 2 and 3
    (tensor([0, 0, 1]), tensor([ True,  True, False]))
    """
    outside = (ids < start) | (ids >= start + vocab_local)
    return (ids - start).masked_fill(outside, 0), outside


class _OwnedRows(torch.autograd.Function):
    """``weight[ids - start]`` for the ids this rank owns, zeros for the others.

    ``F.embedding`` followed by ``masked_fill`` would keep the shifted ids (int64)
    and the mask for backward: 9 bytes a token more than torch's DTensor
    embedding, which keeps only the caller's ids. This keeps only ``ids`` too and
    recomputes the two in backward (a few integer ops a token); the gradient is
    the same ``embedding_dense_backward`` autograd would call.
    """

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, start: int, scale_grad_by_freq: bool) -> torch.Tensor:
        local, outside = local_vocab_ids(ids, start, weight.shape[0])
        ctx.save_for_backward(ids)
        ctx.start, ctx.rows, ctx.scale_grad_by_freq = start, weight.shape[0], scale_grad_by_freq
        out = F.embedding(local, weight, None, None, 2.0, scale_grad_by_freq, False)
        return out.masked_fill_(outside.unsqueeze(-1), 0.0)  # rows another rank owns (out is ours to edit)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        local, outside = local_vocab_ids(ids, ctx.start, ctx.rows)
        grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)
        grad_weight = torch.ops.aten.embedding_dense_backward(grad, local, ctx.rows, -1, ctx.scale_grad_by_freq)
        return None, grad_weight, None, None


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank ``r`` owns ids ``[r*V/tp, (r+1)*V/tp)``.

    Each rank looks up the ids it owns, writes zeros for the others, and g
    (all-reduce) adds the ranks' tables: exactly one rank contributes each row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, init_method: InitMethod = nn.init.xavier_normal_) -> None:
        super().__init__()
        if max_norm is not None or sparse:
            raise ValueError("VocabParallelEmbedding: max_norm and sparse are not supported; leave them unset")
        tp, r = get_model_parallel_world_size(), get_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        self.num_embeddings_per_partition = divide(num_embeddings, tp, "num_embeddings (vocabulary)")
        self.vocab_start_index = r * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        weight, _ = _master((num_embeddings, embedding_dim), init_method, 0, 1, False)
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        layer = cls(emb.num_embeddings, emb.embedding_dim, init_method=lambda w: w.copy_(emb.weight.detach()),
                    **kwargs)
        return layer.to(device=emb.weight.device, dtype=emb.weight.dtype)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = _OwnedRows.apply(input_, self.weight, self.vocab_start_index, self.scale_grad_by_freq)
        return reduce_from_model_parallel_region(out)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} "
                f"(local rows [{self.vocab_start_index}, {self.vocab_end_index}))")
