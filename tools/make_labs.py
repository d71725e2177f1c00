"""Build the course notebooks: solutions/src/*.py -> solutions/*.ipynb -> labs/*.ipynb.

Usage (from the repository root)::

    python tools/make_labs.py            # (re)build every generated notebook
    python tools/make_labs.py --check    # exit 1 if a generated notebook is stale
    python tools/make_labs.py --to-source solutions/04_fsdp.ipynb
                                         # notebook edited in JupyterLab -> its source

The source ``solutions/src/NN_name.py`` is what you edit (percent format, see
``tools/notebooks.py``).  ``solutions/NN_name.ipynb`` is the same notebook,
solved; ``labs/NN_name.ipynb`` has each ``# BEGIN SOLUTION`` ... ``# END
SOLUTION`` block replaced by ``raise NotImplementedError("<hint>")``.  Both are
generated and committed; a build only rewrites files whose text changed, and
building twice gives byte-identical files.

After writing (or, with ``--check``, instead of writing) the notebooks, the
course conventions are checked (title cell, a ``# CHECK`` cell after every
exercise, ...) and any problem makes the command exit with status 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import notebooks as nbt  # noqa: E402  (tools/notebooks.py)

ROOT = Path(__file__).resolve().parent.parent
FIX = "python tools/make_labs.py"


def expected_files(root: Path) -> tuple[dict[Path, str], list[str]]:
    """Every generated file with its expected text, and the convention problems."""
    files: dict[Path, str] = {}
    problems: list[str] = []
    for src in sorted((root / "solutions" / "src").glob("*.py")):
        if src.name.startswith(("_", ".")):
            continue
        rel_src = src.relative_to(root).as_posix()
        solution_path = root / "solutions" / f"{src.stem}.ipynb"
        solution_name = solution_path.relative_to(root).as_posix()
        solution = nbt.source_to_notebook(src.read_text(encoding="utf-8"), rel_src)
        try:
            lab = nbt.make_lab_notebook(solution, solution_name)
        except nbt.SolutionMarkerError as err:  # say where it is in the source too
            cell = nbt.parse_source(src.read_text(encoding="utf-8"), rel_src)[err.cell - 1]
            raise nbt.SolutionMarkerError(
                f"{solution_name} (source {rel_src}:{cell.body_line + err.line - 1})",
                err.cell, err.line, err.problem) from None
        files[solution_path] = nbt.dumps(solution)
        files[root / "labs" / f"{src.stem}.ipynb"] = nbt.dumps(lab)
        problems += nbt.lint_notebook(solution, rel_src)
    return files, problems


def orphans(root: Path, files: dict[Path, str]) -> list[Path]:
    """Notebooks in solutions/ or labs/ that no source generates."""
    found = sorted((root / "solutions").glob("*.ipynb")) + sorted((root / "labs").glob("*.ipynb"))
    return [p for p in found if p not in files]


def to_source(notebook: Path, root: Path) -> Path:
    """Write an (edited) solution notebook's cells back to solutions/src/<name>.py."""
    nb = nbt.nbformat.read(notebook, as_version=4)
    target = root / "solutions" / "src" / f"{notebook.stem}.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(nbt.notebook_to_source(nb), encoding="utf-8")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated notebook is stale")
    parser.add_argument("--to-source", nargs="+", type=Path, metavar="NOTEBOOK",
                        help="write these solution notebooks back to solutions/src/*.py")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="repository root (default: the one holding this script)")
    args = parser.parse_args(argv)
    root = args.root.resolve()

    if args.to_source:
        for notebook in args.to_source:
            print(f"wrote {to_source(notebook, root).relative_to(root)}")
        print(f"now run: {FIX}")
        return 0
    try:
        files, problems = expected_files(root)
    except (nbt.NotebookSourceError, nbt.SolutionMarkerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    stale = [p for p, text in files.items()
             if not p.exists() or p.read_text(encoding="utf-8") != text]
    status = 0
    if args.check:
        if stale:
            names = "\n  ".join(p.relative_to(root).as_posix() for p in stale)
            print(f"stale or missing generated notebooks:\n  {names}\n"
                  f"fix: {FIX}  (edit solutions/src/*.py, never the .ipynb)", file=sys.stderr)
            status = 1
        else:
            print(f"{len(files)} generated notebooks are up to date")
    else:
        for path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[path], encoding="utf-8")
            print(f"wrote {path.relative_to(root).as_posix()}")
        print(f"{len(files)} notebooks, {len(stale)} rewritten")
    for path in orphans(root, files):
        rel = path.relative_to(root).as_posix()
        fix = (f"create its source with: {FIX} --to-source {rel}"
               if path.parent.name == "solutions" else "delete it or add its source")
        print(f"{rel} is not generated from any solutions/src/*.py; {fix}", file=sys.stderr)
        status = 1 if args.check else status
    for problem in problems:
        print(f"convention: {problem}", file=sys.stderr)
    return 1 if problems else status


if __name__ == "__main__":
    sys.exit(main())
