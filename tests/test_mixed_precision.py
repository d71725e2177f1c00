"""FSDP honours MixedPrecision; FairScale's precision flags work with FairScale's meaning.

gpt-tiny, a unit per Block, global batch of 8 x 16 tokens of text, AdamW, 2 ranks.
Tolerances against the fp32 run (same seed and data), relative on each loss
(computed in fp32 from 16-bit logits, as autocast would), over 5 steps:
* bf16 (8 significant bits): 2**-8 = 3.9e-3, one bf16 ulp: the loss may move by
  less than one step of bf16's grid. Measured: 1.9e-4.
* fp16 (11 significant bits, loss scaled by ShardedGradScaler): 2**-11 = 4.9e-4,
  one fp16 ulp. Measured: 1.0e-5.
* against torch FSDP1 with the same bf16 policy (CPU, device_id=cpu): one bf16
  ulp too (both round the same products to bf16; sums may be ordered differently).
* DDP and ZeRO-2 with bf16 autocast compute and reduce_dtype=bf16: one bf16 ulp.
  Measured: 1.1e-4. Their bytes halve exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

from minifsdp import data, launch, trace
from minifsdp.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ModuleWrapPolicy
from minifsdp.models import Block, build_model, lm_loss

STEPS = 5
BF16_RTOL, FP16_RTOL = 2.0**-8, 2.0**-11
BF16 = MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
FP16 = MixedPrecision(torch.float16, torch.float16, torch.float16)


def _train(model, steps=STEPS, scaler=None, optim=torch.optim.AdamW, autocast=False):
    """(global mean losses, dtypes of the gradients the optimizer saw, dtypes of the parameters it stepped).

    ``autocast``: forward and loss in a bf16 autocast region, one region per step (autocast caches
    the 16-bit copies of the weights until its region ends: one region around several steps would
    compute every forward with the first step's weights)."""
    n, r = tdist.get_world_size(), tdist.get_rank()
    opt = optim(model.parameters(), lr=0.5 if optim is torch.optim.SGD else 3e-3)
    seen = set()
    opt.register_step_pre_hook(lambda o, *_: seen.update(
        (str(p.dtype), str(p.grad.dtype)) for g in o.param_groups for p in g["params"] if p.grad is not None))
    losses = []
    for step in range(steps):
        x, y = data.get_batch(step, 8, 16, rank=r, world_size=n)   # Shakespeare: a loss that can fall
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        loss = loss.detach()
        tdist.all_reduce(loss)
        losses.append(loss.item() / n)
    return losses, sorted(seen)


def _policy_run(mp, use_scaler=False, keep_low=False, impl="minifsdp"):
    from minifsdp.mixed_precision import ShardedGradScaler

    if impl == "torch":  # FSDP1 with torch's own MixedPrecision holding the same dtypes
        from torch.distributed import fsdp as tfsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
        model = tfsdp.FullyShardedDataParallel(
            build_model("gpt-tiny", seed=0), auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"),
            mixed_precision=tfsdp.MixedPrecision(mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype))
    else:
        model = FSDP(build_model("gpt-tiny", seed=0), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    with trace.Tracer() as tracer:
        losses, grads = _train(model, scaler=ShardedGradScaler() if use_scaler else None,
                               optim=torch.optim.SGD if keep_low else torch.optim.AdamW)
    nbytes = tracer.trace.bytes_by_op()
    dtypes = sorted({(s.name, s.args["dtype"]) for s in tracer.trace.comm_spans()})
    return losses, grads, nbytes, dtypes


@pytest.fixture(scope="module")
def fp32_run():
    return launch(_policy_run, 2, None, timeout=180)[0]


def test_bf16_and_fp16_track_fp32_with_fp32_grads_on_the_master_shard(fp32_run):
    fp32_losses, fp32_grads, fp32_bytes, _ = fp32_run
    bf16_losses, bf16_grads, bf16_bytes, bf16_dtypes = launch(_policy_run, 2, BF16, timeout=180)[0]
    fp16_losses, fp16_grads, _, fp16_dtypes = launch(_policy_run, 2, FP16, True, timeout=180)[0]
    torch.testing.assert_close(bf16_losses, fp32_losses, atol=0, rtol=BF16_RTOL)
    torch_losses = launch(_policy_run, 2, BF16, False, False, "torch", timeout=180)[0][0]
    torch.testing.assert_close(bf16_losses, torch_losses, atol=0, rtol=BF16_RTOL)
    torch.testing.assert_close(fp16_losses, fp32_losses, atol=0, rtol=FP16_RTOL)
    assert bf16_losses != fp32_losses and fp16_losses != fp32_losses, "it did not compute in low precision"
    # the optimizer steps fp32 master shards with fp32 gradients
    assert fp32_grads == bf16_grads == fp16_grads == [("torch.float32", "torch.float32")]
    assert bf16_dtypes == [("all_gather", "bfloat16"), ("reduce_scatter", "bfloat16")]
    assert fp16_dtypes == [("all_gather", "float16"), ("all_reduce", "float32"), ("reduce_scatter", "float16")]
    # half the bytes, exactly (same padded flat parameters, 2 bytes per element instead of 4)
    assert bf16_bytes["all_gather"] * 2 == fp32_bytes["all_gather"]
    assert bf16_bytes["reduce_scatter"] * 2 == fp32_bytes["reduce_scatter"]


def test_reduce_dtype_sets_reduce_scatter_bytes_and_keep_low_precision_grads(fp32_run):
    _, _, fp32_bytes, _ = fp32_run
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, grads, nbytes, dtypes = launch(_policy_run, 2, mp, timeout=180)[0]
    assert dtypes == [("all_gather", "bfloat16"), ("reduce_scatter", "float32")]
    assert nbytes["all_gather"] * 2 == fp32_bytes["all_gather"]
    assert nbytes["reduce_scatter"] == fp32_bytes["reduce_scatter"]
    keep = MixedPrecision(torch.bfloat16, torch.bfloat16, keep_low_precision_grads=True)
    losses, grads, _, _ = launch(_policy_run, 2, keep, False, True, timeout=180)[0]
    assert grads == [("torch.float32", "torch.bfloat16")], "keep_low_precision_grads hands bf16 grads to the optimizer"
    assert losses[-1] < losses[0]


def _keep_low_with_adamw():
    model = FSDP(build_model("gpt-tiny", seed=0), mixed_precision=MixedPrecision(
        torch.bfloat16, torch.bfloat16, keep_low_precision_grads=True))
    _train(model, steps=1)


def test_keep_low_precision_grads_with_adamw_names_the_fix():
    with pytest.raises(Exception, match="AdamW cannot step torch.float32 parameters with torch.bfloat16 gradients"):
        launch(_keep_low_with_adamw, 1, timeout=60)


class _NormNet(nn.Module):
    """Linear -> BatchNorm -> Linear, plus a float buffer outside the BatchNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return self.out(self.norm(self.inp(x))) + self.offset


def _buffers_and_batchnorm(impl):
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as Wrapper, MixedPrecision as MP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as Policy
        extra = {"device_id": torch.device("cpu")}
    else:
        Wrapper, MP, Policy, extra = FSDP, MixedPrecision, ModuleWrapPolicy, {}
    model = Wrapper(_NormNet(), auto_wrap_policy=Policy({nn.Linear}),
                    mixed_precision=MP(torch.bfloat16, torch.bfloat16, torch.bfloat16), **extra)
    seen = {}
    for name, cls in (("inp", nn.Linear), ("norm", nn.BatchNorm1d)):
        mod = next(m for m in model.modules() if type(m) is cls)
        mod.register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, (str(a[0].dtype), str(o.dtype))))
    out = model(torch.randn(6, 8))
    out.float().sum().backward()
    units = sorted(n for n, m in model.named_modules() if isinstance(m, Wrapper))
    buffers = {n.split(".")[-1]: str(b.dtype) for n, b in model.named_buffers() if b.is_floating_point()}
    return units, buffers, seen, str(out.dtype)


def test_batchnorm_kept_fp32_and_buffers_in_buffer_dtype_as_torch():
    ours = launch(_buffers_and_batchnorm, 2, "minifsdp", timeout=120)[0]
    theirs = launch(_buffers_and_batchnorm, 2, "torch", timeout=120)[0]
    units, buffers, seen, out = ours
    assert buffers == {"offset": "torch.bfloat16", "running_mean": "torch.float32", "running_var": "torch.float32"}
    assert seen["inp"][0] == "torch.bfloat16" and seen["norm"][0] == "torch.float32", \
        "BatchNorm runs in fp32 inside a bf16 model (its output is cast back for the next bf16 unit)"
    assert "_fsdp_wrapped_module.norm" in units, "BatchNorm gets a unit of its own (without mixed precision)"
    assert ours == theirs, f"minifsdp {ours} != torch FSDP1 {theirs}"


class _UpcastNet(nn.Module):
    """Two Linear units; the root holds a parameter (so it is a unit with a flat parameter of its own, as in
    torch FSDP1 a root without one casts nothing) and a float buffer; with ``upcast`` it computes in fp32
    between the two units."""

    def __init__(self, upcast):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out, self.upcast = nn.Linear(8, 8), nn.Linear(8, 4), upcast
        self.gain = nn.Parameter(torch.ones(8))
        self.register_buffer("offset", torch.zeros(8))

    def forward(self, x):
        h = self.inp(x * self.gain)
        h = h.float() if self.upcast else h
        return self.out(h + self.offset.to(h.dtype))


# policy -> what it exercises: buffer_dtype apart from param_dtype; buffer_dtype None (buffers keep fp32);
# cast_forward_inputs: every unit casts its inputs (the root's fp32 activation too, at the next unit)
POLICY_VARIANTS = {"buffer fp16": dict(param_dtype=torch.bfloat16, buffer_dtype=torch.float16),
                   "buffer None": dict(param_dtype=torch.bfloat16),
                   "cast every unit": dict(param_dtype=torch.bfloat16, cast_forward_inputs=True,
                                           cast_root_forward_inputs=False)}


def _policy_variants(impl):
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as Wrapper, MixedPrecision as MP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as Policy
        extra = {"device_id": torch.device("cpu")}
    else:
        Wrapper, MP, Policy, extra = FSDP, MixedPrecision, ModuleWrapPolicy, {}
    out = {}
    for name, kw in POLICY_VARIANTS.items():
        model = Wrapper(_UpcastNet(kw.get("cast_forward_inputs", False)), auto_wrap_policy=Policy({nn.Linear}), mixed_precision=MP(**kw), **extra)
        seen = {}
        for mod_name in ("root", "inp", "out"):
            mod = next(m for n, m in model.named_modules() if type(m) is (_UpcastNet if mod_name == "root" else
                                                                            nn.Linear) and mod_name in n.split(".") + ["root"])
            mod.register_forward_pre_hook(lambda m, a, mod_name=mod_name: seen.__setitem__(mod_name, str(a[0].dtype)))
        y = model(torch.randn(6, 8))
        y.float().sum().backward()
        buffers = {n.split(".")[-1]: str(b.dtype) for n, b in model.named_buffers()}
        out[name] = (buffers, seen, str(y.dtype))
    return out


def test_buffer_dtype_and_forward_input_casts_as_torch():
    """buffer_dtype apart from param_dtype, buffer_dtype None, cast_forward_inputs / cast_root_forward_inputs."""
    ours = launch(_policy_variants, 2, "minifsdp", timeout=120)[0]
    theirs = launch(_policy_variants, 2, "torch", timeout=120)[0]
    assert ours["buffer fp16"][0] == {"offset": "torch.float16"}, "buffers follow buffer_dtype, not param_dtype"
    assert ours["buffer None"][0] == {"offset": "torch.float32"}, "buffer_dtype=None leaves buffers as they are"
    assert ours["buffer None"][1]["root"] == "torch.bfloat16", "cast_root_forward_inputs (default): the root casts"
    assert ours["cast every unit"][1] == {"root": "torch.bfloat16", "inp": "torch.bfloat16",
                                          "out": "torch.bfloat16"}, \
        "cast_forward_inputs: every unit (the root too, as torch) casts its inputs, also the root's fp32 activation"
    assert ours == theirs, f"minifsdp {ours} != torch FSDP1 {theirs}"


def _paramless_root_cast(impl):
    """A root that owns no parameter (every Linear is its own unit), cast_forward_inputs only: the dtype the
    root's module sees."""
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as Wrapper, MixedPrecision as MP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as Policy
        extra = {"device_id": torch.device("cpu")}
    else:
        Wrapper, MP, Policy, extra = FSDP, MixedPrecision, ModuleWrapPolicy, {}
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    seen = []
    net.register_forward_pre_hook(lambda m, a: seen.append(str(a[0].dtype)))
    model = Wrapper(net, auto_wrap_policy=Policy({nn.Linear}), **extra,
                    mixed_precision=MP(param_dtype=torch.bfloat16, cast_forward_inputs=True,
                                       cast_root_forward_inputs=False))
    model(torch.randn(4, 8)).float().sum().backward()
    return seen


def test_cast_forward_inputs_skips_a_root_without_parameters_as_torch():
    """torch's FSDP1 casts with cast_forward_inputs only in units that own parameters."""
    ours = launch(_paramless_root_cast, 2, "minifsdp", timeout=120)[0]
    theirs = launch(_paramless_root_cast, 2, "torch", timeout=120)[0]
    assert ours == theirs == ["torch.float32"], f"minifsdp {ours}, torch FSDP1 {theirs}"


def _fairscale_style(kind):
    from minifsdp.fsdp.wrap import enable_wrap, wrap

    n, r = tdist.get_world_size(), tdist.get_rank()
    if kind == "flags":
        model = FSDP(build_model("gpt-tiny", seed=0), mixed_precision=True, flatten_parameters=True,
                     cpu_offload=True, reshard_after_forward=True)
    elif kind == "fp32_reduce_scatter":
        model = FSDP(build_model("gpt-tiny", seed=0), mixed_precision=True, fp32_reduce_scatter=True,
                     compute_dtype=torch.bfloat16, move_grads_to_cpu=False)
    else:  # enable_wrap passes FairScale's keywords to every unit
        gpt = build_model("gpt-tiny", seed=0)
        with enable_wrap(wrapper_cls=FSDP, mixed_precision=True, flatten_parameters=True, cpu_offload=True):
            for i, block in enumerate(gpt.blocks):
                gpt.blocks[i] = wrap(block)
            model = wrap(gpt)
    with trace.Tracer() as tracer:
        losses, grads = _train(model)
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    return (losses, grads, sorted({(s.name, s.args["dtype"]) for s in tracer.trace.comm_spans()}),
            len(units), sorted({str(h.flat_param.device) for u in units for h in u._handles}))


@pytest.mark.parametrize("kind", ["flags", "fp32_reduce_scatter", "enable_wrap"])
def test_fairscale_style_construction_trains(kind, fp32_run):
    losses, grads, dtypes, n_units, devices = launch(_fairscale_style, 2, kind, timeout=180)[0]
    assert grads == [("torch.float32", "torch.float32")]
    assert losses[-1] < losses[0] - 0.05, f"did not train: {losses}"
    if kind == "fp32_reduce_scatter":  # compute_dtype=bf16: no scaler needed
        assert dtypes == [("all_gather", "bfloat16"), ("reduce_scatter", "float32")]
        torch.testing.assert_close(losses, fp32_run[0], atol=0, rtol=BF16_RTOL)
    else:  # FairScale's mixed_precision=True: fp16 compute and fp16 reduction, the master on the CPU
        assert dtypes == [("all_gather", "float16"), ("reduce_scatter", "float16")]
        assert devices == ["cpu"]
        torch.testing.assert_close(losses, fp32_run[0], atol=0, rtol=FP16_RTOL)
    assert n_units == (3 if kind == "enable_wrap" else 1)


def _fp16_where_the_device_cannot_compute_it():
    from minifsdp.mixed_precision import policy
    policy._can_compute = lambda dtype, device_type: False   # a device without fp16 arithmetic
    try:
        FSDP(build_model("gpt-tiny", seed=0), mixed_precision=FP16)
    except ValueError as err:
        return str(err)
    return "FSDP accepted fp16 on a device that cannot compute it"


def test_fsdp_fp16_where_the_device_cannot_compute_it_names_the_fix():
    message = launch(_fp16_where_the_device_cannot_compute_it, 1, timeout=60)[0]
    assert "cpu cannot compute in torch.float16" in message and "use precision fp32 or bf16" in message, message
    assert "\n" not in message


def test_bad_precision_flags_name_the_fix():
    from minifsdp.fsdp.strategy import resolve_mixed_precision, resolve_offload

    with pytest.raises(ValueError, match="fp32_reduce_scatter=True requires mixed_precision=True"):
        resolve_mixed_precision(None, fp32_reduce_scatter=True)
    with pytest.raises(ValueError, match="either mixed_precision=MixedPrecision"):
        resolve_mixed_precision(BF16, compute_dtype=torch.float16)
    with pytest.raises(TypeError, match="mixed_precision must be a MixedPrecision, True or None"):
        resolve_mixed_precision("bf16")
    with pytest.raises(ValueError, match="move_grads_to_cpu=True with parameters not offloaded"):
        resolve_offload(None, move_grads_to_cpu=True)
    assert resolve_offload(True) == CPUOffload(offload_params=True)
    assert resolve_mixed_precision(False) is None


# --------------------------------------------------------------------------
# DDP and ZeRO: the policy's reduce_dtype is the dtype gradients travel in
# --------------------------------------------------------------------------
def _dp_run(kind, reduce_dtype):
    from minifsdp.ddp import DistributedDataParallel
    from minifsdp.zero import OSS, ShardedDataParallel

    mp = MixedPrecision(reduce_dtype=reduce_dtype) if reduce_dtype is not None else None
    model = build_model("gpt-tiny", seed=0)
    if kind == "ddp":
        model = DistributedDataParallel(model, mixed_precision=mp)
        optim = torch.optim.AdamW
    else:  # ZeRO-2: gradients reduced to their owner
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-3)
        model = ShardedDataParallel(model, opt, reduce_buffer_size=0, mixed_precision=mp)
        optim = lambda params, lr: opt  # noqa: E731 - the OSS built above
    with trace.Tracer() as tracer:
        losses, grads = _train(model, optim=optim, autocast=reduce_dtype is not None)
    return losses, grads, {k: v for k, v in tracer.trace.bytes_by_op().items() if k != "broadcast"}


@pytest.mark.parametrize("kind", ["ddp", "zero2"])
def test_ddp_and_zero_reduce_in_reduce_dtype_with_autocast_compute(kind):
    fp32_losses, fp32_grads, fp32_bytes = launch(_dp_run, 2, kind, None, timeout=180)[0]
    losses, grads, nbytes = launch(_dp_run, 2, kind, torch.bfloat16, timeout=180)[0]
    assert {k: 2 * v for k, v in nbytes.items()} == fp32_bytes, "bf16 gradients must move half the bytes"
    assert grads == fp32_grads == [("torch.float32", "torch.float32")], "the optimizer gets fp32 gradients"
    torch.testing.assert_close(losses, fp32_losses, atol=0, rtol=BF16_RTOL)
    assert losses != fp32_losses


def test_ddp_policy_errors_name_the_fix():
    from minifsdp.ddp import _reduce_dtype_of
    with pytest.raises(NotImplementedError, match="compute in 16 bits with torch.autocast"):
        _reduce_dtype_of(BF16, False)
    with pytest.raises(ValueError, match="gradient_as_bucket_view=True"):
        _reduce_dtype_of(MixedPrecision(reduce_dtype=torch.bfloat16), True)
