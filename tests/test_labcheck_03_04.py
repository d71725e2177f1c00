"""The checks of labs 03 (ZeRO) and 04 (FSDP): pass on the solution, fail in words on the rest.

The learner's functions come from the notebooks themselves: the cells that
define them (and the scaffolding around them) are executed into a fresh
namespace, from ``solutions/NN.ipynb`` (the solution), from ``labs/NN.ipynb``
(the blank lab: every exercise still raises NotImplementedError), or from the
solution with one line changed (a typical mistake). Each runs through the
one-call check of the lab, which must pass, or fail with ``CheckFailed`` and a
message naming what is wrong. The namespace's module name is not importable,
so ``launch`` sends the functions to the workers by value, as from a notebook.
"""

from __future__ import annotations

import linecache
import re
import sys
from pathlib import Path

import nbformat
import pytest

from minifsdp.labcheck import lab03, lab04
from minifsdp.labcheck.verdict import CheckFailed

ROOT = Path(__file__).resolve().parent.parent
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


def fails(call, *words: str) -> str:
    """``call()`` must raise CheckFailed whose message contains every one of ``words``."""
    with pytest.raises(CheckFailed) as err:
        call()
    message = str(err.value)
    for w in words:
        assert re.search(w, message), f"{w!r} not in the verdict: {message}"
    return message


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
