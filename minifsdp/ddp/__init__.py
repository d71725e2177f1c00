"""Data parallel training from scratch: a naive version, then bucketed and overlapped DDP.

``from minifsdp.ddp import DistributedDataParallel`` mirrors
``torch.nn.parallel.DistributedDataParallel``.

Layer 5 (techniques). Data parallelism keeps a full copy of the model on every
rank, gives each rank a different slice of the global batch, and averages the
gradients before the optimizer step, so every replica takes the same step:

    grad = (1/N) * sum over ranks of grad_r        (an all-reduce, then / N)

With equal slices, the mean of the per-rank mean losses is the mean loss of
the whole batch, so N ranks with B samples each compute exactly what one process computes on
N*B samples (up to float rounding). Cost: one all-reduce of every gradient
per step: 2·4Ψ bytes for Ψ fp32 gradients (Ψ = the number of parameters; a ring
all-reduce sends about twice the buffer).

Naive beside optimized, same contract (drop-in for ``torch.nn.parallel.DistributedDataParallel``),
one file each; read them in this order:

1. ``naive.py`` - ``NaiveDataParallel``: a hook on each parameter all-reduces
   its gradient the moment it is ready, one blocking collective per tensor
   (picotron's ``DataParallelNaive``). Easy to read; slow.
2. ``bucketed.py`` - ``bucket_assignment`` (which gradients travel together)
   and ``BucketedDataParallel``, what PyTorch's DDP does and only that:
   buckets in reverse parameter order, each one's all-reduce started
   asynchronously as it fills while backward goes on, waited for at the end.
   This is the lesson.
3. ``distributed.py`` - ``DistributedDataParallel``: the same with torch's
   signature and options (``find_unused_parameters``,
   ``gradient_as_bucket_view``, buffer and device arguments, ``mixed_precision``).

``common.py`` holds what they share: ``broadcast_coalesced`` (rank 0's model on
every rank in one message), the same-model check, the gradient-hook helper.

Read first: ``comm.py`` (the collectives and their byte counts) and
``trace.py`` (the spans ``bucketed.py`` records); then the files above in
order. Next: ``zero/`` (sharding the optimizer state of this data parallel
training).

Usage, inside ``minifsdp.launch`` or under torchrun (a process group exists):

    >>> model = DistributedDataParallel(build_model("gpt-tiny"))   # rank 0's weights everywhere
    >>> loss = lm_loss(model(x_local), y_local)
    >>> loss.backward()                 # grads all-reduced, averaged, overlapped with backward
    >>> optimizer.step()                # identical step on every rank
    >>> with model.no_sync():           # gradient accumulation: no communication...
    ...     lm_loss(model(x0), y0).backward()
    >>> lm_loss(model(x1), y1).backward()   # ...until the last micro-batch
"""

from .bucketed import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_MB, Bucket, BucketedDataParallel, bucket_assignment
from .common import broadcast_coalesced
from .distributed import DistributedDataParallel
from .distributed import _reduce_dtype_of  # noqa: F401  (tests/test_mixed_precision.py checks its errors)
from .naive import NaiveDataParallel

__all__ = ["NaiveDataParallel", "BucketedDataParallel", "DistributedDataParallel", "Bucket", "bucket_assignment",
           "broadcast_coalesced", "DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_MB"]
