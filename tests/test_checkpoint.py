"""Activation checkpointing (minifsdp.checkpoint) against the un-checkpointed model and torch's own.

* Gradients: every variant (reentrant, non-reentrant, selective, offload, the
  functional ``checkpoint`` and the wrappers) gives *bit-identical* fp32
  gradients to the plain model, with dropout 0.1 (so the RNG replay is
  exercised; a negative control shows a missing replay is caught), and equal
  to ``torch.utils.checkpoint`` / torch's ``checkpoint_wrapper`` / torch's
  selective checkpointing.
* Memory: the tracker sees the activations after forward drop by exactly what
  ``estimate.gpt_checkpoint_activation_bytes`` predicts (full and selective).
* FSDP: checkpoint_wrapper on every block, then FSDP (PyTorch's recipe order),
  and the other order, trains like torch's FSDP1 with torch's checkpoint_wrapper
  (fp32, 2 ranks; the same recipe with bf16 MixedPrecision, against torch FSDP1 at
  2 and 4 ranks under a bf16 tolerance, is tests/test_fsdp_ac_bf16.py); state-dict
  keys are the plain model's and load into it.
* Bad input: one-line errors that name the fix.
"""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_cp
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw

from fsdp_helpers import gpt_batch, train_steps
from minifsdp import estimate, launch, models
from minifsdp.checkpoint import (LINEAR_OPS, MATMUL_OPS, CheckpointImpl, CheckpointPolicy, CheckpointWrapper,
                                 apply_activation_checkpointing, checkpoint, checkpoint_wrapper,
                                 create_selective_checkpoint_contexts, offload_wrapper,
                                 selective_checkpoint_wrapper)
from minifsdp.memory import ACTIVATIONS, MemoryTracker

B, T = 4, 32
PREFIX = "_checkpoint_wrapped_module."
is_block = functools.partial(lambda m: isinstance(m, models.Block))


def _model(dropout=0.1):
    return models.build_model("gpt-tiny", seed=3, dropout=dropout)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


def _grads(model, forward=None, seed=1):
    """Loss and gradients (by the plain model's names) of one forward/backward; dropout draws from ``seed``."""
    x, y = _data()
    torch.manual_seed(seed)
    loss = models.lm_loss((forward or model)(x), y)
    loss.backward()
    grads = {n.replace(PREFIX, ""): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _wrapped(wrapper_fn, apply=apply_activation_checkpointing, dropout=0.1):
    model = _model(dropout)
    apply(model, checkpoint_wrapper_fn=wrapper_fn, check_fn=is_block)
    return model


def _assert_same(got, want, what):
    (loss_got, g_got), (loss_want, g_want) = got, want
    assert loss_got == loss_want, f"{what}: loss {loss_got} != {loss_want}"
    assert g_got.keys() == g_want.keys(), f"{what}: parameter names differ"
    for name in g_want:
        assert torch.equal(g_got[name], g_want[name]), \
            f"{what}: gradient of {name} differs by {(g_got[name] - g_want[name]).abs().max():.3g}"


WRAPPERS = {
    "non-reentrant": checkpoint_wrapper,
    "reentrant": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT),
    "selective (linears)": selective_checkpoint_wrapper,
    "selective (all matmuls)": functools.partial(selective_checkpoint_wrapper, ops=MATMUL_OPS),
    "offload_wrapper": offload_wrapper,
    "non-reentrant, offload_to_cpu": functools.partial(checkpoint_wrapper, offload_to_cpu=True),
    "reentrant, offload_to_cpu": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT,
                                                   offload_to_cpu=True),
}


@pytest.mark.parametrize("variant", list(WRAPPERS))
def test_wrappers_give_exact_gradients_with_dropout(variant):
    reference = _grads(_model())
    _assert_same(_grads(_wrapped(WRAPPERS[variant])), reference, variant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_functional_checkpoint_exact_and_equal_to_torch(use_reentrant):
    """checkpoint(block, h) per block, ours and torch.utils.checkpoint's, against no checkpoint."""
    model = _model()

    def forward_with(cp):
        def forward(x):
            h = model.embed(x)
            for block in model.blocks:
                h = cp(block, h, use_reentrant=use_reentrant)
            return model.unembed(h)
        return forward

    reference = _grads(model)
    _assert_same(_grads(model, forward_with(checkpoint)), reference, f"checkpoint(use_reentrant={use_reentrant})")
    _assert_same(_grads(model, forward_with(torch_cp.checkpoint)), reference, "torch.utils.checkpoint")


def test_equal_to_torch_wrappers_and_torch_selective():
    ours = {"nr": _grads(_wrapped(WRAPPERS["non-reentrant"])), "re": _grads(_wrapped(WRAPPERS["reentrant"])),
            "sel": _grads(_wrapped(WRAPPERS["selective (linears)"]))}
    theirs = {
        "nr": _grads(_wrapped(torch_cw.checkpoint_wrapper, torch_cw.apply_activation_checkpointing)),
        "re": _grads(_wrapped(functools.partial(torch_cw.checkpoint_wrapper,
                                                checkpoint_impl=torch_cw.CheckpointImpl.REENTRANT),
                              torch_cw.apply_activation_checkpointing)),
        "sel": _grads(_wrapped(functools.partial(
            torch_cw.checkpoint_wrapper,
            context_fn=functools.partial(torch_cp.create_selective_checkpoint_contexts, list(LINEAR_OPS))),
            torch_cw.apply_activation_checkpointing)),
    }
    for k in ours:
        _assert_same(ours[k], theirs[k], f"{k} vs torch")


def test_rng_replay_is_what_makes_dropout_exact():
    """Negative control: without the RNG replay the recompute draws other dropout masks."""
    reference = _grads(_model())
    for impl in CheckpointImpl:
        _, grads = _grads(_wrapped(functools.partial(checkpoint_wrapper, checkpoint_impl=impl,
                                                     preserve_rng_state=False)))
        assert any(not torch.equal(grads[n], reference[1][n]) for n in grads), \
            f"{impl}: dropout recomputed identically without replaying the RNG; the gradient test cannot fail"


def test_policy_function_and_bool_policy_match_the_list():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in LINEAR_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    reference = _grads(_model())
    for p in (policy, lambda ctx, op, *a, **k: op in LINEAR_OPS):
        wrap = functools.partial(checkpoint_wrapper, context_fn=functools.partial(
            create_selective_checkpoint_contexts, p))
        _assert_same(_grads(_wrapped(wrap)), reference, "policy function")


def test_kwargs_non_tensor_outputs_autograd_grad_and_retain_graph():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def fn(a, scale=1.0, *, shift):
        y = lin(a) * scale + shift
        return {"y": y, "n": 7, "parts": (y.sum(), "label")}

    shift = torch.randn(4, requires_grad=True)
    want = torch.autograd.grad(fn(x, 2.0, shift=shift)["y"].square().sum(), [x, shift, lin.weight])
    out = checkpoint(fn, x, 2.0, shift=shift, use_reentrant=False)
    assert out["n"] == 7 and out["parts"][1] == "label"
    got = torch.autograd.grad(out["y"].square().sum(), [x, shift, lin.weight], retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "non-reentrant: kwargs / autograd.grad"
    again = torch.autograd.grad(out["y"].square().sum(), [x, shift, lin.weight])  # recomputes a second time
    assert all(torch.equal(a, b) for a, b in zip(again, want)), "non-reentrant: second backward (retain_graph)"

    # reentrant: positional only; a tuple output may carry non-tensors
    y, tag = checkpoint(lambda a, s, b: (lin(a) * s + b, "tag"), x, 2.0, shift, use_reentrant=True)
    y.square().sum().backward()
    assert tag == "tag" and torch.equal(x.grad, want[0]), "reentrant: tuple output with a non-tensor"
    # the REENTRANT wrapper packs keyword arguments positionally (torch's wrapper does too)
    x.grad = shift.grad = None

    class WithKwargs(nn.Module):
        def forward(self, a, *, shift):
            return lin(a) * 2.0 + shift

    checkpoint_wrapper(WithKwargs(), CheckpointImpl.REENTRANT)(x, shift=shift).square().sum().backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(shift.grad, want[1]), "REENTRANT wrapper with kwargs"


def test_no_grad_just_runs_the_function():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for r in (False, True):
            assert torch.equal(checkpoint(lin, x, use_reentrant=r), lin(x))


def test_bad_input_one_line_errors_name_the_fix():
    lin = nn.Linear(4, 4).requires_grad_(False)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="no output of fn requires grad.*call fn without checkpoint"):
        checkpoint(lin, x, use_reentrant=False)
    with pytest.raises(ValueError, match="no input tensor requires grad.*use_reentrant=False"):
        checkpoint(nn.Linear(4, 4), x, use_reentrant=True)
    with pytest.raises(ValueError, match=r"keyword arguments \['scale'\].*use_reentrant=False"):
        checkpoint(lambda a, scale: a * scale, x.requires_grad_(), use_reentrant=True, scale=2.0)
    with pytest.raises(TypeError, match="return a tuple or use use_reentrant=False"):
        checkpoint(lambda a: {"y": a * 2}, x, use_reentrant=True)
    sel = functools.partial(create_selective_checkpoint_contexts, list(LINEAR_OPS))
    with pytest.raises(ValueError, match="needs use_reentrant=False"):
        checkpoint(lambda a: a * 2, x, use_reentrant=True, context_fn=sel)
    with pytest.raises(ValueError, match="needs CheckpointImpl.NO_REENTRANT"):
        checkpoint_wrapper(nn.Linear(4, 4), CheckpointImpl.REENTRANT, context_fn=sel)
    with pytest.raises(TypeError, match="CheckpointImpl.NO_REENTRANT or CheckpointImpl.REENTRANT"):
        checkpoint_wrapper(nn.Linear(4, 4), "reentrant")
    with pytest.raises(TypeError, match="torch.ops.aten.mm.default"):
        create_selective_checkpoint_contexts([torch.mm])
    with pytest.raises(ValueError) as e:
        checkpoint(lin, x.detach(), use_reentrant=False)
    assert "\n" not in str(e.value), "the error is one line"


def _activations_after_forward(model):
    x, y = _data()
    tracker = MemoryTracker()
    tracker.track_model(model)
    with tracker:
        loss = models.lm_loss(model(x.clone()), y.clone())
        live = tracker.snapshot()[ACTIVATIONS]
        loss.backward()
    tracker.close()
    return live


@pytest.mark.parametrize("mode,wrapper", [("full", checkpoint_wrapper), ("full", WRAPPERS["reentrant"]),
                                          ("selective", selective_checkpoint_wrapper)])
def test_activation_memory_drops_by_the_predicted_amount(mode, wrapper):
    cfg = models.MODEL_PRESETS["gpt-tiny"]
    none = _activations_after_forward(_model(dropout=0.0))
    ours = _activations_after_forward(_wrapped(wrapper, dropout=0.0))
    predicted = estimate.gpt_checkpoint_activation_bytes(cfg, B, T, checkpoint=mode)
    predicted_none = estimate.gpt_checkpoint_activation_bytes(cfg, B, T, checkpoint="none")
    assert none - ours == predicted_none["total"] - predicted["total"], \
        f"{mode}: measured drop {none - ours} B, predicted {predicted_none['total'] - predicted['total']} B"
    assert predicted["total"] < predicted_none["total"]


def test_state_dict_keys_are_the_plain_models_and_load_both_ways():
    plain, wrapped = _model(), _wrapped(checkpoint_wrapper)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    wrapped.load_state_dict(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(wrapped.state_dict().values(), plain.state_dict().values()))
    plain.load_state_dict(_wrapped(checkpoint_wrapper).state_dict())
    block = wrapped.blocks[0]
    assert isinstance(block, CheckpointWrapper) and block.ln_1 is block._checkpoint_wrapped_module.ln_1
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in _model().blocks[0].named_parameters()]


def test_apply_with_auto_wrap_policy_wraps_children_not_root():
    model = _model()
    apply_activation_checkpointing(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel:
                                   isinstance(module, models.Block))
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    assert not isinstance(model, CheckpointWrapper) and not isinstance(model.head, CheckpointWrapper)
    apply_activation_checkpointing(model, check_fn=is_block)  # idempotent: no wrapper inside a wrapper
    assert not isinstance(model.blocks[0]._checkpoint_wrapped_module, CheckpointWrapper)


# -- FSDP: checkpoint the blocks, then wrap (PyTorch's recipe), against torch FSDP1 -------

def _fsdp_worker(side, order, impl):
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as tcw
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ModuleWrapPolicy

    model = models.build_model("gpt-tiny", seed=0)
    if side == "ours":
        apply, fsdp = apply_activation_checkpointing, functools.partial(
            FSDP, auto_wrap_policy=ModuleWrapPolicy({models.Block}))
        wrap_fn = {"nr": checkpoint_wrapper, "sel": selective_checkpoint_wrapper,
                   "re": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)}[impl]
    else:
        apply, fsdp = tcw.apply_activation_checkpointing, functools.partial(
            TorchFSDP, auto_wrap_policy=TorchPolicy({models.Block}), device_id=torch.device("cpu"))
        wrap_fn = {"nr": tcw.checkpoint_wrapper,
                   "re": functools.partial(tcw.checkpoint_wrapper, checkpoint_impl=tcw.CheckpointImpl.REENTRANT)}[impl]
    if order == "before":  # PyTorch's recipe: checkpoint the blocks, then FSDP wraps FSDP(Block) inside each
        apply(model, checkpoint_wrapper_fn=wrap_fn, check_fn=is_block)
    model = fsdp(model)
    if order == "after":
        apply(model, checkpoint_wrapper_fn=wrap_fn, check_fn=is_block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, _ = train_steps(model, opt, gpt_batch, models.lm_loss, steps=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, state


def test_fsdp_with_checkpoint_wrapper_trains_like_torch_fsdp():
    plain = models.build_model("gpt-tiny", seed=0)
    single, _ = train_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), gpt_batch, models.lm_loss, 3)
    torch_losses, torch_state = launch(_fsdp_worker, 2, "torch", "before", "nr", timeout=120)[0]
    assert torch_losses == pytest.approx(single, rel=1e-5)
    for order, impl in [("before", "nr"), ("before", "re"), ("before", "sel"), ("after", "nr")]:
        losses, state = launch(_fsdp_worker, 2, "ours", order, impl, timeout=120)[0]
        assert losses == pytest.approx(torch_losses, rel=1e-5), f"{order}/{impl}: {losses} vs torch {torch_losses}"
        assert list(state) == list(torch_state), f"{order}/{impl}: state-dict keys differ from torch FSDP's"
        for k in state:
            torch.testing.assert_close(state[k], torch_state[k], rtol=1e-4, atol=1e-5, msg=f"{order}/{impl}: {k}")
        models.build_model("gpt-tiny").load_state_dict(state)  # loads into the plain model


def test_recompute_stops_after_the_last_saved_tensor():
    """Early stop (torch's default): what a block does after its last saved tensor is not re-run in
    backward - here a counter after the last op; the gradients stay exact."""
    from minifsdp.checkpoint import checkpoint

    calls = []
    lin = torch.nn.Linear(4, 4)

    def block(x):
        calls.append("start")
        h = lin(x).relu()          # saves x, the weight and relu's output
        calls.append("tail")       # after the last saved tensor: the recompute stops before this
        return h + 1.0

    x = torch.randn(3, 4, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert calls == ["start", "tail", "start"], calls
    ref_x = x.detach().clone().requires_grad_()
    lin.zero_grad()
    block(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
