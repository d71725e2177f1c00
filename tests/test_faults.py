"""Each way a rank fails ends the run soon, with one message naming the rank and the cause, and leaves nothing.

A rank raises, runs out of memory, is killed by a signal, is stuck while its peers wait, or
calls a different collective than its peers: for each, ``launch`` ends within a bound (the
ceilings here are generous behaviour bounds, far above what it takes, never timings), the
message names the rank and the cause, no worker process survives, and the next launch from
the same process works (what a notebook's next cell needs). The same faults under
``torchrun``: torchrun's own report, and our one line before it. docs/faults.md has the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from minifsdp import LaunchTimeout, WorkerError, comm, dist, faults, flight_recorder, launch

REPO = Path(__file__).resolve().parents[1]


def _train_steps(fault: str | None, steps: int = 4) -> float:
    """A training loop in miniature: one all-reduce a step, and the fault hook a trainer calls."""
    t = torch.ones(4)
    for step in range(steps):
        faults.inject(step, fault)
        comm.all_reduce(t)
    return t.sum().item()


def _different_shapes_at_step_2() -> None:
    """Rank 1 all-reduces 6 numbers where rank 0 all-reduces 4."""
    for step in range(3):
        comm.all_reduce(torch.ones(6 if step == 2 and dist.rank() == 1 else 4))


def _workers() -> set[int]:
    """This process's live children, but for the forkserver and resource tracker that launch keeps."""
    import psutil

    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not any(
                    k in " ".join(child.cmdline()) for k in ("forkserver", "resource_tracker")):
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _fails(expected: type, ceiling_s: float, fn, *args, **kwargs) -> tuple[str, float]:
    """Run a launch that must fail; return its message and seconds, after checking it left nothing behind."""
    before = _workers()
    start = time.perf_counter()
    with pytest.raises(expected) as info:
        launch(fn, 2, *args, **kwargs)
    seconds = time.perf_counter() - start
    assert seconds < ceiling_s, f"the launch took {seconds:.1f} s to end"
    assert _workers() - before == set(), "a worker outlived its launch"
    assert launch(dist.rank, 2, timeout=60) == [0, 1], "the next launch from this process failed"
    print(f"ended in {seconds:.1f} s: {info.value}")
    return str(info.value), seconds


def test_a_rank_that_raises():
    message, _ = _fails(WorkerError, 60, _train_steps, "1:raise:2", timeout=60)
    first = message.splitlines()[0]
    assert first.startswith("rank 1 failed: RuntimeError: MINIFSDP_FAULT injected a failure at step 2")
    assert "(in _train_steps, line " in first  # the line of the caller's code


def test_a_rank_out_of_memory_names_the_fix():
    message, _ = _fails(WorkerError, 60, _train_steps, "1:oom:2", timeout=60)
    first = message.splitlines()[0]
    assert first.startswith("rank 1 ran out of memory (tried to allocate") and "in _train_steps" in first
    assert "smaller batch" in first and "sharding" in first and "activation checkpointing" in first


@pytest.mark.parametrize("mode, signal_name, usual_cause", [
    ("kill", "SIGKILL", "out-of-memory killer"),
    ("term", "SIGTERM", "scheduler"),
    ("segv", "SIGSEGV", "segmentation fault"),
])
def test_a_rank_killed_by_a_signal(mode, signal_name, usual_cause, monkeypatch):
    monkeypatch.setenv("MINIFSDP_FAULT", f"1:{mode}:2")  # as a trainer's user sets it: launch hands it to the workers
    message, _ = _fails(WorkerError, 60, _train_steps, None, timeout=60)
    first = message.splitlines()[0]
    code = {"kill": -9, "term": -15, "segv": -11}[mode]
    assert first.startswith(f"rank 1 was killed by signal {signal_name} (exit code {code})"), first
    assert usual_cause in first
    if mode == "segv":  # a crash: faulthandler's stack says where, in the caller's code
        assert "in _train_steps" in first


def test_a_stuck_rank_is_named_with_the_collective_its_peer_waits_in():
    message, seconds = _fails(LaunchTimeout, 60, _train_steps, "1:hang:2", timeout=4)
    first = message.splitlines()[0]
    assert seconds >= 4  # it waited for the deadline, not for the 10^6 s sleep (the ceiling above)
    assert "rank 1 is stuck outside any collective (in _train_steps" in first
    assert "rank 0 waits in all_reduce #3 (float32[4])" in first


def test_ranks_in_different_collectives_at_the_deadline():
    """The classic desync: rank 1 all-gathers while rank 0 all-reduces (as many bytes: gloo just waits)."""
    message, _ = _fails(LaunchTimeout, 60, _train_steps, "1:desync:2", timeout=4)
    assert ("ranks disagree: rank 0 in all_reduce #3 (float32[4]), rank 1 in all_gather #3 "
            "(float32[4] <- float32[2])") in message.splitlines()[0]


@pytest.mark.parametrize("fn, args, rank_1", [
    (_train_steps, ("1:desync:2",), "all_gather #3 (float32[4] <- float32[2])"),
    (_different_shapes_at_step_2, (), "all_reduce #3 (float32[6])"),
])
def test_ranks_in_different_collectives_caught_before_the_call(fn, args, rank_1):
    """check_collectives: a desync (op or shape) is an error on every rank at once, no deadline to wait for."""
    message, _ = _fails(WorkerError, 30, fn, *args, timeout=60, check_collectives=True)
    assert message.startswith(f"ranks 0, 1 failed: CollectiveMismatchError: ranks disagree: rank 0 in all_reduce "
                              f"#3 (float32[4]), rank 1 in {rank_1} (caught before the call by check_collectives)")


def test_a_rank_aborted_by_gloo_for_a_desync_is_explained_from_the_recorder(tmp_path):
    """gloo aborts a rank (SIGABRT) when the byte counts differ; what each rank was in survives in its slot."""
    for rank, numel in ((0, 4), (1, 6)):
        slot = flight_recorder._Recorder(faults.slot_path(str(tmp_path), rank), check=False)
        slot._publish(("all_reduce", 3, f"float32[{numel}]", ""))
        slot.close()
    peer = "RuntimeError: Connection closed by peer"
    outcomes = {0: (0, "exit", -6), 1: (1, "error", peer, f"Traceback ...\n{peer}", None)}
    error = faults.failure(outcomes, 2, 60.0, str(tmp_path))
    assert isinstance(error, WorkerError) and error.ranks == [0]  # the peer's symptom is not a cause
    lines = str(error).splitlines()
    assert lines[0] == "ranks disagree: rank 0 in all_reduce #3 (float32[4]), rank 1 in all_reduce #3 (float32[6])"
    assert lines[1].startswith("rank 0 was killed by signal SIGABRT (exit code -6) in all_reduce #3 (float32[4]): "
                               "native code gave up: gloo and NCCL abort like this when the ranks' collectives disagree")


def test_the_fault_spec_is_checked():
    with pytest.raises(ValueError, match="must be RANK:MODE:STEP"):
        faults.inject(0, "1:explode:2")


def test_a_dead_rank_without_a_signal_says_its_exit_code():
    assert faults.explain_exit(3).startswith("exited with code 3 without reporting a result")
    assert faults.explain_exit(-9, " in all_reduce #3 (float32[4])").startswith(
        "was killed by signal SIGKILL (exit code -9) in all_reduce #3 (float32[4]): a kill Python cannot catch")


def test_recorded_calls_in_a_subgroup_and_point_to_point_are_not_a_desync():
    rec = flight_recorder.Collective
    assert flight_recorder.disagreement({0: rec("send", 1, "float32[2]", "", "in"),
                                         1: rec("recv", 1, "float32[2]", "", "in")}) == ""
    assert flight_recorder.disagreement({0: rec("all_reduce", 2, "float32[2]", "ranks [0, 2]", "in"),
                                         1: rec("all_reduce", 2, "float32[2]", "ranks [1, 3]", "in"),
                                         2: rec("all_reduce", 2, "float32[2]", "ranks [0, 2]", "in")}) == ""
    assert flight_recorder.disagreement({0: rec("all_reduce", 3, "float32[2]", "", "in"),
                                         1: rec("all_reduce", 4, "float32[2]", "", "in")}) == (
        "ranks disagree: rank 0 in all_reduce #3 (float32[2]), rank 1 in all_reduce #4 (float32[2])")


# ------------------------------------------------------------------ under torchrun
_SCRIPT = textwrap.dedent("""
    import torch
    from minifsdp import comm, dist, faults

    dist.init()
    t = torch.ones(4)
    for step in range(4):
        faults.inject(step)  # the one line a trainer's step loop adds
        comm.all_reduce(t)
    dist.destroy()
""")


@pytest.mark.parametrize("mode, ours, torchruns", [
    ("raise", "[minifsdp] rank 1 at step 2 failed: RuntimeError: MINIFSDP_FAULT injected a failure at step 2 "
              "(in <module>, line 8 of steps.py)", "exitcode  : 1"),
    ("kill", "[minifsdp] rank 1: MINIFSDP_FAULT injects 'kill' at step 2", "Signal 9 (SIGKILL)"),
])
def test_under_torchrun(tmp_path, mode, ours, torchruns):
    import psutil

    script = tmp_path / "steps.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, MINIFSDP_FAULT=f"1:{mode}:2", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--monitor-interval", "0.2", str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    print(f"torchrun ended in {seconds:.1f} s\n{run.stderr[-3000:]}")
    assert run.returncode != 0
    assert ours in run.stderr
    assert torchruns in run.stderr and "rank      : 1" in run.stderr  # torchrun's report names rank 1
    assert run.stderr.index(ours) < run.stderr.index(torchruns)  # ours first, then torchrun's report
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]
    assert left == [], "a torchrun worker outlived the run"
