"""The trainer: the parity contract (every strategy reproduces `single`'s losses), its outputs, bad input, torchrun."""

import json
import os
import subprocess
import sys

import pytest

from minifsdp.train import TrainConfig, main, parse_args, train

# fp32, a few AdamW steps on gpt-tiny: reductions happen in a different order
# across ranks, so losses agree to ~1e-6 relative, not bit for bit.
LOSS_RTOL = 1e-5


def _run(tmp_path, **kw):
    kw.setdefault("write_plots", False)  # test_outputs asks for the plots
    cfg = TrainConfig(model="gpt-tiny", steps=4, batch_size=8, quiet=True, out=str(tmp_path / kw.get("strategy", "single")),
                      **kw)
    return train(cfg)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), strategy="single", world_size=1, track_memory=True)


@pytest.mark.parametrize("strategy,world_size,grad_accum,extra", [
    ("ddp-naive", 2, 1, {}), ("ddp", 2, 1, {}), ("ddp", 4, 1, {}), ("ddp", 2, 2, {}), ("torch-ddp", 2, 1, {}),
    ("zero1", 2, 1, {}), ("zero2", 4, 1, {}),
    ("fsdp", 2, 2, {}), ("fsdp", 4, 1, {"sharding_strategy": "HYBRID_SHARD"}),
    ("fsdp", 2, 1, {"sharding_strategy": "SHARD_GRAD_OP", "wrap": "none"}), ("torch-fsdp", 2, 1, {}),
    ("torch-zero1", 2, 1, {}), ("torch-fsdp", 4, 1, {"sharding_strategy": "HYBRID_SHARD"}), ("torch-fsdp2", 2, 1, {}),
    ("fsdp2", 1, 1, {}), ("fsdp2", 2, 2, {}), ("fsdp2", 4, 1, {"sharding_strategy": "HYBRID_SHARD"}),
    ("fsdp2", 2, 1, {"sharding_strategy": "SHARD_GRAD_OP", "wrap": "none"}),
])
def test_parity_with_single(tmp_path, single, strategy, world_size, grad_accum, extra):
    m = _run(tmp_path, strategy=strategy, world_size=world_size, grad_accum=grad_accum, track_memory=False, **extra)
    assert len(m["losses"]) == 4
    for a, b in zip(m["losses"], single["losses"]):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (m["losses"], single["losses"])
    assert m["losses"][-1] < m["losses"][0]  # it trains


def test_outputs(tmp_path, single):
    out = tmp_path / "single"
    m = _run(tmp_path, strategy="single", world_size=1, write_plots=True)
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["strategy"] == "single" and metrics["world_size"] == 1
    assert metrics["losses"] == m["losses"] and len(metrics["step_time_s"][0]) == 4
    assert metrics["peak_bytes"][0] > 0
    cats = metrics["peak_by_category"][0]
    assert cats["parameters"] == 4 * metrics["n_params"]  # fp32 parameters, exactly
    events = json.load(open(out / "trace.json"))["traceEvents"]
    assert {"forward", "backward", "optimizer"} <= {e["name"] for e in events if e["ph"] == "X"}
    assert (out / "timeline.png").stat().st_size > 1000 and (out / "memory.png").stat().st_size > 1000


def test_ddp_records_bytes_per_step(tmp_path):
    m = _run(tmp_path, strategy="ddp", world_size=2, track_memory=False)
    # all_reduce volume is 2 x the gradient bytes (fp32) every step
    assert m["bytes_per_step"][0]["all_reduce"] == pytest.approx(2 * 4 * m["n_params"])


@pytest.mark.parametrize("argv,message", [
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--strategy", "ddp", "--world-size", "3", "--batch-size", "8"], "multiple of world size x grad accum = 3"),
    (["--out", "/proc/forbidden"], "is not writable"),
    (["--strategy", "torch-fsdp2", "--sharding-strategy", "NO_SHARD"], "choose one of: FULL_SHARD, SHARD_GRAD_OP"),
    (["--strategy", "fsdp", "--sharding-strategy", "HYBRID_SHARD", "--world-size", "3", "--batch-size", "6"],
     "use an even --world-size"),
])
def test_bad_input_one_line_error(argv, message, capsys):
    """``main`` as the command line runs it, in this process (tests/test_bad_input.py has every row)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    said = capsys.readouterr().err + (exit_.value.code if isinstance(exit_.value.code, str) else "")
    assert exit_.value.code not in (0, None)
    assert message in said and "Traceback" not in said, said


def test_bad_input_from_the_command_line():
    """The same from a shell: a non-zero exit and one line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "minifsdp.train", "--strategy", "ddp", "--world-size", "3",
                           "--batch-size", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "multiple of world size x grad accum = 3" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_parse_args_defaults():
    assert parse_args([]).world_size == 1 and parse_args(["--strategy", "ddp"]).world_size == 2


def test_torchrun_two_processes(tmp_path, single):
    out = tmp_path / "torchrun"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "minifsdp.train", "--strategy", "ddp", "--model", "gpt-tiny", "--steps", "4",
                           "--batch-size", "8", "--out", str(out), "--no-memory"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(out / "metrics.json"))
    assert metrics["world_size"] == 2
    for a, b in zip(metrics["losses"], single["losses"]):
        assert a == pytest.approx(b, rel=LOSS_RTOL)
