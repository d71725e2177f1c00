"""The checks of lab 04b (per-parameter sharding, FSDP2's fully_shard): pass on the solution, fail in words on the rest.

The learner's functions come from the notebook source itself (solutions/src/04b_fully_shard.py): the exercise
cells and the ``Group`` scaffolding are executed into a fresh ``__main__`` namespace (so ``launch`` sends them
to the workers by value), as the solution, as the blank lab (every exercise still raises NotImplementedError),
or as the solution with a small edit (a typical mistake). Each runs through the one-call check of the lab,
which must pass, or fail with ``CheckFailed`` and one sentence naming what is wrong. Every exercise also has
library shortcuts, written the way a learner looking for one would (minifsdp's ``fully_shard`` and its pieces,
torch's FSDP2 and DTensor): each must fail with a sentence naming the library, statically or at run time.
"""

from __future__ import annotations

import sys

import pytest

from labcheck_helpers import edits_apply, fails, hints_come_one_at_a_time, load, run_cell, shortcut_fails
from minifsdp.labcheck import lab04b

STEM = "04b_fully_shard"


def ns04b(*edits: tuple[str, str], blank: bool = False) -> dict:
    edits_apply(STEM, edits)
    return load(STEM, blank=blank, edits=edits, extra=("class Group",))


def ex1(ns: dict) -> tuple:
    return ns["shard_param"], ns["real_rows"]


def ex2(ns: dict) -> tuple:
    return ns["shard_model"], ns["unshard"], ns["reshard"]


def ex3(ns: dict) -> tuple:
    return (ns["reduce_scatter_grads"],)


def ex4(ns: dict) -> tuple:
    return ns["shard_model"], ns["post_backward"], ns["train_step"]


@pytest.fixture(scope="module")
def sol() -> dict:
    return ns04b()


# ------------------------------------------------------------------------------------ solution and blank
def test_checks_pass_on_the_solution(sol, capsys):
    lab04b.shard_param(*ex1(sol))
    lab04b.unshard(*ex2(sol))
    lab04b.reduce_scatter_grads(*ex3(sol))
    lab04b.post_backward(*ex4(sol))
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 4, out
    # gpt-tiny at 3 ranks: 42,880 parameters padded to 43,440 (per-parameter), x 4 B
    for words in ("yours 560 numbers, target 560", "173,760 B in 3 calls", "library (fully_shard) 173,760 B",
                  "347,520 / 173,760 B", "4Ψ = 171,520 B"):
        assert words in out, out
    assert lab04b.results["post_backward"]["held"][lab04b.MICRO + 1] == 171_520


def test_checks_fail_on_the_blank_lab():
    blank = ns04b(blank=True)
    fails(lab04b.shard_param, *ex1(blank), words="not written yet")
    fails(lab04b.unshard, *ex2(blank), words="not written yet")
    fails(lab04b.reduce_scatter_grads, *ex3(blank), words="not written yet")
    fails(lab04b.post_backward, *ex4(blank), words="not written yet")


def test_hints_come_one_at_a_time(capsys):
    names = ("shard_param", "unshard", "reduce_scatter_grads", "post_backward")
    hints_come_one_at_a_time(lab04b.hint, names, capsys)


# ------------------------------------------------------------------------------------ exercise 1 (in this process)
@pytest.mark.parametrize("edits, words", [
    ((("    shard[:mine.shape[0]] = mine\n    return shard\n", "    return mine.clone()\n"),), "pad with zero rows"),
    ((("    return shard\n", "    return mine if mine.shape[0] == rows else shard\n"),), "a view into"),
    ((("mine = param.detach()[rank * rows:(rank + 1) * rows]", "mine = param[rank * rows:(rank + 1) * rows]"),),
     "autograd history"),
    ((("mine = param.detach()[rank * rows:(rank + 1) * rows]", "mine = torch.tensor_split(param.detach(), world)[rank]"),),
     "spreads the rows evenly"),
    ((("mine = param.detach()[rank * rows:(rank + 1) * rows]",
       "mine = param.detach()[(world - 1 - rank) * rows:(world - rank) * rows]"),), "rank r keeps rows"),
    ((("    shard = param.new_zeros((rows, *param.shape[1:]))", "    shard = param.new_ones((rows, *param.shape[1:]))"),),
     "must be zeros"),
    ((("    return max(0, min(rows, n - rank * rows))", "    return min(rows, n - rank * rows)"),), "expected 0"),
    ((("    shard = param.new_zeros((rows, *param.shape[1:]))", "    shard = param.new_zeros(rows * param[0].numel())"),
      ("    shard[:mine.shape[0]] = mine\n", "    shard[:mine.numel()] = mine.reshape(-1)\n")), "not a flat vector"),
])
def test_shard_param_mistakes(edits, words):
    fails(lab04b.shard_param, *ex1(ns04b(*edits)), words=words)


TORCH_SPLIT = """
from torch.distributed.tensor import Shard as _Placement


def shard_param(param, rank, world):
    pieces, _ = _Placement(0)._split_tensor(param.detach(), world, with_padding=True)   # DTensor's own split
    return pieces[rank].clone()
"""
LAYOUT_ALIAS = """
from minifsdp.fsdp.fsdp_param import ShardLayout as Rows


def shard_param(param, rank, world):
    rows = math.ceil(param.shape[0] / world)
    layout = Rows(param.shape[0], param[0].numel(), world, rows)
    out = param.new_empty(rows * param[0].numel())
    layout.pack(param.detach(), rank, out)
    return out.view(rows, *param.shape[1:])
"""


def test_shard_param_library_shortcuts():
    message = shortcut_fails(lab04b.shard_param, *ex1(run_cell(ns04b(), TORCH_SPLIT)))   # only the wire sees it
    assert "_split_tensor" in message, message
    message = shortcut_fails(lab04b.shard_param, *ex1(run_cell(ns04b(), LAYOUT_ALIAS)))  # refused statically
    assert "ShardLayout" in message, message


# ------------------------------------------------------------------------------------ exercise 2 (3 ranks)
@pytest.mark.parametrize("edits, words", [
    ((("    for (module, attr), u in zip(group.slots, group.unsharded):\n        module._parameters[attr] = u\n", ""),),
     "computed with a sharded parameter"),
    ((("u.data.copy_(piece.reshape(-1, *u.shape[1:])[:u.shape[0]])", "u.data.copy_(piece.reshape(-1, *u.shape[1:]))"),),
     "drop the padding rows"),
    ((("        u.data.copy_(piece.reshape(-1, *u.shape[1:])[:u.shape[0]])",
       "        with torch.no_grad():\n            u.copy_(piece.reshape(-1, *u.shape[1:])[:u.shape[0]])"),), "through .data"),
    ((("        module._parameters[attr] = p\n    group.free()\n", "        module._parameters[attr] = p\n"),),
     "unsharded memory not freed"),
])
def test_unshard_mistakes(edits, words):
    fails(lab04b.unshard, *ex2(ns04b(*edits)), words=words)


PER_PARAMETER_GATHERS = """
def unshard(group):
    group.allocate()
    for u, s, (module, attr) in zip(group.unsharded, group.padded, group.slots):
        full = s.new_empty(group.world * s.shape[0], *s.shape[1:])
        comm.all_gather_into_tensor(full, s)            # right values, but one collective per parameter
        u.data.copy_(full[:u.shape[0]])
        module._parameters[attr] = u
"""


def test_one_all_gather_per_group():
    fails(lab04b.unshard, *ex2(run_cell(ns04b(), PER_PARAMETER_GATHERS)), words="one call")


LIBRARY_MODEL = """
from minifsdp.fsdp import fully_shard as _fully_shard


def shard_model(model):
    for block in model.modules():
        if isinstance(block, models.Block):
            _fully_shard(block)                           # the library's FSDP2 builds the groups
    return [_fully_shard(model)]
"""
HIDDEN_FULL_TENSOR = """
def unshard(group):
    import importlib
    tensor = importlib.import_module("torch.distributed." + "tensor")
    mesh = importlib.import_module("torch.distributed.device_mesh").init_device_mesh("cpu", (group.world,))
    group.allocate()
    for u, s, (module, attr) in zip(group.unsharded, group.sharded, group.slots):
        full = getattr(tensor, "DTensor").from_local(s.detach(), mesh, [tensor.Shard(0)], shape=u.shape,
                                                     stride=u.stride()).full_tensor()
        u.data.copy_(full)
        module._parameters[attr] = u
"""


def test_unshard_library_shortcuts():
    message = shortcut_fails(lab04b.unshard, *ex2(run_cell(ns04b(), LIBRARY_MODEL)))      # refused statically
    assert "fully_shard" in message, message
    message = shortcut_fails(lab04b.unshard, *ex2(run_cell(ns04b(), HIDDEN_FULL_TENSOR)))  # only the wire sees it
    assert "full_tensor" in message, message


# ------------------------------------------------------------------------------------ exercise 3 (3 ranks)
@pytest.mark.parametrize("edits, words", [
    ((("    recv /= world\n", ""),), "SUMS"),
    ((("return [piece.view(r, *g.shape[1:])[:real_rows(g.shape[0], rank, world)]", "return [piece.view(r, *g.shape[1:])"),),
     "padded rows"),
    # lab 04's flat layout: every gradient padded and concatenated, then cut in N: the pieces mix parameters
    ((("    send = grads[0].new_empty(world, sum(sizes))                        # row r: rank r's pieces, side by side\n"
       "    for g, r, columns in zip(grads, rows, send.split(sizes, dim=1)):\n"
       "        columns.copy_(F.pad(g.reshape(g.shape[0], -1), (0, 0, 0, world * r - g.shape[0])).view(world, -1))\n",
       "    send = torch.cat([F.pad(g.reshape(g.shape[0], -1), (0, 0, 0, world * r - g.shape[0])).reshape(-1)\n"
       "                      for g, r in zip(grads, rows)])\n"),
      ("    recv = send.new_empty(send.shape[1])\n", "    recv = send.new_empty(send.numel() // world)\n")),
     "piece r of the reduce-scatter's input"),
])
def test_reduce_scatter_mistakes(edits, words):
    fails(lab04b.reduce_scatter_grads, *ex3(ns04b(*edits)), words=words)


PER_GRADIENT = """
def reduce_scatter_grads(grads):
    world, rank = dist.world_size(), dist.rank()
    out = []
    for g in grads:                                        # right values, one collective per gradient
        rows = math.ceil(g.shape[0] / world)
        padded = F.pad(g.reshape(g.shape[0], -1), (0, 0, 0, world * rows - g.shape[0]))
        piece = padded.new_empty(rows, padded.shape[1])
        comm.reduce_scatter_tensor(piece, padded)
        out.append((piece / world).view(rows, *g.shape[1:])[:real_rows(g.shape[0], rank, world)])
    return out
"""
HIDDEN_REDISTRIBUTE = """
def reduce_scatter_grads(grads):
    import importlib
    tensor = importlib.import_module("torch.distributed." + "tensor")
    mesh = importlib.import_module("torch.distributed.device_mesh").init_device_mesh("cpu", (dist.world_size(),))
    return [getattr(tensor, "DTensor").from_local(g / dist.world_size(), mesh, [tensor.Partial()])
            .redistribute(mesh, [tensor.Shard(0)]).to_local() for g in grads]
"""
SPLIT_ALIAS = """
from minifsdp.fsdp.param_group import FSDPParamGroup as _Group


def reduce_scatter_grads(grads):
    return _Group.reduce_grads(grads)                       # the library's reduce-scatter, through an alias
"""


def test_one_reduce_scatter_per_group():
    fails(lab04b.reduce_scatter_grads, *ex3(run_cell(ns04b(), PER_GRADIENT)), words="reduce-scatters for one group")


def test_reduce_scatter_library_shortcuts():
    message = shortcut_fails(lab04b.reduce_scatter_grads, *ex3(run_cell(ns04b(), SPLIT_ALIAS)))     # statically
    assert "FSDPParamGroup" in message, message
    message = shortcut_fails(lab04b.reduce_scatter_grads, *ex3(run_cell(ns04b(), HIDDEN_REDISTRIBUTE)))  # wire
    assert "redistribute" in message, message


# ------------------------------------------------------------------------------------ exercise 4 (3 ranks)
@pytest.mark.parametrize("edits, words", [
    ((("            p.grad = g if p.grad is None else p.grad + g\n", "            p.grad = g\n"),), "add to the sharded"),
    ((("        for u in group.unsharded:\n            u.grad = None\n", ""),), "still on the unsharded parameters"),
    ((("    if group.sync:\n", "    if True:\n"),), "without sync"),
])
def test_post_backward_mistakes(edits, words):
    fails(lab04b.post_backward, *ex4(ns04b(*edits)), words=words)


HIDDEN_COPY_IN = """
def post_backward(group):
    import importlib
    fsdp2 = importlib.import_module("torch.distributed.fsdp._fully_shard." + "_fsdp_collectives")
    if group.sync:
        grads = [u.grad for u in group.unsharded]
        send = grads[0].new_empty(sum(group.world * p.numel() for p in group.padded))
        getattr(fsdp2, "foreach_reduce_scatter_" + "copy_in")(grads, send, group.world)   # FSDP2's own copy-in
    reshard(group)
"""


def test_post_backward_library_shortcuts():
    message = shortcut_fails(lab04b.post_backward, *ex4(run_cell(ns04b(), LIBRARY_MODEL)))  # fully_shard's groups
    assert "fully_shard" in message, message
    message = shortcut_fails(lab04b.post_backward, *ex4(run_cell(ns04b(), HIDDEN_COPY_IN)))  # only the wire
    assert "copy_in" in message, message


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
