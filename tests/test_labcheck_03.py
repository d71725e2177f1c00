"""The checks of lab 03 (ZeRO): pass on the solution, fail in words on the rest.

The learner's functions come from the notebooks themselves: the cells that
define them (and the scaffolding around them) are executed into a fresh
namespace, from ``solutions/NN.ipynb`` (the solution), from ``labs/NN.ipynb``
(the blank lab: every exercise still raises NotImplementedError), or from the
solution with one line changed (a typical mistake). Each runs through the
one-call check of the lab, which must pass, or fail with ``CheckFailed`` and a
message naming what is wrong; a library shortcut must fail too.
"""

from __future__ import annotations

import pytest

from labcheck_helpers import cells, namespace, shortcut_fails  # noqa: F401
from labcheck_helpers import fails_with as fails
from minifsdp.labcheck import lab03

# -------------------------------------------------------------------------------- lab 03
SETUP03 = ("from minifsdp.labcheck import lab03 as check",)
EX03 = ("def greedy_partition", "def local_optimizer", "def owner_buckets", "def install_zero2",
        "def predict_model_states")


def lab03_fns(notebook: str = "solutions/03_zero.ipynb", edits: dict[str, str] | None = None) -> dict:
    return namespace(cells(notebook, *SETUP03, *EX03), edits)


@pytest.fixture(scope="module")
def sol03() -> dict:
    return lab03_fns()


@pytest.fixture(scope="module")
def blank03() -> dict:
    return lab03_fns("labs/03_zero.ipynb")


def zero1_args(ns: dict) -> tuple:
    return ns["greedy_partition"], ns["local_optimizer"], ns["zero1_step"], ns["consolidate_state"]


def zero2_args(ns: dict) -> tuple:
    return ns["greedy_partition"], ns["local_optimizer"], ns["zero1_step"], ns["install_zero2"]


def test_lab03_checks_pass_on_the_solution(sol03, capsys):
    lab03.greedy_partition(sol03["greedy_partition"])
    lab03.zero1(*zero1_args(sol03), world_sizes=(2,))
    lab03.zero2(*zero2_args(sol03), world_sizes=(2,))
    out = capsys.readouterr().out
    assert out.count("✅") == 3, out


def test_lab03_checks_fail_on_the_blank_lab(blank03):
    fails(lambda: lab03.greedy_partition(blank03["greedy_partition"]), "not written yet", "NotImplementedError",
          "least load|smallest load")
    fails(lambda: lab03.zero1(*zero1_args(blank03)), "not written yet")
    fails(lambda: lab03.zero2(*zero2_args(blank03)), "not written yet")
    fails(lambda: lab03.predict_model_states(blank03["predict_model_states"], {}, 1), "not written yet")


def test_lab03_partition_mistakes():
    in_order = lab03_fns(edits={"sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))": "range(len(sizes))"})
    fails(lambda: lab03.greedy_partition(in_order["greedy_partition"]), "list order")
    last_rank = lab03_fns(edits={"r = load.index(min(load))": "r = len(load) - 1 - load[::-1].index(min(load))"})
    fails(lambda: lab03.greedy_partition(last_rank["greedy_partition"]), "ties")


def test_lab03_zero1_mistakes():
    full_state = lab03_fns(edits={"mine = [p for p, owner in zip(params, owners) if owner == rank]": "mine = params"})
    fails(lambda: lab03.zero1(*zero1_args(full_state), world_sizes=(2,)), "full AdamW state")
    from_rank0 = lab03_fns(edits={"comm.broadcast(p.data, src=owner)": "comm.broadcast(p.data, src=0)"})
    fails(lambda: lab03.zero1(*zero1_args(from_rank0), world_sizes=(2,)), "differs from one process", "owner")


def test_lab03_consolidate_mistakes():
    from_rank0 = lab03_fns(edits={"comm.broadcast(t, src=owner)": "comm.broadcast(t, src=0)"})
    fails(lambda: lab03.zero1(*zero1_args(from_rank0), world_sizes=(2,)), "consolidated", "owner")
    everywhere = lab03_fns(edits={"return state if dist.rank() == 0 else None": "return state"})
    fails(lambda: lab03.zero1(*zero1_args(everywhere), world_sizes=(2,)), "other than 0")


def test_lab03_owner_buckets(sol03, blank03, capsys):
    lab03.owner_buckets(sol03["owner_buckets"], sol03["unpack_bucket"])
    assert "round trip exact" in capsys.readouterr().out
    fails(lambda: lab03.owner_buckets(blank03["owner_buckets"], blank03["unpack_bucket"]),
          "not written yet", "NotImplementedError")
    every = lab03_fns(edits={"for t, o in zip(tensors, owners) if o == r]": "for t, o in zip(tensors, owners)]"})
    fails(lambda: lab03.owner_buckets(every["owner_buckets"], every["unpack_bucket"]), "owns")
    rebinds = lab03_fns(edits={"t.data.copy_(bucket[offset:offset + n].view_as(t))":
                               "t = bucket[offset:offset + n].view_as(t)"})
    fails(lambda: lab03.owner_buckets(rebinds["owner_buckets"], rebinds["unpack_bucket"]), "in place")


def test_lab03_zero2_mistakes(sol03):
    keeps = lab03_fns(edits={"            p.grad = None            # not ours": "            pass  # not ours"})
    fails(lambda: lab03.zero2(*zero2_args(keeps), world_sizes=(2,)),
          "still holds every gradient", r"p\.grad = None")
    no_average = lab03_fns(edits={"        p.grad.div_(n)\n": ""})
    fails(lambda: lab03.zero2(*zero2_args(no_average), world_sizes=(2,)),
          "divide by N")
    library = lab03_fns(edits={"    rank, n = dist.rank(), dist.world_size()\n":
                               "    from minifsdp.zero import wrap_zero\n    rank, n = dist.rank(), dist.world_size()\n"
                               "    wrap_zero\n"})
    fails(lambda: lab03.zero2(*zero2_args(library), world_sizes=(2,)),
          "sees the library", "wrap_zero")


def test_lab03_predict_model_states(sol03):
    runs = {"ddp": {2: [{"parameters": 400, "gradients": 400, "optimizer": 808, "owned_numel": 100,
                         "owned_tensors": 2}] * 2},
            "zero2": {2: [{"parameters": 400, "gradients": 240, "optimizer": 488, "owned_numel": 60,
                           "owned_tensors": 2},
                          {"parameters": 400, "gradients": 160, "optimizer": 328, "owned_numel": 40,
                           "owned_tensors": 2}]}}
    lab03.predict_model_states(sol03["predict_model_states"], runs, 100)
    elements = lab03_fns(edits={"    return {\"parameters\": FP32 * n_params,": "    FP32 = 1\n    return {\"parameters\": FP32 * n_params,"})
    fails(lambda: lab03.predict_model_states(elements["predict_model_states"], runs, 100), "counted elements")
    no_step = lab03_fns(edits={" + FP32 * owned_tensors}": "}"})
    fails(lambda: lab03.predict_model_states(no_step["predict_model_states"], runs, 100), "step counter")
