"""Run the course notebooks with nbclient through tools/run_notebooks.py
(kernel python3, cwd = the notebook's folder, repo root on PYTHONPATH).

* every solutions/NN.ipynb runs end to end; a failure shows the cell's source
  and traceback; cells marked ``# NBVAL_CHECK_OUTPUT`` run twice and must
  print the same text;
* every labs/NN.ipynb runs cleanly up to its first exercise, which must stop
  with the exercise's ``NotImplementedError`` stub; then every other cell runs
  too, and every check cell must fail (no reference implementation outside the
  exercises);
* every solution runs as on a 2-GPU VM and (opt-in) a 1-GPU VM (``MINIFSDP_FAKE_GPU=2`` / ``1``:
  device discipline, no worker hands a CPU tensor to a collective, and CPU
  ranks where a lesson needs more ranks than GPUs; see minifsdp/fake_gpu.py).

``make test`` executes the solutions with ``pytest --nbval-lax`` (pyproject's
testpaths include solutions/), under ``MINIFSDP_FAKE_GPU=2`` (conftest.py); the run
here under ``MINIFSDP_FAKE_GPU=1`` is opt-in (``make test-gpu-counts``), the 2-GPU run here skips a
notebook that nbval runs in the same session, and the nbclient run of the
solutions, which adds the twice-run NBVAL_CHECK_OUTPUT comparison, is opt-in:
``MINIFSDP_NB_DETERMINISM=1 pytest tests/test_notebooks.py``.  The runner is first tested on
tests/fixtures/nb_example.py, built into a temporary folder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nb_example.py"
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402
import run_notebooks as runner  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
NO_NOTEBOOKS = pytest.param(None, marks=pytest.mark.skip(reason="no notebooks in solutions/ yet"))


def _ids(path: Path | None) -> str:
    return path.stem if path else "none"


def build(root: Path, sources: dict[str, str]) -> Path:
    """Write sources into root/solutions/src and build their notebooks."""
    (root / "solutions" / "src").mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (root / "solutions" / "src" / name).write_text(text, encoding="utf-8")
    assert make_labs.main(["--root", str(root)]) in (0, 1)  # 1: a convention problem is fine here
    return root


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("example"),
                 {"nb_example.py": FIXTURE.read_text(encoding="utf-8")})


# ---------------------------------------------------------------- the runner itself
def test_fixture_solution_runs(example: Path) -> None:
    assert runner.run_solution(example / "solutions" / "nb_example.ipynb", ROOT) == 6


def test_fixture_lab_stops_at_first_exercise(example: Path) -> None:
    summary = runner.run_lab(example / "labs" / "nb_example.ipynb",
                          example / "solutions" / "nb_example.ipynb", ROOT)
    assert "stopped at cell 5 with the stub of exercise cell 5" in summary


ENV_AND_FUNCTION = """\
# %% [markdown]
# # Environment, and an exercise that only defines a function

# %%
import os, sys
from pathlib import Path
assert Path.cwd() == Path(r"{folder}"), f"cwd is {{Path.cwd()}}"
assert r"{root}" in os.environ["PYTHONPATH"].split(os.pathsep), "repo root not on PYTHONPATH"
assert r"{root}" in sys.path, "repo root not importable"

# %%
def double(x):
    # BEGIN SOLUTION
    # HINT: twice x.
    return 2 * x
    # END SOLUTION

# %%
# CHECK
assert double(2) == 4, "double(2) should be 4"
"""


def test_kernel_env_and_exercise_raising_in_its_check_cell(tmp_path: Path) -> None:
    fake_root = tmp_path / "fake repo"
    text = ENV_AND_FUNCTION.format(folder=tmp_path / "labs", root=fake_root)
    build(tmp_path, {"01_env.py": text})
    summary = runner.run_lab(tmp_path / "labs" / "01_env.ipynb",
                          tmp_path / "solutions" / "01_env.ipynb", fake_root)
    assert "stopped at cell 4 with the stub of exercise cell 3" in summary


def test_failing_cell_is_reported_with_source_and_traceback(tmp_path: Path) -> None:
    build(tmp_path, {"02_fail.py": "# %% [markdown]\n# # Fails\n\n# %%\nok = 1\n\n"
                                   "# %%\ndef f(n):\n    return 1 / n\n\nf(0)\n"})
    with pytest.raises(runner.NotebookRunError) as err:
        runner.run_solution(tmp_path / "solutions" / "02_fail.ipynb", ROOT)
    message = str(err.value)
    assert "02_fail.ipynb: cell 3 failed: ZeroDivisionError: division by zero" in message
    assert "----- cell source -----\ndef f(n):\n    return 1 / n\n\nf(0)\n" in message
    assert "return 1 / n" in message.split("----- traceback -----")[1]
    assert "\x1b[" not in message


def test_lab_must_not_fail_before_its_exercise(tmp_path: Path) -> None:
    fixture = FIXTURE.read_text(encoding="utf-8")
    build(tmp_path, {"03_broken.py": fixture.replace("import math", "import no_such_module_x")})
    with pytest.raises(runner.NotebookRunError, match="cell 2 failed before the first exercise: "
                                                   "ModuleNotFoundError"):
        runner.run_lab(tmp_path / "labs" / "03_broken.ipynb",
                    tmp_path / "solutions" / "03_broken.ipynb", ROOT)


REFERENCE_IN_CHECK = """\
# %% [markdown]
# # A check that does not run the learner's code

# %%
def double(x):
    # BEGIN SOLUTION
    # HINT: twice x.
    return 2 * x
    # END SOLUTION

# %%
# CHECK: computes the answer itself (a reference implementation outside the exercise)
reference = lambda x: 2 * x
assert reference(2) == 4, "double(2) should be 4"
"""


def test_blank_lab_catches_a_check_that_passes_without_the_exercise(tmp_path: Path) -> None:
    build(tmp_path, {"05_ref.py": REFERENCE_IN_CHECK})
    with pytest.raises(runner.NotebookRunError, match=r"check cell\(s\) \[3\] passed although no exercise"):
        runner.run_blank_lab(tmp_path / "labs" / "05_ref.ipynb", tmp_path / "solutions" / "05_ref.ipynb", ROOT)
    build(tmp_path, {"06_ok.py": REFERENCE_IN_CHECK.replace("assert reference(2)", "assert double(2)")})
    assert "all 1 check cells fail" in runner.run_blank_lab(
        tmp_path / "labs" / "06_ok.ipynb", tmp_path / "solutions" / "06_ok.ipynb", ROOT)


REFERENCE_IN_A_DEMO = """\
# %% [markdown]
# # A reference implementation in a demo cell after the exercise

# %%
import os

# %%
def double(x):
    # BEGIN SOLUTION
    # HINT: twice x.
    return 2 * x
    # END SOLUTION

# %%
# CHECK
assert double(2) == 4, "double(2) should be 4"

# %%
shown = [double(i) for i in range(3)]   # a demo: only a print reads it
print(shown)

# %%
helper = lambda x: x + x                # a demo cell that holds a reference implementation

# %%
os.environ["LAB_SEEN"] = "1"            # acts past its names

# %%
def triple(x):
    # BEGIN SOLUTION
    # HINT: three times x.
    return 3 * x
    # END SOLUTION

# %%
# CHECK: leans on the demo's helper instead of the learner's code
assert helper(3) + 3 == 9
"""


def test_blank_lab_skips_only_cells_no_check_needs(tmp_path: Path) -> None:
    """The blank lab leaves out demos that no exercise or check reads (they run in the solution's run); a demo
    whose name a check reads stays, so a reference implementation there is still caught."""
    build(tmp_path, {"07_demo.py": REFERENCE_IN_A_DEMO})
    solution = tmp_path / "solutions" / "07_demo.ipynb"
    nb = nbformat.read(solution, as_version=4)
    code = [i for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"]
    skipped = runner.cells_no_check_needs(nb)
    assert [nb.cells[i - 1].source.splitlines()[0] for i in sorted(skipped)] == [
        "shown = [double(i) for i in range(3)]   # a demo: only a print reads it"]
    assert set(code) - skipped >= {code[0], code[1], code[2], code[4], code[5], code[6], code[7]}
    with pytest.raises(runner.NotebookRunError, match=r"check cell\(s\) \[\d+\] passed although no exercise"):
        runner.run_blank_lab(tmp_path / "labs" / "07_demo.ipynb", solution, ROOT)


def test_shared_kernel_starts_each_notebook_clean(tmp_path: Path) -> None:
    """What one notebook leaves behind (names, environment, sys.path, folder, warning filters, figures) is gone
    when the next starts on the shared kernel; a cell that times out ends the kernel and the next gets a new one."""
    (tmp_path / "sub").mkdir()
    dirty = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, sys, warnings\nimport matplotlib.pyplot as plt\nleft = 1\nos.environ['LEFT_BEHIND'] = '1'\n"
        "sys.path.append('/left')\nos.chdir('sub')\nwarnings.simplefilter('error')\nplt.figure()")])
    probe = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import os, sys, warnings\nimport matplotlib.pyplot as plt\n"
        "print('left' in globals(), 'LEFT_BEHIND' in os.environ, '/left' in sys.path, os.getcwd(),\n"
        "      ('error', None, Warning, None, 0) in warnings.filters, len(plt.get_fignums()), os.environ['CHOSEN'])")])
    slow = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time\ntime.sleep(30)")])
    for name, nb in (("dirty", dirty), ("probe", probe), ("slow", slow)):
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    out: list[str] = []
    with runner.SharedKernel(ROOT, env={"CHOSEN": "yes"}, timeout=5) as kernel:
        for name in ("dirty", "probe"):
            assert [e for _, e in runner.execute_cells(tmp_path / f"{name}.ipynb", ROOT, 5, env=kernel.env,
                                                        collect=out, kernel=kernel) if e] == []
        assert out[1].split() == ["stdout:", "False", "False", "False", str(tmp_path), "False", "0", "yes"], out
        errors = [e for _, e in runner.execute_cells(tmp_path / "slow.ipynb", ROOT, 5, env=kernel.env, kernel=kernel)]
        assert errors[0] is not None and errors[0].ename == "CellTimeoutError"
        list(runner.execute_cells(tmp_path / "probe.ipynb", ROOT, 5, env=kernel.env, collect=out, kernel=kernel))
        assert kernel.started == 2 and out[-1].split()[-1] == "yes", (kernel.started, out)


def test_nondeterministic_checked_output_is_caught(tmp_path: Path) -> None:
    build(tmp_path, {"04_random.py": "# %% [markdown]\n# # Random\n\n# %%\n"
                                     "# NBVAL_CHECK_OUTPUT\nimport random\nprint(random.random())\n"})
    with pytest.raises(runner.NotebookRunError, match="NBVAL_CHECK_OUTPUT: the output differs"):
        runner.run_solution(tmp_path / "solutions" / "04_random.ipynb", ROOT)


# ---------------------------------------------------------------- the real notebooks
@pytest.mark.skipif(os.environ.get("MINIFSDP_NB_DETERMINISM") != "1",
                    reason="solutions run under nbval-lax; set MINIFSDP_NB_DETERMINISM=1 for this stricter run")
@pytest.mark.parametrize("path", SOLUTIONS or [NO_NOTEBOOKS], ids=_ids)
def test_solution_notebook_runs(path: Path) -> None:
    try:
        runner.run_solution(path, ROOT)
    except runner.NotebookRunError as err:
        pytest.fail(str(err), pytrace=False)


BLANK_ENV = {"MINIFSDP_FAKE_GPU": "1"}


@pytest.fixture(scope="module")
def blank_kernel():
    """One kernel for every blank lab, each started clean (run_notebooks.SharedKernel: ~8 s of CPU saved a lab)."""
    with runner.SharedKernel(ROOT, env=BLANK_ENV, timeout=runner.BLANK_CELL_TIMEOUT) as kernel:
        yield kernel


@pytest.mark.parametrize("path", SOLUTIONS or [NO_NOTEBOOKS], ids=_ids)
def test_blank_lab_every_check_fails(path: Path, blank_kernel) -> None:
    """Every cell of labs/NN.ipynb runs with the exercises unwritten: the first exercise stops with its
    hint, and EVERY check cell fails, in words (CheckFailed, not a raw traceback). A check passing on the
    blank lab would mean that a cell outside the exercises holds a reference implementation, or that the
    check does not run the learner's code. Run as on a 1-GPU VM (MINIFSDP_FAKE_GPU=1), the smallest."""
    lab = ROOT / "labs" / path.name
    assert lab.exists(), f"{lab} is missing; run: python tools/make_labs.py"
    try:
        runner.run_blank_lab(lab, path, ROOT, env=BLANK_ENV, kernel=blank_kernel)
    except runner.NotebookRunError as err:
        pytest.fail(str(err), pytrace=False)


@pytest.mark.parametrize("gpus", ["1", "2"])
@pytest.mark.parametrize("path", SOLUTIONS or [NO_NOTEBOOKS], ids=_ids)
def test_solution_on_pretend_gpus(path: Path, gpus: str, request: pytest.FixtureRequest) -> None:
    """Every solution runs end to end as on a VM with 1 and with 2 GPUs (``MINIFSDP_FAKE_GPU=N``): a launch
    of at most N ranks runs on pretend GPUs, where every collective checks that its tensors are on
    dist.device() (a worker that would hand a CPU tensor to NCCL fails here, on a CPU-only machine), and a
    launch of more ranks runs CPU ranks, as on the VM. Every check must still pass: a check never needs more
    GPUs than the machine has, and never counts one rank as a proof.

    When nbval executes every cell of the notebook in this session (``make test``), that run is already the
    2-GPU one (conftest.py): this one would only repeat it. The 1-GPU run is opt-in
    (``MINIFSDP_NB_GPU_COUNTS=1``, ``make test-gpu-counts``): what it adds is covered in ``make test`` by
    parts -- the blank lab runs every cell outside the exercises as a 1-GPU VM, tests/test_labcheck_NN.py
    runs every check on the solution with CPU ranks (the path a 1-GPU VM takes for 2 ranks), and nbval
    runs the exercises' 1- and 2-rank launches on pretend GPUs -- and it costs a third of the suite's time."""
    if gpus == "1" and os.environ.get("MINIFSDP_NB_GPU_COUNTS") != "1":
        pytest.skip("the 1-GPU run of every solution is opt-in: MINIFSDP_NB_GPU_COUNTS=1 (make test-gpu-counts)")
    if gpus == "2" and any(item.path == path for item in request.session.items) \
            and "NBVAL_SKIP" not in path.read_text():
        pytest.skip("nbval runs every cell of this notebook in this session, as a 2-GPU VM (conftest.py)")
    try:
        runner.run_solution(path, ROOT, env={"MINIFSDP_FAKE_GPU": gpus}, recheck_marked=False)
    except runner.NotebookRunError as err:
        pytest.fail(str(err), pytrace=False)


def test_a_promised_figure_that_is_not_shown_fails(tmp_path: Path) -> None:
    shown = ("# %% [markdown]\n# # Figures\n\n# %%\n# FIGURE\nfrom minifsdp import plot\n"
             "fig = plot.Figure(figsize=(2, 1)); fig.add_subplot().plot([1, 2])\nfig\n")
    build(tmp_path, {"07_fig.py": shown})
    assert runner.run_solution(tmp_path / "solutions" / "07_fig.ipynb", ROOT) == 1
    build(tmp_path, {"08_nofig.py": shown.replace("\nfig\n", "\ndef draw():\n    return fig\n_ = draw()\n")})
    with pytest.raises(runner.NotebookRunError, match="promises a figure"):
        runner.run_solution(tmp_path / "solutions" / "08_nofig.ipynb", ROOT)
