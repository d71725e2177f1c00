"""The checks of lab 03 (ZeRO): pass on the solution, fail in words on the rest.

The learner's functions come from the notebooks themselves: the cells that
define them (and the scaffolding around them) are executed into a fresh
namespace, from ``solutions/NN.ipynb`` (the solution), from ``labs/NN.ipynb``
(the blank lab: every exercise still raises NotImplementedError), or from the
solution with one line changed (a typical mistake). Each runs through the
one-call check of the lab, which must pass, or fail with ``CheckFailed`` and a
message naming what is wrong. Each exercise also has "library shortcuts" - the
exercise answered with minifsdp's (or torch's) ZeRO, the way a learner looking
for one would write it - and each must fail, saying "library": the visible
forms (a notebook helper, an alias, a subclass) statically, the hidden ones
(an import by a computed name) at run time, inside the launched workers.
"""

from __future__ import annotations

import pytest

from labcheck_helpers import cells, namespace, shortcut_fails  # noqa: F401
from labcheck_helpers import fails_with as fails
from minifsdp.labcheck import lab03

# -------------------------------------------------------------------------------- lab 03
SETUP03 = ("from minifsdp.labcheck import lab03 as check",)
EX03 = ("def greedy_partition", "def local_optimizer", "def install_zero2", "def predict_model_states")


def lab03_fns(notebook: str = "solutions/03_zero.ipynb", edits: dict[str, str] | None = None) -> dict:
    return namespace(cells(notebook, *SETUP03, *EX03), edits)


@pytest.fixture(scope="module")
def sol03() -> dict:
    return lab03_fns()


@pytest.fixture(scope="module")
def blank03() -> dict:
    return lab03_fns("labs/03_zero.ipynb")


def ownership_args(ns: dict) -> tuple:
    return ns["greedy_partition"], ns["owner_buckets"], ns["unpack_bucket"]


def zero1_args(ns: dict) -> tuple:
    return ns["greedy_partition"], ns["local_optimizer"], ns["zero1_step"], ns["consolidate_state"]


def zero2_args(ns: dict) -> tuple:
    return ns["greedy_partition"], ns["local_optimizer"], ns["zero1_step"], ns["install_zero2"]


# Bytes of a made-up 100-parameter model in two tensors, as the tracker and comm would record them
RUNS = {"ddp": {2: [{"parameters": 400, "gradients": 400, "optimizer": 808, "owned_numel": 100,
                     "owned_tensors": 2, "bytes": {"all_reduce": 800}}] * 2},
        "zero1": {2: [{"parameters": 400, "gradients": 400, "optimizer": 488, "owned_numel": 60,
                       "owned_tensors": 1 + 1, "bytes": {"all_reduce": 800, "broadcast": 400}},
                      {"parameters": 400, "gradients": 400, "optimizer": 328, "owned_numel": 40,
                       "owned_tensors": 2, "bytes": {"all_reduce": 800, "broadcast": 400}}]},
        "zero2": {1: [{"parameters": 400, "gradients": 400, "optimizer": 808, "owned_numel": 100,
                       "owned_tensors": 2, "bytes": {}}],
                  2: [{"parameters": 400, "gradients": 240, "optimizer": 488, "owned_numel": 60,
                       "owned_tensors": 2, "bytes": {"reduce": 400, "broadcast": 400}},
                      {"parameters": 400, "gradients": 160, "optimizer": 328, "owned_numel": 40,
                       "owned_tensors": 2, "bytes": {"reduce": 400, "broadcast": 400}}]}}


def test_lab03_checks_pass_on_the_solution(sol03, capsys):
    lab03.ownership(*ownership_args(sol03))
    lab03.zero1(*zero1_args(sol03), world_sizes=(2,))
    lab03.zero2(*zero2_args(sol03), world_sizes=(2,))
    lab03.predict_model_states(sol03["predict_model_states"], RUNS, 100)
    out = capsys.readouterr().out
    assert out.count("✅ passed") == 4, out
    assert "2·4Ψ" in out and "Ψ = " in out and "parameters" in out, out


def test_lab03_checks_never_run_one_rank(sol03, capsys):
    """World size 1 proves nothing: asked for 1, a check still runs (and holds the code to) 2 ranks."""
    lab03.zero1(*zero1_args(sol03), world_sizes=(1,))
    assert "at 2 ranks" in capsys.readouterr().out
    only_one = {"ddp": {1: RUNS["zero2"][1]}}
    fails(lambda: lab03.predict_model_states(sol03["predict_model_states"], only_one, 100), "2 ranks or more")


def test_lab03_checks_fail_on_the_blank_lab(blank03):
    fails(lambda: lab03.ownership(*ownership_args(blank03)), "not written yet", "check.hint")
    fails(lambda: lab03.zero1(*zero1_args(blank03)), "not written yet")
    fails(lambda: lab03.zero2(*zero2_args(blank03)), "not written yet")
    fails(lambda: lab03.predict_model_states(blank03["predict_model_states"], RUNS, 100), "not written yet")


def test_lab03_hints_come_one_at_a_time(capsys):
    for name in ("greedy_partition", "owner_buckets", "unpack_bucket", "local_optimizer", "zero1_step",
                 "consolidate_state", "install_zero2", "predict_model_states"):
        lab03.hint(name)
        first = capsys.readouterr().out
        assert first.startswith(f"hint 1 of ") and all(len(line) <= 100 for line in first.splitlines()), first
        lab03.hint.again(name)


def test_lab03_library_source_only_after_the_check(capsys):
    saved = lab03.results.pop("ZeRO-2", None)
    try:
        lab03.library_hook()
        assert "def _on_grad_ready" not in capsys.readouterr().out
    finally:
        if saved is not None:
            lab03.results["ZeRO-2"] = saved


def test_lab03_ownership_mistakes():
    in_order = lab03_fns(edits={"sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))": "range(len(sizes))"})
    fails(lambda: lab03.ownership(*ownership_args(in_order)), "list order")
    last_rank = lab03_fns(edits={"r = load.index(min(load))": "r = len(load) - 1 - load[::-1].index(min(load))"})
    fails(lambda: lab03.ownership(*ownership_args(last_rank)), "ties")
    every = lab03_fns(edits={"for t, o in zip(tensors, owners) if o == r]": "for t, o in zip(tensors, owners)]"})
    fails(lambda: lab03.ownership(*ownership_args(every)), "owns")
    rebinds = lab03_fns(edits={"t.data.copy_(bucket[offset:offset + n].view_as(t))":
                               "t = bucket[offset:offset + n].view_as(t)"})
    fails(lambda: lab03.ownership(*ownership_args(rebinds)), "in place")


def test_lab03_zero1_mistakes():
    full_state = lab03_fns(edits={"mine = [p for p, owner in zip(params, owners) if owner == rank]": "mine = params"})
    fails(lambda: lab03.zero1(*zero1_args(full_state), world_sizes=(2,)), "full AdamW state")
    no_broadcast = lab03_fns(edits={"            comm.broadcast(buckets[r], src=r)\n": ""})
    fails(lambda: lab03.zero1(*zero1_args(no_broadcast), world_sizes=(2,)), "differ from rank 0", "owner")
    per_parameter = lab03_fns(edits={
        "    buckets = owner_buckets(params, owners, n)\n    for r in range(n):\n        if buckets[r].numel():\n"
        "            comm.broadcast(buckets[r], src=r)\n            unpack_bucket(buckets[r], params, owners, r)\n":
        "    for p, owner in zip(params, owners):\n        comm.broadcast(p.data, src=owner)\n"})
    fails(lambda: lab03.zero1(*zero1_args(per_parameter), world_sizes=(2,)), "at most 2", "owner_buckets")


def test_lab03_consolidate_mistakes():
    from_rank0 = lab03_fns(edits={"comm.broadcast(t, src=owner)": "comm.broadcast(t, src=0)"})
    fails(lambda: lab03.zero1(*zero1_args(from_rank0), world_sizes=(2,)), "consolidated", "owner")
    everywhere = lab03_fns(edits={"return state if dist.rank() == 0 else None": "return state"})
    fails(lambda: lab03.zero1(*zero1_args(everywhere), world_sizes=(2,)), "other than 0")


def test_lab03_zero2_mistakes():
    keeps = lab03_fns(edits={"            p.grad = None            # not ours": "            pass  # not ours"})
    fails(lambda: lab03.zero2(*zero2_args(keeps), world_sizes=(2,)),
          "still holds every gradient", r"p\.grad = None")
    no_average = lab03_fns(edits={"        p.grad.div_(n)\n": ""})
    fails(lambda: lab03.zero2(*zero2_args(no_average), world_sizes=(2,)), "divide by N")


def test_lab03_predict_mistakes(sol03):
    elements = lab03_fns(edits={"    grads = owned_numel if stage >= 2 else n_params":
                                "    FP32 = 1\n    grads = owned_numel if stage >= 2 else n_params"})
    fails(lambda: lab03.predict_model_states(elements["predict_model_states"], RUNS, 100), "counted elements")
    no_step = lab03_fns(edits={" + FP32 * owned_tensors,": ","})
    fails(lambda: lab03.predict_model_states(no_step["predict_model_states"], RUNS, 100), "step counter")
    paper = lab03_fns(edits={"    broadcast = FP32 * n_params if stage >= 1 else 0":
                             "    broadcast = FP32 * n_params if stage >= 2 else 0"})
    fails(lambda: lab03.predict_model_states(paper["predict_model_states"], RUNS, 100), "FairScale", "3|2·4Ψ")
    one_rank = lab03_fns(edits={"if world_size > 1 else 0}": "}"})
    fails(lambda: lab03.predict_model_states(one_rank["predict_model_states"], RUNS, 100), "world of one")


# ------------------------------------------------------------------ library shortcuts, one or more per exercise
# Visible forms (a notebook helper, an alias, a subclass): refused statically. Hidden forms (the library
# fetched by a computed name, so no reader of the code can see it): the Wire trips when it runs.
HIDDEN = "__import__('importlib').import_module('minifsdp.' + 'zero')"


def test_lab03_ownership_shortcuts():
    helper = lab03_fns(edits={
        "def greedy_partition(sizes: list[int], world_size: int) -> list[int]:":
        "from minifsdp.zero import partition_parameters as _by_size\n\n\n"
        "def _owners(sizes, n):\n    return _by_size([torch.empty(s) for s in sizes], n)\n\n\n"
        "def greedy_partition(sizes: list[int], world_size: int) -> list[int]:\n"
        "    return _owners(sizes, world_size)"})
    shortcut_fails(lab03.ownership, *ownership_args(helper))
    hidden = lab03_fns(edits={
        "def greedy_partition(sizes: list[int], world_size: int) -> list[int]:":
        "def greedy_partition(sizes: list[int], world_size: int) -> list[int]:\n"
        f"    return getattr({HIDDEN}, 'partition_' + 'parameters')([torch.empty(s) for s in sizes], world_size)"})
    message = shortcut_fails(lab03.ownership, *ownership_args(hidden))
    assert "partition_parameters" in message, message


def test_lab03_zero1_shortcuts():
    alias = lab03_fns(edits={
        "    mine = [p for p, owner in zip(params, owners) if owner == rank]\n"
        "    return torch.optim.AdamW(mine, **adamw_kwargs)":
        "    from minifsdp.zero import ZeroRedundancyOptimizer as Sharded\n"
        "    return Sharded(params, optimizer_class=torch.optim.AdamW, **adamw_kwargs)",
        "    optimizer.step()\n    n = dist.world_size()": "    optimizer.step()\n    return\n    n = dist.world_size()"})
    shortcut_fails(lab03.zero1, *zero1_args(alias), (2,))
    subclass = lab03_fns(edits={
        "def local_optimizer(": "from minifsdp.zero import OSS\n\n\nclass MyShards(OSS):\n"
                                "    def __init__(self, params, **kw):\n"
                                "        super().__init__(params, optim=torch.optim.AdamW, **kw)\n\n\n"
                                "def local_optimizer(",
        "    return torch.optim.AdamW(mine, **adamw_kwargs)": "    return MyShards(params, **adamw_kwargs)"})
    shortcut_fails(lab03.zero1, *zero1_args(subclass), (2,))
    torch_zero = lab03_fns(edits={
        "    return torch.optim.AdamW(mine, **adamw_kwargs)":
        "    from torch.distributed.optim import ZeroRedundancyOptimizer as Z\n"
        "    return Z(params, optimizer_class=torch.optim.AdamW, **adamw_kwargs)"})
    shortcut_fails(lab03.zero1, *zero1_args(torch_zero), (2,))
    hidden = lab03_fns(edits={
        "    return torch.optim.AdamW(mine, **adamw_kwargs)":
        f"    return getattr({HIDDEN}, 'O' + 'SS')(params, optim=torch.optim.AdamW, **adamw_kwargs)",
        "    optimizer.step()\n    n = dist.world_size()": "    optimizer.step()\n    return\n    n = dist.world_size()"})
    message = shortcut_fails(lab03.zero1, *zero1_args(hidden), (2,))
    assert "OSS" in message, message


SDP_HOOK = ("    sdp = object.__new__(SDP)\n    torch.nn.Module.__init__(sdp)\n"
            "    sdp._sync, sdp._callback_queued, sdp.reduce_dtype, sdp.shard_gradients = True, False, None, True\n"
            "    sdp.group, sdp.rank, sdp.world_size = None, dist.rank(), dist.world_size()\n"
            "    sdp._owner, sdp._in_flight, sdp.max_inflight_bytes = dict(zip(params, owners)), [], 0\n"
            "    for p in params:\n        p.register_post_accumulate_grad_hook(sdp._on_grad_ready)\n    return\n")


def test_lab03_zero2_shortcuts():
    alias = lab03_fns(edits={"    rank, n = dist.rank(), dist.world_size()\n\n    def reduce_to_owner":
                             SDP_HOOK + "    rank, n = dist.rank(), dist.world_size()\n\n    def reduce_to_owner",
                             "def install_zero2(": "from minifsdp.zero import ShardedDataParallel as SDP\n\n\n"
                                                   "def install_zero2("})
    shortcut_fails(lab03.zero2, *zero2_args(alias), (2,))
    hidden = lab03_fns(edits={"    rank, n = dist.rank(), dist.world_size()\n\n    def reduce_to_owner":
                              f"    SDP = getattr({HIDDEN}, 'Sharded' + 'DataParallel')\n" + SDP_HOOK +
                              "    rank, n = dist.rank(), dist.world_size()\n\n    def reduce_to_owner"})
    message = shortcut_fails(lab03.zero2, *zero2_args(hidden), (2,))
    assert "ShardedDataParallel" in message, message


def test_lab03_predict_shortcuts():
    helper = lab03_fns(edits={
        "    grads = owned_numel if stage >= 2 else n_params":
        "    return _formula(stage, n_params, world_size)\n    grads = owned_numel if stage >= 2 else n_params",
        "def predict_model_states(": "def _formula(stage, n_params, n):\n"
                                    "    return estimate.model_state_bytes_per_device(n_params, n, stage)\n\n\n"
                                    "def predict_model_states("})
    shortcut_fails(lab03.predict_model_states, helper["predict_model_states"], RUNS, 100)
    measured = lab03_fns(edits={
        "    grads = owned_numel if stage >= 2 else n_params":
        "    runs = check.strategy_runs((world_size,))\n    grads = owned_numel if stage >= 2 else n_params"})
    shortcut_fails(lab03.predict_model_states, measured["predict_model_states"], RUNS, 100)
    hidden = lab03_fns(edits={
        "    grads = owned_numel if stage >= 2 else n_params":
        "    est = __import__('importlib').import_module('minifsdp.' + 'estimate')\n"
        "    getattr(est, 'comm_bytes_' + 'per_step')(n_params, 2, 'zero2')\n"
        "    grads = owned_numel if stage >= 2 else n_params"})
    message = shortcut_fails(lab03.predict_model_states, hidden["predict_model_states"], RUNS, 100)
    assert "comm_bytes_per_step" in message, message
