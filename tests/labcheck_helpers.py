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

``load``, ``fails`` and ``edits_apply`` (test_labcheck_00_02.py) run the
notebook's exercise cells the way a notebook does; see there.
"""
from __future__ import annotations

from typing import Any, Callable

from test_labcheck_00_02 import edits_apply, fails, load

__all__ = ["lab_tests", "mistakes_match", "solution_passes", "blank_fails", "fails", "load"]


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
