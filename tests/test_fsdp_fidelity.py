"""Code written for torch's FSDP1 or FairScale behaves the same on minifsdp (DESIGN's API conventions).

Each torch check runs one worker twice, once with ``torch.distributed.fsdp``
(on CPU: ``device_id=cpu``) and once with ``minifsdp.fsdp``, the code changing
only by its imports, and compares what the two return. FairScale's FSDP needs
CUDA, so its forms are checked against FairScale's documented behaviour (the
expectations of its own tests/nn/wrap/test_wrap.py) and, where ``fairscale`` is
installed, against its ``auto_wrap`` run on the same modules.
"""

import functools
import importlib
import warnings

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

from fsdp_helpers import gpt_batch, train_steps
from minifsdp import WorkerError, launch

ATOL, RTOL = 1e-5, 1e-4  # fp32 parity


def _api(side):
    """The names a user imports, from torch or from minifsdp, and the keyword that puts FSDP1 on CPU."""
    if side == "torch":
        import torch.distributed.fsdp as F
        from torch.distributed.fsdp import wrap as W
        extra = {"device_id": torch.device("cpu")}
    else:
        import minifsdp.fsdp as F
        from minifsdp.fsdp import wrap as W
        extra = {}
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch: FSDP1 and its old optimizer APIs
    return F, W, extra


def _units(model, fsdp_cls):
    return sorted(n.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
                  for n, m in model.named_modules() if isinstance(m, fsdp_cls))


def _gpt():
    from minifsdp.models import build_model

    return build_model("gpt-tiny", seed=0)


def _steps(model, opt, first, count):
    from minifsdp.models import lm_loss

    return train_steps(model, opt, gpt_batch, lm_loss, count, first)[0]


# --------------------------------------------------------------------------
# Import paths
# --------------------------------------------------------------------------
TORCH_PATH_NAMES = ["FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload",
                    "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig", "FullOptimStateDictConfig",
                    "StateDictSettings"]


@pytest.mark.parametrize("side", ["torch.distributed.fsdp", "minifsdp.fsdp"])
def test_import_paths(side):
    import types

    wrap_module = importlib.import_module(f"{side}.wrap")
    exec(f"import {side}.wrap as W", globals_ := {})
    assert isinstance(globals_["W"], types.ModuleType) and globals_["W"] is wrap_module  # not the wrap() function
    assert callable(wrap_module.wrap) and callable(wrap_module.enable_wrap)
    path = importlib.import_module(f"{side}.fully_sharded_data_parallel")
    assert all(hasattr(path, name) for name in TORCH_PATH_NAMES)
    assert path.FullyShardedDataParallel is importlib.import_module(side).FullyShardedDataParallel


# --------------------------------------------------------------------------
# Wrapping: enable_wrap + wrap with a policy, custom policies in torch's words, fsdp_modules
# --------------------------------------------------------------------------
def _wrapping(side):
    F, W, extra = _api(side)
    from minifsdp.models import Block

    with W.enable_wrap(wrapper_cls=F.FullyShardedDataParallel, auto_wrap_policy=W.ModuleWrapPolicy({Block}), **extra):
        model = W.wrap(_gpt())  # the policy goes on to the wrapper: one unit per Block
    out = {"enable_wrap": _units(model, F.FullyShardedDataParallel),
           "fsdp_modules": [len(F.FullyShardedDataParallel.fsdp_modules(model)),
                            len(F.FullyShardedDataParallel.fsdp_modules(model, root_only=True))],
           "losses": _steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3), 0, 2)}

    def named(module, recurse, nonwrapped_numel):  # torch's keywords
        return recurse or isinstance(module, nn.Linear) and nonwrapped_numel > 1000

    def any_keywords(module, recurse, **kwargs):  # torch's ModuleWrapPolicy style
        return recurse or kwargs["nonwrapped_numel"] > 10_000

    for name, policy in (("named", named), ("any_keywords", any_keywords)):
        model = F.FullyShardedDataParallel(_gpt(), auto_wrap_policy=policy, **extra)
        out[name] = _units(model, F.FullyShardedDataParallel)
    return out


def test_wrap_policies_and_fsdp_modules_match_torch():
    theirs = launch(_wrapping, 2, "torch", timeout=120)[0]
    ours = launch(_wrapping, 2, "minifsdp", timeout=120)[0]
    assert ours["enable_wrap"] == theirs["enable_wrap"] == ["", "blocks.0", "blocks.1"]
    assert ours["fsdp_modules"] == theirs["fsdp_modules"] == [3, 1]
    torch.testing.assert_close(ours["losses"], theirs["losses"], atol=ATOL, rtol=RTOL)
    assert ours["named"] == theirs["named"] and len(ours["named"]) == 1 + 2 * 4 + 1  # root, 4 Linears a Block, head
    assert ours["any_keywords"] == theirs["any_keywords"] == ["", "blocks.0", "blocks.1"]


# --------------------------------------------------------------------------
# State dict settings and the optimizer-state APIs
# --------------------------------------------------------------------------
def _optimizer_state(side):
    F, W, extra = _api(side)
    from minifsdp.models import Block

    FSDP = F.FullyShardedDataParallel

    def model_and_optim():
        model = FSDP(_gpt(), auto_wrap_policy=W.ModuleWrapPolicy({Block}), **extra)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    model, opt = model_and_optim()
    default = FSDP.get_state_dict_type(model)
    previous = FSDP.set_state_dict_type(model, F.StateDictType.SHARDED_STATE_DICT)
    now = FSDP.get_state_dict_type(model)
    FSDP.set_state_dict_type(model, F.StateDictType.FULL_STATE_DICT)
    settings = [(s.state_dict_type.name, type(s.state_dict_config).__name__, type(s.optim_state_dict_config).__name__)
                for s in (default, previous, now)]

    _steps(model, opt, 0, 2)
    full = FSDP.full_optim_state_dict(model, opt)  # rank 0 only (rank0_only=True by default)
    saved = FSDP.optim_state_dict(model, opt)  # FULL_STATE_DICT: the same, on every rank
    reference = _steps(model, opt, 2, 2)

    # load_directly=True: a fresh optimizer that took one step of its own gets the saved state
    model2, opt2 = model_and_optim()
    _steps(model2, opt2, 7, 1)
    own = FSDP.optim_state_dict(model2, opt2)
    result = FSDP.optim_state_dict_to_load(model2, opt2, saved, load_directly=True)
    loaded = {"into_optim": _same_state(opt2.state_dict(), result),
              "round_trip": _same_state(FSDP.optim_state_dict(model2, opt2), saved),
              "old_state_differed": not _same_state(own, saved)}

    # scatter_full_optim_state_dict: rank 0's full dict -> every rank's, then training continues identically
    model3, opt3 = model_and_optim()
    _steps(model3, opt3, 0, 2)
    opt3 = torch.optim.AdamW(model3.parameters(), lr=3e-3, weight_decay=0.1)  # the optimizer state is lost
    scattered = FSDP.scatter_full_optim_state_dict(full if tdist.get_rank() == 0 else None, model3, optim=opt3)
    opt3.load_state_dict(scattered)
    return {"settings": settings, "full": full, "loaded": loaded, "reference": reference,
            "resumed": _steps(model3, opt3, 2, 2)}


def _same_state(a, b):
    """Two optimizer state dicts hold the same keys, equal tensors and counters."""
    if sorted(a["state"]) != sorted(b["state"]):
        return False
    return all(sorted(a["state"][k]) == sorted(b["state"][k]) and all(
        torch.equal(torch.as_tensor(a["state"][k][n]).cpu(), torch.as_tensor(b["state"][k][n]).cpu())
        for n in a["state"][k]) for k in a["state"])


def test_state_dict_settings_and_optimizer_state_apis_match_torch():
    theirs = launch(_optimizer_state, 2, "torch", timeout=180)
    ours = launch(_optimizer_state, 2, "minifsdp", timeout=180)
    assert ours[0]["settings"] == theirs[0]["settings"] == [
        ("FULL_STATE_DICT", "FullStateDictConfig", "FullOptimStateDictConfig"),
        ("FULL_STATE_DICT", "FullStateDictConfig", "FullOptimStateDictConfig"),
        ("SHARDED_STATE_DICT", "ShardedStateDictConfig", "ShardedOptimStateDictConfig")]
    for rank in (0, 1):
        assert ours[rank]["loaded"] == theirs[rank]["loaded"] == {
            "into_optim": True, "round_trip": True, "old_state_differed": True}
        # scatter_full_optim_state_dict: training resumes exactly where it stopped
        assert ours[rank]["resumed"] == ours[rank]["reference"]
        assert theirs[rank]["resumed"] == theirs[rank]["reference"]
        torch.testing.assert_close(ours[rank]["reference"], theirs[rank]["reference"], atol=ATOL, rtol=RTOL)
    assert ours[1]["full"] == theirs[1]["full"] == {}  # rank0_only=True
    ours_full, theirs_full = ours[0]["full"], theirs[0]["full"]
    assert sorted(ours_full["state"]) == sorted(theirs_full["state"]) and len(ours_full["state"]) > 10
    assert ours_full["param_groups"] == theirs_full["param_groups"]
    for name, state in theirs_full["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(ours_full["state"][name][k], v, atol=ATOL, rtol=RTOL, msg=f"{name} {k}")


def _load_from_another_model():
    from minifsdp.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = FSDP.optim_state_dict(model, opt)
    other = FSDP(nn.Sequential(nn.Linear(4, 4)))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    FSDP.optim_state_dict_to_load(other, other_opt, saved, load_directly=True)


def test_load_directly_raises_rather_than_keep_the_old_state():
    with pytest.raises(WorkerError, match=r"no key of the checkpoint \(\['bias', 'weight'\]...\) names a parameter"):
        launch(_load_from_another_model, 2, timeout=60)


# --------------------------------------------------------------------------
# register_comm_hook with torch's own hooks; HYBRID_SHARD's default groups
# --------------------------------------------------------------------------
def _comm_hook(side, strategy):
    F, W, extra = _api(side)
    from torch.distributed.algorithms._comm_hooks import default_hooks

    from minifsdp.models import Block

    calls = []

    def counted(hook):
        def run(state, *tensors):
            calls.append(tensors[0].numel())
            return hook(state, *tensors)
        return run

    def run(with_hook):
        model = F.FullyShardedDataParallel(_gpt(), auto_wrap_policy=W.ModuleWrapPolicy({Block}),
                                           sharding_strategy=F.ShardingStrategy[strategy], **extra)
        if with_hook:
            hook = default_hooks.allreduce_hook if strategy == "NO_SHARD" else default_hooks.reduce_scatter_hook
            model.register_comm_hook(default_hooks.DefaultState(tdist.group.WORLD), counted(hook))
        return _steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3), 0, 2)

    hooked, plain = run(True), run(False)
    return {"hooked": hooked, "plain": plain, "calls": len(calls)}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_register_comm_hook_with_torchs_default_hooks(strategy):
    theirs = launch(_comm_hook, 2, "torch", strategy, timeout=120)[0]
    ours = launch(_comm_hook, 2, "minifsdp", strategy, timeout=120)[0]
    assert ours["calls"] == theirs["calls"] == 3 * 2  # each unit's gradient, each step
    torch.testing.assert_close(ours["hooked"], ours["plain"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours["hooked"], theirs["hooked"], atol=ATOL, rtol=RTOL)


def _hook_refused(case):
    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ModuleWrapPolicy, ShardingStrategy

    strategy = ShardingStrategy.HYBRID_SHARD if case == "hybrid" else ShardingStrategy.FULL_SHARD
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), sharding_strategy=strategy,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    if case == "child":  # after a forward every unit knows its root
        model(torch.ones(2, 4)).sum().backward()
    target = model.module[0] if case == "child" else model
    target.register_comm_hook(None, lambda state, grad, out: None)
    if case == "twice":
        model.register_comm_hook(None, lambda state, grad, out: None)


@pytest.mark.parametrize("case, message", [
    ("hybrid", "does not support HYBRID_SHARD"), ("child", "must be called on the root"),
    ("twice", "already registered; register it once")])
def test_register_comm_hook_refuses_what_torch_refuses(case, message):
    with pytest.raises(WorkerError, match=message):
        launch(_hook_refused, 2, case, timeout=60)


def _hybrid_default_groups(side):
    F, W, extra = _api(side)
    model = F.FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                                       sharding_strategy=F.ShardingStrategy.HYBRID_SHARD,
                                       auto_wrap_policy=W.ModuleWrapPolicy({nn.Linear}), **extra)
    if side == "torch":
        shard, replicate = model.process_group, model._inter_node_pg
    else:
        shard, replicate = model._shard_group, model._replicate_group
    children = [m for m in model.modules() if isinstance(m, F.FullyShardedDataParallel) and m is not model]
    same = all((c.process_group, c._inter_node_pg) == (shard, replicate) if side == "torch"
               else (c._shard_group, c._replicate_group) == (shard, replicate) for c in children)
    return shard.size(), replicate.size(), same


def test_hybrid_shard_without_a_group_takes_torchs_node_size():
    # torch: devices per node = torch.<device type>.device_count(); torch.cpu.device_count() is 1,
    # so on CPU the shard groups hold one rank and all ranks replicate (minifsdp.fsdp.strategy).
    for n in (2, 4):
        theirs = launch(_hybrid_default_groups, n, "torch", timeout=120)
        ours = launch(_hybrid_default_groups, n, "minifsdp", timeout=120)
        assert ours == theirs == [(torch.cpu.device_count(), n, True)] * n


# --------------------------------------------------------------------------
# FairScale's forms: summon_full_params on the instance, auto_wrap and its policies
# --------------------------------------------------------------------------
def _summon_forms():
    from minifsdp.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 3))
    with model.summon_full_params():  # FairScale: an instance context manager, changes written back
        shape = tuple(model.module.weight.shape)
        model.module.weight.data.fill_(1.0)
    with model.summon_full_params(volatile=True):  # FairScale: volatile=True drops changes
        model.module.weight.data.fill_(2.0)
    with FSDP.summon_full_params(model, writeback=False):  # torch: static, on any module
        after = model.module.weight.detach().clone()
    with model.summon_full_params(model, with_grads=False):  # torch's form called on an instance
        again = model.module.weight.detach().clone()
    return shape, after.unique().tolist(), again.unique().tolist()


def test_summon_full_params_fairscale_and_torch_forms():
    for shape, after, again in launch(_summon_forms, 2, timeout=60):
        assert shape == (3, 4) and after == again == [1.0]


class Box(nn.Module):
    """A stand-in wrapper class: auto_wrap only decides *which* modules get wrapped."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.module, self.kwargs = module, kwargs


def _describe(m):
    if isinstance(m, Box):
        return f"Box({_describe(m.module)})"
    kids = [_describe(c) for c in m.children()]
    return type(m).__name__ + (f"({', '.join(kids)})" if kids else "")


# FairScale's tests/nn/wrap/test_wrap.py: the module, the policy's keywords, the wrapping it documents
FAIRSCALE_CASES = [
    (lambda: nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))),
     {"min_num_params": 60}, "Sequential(Linear, Box(Sequential(Linear, Linear)))"),
    (lambda: nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))),
     {"min_num_params": 60, "skip_params_check_for_root": True}, "Box(Sequential(Linear, Box(Sequential(Linear, Linear))))"),
    (lambda: nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), {"min_num_params": 40}, "ModuleList(Linear, Linear)"),
    (lambda: nn.ModuleList([nn.Linear(10, 10)]), {"min_num_params": 40}, "ModuleList(Box(Linear))"),
    (lambda: nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)), {"min_num_params": 40},
     "Box(Sequential(Box(Linear), MultiheadAttention(NonDynamicallyQuantizableLinear)))"),
    (lambda: nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])),
     {"min_num_params": 40, "force_leaf_modules": {nn.MultiheadAttention, nn.Linear}},
     "Box(Sequential(Linear, ModuleList(Linear)))"),
]


def _fairscale_wrap(lib, build, policy_kwargs, in_context):
    """FairScale's code, with ``lib`` = ``fairscale.nn.wrap`` or ``minifsdp.fsdp.wrap``."""
    policy = functools.partial(lib.default_auto_wrap_policy, **policy_kwargs)
    if in_context:  # the policy given to enable_wrap (FairScale's own keyword)
        with lib.enable_wrap(auto_wrap_policy=policy, wrapper_cls=Box):
            return lib.auto_wrap(build())
    with lib.enable_wrap(wrapper_cls=Box):
        return lib.auto_wrap(build(), auto_wrap_policy=policy)


@pytest.mark.parametrize("case", range(len(FAIRSCALE_CASES)))
def test_auto_wrap_does_what_fairscale_documents(case):
    from minifsdp.fsdp import wrap as ours

    build, policy_kwargs, expected = FAIRSCALE_CASES[case]
    assert _describe(_fairscale_wrap(ours, build, policy_kwargs, in_context=case == 5)) == expected


def _policy_calls(lib):
    """A FairScale-style custom policy (it names module_is_root): which questions it is asked."""
    calls = []

    def policy(module, recurse, unwrapped_params, module_is_root):
        calls.append((type(module).__name__, recurse, unwrapped_params, module_is_root))
        return recurse or module_is_root or unwrapped_params >= 50

    with lib.enable_wrap(wrapper_cls=Box):
        model = lib.auto_wrap(nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(8, 8), nn.ReLU())),
                              auto_wrap_policy=policy)
    return _describe(model), calls


def test_custom_policy_is_asked_fairscales_questions():
    from minifsdp.fsdp import wrap as ours

    wrapped, calls = _policy_calls(ours)
    assert wrapped == "Box(Sequential(Linear, Sequential(Box(Linear), ReLU)))"
    assert calls[0] == ("Sequential", True, 20 + 72, True) and calls[-1] == ("Sequential", False, 20, True)
    assert all(not is_root for *_, is_root in calls[1:-1])  # only the module given to auto_wrap is the root


@pytest.mark.parametrize("case", range(len(FAIRSCALE_CASES)))
def test_auto_wrap_same_as_fairscale_itself(case):
    fairscale_wrap = pytest.importorskip("fairscale.nn.wrap")
    from minifsdp.fsdp import wrap as ours

    build, policy_kwargs, expected = FAIRSCALE_CASES[case]
    in_context = case == 5
    theirs = _describe(_fairscale_wrap(fairscale_wrap, build, policy_kwargs, in_context))
    assert _describe(_fairscale_wrap(ours, build, policy_kwargs, in_context)) == theirs == expected
    assert _policy_calls(ours) == _policy_calls(fairscale_wrap)
