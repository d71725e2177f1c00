"""Tensor parallel (Megatron under FairScale's names): each layer equals the full layer's slices, a
whole GPT trains as the single process does (with and without sequence parallel), and the tracer
counts exactly the collectives the paper's design predicts."""

import dataclasses

import pytest
import torch

from minifsdp import launch, models
from minifsdp import tensor_parallel as T

import tp_helpers

TOL = 1e-5  # fp32; sums over ranks run in another order than one process's matmul


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_equal_full_slices(tp):
    for rank, errs in enumerate(launch(tp_helpers.layer_checks, tp, tp, timeout=120)):
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_same_as_fairscale():
    pytest.importorskip("fairscale")
    for errs in launch(tp_helpers.fairscale_checks, 2, 2, timeout=120):
        assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_parity_with_single_process(tp):
    """Losses (relative), gradients and parameters after 3 AdamW steps, TP and TP + SP."""
    for rank, result in enumerate(launch(tp_helpers.gpt_parity, tp, tp, timeout=180)):
        assert set(result) == {"sp=False", "sp=True"}
        for mode, errs in result.items():
            assert errs["loss"] < TOL and errs["grad"] < TOL and errs["param"] < TOL, (rank, mode, errs)


def test_fsdp_x_tp_parity_with_single_process():
    """FSDP x TP (dp 2 x tp 2, FSDP given the mesh): loss, gradients and parameters after 3 AdamW steps."""
    for rank, errs in enumerate(launch(tp_helpers.fsdp_tp_parity, 4, 2, 2, timeout=180)):
        assert errs["loss"] < TOL and errs["grad"] < TOL and errs["param"] < TOL, (rank, errs)


def test_tracer_counts_tp_and_sp_collectives_per_block():
    b, s, h, tp = 2, 8, 32, 2
    bsh = b * s * h
    tp_calls, sp_calls = (launch(tp_helpers.block_collectives, tp, tp, sp, b, s, timeout=120)[0]
                          for sp in (False, True))
    # TP: g forward in attention and MLP, f backward in both: all-reduces of b*s*h
    assert tp_calls["forward"] == [("all_reduce", bsh, 2 * 4 * bsh)] * 2
    assert tp_calls["backward"] == [("all_reduce", bsh, 2 * 4 * bsh)] * 2
    # SP: each all-reduce becomes an all-gather + a reduce-scatter of the same full size
    assert sorted(sp_calls["forward"]) == sorted([("all_gather", bsh, 4 * bsh), ("reduce_scatter", bsh, 4 * bsh)] * 2)
    act = [c for c in sp_calls["backward"] if c[1] == bsh]
    assert sorted(act) == sorted([("all_gather", bsh, 4 * bsh), ("reduce_scatter", bsh, 4 * bsh)] * 2)
    # ... plus the sequence-sharded parameters' gradients (2 layer norms x (w, b), 2 row biases), h each
    assert sorted(c for c in sp_calls["backward"] if c[1] != bsh) == [("all_reduce", h, 2 * 4 * h)] * 6
    volume = lambda calls: sum(c[2] for c in calls if c[1] == bsh)  # noqa: E731
    assert volume(sp_calls["forward"] + act) == volume(tp_calls["forward"] + tp_calls["backward"])


def test_bad_sizes_name_the_fix():
    heads = launch(tp_helpers.bad_input, 2, 2, n_head=3, n_embd=33, timeout=60)[0]
    assert heads.startswith("n_head=3 is not divisible by tp=2") and "choose a tp" in heads
    vocab = launch(tp_helpers.bad_input, 2, 2, vocab_size=255, timeout=60)[0]
    assert "vocab_size=255 is not divisible by tp=2" in vocab
    seq = launch(tp_helpers.bad_input, 2, 2, 15, True, timeout=60)[0]
    assert "length 15 is not divisible by tp=2" in seq
    assert launch(tp_helpers.bad_input, 2, 2, 16, True, timeout=60)[0] is None


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_mlp_same_as_torch_tensor_parallel(sequence_parallel):
    """PyTorch's own ColwiseParallel/RowwiseParallel (DTensor, gloo) on the same MLP: same numbers."""
    for rank, errs in enumerate(launch(tp_helpers.torch_tp_mlp, 2, 2, sequence_parallel, timeout=120)):
        assert max(errs.values()) < TOL, (rank, errs)


def test_activation_memory_down_by_the_predicted_factor():
    """gpt-mini (2 layers), B=4, T=64: activations after forward, one rank vs TP=2 vs TP=2 + SP, each within 3 %
    of the planner's prediction, so the TP and SP savings are the predicted ones."""
    from minifsdp import planner

    config = dataclasses.replace(models.MODEL_PRESETS["gpt-mini"], n_layer=2)
    measured = {(1, False): launch(tp_helpers.activations_after_forward, 1, 1, False, n_layer=2, timeout=120)[0]}
    for sp in (False, True):
        measured[(2, sp)] = launch(tp_helpers.activations_after_forward, 2, 2, sp, n_layer=2, timeout=120)[0]
    for (tp, sp), kept in measured.items():
        predicted = planner.plan(config, batch=4, seq_len=64, tp=tp, sequence_parallel=sp).memory["activations"]
        assert kept == pytest.approx(predicted, rel=0.03), (tp, sp, kept, predicted)
    assert measured[(2, True)] < measured[(2, False)] < measured[(1, False)]


def test_three_d_parity_with_single_process():
    """PP 2 x TP 2 x DP 2 on 8 ranks: loss, gradient and parameter slices of every rank's stages after
    3 AdamW steps equal the full GPT's on the whole batch."""
    for rank, errs in enumerate(launch(tp_helpers.three_d_parity, 8, 2, 2, 2, timeout=300)):
        assert errs["compared"] > 0, f"rank {rank} compared no parameter"
        assert errs["loss"] < TOL and errs["grad"] < TOL and errs["param"] < TOL, (rank, errs)
