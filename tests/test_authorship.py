"""labcheck.authorship: the library's mechanism is seen in every form a shortcut-seeking learner tries.

Statically (``library_reached``): a direct call, an alias, a notebook helper, a module attribute, a
subclass. At run time (``Wire``): the same, plus what the code hides from a reader (a name built from
strings), an empty subclass of the library's autograd Function (its forward and backward run), an
object the library built and the learner returned, and all of it inside launched workers. The learner's
own code, using the building blocks (comm, models, torch), trips nothing.
"""
from __future__ import annotations

import pytest
import torch

from minifsdp.ddp import NaiveDataParallel, bucket_assignment
from minifsdp.labcheck.authorship import LibraryShortcut, Wire, library_reached, watched
from minifsdp.labcheck.verdict import CheckFailed, Hints, run
from minifsdp.tensor_parallel import mappings


def _cell(source: str) -> dict:
    ns = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), ns)
    return ns


CELL = _cell('''
import importlib, torch
import minifsdp
from minifsdp.ddp import bucket_assignment as layout, NaiveDataParallel
from minifsdp.tensor_parallel.mappings import _CopyToModelParallelRegion

def helper(params, cap):
    return layout(params, cap)

def alias(params, cap):
    return layout(params, cap)

def through_helper(params, cap):
    return helper(params, cap)

def module_attribute(params, cap):
    return minifsdp.ddp.bucket_assignment(params, cap)

def hidden(params, cap):
    return getattr(importlib.import_module("minifsdp." + "ddp"), "bucket_" + "assignment")(params, cap)

class Mine(NaiveDataParallel):
    def __init__(self, module):
        super().__init__(module)

class EmptyF(_CopyToModelParallelRegion):
    pass

def f_op(x):
    return EmptyF.apply(x)

def own(params, cap):
    return [[i] for i in reversed(range(len(params)))]
''')
PARAMS = list(torch.nn.Linear(4, 4).parameters())


@pytest.mark.parametrize("name, via", [("alias", "as layout"), ("through_helper", "through your helper helper"),
                                        ("module_attribute", "as minifsdp.ddp.bucket_assignment")])
def test_static_routes(name, via):
    found = library_reached(CELL[name], bucket_assignment)
    assert found and "bucket_assignment" in found[0] and via in found[0], found


def test_static_subclass_and_own_code():
    assert "subclasses it" in library_reached(CELL["Mine"], NaiveDataParallel)[0]
    assert library_reached(CELL["own"], bucket_assignment, NaiveDataParallel) == []
    assert library_reached(CELL["hidden"], bucket_assignment) == []  # hidden from a reader: the wire's job


@pytest.mark.parametrize("name", ["alias", "through_helper", "module_attribute", "hidden"])
def test_wire_trips_on_every_route(name):
    with pytest.raises(LibraryShortcut, match="bucket_assignment"):
        with Wire(bucket_assignment):
            CELL[name](PARAMS, 1.0)


def test_wire_sees_subclass_init_and_empty_autograd_function():
    with pytest.raises(LibraryShortcut, match="NaiveDataParallel.__init__"):
        with Wire(NaiveDataParallel):
            CELL["Mine"](torch.nn.Linear(2, 2))
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(LibraryShortcut, match="_CopyToModelParallelRegion"):
        with Wire(mappings._CopyToModelParallelRegion):
            CELL["f_op"](x).sum().backward()


def test_wire_is_quiet_on_own_code_and_restores_the_profiler():
    with Wire(bucket_assignment, NaiveDataParallel) as wire:
        CELL["own"](PARAMS, 1.0)
    assert wire.hits == [] and __import__("sys").getprofile() is None


def _worker(fn):
    return fn(list(torch.nn.Linear(2, 2).parameters()), 1.0)


def test_wire_inside_launched_workers_is_one_sentence():
    with pytest.raises(CheckFailed) as err:
        run("bucket layout", _worker, 2, watched(CELL["hidden"], bucket_assignment))
    message = str(err.value)
    assert "library's minifsdp.ddp" in message and "\n" not in message
    assert run("bucket layout", _worker, 2, watched(CELL["own"], bucket_assignment)) == [[[1], [0]]] * 2


def test_hints_step_by_step_and_wrapped(capsys):
    hint = Hints({"ring": ["Idea: " + "pass the chunk on " * 12, "Layout: rank r starts with chunk r."]})
    hint("ring")
    hint("ring")
    hint("ring")
    hint("other")
    hint.again("ring")
    hint("ring")
    out = capsys.readouterr().out
    assert out.count("hint 1 of 2 for ring") == 2 and "hint 2 of 2" in out and "no more hints" in out
    assert "no hints for 'other'" in out and all(len(line) <= 100 for line in out.splitlines())


def test_wire_sees_a_thread_the_learner_starts():
    def in_a_thread(params, cap):
        import threading
        out = []
        t = threading.Thread(target=lambda: out.append(CELL["hidden"](params, cap)))
        t.start()
        t.join()
        return out[0]
    with pytest.raises(LibraryShortcut, match="bucket_assignment"):
        with Wire(bucket_assignment):
            in_a_thread(PARAMS, 1.0)


def test_decorated_library_code_is_watched_under_its_decorator():
    """A @contextmanager's wrapper code is shared by every context manager: only the function under it counts."""
    from minifsdp import trace

    @__import__("contextlib").contextmanager
    def mine():
        yield
    with Wire(trace.span) as wire:
        with mine():
            pass
    assert wire.hits == []
    with pytest.raises(LibraryShortcut, match="span"):
        with Wire(trace.span):
            with trace.span("step"):
                pass


def test_an_attribute_is_not_a_global_of_the_same_name():
    """``tuc.checkpoint`` reads torch's, even where the notebook also imported minifsdp's ``checkpoint``."""
    from minifsdp.checkpoint import checkpoint
    ns = _cell("import torch.utils.checkpoint as tuc\nfrom minifsdp.checkpoint import checkpoint\n"
               "def mine(f, x):\n    return tuc.checkpoint(f, x, use_reentrant=False)\n"
               "def theirs(f, x):\n    return checkpoint(f, x)\n")
    assert library_reached(ns["mine"], checkpoint) == []
    assert library_reached(ns["theirs"], checkpoint)


def test_wire_sees_a_c_function():
    """torch's kernels are C functions (no Python frame): the wire watches them as the profiler's c_call."""
    with pytest.raises(LibraryShortcut, match="torch._amp_update_scale_"):
        with Wire(torch._amp_update_scale_):
            growth = torch.zeros(1, dtype=torch.int32)
            torch._amp_update_scale_(torch.ones(1), growth, torch.zeros(1), 2.0, 0.5, 2000)


def test_an_import_inside_the_body_is_followed():
    ns = _cell("def layout(params, cap):\n    from minifsdp.ddp import bucket_assignment as b\n    return b(params, cap)\n"
               "def deep(params, cap):\n    import minifsdp.ddp.bucketed as m\n    return m.bucket_assignment(params, cap)\n")
    assert "bucket_assignment" in library_reached(ns["layout"], bucket_assignment)[0]
    assert "bucket_assignment" in library_reached(ns["deep"], bucket_assignment)[0]
