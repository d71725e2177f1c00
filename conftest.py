"""pytest setup for the whole repository: which tests are fast, and the pretend GPU of nbval's run.

**Markers.** Every test is one of three kinds, and ``make test-fast`` runs only the first
(``-m "not multiprocess and not notebook"``, no solutions/):

* single-process (no marker): runs in this process, in well under a second or two;
* ``multiprocess``: starts processes (``launch``, torchrun, a training run with world_size > 1);
* ``notebook``: runs a notebook in a Jupyter kernel (solutions/*.ipynb under nbval,
  tests/test_notebooks.py).

Nobody has to remember the markers. ``pytest_collection_modifyitems`` marks a test
``multiprocess`` when its function, a fixture it uses, or anything they call in minifsdp/,
tests/ or tools/ names a process starter (``launch``, ``subprocess``, ``multiprocessing``,
``torch.multiprocessing``: ``_reaches_a_spawner``). What that reading misses is caught when it
runs: a test without either marker that starts a Python process fails and says which marker
to add (``_refuse_processes``), so a slow test cannot sit in the fast set unnoticed.

**nbval's run of solutions/ checks device discipline too.** ``make test`` executes each
solutions/NN.ipynb once, with nbval (pyproject's testpaths include solutions/; ``--nbval-lax``).
That one execution gives two guarantees:

* nbval's: every cell runs without error, and each cell marked ``# NBVAL_CHECK_OUTPUT`` prints
  what the stored notebook shows;
* a 2-GPU VM and its device discipline: on a machine without CUDA the kernel starts with
  ``MINIFSDP_FAKE_GPU=2`` (``NBVAL_GPUS``), a pretend 2-GPU machine: every worker of a launch of
  at most 2 ranks runs on a pretend GPU, where every collective checks that its tensors are on
  ``dist.device()`` (minifsdp/fake_gpu.py), and a launch of more ranks runs CPU ranks, as on the
  VM. Only launched workers change; the notebook's own process runs as before, and a pretend GPU
  prints and compares as ``cpu``, so the compared outputs are the same. On a GPU machine the
  workers run on the real GPUs with NCCL, which is the check itself.

tests/test_notebooks.py::test_solution_on_pretend_gpus runs every solution as a 2-GPU VM for a
notebook that nbval does not run in the session, and (opt-in: ``make test-gpu-counts``) once more
through nbclient as a 1-GPU VM (``MINIFSDP_FAKE_GPU=1``).

**Two workers.** ``make test`` runs tests/ and solutions/ in one pytest on two pytest-xdist workers (``-n 2
--dist loadfile``): every file whole on one worker, so a module's fixtures run once and nbval keeps one kernel per
notebook across its cells. Kernels on the two workers may run at the same time; they talk over Unix sockets, not
TCP ports (``pytest_configure``; tools/run_notebooks.py's ``use_ipc`` says why).
"""
from __future__ import annotations

import contextlib
import dis
import functools
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parent
FAKE_GPU_ENV = "MINIFSDP_FAKE_GPU"   # minifsdp.fake_gpu.ENV (not imported: collecting must not import torch)
NBVAL_GPUS = "2"
_outside = os.environ.get(FAKE_GPU_ENV)
SLOW_MARKS = ("multiprocess", "notebook")
# Whatever starts a process: a function of these modules, or one of these names.
_SPAWNING_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures.process",
                     "jupyter_client", "nbclient")
_SPAWNING_NAMES = {("minifsdp.launch", "launch"), ("os", "fork"), ("os", "system"), ("posix", "fork"),
                   ("posix", "system")}


@functools.lru_cache(maxsize=1)
def _has_cuda() -> bool:
    import torch  # here, not at the top: only a session that runs a notebook pays for it
    return torch.cuda.is_available()


# ---------------------------------------------------------------- markers
def _is_spawner(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return (module, getattr(obj, "__name__", "")) in _SPAWNING_NAMES or \
        any(module == m or module.startswith(m + ".") for m in _SPAWNING_MODULES)


_OUR_FOLDERS = tuple(f"{ROOT / folder}{os.sep}" for folder in ("minifsdp", "tests", "tools"))


def _ours(obj: Any) -> bool:
    """A function or class written in this repository (minifsdp/, tests/, tools/): worth reading."""
    try:
        return _in_repository(inspect.getfile(obj))
    except (TypeError, OSError):
        return False


@functools.lru_cache(maxsize=None)
def _in_repository(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_OUR_FOLDERS)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """A code object and those nested in it (inner functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


@functools.lru_cache(maxsize=None)
def _imported_in(code: types.CodeType, package: str) -> tuple[types.ModuleType, ...]:
    """The modules an import statement inside a function names (``from ..launch import launch``,
    ``from minifsdp.labcheck import lab00``: the submodule too, imported here if nothing has yet)."""
    found: list[types.ModuleType | None] = []
    recent: list[Any] = []  # LOAD_CONST level, LOAD_CONST names, IMPORT_NAME module
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            level = recent[-2] if len(recent) >= 2 and isinstance(recent[-2], int) else 0
            found.append(_module("." * level + ins.argval, package))
        elif ins.opname == "IMPORT_FROM" and found and hasattr(found[-1], "__path__"):
            found.append(_module(f"{found[-1].__name__}.{ins.argval}", ""))
        recent.append(ins.argval if ins.opname == "LOAD_CONST" else None)
    return tuple(m for m in found if m is not None)


def _module(name: str, package: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(importlib.util.resolve_name(name, package) if name.startswith(".") else name)
    except (ImportError, ValueError):
        return None


def _used(code: types.CodeType, scope: dict, modules: list[types.ModuleType]) -> list[Any]:
    """What a code object's names may stand for: a global, a module it imports, or an attribute of
    one of those modules (or of ``modules``), followed along chains (``a.b.c``); for a
    ``getattr(module, name)``, anything in the module."""
    names = set(code.co_names)
    found = [scope[n] for n in names if n in scope] + list(_imported_in(code, scope.get("__package__") or ""))
    todo = [m for m in found if isinstance(m, types.ModuleType)] + modules
    dynamic = "getattr" in names and "getattr" not in scope
    while todo:
        module = todo.pop()
        for n in (vars(module) if dynamic and _ours(module) else names):
            attr = _safe_getattr(module, n)
            if attr is not None and all(attr is not f for f in found):
                found.append(attr)
                if isinstance(attr, types.ModuleType) and not dynamic:
                    todo.append(attr)
    return found


def _safe_getattr(module: types.ModuleType, name: str) -> Any:
    try:
        return getattr(module, name, None)
    except Exception:  # noqa: BLE001 - a lazy module's __getattr__ may raise anything
        return None


def _dict_of(obj: Any) -> dict:
    """An object's own attributes, read without running any __getattr__ of its class."""
    try:
        found = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001
        return {}
    return found if isinstance(found, dict) else {}


def _inside(obj: Any, depth: int = 3) -> Iterator[Any]:
    """What an object hands on when called or read: a decorated function's original, a closure's
    variables, the items of a table (``CHECKS = [(lab07.executor, ...), ...]``)."""
    if isinstance(obj, (list, tuple, set, frozenset, dict)) and depth and len(obj) <= 256:
        for item in (obj.values() if isinstance(obj, dict) else obj):
            yield item
            yield from _inside(item, depth - 1)
    original = _dict_of(obj).get("__wrapped__") if callable(obj) else None  # functools.wraps, lru_cache
    if original is not None:
        yield original
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                yield cell.cell_contents


_USED: dict[tuple, list[Any]] = {}
_SPAWNS: dict[tuple, bool] = {}   # (id(function), id(modules)...) -> whether it reaches a spawner
_KEEP: list[Any] = []             # what _SPAWNS' ids name, kept alive so that no id is reused


def _spawns(root: Any, modules: tuple[types.ModuleType, ...] = ()) -> bool:
    """Whether calling ``root`` may start a process, read from the code (no call is made).

    Follows every name a function's code uses (``_used``) and what an object hands on
    (``_inside``) into every function and class of this repository; stops at a spawner. A result
    is kept: a function that reaches none is not read again. Over-marking only moves a test out
    of the fast set."""
    key = (id(root), *map(id, modules))
    if key in _SPAWNS:
        return _SPAWNS[key]
    seen: dict[int, Any] = {}
    todo: list[tuple[Any, tuple]] = [(root, modules)]
    found = False
    while todo and not found:
        obj, mods = todo.pop()
        obj = obj.func if isinstance(obj, functools.partial) else obj
        if id(obj) in seen or (obj is not root and (id(obj),) in _SPAWNS and not _SPAWNS[(id(obj),)]):
            continue
        seen[id(obj)] = obj
        found = _is_spawner(obj) or (obj is not root and _SPAWNS.get((id(obj),), False))
        todo.extend((inner, ()) for inner in _inside(obj))
        if isinstance(obj, type) and _ours(obj):
            methods = (v for v in vars(obj).values() if callable(v) or isinstance(v, (staticmethod, classmethod)))
            todo.extend((v, ()) for v in methods)
            continue
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            obj = obj.__func__
        if not isinstance(obj, types.FunctionType) or not _ours(obj):
            continue
        for c in _codes(obj.__code__):
            at = (c, *map(id, mods))
            used = _USED[at] if at in _USED else _USED.setdefault(at, _used(c, obj.__globals__, list(mods)))
            todo.extend((f, ()) for f in used if not isinstance(f, types.ModuleType))
    _SPAWNS[key] = found
    _KEEP.append(root)
    if not found:  # then nothing it reaches reaches one either
        _SPAWNS.update(((i,), False) for i in seen)
        _KEEP.extend(seen.values())
    return found


def _reaches_a_spawner(test: Any, fixtures: list[Any]) -> bool:
    """Whether a test, or a fixture it uses, may start a process. A fixture may hand the test a
    module (``lab03``): the test's names are looked up in the modules its fixtures use too."""
    modules = tuple(m for f in fixtures if _ours(f) for c in _codes(f.__code__)
                    for m in _used(c, f.__globals__, []) if isinstance(m, types.ModuleType))
    return any(_spawns(f) for f in fixtures) or _spawns(test, modules)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        if item.path.suffix == ".ipynb" or item.path.name == "test_notebooks.py":
            if "notebook" not in marks:
                item.add_marker(pytest.mark.notebook)
        elif "multiprocess" not in marks and isinstance(item, pytest.Function):
            info = getattr(item, "_fixtureinfo", None)
            fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
            if _reaches_a_spawner(item.function, fixtures):
                item.add_marker(pytest.mark.multiprocess)
    # Slow files first: those that start kernels, then those that start processes, then the rest. make test's
    # workers take whole files in this order (--no-loadscope-reorder), so the last files are quick ones and
    # neither worker sits idle long at the end waiting for the other. The sort is stable: a file keeps its order.
    kind: dict[Path, int] = {}
    for item in items:
        slow = 0 if item.get_closest_marker("notebook") else 1 if item.get_closest_marker("multiprocess") else 2
        kind[item.path] = min(kind.get(item.path, 2), slow)
    items.sort(key=lambda item: kind[item.path])


# ---------------------------------------------------------------- a fast test stays fast
class _ProcessInFastTest(AssertionError):
    pass


def _refusing(start_method: Any, item: pytest.Item, what: Any) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        argv = what(self, args, kwargs)
        if argv is not None:
            raise _ProcessInFastTest(
                f"{item.nodeid} starts a process ({argv}) but is not marked multiprocess, so it would run in "
                f"`make test-fast`: add @pytest.mark.multiprocess (conftest.py marks a test that calls launch, "
                f"subprocess or multiprocessing itself; this one reached it another way)")
        return start_method(self, *args, **kwargs)
    return refuse


def _python_argv(popen: subprocess.Popen, args: tuple, kwargs: dict) -> str | None:
    """A subprocess that runs Python (a kernel, torchrun, a script); None for a tool such as uname."""
    argv = args[0] if args else kwargs.get("args")
    program = (argv if isinstance(argv, (str, bytes)) else (argv or [""])[0]) or ""
    program = os.fsdecode(program)
    first = program.split()[0] if program else ""
    return program if Path(first).name.startswith("python") or first == sys.executable else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test without a slow marker may not start a Python process (setup, call and teardown)."""
    if any(item.get_closest_marker(m) for m in SLOW_MARKS):
        yield
        return
    import multiprocessing.process
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refusing(
            multiprocessing.process.BaseProcess.start, item, lambda p, a, k: f"multiprocessing {p.name}"))
        patch.setattr(subprocess.Popen, "__init__", _refusing(
            subprocess.Popen.__init__, item, _python_argv))
        yield


# ---------------------------------------------------------------- nbval's kernels on Unix sockets
def pytest_configure(config: pytest.Config) -> None:
    """nbval's kernels talk over Unix sockets, as tools/run_notebooks.py's do (``use_ipc`` says why: a TCP
    port chosen for a kernel can be taken by another process before the kernel binds it)."""
    try:
        import nbval.kernel
    except ImportError:
        return
    if getattr(nbval.kernel.KernelManager, "minifsdp_ipc", False):
        return
    sys.path.insert(0, str(ROOT / "tools"))
    import run_notebooks

    manager = nbval.kernel.KernelManager

    def ipc_kernel_manager(**kwargs: Any) -> Any:
        return run_notebooks.use_ipc(manager(**kwargs))

    ipc_kernel_manager.minifsdp_ipc = True  # type: ignore[attr-defined]
    nbval.kernel.KernelManager = ipc_kernel_manager


# ---------------------------------------------------------------- nbval's pretend GPU
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
