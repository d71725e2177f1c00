"""Run course notebooks the way the tests do, and explain any failure.

    python tools/run_notebooks.py solutions/00_collectives.ipynb   # every cell must pass
    python tools/run_notebooks.py labs/00_collectives.ipynb        # must stop at exercise 1

A solution notebook must run end to end; a cell marked ``# NBVAL_CHECK_OUTPUT``
is run twice and must print the same text both times (its output is the
kind a reader compares with the book, so it has to be deterministic). A cell
marked ``# FIGURE`` must show at least one image: a figure that silently
vanishes (returned inside a function, drawn inside a widget callback) fails.

A lab must run cleanly up to its first exercise and stop there with the
exercise's ``NotImplementedError`` stub: raised by the exercise cell itself,
or by the check cell right after it when the exercise only defines a
function (a stub raised inside a worker process counts too, as long as its
message reaches the traceback).

Kernels are ``python3`` (the Python that runs this), with the notebook's
folder as working directory and the repository root on ``PYTHONPATH``, so
``import minifsdp`` works even without ``pip install -e .``.  Each cell may
take ``CELL_TIMEOUT`` seconds.  tests/test_notebooks.py calls
``run_solution`` and ``run_lab`` for every notebook in solutions/.
"""
from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import os
import re
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import nbformat
from nbformat import NotebookNode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import notebooks as nbt  # noqa: E402  (tools/notebooks.py)

ROOT = Path(__file__).resolve().parent.parent
CELL_TIMEOUT = 300  # seconds per cell
# A blank lab's cells fail fast (each whole blank lab runs in 10-30 s on the 2-core CI machine). Once in a
# CI run a cell's reply never reached nbclient although the kernel was idle, and the run sat out the full
# cell timeout: a shorter one here bounds that stall without failing a check cell that is slow for real.
BLANK_CELL_TIMEOUT = 120
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class NotebookRunError(AssertionError):
    """A notebook did not run the way the conventions require."""


@dataclass
class CellError:
    index: int  # 1-based, counting every cell
    source: str
    ename: str
    evalue: str
    traceback: str

    def report(self, path: Path | str, what: str = "failed") -> str:
        return (f"{path}: cell {self.index} {what}: {self.ename}: {self.evalue}\n"
                f"----- cell source -----\n{self.source}\n"
                f"----- traceback -----\n{self.traceback}")


def kernel_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a notebook kernel: ours, plus the repo root on PYTHONPATH (and ``extra``)."""
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return env


_IPC_DIR: list[str] = []  # one private folder per process for every kernel's sockets


def use_ipc(km: Any) -> Any:
    """Reach the kernel through Unix sockets in a private folder instead of TCP ports; returns ``km``.

    jupyter_client picks a kernel's five TCP ports by asking the OS for a free port and closing it again;
    the kernel binds them a moment later, and meanwhile another process (a second test worker's kernel,
    gloo ranks opening ports of their own) can take one. That is the likely cause of a reply that never
    came while the kernel sat idle (once in a serial CI run, more often with two workers: the client waited
    out the cell timeout). Socket files in a folder of this process's own cannot be taken by anyone else."""
    if os.name == "nt":  # ZeroMQ has no ipc:// transport on Windows: TCP it is
        return km
    if not _IPC_DIR:
        _IPC_DIR.append(tempfile.mkdtemp(prefix="kernels-"))
        atexit.register(shutil.rmtree, _IPC_DIR[0], True)
    km.transport = "ipc"
    km.ip = os.path.join(_IPC_DIR[0], uuid.uuid4().hex[:12])  # the sockets are this path + "-1" ... "-5"
    return km


def _text_outputs(cell: NotebookNode) -> list[str]:
    texts: list[str] = []
    last_stream: str | None = None
    for out in cell.outputs:
        if out.output_type == "stream":
            # The kernel may split one print across chunks: merge consecutive ones of a stream.
            if last_stream == out.name:
                texts[-1] += out.text
            else:
                texts.append(f"{out.name}: {out.text}")
            last_stream = out.name
            continue
        last_stream = None
        if out.output_type in ("execute_result", "display_data"):
            texts.append(out.get("data", {}).get("text/plain", ""))
        elif out.output_type == "error":
            texts.append(out.ename)
    return texts


def execute_cells(path: Path, root: Path, timeout: int = CELL_TIMEOUT, recheck_marked: bool = False,
                  env: dict[str, str] | None = None,
                  collect: list[str] | None = None,
                  skip: frozenset[int] = frozenset(),
                  kernel: SharedKernel | None = None) -> Iterator[tuple[int, CellError | None]]:
    """Run a notebook's code cells in order, yielding (cell number, error or None); cells in ``skip`` are not run.

    Stop early by breaking out of the loop: the kernel is shut down either way (a ``kernel`` passed in is
    kept for the next notebook, started clean). With ``recheck_marked``, a cell marked
    ``# NBVAL_CHECK_OUTPUT`` runs twice and must print the same text both times. ``collect``: a list that
    gets each cell's text output.
    """
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    if kernel is None:
        client = _client(nb, timeout)
        session = client.setup_kernel(env=kernel_env(root, env), cwd=str(path.parent))
    else:
        assert env == kernel.env and timeout == kernel.timeout, "a shared kernel runs with its own env and timeout"
        client, session = kernel.client_for(nb, path.parent), contextlib.nullcontext()
    with session:
        for index, cell in enumerate(nb.cells, start=1):
            if cell.cell_type != "code" or index in skip:
                continue
            error = _run(client, cell, index, (CellExecutionError, CellTimeoutError,
                                               DeadKernelError))
            if error is None and FIGURE_MARK in cell.source and not _shows_image(cell):
                error = CellError(index, cell.source, "FIGURE", "the cell promises a figure (# FIGURE) and shows "
                                  "none: display it (a plot.Figure returned inside a function, or drawn inside a "
                                  "widget callback, is not shown unless displayed)", "")
            if error is None and recheck_marked and "# NBVAL_CHECK_OUTPUT" in cell.source:
                first = _text_outputs(cell)
                error = _run(client, cell, index, (CellExecutionError, CellTimeoutError,
                                                   DeadKernelError))
                if error is None and _text_outputs(cell) != first:
                    error = CellError(index, cell.source, "NBVAL_CHECK_OUTPUT",
                                      "the output differs between two runs",
                                      f"first run: {first!r}\nsecond run: {_text_outputs(cell)!r}")
            if kernel is not None and error is not None and error.ename in ("CellTimeoutError", "DeadKernelError"):
                kernel.discard()  # busy or gone: the next notebook gets a fresh kernel
            if collect is not None:
                collect.append("".join(_text_outputs(cell)))
            yield index, error


def _client(nb: NotebookNode, timeout: int) -> Any:
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=timeout, kernel_name=nbt.KERNEL, allow_errors=False)
    client.km = use_ipc(client.create_kernel_manager())
    client.km.shutdown_wait_time = 2.0  # ipykernel sometimes lingers ~3 s after shutdown
    return client


# Run once in a fresh shared kernel: what a notebook starts from, kept in a module the notebooks do not see,
# with the function that puts it back: the kernel's first namespace (not %reset, which also drops __main__'s
# __spec__, which launch reads), environment, sys.path, folder and warning filters; no figure left open
_SNAPSHOT = """def _kernel_start():
    import os, sys, types, warnings
    ip, start = get_ipython(), types.ModuleType("_kernel_start")
    environ, path, filters = dict(os.environ), list(sys.path), list(warnings.filters)

    def restore(cwd):
        os.environ.clear(); os.environ.update(environ)
        sys.path[:] = path
        os.chdir(cwd)
        warnings.filters[:] = filters
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
        ip.user_ns.clear(); ip.user_ns.update(start.names)

    start.restore, sys.modules[start.__name__] = restore, start
    return start
_kernel_start().names = {k: v for k, v in get_ipython().user_ns.items() if k != "_kernel_start"}
del _kernel_start"""
_RESET = """__import__("sys").modules["_kernel_start"].restore({cwd!r})"""


class SharedKernel:
    """One kernel that runs many notebooks one after another, each from a clean start.

    A kernel of its own costs a notebook ~8 s of CPU before its first cell does anything: the kernel,
    ``import torch`` and minifsdp in it, and the forkserver its first ``launch`` starts (minifsdp/launch.py).
    The blank labs (tests/test_notebooks.py) share one instead. Each notebook starts with the namespace a
    fresh kernel has, the environment, ``sys.path``, warning filters and folder the kernel started with, and
    no open figure; what stays is what makes it cheap: the imported modules and the forkserver. A notebook
    that needs a name it never defined still fails with NameError. A cell that times out or kills the
    kernel ends it (``discard``): the next notebook starts a fresh one.

        with SharedKernel(ROOT, env={"MINIFSDP_FAKE_GPU": "1"}, timeout=120) as kernel:
            for lab in labs:
                run_blank_lab(lab, solution_of(lab), ROOT, env=kernel.env, kernel=kernel)
    """

    def __init__(self, root: Path, env: dict[str, str] | None = None, timeout: int = CELL_TIMEOUT):
        self.root, self.env, self.timeout = root, env, timeout
        self._client: Any = None
        self._session: contextlib.ExitStack | None = None
        self.started = 0  # kernels started so far (tests read it)

    def client_for(self, nb: NotebookNode, cwd: Path) -> Any:
        """A client on the shared kernel, reset and pointed at ``nb``, working in ``cwd``."""
        scratch = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell()])
        if self._client is None:
            self._client = _client(scratch, self.timeout)
            self._session = contextlib.ExitStack()
            self._session.enter_context(self._client.setup_kernel(env=kernel_env(self.root, self.env), cwd=str(cwd)))
            self.started += 1
            scratch.cells[0].source = _SNAPSHOT
        else:
            scratch.cells[0].source = _RESET.format(cwd=str(cwd))
        self._client.nb = scratch
        self._client.execute_cell(scratch.cells[0], 0)
        self._client.nb = nb
        self._client.reset_execution_trackers()
        return self._client

    def discard(self) -> None:
        """Shut the kernel down; the next notebook starts a new one."""
        if self._session is not None:
            session, self._session, self._client = self._session, None, None
            session.close()

    def __enter__(self) -> SharedKernel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.discard()


FIGURE_MARK = "# FIGURE"  # a code cell marked so must show at least one image (LAB-GUIDE §4: tests count images)


def _shows_image(cell: NotebookNode) -> bool:
    return any("image/png" in output.get("data", {}) for output in cell.get("outputs", []))


def _run(client, cell: NotebookNode, index: int, errors: tuple) -> CellError | None:
    try:
        client.execute_cell(cell, index - 1)
        return None
    except errors as exc:
        found = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if found:
            ename, evalue, tb = found[-1].ename, found[-1].evalue, "\n".join(found[-1].traceback)
        else:
            ename, evalue, tb = type(exc).__name__, str(exc), ""
        return CellError(index, cell.source, ename, _ANSI.sub("", evalue), _ANSI.sub("", tb))


def run_solution(path: Path, root: Path, timeout: int = CELL_TIMEOUT, env: dict[str, str] | None = None,
                 recheck_marked: bool = True) -> int:
    """Run every cell; raise NotebookRunError at the first failure. Returns cells run.

    ``env``: extra variables for the kernel, e.g. ``{"MINIFSDP_FAKE_GPU": "2"}`` (a 2-GPU VM) to run every
    ``launch``ed worker on a pretend GPU (minifsdp/fake_gpu.py: device discipline).
    """
    count = 0
    with contextlib.closing(execute_cells(path, root, timeout, recheck_marked, env)) as cells:
        for _, error in cells:
            if error is not None:
                raise NotebookRunError(error.report(path))
            count += 1
    return count


def run_lab(lab: Path, solution: Path, root: Path, timeout: int = CELL_TIMEOUT) -> str:
    """Run a lab up to its first exercise; it must stop there with NotImplementedError.

    Every cell before the first exercise cell must succeed.  The exercise cell,
    or its check cell right after (when the exercise only defines a function),
    must raise the exercise's NotImplementedError stub.  Returns a summary.
    """
    sol = nbformat.read(solution, as_version=4)
    exercises = [i for i, c in enumerate(sol.cells, start=1) if nbt.is_exercise(c)]
    if not exercises:
        return f"{lab}: no exercise; ran all {run_solution(lab, root, timeout)} code cells"
    target = exercises[0]
    hints = nbt.make_lab_source(sol.cells[target - 1].source, str(solution), target)[1]
    with contextlib.closing(execute_cells(lab, root, timeout)) as cells:
        for index, error in cells:
            if index < target:
                if error is not None:
                    raise NotebookRunError(error.report(lab, "failed before the first exercise"))
                continue
            if error is None:
                if index == target:
                    continue  # the exercise only defined something; its check cell calls it
                break
            text = f"{error.ename}: {error.evalue}\n{error.traceback}"
            if "NotImplementedError" in text and any(h in text for h in hints):
                return f"{lab}: stopped at cell {index} with the stub of exercise cell {target}"
            raise NotebookRunError(error.report(lab, "raised something other than the "
                                                     "exercise stub's NotImplementedError"))
    raise NotebookRunError(f"{lab}: neither exercise cell {target} nor the check cell after "
                           "it raised the stub's NotImplementedError; is the lab stale? "
                           "Run: python tools/make_labs.py")


def check_cells(nb: NotebookNode) -> list[int]:
    """1-based indices of the check cells: the code cell right after each exercise cell."""
    code = [i for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"]
    return [code[k + 1] for k, i in enumerate(code[:-1]) if nbt.is_exercise(nb.cells[i - 1])]


# Calls and names through which a cell may act past the names it binds: the environment, files, global RNG,
# objects by name. A cell that makes one (in its own code or in a function it defines) is never skipped.
_SIDE_EFFECTS = {"exec", "eval", "setattr", "delattr", "open", "chdir", "environ", "putenv", "manual_seed",
                 "write", "write_text", "write_bytes", "save", "savefig", "unlink", "rmtree", "mkdir", "makedirs",
                 "rename", "set_start_method", "set_default_dtype"}


def _names(source: str) -> tuple[set[str], set[str]] | None:
    """(names a cell binds, names it reads); None where it may act past its names (``_SIDE_EFFECTS``), does not
    parse, or changes an object it did not make (``x.attr = ...``, ``x[k] = ...`` of an outside ``x``)."""
    try:
        tree = ast.parse(source)  # a magic (%time, !ls) does not parse: not sorted
    except SyntaxError:
        return None
    binds, reads = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Global, ast.Nonlocal)) or \
                (isinstance(node, ast.Name) and node.id in _SIDE_EFFECTS) or \
                (isinstance(node, ast.Attribute) and node.attr in _SIDE_EFFECTS):
            return None
        if isinstance(node, ast.Name):
            (binds if isinstance(node.ctx, (ast.Store, ast.Del)) else reads).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            base = node.value
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                base = base.value
            if not (isinstance(base, ast.Name) and base.id in binds):
                return None
    return binds, reads


def _mentioned(source: str) -> set[str]:
    """Every name a cell mentions: what a cell whose names ``_names`` cannot sort may read."""
    try:
        return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


def cells_no_check_needs(nb: NotebookNode) -> frozenset[int]:
    """The cells after the first exercise that no exercise or check cell needs: demos, plots, tables.

    A blank lab skips them: they run (and are checked) in the solution's run, and leaving them out cannot
    make a check pass, because a cell stays whenever a name it binds is read by a cell that stays (followed
    back from every exercise and check cell), or when it may act past its names (``_names``). A cell that a
    check needs and that was skipped anyway would show as that check's NameError, a raw error, which fails."""
    code = [i for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"]
    exercises = [i for i in code if nbt.is_exercise(nb.cells[i - 1])]
    if not exercises:
        return frozenset()
    keep = set(exercises) | set(check_cells(nb)) | {i for i in code if i < exercises[0]}
    needed: set[str] = set()
    skip = set()
    for i in reversed(code):
        source = nb.cells[i - 1].source
        names = _names(source)
        if i in keep or names is None or names[0] & needed:
            needed |= names[1] if names is not None else _mentioned(source)
        else:
            skip.add(i)
    return frozenset(skip)


def run_blank_lab(lab: Path, solution: Path, root: Path, timeout: int = BLANK_CELL_TIMEOUT,
                  env: dict[str, str] | None = None, kernel: SharedKernel | None = None) -> str:
    """Run EVERY cell of a lab (exercises unwritten); every check cell must fail, in words.

    The proof that no cell outside the exercises holds a reference implementation:
    if one did (a solution left in a helper cell, a check that computes the answer
    itself instead of calling the learner's code), some check would pass on the
    blank lab. Cells before the first exercise must run cleanly; other cells may
    fail (they use what the learner has not written yet). A check cell fails in words: with the
    check's own ``CheckFailed`` (one sentence), never a raw traceback from inside the check.
    """
    sol = nbformat.read(solution, as_version=4)
    checks = check_cells(sol)
    exercises = [i for i, c in enumerate(sol.cells, start=1) if nbt.is_exercise(c)]
    if not exercises:
        return f"{lab}: no exercise"
    target = exercises[0]
    hints = nbt.make_lab_source(sol.cells[target - 1].source, str(solution), target)[1]
    passed_checks, first_stop, raw = [], None, []
    uses_labcheck = "labcheck" in "".join(c.source for c in sol.cells if c.cell_type == "code")
    skip = cells_no_check_needs(sol)  # judged on the solution's sources: its exercises read more than the stubs
    with contextlib.closing(execute_cells(lab, root, timeout, env=env, skip=skip, kernel=kernel)) as cells:
        for index, error in cells:
            if index < target and error is not None:
                raise NotebookRunError(error.report(lab, "failed before the first exercise"))
            if error is not None and first_stop is None:
                first_stop = error
            if index in checks and error is None:
                passed_checks.append(index)
            elif index in checks and uses_labcheck and error.ename != "CheckFailed":
                raw.append(error)
    if passed_checks:
        raise NotebookRunError(
            f"{lab}: check cell(s) {passed_checks} passed although no exercise is written: a cell outside the "
            "exercises holds a reference implementation, or the check does not run the learner's code")
    if raw:
        raise NotebookRunError(raw[0].report(lab, "check cell failed with a raw error, not a verdict in words "
                                                  "(CheckFailed)"))
    text = f"{first_stop.ename}: {first_stop.evalue}\n{first_stop.traceback}" if first_stop else ""
    if not ("NotImplementedError" in text and any(h in text for h in hints)):
        raise NotebookRunError(f"{lab}: the first exercise (cell {target}) or its check did not stop with the "
                               "exercise's NotImplementedError hint; is the lab stale? Run: python tools/make_labs.py"
                               + (f"\nfirst error: {first_stop.report(lab)}" if first_stop else ""))
    return f"{lab}: all {len(checks)} check cells fail on the blank lab"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path,
                        help="solutions/NN.ipynb (run all) or labs/NN.ipynb (run to exercise 1)")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT, help="seconds per cell")
    args = parser.parse_args(argv)
    status = 0
    for path in args.notebooks:
        path = path.resolve()
        try:
            if path.parent.name == "labs":
                print(run_lab(path, path.parent.parent / "solutions" / path.name, ROOT,
                              args.timeout))
            else:
                print(f"{path}: all {run_solution(path, ROOT, args.timeout)} code cells passed")
        except NotebookRunError as err:
            print(err, file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
