"""How a check speaks: one line, passed or what is wrong, and whose code ran.

Every check in ``minifsdp.labcheck`` ends in :func:`passed` or :func:`failed`.
``failed`` raises :class:`CheckFailed`, so a failing check cell is red in the
notebook (and fails nbval) while the learner reads one sentence, not a
traceback::

    >>> passed("ring all-gather", figures("bytes sent per rank", 96, 96, 96, unit="B"))
    ✅ passed - ring all-gather: bytes sent per rank: yours 96 B, target 96 B, library 96 B

A failing check reads ``❌ not yet - <what>: <why>``: the word as well as the
mark, since not every machine has an emoji font.

The other helpers are what most checks need:

* :func:`run` runs the learner's worker on N ranks through ``launch`` and turns
  an unfinished exercise (the lab's ``NotImplementedError``) or a crash into one
  sentence instead of a traceback per rank;
* :func:`call` does the same for a function run in this process;
* :func:`require_written` (via :func:`is_library`) and :func:`uses` tell the
  blank lab and a call to the library apart from the learner's own code
  (LAB-GUIDE §1: "the check must tell the learner's own code from a call to the
  library");
* :func:`refuse_library` and :class:`Wire` (``authorship.py``) do it in any form:
  statically, through aliases, notebook helpers and subclasses, and at run time,
  where the library's implementation of the exercise trips a wire when it runs
  inside the learner's code (:func:`watched`: a function that runs under one);
  :func:`require_own` is the usual pair, written and not the library's;
* :class:`Hints` gives ``check.hint(name)``: the next hint, idea first.
"""
from __future__ import annotations

import dis
import inspect
import json
import re
import textwrap
from typing import Any, Callable

from ..launch import LaunchTimeout, WorkerError, launch
from .authorship import LibraryShortcut, Wire, code_objects, library_reached, watched  # noqa: F401 (re-exported)


class CheckFailed(AssertionError):
    """A learner's exercise is not right yet; the message says why, in words."""

    def _render_traceback_(self) -> list[str]:  # IPython: show the sentence, not a traceback
        return [f"❌ not yet - {self}"]


def passed(what: str, detail: str = "") -> None:
    """Print the one-line success verdict for the exercise ``what``."""
    print(f"✅ passed - {what}: {detail}" if detail else f"✅ passed - {what}")


def failed(what: str, why: str) -> None:
    """Stop the check: ``what`` is not right yet, because ``why`` (a sentence for the learner)."""
    raise CheckFailed(f"{what}: {why}")


def figures(label: str, yours: Any, target: Any, library: Any = None, unit: str = "") -> str:
    """'label: yours X, target Y, library Z' — the learner's figure beside the target and the library's."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            v = f"{v:.3g}"
        elif isinstance(v, int) and not isinstance(v, bool):
            v = f"{v:,}"
        return f"{v} {unit}".rstrip()
    text = f"{label}: yours {fmt(yours)}, target {fmt(target)}"
    return text + (f", library {fmt(library)}" if library is not None else "")


def _stub_hint(fn: Callable[..., Any]) -> str | None:
    """The hint of the blank lab's ``raise NotImplementedError("hint")`` in ``fn``, or None."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    if "raise NotImplementedError" not in src:
        return None
    found = re.search(r"raise NotImplementedError\((\"(?:[^\"\\]|\\.)*\")\)", src)
    return json.loads(found.group(1)) if found else ""


def require_written(what: str, *fns: Callable[..., Any]) -> None:
    """Fail when one of ``fns`` is the library's own function, or still the blank lab's stub ('not written yet')."""
    for fn in fns:
        if not callable(fn):
            failed(what, f"expected a function, got {type(fn).__name__}: pass the function itself, without ()")
        if is_library(fn):
            failed(what, f"that is the library's own {getattr(fn, '__qualname__', 'function')} "
                         f"({getattr(fn, '__module__', '?')}): pass your function, the exercise is to write it")
        hint = _stub_hint(fn)
        if hint is not None:
            failed(what, f"{getattr(fn, '__name__', 'the exercise')} is not written yet (it still raises "
                         f"NotImplementedError): {hint or 'write the exercise, run its cell, then this one'}")


def is_library(fn: Any, *library: Any) -> bool:
    """True when ``fn`` is (or merely wraps by name) one of the library's own callables.

    A learner who answers an exercise with ``return minifsdp.comm.all_gather(...)``
    is told so: the check wants their own mechanism.
    """
    if any(fn is lib for lib in library):
        return True
    module = getattr(fn, "__module__", "") or ""
    return module.startswith("minifsdp.") and not module.startswith("minifsdp.labcheck")


def uses(fn: Any, *names: str) -> list[str]:
    """Which of ``names`` the body of ``fn`` (nested functions included) refers to.

    ``uses(my_all_gather, "all_gather", "all_reduce")`` -> ``["all_reduce"]`` for a
    learner who wrote ``comm.all_reduce(...)``: global, attribute and method names
    are read from the compiled code, so comments and strings do not count.
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found: set[str] = set()
    for c in code_objects(code):
        found.update(c.co_names)
        found.update(ins.argval for ins in dis.get_instructions(c)
                     if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL") and isinstance(ins.argval, str))
    return [n for n in names if n in found]


def refuse_library(what: str, fn: Any, *library: Any) -> None:
    """Fail in one sentence when ``fn`` reaches one of ``library`` by any route a reader of its code can see:
    a direct call, an alias, a notebook helper that calls it, an import under another name, a subclass."""
    reached = library_reached(fn, *library)
    if reached:
        failed(what, f"your code reaches the library's {reached[0]}: the exercise is to build this mechanism "
                     "yourself, without minifsdp's implementation of it")


def require_own(what: str, library: tuple, *fns: Any) -> None:
    """The learner's own code: each of ``fns`` written (:func:`require_written`), then none reaching
    ``library`` (:func:`refuse_library`); the first problem is the verdict."""
    require_written(what, *fns)
    for fn in fns:
        refuse_library(what, fn, *library)


def check_world(world_size: int) -> int:
    """A check's world size: at least 2 ranks (one rank averages, gathers and shards nothing, so it proves
    nothing); on a machine with fewer GPUs ``launch`` runs them as CPU ranks and says so once."""
    return max(2, world_size)


def run(what: str, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
        **kwargs: Any) -> list:
    """``launch(fn, world_size, *args)``, with a failing worker turned into one sentence.

    An exercise still raising the lab's ``NotImplementedError`` reads "not written
    yet: <hint>"; a run that tripped a library :class:`Wire` says which of the
    library's functions ran; any other error names the ranks and the error, once.
    """
    try:
        return launch(fn, world_size, *args, timeout=timeout, **kwargs)
    except WorkerError as err:
        first = str(err).splitlines()[0]                 # "ranks 0-3 failed: Error: message (in fn, line 3 ...)"
        ranks, _, error = first.partition(" failed: ")
        if error.startswith("LibraryShortcut"):
            failed(what, error.split("LibraryShortcut:", 1)[1].split(" (in ", 1)[0].strip())
        if error.startswith("NotImplementedError"):
            hint = error.split("NotImplementedError:", 1)[1].strip()
            failed(what, f"not written yet (it raised NotImplementedError on {ranks}): {hint}")
        failed(what, f"your code raised on {ranks}: {error}")
    except LaunchTimeout as err:
        failed(what, f"no result after {timeout:g} s on ranks {err.running}: a rank waits for a message that "
                     "no peer sends (every send needs a matching receive, every collective all ranks)")
    raise AssertionError("unreachable")


def run_explained(what: str, fn: Callable[..., Any], world_size: int, *args: Any,
                  translations: tuple[tuple[str, str], ...], timeout: float = 120.0) -> list:
    """``run``, with the raw torch errors a learner meets said in one sentence of the lab.

    ``translations`` pairs a piece of torch's message with the lab's sentence for it; a verdict
    that already names the library (a shortcut) is left as it is.
    """
    try:
        return run(what, fn, world_size, *args, timeout=timeout)
    except CheckFailed as err:
        message = str(err)
        for needle, sentence in translations:
            if needle in message and "library" not in message:
                failed(what, sentence)
        raise


def call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` in this process, an unfinished exercise or a crash turned into one sentence."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as err:
        failed(what, f"not written yet (it raised NotImplementedError): {err}")
    except LibraryShortcut as err:
        failed(what, str(err))
    except CheckFailed:
        raise
    except Exception as err:  # noqa: BLE001 - the learner's code: say what it raised, in one line
        failed(what, f"your code raised {type(err).__name__}: {err}")
    raise AssertionError("unreachable")


class Hints:
    """``check.hint(name)``: the next hint for exercise ``name``, one at a time, idea first, never the code.

    A lab's check module holds ``hint = Hints({"ring_all_gather": ["idea ...", "layout ...", ...]})``;
    each call shows the next hint for that exercise, wrapped to 100 characters a line::

        >>> hint = Hints({"double": ["What does doubling add to x?", "x + x is one way."]})
        >>> hint("double")
        hint 1 of 2 for double: What does doubling add to x?
    """

    WIDTH = 100

    def __init__(self, table: dict[str, list[str]]):
        self.table = table
        self.shown: dict[str, int] = {}

    def __call__(self, name: Any) -> None:
        key = getattr(name, "__name__", name)
        if key not in self.table:
            names = ", ".join(f'"{n}"' for n in self.table)
            print(f"no hints for {key!r}: this lab has hints for {names}")
            return
        hints = self.table[key]
        k = self.shown.get(key, 0)
        if k >= len(hints):
            print(textwrap.fill(f"no more hints for {key}: run its check; the verdict says what is still wrong. "
                                "check.hint.again(name) starts over.", self.WIDTH))
            return
        self.shown[key] = k + 1
        print(textwrap.fill(f"hint {k + 1} of {len(hints)} for {key}: {hints[k]}", self.WIDTH,
                            subsequent_indent="  "))

    def again(self, name: Any) -> None:
        """Start the hints of ``name`` over."""
        self.shown.pop(getattr(name, "__name__", name), None)
