"""The launcher: results by rank, functions sent by value, errors with the root cause, no hangs, no orphans."""

import os
import sys
import time

import pytest
import torch
import torch.distributed as tdist

import minifsdp
from minifsdp import LaunchTimeout, WorkerError, dist, launch


def _rank_info(offset):
    t = torch.tensor([float(tdist.get_rank() + offset)])
    tdist.all_reduce(t)
    return {"rank": dist.rank(), "world": dist.world_size(), "sum": t.item(), "device": str(dist.device()),
            "backend": dist.backend(), "threads": torch.get_num_threads(), "pid": os.getpid(),
            "env_rank": int(os.environ["RANK"])}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size):
    out = launch(_rank_info, world_size, 10)
    assert [o["rank"] for o in out] == list(range(world_size))
    expected = sum(10 + r for r in range(world_size))
    assert all(o["sum"] == expected and o["world"] == world_size for o in out)
    assert all(o["device"] == "cpu" and o["backend"] == "gloo" for o in out)
    assert [o["env_rank"] for o in out] == list(range(world_size))  # torchrun-style env is set
    assert len({o["pid"] for o in out}) == world_size and os.getpid() not in {o["pid"] for o in out}
    assert all(o["threads"] == max(1, (os.cpu_count() or 1) // world_size) for o in out)


def test_lambda_closure_and_tensor_results():
    scale = 3.0  # captured by the closure: must travel by value
    out = launch(lambda: torch.arange(3.0) * scale + tdist.get_rank(), 2)
    assert torch.equal(out[0], torch.tensor([0.0, 3.0, 6.0]))
    assert torch.equal(out[1], torch.tensor([1.0, 4.0, 7.0]))


def test_function_defined_in_main_like_namespace():
    """A notebook cell defines functions in __main__; emulate that with exec."""
    namespace = {"__name__": "__main__"}
    exec("import torch.distributed as d\ndef cell_fn(k):\n    return k * (d.get_rank() + 1)\n", namespace)
    assert launch(namespace["cell_fn"], 2, 5) == [5, 10]


def _boom_on_rank_1():
    if tdist.get_rank() == 1:
        raise ValueError("rank one exploded")
    tdist.barrier()  # rank 0 waits on the dead peer: its error is only a symptom


def test_raising_rank_reported_with_original_traceback_fast():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_boom_on_rank_1, 2, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 5.0, f"took {elapsed:.1f}s to report a failing rank"
    err = info.value
    assert err.ranks == [1]
    assert "rank 1" in str(err) and "ValueError: rank one exploded" in str(err)
    assert "_boom_on_rank_1" in err.failures[1]  # the worker's own traceback, not a peer's
    assert isinstance(err.__cause__, ValueError)


def _hang_on_rank_0():
    if tdist.get_rank() == 0:
        time.sleep(60)
    tdist.barrier()


def test_hung_rank_hits_deadline_and_says_where():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_rank_0, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 8.0
    assert info.value.running == [0, 1]
    assert "_hang_on_rank_0" in str(info.value)  # the faulthandler stack shows the user's frame


def _pids_then_exit_hard():
    if tdist.get_rank() == 1:
        os._exit(7)  # dies without a word
    time.sleep(30)


def test_crashed_rank_is_reported_and_no_child_survives():
    before = set(_children())
    with pytest.raises(WorkerError, match="rank 1.*exited with code 7"):
        launch(_pids_then_exit_hard, 2, timeout=30)
    time.sleep(0.2)
    leftover = [p for p in _children() if p not in before and _is_worker(p)]
    assert leftover == [], f"worker processes survived: {leftover}"


def _children():
    import psutil

    return [c.pid for c in psutil.Process().children(recursive=True)]


def _is_worker(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and "forkserver" not in " ".join(
            psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False


def test_twenty_launches_stay_fast():
    launch(_rank_info, 2, 0)  # warm the forkserver
    times = []
    for _ in range(20):
        start = time.monotonic()
        launch(_rank_info, 2, 0)
        times.append(time.monotonic() - start)
    print(f"20 launches of 2 ranks: median {sorted(times)[10]:.3f}s, max {max(times):.3f}s")
    assert sorted(times)[10] < 1.0 and max(times) < 3.0


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        launch(_rank_info, bad, 0)


def test_world_size_over_machine_limit():
    from minifsdp.launch import max_world_size

    limit = max_world_size()
    with pytest.raises(ValueError, match=f"use world_size <= {limit}"):
        launch(_rank_info, limit + 1, 0)


def test_unpicklable_result_names_the_fix():
    import threading

    with pytest.raises(WorkerError, match="cannot be pickled.*return plain data"):
        launch(lambda: threading.Lock(), 1)


def test_unpicklable_argument():
    import threading

    def f(x):
        return 1

    with pytest.raises(minifsdp.LaunchError, match="pass picklable arguments"):
        launch(f, 1, threading.Lock())


# ---------------------------------------------------------------- world size on a machine with fewer GPUs
@pytest.fixture()
def two_gpu_machine(monkeypatch):
    """Pretend CUDA is available with 2 devices (nothing here touches a real GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_lab_world_size_adapts_to_gpus(two_gpu_machine, capsys):
    assert dist.default_backend() == "nccl"
    assert dist.lab_world_size(4) == 2
    assert "this machine has 2 GPU(s): running 2 rank(s) instead of 4" in capsys.readouterr().out
    assert dist.lab_world_size(2) == 2 and dist.lab_world_size(1) == 1
    assert dist.lab_world_size(4, backend="gloo") == 4  # CPU ranks when asked


def test_launch_more_ranks_than_gpus_names_the_fix(two_gpu_machine):
    with pytest.raises(ValueError) as info:
        launch(_rank_info, 4, 0, backend="nccl")  # refused before any process starts: no NCCL here is needed
    message = str(info.value)
    assert "needs 4 GPUs" in message and "has 2" in message
    assert "dist.lab_world_size(4)" in message and "backend='gloo'" in message


def test_launch_falls_back_to_cpu_ranks_in_one_line(monkeypatch, capsys):
    """A VM with fewer GPUs than a lesson's ranks runs them as CPU ranks (gloo), said once; pretend count 2."""
    monkeypatch.setenv("MINIFSDP_FAKE_GPU", "2")
    monkeypatch.setattr(sys.modules["minifsdp.launch"], "_said", set())  # said once per process: say it here
    assert dist.gpu_count() == 2 and dist.default_backend() == "nccl" and dist.available_ranks() == 2
    infos = launch(_rank_info, 4, 0, timeout=60)
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert "4 ranks, 2 GPU(s) here: running the 4 ranks on the CPU (gloo)" in capsys.readouterr().out
    assert launch(dist.rank, 2, timeout=60) == [0, 1]  # fits the GPUs: pretend GPU ranks, no notice
    assert "GPU(s) here" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        launch(_rank_info, 4, 0, backend="nccl")


def test_pretend_count_rank_is_a_gpu_rank(monkeypatch):
    """Under MINIFSDP_FAKE_GPU=1 a 1-rank launch runs on the pretend GPU; 2 ranks run on the CPU."""
    from minifsdp import fake_gpu
    monkeypatch.setenv("MINIFSDP_FAKE_GPU", "1")
    assert launch(lambda: dist.device() is fake_gpu.FAKE_GPU, 1, timeout=60) == [True]
    assert launch(lambda: dist.device() is fake_gpu.FAKE_GPU, 2, timeout=60) == [False, False]


def test_no_gpu_visible_with_nccl_is_explained(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no visible GPU"):
        dist.lab_world_size(4, backend="nccl")


def _stub_on_every_rank():
    raise NotImplementedError("Exercise: write the ring, then run the check cell below.")


def test_unfinished_exercise_is_one_short_message():
    """The hint once, which ranks, no library frames; each rank's traceback one attribute away."""
    with pytest.raises(WorkerError) as info:
        launch(_stub_on_every_rank, 4, timeout=60)
    err = info.value
    text = str(err)
    assert text.count("write the ring") == 1 and text.startswith("ranks 0-3 failed: NotImplementedError")
    assert "_stub_on_every_rank" in text.splitlines()[0]  # where, in the learner's code
    assert "minifsdp/launch.py" not in text and "Traceback" not in text and len(text.splitlines()) == 2
    assert err.ranks == [0, 1, 2, 3] and set(err.tracebacks) == {0, 1, 2, 3}
    assert "Traceback" in err.tracebacks[2] and "_stub_on_every_rank" in err.tracebacks[2]
    assert err._render_traceback_() == [f"WorkerError: {text}"]  # what Jupyter shows instead of frames
