"""minifsdp.fsdp.naive: the four-hook FSDP of lab 04, against one process.

One global batch per step; rank r of N trains on its rows of it, so the mean
of the ranks' losses is the single process's loss. After every backward each
rank's gradient shard must equal its chunk of the single process's flat,
zero-padded gradient; after the AdamW steps the gathered parameters must
equal the single process's. Tolerances: fp32, the ranks add in another order
(ATOL/RTOL below). World sizes 1, 2, 4 and 3 (gpt-tiny's units do not divide
by 3: every unit is padded).
"""

import pytest
import torch
import torch.distributed as tdist

from minifsdp import WorkerError, comm, dist, launch, models, trace
from minifsdp.fsdp.naive import NaiveFullyShardedDataParallel

ATOL, RTOL = 1e-5, 1e-4
STEPS, BATCH, SEQ = 3, 12, 8   # 12 rows split evenly over 1, 2, 3 or 4 ranks
# AdamW eps 1e-6, not 1e-8: a gradient that is pure rounding noise (~1e-9, its sign set by the order
# of a sum) would otherwise become a full-size update of either sign (as tests/test_zero.py)
EPS = 1e-6


def _batch(step):
    data = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1], data[:, 1:]


def _unit_params(model):
    """The single model's parameters grouped as NaiveFSDP groups them: blocks innermost first, then the root."""
    units = [list(b.parameters()) for b in model.blocks][::-1]
    in_blocks = {id(p) for u in units for p in u}
    return units + [[p for p in model.parameters() if id(p) not in in_blocks]]


def _flat_chunk(tensors, n, r):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % n)])
    return flat.chunk(n)[r]


def _single():
    model = models.build_model("gpt-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = models.lm_loss(model(x), y)
        loss.backward()
        grads.append([[p.grad.clone() for p in u] for u in _unit_params(model)])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, [[p.detach().clone() for p in u] for u in _unit_params(model)]


def _naive_worker(ref_grads):
    r, n = tdist.get_rank(), tdist.get_world_size()
    model = NaiveFullyShardedDataParallel(models.build_model("gpt-tiny"), unit_types={models.Block})
    assert [u.name for u in model.units] == ["blocks.1", "blocks.0", "root"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    losses, grad_err = [], 0.0
    with trace.Tracer(rank=r) as tracer:
        for step in range(STEPS):
            x, y = _batch(step)
            rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
            with trace.span("step"):
                loss = models.lm_loss(model(x[rows].to(dist.device())), y[rows].to(dist.device()))
                loss.backward()
            assert not any(u.is_gathered() for u in model.units), "a unit is still gathered after backward"
            for unit, ref in zip(model.units, ref_grads[step]):
                want = _flat_chunk(ref, n, r)
                assert torch.allclose(unit.shard.grad, want, atol=ATOL, rtol=RTOL), (step, unit.name)
                grad_err = max(grad_err, (unit.shard.grad - want).abs().max().item())
            opt.step()
            opt.zero_grad()
            total = loss.detach().reshape(1)
            tdist.all_reduce(total)
            losses.append(total.item() / n)
    full = []
    for u in model.units:   # gather the final shards for the comparison
        out = torch.empty(u.padded_numel, device=dist.device())
        comm.all_gather_into_tensor(out, u.shard.detach())
        full.append(out[:u.numel].cpu())
    return {"losses": losses, "full": full, "grad_err": grad_err,
            "bytes": tracer.trace.bytes_by_op(within="step"),
            "padded": [u.padded_numel for u in model.units], "shards": [u.shard.numel() for u in model.units]}


@pytest.fixture(scope="module")
def single():
    return _single()


@pytest.mark.parametrize("world_size", [1, 2, 4, 3])
def test_naive_fsdp_matches_one_process(single, world_size):
    ref_losses, ref_grads, ref_params = single
    results = launch(_naive_worker, world_size, ref_grads, timeout=120)
    for out in results:
        assert out["losses"] == pytest.approx(ref_losses, abs=ATOL)
        assert out["grad_err"] <= ATOL
        for got, want in zip(out["full"], ref_params):
            assert torch.allclose(got, torch.cat([w.reshape(-1) for w in want]), atol=ATOL, rtol=RTOL)
        psi_padded = 4 * sum(out["padded"])   # fp32 bytes of the padded units
        # 3Ψ per step, the root included: all-gather in forward and in backward, one reduce-scatter
        assert out["bytes"] == {"all_gather": STEPS * 2 * psi_padded, "reduce_scatter": STEPS * psi_padded}
        assert all(s * world_size == p for s, p in zip(out["shards"], out["padded"]))
    if world_size == 3:
        assert any(p % 3 == 0 and p > n for p, n in zip(results[0]["padded"], [
            sum(t.numel() for t in u) for u in _unit_params(models.build_model("gpt-tiny"))])), "no unit was padded"


def _tied_worker():
    NaiveFullyShardedDataParallel(models.build_model("gpt-tiny", tie_embeddings=True), unit_types={models.Block})


def test_naive_fsdp_rejects_tied_weights():
    with pytest.raises(WorkerError, match="tied"):
        launch(_tied_worker, 1, timeout=60)
