"""The checks of lab 08 (minifsdp.labcheck.lab08) judge the learner's code: the solution passes, the
blank lab, typical mistakes (the solution with one small edit) and library shortcuts (the exercise answered
with minifsdp.tensor_parallel, in the forms a learner looking for one would try) fail with one sentence."""
from __future__ import annotations

import re

import pytest
from labcheck_helpers import fails, lab_tests, load, run_cell, shortcut_fails
from minifsdp import tensor_parallel as tpl
from minifsdp.labcheck import lab08

L08 = "08_tensor_parallel"

F_BACKWARD_LOCAL = (("        grad = grad.clone()\n        comm.all_reduce(grad, group=get_model_parallel_group())\n"
                     "        return grad", "        return grad"),)
G_BACKWARD_REDUCES = (("        # HINT: g backward: one process's dL/dx; check.hint('f_and_g')\n        return grad",
                       "        grad = grad.clone()\n        comm.all_reduce(grad, group=get_model_parallel_group())\n"
                       "        return grad"),)
G_IN_PLACE = (("        out = x.clone()\n        comm.all_reduce(out, group=get_model_parallel_group())\n        return out",
               "        comm.all_reduce(x, group=get_model_parallel_group())\n        return x"),)
BIAS_BEFORE_G = (("return ReduceFromTP.apply(F.linear(h, self.c_proj.weight)) + self.c_proj.bias",
                  "return ReduceFromTP.apply(self.c_proj(h))"),)
NO_F = (("h = F.gelu(self.c_fc(CopyToTP.apply(x)))", "h = F.gelu(self.c_fc(x))"),)
CONTIGUOUS_QKV = (("q, k, v = t.chunk(3)\n    return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])",
                   "return t.chunk(tp)[r]"),)
QKV_WRONG_ORDER = (("return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]])",
                    "return torch.cat([q.chunk(tp)[r], v.chunk(tp)[r], k.chunk(tp)[r]])"),)
NO_MASK = (("probs = F.softmax(scores.masked_fill(self.future_mask[:T, :T], float(\"-inf\")), dim=-1)",
            "probs = F.softmax(scores, dim=-1)"),)
ATTN_BIAS_BEFORE_G = (("return ReduceFromTP.apply(F.linear(y, self.c_proj.weight)) + self.c_proj.bias",
                       "return ReduceFromTP.apply(self.c_proj(y))"),)
GATHER_BATCH = (("gathered = comm.all_gather(x.transpose(0, 1).contiguous(), group=get_model_parallel_group())\n"
                 "        return gathered.transpose(0, 1).contiguous()",
                 "return comm.all_gather(x.contiguous(), group=get_model_parallel_group())"),)
GATHER_BACKWARD_SLICES = (("summed = comm.reduce_scatter(grad.transpose(0, 1).contiguous(), group=get_model_parallel_group())\n"
                           "        return summed.transpose(0, 1).contiguous()",
                           "r, tp = get_model_parallel_rank(), get_model_parallel_world_size()\n"
                           "        return grad.chunk(tp, dim=1)[r].contiguous()"),)
OWN_MAX = (("    comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)\n", ""),)
UNMASKED_TARGET = (("target_logit = torch.where(mine, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)",
                    "target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)"),)


CHECKS = [(lab08.f_and_g, ("CopyToTP", "ReduceFromTP")),
          (lab08.parallel_layers, ("ParallelMLP", "shard_qkv", "ParallelAttention")),
          (lab08.vocab_parallel_loss, ("vocab_parallel_loss",)),
          (lab08.sequence_parallel_ops, ("GatherSequence", "ReduceScatterSequence"))]
MISTAKES = (NO_MASK, ATTN_BIAS_BEFORE_G, GATHER_BATCH, GATHER_BACKWARD_SLICES, F_BACKWARD_LOCAL,
            G_BACKWARD_REDUCES, G_IN_PLACE, BIAS_BEFORE_G, NO_F, CONTIGUOUS_QKV, QKV_WRONG_ORDER, OWN_MAX,
            UNMASKED_TARGET)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L08, CHECKS, MISTAKES, words=("yours", "target"))


def _layers(ns: dict) -> tuple:
    return ns["ParallelMLP"], ns["shard_qkv"], ns["ParallelAttention"]


def test_f_and_g_mistakes():
    ns = load(L08, edits=F_BACKWARD_LOCAL)
    fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"], words="this rank's gradient only")
    ns = load(L08, edits=G_BACKWARD_REDUCES)
    fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"], words="2x too big")
    ns = load(L08, edits=G_IN_PLACE)
    fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"], words="in place")


def test_layer_mistakes():
    fails(lab08.parallel_layers, *_layers(load(L08, edits=BIAS_BEFORE_G)), words="bias 2x over")
    fails(lab08.parallel_layers, *_layers(load(L08, edits=NO_F)), words="must enter through f")
    fails(lab08.parallel_layers, *_layers(load(L08, edits=CONTIGUOUS_QKV)), words="contiguous block")
    fails(lab08.parallel_layers, *_layers(load(L08, edits=QKV_WRONG_ORDER)), words="then of k, then of v")
    fails(lab08.parallel_layers, *_layers(load(L08, edits=NO_MASK)), words="differs from the full")
    message = fails(lab08.parallel_layers, *_layers(load(L08, edits=ATTN_BIAS_BEFORE_G)), words="bias 2x over")
    assert message.startswith("parallel attention"), message   # the MLP passed: the verdict names the attention


def test_loss_and_sequence_parallel_mistakes():
    fails(lab08.vocab_parallel_loss, load(L08, edits=OWN_MAX)["vocab_parallel_loss"], words="global max")
    fails(lab08.vocab_parallel_loss, load(L08, edits=UNMASKED_TARGET)["vocab_parallel_loss"],
          words="owns the target id")
    ns = load(L08, edits=GATHER_BATCH)
    fails(lab08.sequence_parallel_ops, ns["GatherSequence"], ns["ReduceScatterSequence"], words="dim 1")
    ns = load(L08, edits=GATHER_BACKWARD_SLICES)
    fails(lab08.sequence_parallel_ops, ns["GatherSequence"], ns["ReduceScatterSequence"], words="reduce-scatter")


# ------------------------------------------------------------------ library shortcuts, one set per exercise
def _with(source: str) -> dict:
    """The solution's namespace (a notebook's __main__), then a learner's cell that swaps in the library."""
    return run_cell(load(L08), source)


# Written so that reading the code does not show the library: only the run-time wire can tell.
HIDDEN = "import importlib\nlib = lambda mod, *parts: getattr(importlib.import_module(mod), ''.join(parts))\n"

F_G_SHORTCUTS = {
    "empty subclasses of the library's Functions":
        "from minifsdp.tensor_parallel.mappings import _CopyToModelParallelRegion as Copy\n"
        "from minifsdp.tensor_parallel import mappings\n"
        "class CopyToTP(Copy):\n    pass\n"
        "class ReduceFromTP(mappings._ReduceFromModelParallelRegion):\n    pass\n",
    "a notebook helper calling the library's g":
        "def summed(t):\n    return tpl.reduce_from_model_parallel_region(t)\n"
        "class ReduceFromTP(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return summed(x)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        return grad\n",
    "the library's all-reduce, reached by a string":
        HIDDEN + "class CopyToTP(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return x\n"
        "    @staticmethod\n    def backward(ctx, grad):\n"
        "        return lib('minifsdp.tensor_parallel.mappings', '_all_', 'reduce')(grad)\n",
}


@pytest.mark.parametrize("name", list(F_G_SHORTCUTS))
def test_f_and_g_refuses_the_library(name):
    ns = _with(F_G_SHORTCUTS[name])
    shortcut_fails(lab08.f_and_g, ns["CopyToTP"], ns["ReduceFromTP"])


def test_f_and_g_refuses_the_library_passed_itself():
    shortcut_fails(lab08.f_and_g, tpl.mappings._CopyToModelParallelRegion, tpl.mappings._ReduceFromModelParallelRegion)


LAYER_SHORTCUTS = {
    "a subclass of the library's ParallelMLP calling super().__init__":
        "class ParallelMLP(tpl.ParallelMLP):\n    def __init__(self, full):\n        super().__init__(full)\n",
    "a subclass of the library's ParallelAttention calling super().__init__":
        "from minifsdp.tensor_parallel import ParallelAttention as Megatron\n"
        "class ParallelAttention(Megatron):\n    def __init__(self, full):\n        super().__init__(full)\n",
    "layers the library built, in the learner's own class":
        "from minifsdp.tensor_parallel import ColumnParallelLinear as Col, RowParallelLinear as Row\n"
        "class ParallelMLP(torch.nn.Module):\n    def __init__(self, full):\n        super().__init__()\n"
        "        self.c_fc = Col.from_linear(full.c_fc, gather_output=False)\n"
        "        self.c_proj = Row.from_linear(full.c_proj, input_is_parallel=True)\n"
        "    def forward(self, x):\n        return self.c_proj(F.gelu(self.c_fc(x)))\n",
    "the library's slicing helper, under another name":
        "from minifsdp.tensor_parallel.layers import _local_slice as pieces\n"
        "def shard_qkv(t, r, tp):\n    return pieces(t, 0, 3)\n",
    "the library's MLP, reached by a string":
        HIDDEN + "class ParallelMLP(torch.nn.Module):\n    def __init__(self, full):\n        super().__init__()\n"
        "        self.inner = lib('minifsdp.tensor_parallel', 'Parallel', 'MLP')(full)\n"
        "    def forward(self, x):\n        return self.inner(x)\n",
    "the library's attention, reached by a string":
        HIDDEN + "class ParallelAttention(torch.nn.Module):\n    def __init__(self, full):\n        super().__init__()\n"
        "        self.inner = lib('minifsdp.tensor_parallel', 'Parallel', 'Attention')(full)\n"
        "    def forward(self, x):\n        return self.inner(x)\n",
}


@pytest.mark.parametrize("name", list(LAYER_SHORTCUTS))
def test_parallel_layers_refuse_the_library(name):
    shortcut_fails(lab08.parallel_layers, *_layers(_with(LAYER_SHORTCUTS[name])))


LOSS_SHORTCUTS = {
    "the library's loss under another name":
        "from minifsdp.tensor_parallel import vocab_parallel_cross_entropy as xent\n"
        "def vocab_parallel_loss(logits_local, target):\n    return xent(logits_local, target)\n",
    "the library's loss through the model's own method":
        "def vocab_parallel_loss(logits_local, target):\n"
        "    return tpl.ParallelGPT.loss(logits_local.unsqueeze(-2), target.unsqueeze(-1)).expand(target.shape)\n",
    "the library's loss, reached by a string":
        HIDDEN + "def vocab_parallel_loss(logits_local, target):\n"
        "    return lib('minifsdp.tensor_parallel', 'vocab_parallel_', 'cross_entropy')(logits_local, target)\n",
}


@pytest.mark.parametrize("name", list(LOSS_SHORTCUTS))
def test_vocab_parallel_loss_refuses_the_library(name):
    shortcut_fails(lab08.vocab_parallel_loss, _with(LOSS_SHORTCUTS[name])["vocab_parallel_loss"])


SP_SHORTCUTS = {
    "empty subclasses of the library's sequence-parallel Functions":
        "from minifsdp.tensor_parallel import mappings as m\n"
        "class GatherSequence(m._GatherFromSequenceParallelRegion):\n    pass\n"
        "class ReduceScatterSequence(m._ReduceScatterToSequenceParallelRegion):\n    pass\n",
    "a notebook helper calling the library's gather along a dimension":
        "from minifsdp.tensor_parallel.mappings import gather_along\n"
        "def every_position(t):\n    return gather_along(t, 1)\n"
        "class GatherSequence(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n        return every_position(x)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n"
        "        return comm.reduce_scatter(grad.transpose(0, 1).contiguous(), group=get_model_parallel_group())"
        ".transpose(0, 1)\n",
    "the library's operators, reached by a string":
        HIDDEN + "class ReduceScatterSequence(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x):\n"
        "        return lib('minifsdp.tensor_parallel', 'reduce_scatter_to_', 'sequence_parallel_region')(x)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        return grad\n",
}


@pytest.mark.parametrize("name", list(SP_SHORTCUTS))
def test_sequence_parallel_ops_refuse_the_library(name):
    ns = _with(SP_SHORTCUTS[name])
    shortcut_fails(lab08.sequence_parallel_ops, ns["GatherSequence"], ns["ReduceScatterSequence"])


def test_hints_come_one_at_a_time_and_never_hold_code(capsys):
    for name, steps in lab08.hint.table.items():
        assert 2 <= len(steps) <= 4, name
        for step in steps:   # ideas in words: no call of a named function or method
            assert not re.search(r"[A-Za-z_]\.[A-Za-z_]+\(|\w\(\w+[,)]", step), (name, step)
    lab08.hint("f_and_g")
    lab08.hint("f_and_g")
    out = capsys.readouterr().out
    assert "hint 1 of" in out and "hint 2 of" in out and max(map(len, out.splitlines())) <= 100
