"""Allocation-stable steps: after the second step a technique allocates nothing above 4 KiB that the same
model's plain computation does not allocate too.

The memory tracker logs every block each step asks for (``MemoryTracker.take_allocations``: new storages,
and storages grown again by ``resize_``). A technique's step allocates what the model's forward, backward
and optimizer allocate (activations, gradients, AdamW's temporaries) plus whatever the technique itself makes.
So for steps 3 and 4 (index 2 and 3), on every rank, the multiset of block sizes above 4 KiB must be
contained in the reference's:

* data parallel (ddp, zero1, zero2) in the *compute-only* run: each rank trains its slice alone
  (``bench.COMPUTE``), so anything beyond it is the technique's. DDP packs gradients into buckets made
  once, syncs buffers through a packed buffer made once; OSS broadcasts into flat buckets the parameters view;
* FSDP (both flavours) and pipelines in torch's own implementation, which re-gathers the same unsharded
  parameters every step (FULL_SHARD frees them after use: keeping them would raise the peak) and keeps its
  pipeline receive buffers (ours: ``PipelineStage._recv_buffer``);
* tensor parallel in DTensor's (the row-parallel bias goes into the all-reduce's copy in place).

Before these changes the pipeline's receives, OSS's broadcast and the row-parallel bias each allocated
blocks the reference does not (the test fails on each); losses and gradients are the parity tests'.
"""

import collections
import tempfile

import pytest

from minifsdp import bench
from minifsdp.launch import launch
from minifsdp.train import run_rank

pytestmark = pytest.mark.multiprocess

SMALL = 4096  # bytes: scalars, the loss, small bookkeeping tensors may come and go


def _allocations(side: str, world: int = 2, steps: int = 4) -> list[list[list[tuple[int, str]]]]:
    """Per rank, per step, the (bytes, category) blocks the tracker saw allocated (gpt-tiny, batch 8)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench._config(bench.BenchConfig(model="gpt-tiny"), side, world, True, steps, tmp)
        return [r["allocations"] for r in launch(run_rank, world, cfg, timeout=180)]


@pytest.mark.parametrize("ours,reference", [
    ("ddp", bench.COMPUTE), ("zero1", bench.COMPUTE), ("zero2", bench.COMPUTE),
    ("fsdp@FULL_SHARD", "torch-fsdp@FULL_SHARD"), ("fsdp@SHARD_GRAD_OP", "torch-fsdp@SHARD_GRAD_OP"),
    ("fsdp2", "torch-fsdp2"), ("pp@1f1b", "torch-pp@1f1b"), ("pp@zero-bubble", "torch-pp@zero-bubble"),
    ("tp", "torch-tp"),
])
def test_later_steps_allocate_nothing_the_reference_does_not(ours, reference):
    mine, theirs = _allocations(ours), _allocations(reference)
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        for step in (2, 3):
            sizes = collections.Counter(n for n, _ in a[step] if n > SMALL)
            allowed = collections.Counter(n for n, _ in b[step] if n > SMALL)
            assert sizes and allowed, (rank, step)  # a step allocates activations at least: the log works
            extra = sizes - allowed
            assert not extra, (f"{ours}, rank {rank}, step {step + 1}: blocks (bytes: count) {dict(extra)} that "
                               f"{reference} does not allocate; categories: "
                               f"{sorted({c for n, c in a[step] if n in extra})}")
