"""FSDP2 recipes (tests/fsdp2_recipes.py) under torch's fully_shard and minifsdp's: same numbers.

Each recipe is user code taking the fully_shard namespace; it runs on 2 ranks under
``torch.distributed.fsdp`` and under ``minifsdp.fsdp`` (one launch each, every recipe inside).
Both must match one process on the whole global batch (fp32: relative 1e-5; bf16: fsdp2_recipes.BF16_TOL
says which tolerance and why), and minifsdp's must match torch's: losses, every full gradient
(``p.grad.full_tensor()``) of the first and last step, every parameter after, and the bytes per step.

The checkpoint recipe trains 3 steps at 2 ranks and saves (torch.distributed.checkpoint of
get_model_state_dict / get_optimizer_state_dict); a 4-rank run loads it (DCP reshards on read),
checks the state bit for bit and saves it again; a 1-rank run loads that, checks, saves; a 2-rank run
loads that and continues: bit-identical to the uninterrupted 6-step run at 2 ranks (the same
arithmetic). The 4- and 1-rank runs also continue training: within fp32 tolerance of the
uninterrupted run (another world size sums the gradients in another order).
"""
from __future__ import annotations

import pytest

from fsdp2_recipes import (BF16_TOL, FP32_TOL, PREFETCH_LAYERS, RECIPES, RTOL, assert_close, assert_equal,
                           assert_parity, checkpoint_load_and_continue, checkpoint_train_and_save, counted,
                           expected_bytes, namespace, plain_run)
from minifsdp import launch

IMPLS = ["torch", "minifsdp"]
SAVE_AT, TOTAL = 3, 6   # the checkpoint recipe saves after step 3 of the 6 per_block_then_root trains


def _recipes_at_2(impl: str, ckpt: str) -> dict:
    """Every recipe at 2 ranks (with the bytes it moved per step), then the checkpoint recipe's save."""
    fs = namespace(impl)
    out = {}
    for name, recipe in RECIPES.items():
        with counted(fs) as tracer:
            out[name] = recipe(fs)
        steps = len(out[name]["losses"])
        out[name]["bytes_per_step"] = {op: b / steps for op, b in tracer.trace.bytes_by_op(within="step").items()}
    out["checkpoint"] = checkpoint_train_and_save(fs, f"{ckpt}/w2", SAVE_AT)
    return out


def _load_at(impl: str, ckpt: str, src: str, dst: str | None, first: int, steps: int,
             foreign: tuple[str, str] | None = None) -> dict:
    fs = namespace(impl)
    out = checkpoint_load_and_continue(fs, f"{ckpt}/{src}", first, steps, f"{ckpt}/{dst}" if dst else None)
    if foreign is not None:  # a checkpoint the other implementation wrote
        other_impl, other_path = foreign
        out["foreign"] = checkpoint_load_and_continue(namespace(other_impl), other_path, first, steps)
    return out


_RUNS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(impl) -> {"w2": rank outputs, "w4", "w1", "w2_resumed"}; each implementation launched once."""
    def get(impl: str) -> dict:
        if impl not in _RUNS:
            ckpt = str(tmp_path_factory.mktemp(f"dcp_{impl}"))
            steps = (SAVE_AT, TOTAL - SAVE_AT)
            run = {"ckpt": ckpt, "w2": launch(_recipes_at_2, 2, impl, ckpt, timeout=150, threads_per_rank=1)}
            # minifsdp's 4-rank run also loads torch's 2-rank checkpoint; its 2-rank resume also loads the
            # checkpoint minifsdp wrote at 1 rank into torch's fully_shard
            foreign4 = ("torch", f"{get('torch')['ckpt']}/w2") if impl == "minifsdp" else None
            foreign2 = ("torch", f"{ckpt}/w1") if impl == "minifsdp" else None
            run["w4"] = launch(_load_at, 4, impl, ckpt, "w2", "w4", *steps, foreign4, timeout=90, threads_per_rank=1)
            run["w1"] = launch(_load_at, 1, impl, ckpt, "w4", "w1", *steps, timeout=90, threads_per_rank=1)
            run["w2_resumed"] = launch(_load_at, 2, impl, ckpt, "w1", None, *steps, foreign2, timeout=90,
                                       threads_per_rank=1)
            _RUNS[impl] = run
        return _RUNS[impl]
    return get


@pytest.fixture(scope="module")
def reference():
    """One process, whole batch: per_block_then_root's 6 steps, the 3-step runs, the 4-layer model, bf16."""
    return {"per_block_then_root": plain_run(TOTAL), "accumulate_without_sync": plain_run(3),
            "explicit_prefetch": plain_run(3, n_layer=PREFETCH_LAYERS),
            "bf16_mixed_precision": plain_run(3, bf16=True)}


def _tolerances(recipe: str) -> dict[str, float]:
    return BF16_TOL if recipe == "bf16_mixed_precision" else FP32_TOL


def _same_on_every_rank(rank_outs: list[dict], recipe: str) -> dict:
    first = rank_outs[0][recipe]
    for r, out in enumerate(rank_outs[1:], 1):
        assert_equal(out[recipe]["losses"], first["losses"], f"{recipe}: rank {r}'s global losses")
        assert_equal(out[recipe]["grads"], first["grads"], f"{recipe}: rank {r}'s full gradients")
    return first


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("impl", IMPLS)
def test_recipe_matches_one_process(impl, recipe, runs, reference):
    got = _same_on_every_rank(runs(impl)["w2"], recipe)
    assert_parity(got, reference[recipe], _tolerances(recipe), f"{impl} {recipe}")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_minifsdp_equals_torch(recipe, runs):
    theirs = _same_on_every_rank(runs("torch")["w2"], recipe)
    ours = _same_on_every_rank(runs("minifsdp")["w2"], recipe)
    assert_parity(ours, theirs, _tolerances(recipe), f"{recipe}: minifsdp vs torch")
    assert ours["bytes_per_step"] == theirs["bytes_per_step"], f"{recipe}: bytes per step per collective"


@pytest.mark.parametrize("impl", IMPLS)
def test_recipe_bytes_follow_the_per_parameter_formula(impl, runs):
    """Each recipe's collectives per step per rank, from the parameter shapes (fsdp2_recipes.expected_bytes)."""
    got = {name: runs(impl)["w2"][0][name]["bytes_per_step"] for name in RECIPES}
    not_root = lambda g: g != "root"  # noqa: E731 - reshard_after_forward=None: every group but the root
    assert got["per_block_then_root"] == expected_bytes(2, not_root)
    assert got["bf16_mixed_precision"] == expected_bytes(2, not_root, param_elem=2, grad_elem=4)
    # explicit prefetch gathers each group once in forward and once in backward (root included): never twice
    assert got["explicit_prefetch"] == expected_bytes(2, lambda g: True, n_layer=PREFETCH_LAYERS)
    # accumulation: a forward (and a backward all-gather) per micro-batch, one reduce-scatter per step
    assert got["accumulate_without_sync"] == expected_bytes(2, not_root, forwards=2, syncs=1)


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_2_to_4_to_1_to_2(impl, runs):
    run = runs(impl)
    uninterrupted = run["w2"][0]["per_block_then_root"]
    saved = run["w2"][0]["checkpoint"]
    assert_equal(saved["losses"], uninterrupted["losses"][:SAVE_AT], f"{impl}: the first {SAVE_AT} steps")
    for world in ("w4", "w1", "w2_resumed"):
        for r, out in enumerate(run[world]):
            assert_equal(out["loaded_params"], saved["saved_params"], f"{impl} {world} rank {r}: parameters loaded")
            assert_equal(out["loaded_optim"], saved["saved_optim"], f"{impl} {world} rank {r}: AdamW state loaded")
    for world in ("w4", "w1"):   # another world size sums gradients in another order: fp32 tolerance
        out = run[world][0]
        assert_close(out["losses"], uninterrupted["losses"][SAVE_AT:], RTOL, f"{impl} {world}: continued losses")
        assert_close(out["params"], uninterrupted["params"], RTOL, f"{impl} {world}: final parameters")
    resumed = run["w2_resumed"][0]   # the same arithmetic as the uninterrupted run: bit for bit
    assert_equal(resumed["losses"], uninterrupted["losses"][SAVE_AT:], f"{impl}: resumed losses")
    assert_equal(resumed["grads"], uninterrupted["grads"], f"{impl}: resumed last gradients")
    assert_equal(resumed["params"], uninterrupted["params"], f"{impl}: resumed final parameters")


def test_checkpoints_cross_between_torch_and_minifsdp(runs):
    """minifsdp at 4 ranks loads torch's 2-rank checkpoint; torch at 2 ranks loads the one minifsdp
    wrote at 1 rank: the state arrives bit for bit and training continues within fp32 tolerance."""
    mini, theirs = runs("minifsdp"), runs("torch")
    uninterrupted = theirs["w2"][0]["per_block_then_root"]
    from_torch = mini["w4"][0]["foreign"]
    assert_equal(from_torch["loaded_params"], theirs["w2"][0]["checkpoint"]["saved_params"], "torch -> minifsdp")
    assert_equal(from_torch["loaded_optim"], theirs["w2"][0]["checkpoint"]["saved_optim"], "torch -> minifsdp")
    assert_close(from_torch["losses"], uninterrupted["losses"][SAVE_AT:], RTOL, "torch -> minifsdp: losses")
    to_torch = mini["w2_resumed"][0]["foreign"]
    assert_equal(to_torch["loaded_params"], mini["w1"][0]["loaded_params"], "minifsdp -> torch")
    assert_equal(to_torch["loaded_optim"], mini["w1"][0]["loaded_optim"], "minifsdp -> torch")
    assert_close(to_torch["losses"], uninterrupted["losses"][SAVE_AT:], RTOL, "minifsdp -> torch: losses")
