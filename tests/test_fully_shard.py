"""fully_shard (FSDP2, per-parameter sharding) against one process, torch's and minifsdp's alike.

Every check runs under ``torch.distributed.fsdp`` and under ``minifsdp.fsdp`` (the ``impl``
parameter; the worker imports one or the other, nothing else differs). One launch per world size
and implementation runs every configuration; a configuration that raises is reported as its own
failure without stopping the others.

The reference is one process training the unwrapped gpt-tiny on the whole global batch (rank r of n
takes rows [r*B/n, (r+1)*B/n)): losses, full gradients (``p.grad.full_tensor()``) and full
parameters after 3 AdamW steps agree within fp32 relative 1e-5 at 1, 2, 3 (dim 0 uneven: padding)
and 4 ranks, with reshard_after_forward None, True, False and 2 (at 4 ranks); with
MixedPrecisionPolicy(bf16, fp32) (fsdp2_recipes.BF16_TOL says which tolerance and why; at 1 rank bit
for bit); on a 2x2 HSDP mesh; with gradient accumulation synchronised on every micro-batch or only
on the last. The bytes each rank moves per step equal the per-parameter formula
(fsdp2_recipes.expected_bytes), computed here from the parameter shapes.
"""
from __future__ import annotations

import contextlib
import math
import re
import traceback

import pytest
import torch
import torch.distributed as tdist

from fsdp2_recipes import (BF16_TOL, FP32_TOL, LR, MICRO, RTOL, assert_close, assert_equal, assert_parity,
                           counted, expected_bytes, gpt_groups, mesh_1d, namespace, padded_shard_numel, plain_run,
                           tiny_gpt, train)
from minifsdp import launch

IMPLS = ["torch", "minifsdp"]
WORLDS = [1, 2, 3, 4]
STEPS = 3
ODD = (5, 3)   # an extra Linear(3, 5): weight [5, 3] and bias [5] split unevenly over 2, 3 and 4 ranks


# ----------------------------------------------------------------------------- the workers
def _sharded_run(fs, mesh, memory=False, micro=1, no_sync=False, keep_unsharded=False, **kw):
    """gpt-tiny, fully_shard(each block, **kw) then fully_shard(root, **kw), 3 AdamW steps; the
    results (fsdp2_recipes.train), the bytes per step per collective, the (op, group size) pairs seen,
    and with ``memory`` the peak bytes minifsdp.memory's tracker saw during training."""
    from minifsdp.memory import MemoryTracker

    model = tiny_gpt()
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh, **kw)
    fs.fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tracker = MemoryTracker() if memory else None
    if tracker is not None:
        tracker.track_model(model)
    with counted(fs) as tracer, tracker if tracker is not None else contextlib.nullcontext():
        out = train(model, opt, STEPS, micro=micro, no_sync=no_sync, keep_unsharded=keep_unsharded)
    steps = tracer.trace.bytes_by_op(within="step")
    out["bytes_per_step"] = {op: b / STEPS for op, b in steps.items()}
    windows = [(s.start, s.end) for s in tracer.trace.compute_spans() if s.name == "step"]
    out["groups"] = sorted({(s.name, s.args.get("group_size")) for s in tracer.trace.comm_spans()
                            if any(a <= s.start <= b for a, b in windows)})
    out["dtypes"] = (sorted({str(p.dtype) for p in model.parameters()}),
                     sorted({str(g.dtype) for g in out["grads"].values()}))
    if tracker is not None:
        out["peak"] = tracker.peak_total
        tracker.close()
    return out


def _layout(fs, mesh):
    """What sharding leaves on this rank: parameter types, placements, local shapes, full values."""
    from torch.distributed.tensor import DTensor

    from minifsdp.models import Block, GPT

    reference = dict(tiny_gpt().named_parameters())
    model = tiny_gpt()
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    torch.manual_seed(0)
    odd = torch.nn.Linear(ODD[1], ODD[0])
    odd_reference = {n: p.detach().clone() for n, p in odd.named_parameters()}
    fs.fully_shard(odd, mesh=mesh)
    params = {}
    for prefix, module, ref in (("", model, reference), ("odd.", odd, odd_reference)):
        for n, p in module.named_parameters():
            params[prefix + n] = {
                "dtensor": isinstance(p, DTensor), "parameter": isinstance(p, torch.nn.Parameter),
                "placements": [(type(pl).__name__, getattr(pl, "dim", None)) for pl in getattr(p, "placements", ())],
                "shape": tuple(p.shape), "local": tuple(p.to_local().shape) if isinstance(p, DTensor) else None,
                "full_equal": isinstance(p, DTensor) and torch.equal(p.full_tensor().cpu(), ref[n].cpu())}
    return {"params": params,
            "classes": {"root": type(model).__name__, "block": type(model.blocks[0]).__name__,
                        "blocks": type(model.blocks).__name__, "head": type(model.head).__name__,
                        "odd": type(odd).__name__},
            "isinstance": {"root_fsdp": isinstance(model, fs.FSDPModule), "block_fsdp": isinstance(model.blocks[0],
                           fs.FSDPModule), "root_gpt": isinstance(model, GPT), "block_block":
                           isinstance(model.blocks[0], Block), "head_fsdp": isinstance(model.head, fs.FSDPModule)}}


def _methods(fs, mesh, divide_factor=None):
    """FSDPModule's methods on one model: unshard (async: an UnshardHandle) and reshard of the root's
    group, then one step after set_reshard_after_forward(False) (and, given ``divide_factor``,
    set_gradient_divide_factor on every FSDP module)."""
    from torch.distributed.tensor import DTensor

    model = tiny_gpt()
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)

    def registered():   # what the modules hold now: (a DTensor?, shape) of a root and a block parameter
        return [(isinstance(p, DTensor), tuple(p.shape))
                for p in (model.tok_emb.weight, model.blocks[0].mlp.c_fc.weight)]

    out = {"sharded": registered()}
    handle = model.unshard(async_op=True)
    out["handle"] = isinstance(handle, fs.UnshardHandle)
    handle.wait()
    out["unsharded"] = registered()
    model.reshard()
    out["resharded"] = registered()
    model.set_reshard_after_forward(False)
    if divide_factor is not None:
        for module in model.modules():
            if isinstance(module, fs.FSDPModule):
                module.set_gradient_divide_factor(divide_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with counted(fs) as tracer:
        out.update(train(model, opt, 1))
    out["bytes_per_step"] = tracer.trace.bytes_by_op(within="step")
    return out


def _errors(fs, mesh):
    """What each misuse raises: (exception class names, message), or None if nothing was raised."""
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import dist

    def outcome(f):
        try:
            f()
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            return [c.__name__ for c in type(e).__mro__], str(e)
        return None

    twice = torch.nn.Linear(4, 4)
    fs.fully_shard(twice, mesh=mesh)
    mesh_3d = init_device_mesh(dist.device().type, (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    model = tiny_gpt()
    fs.fully_shard(model, mesh=mesh)
    return {
        "twice": outcome(lambda: fs.fully_shard(twice, mesh=mesh)),
        "mesh_3d": outcome(lambda: fs.fully_shard(torch.nn.Linear(4, 4), mesh=mesh_3d)),
        "reshard_int_3_of_4": outcome(lambda: fs.fully_shard(torch.nn.Linear(4, 4), mesh=mesh,
                                                              reshard_after_forward=3)),
        # head sits in the root's group but fully_shard was never called on it: not an FSDPModule
        "sync_on_head": outcome(lambda: model.head.set_requires_gradient_sync(False)),
        "sync_on_plain": outcome(lambda: torch.nn.Linear(4, 4).set_requires_gradient_sync(False)),
    }


def _guarded(f, *args, **kwargs):
    try:
        return f(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a failing configuration is reported by its own test
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _world_suite(impl):
    """Every configuration at this world size, under one implementation."""
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import dist

    fs = namespace(impl)
    n = tdist.get_world_size()
    mesh = mesh_1d()
    out = {("reshard", r): _guarded(_sharded_run, fs, mesh, reshard_after_forward=r)
           for r in [None, True, False] + ([2] if n == 4 else [])}
    out["bf16"] = _guarded(_sharded_run, fs, mesh, mp_policy=fs.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    out["accumulate_sync"] = _guarded(_sharded_run, fs, mesh, memory=True, micro=MICRO)
    out["accumulate_no_sync"] = _guarded(_sharded_run, fs, mesh, memory=True, micro=MICRO, no_sync=True)
    out["accumulate_keep_unsharded"] = _guarded(_sharded_run, fs, mesh, micro=MICRO, no_sync=True,
                                                keep_unsharded=True)
    out["layout"] = _guarded(_layout, fs, mesh)
    if n > 1:
        out["methods"] = _guarded(_methods, fs, mesh)
        out["divide_factor"] = _guarded(_methods, fs, mesh, divide_factor=1.0)
    if n == 4:
        hsdp = init_device_mesh(dist.device().type, (2, 2), mesh_dim_names=("replicate", "shard"))
        out["hsdp"] = _guarded(_sharded_run, fs, hsdp)
        out["hsdp_layout"] = _guarded(_layout, fs, hsdp)
        out["errors"] = _guarded(_errors, fs, mesh)
    return out


# ----------------------------------------------------------------------------- the runs, once each
_RUNS: dict[tuple[str, int], list] = {}


def _suite(impl: str, n: int) -> list[dict]:
    if (impl, n) not in _RUNS:
        _RUNS[impl, n] = launch(_world_suite, n, impl, timeout=150, threads_per_rank=1)
    return _RUNS[impl, n]


def _result(impl, n, key):
    """Rank 0's result of one configuration, after checking that every rank saw the same numbers."""
    outs = [rank_out[key] for rank_out in _suite(impl, n)]
    for r, out in enumerate(outs):
        assert "error" not in out, f"{impl} at {n} ranks, {key}: rank {r} raised {out['error']}\n{out['traceback']}"
    for r, out in enumerate(outs[1:], 1):
        for field in ("losses", "grads", "params", "bytes_per_step"):
            if field in out:
                assert_equal(out[field], outs[0][field], f"{impl} {key}: rank {r}'s {field} vs rank 0's")
    return outs[0]


@pytest.fixture(scope="module")
def reference():
    """One process on the whole batch: fp32, and bf16 as MixedPrecisionPolicy does it (plain_run)."""
    return {"fp32": plain_run(STEPS), "bf16": plain_run(STEPS, bf16=True)}


def _parity(got, ref, what, tol=FP32_TOL):
    assert_parity(got, ref, tol, what)


def _resharded(option):
    """Which groups reshard after forward (so all-gather again in backward): None = all but the root."""
    return {None: lambda g: g != "root", True: lambda g: True, False: lambda g: False,
            2: lambda g: True}[option]


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_with_one_process_every_reshard_after_forward(impl, n, reference):
    for option in [None, True, False] + ([2] if n == 4 else []):
        got = _result(impl, n, ("reshard", option))
        _parity(got, reference["fp32"], f"{impl} at {n} ranks, reshard_after_forward={option}")
        assert got["dtypes"] == (["torch.float32"], ["torch.float32"]), got["dtypes"]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_bytes_per_step_follow_the_per_parameter_formula(impl, n):
    """all-gather: W * sum(ceil(n0/W) * numel/n0) * elem per group, in forward and again in backward
    for a group resharded after forward; reduce-scatter: the same for the gradients, once per step."""
    groups = gpt_groups()
    padded = sum(padded_shard_numel(s, n) for shapes in groups.values() for s in shapes)
    assert n * padded >= sum(math.prod(s) for shapes in groups.values() for s in shapes)
    for option in [None, True, False] + ([2] if n == 4 else []):
        got = _result(impl, n, ("reshard", option))["bytes_per_step"]
        assert got == expected_bytes(n, _resharded(option)), f"{impl} at {n} ranks, reshard_after_forward={option}"
    got = _result(impl, n, "bf16")["bytes_per_step"]
    assert got == expected_bytes(n, _resharded(None), param_elem=2, grad_elem=4), "bf16: parameters gathered in bf16"


def test_bytes_formula_counts_padding():
    """The formula's padding, by hand: gpt-tiny's token embedding [256, 32] at 3 ranks gathers 3 * 86 rows."""
    assert padded_shard_numel((256, 32), 3) == 86 * 32
    assert padded_shard_numel((32,), 3) == 11
    assert expected_bytes(3, lambda g: False)["reduce_scatter"] == 3 * 4 * sum(
        math.ceil(s[0] / 3) * math.prod(s[1:]) for shapes in gpt_groups().values() for s in shapes)


@pytest.mark.parametrize("impl", IMPLS)
def test_reshard_after_forward_int_regathers_within_groups_of_that_size(impl):
    """reshard_after_forward=2 at 4 ranks: forward gathers over all 4, backward over 2 (the post-forward
    shard lives on a group of 2); an int not dividing 4 is refused (test_error_messages)."""
    got = _result(impl, 4, ("reshard", 2))
    assert ("all_gather", 2) in got["groups"] and ("all_gather", 4) in got["groups"], got["groups"]
    assert _result(impl, 4, ("reshard", True))["groups"] == [("all_gather", 4), ("reduce_scatter", 4)]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_policy(impl, n, reference):
    got = _result(impl, n, "bf16")
    what = f"{impl} bf16 at {n} ranks"
    if n == 1:   # nothing to reduce: exactly one process's bf16 forward/backward on an fp32 master
        for field in ("losses", "first_grads", "grads", "params"):
            assert_equal(got[field], reference["bf16"][field], f"{what}: {field}")
    _parity(got, reference["bf16"], what, BF16_TOL)
    # the sharded parameters and their gradients stay fp32 (the master copy), only the gathered ones are bf16
    assert got["dtypes"] == (["torch.float32"], ["torch.float32"]), got["dtypes"]


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_accumulation_both_ways(impl, n, reference):
    """Micro-batches (each loss / MICRO) synchronised every time, or with set_requires_gradient_sync(False)
    on all but the last: both equal one process on the whole batch. Without sync fewer reduce-scatter
    bytes (one per step instead of one per micro-batch), the same all-gathers, a higher peak (every
    unsharded gradient is kept until the last micro-batch)."""
    sync, no_sync = _result(impl, n, "accumulate_sync"), _result(impl, n, "accumulate_no_sync")
    _parity(sync, reference["fp32"], f"{impl} at {n} ranks, sync every micro-batch")
    _parity(no_sync, reference["fp32"], f"{impl} at {n} ranks, sync on the last micro-batch")
    assert sync["bytes_per_step"] == expected_bytes(n, _resharded(None), forwards=MICRO, syncs=MICRO)
    assert no_sync["bytes_per_step"] == expected_bytes(n, _resharded(None), forwards=MICRO, syncs=1)
    if n > 1:
        assert no_sync["bytes_per_step"]["reduce_scatter"] * MICRO == sync["bytes_per_step"]["reduce_scatter"]
        assert no_sync["peak"] > sync["peak"], (no_sync["peak"], sync["peak"])
    else:   # one rank: a shard is the whole parameter, an unsharded gradient costs nothing more
        assert no_sync["peak"] == sync["peak"], (no_sync["peak"], sync["peak"])
    # torch's recipe for less traffic: set_reshard_after_backward(False) too, until the last micro-batch:
    # the next forward finds every group unsharded (one forward all-gather per step, not per micro-batch)
    keep = _result(impl, n, "accumulate_keep_unsharded")
    _parity(keep, reference["fp32"], f"{impl} at {n} ranks, no sync and no reshard until the last")
    assert keep["bytes_per_step"] == expected_bytes(n, _resharded(None), forwards=1, backwards=MICRO, syncs=1)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("impl", IMPLS)
def test_unshard_reshard_and_set_reshard_after_forward(impl, n, reference):
    """unshard(async_op=True) returns an UnshardHandle and registers the root group's full parameters
    (plain tensors; the blocks' stay sharded: not recursive); reshard() puts the DTensors back;
    after set_reshard_after_forward(False) (recursive) backward gathers nothing."""
    got = _result(impl, n, "methods")
    sharded = [(True, (256, 32)), (True, (128, 32))]
    assert got["sharded"] == sharded and got["resharded"] == sharded, (got["sharded"], got["resharded"])
    assert got["handle"] is True
    assert got["unsharded"] == [(False, (256, 32)), (True, (128, 32))], got["unsharded"]
    assert_close(got["losses"], reference["fp32"]["losses"][:1], RTOL, f"{impl} at {n} ranks: loss")
    assert_close(got["grads"], reference["fp32"]["first_grads"], RTOL, f"{impl} at {n} ranks: gradients")
    assert got["bytes_per_step"] == expected_bytes(n, _resharded(False))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("impl", IMPLS)
def test_set_gradient_divide_factor(impl, n, reference):
    """set_gradient_divide_factor(1.0): gradients summed over the ranks, not averaged: n times the mean."""
    outs = [rank_out["divide_factor"] for rank_out in _suite(impl, n)]
    from minifsdp import dist
    if impl == "torch" and dist.default_backend() == "gloo" and "PREMUL_SUM" in outs[0].get("error", ""):
        pytest.skip("torch's set_gradient_divide_factor reduces with ReduceOp.PREMUL_SUM, which gloo lacks")
    got = _result(impl, n, "divide_factor")
    assert_close({k: v / n for k, v in got["grads"].items()}, reference["fp32"]["first_grads"], RTOL,
                 f"{impl} at {n} ranks: gradients / n")


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_sharded_layout(impl, n):
    """Each parameter a DTensor Parameter, Shard(0); this rank's local piece is torch.chunk(full, n)[rank]
    (empty past the last chunk); full_tensor() is the unsharded value bit for bit; the class is FSDP<Class>."""
    for r, rank_out in enumerate(_suite(impl, n)):
        layout = rank_out["layout"]
        assert "error" not in layout, f"{impl} at {n} ranks: {layout.get('error')}\n{layout.get('traceback')}"
        assert "odd.weight" in layout["params"] and "tok_emb.weight" in layout["params"]
        for name, p in layout["params"].items():
            what = f"{impl} at {n} ranks, rank {r}, {name}"
            assert p["dtensor"] and p["parameter"], f"{what}: not a DTensor nn.Parameter"
            assert p["placements"] == [("Shard", 0)], f"{what}: {p['placements']}"
            chunks = torch.empty(p["shape"]).chunk(n, dim=0)
            want = tuple(chunks[r].shape) if r < len(chunks) else (0, *p["shape"][1:])
            assert p["local"] == want, f"{what}: local shape {p['local']}, torch.chunk gives {want}"
            assert p["full_equal"], f"{what}: full_tensor() is not the unsharded parameter"
        assert layout["classes"] == {"root": "FSDPGPT", "block": "FSDPBlock", "blocks": "ModuleList",
                                     "head": "Linear", "odd": "FSDPLinear"}, layout["classes"]
        assert layout["isinstance"] == {"root_fsdp": True, "block_fsdp": True, "root_gpt": True,
                                        "block_block": True, "head_fsdp": False}, layout["isinstance"]
    if n == 4:   # the uneven case spelled out: 5 rows over 4 ranks are 2, 2, 1, 0
        assert [o["layout"]["params"]["odd.weight"]["local"] for o in _suite(impl, n)] == [(2, 3), (2, 3), (1, 3),
                                                                                            (0, 3)]


@pytest.mark.parametrize("impl", IMPLS)
def test_hsdp_2x2(impl, reference):
    """A (2, 2) mesh: replicate over dim 0, shard over dim 1. Same numbers as one process; parameters
    (Replicate(), Shard(0)); bytes: all-gather and reduce-scatter within a shard group of 2, then an
    all-reduce of each gradient shard across the replicas (2x its bytes, all-reduce's volume)."""
    got = _result(impl, 4, "hsdp")
    _parity(got, reference["fp32"], f"{impl} HSDP 2x2")
    shards = sum(padded_shard_numel(s, 2) for shapes in gpt_groups().values() for s in shapes) * 4
    assert got["bytes_per_step"] == {**expected_bytes(2, _resharded(None)), "all_reduce": 2 * shards}
    assert got["groups"] == [("all_gather", 2), ("all_reduce", 2), ("reduce_scatter", 2)], got["groups"]
    for r, rank_out in enumerate(_suite(impl, 4)):
        layout = rank_out["hsdp_layout"]
        assert "error" not in layout, f"{impl}: {layout.get('error')}\n{layout.get('traceback')}"
        for name, p in layout["params"].items():
            assert p["placements"] == [("Replicate", None), ("Shard", 0)], f"{impl} rank {r} {name}: {p['placements']}"
            chunks = torch.empty(p["shape"]).chunk(2, dim=0)
            want = tuple(chunks[r % 2].shape) if r % 2 < len(chunks) else (0, *p["shape"][1:])
            assert p["local"] == want and p["full_equal"], f"{impl} rank {r} {name}: {p['local']} vs {want}"


# what each misuse must raise (torch's type), and the words that name the fix
_MISUSES = {
    # torch's composable-API contract raises AssertionError; a ValueError (the caller's mistake) is as good
    "twice": (("AssertionError", "ValueError"), r"once|already"),
    "mesh_3d": (("ValueError",), r"1D or 2D|1-D or 2-D|2 dim|two dim|ndim"),
    "reshard_int_3_of_4": (("ValueError",), r"factor|divid|divisor"),
    "sync_on_head": (("AttributeError",), r"set_requires_gradient_sync"),
    "sync_on_plain": (("AttributeError",), r"set_requires_gradient_sync"),
}


@pytest.mark.parametrize("impl", IMPLS)
def test_error_messages(impl):
    """fully_shard twice on a module, a 3-D mesh, reshard_after_forward=3 at 4 ranks, and
    set_requires_gradient_sync on a module fully_shard was not called on. Each raises torch's
    exception type (or a subclass) with a message naming the fix; minifsdp's in one line."""
    errors = _result(impl, 4, "errors")
    for case, (kinds, fix) in _MISUSES.items():
        assert errors[case] is not None, f"{impl}: {case} raised nothing"
        mro, message = errors[case]
        assert set(kinds) & set(mro), f"{impl}: {case} raised {mro[0]}, expected one of {kinds}: {message}"
        assert re.search(fix, message), f"{impl}: {case}: {message!r} does not name the fix ({fix})"
        if impl == "minifsdp" and "AttributeError" not in kinds:
            assert "\n" not in message.strip(), f"{case}: not one line: {message!r}"
    assert "3" in errors["reshard_int_3_of_4"][1] and "4" in errors["reshard_int_3_of_4"][1]
