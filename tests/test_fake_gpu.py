"""minifsdp.fake_gpu: on a CPU-only machine, catch a worker that would hand CPU tensors to NCCL.

Each worker runs through ``launch`` with MINIFSDP_FAKE_GPU=2 (how the notebooks
are checked, tests/test_notebooks.py); the good workers are what the labs do,
the bad ones the mistakes a GPU VM would reject.
"""
import pytest
import torch

from minifsdp import WorkerError, comm, data, dist, fake_gpu, launch, models
from minifsdp.fake_gpu import ENV


@pytest.fixture(autouse=True)
def pretend(monkeypatch):
    monkeypatch.setenv(ENV, "2")  # a pretend 2-GPU machine: 2-rank launches run on pretend GPUs


def _good():
    assert dist.device() is fake_gpu.FAKE_GPU and str(dist.device()) == "cpu"  # prints as cpu: trackers etc. unchanged
    x = torch.ones(3, device=dist.device())
    comm.all_reduce(x)
    model = models.build_model("gpt-tiny", seed=0).to(dist.device())
    for p in model.parameters():  # Module.to(dist.device()) moved them
        comm.broadcast(p.detach(), src=0)
    xb, yb = (t.to(dist.device()) for t in data.get_batch(0, 4, 16, rank=dist.rank(), world_size=2))
    models.lm_loss(model(xb), yb).backward()
    for p in model.parameters():  # gradients made by autograd from device tensors are on the device
        comm.all_reduce(p.grad)
    out = x.new_zeros(6)
    comm.all_gather_into_tensor(out, x[:3])
    return x.cpu()


def test_a_disciplined_worker_passes():
    assert [t.tolist() for t in launch(_good, 2, timeout=60)] == [[2.0] * 3] * 2


def _cpu_factory():
    comm.all_reduce(torch.ones(3))  # forgot device=dist.device()


def _model_not_moved():
    model = models.build_model("gpt-tiny", seed=0)  # forgot .to(dist.device())
    for p in model.parameters():
        comm.broadcast(p.detach(), src=0)


def _batch_not_moved():
    model = models.build_model("gpt-tiny", seed=0).to(dist.device())
    x, y = data.get_batch(0, 4, 16)
    comm.all_reduce(x.float())  # the batch stayed on the CPU


def _moved_but_sent_the_original():
    x = torch.ones(3)
    x.to(dist.device())  # the moved copy is dropped: x is still a CPU tensor on a GPU machine
    comm.all_reduce(x)


def _cpu_copy():
    x = torch.ones(3, device=dist.device())
    comm.all_reduce(x.cpu())  # a CPU copy, handed to the collective


@pytest.mark.parametrize("worker", [_cpu_factory, _model_not_moved, _batch_not_moved, _moved_but_sent_the_original,
                                    _cpu_copy], ids=["factory", "model", "batch", "original", "cpu-copy"])
def test_cpu_tensor_to_a_collective_is_caught(worker):
    with pytest.raises(WorkerError, match="DeviceDisciplineError: .* on the CPU: on a GPU machine NCCL rejects it"):
        launch(worker, 2, timeout=60)


def test_without_the_flag_nothing_changes(monkeypatch):
    monkeypatch.delenv(ENV)
    launch(_cpu_factory, 2, timeout=60)  # fine on a CPU machine: that is why the flag exists


def _cpu_all_gather_single():
    out = torch.empty(2 * 3, device=dist.device())
    comm.all_gather_into_tensor(out, torch.ones(3))   # the input forgot device=dist.device()
    return True


def test_single_tensor_collectives_are_checked_too(monkeypatch):
    """comm's all_gather_into_tensor / reduce_scatter_tensor (torch's *_single) go through the device check."""
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(WorkerError, match="DeviceDisciplineError: all_gather_(single|into_tensor) got a"):
        launch(_cpu_all_gather_single, 2, timeout=60)
