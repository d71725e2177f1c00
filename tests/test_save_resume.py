"""Save and resume in the trainer (``--save-every``, ``--resume``; minifsdp.save_resume).

* every record in ``STRATEGIES`` (minifsdp's and torch's) trains 4 steps saving every 2, then a fresh run
  resumes from step 2: its losses at steps 2 and 3 equal the uninterrupted run's exactly (fp32, same
  layout; step 3's loss depends on the optimizer state resumed, step 2's on the parameters);
* the checkpoint is DCP's file set (one ``.distcp`` per rank, ``.metadata``) keyed by the single model's
  parameter names, whatever the strategy (pieces and stages included);
* a checkpoint saved at 2 ranks resumes at 1 and at 4 (ddp, zero2, fsdp, fsdp2): the losses match the
  uninterrupted run within the parity tolerance of tests/test_train.py;
* a run killed (SIGKILL) in the middle of a save leaves the previous checkpoint, which is what a resume
  loads; the half-written folder is refused;
* fp16: the gradient scaler's state (scale, growth tracker) resumes, and so does the RNG state;
* a resume into another model, strategy, tensor-parallel split or precision is refused before anything runs.
"""

import dataclasses
import os
import signal

import pytest
import torch

from minifsdp import LaunchError, launch
from minifsdp.launch import default_threads
from minifsdp.records import TrainConfig
from minifsdp.save_resume import LATEST, check_resume, resolve
from minifsdp.strategies import STRATEGIES

LOSS_RTOL = 1e-5  # tests/test_train.py's parity tolerance
# What each record needs to run on 2 ranks (the rest: data parallel over both, pp = tp = cp = ep = 2)
FLAGS = {"3d": dict(dp=1, pp=2, tp=1), "pp+dp": dict(pp=2, dp=1), "fsdp+tp": dict(dp=1, tp=2),
         "torch-fsdp+tp": dict(dp=1, tp=2), "ep": dict(model="gpt-moe-tiny")}
ANOTHER_WORLD = ("ddp", "zero2", "fsdp", "fsdp2")
STEPS, SAVED = 4, 2  # the uninterrupted run's steps; the checkpoint a resume starts from (step_2)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The runs in this process (single) on one thread, as launch's workers: two cores shared by many ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(name: str, root: str, world_size: int = 2, **kw) -> TrainConfig:
    flags = dict(world_size=1 if name == "single" else world_size, steps=STEPS, track_memory=False,
                 write_plots=False, quiet=True)
    return TrainConfig(strategy=name, **{"out": os.path.join(root, name), **flags, **FLAGS.get(name, {}), **kw})


def _resumed(cfg: TrainConfig, root: str, world_size: int) -> TrainConfig:
    """The run that resumes ``cfg``'s checkpoint of step 2, at ``world_size`` ranks, into a folder of its own."""
    return dataclasses.replace(cfg, world_size=world_size, save_every=0, out=f"{cfg.out}-resumed-{world_size}",
                               resume=os.path.join(cfg.out, "checkpoints", f"step_{SAVED}"))


def _save_then_resume(names: list[str], root: str, save: bool = True) -> dict:
    """On every rank, for each record: (save) 4 steps saving every 2; then a fresh run from step 2."""
    from minifsdp import dist, train
    from minifsdp.tensor_parallel import destroy_model_parallel

    out = {}
    for name in names:
        cfg = _cfg(name, root, save_every=SAVED)
        first = train.run_rank(cfg) if save else None
        destroy_model_parallel()  # the next record may split the world another way
        again = _resumed(cfg, root, dist.world_size())
        train.validate(again)
        out[name] = (first, train.run_rank(again))
        destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (the uninterrupted run's result, the resumed run's result); single in this process."""
    root = str(tmp_path_factory.mktemp("save_resume"))
    names = [n for n in STRATEGIES if n != "single"]
    results = launch(_save_then_resume, 2, names, root, timeout=600)[0]
    results.update(_save_then_resume(["single"], root))
    return root, results


def test_every_record_resumes_bit_exact(runs):
    _, results = runs
    assert set(results) == set(STRATEGIES)  # no record left without a save/resume path
    for name, (first, resumed) in results.items():
        assert resumed["first_step"] == SAVED and len(first["losses"]) == STEPS, name
        assert resumed["losses"] == first["losses"][SAVED:], f"{name}: {resumed['losses']} != {first['losses']}"


@pytest.mark.parametrize("name", ["fsdp", "fsdp2", "zero2", "pp", "tp", "ep", "torch-fsdp"])
def test_checkpoint_is_a_dcp_file_set_keyed_by_the_model_names(runs, name):
    from torch.distributed.checkpoint import FileSystemReader

    from minifsdp.save_resume import model_shapes, read_meta

    root, _ = runs
    path = os.path.join(root, name, "checkpoints", f"step_{SAVED}")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json"} <= set(os.listdir(path))
    assert read_meta(path)["step"] == SAVED and read_meta(path)["world_size"] == 2
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    shapes = model_shapes(_cfg(name, root).model)
    model = {k[len("model."):]: tuple(v.size) for k, v in saved.items() if k.startswith("model.")}
    assert model == shapes  # every parameter, under its single-model name, at its whole shape
    assert {k.split(".")[0] for k in saved} >= {"model", "optim", "rank0", "rank1"}  # RNG: every rank


def _resume_at(names: list[str], root: str) -> dict:
    return _save_then_resume(names, root, save=False)


@pytest.mark.parametrize("world_size", [1, 4])
def test_resume_at_another_data_parallel_world_size(runs, world_size):
    root, results = runs
    names = ANOTHER_WORLD if world_size == 1 else ("fsdp", "fsdp2")
    resumed = launch(_resume_at, world_size, list(names), root, timeout=300)[0]
    for name in names:
        _, again = resumed[name]
        expected = results[name][0]["losses"][SAVED:]
        assert again["losses"] == pytest.approx(expected, rel=LOSS_RTOL), (name, world_size)


def _killed_in_save(root: str) -> None:
    """single, saving after each step; the second save dies (SIGKILL) after every file of step_2.tmp is
    written, before the rename that commits it."""
    from minifsdp import save_resume, train

    commit = save_resume._commit

    def die_on_second(tmp: str, final: str, ckpt_root: str, step: int) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        commit(tmp, final, ckpt_root, step)

    save_resume._commit = die_on_second
    train.run_rank(_cfg("single", root, save_every=1))


def test_a_run_killed_during_save_resumes_from_the_previous_checkpoint(runs, tmp_path):
    from minifsdp import train

    _, results = runs
    with pytest.raises(LaunchError):
        launch(_killed_in_save, 1, str(tmp_path), timeout=120)
    ckpts = tmp_path / "single" / "checkpoints"
    half = ckpts / "step_2.tmp"
    assert {".metadata", "meta.json", "__0_0.distcp"} <= set(os.listdir(half))  # everything but the commit
    assert not (ckpts / "step_2").exists() and (ckpts / LATEST).read_text().strip() == "step_1"
    assert resolve(str(ckpts)) == str(ckpts / "step_1")
    cfg = _cfg("single", str(tmp_path), resume=str(ckpts), out=str(tmp_path / "again"))
    with pytest.raises(ValueError, match="half-written checkpoint.*takes the latest complete one"):
        train.validate(dataclasses.replace(cfg, resume=str(half)))
    train.validate(cfg)
    # the threads the uninterrupted run had (one of 2 ranks): bit-exact needs the same reduction order
    resumed = launch(train.run_rank, 1, cfg, threads_per_rank=default_threads(2), timeout=120)[0]
    assert resumed["first_step"] == 1 and resumed["losses"] == results["single"][0]["losses"][1:]  # steps 1-3


def _read(path: str, template: dict) -> dict:
    """``template``'s entries of the checkpoint at ``path``, read in this process."""
    import torch.distributed.checkpoint as dcp

    dcp.load(template, checkpoint_id=path, no_dist=True)
    return template


def _scaler_state(path: str) -> dict:
    keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    return _read(path, {"scaler": dict.fromkeys(keys, 0.0)})["scaler"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_rng_state_resumes(runs):
    from minifsdp import train

    root, _ = runs
    path = os.path.join(root, "single", "checkpoints", f"step_{SAVED}")
    saved = _read(path, {"rank0": {"rng_cpu": torch.get_rng_state()}})["rank0"]["rng_cpu"]
    before = torch.get_rng_state()
    try:
        torch.manual_seed(1234)  # anything but the saved stream
        assert not torch.equal(torch.get_rng_state(), saved)
        train.run_rank(_cfg("single", root, out=os.path.join(root, "rng"), resume=path))
        assert torch.equal(torch.get_rng_state(), saved)  # set at resume; a dropout-free step draws nothing
    finally:
        torch.set_rng_state(before)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # _scaler_state reads in this one process
def test_fp16_gradient_scaler_state_resumes(tmp_path):
    from minifsdp import train

    cfg = _cfg("single", str(tmp_path), steps=3, save_every=1, precision="fp16")
    first = train.run_rank(cfg)
    again = dataclasses.replace(cfg, out=str(tmp_path / "again"), resume=str(tmp_path / "single/checkpoints/step_1"))
    train.validate(again)
    resumed = train.run_rank(again)
    assert resumed["losses"] == first["losses"][1:]
    saved = _scaler_state(str(tmp_path / "single/checkpoints/step_3"))
    assert saved == _scaler_state(str(tmp_path / "again/checkpoints/step_3"))  # a scaler not resumed: 2 steps' worth
    assert (saved["scale"], saved["_growth_tracker"]) != (2.0 ** 16, 0)  # not the initial state: three steps taken


@pytest.mark.parametrize("change, message", [
    (dict(model="gpt-mini"), "holds --model gpt-tiny: resume with --model gpt-tiny"),
    (dict(strategy="ddp"), "saved by --strategy fsdp: resume with --strategy fsdp"),
    (dict(steps=2), "at step 2 already: pass --steps > 2"),
    (dict(precision="fp16"), "saved with --precision fp32.*resume with --precision fp32"),
    (dict(strategy="tp", tp=1, world_size=1, resume="tp"), "split 2 ways.*resume with --tp 2"),
    (dict(resume="nowhere"), "not a folder: give a checkpoints folder"),
    (dict(resume=""), "holds no complete checkpoint"),
    (dict(save_every=-1), "--save-every must be >= 0"),
])
def test_a_resume_it_cannot_load_is_refused_before_it_starts(runs, change, message):
    root, _ = runs
    saved_by = change.pop("resume", "fsdp")
    resume = {"nowhere": os.path.join(root, "nowhere"), "": root}.get(
        saved_by, os.path.join(root, saved_by, "checkpoints", f"step_{SAVED}"))
    cfg = _cfg(change.get("strategy", "fsdp"), root, resume=resume, **{
        k: v for k, v in change.items() if k != "strategy"})
    with pytest.raises(ValueError, match=message) as err:
        check_resume(cfg, STRATEGIES[cfg.strategy])
    assert "\n" not in str(err.value)
