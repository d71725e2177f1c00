"""What every tests/test_labcheck_NN.py does with its lab's checks, written once.

A lab's test file lists its checks as rows ``(check, exercise names, *extra
args)`` - the exercise names are looked up in the notebook's namespace, the
extra args passed after them, as the check cell does - and its mistakes as
edits of the solution's text. Then one line gives the three tests every lab
has (the solution passes every check, printing one ✅ line each; the blank lab
fails every check with "not written yet"; each mistake still edits the
solution's text)::

    CHECKS = [(lab07.one_f_one_b, ("my_1f1b",)), (lab09.tp_bytes, ("tp_bytes_per_step",), 661504, 2, 32, 256)]
    test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
        lab_tests(L07, CHECKS, (LONG_WARMUP, BACKWARD_FIRST), words=("yours", "target"))

``load``, ``fails`` and ``edits_apply`` run the notebook's exercise cells the
way a notebook does: the learner's code is taken from the real notebook sources
(solutions/src/NN_*.py), exec'd in a ``__main__`` namespace, so ``launch`` sends
it to the workers by value. A mistake is the solution with one small edit.
``shortcut`` is a mistake that swaps an exercise for the library: the check must
refuse it, saying so ("library").
"""
from __future__ import annotations

import linecache
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import nbformat
import pytest

from minifsdp.labcheck.verdict import CheckFailed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import notebooks as nbt  # noqa: E402


def _cells(stem: str) -> list:
    text = (ROOT / "solutions" / "src" / f"{stem}.py").read_text(encoding="utf-8")
    return [c for c in nbt.parse_source(text, stem) if c.cell_type == "code"]


def load(stem: str, *, blank: bool = False, edits: tuple[tuple[str, str], ...] = (),
         extra: tuple[str, ...] = ()) -> dict:
    """The notebook's import cell, then every exercise cell (blank: the lab's version, or with ``edits``)."""
    cells = _cells(stem)
    ns: dict = {"__name__": "__main__"}
    exec(compile(cells[0].source, f"<{stem} imports>", "exec"), ns)
    for cell in cells[1:]:
        source = cell.source
        if any(marker in source for marker in extra) and "# BEGIN SOLUTION" not in source:
            exec(compile(source, f"<{stem}>", "exec"), ns)
            continue
        if "# BEGIN SOLUTION" not in source:
            continue
        if blank:
            source = nbt.make_lab_source(source)[0]
        for old, new in edits:
            if old in source:
                source = source.replace(old, new)
        exec(compile(source, f"<{stem} exercise>", "exec"), ns)
    return ns


def edits_apply(stem: str, edits: tuple[tuple[str, str], ...]) -> None:
    """A mistake that no longer matches the solution's text would test nothing: fail loudly instead."""
    text = (ROOT / "solutions" / "src" / f"{stem}.py").read_text(encoding="utf-8")
    missing = [old for old, _ in edits if old not in text]
    assert not missing, f"the mistake no longer matches {stem}.py: {missing}"


def fails(check, *args, words: str) -> str:
    with pytest.raises(CheckFailed) as info:
        check(*args)
    message = str(info.value)
    assert words.lower() in message.lower(), f"expected {words!r} in the verdict, got: {message}"
    assert "\n" not in message.strip(), "a verdict is one line"
    return message




__all__ = ["lab_tests", "mistakes_match", "solution_passes", "blank_fails", "fails", "load", "edits_apply",
           "shortcut_fails", "run_cell", "ROOT", "cells", "namespace", "fails_with"]


def mistakes_match(stem: str, *mistakes: tuple[tuple[str, str], ...]) -> None:
    """Each mistake (a tuple of (old, new) edits) still finds its text in the solution."""
    for edits in mistakes:
        edits_apply(stem, edits)


def solution_passes(stem: str, checks: list[tuple], capsys: Any) -> str:
    """Run the solution's exercises through every check; each prints exactly one ✅ verdict."""
    ns = load(stem)
    for check, names, *args in checks:
        check(*(ns[n] for n in names), *args)
    out = capsys.readouterr().out
    assert out.count("✅") == len(checks), out
    return out


def blank_fails(stem: str, checks: list[tuple]) -> None:
    """Run the blank lab's exercises (still raising NotImplementedError) through every check: each fails,
    saying the exercise is not written yet."""
    ns = load(stem, blank=True)
    for check, names, *args in checks:
        fails(check, *(ns[n] for n in names), *args, words="not written yet")


def lab_tests(stem: str, checks: list[tuple], mistakes: tuple, words: tuple[str, ...] = ()) -> tuple[Callable, ...]:
    """The three tests of a lab's checks, to bind to ``test_*`` names in the lab's test module:
    the solution passes (its verdicts contain each of ``words``), the blank lab fails, the mistakes still apply."""
    def solution(capsys: Any) -> None:
        out = solution_passes(stem, checks, capsys)
        missing = [w for w in words if w not in out]
        assert not missing, f"the verdicts lack {missing}: {out}"

    def blank() -> None:
        blank_fails(stem, checks)

    def edits() -> None:
        mistakes_match(stem, *mistakes)
    return solution, blank, edits


def run_cell(ns: dict, source: str) -> dict:
    """Run ``source`` in the notebook namespace ``ns`` (a ``__main__`` module: launch sends what it defines to
    the workers by value), as a learner's cell run after the lab's: a mistake or a shortcut that replaces an
    exercise. Returns ``ns``."""
    exec(compile(textwrap.dedent(source), "<learner's cell>", "exec"), ns)  # noqa: S102 - the test's own text
    return ns


def shortcut_fails(check: Callable, *args: Any) -> str:
    """A library shortcut (an exercise answered with the library's mechanism, in any form) fails the check,
    in one sentence naming the library."""
    return fails(check, *args, words="library")


# ------------------------------------------------------------------ notebook cells by needle (labs 03, 04)
_count = 0


def cells(notebook: str, *needles: str) -> list[str]:
    """The code cells of ``notebook`` that contain one of ``needles`` (in notebook order)."""
    nb = nbformat.read(ROOT / notebook, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and any(n in c.source for n in needles)]


def namespace(sources: list[str], edits: dict[str, str] | None = None) -> dict:
    """Execute ``sources`` (after replacing each key of ``edits`` by its value) in a fresh module namespace."""
    global _count
    _count += 1
    name = f"_lab_cells_{_count}"        # not in sys.modules: cloudpickle sends its functions by value
    text = "\n\n".join(sources)
    for old, new in (edits or {}).items():
        assert old in text, f"the mistake's target is not in the notebook any more: {old!r}"
        text = text.replace(old, new)
    filename = f"<{name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)   # inspect.getsource works
    ns = {"__name__": name}
    exec(compile(text, filename, "exec"), ns)  # noqa: S102 - our own notebook cells
    return ns


def fails_with(call, *words: str) -> str:
    """``call()`` must raise CheckFailed whose message contains every one of ``words``."""
    with pytest.raises(CheckFailed) as err:
        call()
    message = str(err.value)
    for w in words:
        assert re.search(w, message), f"{w!r} not in the verdict: {message}"
    return message


def hints_come_one_at_a_time(hint: Any, names: tuple[str, ...], capsys: Any) -> None:
    """Each exercise's hints: the first, then the second, each line at most 100 characters; ``again`` restarts."""
    for name in names:
        hint.again(name)
        hint(name)
        first = capsys.readouterr().out
        assert first.startswith("hint 1 of") and all(len(line) <= 100 for line in first.splitlines()), first
        hint(name)
        assert capsys.readouterr().out.startswith("hint 2 of")
        hint.again(name)
