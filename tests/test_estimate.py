"""Tests for minifsdp.estimate: formulas against hand counts, the ZeRO paper
and measurement of the real models."""

from __future__ import annotations

import pytest
import torch

from minifsdp.estimate import (
    comm_bytes_per_step,
    dtype_bytes,
    format_bytes,
    gpt_activation_bytes,
    gpt_layer_activation_breakdown,
    gpt_param_count,
    grad_bytes,
    model_state_bytes_per_device,
    optimizer_state_bytes_for,
    paper_comm_bytes,
    padded_numel,
    param_bytes,
    pipeline_bubble_fraction,
    pipeline_peak_microbatches,
    shard_numel,
)
from minifsdp.models import GPTConfig, build_model, count_parameters, lm_loss


def test_dtype_bytes_and_format():
    assert dtype_bytes(torch.float32) == dtype_bytes("fp32") == 4
    assert dtype_bytes("bf16") == dtype_bytes(torch.float16) == 2
    with pytest.raises(ValueError):
        dtype_bytes("fp8ish")
    assert format_bytes(14_753_792) == "14.07 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(4 * 2**20, digits=1) == "4.0 MiB" and format_bytes(-1536, digits=1) == "-1.5 KiB"


def test_mlp_bytes_by_hand():
    model = build_model("mlp", dims=(8, 16, 4))
    n = count_parameters(model)
    assert n == 8 * 16 + 16 + 16 * 4 + 4 == 212
    assert param_bytes(n) == 848 == sum(p.numel() * p.element_size() for p in model.parameters())
    assert grad_bytes(n) == 848
    assert param_bytes(n, torch.bfloat16) == 424
    # Measure AdamW's state after one step (ignoring its scalar `step` tensors).
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    measured = sum(t.numel() * t.element_size() for st in opt.state.values()
                   for k, t in st.items() if k != "step")
    assert optimizer_state_bytes_for(n, "adamw") == 1696 == measured
    assert optimizer_state_bytes_for(n, "sgd_momentum") == 848
    assert optimizer_state_bytes_for(n, "sgd") == 0
    with pytest.raises(ValueError):
        optimizer_state_bytes_for(n, "lion")


def test_padding():
    assert padded_numel(10, 4) == 12 and shard_numel(10, 4) == 3
    assert padded_numel(12, 4) == 12 and shard_numel(1, 8) == 1
    assert shard_numel(212, 1) == 212


def test_zero_paper_example():
    # ZeRO paper Figure 1: Psi = 7.5B, N = 64, mixed-precision Adam (K = 12).
    psi, gb = 7_500_000_000, 1e9
    total = {s: model_state_bytes_per_device(psi, 64, s, mixed_precision=True)["total"] / gb
             for s in range(4)}
    assert total[0] == pytest.approx(120.0)
    assert round(total[1], 1) == 31.4
    assert round(total[2], 1) == 16.6
    assert round(total[3], 1) == 1.9
    # Same with the paper's exact division and with names for the stages.
    assert model_state_bytes_per_device(psi, 64, "zero3", mixed_precision=True, padding=False)[
        "total"] == pytest.approx(16 * psi / 64)
    assert model_state_bytes_per_device(psi, 64, "ddp", mixed_precision=True)["total"] == 16 * psi


def test_fp32_stages_with_padding():
    # fp32 AdamW: 4 + 4 + 8 = 16 bytes per parameter; 10 params on 4 ranks pad to 12.
    s0 = model_state_bytes_per_device(10, 4, 0)
    assert s0 == {"parameters": 40, "gradients": 40, "optimizer": 80, "total": 160}
    s1 = model_state_bytes_per_device(10, 4, 1)
    assert s1["optimizer"] == 3 * 8 and s1["gradients"] == 40
    s2 = model_state_bytes_per_device(10, 4, "shard_grad_op")
    assert (s2["parameters"], s2["gradients"], s2["optimizer"]) == (40, 12, 24)
    s3 = model_state_bytes_per_device(10, 4, "full_shard")
    assert s3["total"] == 3 * 16
    # One flat parameter per FSDP unit, each padded on its own: 3 + 3 = 6 elements.
    assert model_state_bytes_per_device([10, 10], 4, 3)["parameters"] == 6 * 4
    with pytest.raises(ValueError):
        model_state_bytes_per_device(10, 4, 4)


def test_gpt_param_count_formula():
    variants = [("gpt-tiny", {}), ("gpt-mini", {}), ("gpt-small", {}),
                ("gpt-tiny", {"bias": False}), ("gpt-tiny", {"tie_embeddings": True}),
                ("gpt-tiny", {"bias": False, "tie_embeddings": True, "n_layer": 3})]
    for name, kw in variants:
        model = build_model(name, **kw)
        assert gpt_param_count(model.config) == count_parameters(model), (name, kw)


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in forward + loss,
    leaving out parameters and buffers (model state, not activations)."""
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), y)
    return sum(saved.values())


@pytest.mark.parametrize("name,overrides,batch,seq_len,dtype", [
    ("gpt-tiny", {}, 8, 32, torch.float32),
    ("gpt-tiny", {"n_layer": 3, "n_head": 4, "n_embd": 64, "bias": False,
                  "tie_embeddings": True}, 3, 17, torch.float32),
    ("gpt-mini", {}, 2, 64, torch.float32),
    ("gpt-tiny", {}, 4, 32, torch.bfloat16),
])
def test_activation_estimate_matches_saved_tensors(name, overrides, batch, seq_len, dtype):
    model = build_model(name, **overrides).to(dtype)
    x = torch.randint(0, 256, (batch, seq_len))
    y = torch.randint(0, 256, (batch, seq_len))
    measured = saved_activation_bytes(model, x, y)
    predicted = gpt_activation_bytes(model.config, batch, seq_len, dtype)["total"]
    # Measured ratio is exactly 1.000 for all four cases (torch 2.13, CPU): the
    # estimate counts every tensor the Block saves. Allow 10 % for other torch
    # versions whose kernels might save slightly different tensors.
    assert measured / predicted == pytest.approx(1.0, rel=0.10)


def test_activation_breakdown_worked_example():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    parts = gpt_layer_activation_breakdown(cfg, 8, 32)
    assert parts["attention probs"] == 8 * 2 * 32 * 32 * 4
    est = gpt_activation_bytes(cfg, 8, 32)
    assert est["per_layer"] == sum(parts.values()) == 593_920
    assert est["total"] == 1_521_924
    assert gpt_activation_bytes(cfg, 8, 32, include_loss=False)["loss"] == 0
    # Doubling T doubles the linear terms and quadruples the attention probs.
    longer = gpt_layer_activation_breakdown(cfg, 8, 64)
    assert longer["attention probs"] == 4 * parts["attention probs"]
    assert longer["gelu input"] == 2 * parts["gelu input"]


def test_comm_volume_conventions():
    psi = 1_000_000  # a multiple of 8: no padding
    # The ZeRO paper's kΨ, independent of N; FairScale-style ZeRO-1 ("oss") is one Ψ more than the paper's.
    paper = {s: paper_comm_bytes(psi, s) / (4 * psi) for s in ("ddp", "zero1", "zero2", "shard_grad_op", "zero3")}
    assert paper == {"ddp": 2, "zero1": 2, "zero2": 2, "shard_grad_op": 2, "zero3": 3}
    exact = {s: comm_bytes_per_step(psi, 8, s)["total"] / (4 * psi)
             for s in ("ddp", "zero1", "oss", "zero2", "shard_grad_op", "no_shard", "full_shard", "fsdp")}
    assert exact == {"ddp": 2, "zero1": 3, "oss": 3, "zero2": 2, "shard_grad_op": 2, "no_shard": 2,
                     "full_shard": 3, "fsdp": 3}
    # by collective, with the names comm records
    assert comm_bytes_per_step(psi, 4, "zero2") == {"reduce": 4 * psi, "broadcast": 4 * psi, "total": 8 * psi}
    assert comm_bytes_per_step(psi, 4, "zero1", buffer_bytes=96) == {
        "all_reduce": 8 * psi, "broadcast": 4 * psi + 96, "total": 12 * psi + 96}
    assert comm_bytes_per_step(psi, 4, "no_shard", buffer_bytes=96)["total"] == 8 * psi  # FSDP has no buffer sync
    # Ring: (N-1)/N of that, sent by each rank.
    ddp = comm_bytes_per_step(psi, 4, "ddp", ring=True)
    assert ddp["all_reduce"] == ddp["total"] == 2 * 3 / 4 * 4 * psi
    fsdp = comm_bytes_per_step(psi, 4, "full_shard", dtype="bf16", ring=True)
    assert fsdp["all_gather"] == 2 * 3 / 4 * 2 * psi and fsdp["reduce_scatter"] == 3 / 4 * 2 * psi
    assert comm_bytes_per_step(psi, 1, "fsdp")["total"] == 0  # nobody to talk to
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        comm_bytes_per_step(psi, 4, "zero4")
    with pytest.raises(ValueError, match="hybrid_shard needs shard_size"):
        comm_bytes_per_step(psi, 4, "hybrid_shard")


def test_comm_padding_and_root_rule_by_hand():
    # 3 ranks, units of 10 and 7 elements, root 5: padded to 12, 9 and 6 elements (fp32: x4 bytes)
    full = comm_bytes_per_step([10, 7], 3, "full_shard", root_numel=5)
    assert full == {"all_gather": 4 * (2 * (12 + 9) + 6), "reduce_scatter": 4 * (12 + 9 + 6),
                    "total": 4 * (3 * 27 - 6)}  # 3Ψ_padded - Ψ_root: the root is gathered once
    assert comm_bytes_per_step([10, 7], 3, "shard_grad_op", root_numel=5)["all_gather"] == 4 * 27
    assert comm_bytes_per_step([10, 7], 3, "no_shard", root_numel=5)["all_reduce"] == 2 * 4 * 22  # unpadded
    # HYBRID: full_shard inside groups of 2 (padded to 2), then the 1/2 shard all-reduced across the 2 groups
    hybrid = comm_bytes_per_step([10, 7], 4, "hybrid_shard", root_numel=5, shard_size=2)
    assert hybrid == {"all_gather": 4 * (2 * (10 + 8) + 6), "reduce_scatter": 4 * 24, "all_reduce": 4 * 24,
                      "total": 4 * (36 + 6 + 24 + 24)}
    ring = comm_bytes_per_step([10, 7], 4, "hybrid_shard", root_numel=5, shard_size=2, ring=True)
    assert ring["all_gather"] == hybrid["all_gather"] / 2 and ring["all_reduce"] == hybrid["all_reduce"] / 2
    # groups of one shard nothing: the replicas all-reduce everything
    assert comm_bytes_per_step([10, 7], 2, "hybrid_shard", root_numel=5, shard_size=1) == {
        "all_reduce": 2 * 4 * 22, "total": 2 * 4 * 22}


def test_estimate_docstring_examples_run():
    import doctest

    import minifsdp.estimate
    assert doctest.testmod(minifsdp.estimate).failed == 0


def test_pipeline_bubble():
    assert pipeline_bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble_fraction(4, 8, virtual_stages=4) == pytest.approx(3 / 35)
    assert pipeline_bubble_fraction(1, 5) == 0.0
    assert pipeline_bubble_fraction(4, 1000) < 0.01
    assert pipeline_peak_microbatches(4, 8, "gpipe") == 8
    assert [pipeline_peak_microbatches(4, 8, "1f1b", s) for s in range(4)] == [4, 3, 2, 1]
    assert pipeline_peak_microbatches(4, 2, "1f1b", 0) == 2
    with pytest.raises(ValueError):
        pipeline_bubble_fraction(0, 4)
