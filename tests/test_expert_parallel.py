"""Expert parallel and the mixture-of-experts GPT: the single-process MoE checked by hand, then the
expert-parallel GPT against one process (losses, gradients, parameters after AdamW steps) at ep = 2 and 4,
dropless and with a capacity factor, the tracer's all-to-all bytes against the formula to the byte, the
naive all-gather dispatch beside it, and bad input refused in one line.

Two launches in all (module fixtures; the ep = 2 one on pretend GPUs, so every collective's tensors are
checked to be on ``dist.device()``); each runs every multi-rank check and returns numbers.
"""

import doctest
import math

import pytest
import torch
import torch.nn.functional as F

from minifsdp import launch, models
from minifsdp import expert_parallel as EP

import ep_helpers

TOL = 1e-5  # fp32: the ranks sum in another order than one process


# ---------------------------------------------------------------- single process: the MoE by hand
def test_top_k_routing_weights():
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.1, 0.4]]).log()
    probs, idx, w = models.top_k_routing(logits, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert idx[0].tolist() == [1, 2] and sorted(idx[1].tolist()) == [0, 3]
    torch.testing.assert_close(w, torch.tensor([[0.625, 0.375], [0.5, 0.5]]))   # renormalised (Mixtral)
    _, idx1, w1 = models.top_k_routing(logits, 1)
    torch.testing.assert_close(w1, torch.tensor([[0.5], [0.4]]))                 # raw probability (Switch)


def _two_token_moe(probs, k=1, **config):
    """A MoE layer with d = 2 whose router turns one-hot token t into log(probs[t]): softmax gives probs back."""
    cfg = models.GPTConfig(n_layer=1, n_head=1, n_embd=2, block_size=4, n_expert=2, top_k=k, **config)
    moe = models.MoE(cfg)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor(probs).log().T)  # W[e, t] = log p_t,e
    return moe


@pytest.mark.parametrize("probs, expected", [([[0.8, 0.2], [0.7, 0.3]], 1.5),   # f = [1, 0], P = [0.75, 0.25]
                                             ([[0.8, 0.2], [0.4, 0.6]], 1.0)])  # f = [.5, .5], P = [.6, .4]
def test_load_balancing_loss_by_hand(probs, expected):
    p = torch.tensor(probs)
    assert math.isclose(models.load_balancing_loss(p, p.argmax(-1, keepdim=True)).item(), expected, rel_tol=1e-6)
    moe = _two_token_moe(probs, aux_loss_coef=0.1)
    moe(torch.eye(2).unsqueeze(0))                               # one sequence of the two tokens
    assert math.isclose(moe.aux_loss.item(), 0.1 * expected, rel_tol=1e-6)
    # Per sequence, averaged: the two sequences [balanced, unbalanced] give the mean of 1.0 and 1.5.
    pair = torch.tensor([[[0.8, 0.2], [0.4, 0.6]], [[0.8, 0.2], [0.7, 0.3]]])
    assert math.isclose(models.load_balancing_loss(pair, pair.argmax(-1, keepdim=True)).item(), 1.25, rel_tol=1e-6)


def test_capacity_drops_by_position_and_counts():
    assert (models.expert_capacity(16, 2, 8, 1.0), models.expert_capacity(16, 2, 8, 1.25),
            models.expert_capacity(10, 1, 1, 1.1), models.expert_capacity(3, 1, 2, 1.0)) == (4, 5, 11, 2)
    keep = models.capacity_mask(torch.tensor([[0], [0], [1], [0]]), 2, 2)
    assert keep.view(-1).tolist() == [True, True, True, False]          # expert 0's third token goes
    # k = 2: token order first, then a token's slots best first; per sequence (two identical sequences)
    idx = torch.tensor([[[0, 1], [1, 0], [0, 2]]] * 2)
    assert models.capacity_mask(idx, 3, 2).tolist() == [[[True, True], [True, True], [False, True]]] * 2
    # in the layer: dropped assignments counted per expert, and they contribute nothing
    cfg = models.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, n_expert=2, top_k=1, capacity_factor=0.5)
    moe = models.MoE(cfg)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0] + [0.0] * 7, [-1.0] + [0.0] * 7]))  # everything to expert 0
    x = torch.rand(1, 4, 8) + 0.1                                        # capacity ceil(0.5 * 4 / 2) = 1
    y = moe(x)
    assert moe.tokens_per_expert.tolist() == [4, 0] and moe.dropped_per_expert.tolist() == [3, 0]
    assert torch.count_nonzero(y[0, 1:]) == 0 and torch.count_nonzero(y[0, 0]) > 0
    torch.testing.assert_close(moe(x), y, rtol=0, atol=0)                # deterministic


def test_moe_loop_equals_dense_computation():
    """The readable loop (each expert on its tokens) equals every expert on every token, mixed by a dense
    (N, E) gate matrix holding the kept assignments' weights (GShard's combine tensor)."""
    for capacity_factor in (None, 1.0):
        moe = models.build_model("gpt-moe-tiny", capacity_factor=capacity_factor).blocks[1].mlp
        x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0))
        y = moe(x)
        probs, idx, w = models.top_k_routing(moe.router(x), 2)
        keep = (models.capacity_mask(idx, 8, models.expert_capacity(16, 2, 8, capacity_factor))
                if capacity_factor else torch.ones_like(idx, dtype=torch.bool))
        gates = (F.one_hot(idx, 8) * (w * keep)[..., None]).sum(-2)               # (3, 16, 8)
        dense = sum(gates[..., e, None] * moe.experts[e](x) for e in range(8))
        torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)
        assert (moe.dropped_per_expert.sum() > 0) == (capacity_factor is not None)


def test_moe_gpt_presets_and_dense_models_unchanged():
    tiny = models.build_model("gpt-moe-tiny")
    assert models.count_parameters(tiny) == 101600                      # by hand in models.py's docstring
    assert [type(b.mlp).__name__ for b in tiny.blocks] == ["FeedForward", "MoE"]
    small = models.build_model("gpt-moe-small", device="meta")
    assert [isinstance(b.mlp, models.MoE) for b in small.blocks] == [False, True] * 3
    dense = models.build_model("gpt-tiny")
    assert models.count_parameters(dense) == 42880 and not any(isinstance(m, models.MoE) for m in dense.modules())
    assert dense.aux_loss().item() == 0.0
    idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    logits = tiny(idx[:, :-1])
    assert 0.0 < tiny.aux_loss().item() < 0.02                          # 0.01 x (about 1 when balanced)
    (models.lm_loss(logits, idx[:, 1:]) + tiny.aux_loss()).backward()
    assert tiny.blocks[1].mlp.router.weight.grad.abs().sum() > 0


def test_bad_config_and_sizes_in_one_line():
    messages = []
    for kw in ({"top_k": 9}, {"top_k": 0}, {"capacity_factor": 0.0}, {"n_expert": -1}):
        with pytest.raises(ValueError) as e:
            models.build_model("gpt-moe-tiny", **kw)
        messages.append(str(e.value))
    assert messages[0].startswith("top_k=9 must be between 1 and n_expert=8") and "choose top_k <= 8" in messages[0]
    with pytest.raises(ValueError, match="n_expert=6 is not divisible by ep=4.*choose an ep that divides 6"):
        EP.check_expert_parallel(models.GPTConfig(2, 2, 32, 32, n_expert=6), 4)
    with pytest.raises(ValueError, match="needs a mixture-of-experts GPT.*gpt-moe-tiny"):
        EP.check_expert_parallel(models.MODEL_PRESETS["gpt-tiny"], 2)
    with pytest.raises(TypeError, match="takes a minifsdp.models.GPT"):
        EP.expert_parallel_gpt(models.build_model("mlp"))
    assert all("\n" not in m for m in messages)


def test_docstring_examples_run():
    for module in (models, EP.dispatch, EP.capacity):
        assert doctest.testmod(module).failed == 0, module.__name__


# ---------------------------------------------------------------- multi-rank: one launch per ep size
@pytest.fixture(scope="module")
def ep2():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINIFSDP_FAKE_GPU", "2")  # a pretend 2-GPU machine: every collective's tensors checked
        return launch(ep_helpers.ep_checks, 2, 2, timeout=240)


@pytest.fixture(scope="module")
def ep4():
    return launch(ep_helpers.ep_checks, 4, 4, timeout=240)


@pytest.fixture(params=[2, 4], ids=["ep=2", "ep=4"])
def ranks(request):
    return request.getfixturevalue(f"ep{request.param}")


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
def test_all_to_all_single_uneven_splits_and_bytes(ranks):
    assert [out["pretend_gpu"] for out in ranks] == [len(ranks) == 2] * len(ranks)  # ep = 2 ran device-checked
    for rank, out in enumerate(ranks):
        c = out["comm"]
        assert c["values_ok"] and c["name"] == "all_to_all", (rank, c)
        assert (c["bytes"], c["ring_bytes"]) == (c["expect_bytes"], c["expect_ring"]), (rank, c)
        assert "input_split_sizes" in c["bad_splits"] and "\n" not in c["bad_splits"]


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_parity_with_one_process(ranks, mode):
    """Losses (relative), gradients and parameters after 3 AdamW steps (max abs), this rank's experts."""
    ep = len(ranks)
    for rank, out in enumerate(ranks):
        o = out[mode]
        assert o["loss"] < TOL and o["aux"] < TOL and o["grad"] < TOL and o["param"] < TOL, (rank, mode, o)
        assert o["local_experts"] == [str(e) for e in range(rank * 8 // ep, (rank + 1) * 8 // ep)]


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
def test_skewed_routing_with_empty_splits(ranks):
    """Every token to rank 0's experts 0 and 1: the other ranks' experts receive nothing, yet the layer's
    output, input gradients, expert gradients and (summed) router gradients equal one process's."""
    for rank, out in enumerate(ranks):
        sk = out["skewed"]
        assert sk["routed"] == [ep_helpers.B // len(ranks) * ep_helpers.T] * 2 + [0] * 6, (rank, sk["routed"])
        assert max(v for k, v in sk.items() if k != "routed") < TOL, (rank, sk)


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
def test_capacity_drops_the_same_tokens_as_one_process(ranks):
    """Capacity per sequence: the ep group drops exactly the assignments one process drops, counted."""
    for out in ranks:
        o = out["capacity"]
        assert o["dropped_ep"] == o["dropped_single"] == o["dropped_by_hand"] > 0, o
        assert o["routed_ep"] == 2 * ep_helpers.B * ep_helpers.T * 2          # 2 layers x tokens x k
        assert out["dropless"]["dropped_ep"] == 0


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_bytes_per_layer_equal_the_formula(ranks, mode):
    """Per MoE layer and rank: forward a counts all-to-all (E int64) and the dispatch and combine
    all-to-alls, backward their two reverses, nothing else; every one's bytes equal the formula from
    the reference routing. Over the group: 4 x d x 4 bytes x (tokens x k - dropped - local)."""
    d, ep = 32, len(ranks)
    for rank, out in enumerate(ranks):
        o = out[mode]
        assert o["calls"] == [("all_to_all", "backward", "combine"), ("all_to_all", "backward", "dispatch"),
                              ("all_to_all", "forward", "combine"), ("all_to_all", "forward", "counts"),
                              ("all_to_all", "forward", "dispatch")], (rank, o["calls"])
        assert o["measured"] == o["expected"], (rank, o["measured"], o["expected"])
    layers = ranks[0][mode]["rows"]
    tokens_k = ep_helpers.B * ep_helpers.T * 2                       # every token's k = 2 assignments
    assert sum(rows["kept"] for rows in layers.values()) == len(layers) * tokens_k - ranks[0][mode]["dropped_single"]
    for unit, rows in layers.items():
        moved = sum(out[mode]["measured"][(unit, phase, x)][1] for out in ranks
                    for phase in ("forward", "backward") for x in ("dispatch", "combine"))
        assert moved == 4 * d * 4 * (rows["kept"] - rows["local"]), (unit, moved, rows)
        assert 0 < rows["local"] < rows["kept"]


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
def test_naive_all_gather_dispatch_agrees_and_moves_more(ranks):
    ep = len(ranks)
    for rank, out in enumerate(ranks):
        naive, a2a = out["all_gather"], out["dropless"]
        assert naive["loss"] < TOL and naive["grad"] < TOL and naive["param"] < TOL, (rank, naive)
        assert {c[0] for c in naive["calls"]} == {"all_gather", "reduce_scatter"}
        assert naive["ring_bytes"] > a2a["ring_bytes"], (rank, naive["ring_bytes"], a2a["ring_bytes"])
    if ep == 4:  # ep / k = 2: about twice the all-to-all's bytes (plus the gates)
        assert sum(o["all_gather"]["ring_bytes"] for o in ranks) > 2 * sum(o["dropless"]["ring_bytes"] for o in ranks)


@pytest.mark.multiprocess  # through the ranks fixture, which conftest cannot follow
def test_bad_input_on_ranks_in_one_line(ranks):
    ep = len(ranks)
    errors = ranks[0]["errors"]
    assert errors["not_divisible"].startswith(f"n_expert={ep + 1} is not divisible by ep={ep}")
    assert "choose an ep that divides" in errors["not_divisible"]
    assert "n_expert=0" in errors["dense"] and "gpt-moe-tiny" in errors["dense"]
    assert all("\n" not in m for m in errors.values())
