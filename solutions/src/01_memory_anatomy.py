# Lab 01 - memory anatomy. Source of solutions/01_memory_anatomy.ipynb and
# labs/01_memory_anatomy.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 01 - Memory anatomy: where training memory goes
#
# A device holds, at once, parameters, gradients, optimizer state, activations (what
# the forward keeps for backward) and temporaries. Before sharding them (labs 03, 04),
# we *predict* each term and *measure* it, to the byte.
#
# **You will be able to**: predict a model's parameter, gradient and AdamW bytes from
# its shapes; find what an op keeps for backward; predict a transformer block's and a
# GPT's activations; read a training step's memory curve.
#
# **Prerequisites**: lab 00 (last section only). **Time**: about 60 minutes of work;
# the cells compute for about 1 minute on a laptop or a GPU VM (the lab measures on
# the CPU, where every count is exact).
#
# **Symbols**: Ψ = the number of parameters; bytes are k·Ψ (fp32 parameters: 4Ψ).
# B batch, T sequence, d width, h heads, L layers, V vocabulary.

# %% [markdown]
# | category | what it is | grows with |
# |---|---|---|
# | **parameters** | the weights | model size |
# | **gradients** | one per weight, filled by `backward()` | model size |
# | **optimizer state** | AdamW's running moments | model size |
# | **activations** | what the forward pass keeps for the backward pass | batch × sequence × layers |
# | **temporaries** | scratch of the backward pass, freed within it | the largest layer |
#
# **Tools**: `minifsdp.memory.MemoryTracker` counts the bytes of every live tensor by
# category, op by op (CPU has no allocator counter, so it watches every op);
# `minifsdp.estimate` holds the library's formulas, printed beside your predictions
# after each check.

# %%
import inspect
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import minifsdp
from minifsdp import data, estimate, models, plot
from minifsdp.estimate import format_bytes
from minifsdp.labcheck import lab01 as check
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
# ### A toy MLP, and its model states
#
# `models.build_model("mlp")` is `Linear(8,16) -> ReLU -> Linear(16,16) -> ReLU -> Linear(16,4)`.
# A `Linear(i, o)` has an `o x i` weight and `o` biases. Its parameter shapes:

# %%
mlp = models.build_model("mlp")
print(mlp)
mlp_shapes = {name: tuple(p.shape) for name, p in mlp.named_parameters()}
for name, shape in mlp_shapes.items():
    print(f"  {name:18} {shape}")

# %% [markdown]
# ### Exercise 1: model states from the shapes alone
#
# **Goal**: `predict_model_states(shapes)`, given `{parameter name: shape}` of an fp32
# model trained with `torch.optim.AdamW`, returns the bytes of its **parameters**, its
# **gradients** (after `backward()`) and AdamW's **optimizer state** (after its first
# `step()`). **Target**: a real AdamW step of three models, measured by the check, to
# the byte. Everything you need is in the AdamW algorithm (Loshchilov & Hutter 2019)
# and in one detail of torch's implementation, which keeps a `step` count per
# parameter *tensor*. Predict; don't step an optimizer.
#
# Then `predict_gpt_params(config)`: Ψ of a GPT **from its config alone**, before any
# model exists. **Target**: the built model's count, for six configs (biases or not:
# `config.bias`; tied embeddings or not: `config.tie_embeddings`). The cell below
# prints gpt-tiny's shapes, where the config's sizes reappear.
#
# `check.hint("predict_model_states")` prints an exercise's next hint (idea first,
# then the layout; never the code).

# %%
tiny = models.build_model("gpt-tiny")
print(tiny.config)
for name, p in tiny.named_parameters():
    if not name.startswith("blocks.") or name.startswith("blocks.0."):
        print(f"  {name:28} {tuple(p.shape)}")
print("  (blocks.1 ... have the same shapes as blocks.0)")

# %%
def predict_model_states(shapes: dict) -> dict:
    """{"parameters", "gradients", "optimizer"}: bytes of an fp32 model with these parameter shapes, AdamW."""
    # BEGIN SOLUTION
    # HINT: bytes per category from Ψ and the tensors. More: check.hint('predict_model_states')
    psi = sum(math.prod(shape) for shape in shapes.values())
    return {
        "parameters": FP32 * psi,
        "gradients": FP32 * psi,                            # one fp32 gradient per weight
        "optimizer": 2 * FP32 * psi + FP32 * len(shapes),   # exp_avg, exp_avg_sq; a step per tensor
    }
    # END SOLUTION


def predict_gpt_params(config: models.GPTConfig) -> int:
    """Ψ of models.GPT(config), from the config alone."""
    d, V, L = config.n_embd, config.vocab_size, config.n_layer
    # BEGIN SOLUTION
    # HINT: add up the shapes printed above. More: check.hint('predict_gpt_params')
    b = 1 if config.bias else 0
    layer_norm = d + b * d                                   # weight, bias
    attention = (d * 3 * d + b * 3 * d) + (d * d + b * d)    # c_attn, c_proj
    mlp = (d * 4 * d + b * 4 * d) + (4 * d * d + b * d)      # c_fc, c_proj
    block = 2 * layer_norm + attention + mlp
    head = 0 if config.tie_embeddings else V * d
    return V * d + config.block_size * d + L * block + layer_norm + head
    # END SOLUTION


print("the MLP:", predict_model_states(mlp_shapes))
print("gpt-tiny: Ψ =", predict_gpt_params(tiny.config), "parameters")

# %%
# CHECK: your bytes against a real AdamW step of three models; your Ψ against built GPTs of six configs
check.model_states(predict_model_states, predict_gpt_params)

# %% [markdown]
# So in fp32 with AdamW a model's states take 4Ψ + 4Ψ + 8Ψ = **16Ψ bytes** (plus a
# few bytes per tensor), however big the batch.
#
# ### What does an op keep for backward?
#
# Activations are different: they are whatever each op's backward *formula* needs.
# `y = x @ W^T` needs `x` to form the weight gradient `grad^T x`; `relu` needs to
# know where its input was positive, which its output tells as well. You do not have
# to guess: PyTorch calls a *pack hook* for every tensor an op saves for backward
# (`torch.autograd.graph.saved_tensors_hooks`). The probe below runs one op and lists
# what it saved: shape, dtype, and whether it is a parameter (already counted above)
# or the very same tensor as something saved before (stored once, counted once).

# %%
def saved_by(fn, *inputs):
    """Run fn(*inputs) and list the tensors autograd saved for its backward."""
    params = {p.data_ptr() for x in (fn, *inputs) if isinstance(x, torch.nn.Module) for p in x.parameters()}
    seen, rows = set(), []

    def pack(t):
        key = (t.data_ptr(), tuple(t.shape))
        kind = ("parameter" if t.data_ptr() in params else
                "same tensor as above" if key in seen else
                "an input" if any(t.data_ptr() == x.data_ptr() for x in inputs if isinstance(x, torch.Tensor))
                else "new")
        seen.add(key)
        rows.append(f"{str(tuple(t.shape)):>16} {str(t.dtype).replace('torch.', ''):>8}  {kind}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return rows


B_, T_, d_, h_ = 2, 5, 8, 2
x3 = torch.randn(B_, T_, d_, requires_grad=True)
x4 = torch.randn(B_, h_, T_, T_, requires_grad=True)
probes = {
    "Linear(8, 16)(x)": (torch.nn.Linear(d_, 16), x3),
    "relu(x)": (F.relu, x3),
    "gelu(x)": (F.gelu, x3),
    "LayerNorm(8)(x)": (torch.nn.LayerNorm(d_), x3),
    "softmax(x, -1)": (lambda x: F.softmax(x, dim=-1), x4),
    "q @ k.transpose (4-D)": (lambda q: q @ q.transpose(-2, -1), x4),
    "x * 0.5, x + x": (lambda x: x * 0.5 + x, x3),
    "cross_entropy(logits, labels)": (F.cross_entropy, torch.randn(6, 4, requires_grad=True),
                                      torch.randint(0, 4, (6,))),
}
for name, (fn, *args) in probes.items():
    rows = saved_by(fn, *args)
    print(f"{name}  (inputs {[tuple(a.shape) for a in args]})")
    print("\n".join(rows) if rows else "        nothing")

# %% [markdown]
# Read it as rules: a `Linear` keeps its input (and its weight, a parameter);
# `relu` and `softmax` keep their output; `gelu` its input; `LayerNorm` its input and
# two numbers per row (mean and 1/std, shape `[B, T, 1]`); a batched matmul keeps
# both operands (as contiguous copies when they are views); scaling and adding keep
# nothing; `cross_entropy` keeps its log-softmax output, the labels, and one scalar.
# When the tensor one op saves is the tensor the next op saves too (relu's output is
# the next `Linear`'s input), it is stored once.

# %% [markdown]
# ### Exercise 2: the MLP's activations
#
# **Goal**: `predict_mlp_activation_bytes(B)` returns the bytes the MLP's forward
# pass and `F.cross_entropy` keep for backward on a batch of `B` samples (inputs
# `[B, 8]` fp32, labels `[B]` int64), counting the batch itself (the first layer keeps
# `x`) and not the loss value (an output, not something saved). **Target**: the
# bytes the check measures for B = 32, 7 and 1, exactly; if you are off, it says how
# many bytes per sample (or in all) are missing.

# %%
def predict_mlp_activation_bytes(B: int) -> int:
    """Bytes kept for backward by mlp(x) and cross_entropy on a batch of B (fp32 inputs, int64 labels)."""
    # BEGIN SOLUTION
    # HINT: what each op's backward needs, shared tensors once. More: check.hint('predict_mlp_activation_bytes')
    x = FP32 * B * 8                      # kept by the first Linear
    relu_1 = FP32 * B * 16                # its output, also the second Linear's input: stored once
    relu_2 = FP32 * B * 16                # the same for the second ReLU and the third Linear
    log_probs = FP32 * B * 4              # cross_entropy's log-softmax output
    labels = INT64 * B
    total_weight = FP32                   # the scalar nll_loss divides by
    return x + relu_1 + relu_2 + log_probs + labels + total_weight
    # END SOLUTION


# %%
# CHECK: your formula against the bytes measured for B = 32, 7 and 1
check.mlp_activations(predict_mlp_activation_bytes)

# %% [markdown]
# ## 2. A transformer block
#
# A GPT is L copies of one `Block` between an embedding and a loss. Here is its code,
# op by op; with the probe's rules you can say what each line keeps.

# %%
for fn in (models.Block.forward, models.CausalSelfAttention.forward, models.causal_attention,
           models.FeedForward.forward):
    print(inspect.getsource(fn))

# %% [markdown]
# ### Exercise 3: one block's activations
#
# **Goal**: `predict_block_activation_bytes(config, B, T)` returns the bytes one
# `Block` keeps for backward on an fp32 input `[B, T, d]`, **its input included** (the
# block's first LayerNorm keeps it; in a GPT that is the residual stream), its output
# not (the next block keeps that). `config.n_embd` is d, `config.n_head` is h. Run the
# probe on any op you are unsure of. **Target**: a measured `Block` at six shapes,
# exactly; if you are off, the check says what *kind* of tensor is missing (per token,
# per token and feature, per pair of positions).

# %%
def predict_block_activation_bytes(config: models.GPTConfig, B: int, T: int) -> int:
    """Bytes saved for backward by models.Block(config) on an fp32 [B, T, d] input (input included)."""
    d, h = config.n_embd, config.n_head
    # BEGIN SOLUTION
    # HINT: walk Block.forward op by op. More: check.hint('predict_block_activation_bytes')
    btd = B * T * d
    saved = {                             # fp32 values each op keeps for its backward
        "ln_1 input": btd,                # the block's input
        "ln_1 mean, rstd": 2 * B * T,
        "c_attn input": btd,              # ln_1's output
        "q, k, v": 3 * btd,               # contiguous copies kept by the two matmuls
        "softmax output": B * h * T * T,  # the attention probabilities
        "attn c_proj input": btd,
        "ln_2 input": btd,                # the first residual sum
        "ln_2 mean, rstd": 2 * B * T,
        "c_fc input": btd,
        "gelu input": 4 * btd,
        "mlp c_proj input": 4 * btd,      # GELU's output: another 4d-wide tensor
    }
    return FP32 * sum(saved.values())
    # END SOLUTION


# %%
# CHECK: your formula against a measured Block at six shapes (B, T, d and h varied one at a time)
check.block_activations(predict_block_activation_bytes)

# %% [markdown]
# ### Exercise 4: the whole GPT
#
# **Goal**: `predict_gpt_activation_bytes(config, B, T)` returns the bytes
# `lm_loss(model(x), y)` of a `models.GPT` keeps for backward, using your block
# formula L times. What is left is outside the blocks: read `GPT.embed`, `GPT.unembed`
# and `lm_loss` below (the token ids `x` and targets `y` are int64 and count; the loss
# value does not). **Target**: measured forward passes with B, T, L and V varied,
# exactly.

# %%
for fn in (models.GPT.forward, models.GPT.embed, models.GPT.unembed, models.lm_loss):
    print(inspect.getsource(fn))

# %%
def predict_gpt_activation_bytes(config: models.GPTConfig, B: int, T: int) -> int:
    """Bytes saved for backward by lm_loss(models.GPT(config)(x), y), x and y int64 [B, T]."""
    d, V = config.n_embd, config.vocab_size
    blocks = config.n_layer * predict_block_activation_bytes(config, B, T)
    # BEGIN SOLUTION
    # HINT: L blocks plus what is kept outside them. More: check.hint('predict_gpt_activation_bytes')
    outside = {
        "token ids": INT64 * B * T,
        "position ids": INT64 * T,
        "ln_f input, mean, rstd": FP32 * (B * T * d + 2 * B * T),
        "head input": FP32 * B * T * d,
        "loss: log-probs, total weight": FP32 * (B * T * V + 1),
        "targets": INT64 * B * T,
    }
    return blocks + sum(outside.values())
    # END SOLUTION


# %%
# CHECK: your whole-model formula against measured forward passes (B, T, L and V varied)
check.gpt_activations(predict_gpt_activation_bytes, predict_block_activation_bytes)

# %% [markdown]
# ## 3. One GPT training step
#
# Now `gpt-mini` (4 layers, width 256, 4 heads, vocabulary 256) on batches of
# Shakespeare from `data.get_batch`. We run **two** steps, because the first is
# special: AdamW allocates its state only inside the first `step()`. The tracker
# samples the live bytes every time their total moves by 1 % of the peak, plus at
# every snapshot and at the exact peak.
#
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


# FIGURE
fig = plot.memory(gpt_tracker.samples,
                  title=f"{GPT_NAME}: two AdamW steps on batches of {B_GPT} x {T_GPT} tokens")
ax = fig.axes[0]
ax.set_ylim(0, ax.get_ylim()[1] * 1.25)      # room for the snapshot labels
mark_snapshots(ax, gpt_tracker.samples, peaks=[gpt_peaks[0][0]])
ax.set_xlabel("time (ms, the tracker's overhead included)")
fig

# %% [markdown]
# Takeaway: the step's peak is not the sum of the categories; which of them are alive
# together decides it.
#
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
# `estimate` predicts each term from the config alone (see its docstrings; its
# activation formula is the one you wrote in exercises 3 and 4). The table puts the
# measurements next to them.

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
    ("optimizer (AdamW)", s1["step"][OPTIMIZER], estimate.optimizer_state_bytes_for(n_gpt, "adamw"),
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
# ## 4. How activations grow with batch and sequence length
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
# FIGURE
def attention_probs_bytes(config, batch, seq_len):
    return config.n_layer * estimate.gpt_layer_activation_breakdown(
        config, batch, seq_len)["attention probs"]


fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(10.5, 4))
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

# %% [markdown]
# Takeaway: activations grow linearly with the batch B, and faster than linearly with
# the sequence length T, because the attention probabilities grow with T².

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
# How does that compare with the model states? For `gpt-mini` (section 3), the
# batch at which the activations alone equal parameters + gradients + AdamW:

# %%
# NBVAL_CHECK_OUTPUT
per_sequence = estimate.gpt_activation_bytes(cfg, 1, cfg.block_size)["total"]
states = estimate.model_state_bytes_per_device(n_gpt)["total"]
print(f"{GPT_NAME}: model states {format_bytes(states)} (16 B per parameter); "
      f"activations {format_bytes(per_sequence)} per sequence of {cfg.block_size} tokens\n"
      f"activations pass the model states at a batch of {states / per_sequence:.1f} sequences")

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
# model (Ψ = 7.5·10⁹ parameters) on 64 GPUs with mixed-precision Adam: per parameter,
# 2 bytes of fp16 weight, 2 of gradient and 12 of fp32 optimizer state, (2 + 2 + 12)·Ψ
# = 16Ψ bytes in all:

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
# FIGURE
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
# Takeaway: each ZeRO stage divides one more category by N = 64, taking the model
# states from 120 GB per GPU (DDP) to 31.4, 16.6 and 1.9 GB; stage 1 alone removes
# the largest, the optimizer state (12 of the 16 bytes per parameter).

# %% [markdown]
# Lab 03 builds stages 1 and 2 and measures them with this same tracker; lab 04
# builds stage 3. What they cannot divide is the activations: those need smaller
# per-device batches, recomputing them in backward, or splitting the layers across devices.
#
# **Summary.** Parameters, gradients and AdamW state are fixed by the model:
# 4 + 4 + 8 bytes per parameter in fp32 (plus 4 bytes per tensor for AdamW's step
# counters). Activations are what each op's backward needs, linear in the batch,
# linear in the sequence except the attention probabilities, quadratic; past the
# batch size section 4 computed, they outweigh all the model states. Size memory
# from step 2 on: here the peak came early in step 2's backward pass, most
# activations still alive on top of the optimizer state; with small batches it is
# the optimizer step instead (parameters + gradients + state + the update's scratch).

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")

