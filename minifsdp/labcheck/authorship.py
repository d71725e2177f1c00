"""Whose code ran? Telling the learner's mechanism from the library's, in any form.

A lab's exercise is a mechanism the library also has: lab 02's hook DDP is
``minifsdp.ddp.NaiveDataParallel``, lab 07's 1F1B plan is
``pipeline.make_plan("1f1b", ...)``. A learner looking for a shortcut can reach
the library's version in many ways - a direct call, an alias
(``from minifsdp.ddp import bucket_assignment as layout``), a notebook helper
that calls it, a subclass whose ``__init__`` calls ``super().__init__``, an empty
subclass of the library's autograd ``Function``, or an object the library built.
Reading names in the exercise's own body sees only the first. Two guards see
the rest (LAB-GUIDE §1):

* **statically**, :func:`library_reached` follows what the code can reach: the
  globals it names (aliases included), the notebook helpers and classes it
  uses (recursively, with their base classes), and attributes of modules it
  holds (``import minifsdp.ddp as d; d.bucket_assignment``);
* **at run time**, a :class:`Wire` watches every Python function call while the
  learner's code runs (``sys.setprofile``) and records a call into the code of
  the library's implementation - functions, every method of a class,
  an autograd ``Function``'s ``forward`` / ``backward`` - however it was reached.
  On leaving, a tripped wire raises :class:`LibraryShortcut` with one sentence.

    >>> from minifsdp.ddp import bucket_assignment
    >>> shortcut = lambda params, cap: bucket_assignment(params, cap / 2**20)
    >>> with Wire(bucket_assignment):                       # doctest: +SKIP
    ...     shortcut(params, 2**20)
    LibraryShortcut: your code ran the library's minifsdp.ddp.bucketed.bucket_assignment: ...

A wire is picklable (it holds the library objects, which pickle by reference),
so a check can watch inside its launched workers: ``with Wire(*LIBRARY): ...``
around the learner's part of the worker, or ``watched(fn, *LIBRARY)``, a
callable that runs ``fn`` under a wire.
"""
from __future__ import annotations

import dis
import inspect
import sys
import threading
import types
from typing import Any, Callable, Iterable

import torch

__all__ = ["LibraryShortcut", "Wire", "library_reached", "watched", "code_objects", "learner_owned"]


class LibraryShortcut(RuntimeError):
    """The learner's code ran (or reaches) the library's implementation of the exercise."""


def _name(obj: Any) -> str:
    if isinstance(obj, types.BuiltinFunctionType):  # a C function: its qualname is pybind's, not the reader's
        return f"{getattr(obj, '__module__', None) or 'torch'}.{obj.__name__}"
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', obj))}"


def _unwrapped(fn: Any) -> Any:
    """The function under decorators (``@contextmanager``, torch's ``__torch_dispatch__`` wrapper): the wrapper's
    code is shared by every decorated function, so watching it would trip on all of them."""
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def _functions_of(obj: Any) -> Iterable[tuple[types.FunctionType, str]]:
    """The Python functions that implement ``obj``: itself, or every method a class defines (any kind)."""
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    obj = _unwrapped(obj)
    if isinstance(obj, types.FunctionType):
        yield obj, _name(obj)
    elif isinstance(obj, type):
        for klass in obj.__mro__:
            if not (getattr(klass, "__module__", "") or "").startswith("minifsdp."):
                continue  # torch.nn.Module, autograd.Function...: the shared base is not the exercise
            for attr, value in vars(klass).items():
                for fn in (getattr(value, "__func__", None), getattr(value, "fget", None), value):
                    fn = _unwrapped(fn)
                    if isinstance(fn, types.FunctionType):
                        yield fn, f"{_name(klass)}.{attr}"
                        break


def code_objects(code: types.CodeType) -> list[types.CodeType]:
    """A code object and every code object nested in it (inner functions, lambdas, comprehensions)."""
    out = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += code_objects(const)
    return out


class Wire:
    """A tripwire on the library's implementation of an exercise; see the module docstring.

    ``with Wire(NaiveDataParallel, bucket_assignment): learner_code()`` raises
    :class:`LibraryShortcut` on leaving if any function (or method, or nested
    function) of those objects ran inside, or any C function among them (torch's
    kernels, seen as the profiler's ``c_call``); ``wire.hits`` lists what ran.
    """

    def __init__(self, *library: Any):
        self.library = library
        self.hits: list[str] = []
        self._previous: Any = None
        self._alive: list[types.CodeType] = []

    def _watch(self) -> dict[int, str]:
        """id of each watched code object -> the library name to report (ids: hashing a code object on
        every call would cost; the library's functions, module-level, keep their code objects alive)."""
        watched_codes: dict[int, str] = {}
        self._alive = []
        for obj in self.library:
            if isinstance(obj, types.BuiltinFunctionType):  # a C function (torch's kernels): seen as "c_call"
                watched_codes[id(obj)] = _name(obj)
                self._alive.append(obj)
            for fn, name in _functions_of(obj):
                for code in code_objects(fn.__code__):
                    watched_codes.setdefault(id(code), name)
                    self._alive.append(code)
        return watched_codes

    def __enter__(self) -> "Wire":
        codes = self._watch()
        hits = self.hits
        # A profiler sees one thread. On CUDA, autograd runs backward on a thread per device: keep backward
        # on this thread while the wire is up, so a library Function's backward cannot slip past it.
        self._one_thread = torch.autograd.set_multithreading_enabled(False)
        self._one_thread.__enter__()

        def profile(frame: types.FrameType, event: str, arg: Any) -> None:
            if event == "call" and id(frame.f_code) in codes:
                hits.append(codes[id(frame.f_code)])
            elif event == "c_call" and id(arg) in codes:
                hits.append(codes[id(arg)])
        self._previous = sys.getprofile()
        self._previous_threads = threading.getprofile()
        sys.setprofile(profile)
        threading.setprofile(profile)  # threads the learner's code starts are watched too
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        sys.setprofile(self._previous)
        threading.setprofile(self._previous_threads)
        self._one_thread.__exit__(exc_type, exc, tb)
        if self.hits and not isinstance(exc, LibraryShortcut):
            raise LibraryShortcut(
                f"your code ran the library's {self.hits[0]}: the exercise is to build this mechanism "
                "yourself, not to call (or subclass, or return) the library's implementation of it") from None

    def __getstate__(self) -> dict:
        return {"library": self.library, "hits": [], "_previous": None, "_alive": [], "_one_thread": None,
                "_previous_threads": None}


class _Watched:
    """``fn`` that runs under a fresh :class:`Wire` each call (picklable: sent to workers by ``launch``)."""

    def __init__(self, fn: Callable[..., Any], library: tuple):
        self.fn, self.library = fn, library
        self.__name__ = getattr(fn, "__name__", "learner_code")
        self.__wrapped__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with Wire(*self.library):
            return self.fn(*args, **kwargs)


def watched(fn: Callable[..., Any], *library: Any) -> Callable[..., Any]:
    """``fn``, watched: each call runs under ``Wire(*library)``."""
    return _Watched(fn, library)


# ------------------------------------------------------------------ statically
def _names(code: types.CodeType) -> tuple[set[str], set[str], set[str]]:
    """(global names the code reads, attribute names it reads, modules it imports): ``d.NaiveDataParallel`` is
    a global ``d`` and an attribute ``NaiveDataParallel``, which only counts when read off a module; an import
    in the body (``from minifsdp.zero import OSS as O``) is a module and an attribute ``OSS``."""
    globals_read: set[str] = set()
    attributes: set[str] = set()
    imports: set[str] = set()
    for c in code_objects(code):
        for ins in dis.get_instructions(c):
            if not isinstance(ins.argval, str):
                continue
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                globals_read.add(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM"):
                attributes.add(ins.argval)
            elif ins.opname == "IMPORT_NAME":
                imports.add(ins.argval)
                attributes.update(ins.argval.split("."))
    return globals_read, attributes, imports


def learner_owned(obj: Any) -> bool:
    """Defined in the notebook (or a test exec'ing its cells): code to follow, not library code."""
    module = getattr(obj, "__module__", "") or ""
    return not module.startswith(("minifsdp", "torch", "builtins", "numpy", "matplotlib", "ipywidgets"))


def library_reached(fn: Any, *library: Any) -> list[str]:
    """Which of ``library`` the learner's ``fn`` can reach, as 'name (through path)' sentences' subjects.

    Follows the globals ``fn`` names (aliases), closure cells and defaults, the learner's own helpers and
    classes (methods and bases, recursively), and attributes of modules it holds. ``[]``: none reached.
    """
    targets: dict[int, str] = {}
    codes: dict[types.CodeType, str] = {}
    classes: list[type] = []
    for obj in library:
        targets[id(obj)] = _name(obj)
        if isinstance(obj, type):
            classes.append(obj)
        for f, name in _functions_of(obj):
            codes[f.__code__] = name

    found: list[str] = []
    seen: set[int] = set()

    def hit(obj: Any, path: str) -> bool:
        if id(obj) in targets:
            found.append(f"{targets[id(obj)]}{path}")
            return True
        if isinstance(obj, type) and obj not in classes and any(issubclass(obj, c) for c in classes):
            base = next(c for c in classes if issubclass(obj, c))
            found.append(f"{_name(base)} (your class {obj.__name__} subclasses it)")
            return True
        code = getattr(_unwrapped(getattr(obj, "__func__", obj)), "__code__", None)
        if code in codes:
            found.append(f"{codes[code]}{path}")
            return True
        return False

    def visit(obj: Any, via: str) -> None:
        if id(obj) in seen or found:
            return
        seen.add(id(obj))
        if isinstance(obj, _Watched):
            obj = obj.fn
        if hit(obj, via):
            return
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        obj = _unwrapped(obj)
        if isinstance(obj, type):
            if not learner_owned(obj):
                return
            for base in obj.__bases__:
                visit(base, via or f" (through your class {obj.__name__})")
            for value in vars(obj).values():
                inner = getattr(value, "__func__", getattr(value, "fget", value))
                if isinstance(inner, types.FunctionType):
                    visit(inner, via or f" (through your class {obj.__name__})")
            return
        if not isinstance(obj, types.FunctionType) or not learner_owned(obj):
            return
        path = via or ""
        global_names, names, imports = _names(obj.__code__)
        names |= global_names
        referenced: list[Any] = []
        for name in global_names:
            if name in obj.__globals__:
                referenced.append((obj.__globals__[name], name))
        for cell in obj.__closure__ or ():
            try:
                referenced.append((cell.cell_contents, "a closure variable"))
            except ValueError:
                pass
        referenced += [(d, "a default argument") for d in (obj.__defaults__ or ())]
        modules = [value for value, _ in referenced if isinstance(value, types.ModuleType)]
        modules += [sys.modules[m] for m in imports if m in sys.modules]  # imported inside the body
        while modules:  # attributes read off modules it holds: minifsdp.ddp.bucket_assignment, d.NaiveDataParallel
            module = modules.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name in names:
                value = getattr(module, name, None)
                if isinstance(value, types.ModuleType):
                    modules.append(value)
                elif value is not None and hit(value, path or f" (as {module.__name__}.{name})"):
                    return
        for value, name in referenced:
            if isinstance(value, types.ModuleType):
                continue
            helper = learner_owned(value) and callable(value) and value is not obj
            alias = name if isinstance(name, str) and name != getattr(value, "__name__", name) else None
            visit(value, path or (f" (through your helper {name})" if helper else
                                  f" (as {alias})" if alias and not name.startswith("a ") else ""))
            if found:
                return

    visit(fn, "")
    return found

