"""Run a function on N fresh processes, one per rank, from anywhere — a notebook cell included.

Layer 1 (runtime). What ``torch.multiprocessing.spawn`` and ``torchrun`` do for
a script, ``launch`` does for a *function*, with the guarantees a lab needs:

    >>> import torch.distributed as dist
    >>> def f(x):
    ...     t = torch.tensor([dist.get_rank() + x])
    ...     dist.all_reduce(t)                  # the process group is ready
    ...     return t.item()
    >>> launch(f, 2, 10)                        # ranks hold 10 and 11
    [21, 21]

How it works, and why each piece is there:

* **The function travels by value.** Functions defined in a notebook cell
  live in ``__main__``, which a worker cannot import; cloudpickle sends
  their code instead (lambdas and closures too).
* **Workers start from a forkserver** that has already imported torch and
  minifsdp's techniques (``FORKSERVER_PRELOAD``), so after the first launch a
  worker starts without importing them again.
  ``fork`` is unsafe once the parent has run threaded torch ops or touched
  CUDA; ``spawn`` re-imports torch in every worker of every launch.
* **Rendezvous without ports.** The workers meet in a ``FileStore`` in a
  fresh temporary folder: no port to pick, so no race for one. (A
  ``TCPStore`` the parent opened on port 0 worked too, but now and then a
  client connection stalled for a whole 5 s connect retry; README's
  measurement notes have the counts.) gloo's own connections between ranks
  are TCP as usual.
* **One compute thread per core share** (``cores // world_size``): ranks
  that each run as many threads as the machine has cores fight over them,
  and every op waits for its slowest thread (README's measurement notes).
* **Nothing hangs, nothing is left behind.** Each worker reports ``("ok",
  result)`` or ``("error", traceback)`` through a queue; a worker that dies
  without a word (a signal, ``os._exit``) is noticed by its exit code. On the
  first failure the others get a short grace period to report (so the *root
  cause* wins over a peer's "Connection reset by peer"), then every worker is
  stopped. A deadline stops a stuck run. Workers also watch their parent and
  exit if it dies.
* **One message that names the rank and the cause** (``faults.py``): each
  worker leaves a ``faulthandler`` stack (at the deadline, or on a crash) and
  its current collective (``flight_recorder.py``) in the run's folder, so the
  report says which rank is stuck and where, which collective the others wait
  in, and which collective each rank was in when they disagree.
  ``check_collectives=True`` compares every collective across ranks before it
  runs, so a desync is an error at once instead of a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import json
import math
import multiprocessing as mp
import multiprocessing.spawn as mp_spawn
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import cloudpickle
import torch
import torch.distributed as tdist

from . import dist, fake_gpu, faults, flight_recorder
from .faults import LaunchError, LaunchTimeout, WorkerError

__all__ = ["launch", "LaunchError", "WorkerError", "LaunchTimeout", "max_world_size"]

_GRACE_AFTER_FIRST_ERROR_S = 1.0
# Read by workers, passed as the caller has them now: the forkserver's own environment is older.
_FORWARDED_ENV = (faults.FAULT_ENV,)
# A worker that died without a report: its last words, if any, are already in the queue's pipe.
_SILENT_DEATH_S = 0.5


def max_world_size(backend: str | None = None) -> int:
    """A sane number of ranks for this machine: one per GPU with NCCL, else 4 per CPU core (at least 8)."""
    if (backend or dist.default_backend()) == "nccl":
        return dist.gpu_count()
    return max(8, 4 * (os.cpu_count() or 1))


# --------------------------------------------------------------------------
# The worker side (runs in the child process)
# --------------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    """Exit if the launching process dies, so no worker is ever orphaned."""
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent_pid, 0)
        except OSError:
            os._exit(1)


def _worker_main(rank: int, world_size: int, payload: bytes, run_dir: str,
                 backend: str, timeout_s: float, threads: int, parent_pid: int,
                 results: "mp.Queue", pretend_gpu: bool = False, check: bool = False,
                 env: dict[str, str | None] | None = None) -> None:
    gc.freeze()  # the forkserver's imports live as long as the rank: out of every GC scan (O(1), see gc.freeze)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    # Where is this rank stuck? Dump every thread's stack just before the deadline, or when it crashes.
    with open(faults.stack_path(run_dir, rank), "w") as stack_out:
        faulthandler.enable(file=stack_out, all_threads=True)
        faulthandler.dump_traceback_later(max(timeout_s - 0.5, 0.1), exit=False, file=stack_out)
        try:
            with flight_recorder.record_collectives(faults.slot_path(run_dir, rank), check):
                outcome = _run_rank(rank, world_size, payload, os.path.join(run_dir, "store"), backend,
                                    timeout_s, threads, pretend_gpu)
        finally:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.disable()
    results.put(outcome)
    results.close()
    results.join_thread()  # make sure the bytes are flushed before the process exits


def _run_rank(rank: int, world_size: int, payload: bytes, store_path: str,
              backend: str, timeout_s: float, threads: int, pretend_gpu: bool = False) -> tuple:
    # torchrun's variables, so code that asks "am I under torchrun?" (train._under_torchrun,
    # dist.init) finds the group already made. No MASTER_PORT: the rendezvous is the FileStore.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = tdist.FileStore(store_path, world_size)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        # A little longer than the launch deadline, so the deadline (which says where
        # each rank was) fires before a collective's own timeout does.
        tdist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                 timeout=datetime.timedelta(seconds=timeout_s + 10))
        # MINIFSDP_FAKE_GPU=N (a GPU rank): run as if on a GPU, every collective checking its tensors' device (fake_gpu.py).
        with fake_gpu.pretend_gpu() if pretend_gpu else contextlib.nullcontext():
            result = fn(*args, **kwargs)
        # Nobody tears the group down while a peer still talks to it. Not one of fn's collectives:
        # named as what it is (a rank that returned early shows as such), and not counted.
        flight_recorder.note("the end-of-run barrier (its function returned)")
        tdist.distributed_c10d.barrier()
        tdist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report *everything* to the parent
        tb = traceback.format_exc()
        try:
            exc_bytes = cloudpickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc_bytes = None
        return (rank, "error", f"{type(exc).__name__}: {exc}", tb, exc_bytes)
    try:
        return (rank, "ok", cloudpickle.dumps(result))
    except Exception as exc:  # noqa: BLE001
        msg = (f"rank {rank} returned a {type(result).__name__} that cannot be pickled ({exc}); "
               "return plain data instead (numbers, lists, dicts, CPU tensors, traces)")
        return (rank, "error", msg, msg, None)


# --------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------
_context: Any = None
# What the forkserver imports once, so that no worker of any launch imports it again: torch._dynamo
# (imported lazily by the first op under a TorchDispatchMode, the memory tracker: 2-4 s per rank), and
# the techniques and torch's distributed packages that launched functions use (0.2-0.4 s per launch
# otherwise). Names, not imports: this runtime module does not depend on them, and multiprocessing
# skips a name that fails to import.
FORKSERVER_PRELOAD = (__name__, "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.pipelining",
                      "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.fsdp.sharded_grad_scaler",
                      "minifsdp.train", "minifsdp.memory", "minifsdp.plot", "minifsdp.labcheck.verdict",
                      *(f"minifsdp.{package}" for package in ("ddp", "zero", "fsdp", "mixed_precision", "checkpoint",
                                                              "pipeline", "tensor_parallel", "context_parallel",
                                                              "expert_parallel")))


def default_threads(world_size: int) -> int:
    """Threads per rank when ``launch`` is not told: the machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _mp_context() -> Any:
    """forkserver (preloaded with torch and this module) where available, else spawn."""
    global _context
    if _context is None:
        if "forkserver" in mp.get_all_start_methods():
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        else:  # Windows
            _context = mp.get_context("spawn")
    return _context


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Start workers without re-running the caller's ``__main__`` in each of them.

    multiprocessing's spawn/forkserver children normally re-import the main
    script (hence the ``if __name__ == "__main__":`` idiom). ``fn`` travels by
    value, so the worker does not need it: skipping it makes a script without
    the guard work, and starts workers faster.
    """
    original = mp_spawn.get_preparation_data

    def without_main(name: str) -> dict:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    mp_spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        mp_spawn.get_preparation_data = original


def _pickle_by_value(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """cloudpickle ``fn`` so that a fresh process can run it.

    Functions from ``__main__`` (a notebook) are pickled by value already. A
    function from a module the worker cannot import (a test file loaded with
    ``--import-mode=importlib``, a script) is sent by value as well.
    """
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    by_value = (module is not None and module.__name__ != "__main__"
                and not module.__name__.startswith(("minifsdp", "torch"))
                and "site-packages" not in (getattr(module, "__file__", "") or ""))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
           backend: str | None = None, threads_per_rank: int | None = None,
           check_collectives: bool | None = None, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes; return their results by rank.

    Inside ``fn`` the default process group is initialised (``torch.distributed``
    works directly) and ``minifsdp.dist`` tells rank, world size and device.

    Raises ``WorkerError`` naming the failing rank(s) and the cause (an
    exception with its original traceback, out of memory, a signal, ranks
    that disagree on a collective), or ``LaunchTimeout`` naming the ranks
    still running after ``timeout`` seconds, which one is stuck and where, and
    the collective the others wait in (docs/faults.md). No worker outlives
    the call. ``check_collectives`` (default: ``MINIFSDP_CHECK_COLLECTIVES=1``)
    compares each collective across ranks before it runs (flight_recorder.py).

    Backend: ``None`` runs one rank per GPU with NCCL when the machine has
    ``world_size`` GPUs, else CPU ranks with gloo, saying so in one line (a
    lab asking for 4 ranks runs on a 1- or 2-GPU VM too); ``"nccl"`` refuses
    more ranks than GPUs; ``"gloo"`` always runs CPU ranks.
    """
    backend = backend or _default_backend_for(world_size)
    _validate(fn, world_size, timeout, backend, threads_per_rank)
    # MINIFSDP_FAKE_GPU=N: "nccl" ranks are gloo processes on a pretend GPU (fake_gpu.py)
    pretend_gpu = backend == "nccl" and fake_gpu.enabled() and not torch.cuda.is_available()
    if pretend_gpu:
        backend = "gloo"
    threads = threads_per_rank or default_threads(world_size)
    try:
        payload = _pickle_by_value(fn, args, kwargs)
    except Exception as exc:
        raise LaunchError(f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the workers "
                          f"({type(exc).__name__}: {exc}); pass picklable arguments") from None

    ctx = _mp_context()
    results = ctx.Queue()
    if check_collectives is None:  # read here: the forkserver's environment is older
        check_collectives = os.environ.get(flight_recorder.CHECK_ENV, "0") == "1"
    run_dir = tempfile.mkdtemp(prefix="minifsdp-launch-")  # the rendezvous file, each rank's stack and collective
    procs = [ctx.Process(target=_worker_main, name=f"minifsdp-rank{r}", daemon=True,
                         args=(r, world_size, payload, run_dir, backend, timeout, threads, os.getpid(), results,
                               pretend_gpu, check_collectives,  # decided here, as check_collectives
                               {name: os.environ.get(name) for name in _FORWARDED_ENV}))
             for r in range(world_size)]
    started = time.perf_counter()
    outcomes: dict[int, tuple] = {}
    try:
        with _main_not_reimported():
            for p in procs:
                p.start()
        outcomes = _collect(procs, results, timeout)
    finally:
        _stop(procs)
        results.close()
        _log_launch(world_size, "gpu" if pretend_gpu else backend, started, outcomes)
    try:
        error = faults.failure(outcomes, world_size, timeout, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # stack dumps, and the store file a killed rank left
    if error is not None:
        raise error
    return [cloudpickle.loads(outcomes[r][2]) for r in range(world_size)]


LOG_ENV = "MINIFSDP_LAUNCH_LOG"  # a file: each launch appends one JSON line (tools/gpu_check.py reads it)


def _log_launch(world_size: int, backend: str, started: float, outcomes: dict[int, tuple]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    ok = len(outcomes) == world_size and all(o[1] == "ok" for o in outcomes.values())
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"world_size": world_size, "backend": backend, "ok": ok,
                              "seconds": round(time.perf_counter() - started, 3)}) + "\n")


_said: set[tuple[int, int]] = set()  # (ranks, GPUs) already explained in this process


def _default_backend_for(world_size: int) -> str:
    """NCCL when every rank gets a GPU of its own, else CPU ranks (gloo), said once in one line."""
    gpus = dist.gpu_count()
    if gpus == 0:
        return "gloo"
    if isinstance(world_size, int) and world_size > gpus:
        if (world_size, gpus) not in _said:
            _said.add((world_size, gpus))
            print(f"[minifsdp] {world_size} ranks, {gpus} GPU(s) here: running the {world_size} ranks on the CPU "
                  "(gloo) - the same code and results, CPU speed")
        return "gloo"
    return "nccl"


def _validate(fn: Callable, world_size: int, timeout: float, backend: str, threads_per_rank: int | None = None) -> None:
    if not callable(fn):
        raise TypeError(f"launch(fn, world_size): fn must be callable, got {type(fn).__name__}")
    if threads_per_rank is not None and (isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int)
                                         or threads_per_rank < 1):
        raise ValueError(f"threads_per_rank must be an integer >= 1 (or None: cores / ranks), got {threads_per_rank!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU ranks), 'nccl' (one GPU per rank) or None (NCCL when every "
                         f"rank gets a GPU, else gloo), got {backend!r}")
    if backend == "nccl" and world_size > dist.gpu_count():
        gpus = dist.gpu_count()
        raise ValueError(f"world_size={world_size} needs {world_size} GPUs with NCCL (one per rank) and this "
                         f"machine has {gpus}: use world_size=dist.lab_world_size({world_size}) (= {gpus} here), "
                         f"or backend='gloo' to run {world_size} ranks on the CPU")
    limit = max_world_size(backend)
    if world_size > limit:
        raise ValueError(f"world_size={world_size} is more than this machine runs sensibly ({os.cpu_count()} CPU "
                         f"cores: at most {limit}); use world_size <= {limit}, or torchrun across machines for more")
    # a string or NaN would otherwise reach the wait loop: a TypeError there, or a launch that never times out
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be positive, finite seconds (e.g. timeout=120), got {timeout!r}")


def _collect(procs: list, results: "mp.Queue", timeout: float) -> dict[int, tuple]:
    """Gather each rank's outcome until all report, one fails, or the deadline passes."""
    outcomes: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    stop_at = deadline
    dead_since: dict[int, float] = {}
    while len(outcomes) < len(procs) and time.monotonic() < stop_at:
        try:
            item = results.get(timeout=0.05)
            outcomes[item[0]] = item
            if item[1] != "ok":  # let peers report for a moment: the root cause may be elsewhere
                stop_at = min(stop_at, time.monotonic() + _GRACE_AFTER_FIRST_ERROR_S)
        except queue_mod.Empty:
            pass
        for r, p in enumerate(procs):
            if r in outcomes or p.is_alive():
                continue
            # Exited without a report (killed, os._exit, segfault): wait briefly for a late message.
            first_seen = dead_since.setdefault(r, time.monotonic())
            if time.monotonic() - first_seen > _SILENT_DEATH_S:
                outcomes[r] = (r, "exit", p.exitcode)
                stop_at = min(stop_at, time.monotonic() + _GRACE_AFTER_FIRST_ERROR_S)
    return outcomes


def _stop(procs: list) -> None:
    """Terminate, then kill, every worker still alive; reap them all."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(1.0)
