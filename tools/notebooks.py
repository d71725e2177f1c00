"""Notebook tooling for the minifsdp lab: sources -> solutions -> labs.

How a notebook is made
======================
Every notebook of the course is written once, as a plain Python script in the
jupytext "percent" format, ``solutions/src/NN_name.py``::

    # %% [markdown]
    # # 02 - Data parallel
    # Text of a markdown cell, each line written as a `# ` comment.

    # %%
    import torch

    # %%
    def average(grads, world):
        # BEGIN SOLUTION
        # HINT: divide the all-reduced sum by the world size.
        return [g / world for g in grads]
        # END SOLUTION

    # %%
    # CHECK: average() divides by the world size
    assert average([torch.ones(1) * 4], 2)[0].item() == 2.0, "average() must divide by world"

``python tools/make_labs.py`` then writes two real notebooks that open in
JupyterLab:

* ``solutions/NN_name.ipynb``: the cells as written, no outputs, kernel
  ``python3``, and cell ids derived from each cell's content, so rebuilding is
  byte-identical and a diff shows only the cells that changed.
* ``labs/NN_name.ipynb``: the same notebook where every block between
  ``# BEGIN SOLUTION`` and ``# END SOLUTION`` (in a code cell) is replaced by
  ``raise NotImplementedError("<hint>")`` at the indentation of the
  ``# BEGIN SOLUTION`` line.  The hint is the text of the ``# HINT:`` line(s)
  at the top of the block, or a default.  Lines outside a block stay as they
  are.  Lab cells keep the ids of their solution cells.

Never edit the ``.ipynb`` files by hand: edit the source and rebuild.  If you
did edit ``solutions/NN_name.ipynb`` in JupyterLab, ``python tools/make_labs.py
--to-source solutions/NN_name.ipynb`` writes your cells back to the source
(outputs and the source's header comment are not kept).

Source format rules: a line ``# %%`` starts a code cell, ``# %% [markdown]``
(or ``[md]``) a markdown cell, and either may end with ``tags=["a", "b"]``
(cell tags).  Markdown lines are ``# text`` or a bare ``#``.  Blank lines at
the start and end of a cell are dropped.  Before the first marker only
comment lines are allowed (a file header; it is not part of the notebook).

Conventions (checked by ``lint_notebook`` and the tests)
========================================================
* The first cell is markdown and starts with a ``# Title``.
* Each exercise cell (one containing ``# BEGIN SOLUTION``) is followed by a
  check cell: the next code cell starts with a ``# CHECK`` comment line. In a
  notebook that imports ``minifsdp.labcheck`` the check cell is exactly one
  call, ``check.name(...)`` (the logic lives in the package, LAB-GUIDE §2);
  otherwise it contains an ``assert`` or ``raise`` with a message in words.
* Solution notebooks carry no large outputs (they are built without any).
* Cells marked ``# NBVAL_CHECK_OUTPUT`` print the same thing every run.

Running notebooks (solutions end to end, labs up to their first exercise)
is ``tools/run_notebooks.py``.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
from dataclasses import dataclass

import nbformat
from nbformat import NotebookNode

DEFAULT_HINT = "Exercise: write this part, then run the check cell below."
MAX_OUTPUT_BYTES = 10_000  # per output of a committed solution notebook
MAX_HINT_CHARS = 100       # a stub's hint fits beside JupyterLab's file browser (~108 visible)
MAX_MARKDOWN_WORDS = 150   # a markdown cell outside an "optional deep dive" section (LAB-GUIDE §4)
DEEP_DIVE = "optional deep dive"
EXERCISES = (2, 4)          # exercise cells per lab
EXERCISE_LINES = (5, 25)    # learner lines (code inside BEGIN/END SOLUTION, no comments) per exercise cell
LAB_LINES = (40, 80)        # learner lines per lab
KERNEL = "python3"

_MARKER = re.compile(r"^#\s?%%(.*)$")
_BEGIN = re.compile(r"^(\s*)#\s*BEGIN SOLUTION\s*$")
_END = re.compile(r"^\s*#\s*END SOLUTION\s*$")
_HINT = re.compile(r"^\s*#\s*HINT:\s?(.*?)\s*$")
_METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": KERNEL},
    "language_info": {"name": "python"},
}


class NotebookSourceError(ValueError):
    """A percent-format source file that cannot be turned into a notebook."""


class SolutionMarkerError(ValueError):
    """Unbalanced ``# BEGIN SOLUTION`` / ``# END SOLUTION`` markers."""

    def __init__(self, notebook: str, cell: int, line: int, problem: str) -> None:
        self.notebook, self.cell, self.line, self.problem = notebook, cell, line, problem
        super().__init__(f"{notebook}: cell {cell}, line {line} of the cell: {problem}")


# --------------------------------------------------------------------------
# source (.py, percent format) <-> notebook
# --------------------------------------------------------------------------
@dataclass
class SourceCell:
    cell_type: str  # "code" or "markdown"
    source: str
    tags: list[str]
    first_line: int  # line number, in the .py file, of the cell's marker
    body_line: int = 0  # line number, in the .py file, of the cell's first source line


def _strip_blank_edges(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def parse_source(text: str, name: str = "<source>") -> list[SourceCell]:
    """Split a percent-format script into cells (see the module docstring)."""
    cells: list[SourceCell] = []
    current: SourceCell | None = None
    body: list[str] = []

    def close() -> None:
        if current is None:
            return
        lines = _strip_blank_edges(body)
        leading = next((i for i, line in enumerate(body) if line.strip()), 0)
        current.body_line = current.first_line + 1 + leading
        if current.cell_type == "markdown":
            lines = [_markdown_line(line, name, current.first_line) for line in lines]
        current.source = "\n".join(lines)
        cells.append(current)

    for lineno, line in enumerate(text.splitlines(), start=1):
        match = _MARKER.match(line)
        if match:
            close()
            current, body = _parse_marker(match.group(1), name, lineno), []
        elif current is None:
            if line.strip() and not line.lstrip().startswith("#"):
                raise NotebookSourceError(
                    f"{name}:{lineno}: code before the first '# %%' cell marker "
                    "(only comment lines may come before it)")
        else:
            body.append(line)
    close()
    if not cells:
        raise NotebookSourceError(f"{name}: no cells (start each cell with '# %%' "
                                  "or '# %% [markdown]')")
    return cells


def _parse_marker(rest: str, name: str, lineno: int) -> SourceCell:
    rest, cell_type, tags = rest.strip(), "code", []
    for prefix in ("[markdown]", "[md]"):
        if rest.startswith(prefix):
            rest, cell_type = rest[len(prefix):].strip(), "markdown"
    if rest.startswith("tags="):
        try:
            tags = json.loads(rest[len("tags="):])
            assert isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        except (ValueError, AssertionError):
            raise NotebookSourceError(f'{name}:{lineno}: tags must be a JSON list of '
                                      f'strings, like tags=["slow"]: {rest!r}') from None
        rest = ""
    if rest:
        raise NotebookSourceError(f"{name}:{lineno}: unknown cell marker '# %% {rest}' "
                                  "(use '# %%' or '# %% [markdown]', optionally tags=[...])")
    return SourceCell(cell_type, "", tags, lineno)


def _markdown_line(line: str, name: str, first_line: int) -> str:
    if not line.strip():
        return ""
    if line == "#" or line.startswith("# "):
        return line[2:]
    raise NotebookSourceError(f"{name}: markdown cell at line {first_line}: every line must "
                              f"be a '# ' comment or a bare '#', got {line!r}")


def _cell_ids(cells: list[NotebookNode]) -> list[str]:
    """Ids from each cell's type and text; repeated cells get a -2, -3 suffix."""
    ids, seen = [], {}
    for cell in cells:
        digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()[:8]
        seen[digest] = seen.get(digest, 0) + 1
        ids.append(digest if seen[digest] == 1 else f"{digest}-{seen[digest]}")
    return ids


def source_to_notebook(text: str, name: str = "<source>") -> NotebookNode:
    """Build the solution notebook (no outputs, stable ids) from a source text."""
    cells = []
    for cell in parse_source(text, name):
        metadata = {"tags": cell.tags} if cell.tags else {}
        make = nbformat.v4.new_markdown_cell if cell.cell_type == "markdown" else \
            nbformat.v4.new_code_cell
        cells.append(make(cell.source, metadata=metadata))
    for cell, cell_id in zip(cells, _cell_ids(cells)):
        cell.id = cell_id
    nb = nbformat.v4.new_notebook(cells=cells, metadata=copy.deepcopy(_METADATA))
    nbformat.validate(nb)
    return nb


def notebook_to_source(nb: NotebookNode) -> str:
    """Write a notebook's cells (not its outputs) as a percent-format source."""
    parts = []
    for cell in nb.cells:
        if cell.cell_type not in ("code", "markdown"):
            continue
        marker = "# %% [markdown]" if cell.cell_type == "markdown" else "# %%"
        tags = cell.get("metadata", {}).get("tags")
        if tags:
            marker += " tags=" + json.dumps(tags)
        lines = cell.source.splitlines()
        if cell.cell_type == "markdown":
            lines = [f"# {line}" if line else "#" for line in lines]
        parts.append("\n".join([marker, *lines]))
    return "\n\n".join(parts) + "\n"


def dumps(nb: NotebookNode) -> str:
    """The exact text written to disk for a notebook (sorted keys, final newline)."""
    return nbformat.writes(nb, version=4) + "\n"


# --------------------------------------------------------------------------
# solution notebook -> lab notebook
# --------------------------------------------------------------------------
def make_lab_source(source: str, notebook: str = "<notebook>", cell: int = 0
                    ) -> tuple[str, list[str]]:
    """Replace each solution block of one code cell by a stub; return (text, hints)."""
    out: list[str] = []
    hints: list[str] = []
    block: list[str] | None = None  # lines of the open block
    indent, begin_line = "", 0
    for lineno, line in enumerate(source.splitlines(), start=1):
        begin = _BEGIN.match(line)
        if begin:
            if block is not None:
                raise SolutionMarkerError(notebook, cell, lineno, "'# BEGIN SOLUTION' inside "
                                          f"the block opened at line {begin_line}")
            block, indent, begin_line = [], begin.group(1), lineno
        elif _END.match(line):
            if block is None:
                raise SolutionMarkerError(notebook, cell, lineno, "'# END SOLUTION' without "
                                          "a '# BEGIN SOLUTION' before it")
            hint = _block_hint(block)
            hints.append(hint)
            out.append(f"{indent}raise NotImplementedError({json.dumps(hint, ensure_ascii=False)})")
            block = None
        elif block is not None:
            block.append(line)
        else:
            out.append(line)
    if block is not None:
        raise SolutionMarkerError(notebook, cell, begin_line, "'# BEGIN SOLUTION' has no "
                                  "'# END SOLUTION' after it")
    return "\n".join(out), hints


def _block_hint(block: list[str]) -> str:
    lines = _strip_blank_edges(block)
    hint = []
    for line in lines:
        match = _HINT.match(line)
        if not match:
            break
        hint.append(match.group(1))
    return " ".join(h for h in hint if h) or DEFAULT_HINT


def is_exercise(cell: NotebookNode) -> bool:
    return cell.cell_type == "code" and any(_BEGIN.match(x) for x in cell.source.splitlines())


def make_lab_notebook(nb: NotebookNode, name: str = "<notebook>") -> NotebookNode:
    """The lab version of a solution notebook: stubs instead of solutions, no outputs."""
    lab = copy.deepcopy(nb)
    for index, cell in enumerate(lab.cells, start=1):
        if cell.cell_type != "code":
            continue
        cell.source = make_lab_source(cell.source, name, index)[0]
        cell.outputs, cell.execution_count = [], None
    return lab


# --------------------------------------------------------------------------
# conventions
# --------------------------------------------------------------------------
def _parse_cell(source: str) -> ast.Module | None:
    """Parse a cell as Python, with IPython magics (%x, !x) blanked out."""
    lines = [re.sub(r"^(\s*)[%!].*$", r"\1pass", line) for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _has_words(node: ast.AST | None) -> bool:
    texts = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
             and isinstance(n.value, str)] if node is not None else []
    return any(re.search(r"[A-Za-z]{2,}", t) for t in texts)


def has_worded_check(source: str) -> bool:
    """True if the code asserts or raises with a message that contains words."""
    tree = _parse_cell(source)
    if tree is None:  # fall back to plain text inspection
        return bool(re.search(r"^\s*(assert\b.*,|raise\s+\w+\()\s*f?[\"'][^\"']*[A-Za-z]{2,}",
                              source, re.MULTILINE))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and _has_words(node.msg):
            return True
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                and any(_has_words(arg) for arg in node.exc.args):
            return True
    return False


def is_check_call(source: str) -> bool:
    """True if the cell's code is exactly one call of a labcheck check: ``check.name(...)``.

    That is the check-cell form of LAB-GUIDE §2: the logic lives in
    ``minifsdp.labcheck``, so the notebook holds no reference implementation.
    """
    tree = _parse_cell(source)
    if tree is None or len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return False
    call = tree.body[0].value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "check")


def uses_labcheck(nb: NotebookNode) -> bool:
    """True if the notebook imports its checks from ``minifsdp.labcheck``."""
    return any(c.cell_type == "code" and "minifsdp.labcheck" in c.source for c in nb.cells)


def learner_lines(source: str) -> int:
    """Lines the learner writes in a cell: code (not blank, not comment) inside BEGIN/END SOLUTION blocks."""
    count, inside = 0, False
    for line in source.splitlines():
        text = line.strip()
        if text.startswith("# BEGIN SOLUTION"):
            inside = True
        elif text.startswith("# END SOLUTION"):
            inside = False
        elif inside and text and not text.startswith("#"):
            count += 1
    return count


def lint_notebook(nb: NotebookNode, name: str = "<notebook>",
                  max_output_bytes: int = MAX_OUTPUT_BYTES) -> list[str]:
    """Every convention problem of a solution notebook, as readable sentences."""
    problems = []
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "markdown" or \
            not first.source.lstrip().startswith("# "):
        problems.append(f"{name}: the first cell must be markdown starting with '# Title'")
    code = [(i, c) for i, c in enumerate(nb.cells, start=1) if c.cell_type == "code"]
    labcheck = uses_labcheck(nb)
    for position, (index, cell) in enumerate(code):
        for output in cell.get("outputs", []):
            size = len(json.dumps(output))
            if size > max_output_bytes:
                problems.append(f"{name}: cell {index} has an output of {size} bytes (limit "
                                f"{max_output_bytes}); rebuild with tools/make_labs.py")
        if not is_exercise(cell):
            continue
        stub, hints = make_lab_source(cell.source, name, index)
        for hint in hints:
            if len(hint) > MAX_HINT_CHARS:
                problems.append(f"{name}: cell {index}: the stub's hint is {len(hint)} characters (limit "
                                f"{MAX_HINT_CHARS}, what shows beside the file browser); keep it to the goal "
                                "and point to check.hint(...) for more")
        if _parse_cell(cell.source) is not None and _parse_cell(stub) is None:
            problems.append(f"{name}: cell {index}: the lab version of this cell is not valid "
                            "Python; put whole statements between the markers")
        nxt = code[position + 1] if position + 1 < len(code) else None
        if nxt is None or not nxt[1].source.lstrip().startswith("# CHECK"):
            problems.append(f"{name}: exercise cell {index} must be followed by a check cell "
                            "(the next code cell starts with a '# CHECK' comment)")
        elif labcheck and not is_check_call(nxt[1].source):
            problems.append(f"{name}: check cell {nxt[0]} must be one call, check.<name>(...), with "
                            "the checking logic in minifsdp/labcheck/ (no reference logic in a notebook)")
        elif not labcheck and not has_worded_check(nxt[1].source):
            problems.append(f"{name}: check cell {nxt[0]} needs an assert or raise with a "
                            "message in words, e.g. assert ok, \"the sum is wrong\"")
    sizes = [learner_lines(cell.source) for _, cell in code if is_exercise(cell)]
    if labcheck and sizes:
        if not EXERCISES[0] <= len(sizes) <= EXERCISES[1]:
            problems.append(f"{name}: {len(sizes)} exercise cells; a lab has {EXERCISES[0]}-{EXERCISES[1]}")
        for k, n in enumerate(sizes, start=1):
            if not EXERCISE_LINES[0] <= n <= EXERCISE_LINES[1]:
                problems.append(f"{name}: exercise {k} has {n} learner lines; an exercise has "
                                f"{EXERCISE_LINES[0]}-{EXERCISE_LINES[1]} (merge small ones, split large ones)")
        if not LAB_LINES[0] <= sum(sizes) <= LAB_LINES[1]:
            problems.append(f"{name}: {sum(sizes)} learner lines in all; a lab has {LAB_LINES[0]}-{LAB_LINES[1]}")
    deep_dive = False
    for index, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "markdown":
            continue
        heading = cell.source.lstrip().startswith("#")
        if heading:  # a new section: is it marked as a deep dive?
            deep_dive = DEEP_DIVE in cell.source.splitlines()[0].lower()
        words = len(cell.source.split())
        if words > MAX_MARKDOWN_WORDS and not deep_dive:
            problems.append(f"{name}: markdown cell {index} has {words} words (limit {MAX_MARKDOWN_WORDS} outside "
                            f"a section whose heading says '{DEEP_DIVE}'); split it or move the detail into one")
    return problems
