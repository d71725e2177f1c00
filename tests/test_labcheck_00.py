"""The checks of lab 00 (minifsdp.labcheck.lab00) judge the learner's code.

Each check must pass with the solution, and fail with a clear sentence
(``CheckFailed``) on the blank lab, on typical mistakes and on a library
shortcut. See labcheck_helpers.py for how the notebook's cells are loaded.
"""
from __future__ import annotations

import pytest

from labcheck_helpers import edits_apply, fails, load, run_cell, shortcut_fails  # noqa: F401

L00 = "00_collectives"


@pytest.fixture(scope="module")
def lab00():
    from minifsdp.labcheck import lab00
    return lab00


def test_lab00_solution_passes(lab00, capsys):
    ns = load(L00)
    lab00.ring_all_gather(ns["my_all_gather"])
    lab00.ring_reduce_scatter(ns["my_reduce_scatter"])
    lab00.ring_all_reduce(ns["my_all_reduce"], ns["ring_bytes_sent"], ns["bus_bandwidth"])
    fig = lab00.ring_timeline(ns["draw_ring_timeline"], ns["my_all_reduce"])
    assert fig.get_size_inches()[0] <= 11, "a figure no wider than a notebook column"
    out = capsys.readouterr().out
    assert out.count("✅") == 4 and "yours" in out and "target" in out and "library" in out


def test_lab00_blank_fails(lab00):
    ns = load(L00, blank=True)
    fails(lab00.ring_all_gather, ns["my_all_gather"], words="not written yet")
    fails(lab00.ring_reduce_scatter, ns["my_reduce_scatter"], words="not written yet")
    fails(lab00.ring_all_reduce, ns["my_all_reduce"], ns["ring_bytes_sent"], words="not written yet")
    solved = load(L00)
    fails(lab00.ring_all_reduce, solved["my_all_reduce"], solved["ring_bytes_sent"], ns["bus_bandwidth"],
          words="not written yet")
    fails(lab00.ring_timeline, ns["draw_ring_timeline"], load(L00)["my_all_reduce"], words="not written yet")


AG_WRONG_WAY = (("chunks[(r - step - 1) % n], left)", "chunks[(r + step + 1) % n], left)"),
                ("chunks[(r - step) % n], right)", "chunks[(r + step) % n], right)"))
AG_LAZY = (("    for step in range(n - 1):\n        sending = comm.isend(chunks[(r - step) % n], right)",
            "    comm.all_reduce(out)\n    for step in range(0):\n        sending = comm.isend(chunks[(r - step) % n], right)"),)
RS_COPY = (("chunks[(r - step - 2) % n].add_(incoming)", "chunks[(r - step - 2) % n].copy_(incoming)"),)
RS_SHORT = (("    for step in range(n - 1):\n        sending = comm.isend(chunks[(r - step - 1) % n], right)",
             "    for step in range(n - 2):\n        sending = comm.isend(chunks[(r - step - 1) % n], right)"),)
AR_VOLUME = (("return 2 * (world_size - 1) * nbytes // world_size", "return 2 * nbytes"),)
AR_NO_CUT = (("return summed[:x.numel()]", "return summed"),)
BUS_ALGBW = (("    return algbw * factor\n", "    return algbw\n"),)
BUS_ONE_FACTOR = (('"all_gather": (n - 1) / n,', '"all_gather": 2 * (n - 1) / n,'),)
TL_SECONDS = (("ax.barh(rank, (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3,",
               "ax.barh(rank, (s.end - s.start), left=(s.start - t0),"),)
TL_ROWS = (("ax.barh(rank, (s.end - s.start) * 1e3,", "ax.barh(i, (s.end - s.start) * 1e3,"),)


@pytest.mark.parametrize("check, names, edits, words", [
    ("ring_all_gather", ["my_all_gather"], AG_WRONG_WAY, "chunk"),
    ("ring_all_gather", ["my_all_gather"], AG_LAZY, "all_reduce"),
    ("ring_reduce_scatter", ["my_reduce_scatter"], RS_COPY, "missing"),
    ("ring_reduce_scatter", ["my_reduce_scatter"], RS_SHORT, "nothing was added"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent"], AR_VOLUME, "2S"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent"], AR_NO_CUT, "padding"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"], BUS_ALGBW, "algbw"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"], BUS_ONE_FACTOR, "factor for all_gather"),
    ("ring_timeline", ["draw_ring_timeline", "my_all_reduce"], TL_SECONDS, "milliseconds"),
    ("ring_timeline", ["draw_ring_timeline", "my_all_reduce"], TL_ROWS, "row"),
], ids=["ag-wrong-way", "ag-all-reduce", "rs-copy", "rs-short", "ar-volume", "ar-no-cut", "bus-algbw", "bus-factor",
        "tl-seconds", "tl-rows"])
def test_lab00_mistakes_fail(lab00, check, names, edits, words):
    edits_apply(L00, edits)
    ns = load(L00, edits=edits)
    fails(getattr(lab00, check), *(ns[n] for n in names), words=words)


def test_the_library_itself_is_told_apart(lab00):
    from minifsdp import comm
    fails(lab00.ring_all_gather, comm.all_gather, words="library's own")


# ------------------------------------------------------------------ library shortcuts, one (or more) per exercise
# Written the way a learner looking for a shortcut would: the library behind a notebook helper, an alias, a module
# attribute, or reached only at run time (a name built from strings, which no reading of the code can see).
SHORTCUTS = {
    "ag-helper": ("ring_all_gather", ["my_all_gather"],
                  "def gather_helper(x):\n    return comm.all_gather(x)\n\n"
                  "def my_all_gather(x):\n    return gather_helper(x)\n"),
    "ag-runtime-only": ("ring_all_gather", ["my_all_gather"],
                        "def my_all_gather(x):\n    return getattr(comm, 'all_' + 'gather')(x)\n"),
    "rs-alias": ("ring_reduce_scatter", ["my_reduce_scatter"],
                 "from minifsdp.comm import reduce_scatter as fast_sum\n\n"
                 "def my_reduce_scatter(x):\n    return fast_sum(x.clone())\n"),
    "rs-runtime-only": ("ring_reduce_scatter", ["my_reduce_scatter"],
                        "def my_reduce_scatter(x):\n    y = x.clone()\n"
                        "    out = y.new_empty(y.numel() // dist.world_size())\n"
                        "    getattr(comm, 'reduce_scatter' + '_tensor')(out, y)\n    return out\n"),
    "ar-module-alias": ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"],
                        "import minifsdp.comm as c\n\n"
                        "def my_all_reduce(x):\n    y = x.clone()\n    c.all_reduce(y)\n    return y\n"),
    "bytes-library": ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"],
                      "def ring_bytes_sent(nbytes, world_size):\n"
                      "    return comm.collective_bytes('all_reduce', nbytes, world_size)['ring_bytes']\n"),
    "bytes-runtime-only": ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"],
                           "def ring_bytes_sent(nbytes, world_size):\n"
                           "    count = getattr(comm, 'collective' + '_bytes')\n"
                           "    return count('all_reduce', nbytes, world_size)['ring_bytes']\n"),
    "bus-estimate-helper": ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"],
                            "from minifsdp import estimate\n\n"
                            "def ring_share(op, nbytes, n):\n"
                            "    moved = estimate.comm_bytes_per_step(nbytes // 4, n, 'ddp', ring=True)['total']\n"
                            "    return moved if op == 'all_reduce' else moved / 2\n\n"
                            "def bus_bandwidth(op, nbytes, seconds, world_size):\n"
                            "    return ring_share(op, nbytes, world_size) / seconds\n"),
    "draw-library": ("ring_timeline", ["draw_ring_timeline", "my_all_reduce"],
                     "def draw_ring_timeline(traces, ax):\n    plot.timeline(traces, ax=ax)\n"),
    "draw-runtime-only": ("ring_timeline", ["draw_ring_timeline", "my_all_reduce"],
                          "def draw_ring_timeline(traces, ax):\n    getattr(plot, 'time' + 'line')(traces, ax=ax)\n"),
}


@pytest.mark.parametrize("name", list(SHORTCUTS))
def test_lab00_library_shortcut_fails(lab00, name):
    check, names, code = SHORTCUTS[name]
    ns = run_cell(load(L00), code)
    message = shortcut_fails(getattr(lab00, check), *(ns[n] for n in names))
    assert "library" in message


def test_lab00_hints_come_one_at_a_time_and_never_hold_code(lab00, capsys):
    for name, steps in lab00.hint.table.items():
        assert 2 <= len(steps) <= 4, name
        for step in steps:
            assert "(r - step" not in step and "% n]" not in step, f"a hint of {name} holds code: {step}"
    lab00.hint.again("my_all_gather")
    lab00.hint("my_all_gather")
    out = capsys.readouterr().out
    assert out.startswith("hint 1 of") and all(len(line) <= 100 for line in out.splitlines())
