"""The checks of lab 11 (mixture of experts, expert parallel): pass on the solution, fail in words on the rest.

The learner's functions come from the notebook source itself (solutions/src/11_experts.py): the exercise
cells and the ``ExpertParallelLayer`` scaffolding are executed into a fresh ``__main__`` namespace (so
``launch`` sends them to the workers by value), as the solution, as the blank lab (every exercise still raises
NotImplementedError), or as the solution with a small edit (a typical mistake). Each runs through the
one-call check of the lab, which must pass, or fail with ``CheckFailed`` and one sentence naming what is
wrong. Every exercise also has library shortcuts, written the way a learner looking for one would
(``models.top_k_routing``, ``minifsdp.expert_parallel``'s all-to-all, layer and gradient functions, torch's
differentiable all-to-all): each must fail with a sentence naming the library, statically or at run time.
The formulas of ``expert_parallel/cost.py`` (the lab's widget) are checked here too, against counting.
"""

from __future__ import annotations

import doctest
import sys

import pytest

from labcheck_helpers import edits_apply, fails, hints_come_one_at_a_time, load, run_cell, shortcut_fails
from minifsdp import models, planner
from minifsdp.expert_parallel import cost
from minifsdp.labcheck import lab11

STEM = "11_experts"


def ns11(*edits: tuple[str, str], blank: bool = False) -> dict:
    edits_apply(STEM, edits)
    return load(STEM, blank=blank, edits=edits, extra=("class ExpertParallelLayer",))


def ex1(ns: dict) -> tuple:
    return ns["route"], ns["split_sizes"]


def ex2(ns: dict) -> tuple:
    return ns["dispatch"], ns["AllToAll"]


def ex3(ns: dict) -> tuple:
    return ns["expert_parallel"], ns["combine"], ns["sync_gradients"]


@pytest.fixture(scope="module")
def sol() -> dict:
    return ns11()


# ------------------------------------------------------------------------------------ solution and blank
def test_checks_pass_on_the_solution(sol, capsys):
    lab11.route(*ex1(sol))
    lab11.dispatch(*ex2(sol))
    lab11.combine(*ex3(sol))
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 3, out
    for words in ("yours [61, 67], target [61, 67]", "yours 584 B, target 584 B, library 584 B",
                  "yours 67,392 B, target 67,392 B, library 67,392 B", "53 assignments dropped"):
        assert words in out, out
    assert lab11.results["combine"]["ring"] == lab11.results["combine"]["target"]


def test_checks_fail_on_the_blank_lab():
    blank = ns11(blank=True)
    fails(lab11.route, *ex1(blank), words="not written yet")
    fails(lab11.dispatch, *ex2(blank), words="not written yet")
    fails(lab11.combine, *ex3(blank), words="not written yet")


def test_hints_come_one_at_a_time(capsys):
    hints_come_one_at_a_time(lab11.hint, ("route", "dispatch", "combine"), capsys)


# ------------------------------------------------------------------------------------ exercise 1 (in this process)
RENORMALISE = "    if k > 1:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n"


@pytest.mark.parametrize("edits, words", [
    (((RENORMALISE, "    weights = weights / weights.sum(dim=-1, keepdim=True)\n"),), "raw probability"),
    (((RENORMALISE, ""),), "renormalised to sum to 1"),
    ((("weights, expert_idx = probs.topk(k, dim=-1)", "weights, expert_idx = probs.detach().topk(k, dim=-1)"),),
     "no gradient flows"),
    ((("probs = torch.softmax(logits, dim=-1)", "probs = torch.softmax(logits, dim=0)"),), "probs"),
    ((("weights, expert_idx = probs.topk(k, dim=-1)", "weights, expert_idx = probs.topk(k, dim=-1)\n"
       "    weights, expert_idx = weights.flip(-1), expert_idx.flip(-1)"),), "best first"),
    ((("order = torch.argsort(expert, stable=True)", "order = torch.argsort(expert, descending=True)"),),
     "not sorted by expert"),
    ((("order = torch.argsort(expert, stable=True)", "order = torch.argsort(expert * len(expert) - "
       "torch.arange(len(expert)))"),), "token order"),
    ((("counts = torch.bincount(expert, minlength=n_expert)", "counts = torch.bincount(expert)"),),
     "experts nobody chose"),
    ((("send = counts.view(ep, n_expert // ep).sum(dim=1).tolist()", "send = counts.view(ep, n_expert // ep).sum(dim=1)"),),
     "Python list of ints"),
    ((("send = counts.view(ep, n_expert // ep).sum(dim=1).tolist()",
       "send = counts.view(n_expert // ep, ep).sum(dim=0).tolist()"),), "consecutive experts"),
])
def test_route_mistakes(edits, words):
    fails(lab11.route, *ex1(ns11(*edits)), words=words)


ROUTING_ALIAS = """
from minifsdp.models import top_k_routing as _pick


def route(logits, k):
    return _pick(logits, k)                               # the library's router top-k, under another name
"""
HIDDEN_ROUTING = """
def route(logits, k):
    import importlib
    lib = importlib.import_module("minifsdp." + "models")
    return getattr(lib, "top_k_" + "routing")(logits, k)  # only the wire sees it
"""


def test_route_library_shortcuts():
    message = shortcut_fails(lab11.route, *ex1(run_cell(ns11(), ROUTING_ALIAS)))    # refused statically
    assert "top_k_routing" in message, message
    message = shortcut_fails(lab11.route, *ex1(run_cell(ns11(), HIDDEN_ROUTING)))   # only the wire sees it
    assert "top_k_routing" in message, message


# ------------------------------------------------------------------------------------ exercise 2 (2 ranks)
@pytest.mark.parametrize("edits, words", [
    ((("comm.all_to_all_single(grad_in, grad_out.contiguous(), input_split_sizes, output_split_sizes,",
       "comm.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes, input_split_sizes,"),),
     "the split sizes swap places"),
    ((("rows = AllToAll.apply(x[token[order]], recv, send, group)", "rows = AllToAll.apply(x[token[order]], send, recv, group)"),),
     "output_split_sizes are the rows arriving"),
    ((("    return grad_in, None, None, None\n", "    return grad_in\n"),), "one gradient per input"),
    ((("return rows[by_expert], received.sum(dim=0).tolist(), (order, send, recv, by_expert)",
       "return rows, received.sum(dim=0).tolist(), (order, send, recv, by_expert)"),), "source by source"),
    ((("rows = AllToAll.apply(x[token[order]], recv, send, group)", "rows = AllToAll.apply(x[token], recv, send, group)"),),
     "not x[token] of the assignments"),
    ((("    return grad_in, None, None, None\n", "    return grad_out.new_zeros(grad_in.shape), None, None, None\n"),),
     "x's gradient differs"),
])
def test_dispatch_mistakes(edits, words):
    fails(lab11.dispatch, *ex2(ns11(*edits)), words=words)


RAW_ALL_TO_ALL = """
def dispatch(x, token, expert, n_expert, group=None):
    ep = dist.world_size(group)
    order, counts, send = split_sizes(expert, n_expert, ep)
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts, group=group)
    received = received.view(ep, n_expert // ep)
    recv = received.sum(dim=1).tolist()
    rows = x.new_empty(sum(recv), x.shape[1])
    comm.all_to_all_single(rows, x[token[order]].detach(), recv, send, group=group)   # no autograd: no way back
    local = torch.arange(n_expert // ep, device=rows.device).repeat(ep).repeat_interleave(received.reshape(-1))
    by_expert = torch.argsort(local, stable=True)
    return rows[by_expert], received.sum(dim=0).tolist(), (order, send, recv, by_expert)
"""


def test_dispatch_without_autograd_is_named():
    fails(lab11.dispatch, *ex2(run_cell(ns11(), RAW_ALL_TO_ALL)), words="no autograd history")


LIBRARY_FUNCTION = """
import minifsdp.expert_parallel.dispatch as _d


class AllToAll(_d.AllToAll):                              # the library's Function, subclassed
    pass
"""
HIDDEN_TORCH_ALL_TO_ALL = """
class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        raise RuntimeError("not used")

    @staticmethod
    def apply(x, output_split_sizes, input_split_sizes, group):
        import importlib
        fn = importlib.import_module("torch.distributed.nn." + "functional")
        out = x.new_empty((sum(output_split_sizes), *x.shape[1:]))
        return getattr(fn, "all_to_all_" + "single")(out, x, output_split_sizes, input_split_sizes, group)
"""


def test_dispatch_library_shortcuts():
    message = shortcut_fails(lab11.dispatch, *ex2(run_cell(ns11(), LIBRARY_FUNCTION)))          # statically
    assert "AllToAll" in message, message
    message = shortcut_fails(lab11.dispatch, *ex2(run_cell(ns11(), HIDDEN_TORCH_ALL_TO_ALL)))   # only the wire
    assert "all_to_all_single" in message or "AlltoAll" in message, message


# ------------------------------------------------------------------------------------ exercise 3 (2 ranks)
@pytest.mark.parametrize("edits, words", [
    ((("home = AllToAll.apply(outputs[arrived], send, recv, group)", "home = AllToAll.apply(outputs, send, recv, group)"),),
     "undo the grouping"),
    ((("home = AllToAll.apply(outputs[arrived], send, recv, group)", "home = AllToAll.apply(outputs[arrived], recv, send, group)"),),
     "swap places"),
    ((("return y.index_add(0, token[order], home * weight[order, None])", "return y.index_add(0, token[order], home)"),),
     "not mixed by the router's weights"),
    ((("return y.index_add(0, token[order], home * weight[order, None])",
       "return y.index_add(0, token[order], home * weight[:, None])"),), "same order"),
    ((("        if \".experts.\" not in name:                  # replicated: this rank's sequences only\n"
       "            comm.all_reduce(p.grad, group=group)\n",
       "        comm.all_reduce(p.grad, group=group)\n"),), "adds two experts together"),
    ((("        p.grad /= ep\n", ""),), "SUMS"),
    ((("            comm.all_reduce(p.grad, group=group)\n        p.grad /= ep\n",
       "            comm.all_reduce(p.grad, group=group)\n            p.grad /= ep\n"),), "divide by ep"),
])
def test_combine_mistakes(edits, words):
    fails(lab11.combine, *ex3(ns11(*edits)), words=words)


LIBRARY_MODEL = """
from minifsdp.expert_parallel import expert_parallel_gpt as _convert


def expert_parallel(model, group=None):
    return _convert(model, group)                        # the library's layers instead of yours
"""
HIDDEN_GRADIENTS = """
def sync_gradients(model, group=None):
    import importlib
    lib = importlib.import_module("minifsdp.expert_" + "parallel")
    getattr(lib, "all_reduce_" + "gradients")(model, group)   # only the wire sees it
"""
HIDDEN_COMBINE = """
def combine(outputs, plan, token, weight, n_tokens, group=None):
    import importlib
    lib = importlib.import_module("minifsdp.expert_" + "parallel")
    order, send, recv, by_expert = plan
    arrived = torch.empty_like(by_expert)
    arrived[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    home = getattr(lib, "all_" + "to_all")(outputs[arrived], send, recv, group)     # the library's all-to-all
    return home.new_zeros(n_tokens, home.shape[1]).index_add(0, token[order], home * weight[order, None])
"""


def test_combine_library_shortcuts():
    message = shortcut_fails(lab11.combine, *ex3(run_cell(ns11(), LIBRARY_MODEL)))        # statically
    assert "expert_parallel_gpt" in message, message
    message = shortcut_fails(lab11.combine, *ex3(run_cell(ns11(), HIDDEN_COMBINE)))       # only the wire
    assert "all_to_all" in message or "AllToAll" in message, message
    message = shortcut_fails(lab11.combine, *ex3(run_cell(ns11(), HIDDEN_GRADIENTS)))     # only the wire
    assert "all_reduce_gradients" in message, message


# ------------------------------------------------------------------------------------ the widget's formulas
def test_cost_formulas_count_what_a_model_holds():
    assert doctest.testmod(cost).failed == 0
    config = models.MODEL_PRESETS["gpt-moe-tiny"]
    full = models.build_model("gpt-moe-tiny")
    experts = sum(p.numel() for m in full.modules() if isinstance(m, models.MoE) for p in m.experts.parameters())
    for ep in (1, 2, 4, 8):
        s = cost.model_states(config, ep)
        assert s["experts_total"] == experts and s["replicated"] + experts == models.count_parameters(full)
        assert s["parameters"] == s["replicated"] + experts // ep and s["bytes"] == 16 * s["parameters"]
    a2a, ag = (cost.layer_bytes(256, 2, 32, 8, 8, kind) for kind in ("all_to_all", "all_gather"))
    assert ag["tokens"] == 4 * a2a["tokens"] and a2a["routing"] == 7 * 8       # ep / k = 4; 7 counts of 8 B
    assert cost.layer_bytes(256, 2, 32, 8, 1)["total"] == 0
    for name in ("gpt-moe-tiny", "gpt-moe-small"):                         # the planner's, for the trainer
        config = models.MODEL_PRESETS[name]
        layers = sum(config.is_moe_block(i) for i in range(config.n_layer))
        for ep in (2, 4, 8):
            blocks, rest = planner.moe_param_counts(config, ep)
            assert cost.model_states(config, ep)["parameters"] == sum(blocks) + rest
            for tokens in (96, 1024):
                mine = cost.layer_bytes(tokens, config.top_k, config.n_embd, config.n_expert, ep)["total"]
                assert layers * mine == planner.ep_comm_bytes(config, tokens, ep, ring=True)["all_to_all"]
    with pytest.raises(ValueError, match="not divisible"):
        cost.model_states(config, 3)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
