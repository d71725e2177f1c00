"""What every tests/test_labcheck_NN.py does with its lab's checks, written once.

A lab's test file lists its checks as rows ``(check, exercise names, *extra
args)`` - the exercise names are looked up in the notebook's namespace, the
extra args passed after them, as the check cell does - and its mistakes as
edits of the solution's text. Then::

    CHECKS = [(lab07.one_f_one_b, ("my_1f1b",)), (lab09.tp_bytes, ("tp_bytes_per_step",), 661504, 2, 32, 256)]

    def test_solution_passes_every_check(capsys):
        out = solution_passes(L07, CHECKS, capsys)       # every check prints one ✅ line

    def test_blank_lab_fails_every_check():
        blank_fails(L07, CHECKS)                         # every check says "not written yet"

``load``, ``fails`` and ``edits_apply`` (test_labcheck_00_02.py) run the
notebook's exercise cells the way a notebook does; see there.
"""
from __future__ import annotations

from typing import Any

from test_labcheck_00_02 import edits_apply, fails, load

__all__ = ["mistakes_match", "solution_passes", "blank_fails", "fails", "load"]


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
