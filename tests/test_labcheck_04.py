"""The checks of lab 04 (FSDP): pass on the solution, fail in words on the rest.

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
from minifsdp.labcheck import lab04

# -------------------------------------------------------------------------------- lab 04
SETUP04 = ("from minifsdp.labcheck import lab04 as check",)
EX04 = ("def shard_flat", "class Unit", "def gather", "def pre_backward(unit: Unit) -> None:\n    \"\"\"")


def lab04_fns(notebook: str = "solutions/04_fsdp.ipynb", edits: dict[str, str] | None = None) -> dict:
    return namespace(cells(notebook, *SETUP04, *EX04), edits)


@pytest.fixture(scope="module")
def sol04() -> dict:
    return lab04_fns()


@pytest.fixture(scope="module")
def blank04() -> dict:
    return lab04_fns("labs/04_fsdp.ipynb")


def forward_args(ns: dict) -> tuple:
    return tuple(ns[k] for k in ("shard_model", "free", "allocate", "is_gathered", "gather", "pre_forward",
                                 "post_forward", "install_hooks"))


def test_lab04_checks_pass_on_the_solution(sol04, capsys):
    lab04.shard_flat(sol04["shard_flat"])
    lab04.fsdp_forward(*forward_args(sol04), world_sizes=(3,))
    lab04.fsdp_cycle(sol04["shard_model"], sol04["pre_backward"], sol04["post_backward"], world_sizes=(3,))
    out = capsys.readouterr().out
    assert out.count("✅") == 3, out


def test_lab04_checks_fail_on_the_blank_lab(blank04):
    fails(lambda: lab04.shard_flat(blank04["shard_flat"]), "not written yet", "NotImplementedError")
    fails(lambda: lab04.fsdp_forward(*forward_args(blank04)), "not written yet")
    fails(lambda: lab04.fsdp_cycle(blank04["shard_model"], blank04["pre_backward"], blank04["post_backward"]),
          "not written yet")


def test_lab04_shard_flat_mistakes():
    no_pad = lab04_fns(edits={"    padded = math.ceil(flat.numel() / world) * world\n": "    padded = flat.numel()\n"})
    fails(lambda: lab04.shard_flat(no_pad["shard_flat"]), "pad the flat vector")
    reversed_ranks = lab04_fns(edits={"return flat.chunk(world)[rank].clone()":
                                      "return flat.chunk(world)[world - 1 - rank].clone()"})
    fails(lambda: lab04.shard_flat(reversed_ranks["shard_flat"]), "wrong ranks")


def test_lab04_forward_mistakes():
    never_freed = lab04_fns(edits={"    free(unit)\n    if output.requires_grad:": "    if output.requires_grad:"})
    fails(lambda: lab04.fsdp_forward(*forward_args(never_freed), world_sizes=(2,)), "still hold", "frees")
    unfilled = lab04_fns(edits={"    comm.all_gather_into_tensor(unit.full.data, unit.shard.detach())\n": ""})
    fails(lambda: lab04.fsdp_forward(*forward_args(unfilled), world_sizes=(2,)), "logits differ")
    no_root = lab04_fns(edits={'candidates[::-1] + [("root", model)]': "candidates[::-1]"})
    fails(lambda: lab04.fsdp_forward(*forward_args(no_root), world_sizes=(2,)), "expected", "root")


def test_lab04_storage_mistakes():
    # the new piece: free / allocate resize the storage under unit.full (checked in-process, before any launch)
    elements = lab04_fns(edits={"resize_(unit.padded_numel * unit.full.element_size())": "resize_(unit.padded_numel)"})
    fails(lambda: lab04.fsdp_forward(*forward_args(elements)), "bytes, not numbers")
    replaced = lab04_fns(edits={"    unit.full.untyped_storage().resize_(0)\n":
                                "    unit.full = torch.empty(0, device=unit.full.device, requires_grad=True)\n"})
    fails(lambda: lab04.fsdp_forward(*forward_args(replaced)), "replaced unit.full", "same tensor")
    unnamed = lab04_fns(edits={'        tracker.register(unit.full, "unsharded_params")\n': "        pass\n"})
    fails(lambda: lab04.fsdp_cycle(unnamed["shard_model"], unnamed["pre_backward"], unnamed["post_backward"],
                                   world_sizes=(2,)), "unsharded_params")


def test_lab04_backward_mistakes():
    no_average = lab04_fns(edits={"grad.div_(unit.world)": "grad"})
    fails(lambda: lab04.fsdp_cycle(no_average["shard_model"], no_average["pre_backward"],
                                   no_average["post_backward"], world_sizes=(2,)), "divide by the world size")
    not_freed = lab04_fns(edits={"        unit.shard.grad += chunk\n    free(unit)\n": "        unit.shard.grad += chunk\n"})
    fails(lambda: lab04.fsdp_cycle(not_freed["shard_model"], not_freed["pre_backward"],
                                   not_freed["post_backward"], world_sizes=(2,)), "after backward", "frees")


def test_lab04_sees_the_library():
    lib = lab04_fns(edits={"def pre_backward(unit: Unit) -> None:\n    \"\"\"Backward":
                           "from minifsdp.fsdp import naive\n\n\ndef pre_backward(unit: Unit) -> None:\n    naive.pre_backward\n    \"\"\"Backward"})
    fails(lambda: lab04.fsdp_cycle(lib["shard_model"], lib["pre_backward"], lib["post_backward"]),
          "sees the library", "naive")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
