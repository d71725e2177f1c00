"""FSDP options, each with an effect a test observes: prefetch order in the trace, the all-gather
limit, bf16 mixed precision (loss within BF16_RTOL of fp32, bf16 on the wire), CPU offload,
ignored modules, sync_module_states, summon_full_params, user code written for torch's FSDP
and FairScale, and a process group made by torchrun."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

from minifsdp import launch, trace
from minifsdp.fsdp import (BackwardPrefetch, CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision,
                           ModuleWrapPolicy, StateDictType, auto_wrap, enable_wrap)
from minifsdp.fsdp.wrap import wrap

ATOL, RTOL = 1e-5, 1e-4   # fp32 parity
BF16_RTOL = 1e-2          # bf16 keeps 8 significant bits: the bf16 loss itself is rounded to 2^-5 near 5.5


def _gpt(**overrides):
    from minifsdp.models import build_model

    return build_model("gpt-tiny", seed=0, **overrides)


def _data(step, n=1, r=0, batch=8, seq=16):
    data = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(step))
    rows = slice(r * batch // n, (r + 1) * batch // n)
    return data[rows, :-1], data[rows, 1:]


def _train(model, steps, clip=None):
    from minifsdp.models import lm_loss

    n, r = (tdist.get_world_size(), tdist.get_rank()) if tdist.is_initialized() else (1, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = _data(step, n, r)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().float()
        if tdist.is_initialized():
            tdist.all_reduce(loss)
        losses.append(loss.item() / n)
    return losses


@pytest.fixture(scope="module")
def fp32_losses():
    return _train(_gpt(), 3)


# --------------------------------------------------------------------------
# Prefetch and the all-gather limit, seen in the trace
# --------------------------------------------------------------------------
def _prefetch_trace(backward_prefetch, forward_prefetch):
    from minifsdp.models import Block

    model = FSDP(_gpt(n_layer=3), auto_wrap_policy=ModuleWrapPolicy({Block}), backward_prefetch=backward_prefetch,
                 forward_prefetch=forward_prefetch)
    with trace.Tracer() as tracer:
        losses = _train(model, 2)
    spans = [(s.name, s.kind, s.start, s.args.get("unit"), s.args.get("dtype")) for s in tracer.trace.spans]
    return losses, spans


def _last(spans, name, unit):
    return [s for s in spans if s[0] == name and s[3] == unit][-1][2]


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST", None])
def test_backward_prefetch_moves_the_next_all_gather(prefetch):
    bp = BackwardPrefetch[prefetch] if prefetch else None
    losses, spans = launch(_prefetch_trace, 2, bp, False, timeout=120)[0]
    # Backward runs blocks.2, blocks.1, blocks.0: when does blocks.1's backward all-gather start?
    gather = _last(spans, "all_gather", "blocks.1")           # the last one of step 2 is backward's
    post_b2 = _last(spans, "post_backward blocks.2", "blocks.2")
    pre_b2 = _last(spans, "pre_backward blocks.2", "blocks.2")
    pre_b1 = _last(spans, "pre_backward blocks.1", "blocks.1")
    if prefetch == "BACKWARD_PRE":     # issued in blocks.2's pre-backward, before its gradient compute
        assert pre_b2 < gather < post_b2
    elif prefetch == "BACKWARD_POST":  # issued once blocks.2's gradients are done
        assert post_b2 < gather < pre_b1
    else:                              # on demand, when blocks.1's own backward starts
        assert pre_b1 < gather
    # Each unit is gathered once per forward and once per backward, whatever the prefetch (the root
    # stays unsharded from its forward to its backward): with BACKWARD_POST the root's post-backward,
    # which runs last, must not prefetch blocks.2 again (its backward ran first).
    gathers = {u: sum(1 for s in spans if s[0] == "all_gather" and s[3] == u) for u in {s[3] for s in spans}}
    assert {u: n for u, n in gathers.items() if n} == {"root": 2, "blocks.0": 4, "blocks.1": 4, "blocks.2": 4}
    # every collective names its unit; every unit is freed after use
    assert all(s[3] for s in spans if s[1] == "comm")
    assert {s[3] for s in spans if s[0].startswith("reshard")} >= {"blocks.0", "blocks.1", "blocks.2", "root"}
    # prefetching changes when parameters arrive, never the numbers
    torch.testing.assert_close(losses, _train(_gpt(n_layer=3), 2), atol=ATOL, rtol=RTOL)


def test_forward_prefetch_gathers_the_next_unit_early():
    def second_step(forward_prefetch):
        _, spans = launch(_prefetch_trace, 2, BackwardPrefetch.BACKWARD_PRE, forward_prefetch, timeout=120)[0]
        return [s for s in spans if s[2] >= _last(spans, "forward root", "root")]

    def first(spans, name, unit=None):
        return next(s[2] for s in spans if s[0] == name and unit in (None, s[3]))
    spans = second_step(True)   # the order of the first step is known: blocks.1 follows blocks.0
    assert first(spans, "forward blocks.0") < first(spans, "all_gather", "blocks.1") < first(spans, "forward blocks.1")
    spans = second_step(False)  # gathered on demand inside its own forward
    assert first(spans, "forward blocks.1") < first(spans, "all_gather", "blocks.1")


def _nested_units(limit):
    torch.manual_seed(0)
    unit = functools.partial(FSDP, forward_prefetch=True, limit_all_gathers=limit)
    model = unit(nn.Sequential(unit(nn.Sequential(nn.Linear(8, 8), unit(nn.Linear(8, 8)))), unit(nn.Linear(8, 8)),
                               nn.Linear(8, 2)))
    opt = torch.optim.AdamW(model.parameters())
    losses = []
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + tdist.get_rank()))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.stats, losses


def test_limit_all_gathers_bounds_unsharded_units():
    limited, l1 = launch(_nested_units, 2, True, timeout=120)[0]
    free, l2 = launch(_nested_units, 2, False, timeout=120)[0]
    # forward order: root, outer, inner, second. In inner's forward the prefetch of "second" would make
    # three non-root units unsharded (outer, inner, second): the limit skips it.
    assert limited["peak_unsharded_units"] == 2 and limited["prefetches_skipped"] >= 1
    assert free["peak_unsharded_units"] == 3 and free["prefetches_skipped"] == 0
    assert l1 == l2


# --------------------------------------------------------------------------
# Backward's memory: one full-size gradient per unit, as in torch's FSDP1
# --------------------------------------------------------------------------
def _full_size_gradients(backward_prefetch):
    """How many fresh full-size (one unit's flat size) tensors backward makes, over 2 steps of 4 units
    (2 Linear(128, 128) each), ours then torch FSDP1's."""
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch, FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    unit_numel = 2 * (128 * 128 + 128)  # no padding at 2 or 3 ranks

    class CountFullSize(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (torch._C._current_graph_task_id() != -1 and isinstance(out, torch.Tensor)  # in backward
                    and out.numel() == unit_numel and not out.is_meta):
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                self.n += out.untyped_storage().data_ptr() not in inputs  # new memory, not a view or in place
            return out

    def count(wrap):
        torch.manual_seed(0)
        model = wrap(nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128))
                                     for _ in range(4)]))
        opt = torch.optim.AdamW(model.parameters())
        with CountFullSize() as counter:
            for step in range(2):
                model(torch.randn(2, 128, generator=torch.Generator().manual_seed(step))).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return counter.n

    ours = count(lambda m: FSDP(m, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                                backward_prefetch=BackwardPrefetch[backward_prefetch]))
    theirs = count(lambda m: TorchFSDP(m, auto_wrap_policy=TorchPolicy({nn.Sequential}), device_id=torch.device("cpu"),
                                       backward_prefetch=TorchPrefetch[backward_prefetch]))
    return ours, theirs


@pytest.mark.parametrize("n, prefetch", [(2, "BACKWARD_PRE"), (3, "BACKWARD_POST")])
def test_backward_makes_one_full_size_gradient_per_unit(n, prefetch):
    # Views made by one split: its backward concatenates the parameters' gradients once per unit. With
    # one slice per parameter, backward made a zero-padded full-size tensor per parameter and summed them
    # (4 + 3 per unit here; gpt-small's FULL_SHARD peak was 170.9 MiB instead of torch's 164.8 at 2 ranks).
    for ours, theirs in launch(_full_size_gradients, n, prefetch, timeout=120):
        assert ours == theirs == 4 * 2  # 4 units x 2 steps


# --------------------------------------------------------------------------
# Mixed precision and CPU offload
# --------------------------------------------------------------------------
def _mixed(mp):
    from minifsdp.models import Block

    model = FSDP(_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    with trace.Tracer() as tracer:
        losses = _train(model, 3)
    dtypes = {(s.name, s.args["dtype"]) for s in tracer.trace.comm_spans()
              if s.name in ("all_gather", "reduce_scatter")}
    masters = {str(p.dtype) for p in model.parameters()}
    return losses, dtypes, masters


def test_bf16_mixed_precision(fp32_losses):
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    losses, dtypes, masters = launch(_mixed, 2, bf16, timeout=120)[0]
    torch.testing.assert_close(losses, fp32_losses, atol=0, rtol=BF16_RTOL)
    assert losses != fp32_losses                      # it really computed in bf16
    assert dtypes == {("all_gather", "bfloat16"), ("reduce_scatter", "bfloat16")}
    assert masters == {"torch.float32"}               # the sharded master copy stays fp32
    # fp32 reduction of bf16 gradients; FairScale's mixed_precision=True shorthand
    _, dtypes, _ = launch(_mixed, 2, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                          timeout=120)[0]
    assert dtypes == {("all_gather", "bfloat16"), ("reduce_scatter", "float32")}
    _, dtypes, _ = launch(_mixed, 2, True, timeout=120)[0]   # FairScale's meaning: fp16 compute and reduction
    assert dtypes == {("all_gather", "float16"), ("reduce_scatter", "float16")}


def _offloaded():
    from minifsdp.models import Block

    model = FSDP(_gpt(), auto_wrap_policy=ModuleWrapPolicy({Block}), cpu_offload=CPUOffload(offload_params=True))
    losses = _train(model, 3)
    from minifsdp.models import lm_loss
    x, y = _data(0, 2, tdist.get_rank())
    lm_loss(model(x), y).backward()  # leave gradients in place to look at them
    handles = [h for u in model.modules() if isinstance(u, FSDP) for h in u._handles]
    return losses, {
        "shard_devices": {str(h.flat_param.device) for h in handles},
        "grad_devices": {str(h.flat_param.grad.device) for h in handles if h.flat_param.grad is not None},
        "distinct": all(not h.aliased and h._full.data_ptr() != h.flat_param.data_ptr() for h in handles),
        "freed": all(h._full.untyped_storage().nbytes() == 0 for h in handles),
    }


def test_cpu_offload_plumbing(fp32_losses):
    # On this CPU-only machine the compute device is the CPU too: nothing moves, but the shard and
    # the unsharded buffer are distinct host tensors and the latter is freed after use.
    losses, info = launch(_offloaded, 2, timeout=120)[0]
    torch.testing.assert_close(losses, fp32_losses, atol=ATOL, rtol=RTOL)
    assert info == {"shard_devices": {"cpu"}, "grad_devices": {"cpu"}, "distinct": True, "freed": True}


# --------------------------------------------------------------------------
# ignored_modules, sync_module_states, summon_full_params
# --------------------------------------------------------------------------
def _ignored():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model = FSDP(net, ignored_modules=[net[2]], auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(tdist.get_rank()))
    model(x).sum().backward()
    ignored = net[2].weight
    return {"kept": isinstance(ignored, nn.Parameter) and tuple(ignored.shape) == (8, 8),
            "not_wrapped": not isinstance(net[2], FSDP) and isinstance(net[0], FSDP),
            "in_parameters": any(p is ignored for p in model.parameters()),
            "grad": ignored.grad.clone()}


def test_ignored_modules_stay_plain_and_unsynchronized():
    outs = launch(_ignored, 2, timeout=60)
    for o in outs:
        assert o["kept"] and o["not_wrapped"] and o["in_parameters"]
    assert not torch.allclose(outs[0]["grad"], outs[1]["grad"])  # local gradients: FSDP does not touch them


def _sync_and_summon():
    from minifsdp.models import Block

    model = FSDP(_gpt_seeded(tdist.get_rank()), auto_wrap_policy=ModuleWrapPolicy({Block}), sync_module_states=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        synced = model.state_dict()
    with FSDP.summon_full_params(model):
        names = [n for n, _ in model.named_parameters()]
        model.blocks[0].ln_1.weight.data.fill_(7.0)  # written back to the shards on exit
    with FSDP.summon_full_params(model, writeback=False):
        model.blocks[1].ln_1.weight.data.fill_(9.0)  # discarded
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        after = model.state_dict()
    from minifsdp.models import lm_loss
    x, y = _data(0, 2, tdist.get_rank())
    lm_loss(model(x), y).backward()
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        rank0_only = sorted(n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters())[:1]
    return synced, names, after, grads, rank0_only


def _gpt_seeded(seed):
    from minifsdp.models import build_model

    return build_model("gpt-tiny", seed=seed)


def test_sync_module_states_and_summon_full_params():
    outs = launch(_sync_and_summon, 2, timeout=60)
    rank0_init = _gpt_seeded(0).state_dict()
    from minifsdp.models import lm_loss
    ref = _gpt_seeded(0)
    ref.blocks[0].ln_1.weight.data.fill_(7.0)
    lm_loss(ref(_data(0)[0]), _data(0)[1]).backward()
    for r, (synced, names, after, grads, rank0_only) in enumerate(outs):
        for name, p in ref.named_parameters():  # with_grads: the full, averaged gradients
            torch.testing.assert_close(grads[name], p.grad, atol=ATOL, rtol=RTOL, msg=name)
        assert rank0_only == (["blocks.0.attn.c_attn.bias"] if r == 0 else ["_flat_param"])
        for k, v in rank0_init.items():
            assert torch.equal(synced[k], v), k   # rank 1 started from seed 1, now holds rank 0's weights
        assert "blocks.0.ln_1.weight" in {n.replace("_fsdp_wrapped_module.", "") for n in names}
        assert torch.equal(after["blocks.0.ln_1.weight"], torch.full((32,), 7.0))
        assert torch.equal(after["blocks.1.ln_1.weight"], rank0_init["blocks.1.ln_1.weight"])


# --------------------------------------------------------------------------
# Code written for torch's FSDP / FairScale: only the import changes
# --------------------------------------------------------------------------
def _as_a_torch_user_writes_it(impl):
    if impl == "torch":
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP, MixedPrecision
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
    else:
        from minifsdp.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP, MixedPrecision
        from minifsdp.fsdp.wrap import size_based_auto_wrap_policy
    model = FSDP(_gpt(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=10_000),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                buffer_dtype=torch.bfloat16),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True, limit_all_gathers=True,
                 device_id=torch.device("cpu"))
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDP))
    return _train(model, 3), units


def test_torch_fsdp_user_code_runs_unchanged(fp32_losses):
    ours, our_units = launch(_as_a_torch_user_writes_it, 2, "minifsdp", timeout=120)[0]
    theirs, their_units = launch(_as_a_torch_user_writes_it, 2, "torch", timeout=120)[0]
    assert our_units == their_units  # same policy, same units (each Block: 12,704 params)
    print(f"bf16 losses: minifsdp {ours}, torch FSDP {theirs}, fp32 {fp32_losses}")
    torch.testing.assert_close(ours, theirs, atol=0, rtol=BF16_RTOL)
    torch.testing.assert_close(ours, fp32_losses, atol=0, rtol=BF16_RTOL)


def _hybrid_groups_from_meshes():
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp.fsdp import ShardingStrategy, init_hybrid_groups
    from minifsdp.mesh import DeviceMesh
    from minifsdp.models import Block

    pair = init_hybrid_groups(2)
    out = {"ranks": [tdist.get_process_group_ranks(g) for g in pair], "cached": init_hybrid_groups(2) == pair}
    meshes = {"pair": dict(process_group=pair), "minifsdp mesh": dict(device_mesh=DeviceMesh(dp=4, dp_shard=2)),
              "torch mesh": dict(device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))}
    for name, kw in meshes.items():
        model = FSDP(_gpt(), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
        with trace.Tracer() as tracer:
            losses = _train(model, 2)
        groups = {tuple(tdist.get_process_group_ranks(g)) for m in model.modules() if isinstance(m, FSDP)
                  for g in (m._shard_group, m._replicate_group)}
        out[name] = (losses, tracer.trace.bytes_by_op(), groups)
    return out


def test_hybrid_shard_groups_come_from_a_device_mesh():
    outs = launch(_hybrid_groups_from_meshes, 4, timeout=180)
    # init_hybrid_groups(2) = DeviceMesh(dp=4, dp_shard=2)'s groups: the same rank lists as ever
    assert [o["ranks"] for o in outs] == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]
    assert all(o["cached"] for o in outs)
    for r, o in enumerate(outs):
        pair_losses, pair_bytes, pair_groups = o["pair"]
        assert pair_groups == {tuple(g) for g in o["ranks"]}
        for name in ("minifsdp mesh", "torch mesh"):  # device_mesh= gives every unit the same two groups
            losses, nbytes, groups = o[name]
            assert groups == pair_groups and nbytes == pair_bytes, (name, r, nbytes, pair_bytes)
            assert losses == pair_losses, name
    from minifsdp.mesh import DeviceMesh

    with pytest.raises(ValueError, match=r"does not split dp.*dp_shard=<ranks per node>"):
        DeviceMesh(dp=4, build_groups=False).groups("dp_shard")


def _fairscale_style():
    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FSDP, reshard_after_forward=True):
        model = wrap(nn.Sequential(wrap(nn.Linear(8, 16)), nn.ReLU(), auto_wrap(nn.Sequential(nn.Linear(16, 16))),
                                   nn.Linear(16, 4)))
    r = tdist.get_rank()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))[r * 4:(r + 1) * 4]
    model(x).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return sorted(n for n, m in model.named_modules() if isinstance(m, FSDP)), model.state_dict()


def test_fairscale_enable_wrap_and_auto_wrap():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16)), nn.Linear(16, 4))
    ref(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    units, sd = launch(_fairscale_style, 2, timeout=60)[0]
    assert units == ["", "_fsdp_wrapped_module.0"]  # auto_wrap's default policy (1e8 params) wraps nothing here
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=ATOL, rtol=RTOL, msg=k)


TORCHRUN_SCRIPT = """
import json, torch, torch.distributed as dist, torch.nn as nn
from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ModuleWrapPolicy
dist.init_process_group("gloo")                     # the user's own group, torchrun's env://
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
r, n = dist.get_rank(), dist.get_world_size()
losses = []
for step in range(3):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))[r * 8 // n:(r + 1) * 8 // n]
    loss = model(x).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
    loss = loss.detach(); dist.all_reduce(loss); losses.append(loss.item() / n)
if r == 0:
    print("LOSSES", json.dumps(losses))
dist.destroy_process_group()
"""


def test_works_in_a_torchrun_process_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = json.loads(out.stdout.split("LOSSES", 1)[1].strip().splitlines()[0])
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    expected = []
    for step in range(3):
        loss = ref(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close(losses, expected, atol=ATOL, rtol=RTOL)
