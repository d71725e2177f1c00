"""Who am I? Rank, world size, device and backend inside a worker.

Layer 1 (runtime). The same worker code runs in three situations:

* inside ``minifsdp.launch(fn, world_size)`` (a notebook cell, a test): the
  launcher has already called ``torch.distributed.init_process_group``;
* under ``torchrun --nproc-per-node N script.py`` (one or many machines):
  call ``minifsdp.dist.init()`` once; it reads RANK / WORLD_SIZE /
  LOCAL_RANK / MASTER_ADDR from the environment (env:// rendezvous);
* in a plain single process: ``rank() == 0``, ``world_size() == 1``.

The device rule mirrors what ``torchrun`` users write by hand:
``cuda:LOCAL_RANK`` with the ``nccl`` backend when CUDA is available, else
``cpu`` with ``gloo``.

    >>> from minifsdp import dist
    >>> dist.rank(), dist.world_size(), dist.device(), dist.backend()
    (0, 1, device(type='cpu'), 'gloo')
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as tdist


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank(group: tdist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the whole world); 0 when not distributed."""
    return tdist.get_rank(group) if is_initialized() else 0


def world_size(group: tdist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group``; 1 when not distributed."""
    return tdist.get_world_size(group) if is_initialized() else 1


def global_rank(group: tdist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (``group=None``: the world, the same number).

    torch's rooted and point-to-point calls (``broadcast``, ``reduce``, ``send``, ``recv``) name
    ``src`` / ``dst`` by global rank even inside a subgroup, so every technique that talks to one
    member of its group (an owner, a stage, a group's rank 0) translates here first.
    """
    return group_rank if group is None else tdist.get_global_rank(group, group_rank)


def local_rank() -> int:
    """Rank among the processes of this machine (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", rank()))


def gpu_count() -> int:
    """GPUs this machine gives ranks: CUDA's device count, or the pretend count of ``MINIFSDP_FAKE_GPU=N``.

    The pretend count (``fake_gpu.py``) lets a CPU machine behave as a VM with N GPUs: ``launch``,
    ``available_ranks`` and ``lab_world_size`` then decide exactly as they would there.
    """
    pretend = os.environ.get("MINIFSDP_FAKE_GPU", "")  # fake_gpu.ENV (fake_gpu imports this module)
    if pretend.isdigit() and int(pretend) > 0:
        return int(pretend)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_backend() -> str:
    """``nccl`` when there are GPUs (real, or pretend under ``MINIFSDP_FAKE_GPU=N``), else ``gloo``."""
    return "nccl" if gpu_count() > 0 else "gloo"


def backend() -> str:
    """The backend of the default process group (or the one ``init`` would pick)."""
    return str(tdist.get_backend()) if is_initialized() else default_backend()


_device_override: torch.device | None = None  # set by fake_gpu.pretend_gpu() while it checks device discipline


def device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available (and the backend can use it), else ``cpu``."""
    if _device_override is not None:
        return _device_override
    if torch.cuda.is_available() and backend() != "gloo":
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def available_ranks(backend: str | None = None) -> int:
    """How many ranks ``launch`` can start here: one per GPU with NCCL; on CPU (gloo) ranks are processes, 8."""
    if (backend or default_backend()) == "nccl":
        return gpu_count()
    return 8


def lab_world_size(wanted: int, backend: str | None = None) -> int:
    """``min(wanted, available_ranks())``, saying so when it is fewer: what a lab asks for ranks.

    A lab written for 4 ranks runs unchanged on a laptop (4 gloo processes) and on a
    1-, 2-, 4- or 8-GPU VM (one rank per GPU, NCCL)::

        >>> lab_world_size(4)          # on a CPU machine, or a VM with >= 4 GPUs
        4
    """
    available = available_ranks(backend)
    if available < 1:
        raise RuntimeError("backend nccl with no visible GPU: check CUDA_VISIBLE_DEVICES / nvidia-smi, "
                           "or pass backend='gloo' to run the ranks on the CPU")
    if wanted > available:
        print(f"[minifsdp] this machine has {available} GPU(s): running {available} rank(s) instead of {wanted} "
              f"(pass backend='gloo' to launch for {wanted} CPU ranks)")
    return min(wanted, available)


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from torchrun's environment (env://).

    A no-op when a group already exists (e.g. inside ``minifsdp.launch``) so the
    same script runs both ways. Without torchrun's variables it starts a
    one-process group, which keeps single-process runs on the same code path.
    """
    if is_initialized():
        return
    backend = backend or default_backend()
    if not torch.cuda.is_available():  # a pretend GPU count (MINIFSDP_FAKE_GPU=N) talks gloo underneath
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one, in-memory store
        tdist.init_process_group(backend=backend, store=tdist.HashStore(), rank=0, world_size=1,
                                 timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    tdist.init_process_group(backend=backend, init_method="env://", timeout=timeout)


def destroy() -> None:
    if is_initialized():
        tdist.destroy_process_group()


def require_initialized(what: str) -> None:
    """Raise a one-line error naming the fix when called outside a process group."""
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs a process group: call it inside minifsdp.launch(fn, world_size) "
            "or after minifsdp.dist.init() / torch.distributed.init_process_group() (torchrun)")


def require_module(module: object, what: str) -> None:
    """Raise a one-line error naming the fix when a wrapper is handed something that is not a module
    (else an AttributeError surfaces from deep inside the wrapper)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{what} wraps a torch.nn.Module, got {type(module).__name__}; pass the model (or block) "
                        "itself")


def require_group(group: object, what: str) -> None:
    """Raise a one-line error naming the fix when a process group is expected and something else (often
    the group's size) was passed: else an AttributeError surfaces at the first collective."""
    if group is not None and not isinstance(group, tdist.ProcessGroup):
        raise TypeError(f"{what} takes a process group or None (the whole world), got {group!r}; pass e.g. "
                        "mesh.DeviceMesh(...).get_group(dim) or torch.distributed.new_group(ranks)")
