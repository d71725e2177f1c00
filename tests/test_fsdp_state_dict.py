"""FSDP checkpoints: full and sharded state dicts of model and optimizer, resume, errors.

* FULL dict keys are the unwrapped model's keys; its optimizer state equals
  the single-process AdamW state (fp32 tolerance ATOL/RTOL).
* save -> stop -> load into a fresh process group -> continue gives
  bit-identical losses (same world size), for FULL and SHARDED checkpoints.
* a FULL checkpoint loads at another world size (losses within tolerance), and so
  does a ``save_sharded`` folder (model and optimizer) saved at 2 ranks, at 1, 3, 4.
"""

import shutil
import time

import pytest
import torch
import torch.distributed as tdist

from fsdp_helpers import gpt_batch, train_steps
from minifsdp import WorkerError, launch
from minifsdp.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, FullyShardedDataParallel as FSDP,
                           ModuleWrapPolicy, StateDictType, load_sharded, save_sharded)

ATOL, RTOL = 1e-5, 1e-4


def _model(**overrides):
    from minifsdp.models import Block, build_model

    return FSDP(build_model("gpt-tiny", seed=0, **overrides), auto_wrap_policy=ModuleWrapPolicy({Block}))


def _steps(model, opt, first, count):
    from minifsdp.models import lm_loss

    return train_steps(model, opt, gpt_batch, lm_loss, count, first)[0]


def _save_then_continue(path):
    """Train 2 steps, save FULL (rank 0 file) and SHARDED (one file per rank), train 2 more."""
    r = tdist.get_rank()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    _steps(model, opt, 0, 2)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True,
                                                                                       rank0_only=True),
                              FullOptimStateDictConfig(rank0_only=True)):
        full = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    if r == 0:
        torch.save(full, f"{path}/full.pt")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
    torch.save(sharded, f"{path}/sharded-rank{r}.pt")
    save_sharded(f"{path}/folder", model, opt)
    after = _steps(model, opt, 2, 2)
    return {"after": after, "full_keys": sorted(full["model"]), "full_empty_off_rank0": r != 0 and full == {
        "model": {}, "optim": {}}, "full_optim": full["optim"] if r == 0 else None,
        "sharded_types": sorted({type(v).__name__ for v in sharded["model"].values()})}


def _load_then_continue(path, kind):
    r = tdist.get_rank()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if kind == "folder":
        load_sharded(f"{path}/folder", model, opt)
        return _steps(model, opt, 2, 2)
    file = f"{path}/full.pt" if kind == "full" else f"{path}/sharded-rank{r}.pt"
    ckpt = torch.load(file, weights_only=False)
    sd_type = StateDictType.FULL_STATE_DICT if kind == "full" else StateDictType.SHARDED_STATE_DICT
    with FSDP.state_dict_type(model, sd_type):
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
    return _steps(model, opt, 2, 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    return path, launch(_save_then_continue, 2, str(path), timeout=120)


def test_full_state_dict_keys_and_optimizer_state_match_single_process(saved):
    from minifsdp.models import build_model, lm_loss

    _, outs = saved
    ref = build_model("gpt-tiny", seed=0)
    assert outs[0]["full_keys"] == sorted(ref.state_dict())  # unwrapped names, tied head included
    assert outs[1]["full_empty_off_rank0"]                    # rank0_only
    assert outs[0]["sharded_types"] == ["FlatShard"]          # no non-persistent buffers, no gather
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    train_steps(ref, opt, gpt_batch, lm_loss, 2)
    osd = outs[0]["full_optim"]
    names = [n for n, _ in ref.named_parameters()]
    assert osd["param_groups"][0]["params"] == names or sorted(osd["param_groups"][0]["params"]) == sorted(names)
    for name, p in ref.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(osd["state"][name][k], opt.state[p][k], atol=ATOL, rtol=RTOL, msg=name)
        assert osd["state"][name]["step"].item() == 2


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_resume_is_bit_exact(saved, kind):
    path, outs = saved
    resumed = launch(_load_then_continue, 2, str(path), kind, timeout=120)
    assert resumed[0] == outs[0]["after"], f"{kind}: {resumed[0]} != {outs[0]['after']}"  # exact equality


def test_full_checkpoint_loads_at_another_world_size(saved):
    path, outs = saved
    resumed = launch(_load_then_continue, 4, str(path), "full", timeout=120)
    torch.testing.assert_close(resumed[0], outs[0]["after"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_sharded_folder_loads_at_another_world_size(saved, n):
    path, outs = saved
    resumed = launch(_load_then_continue, n, str(path), "folder", timeout=120)
    torch.testing.assert_close(resumed[0], outs[0]["after"], atol=ATOL, rtol=RTOL)


def test_sharded_folder_resume_at_the_same_world_size_is_bit_exact(saved):
    path, outs = saved
    assert launch(_load_then_continue, 2, str(path), "folder", timeout=120)[0] == outs[0]["after"]


def test_one_ranks_sharded_file_at_another_world_size_names_the_fix(saved, tmp_path):
    path, _ = saved
    with pytest.raises(WorkerError, match=r"saved at another world size; load it with load_sharded\(dir\)"):
        launch(_load_then_continue, 1, str(path), "sharded", timeout=120)
    shutil.copy(f"{path}/folder/shard-0-of-2.pt", tmp_path / "shard-0-of-2.pt")  # rank 1's file left behind
    with pytest.raises(WorkerError, match=r"lacks the files of ranks \[1\] of 2; copy every rank's file"):
        launch(_load_folder, 1, str(tmp_path), timeout=60)


def _load_folder(path):
    load_sharded(path, _model())


def _state_dict_on_rank0_only():
    from minifsdp.fsdp import unit

    unit.ENTRY_TIMEOUT_S = 2.0
    model = _model()
    if tdist.get_rank() == 0:
        model.state_dict()


def test_state_dict_on_one_rank_errors_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"called on rank 0 but not on ranks \[1\].*call it on every rank"):
        launch(_state_dict_on_rank0_only, 2, timeout=60)
    assert time.monotonic() - start < 30


def _load_other_model(overrides):
    model = _model()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    other = _model(**overrides)
    with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
        other.load_state_dict(sd)


@pytest.mark.parametrize("overrides, message", [
    ({"n_layer": 3}, r"does not match this model: missing keys \['blocks.2.attn.c_attn.bias'"),
    ({"n_embd": 64, "n_head": 2}, r"'tok_emb.weight' has shape \(256, 32\) in the checkpoint but \(256, 64\)"),
])
def test_loading_another_models_checkpoint_names_the_keys(overrides, message):
    with pytest.raises(WorkerError, match=message):
        launch(_load_other_model, 2, overrides, timeout=60)


def _local_roundtrip():
    model = _model()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.data.zero_()
        model.load_state_dict(sd)
        again = model.state_dict()
    # units inside a plain parent (no root FSDP): the parent's state_dict still speaks unwrapped names
    torch.manual_seed(0)
    plain = torch.nn.Sequential(FSDP(torch.nn.Linear(3, 5)), torch.nn.ReLU(), FSDP(torch.nn.Linear(5, 2)))
    with FSDP.state_dict_type(plain, StateDictType.FULL_STATE_DICT):
        plain_sd = plain.state_dict()
    return sorted(sd)[:2], all(torch.equal(sd[k], again[k]) for k in sd), plain_sd


def test_local_state_dict_round_trip_and_units_in_a_plain_parent():
    keys, equal, plain_sd = launch(_local_roundtrip, 2, timeout=60)[0]
    assert keys == ["_flat_param", "_fsdp_wrapped_module.blocks.0._flat_param"] and equal
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)).state_dict()
    assert sorted(plain_sd) == sorted(ref) and all(torch.equal(plain_sd[k], ref[k]) for k in ref)


def _orig_params_folder(path, save):
    """use_orig_params=True: one optimizer state per original parameter, cut at the shard's boundaries."""
    from minifsdp.models import Block, build_model

    model = FSDP(build_model("gpt-tiny", seed=0 if save else 1), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if save:
        _steps(model, opt, 0, 2)
        save_sharded(path, model, opt)
    else:
        load_sharded(path, model, opt)
    return _steps(model, opt, 2, 2)


def test_use_orig_params_sharded_folder_loads_at_another_world_size(tmp_path):
    saved = launch(_orig_params_folder, 2, str(tmp_path), True, timeout=120)[0]
    resumed = launch(_orig_params_folder, 3, str(tmp_path), False, timeout=120)[0]
    torch.testing.assert_close(resumed, saved, atol=ATOL, rtol=RTOL)
