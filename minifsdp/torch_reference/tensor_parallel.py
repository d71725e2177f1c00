"""The same split with PyTorch's own ``torch.distributed.tensor.parallel``, for side-by-side runs.

Front layer (``minifsdp.torch_reference``; a reference, not part of the lesson). ``torch_tensor_parallel_gpt``
applies ``ColwiseParallel`` / ``RowwiseParallel`` (DTensor, a ``DeviceMesh("cpu" |
"cuda", (tp,))``) to the same places ``gpt.py`` splits: q/k/v and ``c_fc`` by
columns, the two ``c_proj`` by rows, the token embedding by vocabulary rows
and the head by vocabulary columns; the loss and its backward run under
``loss_parallel`` (``torch_tp_train_step``), so torch too never gathers the
logits. One adaptation, numerically neutral: ``c_attn``'s rows are
reordered so that torch's contiguous column split gives each rank whole heads ([q_r; k_r; v_r], what ``stride=3`` does in
``layers.py``); ``models.causal_attention`` reads the local head count from the shapes, so the
model's own attention forward runs unchanged on each rank's heads.
The trainer's ``--strategy torch-tp``; bench pairs it with ``tp``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F

from .. import dist, models, trace

__all__ = ["torch_tensor_parallel_gpt", "torch_fsdp_tp_gpt", "torch_tp_train_step"]


def torch_tensor_parallel_gpt(model: models.GPT, tp: int, mesh: object | None = None) -> models.GPT:
    """``model`` parallelized in place with torch's DTensor tensor parallel, over ``mesh`` (a 1-D
    ``DeviceMesh`` of ``tp`` ranks; default: all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    d = model.config.n_embd
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            for p in (attn.c_attn.weight, attn.c_attn.bias):
                if p is None:
                    continue
                pieces = [part.chunk(tp) for part in p.split(d)]          # q, k, v, each in tp slices
                p.copy_(torch.cat([pieces[i][r] for r in range(tp) for i in range(3)]))
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn.c_attn": ColwiseParallel(), f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.c_fc": ColwiseParallel(), f"blocks.{i}.mlp.c_proj": RowwiseParallel()})
    mesh = mesh if mesh is not None else init_device_mesh(dist.device().type, (tp,))
    return parallelize_module(model, mesh, plan)


def torch_fsdp_tp_gpt(model: models.GPT, dp: int, tp: int, mp_policy: Any = None,
                      before_shard: Callable[[torch.nn.Module], None] | None = None) -> tuple[models.GPT, int]:
    """torch's 2D recipe: TP over the inner dimension of a (dp, tp) ``init_device_mesh``, then FSDP2's
    ``fully_shard`` over the outer one, per Block and at the root. Returns the model and this rank's dp index.

    torchtitan's order: TP, then ``before_shard(model)`` (e.g. activation checkpointing of the blocks,
    in place), then FSDP with ``mp_policy`` (a ``MixedPrecisionPolicy``; None: fp32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(dist.device().type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = torch_tensor_parallel_gpt(model, tp, mesh["tp"])
    if before_shard is not None:
        before_shard(model)
    mp_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp_policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy)
    return model, mesh["dp"].get_local_rank()


def torch_tp_train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                        autocast: Callable[[], ContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """Forward, ``models.lm_loss`` on the vocab-sharded DTensor logits and backward, all inside
    ``loss_parallel`` (torch requires the backward there too); returns the loss as a plain tensor.
    ``autocast()`` is entered around the forward (e.g. ``torch.autocast``); the loss is taken in fp32."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        with trace.span("forward"):  # spans as train.py's loop opens them (phases.py)
            with autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.reshape(-1))
        with trace.span("backward"):
            loss.backward()
    loss = loss.detach()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
