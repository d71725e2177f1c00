"""PyTorch's memory-saving recipe, end to end: checkpoint every block, then FSDP with bf16 MixedPrecision.

The recipe, in the order of torch's FSDP tutorials (checkpoint the blocks, then wrap)::

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(
        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT), check_fn=is_block)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                 mixed_precision=MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16))

built once with minifsdp and once with torch's own ``checkpoint_wrapper`` and FSDP1
(CPU, ``device_id=cpu``), gpt-tiny, AdamW (lr 1e-2, so the weights move a lot), 4 steps
of a global batch of 8 x 16 tokens, losses averaged over the ranks; 2 ranks with
reduce_dtype=bf16 and 4 ranks with reduce_dtype=fp32.

Tolerance, relative on each step's loss (computed in fp32 from the bf16 logits): 2**-8 =
3.9e-3, one bf16 ulp (8 significant bits), both against torch FSDP1 with the same recipe
and against the fp32 single process (no checkpointing, no FSDP). Both implementations
round the same products to bf16 but may sum in another order (the reduce-scatter, the
flat-parameter layout), which moves a bf16 result by at most an ulp; against fp32, the
bf16 rounding of weights and activations moves the loss by less than one bf16 step of
its own value over these few steps (AdamW normalises each update, so it does not grow).
The bf16 run must also differ from the fp32 one (it did compute in bf16).

On CPU the two implementations give bit-identical losses (both rank counts), and ours
stays within about 1e-4 of the fp32 single process: the tolerance has a wide margin.

Also checked, from the tracer and an optimizer step pre-hook: the all-gathers move
exactly half the bytes of the same recipe in fp32 (the reduce-scatters half with
reduce_dtype=bf16, the same with reduce_dtype=fp32), and the optimizer steps fp32 master
*shards* (1/N of the padded parameters per rank) holding fp32 gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fsdp_helpers import gpt_batch, train_steps
from minifsdp import launch, models, trace

STEPS, LR = 4, 1e-2
TORCH_RTOL = 2.0**-8      # one bf16 ulp
SINGLE_RTOL = 2.0**-8     # one bf16 ulp
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return models.lm_loss(logits.float(), y)     # the loss in fp32, as autocast computes it


def _build(side: str, policy: tuple[str, str, str] | None):
    """gpt-tiny, every Block checkpointed (NO_REENTRANT), then FSDP with a unit per Block and ``policy``."""
    is_block = functools.partial(lambda m: isinstance(m, models.Block))
    model = models.build_model("gpt-tiny", seed=0)
    if side == "torch":
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        extra = {"device_id": torch.device("cpu")}
    else:
        import minifsdp.checkpoint as cw
        from minifsdp.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ModuleWrapPolicy
        extra = {}
    cw.apply_activation_checkpointing(model, check_fn=is_block, checkpoint_wrapper_fn=functools.partial(
        cw.checkpoint_wrapper, checkpoint_impl=cw.CheckpointImpl.NO_REENTRANT))
    mp = MixedPrecision(*(DTYPES[d] for d in policy)) if policy else None
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({models.Block}), mixed_precision=mp, **extra)


def _train(model) -> tuple[list[float], list[tuple[str, str]], int]:
    """(global mean losses, the optimizer's (param dtype, grad dtype) pairs, elements it steps on this rank)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    seen: set[tuple[str, str]] = set()
    opt.register_step_pre_hook(lambda o, *_: seen.update(
        (str(p.dtype), str(p.grad.dtype)) for g in o.param_groups for p in g["params"] if p.grad is not None))
    losses, _ = train_steps(model, opt, gpt_batch, _loss, STEPS)
    return losses, sorted(seen), sum(p.numel() for g in opt.param_groups for p in g["params"])


def _worker(side: str, policies: list[tuple[str, str, str] | None]) -> list[dict]:
    """Train the recipe once per policy in this process; minifsdp's runs are traced."""
    out = []
    for policy in policies:
        model = _build(side, policy)
        with trace.Tracer() as tracer:
            losses, grads, stepped = _train(model)
        out.append({"losses": losses, "grads": grads, "stepped": stepped,
                    "bytes": tracer.trace.bytes_by_op(),
                    "dtypes": sorted({(s.name, s.args["dtype"]) for s in tracer.trace.comm_spans()})})
    return out


@functools.lru_cache(maxsize=None)
def _single() -> tuple[list[float], int]:
    """The fp32 single process, no checkpointing, no FSDP: the losses every run is held to."""
    model = models.build_model("gpt-tiny", seed=0)
    losses, _ = train_steps(model, torch.optim.AdamW(model.parameters(), lr=LR), gpt_batch, _loss, STEPS)
    return losses, sum(p.numel() for p in model.parameters())


def _check_against_fp32(fp32: dict, bf16: dict, world_size: int, reduce: str) -> None:
    single, numel = _single()
    print(f"{world_size} ranks: bf16 vs fp32 single, worst relative loss difference "
          f"{max(abs(a - b) / b for a, b in zip(bf16['losses'], single)):.2g}")
    assert fp32["losses"] == pytest.approx(single, rel=1e-5), "the fp32 recipe is not the single process"
    torch.testing.assert_close(bf16["losses"], single, atol=0, rtol=SINGLE_RTOL,
                               msg=lambda m: f"bf16 recipe vs fp32 single, {world_size} ranks: {m}")
    assert bf16["losses"] != fp32["losses"], "the bf16 run computed in fp32"
    # the optimizer steps this rank's fp32 master shard, with fp32 gradients
    assert bf16["grads"] == fp32["grads"] == [("torch.float32", "torch.float32")], bf16["grads"]
    assert bf16["stepped"] == fp32["stepped"] and numel / world_size <= bf16["stepped"] < numel / world_size + 4 * \
        world_size, f"rank 0 steps {bf16['stepped']} elements, not a 1/{world_size} shard of {numel}"
    # the shard is cast to bf16 *before* the all-gather: half the bytes, exactly
    assert bf16["dtypes"] == [("all_gather", "bfloat16"), ("reduce_scatter", str(DTYPES[reduce])[6:])], bf16["dtypes"]
    assert 2 * bf16["bytes"]["all_gather"] == fp32["bytes"]["all_gather"], (bf16["bytes"], fp32["bytes"])
    factor = 2 if reduce == "bf16" else 1
    assert factor * bf16["bytes"]["reduce_scatter"] == fp32["bytes"]["reduce_scatter"], (bf16["bytes"], fp32["bytes"])


@pytest.mark.parametrize("world_size, reduce", [(2, "bf16"), (4, "fp32")])
def test_checkpointed_bf16_fsdp_trains_like_torch_fsdp1(world_size, reduce):
    policy = ("bf16", reduce, "bf16")
    theirs = launch(_worker, world_size, "torch", [policy], timeout=120)[0][0]
    fp32, ours = launch(_worker, world_size, "ours", [None, policy], timeout=120)[0]
    print(f"{world_size} ranks, reduce_dtype {reduce}: ours vs torch FSDP1, worst relative loss difference "
          f"{max(abs(a - b) / b for a, b in zip(ours['losses'], theirs['losses'])):.2g}")
    torch.testing.assert_close(ours["losses"], theirs["losses"], atol=0, rtol=TORCH_RTOL,
                               msg=lambda m: f"minifsdp vs torch FSDP1, same recipe, {world_size} ranks: {m}")
    assert theirs["grads"] == [("torch.float32", "torch.float32")], "torch's optimizer sees fp32 grads too"
    assert ours["stepped"] == theirs["stepped"], "both shard the same padded flat parameters"
    _check_against_fp32(fp32, ours, world_size, reduce)
