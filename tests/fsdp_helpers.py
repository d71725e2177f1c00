"""One training loop and one data recipe for the FSDP tests (test_fsdp*.py).

Every parity check compares a run at N ranks with one process on the same
data: each step has a *global* batch, fixed by the step number; rank r of n
trains on rows ``[r*B/n, (r+1)*B/n)`` of it and the losses are averaged over
the ranks, so the numbers are the single process's (within fp32 tolerance).

    losses, norms = train_steps(model, opt, gpt_batch, lm_loss, steps=3, max_norm=1.0)
"""

import sys

import cloudpickle
import torch
import torch.distributed as tdist
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

from minifsdp.fsdp import FullyShardedDataParallel as FSDP

# launch() sends the test's worker function by value; the workers cannot import
# tests/, so what it calls from here must travel by value too.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def gpt_batch(step: int, batch: int = 8, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` for a GPT: inputs and next-token targets, ``[batch, seq]`` each."""
    data = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1], data[:, 1:]


def train_steps(model, opt, batch_fn, loss_fn, steps, first=0, max_norm=None):
    """Train ``steps`` steps from step ``first``; return (global mean losses, gradient norms).

    A wrapped model (minifsdp's or torch's FSDP) is data parallel: each rank takes
    its rows and the losses are all-reduced; a plain one trains on the whole batch.
    With ``max_norm`` gradients are clipped (``model.clip_grad_norm_`` for a wrapped
    model) and the norms returned; otherwise the norms list is empty.
    """
    distributed = isinstance(model, (FSDP, TorchFSDP))
    n, r = (tdist.get_world_size(), tdist.get_rank()) if distributed else (1, 0)
    losses, norms = [], []
    for step in range(first, first + steps):
        x, y = batch_fn(step)
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        loss = loss_fn(model(x[rows]), y[rows])
        loss.backward()
        if max_norm is not None:
            norm = (model.clip_grad_norm_(max_norm) if distributed
                    else torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if distributed:
            tdist.all_reduce(loss)
        losses.append(loss.item() / n)
    return losses, norms
