"""Context parallel (ring attention): the online-softmax merge is the full softmax, ring attention forward and
backward equal one process's causal attention, a GPT trains as the single process does (cp = 2 and 4, zig-zag
and naive), the tracer's ring bytes per layer equal the formula to the byte, zig-zag balances the causal work
(naive does not), bad input gets a one-line error naming the fix, and torch's own context_parallel is recorded
as not running on CPU.

Two launches (cp = 2 and cp = 4, module-scoped fixtures) carry every multi-rank check; tests/cp_helpers.py.
"""

import doctest
import importlib
import math

import pytest
import torch

from minifsdp import launch, models
from minifsdp import context_parallel as C

import cp_helpers

TOL = 1e-5  # fp32, relative: sums over ranks run in another order than one process's


@pytest.fixture(scope="module")
def cp2():
    return launch(cp_helpers.cp_checks, 2, 2, True, True, timeout=240)


@pytest.fixture(scope="module")
def cp4():
    return launch(cp_helpers.cp_checks, 4, 4, timeout=240)


@pytest.fixture(params=[pytest.param(cp, marks=pytest.mark.multiprocess, id=f"cp{cp}") for cp in (2, 4)])
def ranks(request):
    """(cp, every rank's results) of the cp2 or cp4 launch (marked here: conftest cannot see getfixturevalue)."""
    return request.param, request.getfixturevalue(f"cp{request.param}")


# ---------------------------------------------------------------- single process
def test_docstring_examples():
    for name in ("online_softmax", "split", "ring_attention"):  # the package's ring_attention is the function
        module = importlib.import_module(f"minifsdp.context_parallel.{name}")
        assert doctest.testmod(module).failed == 0, name


def test_online_softmax_merge_equals_full_softmax():
    """Keys in three pieces (one of them causal-masked), merged in a shuffled order: the one-softmax result."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g) for _ in range(3))
    mask = models._future_mask(12)
    full = C.softmax_attention(q, k, v, mask)
    pieces = [(0, 4), (8, 12), (4, 8)]  # key ranges; queries are all 12 rows
    out = lse = None
    for lo, hi in pieces:
        rows_blocked = mask[:, lo:hi]
        # a query row whose every key here is masked sits this piece out (lse -inf, weight 0): merge by hand
        o, l = C.partial_attention(q, k[..., lo:hi, :], v[..., lo:hi, :], rows_blocked)
        o, l = torch.nan_to_num(o), l  # fully masked rows: 0/0 -> 0, lse -inf (their merge weight is 0)
        out, lse = (o, l) if out is None else C.merge_partials(out, lse, o, l)
    assert cp_helpers.rel(out, full) < 1e-6
    assert torch.allclose(lse, torch.logsumexp((q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(mask, -math.inf),
                                               -1), atol=1e-6)


def test_block_backward_with_the_final_lse_equals_autograd():
    """FlashAttention-2's backward, block by block from the saved lse, sums to autograd's through the softmax."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g, requires_grad=True) for _ in range(3))
    up = torch.randn(2, 2, 8, 4, generator=g)
    mask = models._future_mask(8)
    C.softmax_attention(q, k, v, mask).backward(up)
    with torch.no_grad():
        out, lse = C.partial_attention(q, k, v, mask)
        delta = (up * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for lo, hi in ((0, 4), (4, 8)):  # key blocks: the first is full for rows 4..7, diagonal for rows 0..3
            gq, gk, gv = C.partial_attention_backward(q, k[..., lo:hi, :], v[..., lo:hi, :], up, lse, delta,
                                                      mask[:, lo:hi])
            dq += gq
            dk[..., lo:hi, :] += gk
            dv[..., lo:hi, :] += gv
    for ours, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert cp_helpers.rel(ours, ref) < 1e-6


def test_one_rank_is_full_attention():
    """cp = 1 (no process group): ring attention is the causal attention, and the cp GPT is the GPT."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    assert cp_helpers.rel(C.ring_attention(q, k, v), C.softmax_attention(q, k, v, models._future_mask(8))) < 1e-6
    model = models.build_model("gpt-tiny", seed=0)
    x = torch.randint(0, 256, (2, 16), generator=g)
    assert cp_helpers.rel(C.context_parallel_gpt(model)(x), model(x)) < 1e-6


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("how", ["zigzag", "naive"])
def test_split_and_unsplit_are_inverse(cp, how):
    x = torch.arange(3 * 16).view(3, 16)
    shards = [C.shard_sequence(x, cp, r, how) for r in range(cp)]
    assert all(s.shape == (3, 16 // cp) for s in shards)
    assert torch.equal(C.unshard_sequence(shards, how), x)
    assert sorted(torch.cat([C.sequence_positions(16, cp, r, how) for r in range(cp)]).tolist()) == list(range(16))
    held = sorted(c for r in range(cp) for c in C.chunks_of(r, cp, how))
    assert held == list(range(C.num_chunks(cp, how)))  # every chunk held by exactly one rank


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_work_formula_zigzag_equal_naive_not(cp):
    """Unmasked query-key pairs per rank, from the chunk pairs: zig-zag's all equal, naive's grow with the rank;
    either way the total is T(T+1)/2 (every causal pair once)."""
    T = 64
    zig, naive = C.attention_work(T, cp, "zigzag"), C.attention_work(T, cp, "naive")
    assert sum(zig) == sum(naive) == T * (T + 1) // 2
    assert C.imbalance(zig) == 0.0
    n = T // cp
    assert naive == [r * n * n + n * (n + 1) // 2 for r in range(cp)]
    assert C.imbalance(naive) > 1.0


# ---------------------------------------------------------------- cp ranks
def test_ring_attention_equals_full_causal_attention(ranks):
    """Output and the gradients of q, k, v (this rank's share) vs one process's attention on the whole sequence."""
    cp, results = ranks
    for rank, result in enumerate(results):
        for how, errs in result["attention"].items():
            assert max(errs.values()) < TOL, (cp, rank, how, errs)


def test_gpt_trains_as_one_process(ranks):
    """gpt-tiny, B=2, T=32: losses, gradients (averaged over the cp group) and parameters after 3 AdamW steps."""
    cp, results = ranks
    for rank, result in enumerate(results):
        for how, errs in result["gpt"].items():
            assert set(errs) == {"loss", "grad", "grad_per_tensor_step0", "param"}
            assert max(errs.values()) < TOL, (cp, rank, how, errs)


def test_composes_with_ddp_and_fsdp_over_the_cp_ranks(cp2):
    """minifsdp's DDP (its all-reduce averages the gradients) and FSDP (sharded over the same 2 ranks) in place of
    all_reduce_gradients: the same parity."""
    for rank, result in enumerate(cp2):
        assert set(result["ddp"]) == {"loss", "grad", "grad_per_tensor_step0", "param"}
        assert set(result["fsdp"]) == {"loss", "param"}  # FSDP's gradients are sharded flat: parameters compared
        for wrap in ("ddp", "fsdp"):
            assert max(result[wrap].values()) < TOL, (rank, wrap, result[wrap])


def test_tracer_bytes_per_layer_equal_the_formula(ranks):
    """Every layer, forward and backward, sent and received: ring_attention_bytes, to the byte."""
    cp, results = ranks
    config = models.MODEL_PRESETS["gpt-tiny"]
    expect = C.ring_attention_bytes(cp_helpers.B, cp_helpers.T, config.n_embd, cp)
    assert expect == {"forward": (cp - 1) * 2 * cp_helpers.B * (cp_helpers.T // cp) * config.n_embd * 4,
                      "backward": 2 * (cp - 1) * 2 * cp_helpers.B * (cp_helpers.T // cp) * config.n_embd * 4}
    for rank, result in enumerate(results):
        for how, measured in result["bytes"].items():
            want = {(f"blocks.{i}.attn", phase, op): expect[phase]
                    for i in range(config.n_layer) for phase in ("forward", "backward") for op in ("send", "recv")}
            assert measured == want, (cp, rank, how)


def test_zigzag_balances_the_work_naive_does_not(ranks):
    """The unmasked pairs each rank computed (the tracer's block spans) equal split.attention_work, and the scores
    it computed (diagonal blocks whole) 2cp+1 blocks of (T/2cp)^2 (zig-zag) or r+1 of (T/cp)^2 (naive). Zig-zag's
    spread is within 10 % (it is 0 for both), the naive split's imbalance is large (pairs, T=32: cp=2 1.88,
    cp=4 5.33; scores: cp=2 1.0, cp=4 3.0)."""
    cp, results = ranks
    n_layer, T = models.MODEL_PRESETS["gpt-tiny"].n_layer, cp_helpers.T
    scores = {"zigzag": [(2 * cp + 1) * (T // (2 * cp)) ** 2] * cp,
              "naive": [(r + 1) * (T // cp) ** 2 for r in range(cp)]}
    spread = {}
    for how in ("zigzag", "naive"):
        for phase in ("forward", "backward"):
            pairs = [r["work"][how][(phase, "pairs")] for r in results]
            assert pairs == [n_layer * w for w in C.attention_work(T, cp, how)], (how, phase)
            computed = [r["work"][how][(phase, "scores")] for r in results]
            assert computed == [n_layer * s for s in scores[how]], (how, phase)
        alone = [r["work_alone"][how]["pairs"] for r in results]
        assert alone == C.attention_work(256, cp, how)
        spread[how] = C.imbalance(pairs), C.imbalance(computed)
    assert max(spread["zigzag"]) <= 0.10
    assert spread["naive"] == pytest.approx({2: (784 / 272 - 1, 1.0), 4: (456 / 72 - 1, 3.0)}[cp]), spread


def test_bad_input_gets_one_line_naming_the_fix(ranks):
    cp, results = ranks
    errors = results[0]["errors"]
    assert all(e is not None and "\n" not in e for e in errors.values()), errors
    assert f"2*cp = {2 * cp} chunks" in errors["zigzag_len"] and f"multiple of {2 * cp}" in errors["zigzag_len"]
    assert f"cp = {cp} chunks" in errors["naive_len"] and f"multiple of {cp}" in errors["naive_len"]
    assert f"multiple of {2 * cp}" in errors["ring_len"]
    for key in ("not_causal", "attn_mask", "model_mask"):
        assert "causal mask only" in errors[key] and "cp=1" in errors[key], errors[key]
    assert "split must be one of" in errors["split"] and "dropout=0" in errors["dropout"]


def test_torch_context_parallel_does_not_run_on_cpu(cp2):
    """torch.distributed.tensor.experimental.context_parallel (torch 2.13): its ring replaces the CUDA SDPA
    kernels only; SDPA on CPU dispatches to a kernel DTensor has no rule for. When torch supports CPU this test
    fails: then compare ring attention with torch's (the result holds torch's error vs full attention)."""
    for result in cp2:
        kind, message = result["torch"]
        assert (kind, message) == ("NotImplementedError", "Operator aten._scaled_dot_product_flash_attention_for_cpu."
                                   "default does not have a sharding strategy registered."), result["torch"]


def _pretend_gpu_step():
    from minifsdp import dist

    model = models.build_model("gpt-tiny", seed=0).to(dist.device())
    cp_model = C.context_parallel_gpt(model)
    data = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0)).to(dist.device())
    x, y = (C.shard_sequence(t, 2, dist.rank()) for t in (data[:, :-1], data[:, 1:]))
    loss = cp_model.loss(cp_model(x), y)
    loss.backward()
    C.all_reduce_gradients(cp_model)
    return C.global_loss(loss).item()


def test_device_discipline_on_pretend_gpus(monkeypatch):
    """Every tensor ring attention hands to comm would be on the GPU (minifsdp.fake_gpu), as NCCL needs."""
    monkeypatch.setenv("MINIFSDP_FAKE_GPU", "2")
    losses = launch(_pretend_gpu_step, 2, timeout=120)
    assert losses[0] == losses[1]
