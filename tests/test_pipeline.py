"""minifsdp.pipeline without processes: plans, the validator, the paper timeline, partitioning.

Every plan the code produces for p <= 8 ranks, m <= 32 micro-batches and
v in {1, 2} stages per rank is validated (no deadlock, every send received,
forward before backward, activations freed) and its simulated bubble is held
to the formula: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
interleaved (m >= p), and below 1F1B's for zero bubble at 1F1B's peak memory.
"""

from __future__ import annotations

import pytest

from minifsdp import estimate, models
from minifsdp.pipeline import (SCHEDULES, Action, Plan, ScheduleError, balance_by_params, gpipe, gpt_layers,
                               interleaved_1f1b, lower, make_plan, one_f_one_b, simulate, split_gpt, validate,
                               zero_bubble)


def _plans():
    for p in range(1, 9):
        for m in range(1, 33):
            for name in SCHEDULES:
                for v in ((1,) if name in ("gpipe", "1f1b") else (1, 2)):
                    try:
                        yield name, p, m, v, make_plan(name, p, m, v)
                    except ValueError as e:  # interleaved: m must split into equal rounds
                        assert name != "gpipe" and "rounds" in str(e), (name, p, m, v, e)


def test_every_plan_is_valid_and_has_the_formula_bubble():
    seen = 0
    for name, p, m, v, plan in _plans():
        tl = validate(plan)
        seen += 1
        formula = estimate.pipeline_bubble_fraction(p, m, v)
        if name in ("gpipe", "1f1b") or (name == "interleaved" and m >= p):
            assert tl.bubble == pytest.approx(formula, abs=1e-12), (name, p, m, v)
        if name == "1f1b":
            assert tl.peak_activations == {r: min(m, p - r) for r in range(p)}
        if name == "gpipe":
            assert set(tl.peak_activations.values()) == {m}
        if name == "zero-bubble":
            base = validate(make_plan("1f1b" if v == 1 else "interleaved", p, m, v))
            assert tl.bubble <= base.bubble + 1e-12 and (p == 1 or tl.bubble < base.bubble), (p, m, v)
            assert max(tl.peak_activations.values()) <= max(base.peak_activations.values())
            if v == 1 and m >= p > 1:  # ZB-H1: a third of 1F1B's bubble, (p-1)/(3m+p-1)
                assert tl.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12), (p, m)
    assert seen > 1200


def test_one_f_one_b_by_hand():
    assert str(one_f_one_b(2, 3)) == "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2"
    assert str(lower(gpipe(2, 1))) == "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0"


def test_table_is_torchgpipe_style():
    assert gpipe(2, 2).table() == ("       0  1  2  3  4  5  6  7  8\n"
                                   "rank 0 |F0|F1|  |  |  |B0   |B1   |\n"
                                   "rank 1 |  |F0|F1|B0   |B1   |  |  |")
    assert "F0b" in interleaved_1f1b(2, 2, 2).table()  # second stage of a rank: suffix b


def test_zero_bubble_splits_backward():
    plan = zero_bubble(2, 2)
    kinds = {a.kind for acts in plan.order.values() for a in acts}
    assert kinds == {"F", "I", "W"}


def test_interleaved_needs_equal_rounds():
    with pytest.raises(ValueError, match="multiple of 4 micro-batches"):
        interleaved_1f1b(4, 9, 2)


def test_action_parse_roundtrip():
    for text in ("1F3", "0SEND_F12", "10RECV_B0", "2W7"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="cannot read action"):
        Action.parse("F3")


# --------------------------------------------------------------------------
# The validator names what is wrong
# --------------------------------------------------------------------------
def _plan(order: dict[int, str], p: int = 2, m: int = 2) -> Plan:
    return Plan("hand-made", p, m, 1, {r: [Action.parse(t) for t in text.split()] for r, text in order.items()})


def test_validator_backward_before_forward():
    with pytest.raises(ScheduleError, match=r"rank 0 runs 0B1 \(position 2\) before 0F1: a backward needs"):
        validate(_plan({0: "0F0 0B0 0B1 0F1", 1: "1F0 1B0 1F1 1B1"}))


def test_validator_missing_receive():
    good = str(lower(gpipe(2, 2))).splitlines()
    order = {r: line.split(": ")[1] for r, line in enumerate(good)}
    order[1] = order[1].replace("1RECV_F1 ", "")
    with pytest.raises(ScheduleError) as err:
        validate(_plan(order))
    assert err.value.problems == ["rank 0 sends 0SEND_F1 but rank 1 has no matching 1RECV_F1",
                                  "rank 1 runs 1F1 (position 2) before 1RECV_F1: its input was never received"]


def test_validator_cycle():
    # rank 0 waits for a gradient before sending the activation that would produce it.
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at 0RECV_B0 for rank 1, rank 1 waits at "
                                            r"1RECV_F0 for rank 0 \(cycle 0 -> 1 -> 0\)"):
        validate(_plan({0: "0F0 0RECV_B0 0B0 0SEND_F0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}, m=1))


def test_validator_missing_and_misplaced_actions():
    with pytest.raises(ScheduleError, match="stage 1 never runs the backward of micro-batch 1"):
        validate(_plan({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0"}))
    with pytest.raises(ScheduleError, match=r"rank 0 runs 1F0 but stage 1 lives on rank 1"):
        validate(_plan({0: "0F0 1F0 0B0", 1: "1B0"}, m=1))
    with pytest.raises(ScheduleError, match="runs the forward of micro-batch 0 2 times"):
        validate(_plan({0: "0F0 0F0 0B0", 1: "1F0 1B0"}, m=1))


def test_simulate_reports_peak_and_makespan():
    tl = simulate(one_f_one_b(4, 8))
    assert tl.peak_activations == {0: 4, 1: 3, 2: 2, 3: 1}
    assert tl.makespan == 3 * (8 + 4 - 1)  # (m + p - 1) slots of F + B


# --------------------------------------------------------------------------
# Partitioning a GPT
# --------------------------------------------------------------------------
def test_balance_by_params_minimises_the_largest_stage():
    assert balance_by_params([8, 1, 1, 1, 1, 8], 3) == [1, 4, 1]
    assert balance_by_params([1, 1, 1, 1], 4) == [1, 1, 1, 1]


def test_split_gpt_keeps_names_and_computes_the_same():
    import torch

    model = models.build_model("gpt-tiny", n_layer=4)
    parts = split_gpt(model, 3, balance=[2, 2, 2])
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    x = torch.randint(0, 256, (2, 8))
    h = x
    for part in parts:
        h = part(h)
    assert torch.equal(h, model(x))
    auto = split_gpt(model, 3)
    assert sum(len(list(p.parameters())) for p in auto) == len(list(model.parameters()))
    assert len(gpt_layers(model)) == 6


def test_split_gpt_bad_input_names_the_fix():
    model = models.build_model("gpt-tiny")  # 4 layers: embed, 2 blocks, head
    with pytest.raises(ValueError, match=r"must have 2 positive entries summing to the 4 layers"):
        split_gpt(model, 2, balance=[1, 2])
    with pytest.raises(ValueError, match="5 stages but the model has only 4 layers"):
        split_gpt(model, 5)
    with pytest.raises(ValueError, match="tie_embeddings=False"):
        split_gpt(models.build_model("gpt-tiny", tie_embeddings=True), 2)


def test_validator_message_order():
    # Both messages arrive, nothing deadlocks, but NCCL would pair 0SEND_F0 with 1RECV_F1.
    with pytest.raises(ScheduleError, match=r"rank 0 sends 0SEND_F0 to rank 1 before 0SEND_F1, but rank 1 receives "
                                            r"0SEND_F1 first"):
        validate(_plan({0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                        1: "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1"}))


def test_bench_pairs_each_schedule_with_torch(tmp_path):
    from minifsdp import bench
    from minifsdp.train import validate as validate_config

    assert set(bench.PRESETS["pipeline"]) == {f"pp@{s}:torch-pp@{s}" for s in SCHEDULES}
    cfg = bench.BenchConfig(model="gpt-small", out=str(tmp_path))
    train_cfg = bench._config(cfg, "torch-pp@interleaved", 4, False, 2, str(tmp_path))
    assert (train_cfg.strategy, train_cfg.pp, train_cfg.micro_batches, train_cfg.virtual_stages) == ("torch-pp", 4, 8, 2)
    validate_config(train_cfg)
    with pytest.raises(ValueError, match="unknown option 'FULL_SHARD' for pp"):
        bench.Side.parse("pp@FULL_SHARD")


def test_every_schedule_on_one_rank_matches_autograd():
    """Two stages on one rank (no process group: they hand over in memory); the I/W split included,
    on a layer whose own parameter acts in its forward and a layer that never runs."""
    import copy

    import torch
    from torch import nn

    from minifsdp.pipeline import PipelineStage, ScheduleFromPlan

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.lin(x).tanh() * self.scale

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    ref = [Scaled(), Scaled()]
    loss_fn(ref[1](ref[0](x)), y).backward()
    for name in ("interleaved", "zero-bubble"):
        mods = copy.deepcopy(ref)
        for m in mods:
            m.zero_grad(set_to_none=True)
        stages = [PipelineStage(m, i, 2, "cpu") for i, m in enumerate(mods)]
        losses = []
        out = ScheduleFromPlan(stages, make_plan(name, 1, 4, 2), loss_fn=loss_fn).step(x, target=y, losses=losses)
        assert torch.allclose(out, ref[1](ref[0](x)), atol=1e-6) and len(losses) == 4
        for m, r in zip(mods, ref):
            for (n, p), q in zip(m.named_parameters(), r.parameters()):
                assert (p.grad is None) == (q.grad is None), (name, n)
                if q.grad is not None:
                    assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), (name, n)
