# Lab 05 - mixed precision. Source of solutions/05_mixed_precision.ipynb and
# labs/05_mixed_precision.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 05 - Mixed precision: 16-bit compute, 32-bit master weights, loss scaling
#
# 16-bit numbers halve the bytes of every parameter, gradient and all-gather; fp16 loses
# small gradients to **underflow**, bf16 keeps fewer digits. The recipe (Micikevicius et
# al. 2018): an **fp32 master copy** for the optimizer, 16-bit compute, and for fp16 a
# **scaled loss**.
#
# **You will be able to**: measure what fp16 and bf16 lose; build a loss scaler that
# rescues an fp16 run; make every FSDP rank skip the same overflowing step; predict an FSDP
# step's bytes under a precision policy.
#
# **Prerequisites**: lab 04 (FSDP: exercise 4 runs on it).
# **Time**: 60 minutes; 10-25 s of compute on a laptop (2 CPU ranks), about as long on
# GPUs (each launch starts CUDA).
#
# **Exercises**: 1. what 16 bits lose · 2. a loss scaler · 3. an fp16 step on an fp32
# master copy · 4. mixed precision under FSDP.

# %%
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp import comm, data, dist, launch, memory, models, plot, trace
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import MixedPrecision, ModuleWrapPolicy
from minifsdp.labcheck import lab05 as check
from minifsdp.mixed_precision import format_info, format_table

torch.set_num_threads(1)  # small models: one thread is as fast, and robust when processes share cores
notebook_start = time.perf_counter()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RANKS = 2   # the FSDP lessons need 2 ranks: with fewer GPUs, launch runs CPU ranks and says so

# %% [markdown]
# ## 1. Three number formats
#
# A floating-point number is sign × mantissa × 2^exponent. The exponent bits set the
# **range**, the mantissa bits the **precision** (eps = the gap between 1 and the next
# number). Below the smallest *normal* number come the *subnormals*, with ever fewer
# digits, down to the smallest subnormal; anything smaller rounds to **0**.
#
# **Symbols**: Ψ = the number of parameters (elements); bytes are k·Ψ with k the bytes per
# element: 4Ψ in fp32, 2Ψ in bf16 or fp16. S = the loss scale; N = the world size.

# %%
# NBVAL_CHECK_OUTPUT
print(format_table())

# %% [markdown]
# bf16 keeps fp32's 8 exponent bits (the same range) but only 8 significant bits (7 stored,
# 1 implicit) to fp32's 24: about 4.8 decimal digits fewer (16 bits × log10 2). fp16 has 5
# exponent bits (range 6e-8 to 65504) and 11 significant bits, about one digit more than
# bf16. Where do a real model's gradients fall? One backward of `gpt-tiny` in fp32 on a
# batch of text:

# %%
# FIGURE
model = models.build_model("gpt-tiny", seed=0)
x, y = data.get_batch(0, 8, 32)
models.lm_loss(model(x), y).backward()
grads = torch.cat([p.grad.flatten() for p in model.parameters()])
SHRINK = 2.0**-16   # see the figure: moves gpt-tiny's gradients to where a large model's live

fig = plot.Figure(figsize=(9, 3.6))   # a plot.Figure shows once, as the cell's last expression
ax = fig.add_subplot()
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
# ### Exercise 1: what 16 bits lose
#
# Two losses, each measured by casting. **Range**: a value *underflows* when it is nonzero
# and becomes exactly 0 in `dtype` (subnormals survive, with fewer digits). **Precision**:
# an update is *swamped* when adding it to a weight stored in `dtype` leaves that weight
# unchanged: the update is below half the gap between the weight and its neighbour.

# %% [markdown]
# Goal, two functions returning a fraction between 0 and 1:
#
# * `underflow_fraction(values, dtype)`: the share of the nonzero `values` that become 0 in
#   `dtype`;
# * `swamped_fraction(weights, updates, dtype)`: the share of the nonzero `updates` that
#   leave their weight (same position) unchanged when both are stored in `dtype` and added.
#
# Target: the check measures both on values from 1e-46 to 1 and on updates from 1e-9 to 0.1,
# in fp16, bf16 and fp32, and wants your fractions exactly.
#
# Stuck? `check.hint("underflow_fraction")` (or any exercise's name) prints the next hint,
# one at a time: the idea first, never the code.

# %%
def underflow_fraction(values: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of the nonzero values that round to 0 in dtype."""
    # BEGIN SOLUTION
    # HINT: the share of nonzero values whose cast is 0; check.hint('underflow_fraction')
    nonzero = values != 0
    lost = nonzero & (values.to(dtype) == 0)
    return lost.sum().item() / nonzero.sum().item()
    # END SOLUTION


def swamped_fraction(weights: torch.Tensor, updates: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of the nonzero updates that leave their weight unchanged, both stored and added in dtype."""
    # BEGIN SOLUTION
    # HINT: the share of nonzero updates lost when added in dtype; check.hint('swamped_fraction')
    stored = weights.to(dtype)
    unchanged = (stored + updates.to(dtype)) == stored
    nonzero = updates != 0
    return (nonzero & unchanged).sum().item() / nonzero.sum().item()
    # END SOLUTION


# %%
# CHECK: the shares lost to underflow and to swamping, against casting real values in fp16, bf16, fp32
check.lost_in_16_bits(underflow_fraction, swamped_fraction)

# %% [markdown]
# Your functions on gpt-tiny: its gradients as they are and shifted down, then one optimizer
# step's updates (lr × a step of size ~1, as Adam's normalised step is) added to its weights.

# %%
print(f"{'gradients x':>12}" + "".join(f"{str(d).replace('torch.', ''):>10}" for d in DTYPES))
for k in (0, 8, 16, 20):
    shifted = grads * 2.0**-k
    print(f"{'2^-' + str(k):>12}" + "".join(f"{underflow_fraction(shifted, d):>10.1%}" for d in DTYPES))
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
unit_step = torch.randn(weights.shape, generator=torch.Generator().manual_seed(0))
print(f"\n{'update, lr':>12}" + "".join(f"{str(d).replace('torch.', ''):>10}" for d in DTYPES))
for lr in (1e-3, 1e-4, 1e-5):
    print(f"{lr:>12g}" + "".join(f"{swamped_fraction(weights, lr * unit_step, d):>10.1%}" for d in DTYPES))

# %% [markdown]
# Takeaway: fp16 loses gradients to underflow once they sit a few powers of two lower; bf16
# loses none. But bf16 loses *updates*: at lr 1e-4 about a fifth of them vanish into
# gpt-tiny's weights, at lr 1e-5 nearly nine in ten (fp16, with 3 more bits, about a
# quarter); fp32 loses none. A model stored in 16 bits stops learning as its learning rate
# decays. Hence the recipe's fp32 master copy: the optimizer adds updates in fp32, and only
# the copy that computes forward and backward is 16-bit.

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
# attention softmax in bf16; CUDA autocast computes softmax in fp32.)
#
# Autocast is safer numerically but moves no fewer bytes: the weights, and FSDP's
# all-gathers of them, stay fp32 (k = 4). On CUDA, fp16 or bf16 matmuls use tensor cores;
# on a CPU without bf16 instructions, bf16 can be *slower*. The two compose: FSDP with
# `param_dtype=torch.bfloat16`, inside an autocast region.

# %% [markdown]
# ## 3. Loss scaling
#
# Multiply the loss by S before backward: by the chain rule every gradient is S times
# larger and climbs back into fp16's range. Before the optimizer step, divide by S in fp32
# (**unscale**) and look for inf/NaN: if S was too large some gradient overflowed, so that
# step is **skipped** and S shrinks (**back off**); after a long enough run of clean steps
# S may **grow** again. That is `torch.amp.GradScaler` (and minifsdp's `GradScaler`): you
# build your own, and the checks refuse theirs.
#
# ### Exercise 2: a loss scaler
#
# Goal: `LossScaler`, whose scale follows torch's `GradScaler` step for step: it shrinks by
# `backoff_factor` at an overflow and grows by `growth_factor` after `growth_interval` clean
# steps in a row.

# %% [markdown]
# Contract: a scaler keeps `self.scale` (S, a float) and `self.tracker` (the clean steps in
# a row, 0 at the start). `unscale_(grads)` divides every gradient by S **in place** (the
# optimizer reads those very tensors) and returns `True` if any value is inf or NaN;
# `update(found_inf)` moves the state on by one step.
#
# Target: four gradient lists (finite, an inf, a NaN, a -inf) against torch's kernel
# `_amp_foreach_non_finite_check_and_unscale_`, and 22 steps with 4 overflows
# (`growth_interval` 3) against torch's `_amp_update_scale_`: the same state after every step.

# %%
class LossScaler:
    """A dynamic loss scaler: the scale S, the clean steps in a row, and the rule's three constants."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        # BEGIN SOLUTION
        # HINT: keep self.scale, self.tracker and the rule's constants; check.hint('LossScaler')
        self.scale, self.tracker = float(init_scale), 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        # END SOLUTION

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """grads /= S, in place; True if any gradient holds an inf or a NaN."""
        # BEGIN SOLUTION
        # HINT: divide each gradient in place and report any inf/NaN; check.hint('LossScaler')
        found_inf = False
        for g in grads:
            found_inf = found_inf or not bool(torch.isfinite(g).all())
            g.mul_(1.0 / self.scale)
        return found_inf
        # END SOLUTION

    def update(self, found_inf: bool) -> None:
        """The scale and the count of clean steps after a step that did or did not overflow."""
        # BEGIN SOLUTION
        # HINT: back off on an overflow, grow after a clean run; check.hint('LossScaler')
        if found_inf:
            self.scale, self.tracker = self.scale * self.backoff_factor, 0
            return
        self.tracker += 1
        if self.tracker == self.growth_interval:
            self.scale, self.tracker = self.scale * self.growth_factor, 0
        # END SOLUTION


# %%
# CHECK: your scaler's unscale_ and update against torch's kernels, step by step
check.loss_scaler(LossScaler)

# %% [markdown]
# ### Exercise 3: an fp16 step on an fp32 master copy
#
# Goal: one training step of an fp16 model whose optimizer owns fp32 copies of the weights,
# guarded by your scaler: small gradients survive the fp16 backward, the optimizer sees the
# true gradients in fp32 and never an inf, and the fp16 model ends the step holding the
# master's new values.
#
# Contract: `fp16_train_step(model16, master, opt, batch, loss_fn, scaler) -> float`.
# `master` holds fp32 copies of `model16`'s parameters (same order) and `opt` steps them;
# `loss_fn(logits, y)` computes the loss in fp32 (as autocast would); `scaler` is a
# `LossScaler`. Return the loss, unscaled, as a float.
#
# Target: 12 steps of gpt-tiny from S = 2^36 (too large: the first steps overflow): the same
# losses (within 1e-3) and scales as the loop built on torch's rules, and a loss that falls
# where fp16 without scaling stalls.

# %%
def fp16_train_step(model16, master, opt, batch, loss_fn, scaler) -> float:
    """One mixed-precision step; returns the loss."""
    x, y = batch
    # BEGIN SOLUTION
    # HINT: a scaled fp16 backward, an fp32 master step unless overflow; check.hint('fp16_train_step')
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
# CHECK: fp16 with your scaler trains gpt-tiny like torch's rules, skipping the steps that overflow
check.rescue(fp16_train_step, LossScaler)

# %% [markdown]
# Now watch the rescue. The loss is multiplied by 2^-16 (`SHRINK`) to put gpt-tiny's
# gradients where a large model's are (section 1). AdamW with a tiny `eps` divides each
# gradient by its own running size, so in fp32 this factor changes nothing: fp32 is the
# control. Three runs of 16 steps: fp32; fp16 with S = 1 forever (no scaling); fp16 with
# your scaler.

# %%
# FIGURE
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
fig = plot.Figure(figsize=(10, 3.4))
ax1, ax2 = fig.subplots(1, 2)
for name, (losses, scales) in runs.items():
    wide = dict(linewidth=4, alpha=0.4) if name == "fp32" else {}   # fp32 is wide: the fp16 scaler's line lies on it
    ax1.plot(losses, label=name, **wide)
    ax2.semilogy(scales, label=name, **wide)
ax1.set_xlabel("step")
ax1.set_ylabel("training loss (cross-entropy, nats)")
ax1.legend(fontsize=8)
ax2.set_xlabel("step")
ax2.set_ylabel("loss scale S (multiplier)")
print({k: round(v[0][-1], 3) for k, v in runs.items()})
fig

# %% [markdown]
# Takeaway: without scaling, fp16 loses most gradients to zero and the loss barely moves;
# with your scaler the fp16 curve lies on the fp32 one (the printed final losses), and
# the scale grows every 5 clean steps. A run that starts with S too large loses its first
# steps to overflow and backs off (the check started at 2^36 and printed how many it skipped).

# %% [markdown]
# ## 4. Mixed precision under FSDP
#
# Under FSDP (lab 04) the optimizer of rank r steps only rank r's **shard**, with the
# reduce-scattered gradients of that shard; a precision policy says which dtype each
# collective runs in. `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`: the fp32
# shard is cast to `param_dtype` **before** the all-gather, gradients are reduce-scattered
# in `reduce_dtype` (`None` means "same as `param_dtype`"; no policy at all means fp32
# throughout), then cast back to fp32 for the optimizer: the shards are the master copy.
#
# ### Exercise 4: every rank skips the same step, and the bytes a policy moves
#
# An overflow lands in some shards and not others: `unscale_` on rank 0 sees only rank 0's
# part. If each rank decided alone, the rank that saw the inf would skip while the others
# step, and their scales would drift apart: different parameters, different scales, one
# model no more.

# %% [markdown]
# Goal, part a: `sharded_scaler_step(shard, opt, scaler) -> bool`. `shard` is this rank's
# list of shard parameters (their `.grad` hold the scaled gradients), `opt` steps them,
# `scaler` is your `LossScaler`. Every rank skips the step when *any* rank found an
# overflow, updates its scale with that agreed flag, and returns it. The loop around it is
# given; a tensor handed to a collective lives on `dist.device()`.
#
# Target: 10 steps on 2 FSDP ranks, an inf in the last rank's shard at step 3, a NaN in
# rank 0's at step 7, an inf in every shard at step 8: every rank skips exactly those three
# steps, and ends with the same scale and the same shards as the library's `ShardedGradScaler`.

# %% [markdown]
# Goal, part b: `policy_bytes(units, mp) -> {"all_gather": bytes, "reduce_scatter": bytes}`
# for one FULL_SHARD step, in lab 00's convention (the full tensor's bytes per call). `units`
# lists each FSDP unit as `(padded numel, all-gathers per step)` (the root is gathered once,
# the blocks twice, lab 04), each unit's gradient is reduce-scattered once, and `mp` is a
# `MixedPrecision` or `None`.
#
# In Ψ terms, with k bytes per element: a step gathers up to 2·kΨ bytes and reduce-scatters
# kΨ, up to 3·4Ψ in fp32, and a policy sets k for each collective. gpt-tiny has Ψ = 42,880
# parameters: in fp32 its reduce-scatter moves 4Ψ = 171,520 B.
#
# Target: the tracer's count of a real 2-rank FSDP step under four policies, to the byte.

# %%
def sharded_scaler_step(shard: list[torch.Tensor], opt, scaler) -> bool:
    """True if any rank's shard overflowed: then every rank skips this step. Every rank's scale moves alike."""
    # BEGIN SOLUTION
    # HINT: skip on every rank when any rank overflowed; check.hint('sharded_scaler_step')
    mine = scaler.unscale_([p.grad for p in shard])
    flag = torch.tensor([float(mine)], device=dist.device())
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)  # 1 if any rank's shard overflowed
    found_inf = bool(flag.item())
    if not found_inf:
        opt.step()
    scaler.update(found_inf)
    return found_inf
    # END SOLUTION


def policy_bytes(units: list[tuple[int, int]], mp) -> dict[str, int]:
    """Bytes all-gathered and reduce-scattered in one FSDP step under policy mp."""
    # BEGIN SOLUTION
    # HINT: elements x bytes per element of each collective's dtype; check.hint('policy_bytes')
    param = mp.param_dtype if mp is not None and mp.param_dtype is not None else torch.float32
    reduce = mp.reduce_dtype if mp is not None and mp.reduce_dtype is not None else param
    return {"all_gather": sum(numel * gathers for numel, gathers in units) * param.itemsize,
            "reduce_scatter": sum(numel for numel, _ in units) * reduce.itemsize}
    # END SOLUTION


# %%
# CHECK: on 2 FSDP ranks every rank skips the steps one shard overflowed, like ShardedGradScaler; bytes = tracer's
check.fsdp_precision(sharded_scaler_step, policy_bytes, LossScaler)

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
for rank, (own, found, stepped, scale) in enumerate(launch(one_overflow_step, RANKS, timeout=60)):
    print(f"{rank:>4} {str(own):>21} {str(found):>19} {str(stepped):>8} {scale:>6g}")

# %% [markdown]
# Takeaway: rank 0's shard was clean, yet it skipped and backed off with the rank that
# overflowed: one all-reduce of one number per step keeps the ranks one model. That is
# what `ShardedGradScaler` adds to `GradScaler` (torch's and minifsdp's).
#
# What the policy does to memory: the same step measured by `MemoryTracker` (lab 01) on
# each rank, with a unit per `Block`. The unsharded parameters and gradients are the
# units being computed; the shards and the optimizer state stay fp32 (the master copy).

# %%
# FIGURE
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


measured = launch(measure, RANKS, POLICIES, timeout=120)[0]
print(f"{'policy':<20}{'all-gather B':>14}{'reduce-scatter B':>18}{'peak KiB':>10}")
for name, m in measured.items():
    print(f"{name:<20}{m['bytes'].get('all_gather', 0):>14,}{m['bytes'].get('reduce_scatter', 0):>18,}"
          f"{m['peak'] / 1024:>10.0f}")
cats = sorted({c for m in measured.values() for c, b in m["by_category"].items() if b > 0})   # live at the peak
fig = plot.Figure(figsize=(8, 2.8))
ax = fig.add_subplot()
left = np.zeros(len(measured))
for i, c in enumerate(cats):
    widths = np.array([m["by_category"].get(c, 0) / 1024 for m in measured.values()])
    ax.barh(list(measured), widths, left=left, label=c, color=f"C{i}")
    left += widths
ax.set_xlabel("live memory at the peak of one step, rank 0 (KiB)")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
fig

# %% [markdown]
# Takeaway: bf16 halves the all-gather bytes exactly, and the reduce-scatter too unless
# `reduce_dtype=torch.float32` (bytes, not peak memory). At the peak, the start of backward,
# the bf16 policy halves the gathered parameters (68 to 34 KiB) and cuts the saved
# activations from about 740 to 435 KiB (the logits go to fp32 for the loss); the fp32
# shards, the master copy, do not shrink. Gradients and AdamW's state come later, below
# this peak.

# %% [markdown]
# ## What you have seen
#
# * fp16 has 5 exponent bits: gradients below 2^-24 become 0. bf16 has fp32's range and
#   needs no scaling; its cost is precision (8 significant bits): small updates vanish into
#   16-bit weights, so the optimizer steps an fp32 master copy.
# * Autocast picks a dtype per op (matmuls in 16 bits, softmax and norms in fp32);
#   parameter casting runs everything in 16 bits and halves k, so FSDP's bytes, up to
#   3·4Ψ per step in fp32, become up to 3·2Ψ.
# * Loss scaling: multiply by S, unscale in fp32, skip steps that overflowed, back off,
#   grow after clean runs. With sharded gradients all ranks must agree on "overflowed"
#   (`ShardedGradScaler` all-reduces the flag).

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
