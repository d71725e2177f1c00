# Lab 05 - mixed precision. Source of solutions/05_mixed_precision.ipynb and
# labs/05_mixed_precision.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 05 - Mixed precision: 16-bit compute, 32-bit master weights, loss scaling
#
# Training in 16-bit numbers halves the bytes every parameter, gradient and
# all-gather costs, and on GPUs runs matrix multiplies several times faster. The price
# is range and precision: fp16 loses small gradients to **underflow**, bf16 keeps
# fewer digits. The recipe that makes it work (Micikevicius et al. 2018) keeps an
# **fp32 master copy** of the weights for the optimizer, computes forward and backward
# in 16 bits, and, for fp16, **scales the loss** so gradients stay inside fp16's range.
#
# **You will be able to**: say where fp16 and bf16 gradients underflow, measured on a
# real model; tell what `torch.autocast` runs in which dtype, op by op; write a
# gradient scaler's two rules (unscale and check, grow and back off) and rescue an fp16
# training run with them; predict the bytes an FSDP step moves under a precision policy
# and check it against the tracer.
#
# **Prerequisites**: lab 00 (collectives, `launch`, the tracer), lab 01 (memory by
# category), lab 04 (FSDP units, all-gather and reduce-scatter).
# **Time**: about 60 minutes of work; the cells compute for about a minute on a laptop
# (CPU, 2 `gloo` ranks), less on GPUs.
#
# **Exercises**: 1. what underflows · 2. the scaler's two rules (`unscale_`, the update) ·
# 3. a loss scaler and an fp16 training step with an fp32 master copy, 3b. every rank skips
# the same step (the sharded scaler's agreement) · 4. bytes per step by policy.
#
# **Symbols**: Ψ = the number of parameters; bytes are written 2Ψ (16-bit) and 4Ψ
# (fp32). S = the loss scale. N = the world size.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp import comm, data, dist, launch, memory, models, trace
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import MixedPrecision, ModuleWrapPolicy
from minifsdp.labcheck import lab05 as check
from minifsdp.mixed_precision import format_info, format_table

torch.set_num_threads(1)  # small models: one thread is as fast, and robust when processes share cores
notebook_start = time.perf_counter()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
N2 = dist.lab_world_size(2)

# %% [markdown]
# ## 1. Three number formats
#
# A floating-point number is sign × mantissa × 2^exponent. The exponent bits set the
# **range**, the mantissa bits the **precision** (eps = the gap between 1 and the next
# number). Below the smallest *normal* number come the *subnormals*, with ever fewer
# digits, down to the smallest subnormal; anything smaller rounds to **0**.

# %%
# NBVAL_CHECK_OUTPUT
print(format_table())

# %% [markdown]
# bf16 has fp32's 8 exponent bits (same range, ~3 decimal digits fewer); fp16 has 5
# (range 6e-8 to 65504, one more digit than bf16). Where do a real model's gradients
# fall? One backward of `gpt-tiny` in fp32 on a batch of text:

# %%
model = models.build_model("gpt-tiny", seed=0)
x, y = data.get_batch(0, 8, 32)
models.lm_loss(model(x), y).backward()
grads = torch.cat([p.grad.flatten() for p in model.parameters()])
SHRINK = 2.0**-16   # see the figure: moves gpt-tiny's gradients to where a large model's live

fig, ax = plt.subplots(figsize=(9, 3.6))
for i, dt in enumerate(DTYPES):
    f = format_info(dt)
    lo, mid, hi = np.log2([f["tiny"], f["smallest_normal"], f["max"]])
    ax.barh(i, hi - mid, left=mid, color=f"C{i}", alpha=0.8)
    ax.barh(i, mid - lo, left=lo, color=f"C{i}", alpha=0.3)
ax.set_yticks(range(3), [str(d).replace("torch.", "") for d in DTYPES])
mags = grads[grads != 0].abs().log2()
ax2 = ax.twinx()
ax2.hist(mags.numpy(), bins=80, color="k", alpha=0.5, label="gpt-tiny gradients")
ax2.hist((mags + np.log2(SHRINK)).numpy(), bins=80, color="C3", alpha=0.5, label="the same x 2^-16")
ax2.set_ylabel("number of gradient values")
ax2.legend(loc="upper right", fontsize=8)
ax.set_xlim(-155, 135)
ax.set_xlabel("log2 |value|  (light: subnormal range, dark: normal range)")
ax.set_title("range of each format, and where gradients fall")
fig

# %% [markdown]
# Takeaway: fp32 and bf16 cover every gradient with room to spare; fp16's range ends at
# 2^-24 ≈ 6e-8, and a gradient distribution only a few powers of two lower (red: the
# same gradients × 2^-16, where the activation gradients of large networks sit,
# Micikevicius et al. 2018, fig. 3) falls off its end.
#
# ### Exercise 1: what underflows
#
# Write `underflow_fraction(values, dtype)`: the share of the **nonzero** `values`
# that become exactly 0 when stored in `dtype`. Subnormals are not lost: only what rounds
# to zero is. The check compares your number with a measurement on values from 1e-46
# to 1 in all three formats.

# %%
def underflow_fraction(values: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of the nonzero values that round to 0 in dtype."""
    # BEGIN SOLUTION
    # HINT: cast, then compare: a value underflows when it was nonzero and its cast is zero.
    nonzero = values != 0
    lost = nonzero & (values.to(dtype) == 0)
    return lost.sum().item() / nonzero.sum().item()
    # END SOLUTION


# %%
# CHECK: the share of values that round to 0, against casting real values in fp16, bf16, fp32
check.underflow(underflow_fraction)

# %% [markdown]
# Your function on gpt-tiny's gradients, as they are and shifted down:

# %%
print(f"{'gradients x':>12}" + "".join(f"{str(d).replace('torch.', ''):>10}" for d in DTYPES))
for k in (0, 8, 16, 20):
    shifted = grads * 2.0**-k
    print(f"{'2^-' + str(k):>12}" + "".join(f"{underflow_fraction(shifted, d):>10.1%}" for d in DTYPES))

# %% [markdown]
# ## 2. What autocast does, op by op
#
# Two ways to compute in 16 bits:
#
# * **cast the parameters** (what FSDP's `MixedPrecision(param_dtype=...)` does): every op
#   of the module sees 16-bit weights, so every op runs in 16 bits;
# * **`torch.autocast`**: the weights stay fp32; ops on a list (matmul, linear) cast their
#   inputs to 16 bits, numerically sensitive ones (softmax, layer norm, losses) run in fp32.
#
# A `TorchDispatchMode` sees every op as it runs. Here is one transformer block both ways:

# %%
SHAPE_OPS = {"view", "t", "transpose", "expand", "clone", "_unsafe_view", "detach", "split", "randn"}


class OpDtypes(TorchDispatchMode):
    """Record the output dtype of every op that computes (shape-only ops left out)."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        name = func.overloadpacket.__name__
        if isinstance(first, torch.Tensor) and first.is_floating_point() and name not in SHAPE_OPS:
            self.ops.setdefault(name, str(first.dtype).replace("torch.", ""))
        return out


block = models.build_model("gpt-tiny", seed=0).blocks[0]
h, target = torch.randn(2, 8, 32), torch.zeros(2, 8, dtype=torch.long)
with OpDtypes() as by_autocast, torch.autocast("cpu", dtype=torch.bfloat16):
    models.lm_loss(block(h), target)        # the block, then a loss on its output
with OpDtypes() as by_cast:
    models.lm_loss(block.to(torch.bfloat16)(h.to(torch.bfloat16)), target)
print(f"{'op':<22}{'autocast':>10}{'params cast':>13}")
for op in by_autocast.ops:
    print(f"{op:<22}{by_autocast.ops[op]:>10}{by_cast.ops.get(op, '-'):>13}")

# %% [markdown]
# Takeaway: under autocast the linear layers and matmuls (`addmm`, `bmm`) run in bf16 on
# inputs autocast casts for them (`_to_copy`), while layer norm and the loss
# (`log_softmax`, `nll_loss`) run in fp32, and the residual `add` of a bf16 and an fp32
# tensor is fp32. With cast parameters everything is bf16. (CPU autocast leaves the
# attention softmax in bf16; CUDA autocast computes softmax in fp32.) Autocast is safer
# numerically but moves no fewer bytes: the weights
# (and FSDP's all-gathers of them) stay fp32. On CUDA, autocast's fp16 or bf16 also makes
# matmuls use tensor cores; on a CPU without bf16 instructions, bf16 can be *slower*.
# The two compose: FSDP with `param_dtype=torch.bfloat16`, inside an autocast region.
#
# ## 3. Loss scaling
#
# Multiply the loss by S before backward: by the chain rule every gradient is S times
# larger and climbs back into fp16's range. Before the optimizer step, divide by S in fp32
# (**unscale**) and check for inf/NaN: if S was too large some gradient overflowed, so
# **skip** the step and halve S (**back off**); after `growth_interval` clean steps in a row
# try doubling S (**grow**). That is `torch.amp.GradScaler`, and
# `minifsdp.mixed_precision.GradScaler` / `ShardedGradScaler` (which, for FSDP, agrees on the
# overflow across ranks with one all-reduce).
#
# ### Exercise 2: the scaler's two rules
#
# Write `unscale_(grads, scale)`: divide every gradient by `scale` **in place** (the
# optimizer reads those tensors) and return `True` if any value of any gradient is inf or
# NaN.
#
# Write `update_scale(scale, tracker, found_inf, growth_factor, backoff_factor,
# growth_interval)` returning the next `(scale, tracker)`, where `tracker` counts clean
# steps in a row. An overflow multiplies the scale by `backoff_factor` and restarts the
# count. A clean step adds one to the count; when the count reaches `growth_interval` the
# scale is multiplied by `growth_factor` and the count restarts.
#
# The check compares both with torch's own kernels (`_amp_foreach_non_finite_check_and_unscale_`,
# `_amp_update_scale_`), the second over a sequence of overflows and clean runs.

# %%
def unscale_(grads: list[torch.Tensor], scale: float) -> bool:
    """grads /= scale, in place; True if any gradient holds an inf or a NaN."""
    # BEGIN SOLUTION
    # HINT: multiply each tensor in place by the reciprocal; torch.isfinite is False for inf and NaN.
    found_inf = False
    for g in grads:
        found_inf = found_inf or not bool(torch.isfinite(g).all())
        g.mul_(1.0 / scale)
    return found_inf
    # END SOLUTION


def update_scale(scale: float, tracker: int, found_inf: bool, growth_factor: float, backoff_factor: float,
                 growth_interval: int) -> tuple[float, int]:
    """The scale and count of clean steps after one step."""
    # BEGIN SOLUTION
    # HINT: two cases (overflow or clean); in the clean case, count first, then compare with the interval.
    if found_inf:
        return scale * backoff_factor, 0
    tracker += 1
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker
    # END SOLUTION


# %%
# CHECK: gradients divided by S in place with inf/NaN found, and the update rule step by step, against torch
check.scaler_rules(unscale_, update_scale)

# %% [markdown]
# ### Exercise 3: a loss scaler and an fp16 step with an fp32 master copy
#
# First the scaler's state: `LossScaler` keeps the current `scale`, the count of clean
# steps and the rule's three constants; its `unscale_(grads)` and `update(found_inf)`
# apply your two rules to that state.
#
# Then one training step. `model16` is gpt-tiny in fp16; `master` holds an fp32 copy of its
# parameters (same order) and `opt` steps `master`. The fp16 forward and the loss
# (`loss_fn(logits, y)`, computed in fp32 as autocast would), backward of the **scaled**
# loss, the fp16 gradients moved to the master's `.grad` in fp32, unscale and check,
# the optimizer step **only if** nothing overflowed, the master copied back into
# `model16`, and the scale updated. Return the loss (unscaled) as a float.

# %%
class LossScaler:
    """A dynamic loss scaler built on unscale_ and update_scale (exercise 2)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        # BEGIN SOLUTION
        # HINT: the state is the current scale and the clean-step count; the rule's constants go with it.
        self.scale, self.tracker = init_scale, 0
        self.rule = (growth_factor, backoff_factor, growth_interval)
        # END SOLUTION

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        # BEGIN SOLUTION
        # HINT: your first rule, with the current scale.
        return unscale_(grads, self.scale)
        # END SOLUTION

    def update(self, found_inf: bool) -> None:
        # BEGIN SOLUTION
        # HINT: your second rule: it gives the new state.
        self.scale, self.tracker = update_scale(self.scale, self.tracker, found_inf, *self.rule)
        # END SOLUTION


def fp16_train_step(model16, master, opt, batch, loss_fn, scaler) -> float:
    """One mixed-precision step; returns the loss."""
    x, y = batch
    # BEGIN SOLUTION
    # HINT: scaled backward; p32.grad = fp32 copy of p16.grad; unscale_; step unless overflow; copy back; update.
    loss = loss_fn(model16(x), y)
    (loss * scaler.scale).backward()
    for p16, p32 in zip(model16.parameters(), master):
        p32.grad, p16.grad = p16.grad.float(), None
    found_inf = scaler.unscale_([p.grad for p in master])
    if not found_inf:
        opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for p16, p32 in zip(model16.parameters(), master):
            p16.copy_(p32)
    scaler.update(found_inf)
    return loss.item()
    # END SOLUTION


# %%
# CHECK: fp16 with your scaler trains gpt-tiny like the library's rules, skipping overflow steps
check.rescue(fp16_train_step, LossScaler)

# %% [markdown]
# Now watch the rescue. The loss is multiplied by 2^-16 (`SHRINK`) to put gpt-tiny's
# gradients where a large model's are (section 1). AdamW with a tiny `eps` divides each
# gradient by its own running size, so in fp32 this factor changes nothing: fp32 is the
# control. Three runs of 16 steps: fp32; fp16 with S = 1 forever (no scaling); fp16 with
# your scaler.

# %%
def run(dtype, scaler, steps=16):
    model16 = models.build_model("gpt-tiny", seed=0).to(dtype)
    master = [p.detach().float().requires_grad_() for p in model16.parameters()]
    opt = torch.optim.AdamW(master, lr=3e-3, eps=1e-16)
    losses, scales = [], []
    for step in range(steps):
        loss = fp16_train_step(model16, master, opt, data.get_batch(step, 8, 32),
                               lambda logits, y: models.lm_loss(logits.float(), y) * SHRINK, scaler)
        losses.append(loss / SHRINK)
        scales.append(scaler.scale)
    return losses, scales


runs = {"fp32": run(torch.float32, LossScaler(init_scale=1.0, growth_interval=10**9)),
        "fp16, no scaling": run(torch.float16, LossScaler(init_scale=1.0, growth_interval=10**9)),
        "fp16, your scaler": run(torch.float16, LossScaler(init_scale=2.0**16, growth_interval=5))}
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
for name, (losses, scales) in runs.items():
    ax1.plot(losses, label=name)
    ax2.semilogy(scales, label=name)
ax1.set_xlabel("step")
ax1.set_ylabel("training loss")
ax1.legend(fontsize=8)
ax2.set_xlabel("step")
ax2.set_ylabel("loss scale S")
print({k: round(v[0][-1], 3) for k, v in runs.items()})
fig

# %% [markdown]
# Takeaway: without scaling, fp16 loses most gradients to zero and the loss barely moves;
# with your scaler the fp16 curve lies on the fp32 one (the printed final losses), and
# the scale grows every 5 clean steps. A run that starts with S too large loses its first
# steps to overflow and backs off (the check started at 2^36 and printed how many it skipped).
#
# ### Exercise 3b: every rank skips the same step
#
# Under FSDP (lab 04) or ZeRO-2 (lab 03) the optimizer of rank r steps only rank r's
# **shard**, with the reduce-scattered gradients of that shard. An overflow lands in some
# shards and not others: your `unscale_` on rank 0 sees only rank 0's part. If each rank
# decided alone, the rank that saw the inf would skip while the others step, and their
# scales would drift apart from then on: different parameters, different scales, one
# model no more. So the ranks first **agree**: a step is skipped when *any* rank found an
# overflow.
#
# Write `sharded_scaler_step(shard, opt, scaler)`: `shard` is this rank's list of shard
# parameters (their `.grad` hold the scaled gradients), `opt` steps them, `scaler` is your
# `LossScaler`. Unscale and check this rank's gradients, make the flag every rank's with
# one collective (`comm.all_reduce(tensor, op=comm.ReduceOp.…)`, on a tensor on
# `dist.device()`), step only if no rank overflowed, update the scale with the agreed flag,
# and return it. The loop around it (forward, scaled backward, `zero_grad`) is given.
#
# The check runs your step on 2 ranks of FSDP for 10 steps and writes an inf into the last
# rank's shard at step 3, a NaN into rank 0's at step 7 and an inf into every shard at step 8.
# Target: every rank skips exactly those three steps, holds the same scale, and ends with the
# shards of the library's `ShardedGradScaler` run in the same loop.

# %%
def sharded_scaler_step(shard: list[torch.Tensor], opt, scaler) -> bool:
    """Unscale this rank's shard, agree on found_inf with every rank, step unless any overflowed, update."""
    # BEGIN SOLUTION
    # HINT: your scaler finds this rank's overflow; a one-element tensor and the reduce op that means "any" make it every rank's.
    mine = scaler.unscale_([p.grad for p in shard])
    flag = torch.tensor([float(mine)], device=dist.device())
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)  # 1 if any rank's shard overflowed
    found_inf = bool(flag.item())
    if not found_inf:
        opt.step()
    scaler.update(found_inf)
    return found_inf
    # END SOLUTION


# %%
# CHECK: on FSDP ranks with an inf in one rank's shard, every rank skips the same steps, like ShardedGradScaler
check.sharded_step(sharded_scaler_step, LossScaler)

# %% [markdown]
# Your step on 2 ranks, one step, an inf written into the last rank's shard only: what each
# rank saw in its own shard, what it returned, whether its shard moved, and its scale.

# %%
def one_overflow_step():
    model = FSDP(models.build_model("gpt-tiny", seed=0), auto_wrap_policy=ModuleWrapPolicy({models.Block}))
    shard = list(model.parameters())
    opt, scaler = torch.optim.AdamW(shard, lr=1e-2), LossScaler(init_scale=2.0**10)
    x, y = data.get_batch(0, 4, 16, rank=dist.rank(), world_size=dist.world_size())
    (models.lm_loss(model(x.to(dist.device())), y.to(dist.device())) * scaler.scale).backward()
    if dist.rank() == dist.world_size() - 1:
        shard[0].grad[0] = float("inf")
    own = not all(bool(torch.isfinite(p.grad).all()) for p in shard)
    before = shard[0].detach().clone()
    found = sharded_scaler_step(shard, opt, scaler)
    return own, found, not torch.equal(before, shard[0]), scaler.scale


print(f"{'rank':>4} {'own shard overflowed':>21} {'returned found_inf':>19} {'stepped':>8} {'scale':>6}")
for rank, (own, found, stepped, scale) in enumerate(launch(one_overflow_step, N2, timeout=60)):
    print(f"{rank:>4} {str(own):>21} {str(found):>19} {str(stepped):>8} {scale:>6g}")

# %% [markdown]
# Takeaway: rank 0's shard was clean, yet it skipped and backed off with the rank that
# overflowed: one all-reduce of one number per step keeps the ranks one model. That is
# what `ShardedGradScaler` adds to `GradScaler` (torch's and minifsdp's).
#
# ## 4. The FSDP precision policy: bytes and memory
#
# `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)` tells FSDP which dtype each
# step runs in: the fp32 shard is cast to `param_dtype` **before** the all-gather,
# gradients are reduce-scattered in `reduce_dtype` (`None` means "same as `param_dtype`"),
# then cast back to fp32 for the optimizer (unless `keep_low_precision_grads`).
#
# ### Exercise 4: bytes per step
#
# `units` lists each FSDP unit as `(padded numel, all-gathers per step)` (the root unit is
# gathered once, the blocks twice under FULL_SHARD, lab 04). Write `policy_bytes(units, mp)`
# returning `{"all_gather": bytes, "reduce_scatter": bytes}` for one step, in the
# collective-volume convention of lab 00 (the full tensor's bytes per call); `mp` is a
# `MixedPrecision` or `None` (all fp32). Each unit's gradient is reduce-scattered once.
# The check compares with the tracer on a 2-rank FSDP step under four policies.

# %%
def policy_bytes(units: list[tuple[int, int]], mp) -> dict[str, int]:
    """Bytes all-gathered and reduce-scattered in one FSDP step under policy mp."""
    # BEGIN SOLUTION
    # HINT: element size of the dtype each collective runs in; mind the defaults (None).
    param = mp.param_dtype if mp is not None and mp.param_dtype is not None else torch.float32
    reduce = mp.reduce_dtype if mp is not None and mp.reduce_dtype is not None else param
    size = lambda dtype: torch.tensor([], dtype=dtype).element_size()  # noqa: E731
    return {"all_gather": sum(numel * gathers for numel, gathers in units) * size(param),
            "reduce_scatter": sum(numel for numel, _ in units) * size(reduce)}
    # END SOLUTION


# %%
# CHECK: your bytes equal the tracer's count of a real FSDP step, for four policies
check.policy_bytes(policy_bytes)

# %% [markdown]
# What the policy does to memory: the same step measured by `MemoryTracker` (lab 01) on
# each rank, with a unit per `Block`. The unsharded parameters and gradients are the
# units being computed; the shards and the optimizer state stay fp32 (the master copy).

# %%
POLICIES = {"fp32": None, "bf16": MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16),
            "bf16, fp32 reduce": MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)}


def measure(policies):
    out = {}
    for name, mp in policies.items():
        model = FSDP(models.build_model("gpt-tiny", seed=0), auto_wrap_policy=ModuleWrapPolicy({models.Block}),
                     mixed_precision=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = data.get_batch(0, 8, 32, rank=dist.rank(), world_size=dist.world_size())
        tracker = memory.MemoryTracker()
        tracker.track_model(model)
        with trace.Tracer() as tracer, tracker:
            models.lm_loss(model(x.to(dist.device())).float(), y.to(dist.device())).backward()
            opt.step()
        tracker.close()
        out[name] = {"bytes": tracer.trace.bytes_by_op(), "peak": tracker.peak_total,
                     "by_category": dict(tracker.peak_by_category)}
    return out


measured = launch(measure, N2, POLICIES, timeout=120)[0]
print(f"{'policy':<20}{'all-gather B':>14}{'reduce-scatter B':>18}{'peak KiB':>10}")
for name, m in measured.items():
    print(f"{name:<20}{m['bytes'].get('all_gather', 0):>14,}{m['bytes'].get('reduce_scatter', 0):>18,}"
          f"{m['peak'] / 1024:>10.0f}")
cats = sorted({c for m in measured.values() for c in m["by_category"]})
fig, ax = plt.subplots(figsize=(8, 2.8))
left = np.zeros(len(measured))
for i, c in enumerate(cats):
    widths = np.array([m["by_category"].get(c, 0) / 1024 for m in measured.values()])
    ax.barh(list(measured), widths, left=left, label=c, color=f"C{i}")
    left += widths
ax.set_xlabel("live memory at the peak of one step, rank 0 (KiB)")
ax.legend(fontsize=7, ncol=3, loc="lower right")
fig

# %% [markdown]
# Takeaway: bf16 halves the all-gather bytes exactly, and the reduce-scatter too unless
# `reduce_dtype=torch.float32`; the unsharded parameters and gradients at the peak take
# half the memory, while the fp32 shards and AdamW's state do not shrink: on gpt-tiny the
# fixed part dominates, on a billion-parameter model the unsharded units and activations do.
#
# ## What you have seen
#
# * fp16 has 5 exponent bits: gradients below 2^-24 become 0. bf16 has fp32's range and
#   needs no scaling; its cost is precision (8 significant bits).
# * Autocast picks a dtype per op (matmuls in 16 bits, softmax and norms in fp32);
#   parameter casting runs everything in 16 bits and halves FSDP's bytes.
# * Loss scaling: multiply by S, unscale in fp32, skip steps that overflowed, back off,
#   grow after clean runs. With sharded gradients all ranks must agree on "overflowed"
#   (`ShardedGradScaler` all-reduces the flag).
# * The optimizer steps an fp32 master copy; 16-bit numbers are for compute and communication.

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
