# Lab 01 - memory anatomy. Source of solutions/01_memory_anatomy.ipynb and
# labs/01_memory_anatomy.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 01 - Memory anatomy: where training memory goes
#
# What stops you from training a bigger model is usually not time but memory: one
# device must hold, at the same moment,
#
# | category | what it is | grows with |
# |---|---|---|
# | **parameters** | the weights | model size |
# | **gradients** | one per weight, filled by `backward()` | model size |
# | **optimizer state** | AdamW's two running moments per weight | model size |
# | **activations** | what the forward pass keeps for the backward pass | batch x sequence x layers |
# | **temporaries** | scratch of the backward pass, freed within it | the largest layer |
#
# Sharding techniques (ZeRO, FSDP: labs 03 and 04) divide the first three by the
# number of devices; activation checkpointing (lab 06) and pipeline parallelism
# (lab 07) attack the fourth. Before dividing anything we *measure* each term,
# exactly, and check that we can *predict* it from first principles.
#
# Everything here runs in one process on the CPU in well under a minute.
#
# **Tools**
# * `minifsdp.memory.MemoryTracker`: counts the bytes of every live tensor by
#   category, op by op (CPU has no allocator counter, so it watches every op).
# * `minifsdp.estimate`: the formulas (`param_bytes`, `grad_bytes`,
#   `optimizer_state_bytes`, `gpt_activation_bytes`, `model_state_bytes_per_device`).
#
# **Sections**: 1. the tracker and a toy MLP, predicted to the byte (exercise 1);
# 2. one GPT training step, drawn; 3. how activations grow with batch and sequence
# length; 4. exercise 2: predict the activations of a GPT; 5. a teaser: what data
# parallelism replicates and what ZeRO divides.

# %%
import inspect
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import minifsdp
from minifsdp import data, estimate, models, plot
from minifsdp.estimate import format_bytes
from minifsdp.memory import (ACTIVATIONS, GRADIENTS, OPTIMIZER, OTHER, PARAMETERS, TEMPORARY,
                             MemoryTracker)

# These tensors are small: one compute thread is as fast as several, and it does not
# slow to a crawl when other programs compete for the cores (OpenMP threads spin).
torch.set_num_threads(1)

FP32 = 4   # bytes per float32 element
INT64 = 8  # bytes per int64 element (token ids, class labels)
MiB = 2**20
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. Counting bytes
#
# A tensor is a *view* (shape, strides, offset) of a *storage*, the block of
# memory the allocator handed out. `MemoryTracker` is a `TorchDispatchMode`: it
# sees the outputs of every aten op run inside `with tracker:`, books each storage
# the first time it appears (bytes and a category), and un-books it, through a weak
# reference, the moment the storage is freed. Views share their base's storage, so
# they cost nothing. Tensors made *before* tracking starts are invisible until you
# `register` them (`track_model` does that for a model's parameters).
#
# This lab stays on the CPU, where every count is exact. On a GPU the tracker rounds
# each storage up to 512 B, as PyTorch's caching allocator does, and
# `tracker.cuda_allocated()` returns `torch.cuda.memory_allocated()` to compare with.

# %%
# NBVAL_CHECK_OUTPUT
out = []  # this cell's lines, printed at once at the end
tracker = MemoryTracker()
with tracker:
    a = torch.empty(1000)                   # 1000 fp32 elements
    out.append(f"after torch.empty(1000):        {tracker.total()} B")
    views = [a[10:20], a.view(10, 100).t(), a.reshape(-1)]
    out.append(f"after three views of it:        {tracker.total()} B")
    b = a.view(10, 100).t().contiguous()    # a real copy: a new storage
    out.append(f"after a contiguous copy:        {tracker.total()} B")
    del a
    out.append(f"after `del a` (views keep it):  {tracker.total()} B")
    del views, b
    out.append(f"after deleting everything:      {tracker.total()} B")
out.append(f"peak: {tracker.peak_total} B")
print("\n".join(out))

# %% [markdown]
# ### A toy MLP, predicted by hand
#
# `models.build_model("mlp")` is `Linear(8,16) -> ReLU -> Linear(16,16) -> ReLU -> Linear(16,4)`.
# A `Linear(i, o)` has an `o x i` weight and `o` biases.

# %%
mlp = models.build_model("mlp")
print(mlp)
for name, p in mlp.named_parameters():
    print(f"  {name:18} {tuple(p.shape)}")

# %% [markdown]
# Predict, before measuring, with `P` parameters in fp32:
#
# * parameters: `4 P` bytes; gradients: the same, `4 P` (one fp32 gradient per weight);
# * activations after the forward pass, batch `B = 32`, cross-entropy over 4 classes.
#   Autograd keeps exactly what each op's backward *formula* needs:
#   the first `Linear` keeps its input `x` (to form the weight gradient `grad^T x`;
#   it also keeps its weight, but that is a parameter, already counted);
#   each `ReLU` keeps its output (the gradient passes where it is > 0), and the next
#   `Linear` needs that very tensor as its input, so it is stored once;
#   the last `Linear`'s output is *not* kept (`log_softmax`'s backward needs only
#   its own output); the loss keeps the log-probabilities `B x 4`, the int64 labels
#   and one fp32 scalar (the total weight it divided by); plus the 4-byte loss itself.

# %%
B_MLP = 32
gen = torch.Generator().manual_seed(0)
x_mlp = torch.randn(B_MLP, 8, generator=gen)
y_mlp = torch.randint(0, 4, (B_MLP,), generator=gen)

P_mlp = (8 * 16 + 16) + (16 * 16 + 16) + (16 * 4 + 4)      # weights + biases, by hand
assert P_mlp == models.count_parameters(mlp)
predicted_mlp = {
    PARAMETERS: FP32 * P_mlp,
    GRADIENTS: FP32 * P_mlp,
    ACTIVATIONS: FP32 * B_MLP * 8            # x, kept by the first Linear
    + FP32 * B_MLP * 16 * 2                  # the two ReLU outputs
    + FP32 * B_MLP * 4                       # log-probabilities
    + INT64 * B_MLP                          # labels
    + FP32                                   # nll_loss's total weight
    + FP32,                                  # the loss itself
}
print("P =", P_mlp, "parameters;", predicted_mlp)

# %% [markdown]
# One helper runs training steps under a fresh tracker and records a snapshot
# after each phase. `reset_peak()` at the start of each step gives one peak per
# step. The batches are made *before* tracking (so the data loader's own buffers
# are not counted); each step copies its batch in, as a GPU step copies it to the device.

# %%
def train_steps(model, batches, loss_fn, lr=1e-3, **tracker_options):
    """AdamW steps on `batches` (a list of (x, y)) under a new MemoryTracker.

    Returns (tracker, optimizer, snaps, peaks): snaps[i][phase] is live bytes by
    category after "forward", "backward", "step" and "zero_grad" of step i;
    peaks[i] is (peak total, bytes by category at that peak) within step i.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tracker = MemoryTracker(**tracker_options)
    tracker.track_model(model)               # parameters, and each .grad once it exists
    snaps, peaks = [], []
    with tracker:
        for i, (x_host, y_host) in enumerate(batches):
            tracker.reset_peak()
            # The step's own copy of its batch (what x.to("cuda") is on a GPU): an
            # activation, since the first layer keeps it, freed when the step ends.
            x, y = x_host.clone(), y_host.clone()
            snap = {}
            loss = loss_fn(model(x), y)
            snap["forward"] = tracker.snapshot(f"forward {i + 1}")
            loss.backward()
            snap["backward"] = tracker.snapshot(f"backward {i + 1}")
            opt.step()
            snap["step"] = tracker.snapshot(f"step {i + 1}")
            opt.zero_grad(set_to_none=True)  # frees the gradients
            del loss, x, y
            snap["zero_grad"] = tracker.snapshot(f"zero_grad {i + 1}")
            snaps.append(snap)
            peaks.append((tracker.peak_total, dict(tracker.peak_by_category)))
    tracker.close()
    return tracker, opt, snaps, peaks

# %% [markdown]
# ### Exercise 1: predict AdamW's bytes
#
# `torch.optim.AdamW` creates its state lazily, in the first `step()`. Write
# `predict_adamw_bytes(model)`: the bytes of that state for an fp32 model, to the
# byte. Everything you need is in the AdamW algorithm (Loshchilov & Hutter 2019)
# and in what torch stores in `optimizer.state[p]` for each parameter `p`.
# The check cell measures a step of the MLP and of a small GPT and compares.

# %%
def predict_adamw_bytes(model: torch.nn.Module) -> int:
    """Bytes of torch.optim.AdamW's state for `model` (fp32) after one step."""
    params = list(model.parameters())
    # BEGIN SOLUTION
    # HINT: make an AdamW for a small model, take one step, then print {k: (v.shape, v.dtype) for k, v in opt.state[p].items()} for a parameter p; count those bytes for every parameter.
    n = sum(p.numel() for p in params)
    # exp_avg (first moment) and exp_avg_sq (second moment): parameter-shaped fp32
    # tensors; plus `step`, a 0-d fp32 tensor per parameter *tensor* (torch keeps
    # it as a tensor so that capturable/fused implementations can update it on device).
    return 2 * FP32 * n + FP32 * len(params)
    # END SOLUTION

# %%
# CHECK: predict_adamw_bytes matches the optimizer state measured after one step
def _diagnose_adamw(got: int, want: int, n: int, k: int) -> str:
    hints = {
        FP32 * n: "you counted one moment; AdamW keeps two (exp_avg and exp_avg_sq)",
        FP32 * n + FP32 * k: "you counted one moment; AdamW keeps two (exp_avg and exp_avg_sq)",
        2 * FP32 * n: f"you forgot the `step` counter: a 4-byte fp32 tensor per parameter tensor ({k} tensors here)",
        2 * n + k: "you counted elements; the state is fp32, 4 bytes per element",
        2 * n: "you counted elements (fp32 is 4 bytes each) and forgot the per-tensor `step` counters",
        3 * FP32 * n + FP32 * k: "you counted the parameters too; they are not optimizer state",
        3 * FP32 * n: "you counted three parameter-sized tensors; AdamW keeps two (exp_avg, exp_avg_sq)",
    }
    return hints.get(got, f"off by {want - got:+d} bytes: count, for every parameter tensor, "
                          "every tensor in opt.state[p] and its bytes")


for name, model in [("mlp", models.build_model("mlp")), ("gpt-tiny", models.build_model("gpt-tiny"))]:
    if name == "mlp":
        batch = [(x_mlp, y_mlp)]
        _, opt, snaps, _ = train_steps(model, batch, F.cross_entropy)
    else:
        batch = [data.get_batch(0, 2, 16)]
        _, opt, snaps, _ = train_steps(model, batch, models.lm_loss)
    measured = snaps[0]["step"][OPTIMIZER]
    by_hand = sum(t.nbytes for state in opt.state.values() for t in state.values())
    assert measured == by_hand, f"tracker disagrees with opt.state ({measured} vs {by_hand})"
    got = int(predict_adamw_bytes(model))
    n, k = models.count_parameters(model), len(list(model.parameters()))
    assert got == measured, (f"{name}: predicted {got} B, measured {measured} B: "
                             + _diagnose_adamw(got, measured, n, k))
    print(f"{name}: predicted {got} B == measured {measured} B")

# %% [markdown]
# Now the whole MLP step against the hand predictions made further up (with your
# `predict_adamw_bytes` for the optimizer row); the "measured" column is the tracker's.

# %%
# NBVAL_CHECK_OUTPUT
mlp = models.build_model("mlp")
mlp_tracker, mlp_opt, mlp_snaps, mlp_peaks = train_steps(mlp, [(x_mlp, y_mlp)], F.cross_entropy)
predicted_mlp[OPTIMIZER] = predict_adamw_bytes(mlp)
measured_mlp = {
    PARAMETERS: mlp_snaps[0]["forward"][PARAMETERS],
    GRADIENTS: mlp_snaps[0]["backward"][GRADIENTS],
    OPTIMIZER: mlp_snaps[0]["step"][OPTIMIZER],
    ACTIVATIONS: mlp_snaps[0]["forward"][ACTIVATIONS],
}
out = [f"{'':14}{'predicted B':>12}{'measured B':>12}"]
for cat, want in measured_mlp.items():
    out.append(f"{cat:14}{predicted_mlp[cat]:>12}{want:>12}   "
               f"{'==' if predicted_mlp[cat] == want else '!='}")
left = mlp_snaps[0]["backward"][ACTIVATIONS]
out.append(f"activations left after backward: {left} B = the batch (x, y) and the loss, still referenced")
print("\n".join(out))
assert all(predicted_mlp[cat] == want for cat, want in measured_mlp.items())
assert left == x_mlp.nbytes + y_mlp.nbytes + FP32

# %% [markdown]
# Every byte is accounted for. Note the last line: `backward()` frees the graph,
# and with it every saved tensor; what survives is what our own variables still
# reference (the step's batch and the loss).

# %% [markdown]
# ## 2. One GPT training step
#
# Now `gpt-mini` (4 layers, width 256, 4 heads, vocabulary 256) on batches of
# Shakespeare from `data.get_batch`. We run **two** steps, because the first is
# special: AdamW allocates its state only inside the first `step()`. The tracker
# samples the live bytes every time their total moves by 1 % of the peak, plus at
# every snapshot and at the exact peak.

# %%
GPT_NAME, B_GPT, T_GPT = "gpt-mini", 4, 64
gpt = models.build_model(GPT_NAME)
cfg = gpt.config
gpt_batches = [data.get_batch(step, B_GPT, T_GPT) for step in range(2)]
t0 = time.perf_counter()
gpt_tracker, gpt_opt, gpt_snaps, gpt_peaks = train_steps(gpt, gpt_batches, models.lm_loss,
                                                         sample_change=0.01)
print(f"{GPT_NAME}: {cfg}")
print(f"two tracked steps took {time.perf_counter() - t0:.2f} s, {len(gpt_tracker.samples)} samples")
print(gpt_tracker.summary())

# %% [markdown]
# The curve, stacked by category, drawn by `minifsdp.plot.memory` (it marks the
# overall peak). Dotted lines mark our snapshots; the hollow triangle, step 1's peak.

# %%
def mark_snapshots(ax, samples, peaks=()):
    """Dotted lines at the labelled samples (snapshots); a hollow triangle at each
    sample whose total is one of `peaks` (the tracker samples its exact peak)."""
    t0 = samples[0].time                     # plot.memory's time zero, for one series
    top = ax.get_ylim()[1]
    labelled = [s for s in samples if s.label and s.label != "peak"]
    for j, s in enumerate(labelled):
        x = (s.time - t0) * 1e3
        ax.axvline(x, color="k", lw=0.6, ls=":")
        ax.text(x, top * (0.98 - 0.06 * (j % 4)), s.label, fontsize=7, ha="center", va="top",
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    for peak in peaks:
        s = next(s for s in samples if s.total == peak)
        ax.plot((s.time - t0) * 1e3, peak / MiB, "v", mfc="none", mec="k")


fig = plot.memory(gpt_tracker.samples,
                  title=f"{GPT_NAME}: two AdamW steps on batches of {B_GPT} x {T_GPT} tokens")
ax = fig.axes[0]
ax.set_ylim(0, ax.get_ylim()[1] * 1.25)      # room for the snapshot labels
mark_snapshots(ax, gpt_tracker.samples, peaks=[gpt_peaks[0][0]])
ax.set_xlabel("time (ms, the tracker's overhead included)")
fig

# %% [markdown]
# Read the curve from the left: parameters are there from the start. The forward
# pass piles up activations; `backward()` turns them into gradients (it frees each
# layer's saved tensors once that layer's gradient is done), with temporaries on
# top. In step 1, `opt.step()` allocates the optimizer state (its peak is there:
# parameters + gradients + the new state + the update's scratch); `zero_grad` frees
# the gradients. Step 2 repeats step 1's `opt.step()`, and before that its
# activations sit on top of the optimizer state: **every later step peaks at least
# as high as step 1, so size a run's memory from step 2 on**. Per step, the peaks
# the tracker found:

# %%
# NBVAL_CHECK_OUTPUT
out = []
for i, (peak, at_peak) in enumerate(gpt_peaks):
    parts = ", ".join(f"{c} {format_bytes(n)}" for c, n in at_peak.items() if n)
    out.append(f"step {i + 1}: peak {format_bytes(peak)} = {parts}")
print("\n".join(out))
assert gpt_peaks[1][0] >= gpt_peaks[0][0]

# %% [markdown]
# ### Measured vs predicted
#
# `estimate` predicts each term from the config alone (see its docstrings; the
# activation formula reads `Block.forward` op by op, which exercise 2 asks you to
# redo). The table puts the measurements next to them.

# %%
# NBVAL_CHECK_OUTPUT
n_gpt = models.count_parameters(gpt)
n_tensors = len(list(gpt.parameters()))
assert n_gpt == estimate.gpt_param_count(cfg)
act_est = estimate.gpt_activation_bytes(cfg, B_GPT, T_GPT)
s1, s2 = gpt_snaps
rows = [
    ("parameters", s1["forward"][PARAMETERS], estimate.param_bytes(n_gpt),
     "exact"),
    ("gradients", s1["backward"][GRADIENTS], estimate.grad_bytes(n_gpt),
     "exact"),
    ("optimizer (AdamW)", s1["step"][OPTIMIZER], estimate.optimizer_state_bytes(n_gpt, "adamw"),
     f"+ {n_tensors} step counters x 4 B"),
    ("activations", s1["forward"][ACTIVATIONS], act_est["total"],
     "+ the 4-B loss, an output, not saved"),
]
out = [f"{GPT_NAME}: {n_gpt:,} parameters in {n_tensors} tensors; batch {B_GPT} x {T_GPT}",
       f"{'':19}{'measured B':>13}{'estimate B':>13}{'diff B':>8}  why"]
out += [f"{name:19}{got:>13,}{est:>13,}{got - est:>8}  {why}" for name, got, est, why in rows]
print("\n".join(out))
assert rows[0][1] == rows[0][2] and rows[1][1] == rows[1][2]
assert rows[2][1] - rows[2][2] == FP32 * n_tensors
assert rows[3][1] - rows[3][2] == FP32
assert s2["forward"][ACTIVATIONS] == s1["forward"][ACTIVATIONS]   # same shapes, same bytes

# %% [markdown]
# Parameters and gradients are exact. AdamW is 8 bytes per parameter plus one
# 4-byte `step` tensor per parameter tensor (the estimate ignores those few bytes).
# Activations differ by exactly the 4-byte loss, which is the forward's output
# rather than something saved for backward.
#
# And the peak? A naive bound adds everything: parameters + gradients + optimizer
# + activations. The measured step-2 peak is below that bound because gradients
# appear as activations are freed; it sits near *parameters + optimizer +
# activations*, reached early in `backward()`, with its first temporaries on top:

# %%
# NBVAL_CHECK_OUTPUT
model_states = estimate.model_state_bytes_per_device(n_gpt)  # fp32, AdamW, one device
naive = model_states["total"] + act_est["total"]
start_of_backward = model_states["parameters"] + model_states["optimizer"] + act_est["total"]
peak2, at_peak2 = gpt_peaks[1]
print(f"params + grads + optimizer + activations: {format_bytes(naive)}\n"
      f"params + optimizer + activations:         {format_bytes(start_of_backward)}\n"
      f"measured step-2 peak:                     {format_bytes(peak2)}"
      f"  (of which temporaries {format_bytes(at_peak2.get(TEMPORARY, 0))},"
      f" gradients {format_bytes(at_peak2.get(GRADIENTS, 0))})")
assert start_of_backward <= peak2 <= naive + at_peak2.get(TEMPORARY, 0)

# %% [markdown]
# ## 3. How activations grow with batch and sequence length
#
# Model states are fixed by the model. Activations scale with the work: every
# saved tensor has a batch dimension `B`, most have a sequence dimension `T`, and
# one of them, the softmax output of attention (`B x heads x T x T` per layer),
# grows with `T^2`. To see the square we use `gpt-tiny` (width 32, 2 heads, 2
# layers) with a longer context, 512 positions, and measure a forward pass for
# several `B` and `T`. Only the forward pass runs; parameters and buffers are booked
# under their own categories, so `activations` is what autograd saved (plus the
# 4-byte loss, which we subtract).

# %%
def measure_activations(model, batch, seq_len):
    """Bytes saved for backward by one forward + loss of `model` (a GPT), measured."""
    x, y = data.get_batch(0, batch, seq_len)     # made before tracking
    # For B = 1 get_batch returns two views of one token window; own copies, as a
    # copy to the device would make, keep the count independent of that detail.
    x, y = x.clone(), y.clone()
    tracker = MemoryTracker()
    with tracker:
        # Book what exists already, so views of it (w.t() in a Linear, the causal
        # mask's [:T, :T]) are not mistaken for new activations.
        tracker.register(list(model.parameters()), PARAMETERS)
        tracker.register(list(model.buffers()), OTHER)
        tracker.register([x, y], ACTIVATIONS)    # the embedding keeps the ids, the loss the targets
        loss = models.lm_loss(model(x), y)
        saved = tracker.live()[ACTIVATIONS] - loss.nbytes   # the loss is an output, not saved
    return saved


long_gpt = models.build_model("gpt-tiny", block_size=512)
long_cfg = long_gpt.config
T_FIXED, B_FIXED = 128, 2
batches_sweep = [1, 2, 4, 8, 16]
seqs_sweep = [32, 64, 128, 256, 384, 512]
t0 = time.perf_counter()
by_batch = [measure_activations(long_gpt, b, T_FIXED) for b in batches_sweep]
by_seq = [measure_activations(long_gpt, B_FIXED, t) for t in seqs_sweep]
print(f"{len(batches_sweep) + len(seqs_sweep)} forward passes measured in "
      f"{time.perf_counter() - t0:.2f} s")

# %%
def attention_probs_bytes(config, batch, seq_len):
    return config.n_layer * estimate.gpt_layer_activation_breakdown(
        config, batch, seq_len)["attention probs"]


fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
est_b = [estimate.gpt_activation_bytes(long_cfg, b, T_FIXED)["total"] / MiB for b in batches_sweep]
ax_b.plot(batches_sweep, est_b, "-", color="tab:red", label="estimate (total)")
ax_b.plot(batches_sweep, [m / MiB for m in by_batch], "o", color="k", label="measured")
ax_b.set_xlabel(f"batch size B (sequences of T = {T_FIXED} tokens)")
ax_b.set_ylabel("activation bytes saved for backward (MiB)")
ax_b.set_title("linear in B")
ax_b.legend()

t_fine = list(range(16, 513, 16))
est_t = [estimate.gpt_activation_bytes(long_cfg, B_FIXED, t)["total"] / MiB for t in t_fine]
att_t = [attention_probs_bytes(long_cfg, B_FIXED, t) / MiB for t in t_fine]
ax_t.plot(t_fine, est_t, "-", color="tab:red", label="estimate (total)")
ax_t.plot(t_fine, [e - a for e, a in zip(est_t, att_t)], "--", color="tab:blue",
          label="estimate without attention probs (linear in T)")
ax_t.plot(t_fine, att_t, ":", color="tab:purple", label="attention probs B*h*T^2 (all layers)")
ax_t.plot(seqs_sweep, [m / MiB for m in by_seq], "o", color="k", label="measured")
ax_t.set_xlabel(f"sequence length T (batch B = {B_FIXED})")
ax_t.set_ylabel("activation bytes saved for backward (MiB)")
ax_t.set_title("quadratic in T: the attention probabilities")
ax_t.legend(fontsize=8)
fig.suptitle(f"gpt-tiny with block_size 512 (d={long_cfg.n_embd}, h={long_cfg.n_head}, "
             f"L={long_cfg.n_layer}, V={long_cfg.vocab_size}), fp32")
plt.tight_layout()
plt.show()

# %%
# NBVAL_CHECK_OUTPUT
out = [f"{'T':>5}{'measured B':>13}{'estimate B':>13}{'attention probs':>17}"]
for t, m in zip(seqs_sweep, by_seq):
    est = estimate.gpt_activation_bytes(long_cfg, B_FIXED, t)["total"]
    share = attention_probs_bytes(long_cfg, B_FIXED, t) / m
    out.append(f"{t:>5}{m:>13,}{est:>13,}{share:>16.0%}")
    assert m == est, f"T={t}: measured {m} != estimate {est}"
for b, m in zip(batches_sweep, by_batch):
    assert m == estimate.gpt_activation_bytes(long_cfg, b, T_FIXED)["total"], f"B={b}"
out.append("every measured point equals the estimate to the byte")
print("\n".join(out))

# %% [markdown]
# The dots sit on the lines, to the byte. Doubling `B` doubles everything, while
# doubling `T` more than doubles it, because the attention probabilities, the
# column on the right, take a growing share. For a real model the per-token terms
# are large (they scale with the width `d`), so the square takes over only at long
# contexts (Korthikanti et al. 2022 count `34 s b h + 5 a s^2 b` bytes per layer for
# Megatron's fp16 GPT, `h` the width, `a` the heads), which is why FlashAttention,
# recomputing the probabilities instead of storing them, matters so much there.
#
# How does that compare with the model states? For `gpt-mini` (section 2), the
# batch at which the activations alone equal parameters + gradients + AdamW:

# %%
# NBVAL_CHECK_OUTPUT
per_sequence = estimate.gpt_activation_bytes(cfg, 1, cfg.block_size)["total"]
states = estimate.model_state_bytes_per_device(n_gpt)["total"]
print(f"{GPT_NAME}: model states {format_bytes(states)} (16 B per parameter); "
      f"activations {format_bytes(per_sequence)} per sequence of {cfg.block_size} tokens\n"
      f"activations pass the model states at a batch of {states / per_sequence:.1f} sequences")

# %% [markdown]
# ## 4. Exercise 2: predict the activations before running
#
# Write `predict_activation_bytes(config, batch, seq_len)`: the bytes autograd keeps
# after `lm_loss(model(x), y)` for a `models.GPT` with this config, fp32, to the
# byte, **without** calling `minifsdp.estimate`. Read the model's code below, op
# by op, and for each op ask: what does its backward need? (The tracked total
# also includes the token ids `x` and targets `y`, int64; not the loss itself.)

# %%
for fn in (models.GPT.forward, models.GPT.embed, models.GPT.unembed, models.Block.forward,
           models.CausalSelfAttention.forward, models.FeedForward.forward, models.lm_loss):
    print(inspect.getsource(fn))

# %%
def predict_activation_bytes(config: models.GPTConfig, batch: int, seq_len: int) -> int:
    """Bytes saved for backward by one forward + lm_loss of models.GPT(config), fp32."""
    B, T = batch, seq_len
    d, h, L, V = config.n_embd, config.n_head, config.n_layer, config.vocab_size
    # BEGIN SOLUTION
    # HINT: go op by op through the code printed above and ask which tensors each op's backward needs; count each distinct tensor once (ids are int64, 8 B; the rest fp32, 4 B). The loss keeps its log-softmax output (B*T*V), the targets and one scalar.
    btd = B * T * d
    per_layer = (
        btd + 2 * B * T      # ln_1: input, mean and rstd per row
        + btd                # c_attn: its input (ln_1's output)
        + 3 * btd            # q, k, v: matmul keeps contiguous copies of its operands
        + B * h * T * T      # softmax: its output, the attention probabilities
        + btd                # attention c_proj: its input
        + btd + 2 * B * T    # ln_2
        + btd                # c_fc: its input
        + 4 * btd            # GELU: its input (4d wide)
        + 4 * btd            # mlp c_proj: its input, GELU's output
    ) * FP32
    embedding = INT64 * (B * T + T)          # token ids and position ids
    final = FP32 * (btd + 2 * B * T + btd)   # ln_f (input, stats), head (input)
    loss = FP32 * (B * T * V + 1) + INT64 * B * T   # log-probs, total weight, targets
    return L * per_layer + embedding + final + loss
    # END SOLUTION

# %%
# CHECK: predict_activation_bytes against measured forward passes
def _check_activation_prediction(predict) -> list[str]:
    """Compare `predict` with measurements; explain any difference in words."""
    try:
        source = inspect.getsource(predict)
    except (OSError, TypeError):   # defined where inspect cannot read it
        source = ""
    if "gpt_activation_bytes" in source:
        return ["write the formula yourself rather than calling estimate.gpt_activation_bytes"]
    cfg_a = models.build_model("gpt-tiny", block_size=128, device="meta").config
    cfg_b = models.build_model("gpt-tiny", block_size=128, device="meta",
                               n_layer=3, n_head=4, n_embd=48).config
    # Doubling B, doubling T, and other sizes: each mistake leaves its own signature.
    cases = [(cfg_a, 2, 32), (cfg_a, 4, 32), (cfg_a, 2, 64), (cfg_b, 2, 32)]
    want, got = {}, {}
    for config, b, t in cases:
        want[config, b, t] = measure_activations(models.GPT(config), b, t)
        got[config, b, t] = int(predict(config, b, t))
    diffs = {k: want[k] - got[k] for k in cases}
    if not any(diffs.values()):
        return []

    def btd(c, b, t, k=1):  # k fp32 tensors of shape [B, T, d] in every layer
        return c.n_layer * k * FP32 * b * t * c.n_embd
    terms = {  # what a single slip usually is, as a function of (config, B, T)
        "the attention probabilities (softmax output, B*h*T*T per layer)":
            lambda c, b, t: c.n_layer * FP32 * b * c.n_head * t * t,
        "the loss's log-softmax output (B*T*V)": lambda c, b, t: FP32 * b * t * c.vocab_size,
        "the int64 token ids or targets (B*T*8 bytes)": lambda c, b, t: INT64 * b * t,
        "the position ids (T int64)": lambda c, b, t: INT64 * t,
        "the scalar total weight that nll_loss keeps (4 B)": lambda c, b, t: FP32,
        "q, k, v (3*B*T*d per layer: matmul keeps contiguous copies)":
            lambda c, b, t: btd(c, b, t, 3),
        "a 4d-wide MLP tensor per layer (GELU keeps its input, and mlp c_proj its own input, "
        "GELU's output: two different tensors)": lambda c, b, t: btd(c, b, t, 4),
        "the LayerNorm mean and rstd (2*B*T per LayerNorm: 2 per layer, plus ln_f)":
            lambda c, b, t: (2 * c.n_layer + 1) * 2 * FP32 * b * t,
        "ln_f's input and the head's input (2*B*T*d)":
            lambda c, b, t: 2 * FP32 * b * t * c.n_embd,
    }
    for k in (1, 2, 3, 5):
        terms[f"{k} tensor(s) of B*T*d per layer (the inputs of ln_1, c_attn, attention c_proj, "
              "ln_2 and c_fc are one each)"] = lambda c, b, t, k=k: btd(c, b, t, k)
    first = next(k for k in cases if diffs[k])
    c, b, t = first
    problems = [f"at B={b}, T={t}, n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd} "
                f"you predicted {got[first]:,} bytes, the measurement is {want[first]:,}"]
    for name, term in terms.items():   # a term that explains the difference in every case
        if all(diffs[k] == term(*k) for k in cases):
            problems.append(f"you are missing exactly {name}")
        elif all(diffs[k] == -term(*k) for k in cases):
            problems.append(f"you counted once too often {name}")
    if len(problems) > 1:
        return problems
    if all(got[k] and 3.3 < want[k] / got[k] < 4.2 for k in cases):
        return problems + ["you seem to count elements: multiply by the bytes per element "
                           "(4 for fp32 activations, 8 for int64 token ids)"]
    e0, eb, et = diffs[cfg_a, 2, 32], diffs[cfg_a, 4, 32], diffs[cfg_a, 2, 64]
    if not (e0 or eb or et):
        return problems + ["right for gpt-tiny but wrong with other n_layer / n_head / n_embd: "
                           "use the config's sizes instead of fixed numbers"]
    if e0:
        problems.append(f"doubling B multiplies your error by {eb / e0:.2f}, doubling T by {et / e0:.2f}")
        if abs(eb / e0 - 1) < 0.05 and abs(et / e0 - 1) < 0.05:
            problems.append("a constant error, whatever B and T: a stray constant or a scalar")
        elif abs(et / e0 - 4) < 0.3:
            problems.append("an error quadratic in T: the attention probabilities B*h*T*T")
        elif 2.2 < et / e0 < 3.8:
            problems.append("part of the error grows like T*T: check the attention probabilities too")
        elif abs(eb / e0 - 1) < 0.05:
            problems.append("the error does not depend on B: something of size T only (position ids?)")
        elif abs(eb / e0 - 2) < 0.05:
            problems.append("the error grows like B*T: a per-token tensor; list each op's saved inputs")
    return problems + ["go through Block.forward op by op again and write down each saved tensor's shape"]


problems = _check_activation_prediction(predict_activation_bytes)
assert not problems, "predict_activation_bytes disagrees with the measurement: " + "; ".join(problems)
print("predict_activation_bytes matches the measurement to the byte in every case")

# %% [markdown]
# ## 5. Teaser: what data parallelism replicates, and what ZeRO divides
#
# Split the same global batch over 2 processes (data parallelism: each rank runs
# the whole model on half the sequences, then the gradients are averaged with an
# all-reduce). Each rank measures its own step and returns its numbers; nothing is
# printed in the workers.

# %%
def data_parallel_memory(global_batch, seq_len):
    """One AdamW step of gpt-mini on this rank's share of the batch; its memory."""
    from minifsdp import comm, dist
    model = models.build_model("gpt-mini").to(dist.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data.get_batch(0, global_batch, seq_len, rank=dist.rank(), world_size=dist.world_size())
    x, y = x.to(dist.device()), y.to(dist.device())
    tracker = MemoryTracker()
    tracker.track_model(model)
    with tracker:
        tracker.register([x, y], ACTIVATIONS)
        loss = models.lm_loss(model(x), y)
        forward = tracker.snapshot("forward")
        loss.backward()
        for p in model.parameters():            # average the gradients over ranks
            comm.all_reduce(p.grad)
            p.grad /= dist.world_size()
        opt.step()
        step = tracker.snapshot("step")
    tracker.close()
    return {"forward": forward, "step": step, "loss": loss.item()}


t0 = time.perf_counter()
# backend="gloo" keeps the ranks on the CPU, like every number above, even on a GPU machine.
dp = minifsdp.launch(data_parallel_memory, 2, B_GPT, T_GPT, backend="gloo", timeout=120)
print(f"2 ranks ran in {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
x0, y0 = gpt_batches[0]
with torch.no_grad():   # a fresh gpt-mini (gpt above has taken two steps) on the whole batch
    single_loss = models.lm_loss(models.build_model(GPT_NAME)(x0), y0).item()
single = {"parameters": s1["forward"][PARAMETERS], "gradients": s1["step"][GRADIENTS],
          "optimizer": s1["step"][OPTIMIZER], "activations": s1["forward"][ACTIVATIONS]}
ranks = [{"parameters": r["forward"][PARAMETERS], "gradients": r["step"][GRADIENTS],
          "optimizer": r["step"][OPTIMIZER], "activations": r["forward"][ACTIVATIONS]} for r in dp]
mean_loss = sum(r["loss"] for r in dp) / len(dp)
out = [f"{'':13}{'1 process, B=' + str(B_GPT):>18}"
       + "".join(f"{f'rank {i}, B={B_GPT // 2}':>16}" for i in range(2))]
for cat in single:
    out.append(f"{cat:13}{format_bytes(single[cat]):>18}"
               + "".join(f"{format_bytes(r[cat]):>16}" for r in ranks))
out.append(f"loss: mean over the 2 ranks {mean_loss:.5f}, one process on the whole batch {single_loss:.5f}")
print("\n".join(out))
for r in ranks:
    for cat in ("parameters", "gradients", "optimizer"):
        assert r[cat] == single[cat], cat   # replicated, byte for byte
assert ranks[0]["activations"] == ranks[1]["activations"] < single["activations"]
assert abs(mean_loss - single_loss) < 1e-5, "the two halves of the batch should average to the whole"

# %% [markdown]
# Data parallelism halves each rank's activations (half the sequences), but every
# rank holds a full copy of the parameters, gradients and optimizer state: the
# model states do not shrink at all, however many ranks you add. ZeRO (Rajbhandari
# et al. 2020) removes that redundancy in stages: stage 1 shards the optimizer
# state over the `N` ranks, stage 2 the gradients too, stage 3 (= FSDP
# `FULL_SHARD`) the parameters as well. The paper's example is a 7.5B-parameter
# model on 64 GPUs with mixed-precision Adam (2-byte parameters and gradients,
# 12 bytes of fp32 optimizer state per parameter):

# %%
# NBVAL_CHECK_OUTPUT
PSI, N = 7_500_000_000, 64
out = [f"{'stage':24}{'params GB':>10}{'grads GB':>10}{'optim GB':>10}{'total GB':>10}"]
zero_rows = {}
for stage, name in [(0, "0 (DDP)"), (1, "1 (optimizer)"), (2, "2 (+gradients)"), (3, "3 (+params, FSDP)")]:
    m = estimate.model_state_bytes_per_device(PSI, N, stage, mixed_precision=True, padding=False)
    zero_rows[name] = m
    out.append(f"{name:24}" + "".join(f"{m[k] / 1e9:>10.1f}"
                                      for k in ("parameters", "gradients", "optimizer", "total")))
print("\n".join(out))

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
left = [0.0] * len(zero_rows)
for cat in ("parameters", "gradients", "optimizer"):
    widths = [m[cat] / 1e9 for m in zero_rows.values()]
    ax.barh(list(zero_rows), widths, left=left, color=plot.color_for(cat), label=cat)
    left = [lo + w for lo, w in zip(left, widths)]
ax.invert_yaxis()
ax.set_xlabel("model-state bytes per GPU (GB = 1e9 B)")
ax.set_ylabel("ZeRO stage")
ax.set_title(f"{PSI / 1e9:.1f}B parameters, {N} GPUs, mixed-precision Adam (estimate)")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Lab 03 builds stages 1 and 2 and measures them with this same tracker; lab 04
# builds stage 3. What they cannot divide is the activations: those need smaller
# per-device batches, recomputation (lab 06) or splitting the layers (labs 07, 08).
#
# **Summary.** Parameters, gradients and AdamW state are fixed by the model:
# 4 + 4 + 8 bytes per parameter in fp32 (plus 4 bytes per tensor for AdamW's step
# counters). Activations are what each op's backward needs, linear in the batch,
# linear in the sequence except the attention probabilities, quadratic; past the
# batch size section 3 computed, they outweigh all the model states. Size memory
# from step 2 on: here the peak came early in step 2's backward pass, most
# activations still alive on top of the optimizer state; with small batches it is
# the optimizer step instead (parameters + gradients + state + the update's scratch).

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
