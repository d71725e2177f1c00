"""Tests of the lab tooling (tools/notebooks.py, tools/make_labs.py) and of the
course conventions on every real notebook in solutions/.

Nothing here starts a kernel; running notebooks is tests/test_notebooks.py.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nb_example.py"
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402
import notebooks as nbt  # noqa: E402

STEMS = sorted({p.stem for p in (ROOT / "solutions" / "src").glob("[!_]*.py")}
               | {p.stem for p in (ROOT / "solutions").glob("*.ipynb")})
NO_NOTEBOOKS = pytest.mark.skip(reason="no notebooks in solutions/ yet")
REAL = STEMS or [pytest.param(None, marks=NO_NOTEBOOKS)]


@pytest.fixture(scope="module")
def text() -> str:
    return FIXTURE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def solution(text: str) -> nbformat.NotebookNode:
    return nbt.source_to_notebook(text, "nb_example.py")


@pytest.fixture(scope="module")
def lab(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    return nbt.make_lab_notebook(solution, "nb_example.ipynb")


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """A scratch repository holding only the fixture source."""
    (tmp_path / "solutions" / "src").mkdir(parents=True)
    shutil.copy(FIXTURE, tmp_path / "solutions" / "src" / "nb_example.py")
    return tmp_path


# ---------------------------------------------------------------- source format
def test_parse_cells_types_tags_and_markdown(solution: nbformat.NotebookNode) -> None:
    types = [c.cell_type for c in solution.cells]
    assert types == ["markdown", "code", "code", "markdown", "code", "code", "markdown",
                     "code", "code"]
    assert solution.cells[0].source.splitlines()[:2] == ["# Example: a tiny exercise notebook", ""]
    assert solution.cells[1].source == "import math\n\nvalues = [3.0, 1.0, 2.0]"
    assert solution.cells[7].metadata == {"tags": ["exercise"]}
    assert all(c.metadata == {} for i, c in enumerate(solution.cells) if i != 7)


def test_round_trip_source_notebook_source(text: str, solution: nbformat.NotebookNode) -> None:
    body = text[text.index("# %%"):]  # the file header comment is not part of the notebook
    assert nbt.notebook_to_source(solution) == body
    again = nbt.source_to_notebook(nbt.notebook_to_source(solution))
    assert nbt.dumps(again) == nbt.dumps(solution)


def test_notebook_is_valid_stable_and_output_free(text: str,
                                                  solution: nbformat.NotebookNode) -> None:
    nbformat.validate(solution)
    assert nbt.dumps(nbt.source_to_notebook(text, "other-name")) == nbt.dumps(solution)
    assert solution.metadata.kernelspec.name == "python3"
    code = [c for c in solution.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    ids = [c.id for c in solution.cells]
    assert len(set(ids)) == len(ids)
    loaded = nbformat.reads(nbt.dumps(solution), as_version=4)  # what JupyterLab opens
    assert [c.source for c in loaded.cells] == [c.source for c in solution.cells]


def test_cell_ids_follow_content_not_position(text: str, solution) -> None:
    edited = nbt.source_to_notebook(text.replace("values = [3.0", "values = [4.0"))
    changed = [i for i, (a, b) in enumerate(zip(solution.cells, edited.cells)) if a.id != b.id]
    assert changed == [1]
    inserted = nbt.source_to_notebook(text.replace("# %%\nimport math", "# %%\nx = 1\n\n# %%\nimport math"))
    assert [c.id for c in inserted.cells[2:]] == [c.id for c in solution.cells[1:]]
    twins = nbt.source_to_notebook("# %% [markdown]\n# # T\n\n# %%\nx = 1\n\n# %%\nx = 1\n")
    assert twins.cells[1].id != twins.cells[2].id and twins.cells[2].id.endswith("-2")


@pytest.mark.parametrize("source, words", [
    ("x = 1\n# %%\ny = 2\n", "code before the first"),
    ("# %% [markdown]\nnot a comment\n", "every line must be a '# ' comment"),
    ("# %% [raw]\nx\n", "unknown cell marker"),
    ("# %% tags=oops\nx\n", "tags must be a JSON list"),
    ("# just a comment\n", "no cells"),
])
def test_bad_sources_are_explained(source: str, words: str) -> None:
    with pytest.raises(nbt.NotebookSourceError, match="bad.py") as err:
        nbt.source_to_notebook(source, "bad.py")
    assert words in str(err.value)


# ---------------------------------------------------------------- labs
def test_lab_replaces_blocks_with_hinted_stubs(lab: nbformat.NotebookNode) -> None:
    top = lab.cells[4].source
    assert top == ('raise NotImplementedError("add the values up and divide by how many '
                   'there are.")\nprint("mean computed")')
    func = lab.cells[7].source.splitlines()
    assert func[2] == f"    raise NotImplementedError({json.dumps(nbt.DEFAULT_HINT)})"
    assert func[3:5] == ["    if scale == 0:", "        return norm, [0.0 for _ in xs]"]
    assert func[5] == '    raise NotImplementedError("multiply every element by scale.")'
    assert func[6] == "    return norm, scaled"
    everything = "\n".join(c.source for c in lab.cells if c.cell_type == "code")
    for gone in ("BEGIN SOLUTION", "END SOLUTION", "HINT:", "math.sqrt", "x * scale"):
        assert gone not in everything


def test_lab_keeps_everything_else(solution, lab) -> None:
    assert len(lab.cells) == len(solution.cells)
    assert [c.id for c in lab.cells] == [c.id for c in solution.cells]
    for sol_cell, lab_cell in zip(solution.cells, lab.cells):
        if not nbt.is_exercise(sol_cell):
            assert lab_cell == sol_cell
    assert lab.metadata == solution.metadata
    compile(lab.cells[7].source, "lab cell", "exec")


def test_nested_indentation_and_multiline_hint() -> None:
    src = ("for i in range(3):\n    if i:\n        # BEGIN SOLUTION\n\n"
           "        # HINT: first part,\n        # HINT: second part.\n        y = i\n"
           "        # END SOLUTION\n    z = 0")
    out, hints = nbt.make_lab_source(src)
    assert out == ('for i in range(3):\n    if i:\n        raise NotImplementedError('
                   '"first part, second part.")\n    z = 0')
    assert hints == ["first part, second part."]
    assert nbt.make_lab_source("x = 1") == ("x = 1", [])


@pytest.mark.parametrize("source, line, words", [
    ("x = 1\n# END SOLUTION", 2, "without a '# BEGIN SOLUTION'"),
    ("# BEGIN SOLUTION\nx = 1", 1, "has no '# END SOLUTION'"),
    ("# BEGIN SOLUTION\n  # BEGIN SOLUTION\n# END SOLUTION", 2, "inside the block opened at line 1"),
])
def test_unbalanced_markers_name_notebook_and_cell(source: str, line: int, words: str) -> None:
    nb = nbt.source_to_notebook(f"# %% [markdown]\n# # T\n\n# %%\nok = 1\n\n# %%\n{source}\n")
    with pytest.raises(nbt.SolutionMarkerError) as err:
        nbt.make_lab_notebook(nb, "solutions/07_x.ipynb")
    assert (err.value.notebook, err.value.cell, err.value.line) == ("solutions/07_x.ipynb", 3, line)
    assert str(err.value).startswith(f"solutions/07_x.ipynb: cell 3, line {line} of the cell")
    assert words in str(err.value)


def test_make_labs_reports_marker_error_with_source_line(repo: Path, capsys) -> None:
    src = repo / "solutions" / "src" / "nb_example.py"
    src.write_text(src.read_text().replace("    # END SOLUTION\n    if scale", "    if scale"))
    assert make_labs.main(["--root", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "solutions/nb_example.ipynb (source solutions/src/nb_example.py:44)" in err
    assert "cell 8, line 7 of the cell: '# BEGIN SOLUTION' inside the block" in err
    assert src.read_text().splitlines()[43].strip() == "# BEGIN SOLUTION"
    assert not (repo / "labs").exists()


# ---------------------------------------------------------------- conventions
def test_fixture_follows_conventions(solution) -> None:
    assert nbt.lint_notebook(solution, "nb_example") == []


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.replace("# CHECK: the mean", "# the mean"), "exercise cell 5 must be followed"),
    (lambda s: s.replace(', f"the mean should be 2.0, got {mean}"', ""), "check cell 6 needs"),
    (lambda s: s.replace("# # Example", "# Example"), "first cell must be markdown"),
    (lambda s: s.replace("    # END SOLUTION\n    if scale == 0:\n", "    if scale == 0:\n    # END SOLUTION\n"),
     "not valid Python"),
])
def test_convention_violations_are_reported(text: str, edit, words: str) -> None:
    problems = nbt.lint_notebook(nbt.source_to_notebook(edit(text)), "nb_example")
    assert len(problems) == 1 and words in problems[0], problems


def test_large_outputs_are_reported(solution) -> None:
    nb = nbformat.reads(nbt.dumps(solution), as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="x" * 20_000)]
    assert ["cell 3 has an output of" in p for p in nbt.lint_notebook(nb, "n")] == [True]


@pytest.mark.parametrize("source, ok", [
    ('assert x == 1, "x should be one"', True),
    ('assert x == 1, f"expected one, got {x}"', True),
    ("assert x == 1", False),
    ('assert x == 1, f"{x}"', False),
    ('if x != 1:\n    raise ValueError(f"x is {x}, not one")', True),
    ("if x != 1:\n    raise ValueError(x)", False),
    ('%time y = 1\nassert y, "y must be set"', True),
    ('!ls\nassert y, "y must be set"\n  bad indent', True),  # text fallback
    ("print(x)", False),
])
def test_worded_check_detection(source: str, ok: bool) -> None:
    assert nbt.has_worded_check(source) is ok


# ---------------------------------------------------------------- make_labs CLI
def test_build_is_byte_identical_and_check_passes(repo: Path, capsys) -> None:
    assert make_labs.main(["--root", str(repo)]) == 0
    solution, lab = repo / "solutions" / "nb_example.ipynb", repo / "labs" / "nb_example.ipynb"
    first = (solution.read_bytes(), lab.read_bytes(), solution.stat().st_mtime_ns)
    assert "2 rewritten" in capsys.readouterr().out
    assert make_labs.main(["--root", str(repo)]) == 0
    assert "0 rewritten" in capsys.readouterr().out
    assert (solution.read_bytes(), lab.read_bytes(), solution.stat().st_mtime_ns) == first
    assert make_labs.main(["--root", str(repo), "--check"]) == 0
    assert b"NotImplementedError" in lab.read_bytes()
    assert b"NotImplementedError" not in solution.read_bytes()


def test_check_names_stale_files_and_the_fix(repo: Path, capsys) -> None:
    make_labs.main(["--root", str(repo)])
    lab = repo / "labs" / "nb_example.ipynb"
    lab.write_text(lab.read_text().replace("mean computed", "edited by hand"))
    (repo / "labs" / "99_orphan.ipynb").write_text(lab.read_text())
    capsys.readouterr()
    assert make_labs.main(["--root", str(repo), "--check"]) == 1
    err = capsys.readouterr().err
    assert "labs/nb_example.ipynb" in err and "solutions/nb_example.ipynb" not in err
    assert "python tools/make_labs.py" in err
    assert "labs/99_orphan.ipynb is not generated" in err
    assert "edited by hand" in lab.read_text()  # --check writes nothing


def test_to_source_brings_jupyterlab_edits_back(repo: Path, text: str) -> None:
    make_labs.main(["--root", str(repo)])
    path = repo / "solutions" / "nb_example.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].source += "\nextra = 1"
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi")]
    nbformat.write(nb, path)
    assert make_labs.main(["--root", str(repo), "--check"]) == 1
    assert make_labs.main(["--root", str(repo), "--to-source", str(path)]) == 0
    src = (repo / "solutions" / "src" / "nb_example.py").read_text()
    assert src == text[text.index("# %%"):].replace("2.0]\n", "2.0]\nextra = 1\n", 1)
    assert make_labs.main(["--root", str(repo)]) == 0
    assert make_labs.main(["--root", str(repo), "--check"]) == 0


# ---------------------------------------------------------------- the real notebooks
@pytest.mark.skipif(not STEMS, reason="no notebooks in solutions/ yet")
def test_repo_labs_in_sync(capsys) -> None:
    status = make_labs.main(["--root", str(ROOT), "--check"])
    assert status == 0, capsys.readouterr().err


@pytest.mark.parametrize("stem", REAL)
def test_repo_notebook_conventions(stem: str) -> None:
    assert (ROOT / "solutions" / "src" / f"{stem}.py").exists(), f"{stem} has no source"
    path = ROOT / "solutions" / f"{stem}.ipynb"
    assert path.exists(), f"{path} is missing; run: python tools/make_labs.py"
    assert (ROOT / "labs" / f"{stem}.ipynb").exists(), f"labs/{stem}.ipynb is missing"
    nb = nbformat.read(path, as_version=4)
    assert nbt.lint_notebook(nb, f"solutions/{stem}.ipynb") == []
    assert any(nbt.is_exercise(c) for c in nb.cells), f"{path} has no exercise"


# ---------------------------------------------------------------- no answer outside the exercises (LAB-GUIDE §1, §2)
# Code, as opposed to prose that names an API: a dotted call with arguments (comm.broadcast(p, src=0)),
# an assignment from a call (loss = models.lm_loss(...)), or a for-loop header over a call.
_CODE_IN_HINT = re.compile(r"\b\w+(\.\w+)+\([^)]*[,=][^)]*\)|\b\w+ = [\w.]+\(|\bfor \w+ in [\w.]+\(")


def _exercise_names(nb: nbformat.NotebookNode) -> set[str]:
    """Top-level functions and classes of exercise cells that hold an exercise block (what the learner writes)."""
    names = set()
    for cell in nb.cells:
        if nbt.is_exercise(cell):
            for node in ast.parse(cell.source).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and \
                        "BEGIN SOLUTION" in (ast.get_source_segment(cell.source, node) or ""):
                    names.add(node.name)
    return names


@pytest.mark.parametrize("text, code", [
    ("sum its gradient over ranks and divide by the world size", False),
    ("comm.broadcast(p.data, src=0) under torch.no_grad()", True),
    ("loss = models.lm_loss(model(x), y) / k", True),
    ("for p in model.parameters(): ...", True),
    ("the last micro-batch runs outside the model's no_sync context", False),
    ("(numel times element size) of B*T*d values", False),
    ("Busy = the sum of their durations; unpack(i) returns the tensor", False),
])
def test_code_in_hint_detection(text: str, code: bool) -> None:
    assert bool(_CODE_IN_HINT.search(text)) is code


@pytest.mark.parametrize("stem", REAL)
def test_repo_hints_are_concepts_not_code(stem: str) -> None:
    """A hint (the stub's message) teaches the idea; it never spells the code (LAB-GUIDE §1)."""
    nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    for index, cell in enumerate(nb.cells, start=1):
        if nbt.is_exercise(cell):
            for hint in nbt.make_lab_source(cell.source, stem, index)[1]:
                found = _CODE_IN_HINT.search(hint)
                assert not found, f"{stem}, cell {index}: the hint spells code ({found.group(0)!r}): {hint}"


@pytest.mark.parametrize("stem", REAL)
def test_repo_no_second_definition_of_an_exercise(stem: str) -> None:
    """No cell outside the exercises defines (again) what an exercise asks the learner to write."""
    nb = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    names = _exercise_names(nb)
    for index, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code" or nbt.is_exercise(cell):
            continue
        tree = nbt._parse_cell(cell.source)
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} if tree else set()
        assert not defined & names, f"{stem}, cell {index} defines {sorted(defined & names)}, an exercise's answer"
