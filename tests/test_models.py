"""Tests for minifsdp.models: shapes, causality, determinism, presets, init."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from minifsdp.models import (
    GPT,
    MODEL_PRESETS,
    Block,
    GPTConfig,
    ToyMLP,
    build_model,
    count_parameters,
    init_weights,
    lm_loss,
)


def test_gpt_structure_and_forward_shape():
    model = build_model("gpt-tiny")
    assert isinstance(model, GPT)
    assert isinstance(model.tok_emb, nn.Embedding) and isinstance(model.pos_emb, nn.Embedding)
    assert isinstance(model.blocks, nn.ModuleList) and all(isinstance(b, Block) for b in model.blocks)
    assert isinstance(model.ln_f, nn.LayerNorm) and isinstance(model.head, nn.Linear)
    block = model.blocks[0]
    d = model.config.n_embd
    assert block.attn.c_attn.weight.shape == (3 * d, d)  # column-parallel in Megatron
    assert block.attn.c_proj.weight.shape == (d, d)  # row-parallel
    assert block.mlp.c_fc.weight.shape == (4 * d, d)
    assert block.mlp.c_proj.weight.shape == (d, 4 * d)
    idx = torch.randint(0, 256, (3, 20))
    assert model(idx).shape == (3, 20, 256)
    # The causal mask is derived, not state: it must not be in the state dict.
    assert not any("mask" in k for k in model.state_dict())


def test_attention_is_causal():
    model = build_model("gpt-tiny").eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)  # past unaffected
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sequence_longer_than_block_size_is_rejected():
    model = build_model("gpt-tiny")
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_lm_loss_is_mean_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    manual = torch.stack([
        -torch.log_softmax(logits[b, t], -1)[targets[b, t]] for b in range(2) for t in range(3)
    ]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), manual)
    # A fresh GPT predicts nearly uniformly: loss close to ln(256).
    model = build_model("gpt-tiny")
    idx = torch.randint(0, 256, (4, 32))
    assert abs(lm_loss(model(idx), idx).item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_model("gpt-tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model("gpt-tiny", seed=7)
    c = build_model("gpt-tiny", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], sc["tok_emb.weight"])


def test_gpt2_init_statistics():
    model = build_model("gpt-small")
    w = model.tok_emb.weight
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    proj = model.blocks[0].attn.c_proj.weight  # residual projection, scaled down
    expected = 0.02 / (2 * model.config.n_layer) ** 0.5
    assert abs(proj.std().item() - expected) / expected < 0.05
    assert torch.count_nonzero(model.blocks[0].mlp.c_fc.bias) == 0
    assert torch.all(model.blocks[0].ln_1.weight == 1)


def test_meta_device_deferred_init_matches_eager():
    eager = build_model("gpt-tiny", seed=3, tie_embeddings=True)
    meta = build_model("gpt-tiny", seed=3, tie_embeddings=True, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    init_weights(meta, seed=3)
    assert meta.head.weight is meta.tok_emb.weight  # re-tied after to_empty
    se, sm = eager.state_dict(), meta.state_dict()
    assert all(torch.equal(se[k], sm[k]) for k in se)
    idx = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(eager(idx), meta(idx), rtol=0, atol=0)


def test_tied_embeddings_counted_once():
    untied = build_model("gpt-tiny")
    tied = build_model("gpt-tiny", tie_embeddings=True)
    assert tied.head.weight is tied.tok_emb.weight
    assert count_parameters(untied) - count_parameters(tied) == 256 * 32


def test_preset_parameter_counts():
    # Hand count for gpt-tiny in the models.py docstring.
    assert count_parameters(build_model("gpt-tiny")) == 42880
    assert count_parameters(build_model("gpt-mini")) == 3_307_008
    assert 10_000_000 <= count_parameters(build_model("gpt-small")) <= 30_000_000
    assert set(MODEL_PRESETS) >= {"gpt-tiny", "gpt-mini", "gpt-small"}


def test_overrides_and_unknown_names():
    model = build_model("gpt-tiny", n_layer=3, n_embd=48, n_head=3)
    assert len(model.blocks) == 3 and model.config.n_embd == 48
    with pytest.raises(ValueError, match="gpt-tiny.*mlp|mlp.*gpt-tiny"):
        build_model("gpt-huge")
    with pytest.raises(ValueError, match="GPTConfig fields"):
        build_model("gpt-tiny", n_layers=3)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_layer=1, n_head=3, n_embd=32, block_size=8)


def test_toy_mlp():
    model = build_model("mlp", seed=1)
    assert isinstance(model, ToyMLP)
    # (8*16 + 16) + (16*16 + 16) + (16*4 + 4)
    assert count_parameters(model) == 144 + 272 + 68
    assert model(torch.randn(5, 8)).shape == (5, 4)
    small = build_model("mlp", dims=(8, 16, 4), activation="tanh")
    assert count_parameters(small) == 212 and isinstance(small.act, nn.Tanh)
    bound = 1 / 8 ** 0.5  # nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert small.layers[0].weight.abs().max() <= bound
    again = build_model("mlp", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    with pytest.raises(ValueError, match="activation"):
        ToyMLP(activation="sigmoid")


def test_gpt_tiny_training_step_is_small_and_learns():
    """gpt-tiny is the model of the unit tests and the labs' quick runs: a step must stay a few tens of
    MFLOP (6 x parameters x tokens, plus attention), well under a second on any laptop CPU, and it must
    learn. The time itself is no test's business (a shared CI machine is noisy)."""
    model = build_model("gpt-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (8, 32))
    losses = []
    for _ in range(12):
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2
    cfg, tokens = model.config, idx[:, :-1].numel()
    attention = 6 * cfg.n_layer * tokens * idx.shape[1] * cfg.n_embd  # QK^T and AV, forward and backward
    assert 6 * count_parameters(model) * tokens + attention < 100e6
