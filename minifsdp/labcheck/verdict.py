"""How a check speaks: one line, passed or what is wrong, and whose code ran.

Every check in ``minifsdp.labcheck`` ends in :func:`passed` or :func:`failed`.
``failed`` prints the reason and raises :class:`CheckFailed`, so a failing
check cell is red in the notebook (and fails nbval) while the learner reads
one sentence, not a traceback::

    >>> passed("ring all-gather", "4 ranks, 3 rounds of send/recv, 96 B sent per rank (target 96 B)")
    ✅ ring all-gather: 4 ranks, 3 rounds of send/recv, 96 B sent per rank (target 96 B)
"""
from __future__ import annotations

import inspect
from typing import Any, Callable


class CheckFailed(AssertionError):
    """A learner's exercise is not right yet; the message says why, in words."""

    def _render_traceback_(self) -> list[str]:  # IPython: show the sentence, not a traceback
        return [f"❌ {self}"]


def passed(what: str, detail: str = "") -> None:
    """Print the one-line success verdict for the exercise ``what``."""
    print(f"✅ {what}: {detail}" if detail else f"✅ {what}: passed")


def failed(what: str, why: str) -> None:
    """Stop the check: ``what`` is not right yet, because ``why`` (a sentence for the learner)."""
    raise CheckFailed(f"{what}: {why}")


def not_implemented(fn: Callable[..., Any]) -> bool:
    """True when ``fn`` still raises the blank lab's ``NotImplementedError`` placeholder."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "raise NotImplementedError" in src


def is_library(fn: Any, *library: Any) -> bool:
    """True when ``fn`` is (or merely wraps by name) one of the library's own callables.

    A learner who answers an exercise with ``return minifsdp.comm.all_gather(...)``
    is told so: the check wants their own mechanism.
    """
    if any(fn is lib for lib in library):
        return True
    module = getattr(fn, "__module__", "") or ""
    return module.startswith("minifsdp.") and not module.startswith("minifsdp.labcheck")
