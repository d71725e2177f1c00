"""pytest setup for the whole repository: nbval's run of solutions/ checks device discipline too.

``make test`` executes each solutions/NN.ipynb once, with nbval (pyproject's
testpaths include solutions/; ``--nbval-lax``). That one execution gives two
guarantees:

* nbval's: every cell runs without error, and each cell marked
  ``# NBVAL_CHECK_OUTPUT`` prints what the stored notebook shows;
* a 2-GPU VM and its device discipline: on a machine without CUDA the kernel
  starts with ``MINIFSDP_FAKE_GPU=2`` (``NBVAL_GPUS``), a pretend 2-GPU machine:
  every worker of a launch of at most 2 ranks runs on a pretend GPU, where every
  collective checks that its tensors are on ``dist.device()``
  (minifsdp/fake_gpu.py), and a launch of more ranks runs CPU ranks, as on the VM. Only launched workers change; the
  notebook's own process runs as before, and a pretend GPU prints and compares
  as ``cpu``, so the compared outputs are the same. On a GPU machine the workers
  run on the real GPUs with NCCL, which is the check itself.

tests/test_notebooks.py::test_solution_on_pretend_gpus runs every solution once
more through nbclient as a 1-GPU VM (``MINIFSDP_FAKE_GPU=1``), and as a 2-GPU VM
for a notebook that nbval does not run in the session.
"""
from __future__ import annotations

import functools
import os

import pytest

FAKE_GPU_ENV = "MINIFSDP_FAKE_GPU"   # minifsdp.fake_gpu.ENV (not imported: collecting must not import torch)
NBVAL_GPUS = "2"
_outside = os.environ.get(FAKE_GPU_ENV)


@functools.lru_cache(maxsize=1)
def _has_cuda() -> bool:
    import torch  # here, not at the top: only a session that runs a notebook pays for it
    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """nbval starts a notebook's kernel while setting up its first cell, right after this hook: the kernel
    (and every worker it launches) inherits the variable. Every other test sees the environment as it was."""
    if item.path.suffix == ".ipynb" and not _has_cuda():
        os.environ[FAKE_GPU_ENV] = NBVAL_GPUS
    elif _outside is None:
        os.environ.pop(FAKE_GPU_ENV, None)
    else:
        os.environ[FAKE_GPU_ENV] = _outside
