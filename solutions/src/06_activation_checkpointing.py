# Lab 06 - activation checkpointing. Source of solutions/06_activation_checkpointing.ipynb and
# labs/06_activation_checkpointing.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 06 - Activation checkpointing: trading compute for memory
#
# FSDP (lab 04) divides parameters, gradients and optimizer state by the number of
# ranks, but not the **activations** the forward keeps for the backward (they grow with
# batch × sequence × layers). Activation checkpointing (Chen et al. 2016) keeps only
# each block's input and runs its forward **again** in backward.
#
# **You will be able to**: write checkpointing the two ways PyTorch does (an autograd
# Function; saved-tensor hooks) with exact gradients, dropout included; write a
# *selective* policy that recomputes only cheap ops; predict to the byte the
# activations left with k of L blocks checkpointed; use it under FSDP.
#
# **Prerequisites**: lab 01 (the memory tracker, what autograd saves) and lab 04 (FSDP).
#
# **Time**: about 60 minutes of work. The cells compute for about 30 seconds on a
# laptop and under a minute on a GPU VM (only section 7 uses the GPUs).

# %%
import itertools
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import display
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp import data, dist, estimate, models, plot
from minifsdp.checkpoint import checkpoint, checkpoint_wrapper, selective_checkpoint_wrapper
from minifsdp.estimate import format_bytes
from minifsdp.labcheck import lab06 as check
from minifsdp.memory import ACTIVATIONS, MemoryTracker
from minifsdp.train import TrainConfig, train

torch.set_num_threads(1)  # small tensors: one thread is as fast, and steady when cores are shared
notebook_start = time.perf_counter()
FP32 = 4
CONFIG = models.MODEL_PRESETS["gpt-mini"]  # L=4 blocks, d=256, h=4, T up to 64
BATCH, SEQ = 4, 64
x_batch, y_batch = data.get_batch(0, BATCH, SEQ)


def measure_step(model, batch=(x_batch, y_batch), seed=1):
    """One forward+backward under a MemoryTracker: activations saved for backward (what is alive after the
    forward, less the 4-byte loss value itself), the peak, seconds, and the tracker."""
    tracker = MemoryTracker()
    tracker.track_model(model)
    x, y = batch
    with tracker:
        torch.manual_seed(seed)
        start = time.perf_counter()
        loss = models.lm_loss(model(x.clone()), y.clone())
        activations = tracker.snapshot("forward")[ACTIVATIONS] - loss.nbytes  # saved for backward
        loss.backward()
        seconds = time.perf_counter() - start
        tracker.snapshot("backward")
    tracker.close()
    return activations, tracker.peak_total, seconds, tracker

# %% [markdown]
# ## 1. What a block keeps, and what checkpointing gives back
#
# `estimate.gpt_layer_activation_breakdown` lists, tensor by tensor, what one GPT block
# saves for its backward (lab 01 derived it). A checkpointed block saves none of it:
# it keeps its input, B·T·d values, and rebuilds the rest when backward reaches it.
#
# Symbols: B = batch (sequences), T = sequence length, d = model width, h = heads,
# L = blocks. Sizes are counted in fp32 values: B·T·d values are 4·B·T·d bytes.

# %%
breakdown = estimate.gpt_layer_activation_breakdown(CONFIG, BATCH, SEQ)
per_block = sum(breakdown.values())
kept_input = BATCH * SEQ * CONFIG.n_embd * FP32
for name, n in breakdown.items():
    print(f"  {name:<20} {format_bytes(n):>11}")
print(f"one block saves {format_bytes(per_block)}; checkpointed it keeps its input, {format_bytes(kept_input)} "
      f"({kept_input / per_block:.1%})")

# %% [markdown]
# ## 2. Exercise 1: reentrant checkpoint, an autograd Function
#
# The original recipe, and `torch.utils.checkpoint(..., use_reentrant=True)`: the whole
# block becomes **one node** of the autograd graph. Its forward runs the block without
# recording anything and keeps only the inputs; its backward builds the block's graph
# again and backpropagates through it, a backward inside the backward that "re-enters"
# the autograd engine.
#
# **Goal**: `ReentrantCheckpoint.apply(run, x)` returns `run(x)`. `forward(ctx, run,
# *inputs)` returns the block's output; `backward(ctx, grad_output)` fills the block's
# parameter gradients and returns one gradient per argument of `forward` (`None` for `run`).
#
# **Target**: gradients bit-identical to no checkpointing with dropout 0.1 (the
# recompute must draw the forward's masks), and after the forward no more activations
# than the library's checkpointing keeps: the blocks' inputs. The check runs on the CPU.
#
# Stuck? `check.hint("ReentrantCheckpoint")` prints the next hint (idea first, never
# the code); each exercise names its own.

# %%
class ReentrantCheckpoint(torch.autograd.Function):
    """``ReentrantCheckpoint.apply(run, x)``: run(x), its activations recomputed in backward."""

    @staticmethod
    def forward(ctx, run, *inputs):
        # BEGIN SOLUTION
        # HINT: keep what backward needs, save nothing inside the block; stuck? check.hint("ReentrantCheckpoint")
        ctx.run = run
        ctx.rng_state = torch.get_rng_state()
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run(*inputs)
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_output):
        # BEGIN SOLUTION
        # HINT: rebuild the block's graph, backpropagate through it; stuck? check.hint("ReentrantCheckpoint")
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng_state)
            output = ctx.run(*inputs)
        torch.autograd.backward(output, grad_output)
        return (None, *[x.grad for x in inputs])
        # END SOLUTION

# %%
# CHECK: bit-identical gradients with dropout 0.1, and only the blocks' inputs kept after the forward
check.reentrant(ReentrantCheckpoint)

# %% [markdown]
# ## 3. Exercise 2: non-reentrant checkpoint, saved-tensor hooks
#
# `use_reentrant=False`, the implementation PyTorch recommends (torch 2.13 still picks
# the reentrant one when you pass nothing, and warns). The block's ops stay ordinary
# nodes of the one graph; only **what they save** changes. Inside
# `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`, each tensor an op saves for
# backward goes through `pack`, and autograd stores what `pack` returns; in backward,
# `unpack` of that must give the tensor back.
#
# **Goal**: `checkpoint_with_hooks(run, *inputs)` returns `run(*inputs)`; the forward
# keeps none of what the block's ops save, and backward gets each saved tensor back,
# recomputed, when it first needs one.
#
# **Target**: as in exercise 1: bit-identical gradients with dropout 0.1, and only the
# blocks' inputs kept after the forward.
#
# Nothing re-enters the engine, so `torch.autograd.grad`, keyword arguments and
# frozen inputs work (see the cell after the check).

# %%
def checkpoint_with_hooks(run, *inputs):
    """run(*inputs), its saved tensors dropped in forward and recomputed at the first unpack."""
    rng_state = torch.get_rng_state()
    # BEGIN SOLUTION
    # HINT: pack drops, the first unpack recomputes; stuck? check.hint("checkpoint_with_hooks")
    numbers = itertools.count()
    recomputed = {}

    def pack(tensor):
        return next(numbers)

    def unpack(i):
        if i not in recomputed:
            collected = []
            with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: collected.append(t.detach()), lambda _: None):
                torch.set_rng_state(rng_state)
                run(*[x.detach().requires_grad_(x.requires_grad) for x in inputs])
            recomputed.update(enumerate(collected))
        return recomputed.pop(i)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return run(*inputs)
    # END SOLUTION

# %%
# CHECK: bit-identical gradients with dropout 0.1, and only the blocks' inputs kept after the forward
check.hooks(checkpoint_with_hooks)

# %% [markdown]
# The reentrant Function's blind spot, through the library (`minifsdp.checkpoint`, whose
# `reentrant.py` and `non_reentrant.py` are your two exercises, side by side): gradients
# reach the block's parameters only through the nested backward, which runs only if the
# Function's output requires grad, i.e. if an *input* does. Frozen embeddings or a first
# layer fed token ids would silently get no gradient; torch warns, minifsdp stops.

# %%
frozen_input = torch.randn(2, 8)  # requires_grad=False, like token ids or a frozen layer's output
layer = torch.nn.Linear(8, 8)
try:
    checkpoint(layer, frozen_input, use_reentrant=True)
except ValueError as err:
    print("reentrant:    ", err)
checkpoint(layer, frozen_input, use_reentrant=False).sum().backward()
print("non-reentrant: the weight gradient is there:", layer.weight.grad is not None)

# %% [markdown]
# ## 4. The price: one extra forward
#
# A checkpointed block runs its forward twice. A backward costs about two forwards
# (a gradient for the input and one for the weights), so a step goes from about 3 to
# about 4 forwards' worth of FLOPs: at most 4/3. A dispatch mode (like lab 01's tracker, it
# sees every aten op) counts the matmul FLOPs of one step exactly; the clock measures this
# CPU, noisily.

# %%
def with_checkpointing(mode, k=None):
    """gpt-mini with its first k blocks (all: None) checkpointed: 'none', 'full' or 'selective' (the
    library's policy, the one exercise 3 asks you for)."""
    model = models.build_model("gpt-mini", seed=0)
    wrap = {"none": lambda block: block, "full": checkpoint_wrapper, "selective": selective_checkpoint_wrapper}[mode]
    for i in range(CONFIG.n_layer if k is None else k):
        model.blocks[i] = wrap(model.blocks[i])
    return model


class OpTable(TorchDispatchMode):
    """Every aten op run inside: calls, bytes of new outputs (views are free), and matmul FLOPs
    (2·m·k·n for an (m×k)·(k×n) product; elementwise ops are negligible next to them)."""

    MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.bmm.default: 0,
               torch.ops.aten.addmm.default: 1, torch.ops.aten.baddbmm.default: 1}  # op -> index of 1st factor

    def __init__(self):
        super().__init__()
        self.calls, self.bytes, self.flops = {}, {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in args if isinstance(a, torch.Tensor)}
        new = isinstance(out, torch.Tensor) and id(out.untyped_storage()) not in inputs
        first = self.MATMULS.get(func)
        flops = 0 if first is None else 2 * args[first].numel() * args[first + 1].shape[-1]
        self.calls[func] = self.calls.get(func, 0) + 1
        self.bytes[func] = self.bytes.get(func, 0) + (out.nbytes if new else 0)
        self.flops[func] = self.flops.get(func, 0) + flops
        return out


def step_flops(model):
    """Matmul FLOPs of one forward + backward (recompute included)."""
    with OpTable() as table:
        models.lm_loss(model(x_batch), y_batch).backward()
    return sum(table.flops.values())


cost = {}
for mode in ("none", "full", "selective"):
    model = with_checkpointing(mode)
    flops = step_flops(model)  # also the warm-up for the clock
    activations, peak, seconds, _ = measure_step(model)
    cost[mode] = (flops, activations, peak, seconds)
forward_flops = cost["none"][0] / 3
for mode, (flops, activations, peak, seconds) in cost.items():
    print(f"{mode:<10} {flops / 1e9:6.2f} GFLOP ({flops / cost['none'][0]:.2f}x)  activations "
          f"{format_bytes(activations):>10}  peak {format_bytes(peak):>10}  {seconds * 1e3:6.0f} ms "
          "(under the tracker)")
extra = (cost["full"][0] - cost["none"][0]) / forward_flops
print(f"full checkpointing recomputes {extra:.2f} forwards' worth of matmul FLOPs (at most 1); "
      f"selective {(cost['selective'][0] - cost['none'][0]) / forward_flops:.2f}")
# per block, in B·T·d-sized tensors: full keeps 1 (the input); selective keeps that plus what its policy chose
selective_per_block = (cost["selective"][1] - cost["full"][1]) / CONFIG.n_layer + kept_input
print(f"per block: none keeps {per_block / kept_input:.0f} B·T·d-sized tensors' worth, full 1, selective "
      f"{selective_per_block / kept_input:.0f}")

# %% [markdown]
# Full checkpointing adds one forward of the blocks (the embedding and the vocabulary
# head are not recomputed, hence under 1); *selective* adds almost nothing in matmul
# FLOPs, but keeps part of the memory: here 10 of a block's 17 tensors' worth. The
# clock on a laptop CPU says less: these tensors are small, so Python overhead weighs
# (selective checkpointing passes every op of a block through two Python dispatch
# modes) and other programs share the cores. On a GPU, with large matmuls, the FLOP
# ratio is the one to expect. Where does that middle ground come from?
#
# ## 5. Exercise 3: selective checkpointing
#
# Korthikanti et al. 2022 observed that a transformer block's **FLOPs** and its
# **activation bytes** sit in different ops. The table lists every aten op one block
# runs in its forward (the `OpTable` mode above), with the bytes of its new outputs and its FLOPs.

# %%
block = models.build_model("gpt-mini", seed=0).blocks[0]
block_input = torch.randn(BATCH, SEQ, CONFIG.n_embd)
with OpTable() as table:
    block(block_input)
print(f"{'aten op':<28}{'calls':>6}{'output bytes':>14}{'MFLOP':>9}")
for op, nbytes in sorted(table.bytes.items(), key=lambda kv: -kv[1]):
    if nbytes:
        print(f"{str(op):<28}{table.calls[op]:>6}{format_bytes(nbytes):>14}{table.flops[op] / 1e6:>9.1f}")

# %% [markdown]
# `torch.utils.checkpoint`'s selective checkpointing (`create_selective_checkpoint_contexts`)
# is built from the table's machinery: two dispatch modes, one around the forward and
# one around the recompute, handed to non-reentrant checkpointing as `context_fn`.
# Autograd sits *above* the modes: what a mode keeps is a plain tensor (memory you
# chose to spend), and where the recompute gets a kept result instead of running the
# op, autograd builds the same graph.
#
# **Goal**: `KeepOutputs(policy, kept)` runs every op and keeps, in `kept`, the outputs
# of those `policy(ctx, op, *args, **kwargs)` chooses; `ReuseOutputs(kept)`, in the
# recompute, gives those ops their forward outputs back and runs every other op;
# `keep_expensive(ctx, op, ...)` returns a bool (`op` is an aten overload such as
# `torch.ops.aten.gelu.default`).
#
# **Target**: backward recomputes **no linear layer**, keeps no more activations than
# that needs (measured), and the gradients stay bit-identical. The check runs your
# policy with the library's modes, then your modes with the library's policy.

# %%
class KeepOutputs(TorchDispatchMode):
    """Forward: run every op, and keep the outputs of those `policy` chooses (kept[op] = [out, ...])."""

    def __init__(self, policy, kept):
        super().__init__()
        self.policy, self.kept = policy, kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # BEGIN SOLUTION
        # HINT: keep what the policy chooses, in call order; stuck? check.hint("KeepOutputs")
        if self.policy(None, func, *args, **kwargs):
            self.kept.setdefault(func, []).append(out.detach())
        # END SOLUTION
        return out


class ReuseOutputs(TorchDispatchMode):
    """Recompute: the k-th call of a kept op returns the k-th kept output; other ops run."""

    def __init__(self, kept):
        super().__init__()
        self.kept, self.calls = kept, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # BEGIN SOLUTION
        # HINT: a kept op's k-th call gets its k-th kept output; stuck? check.hint("ReuseOutputs")
        if func in self.kept:
            k = self.calls.get(func, 0)
            self.calls[func] = k + 1
            return self.kept[func][k].detach()
        return func(*args, **kwargs)
        # END SOLUTION


def keep_expensive(ctx, op, *args, **kwargs):
    """True: keep this op's output until backward; False: recompute it."""
    # BEGIN SOLUTION
    # HINT: True for the ops whose FLOPs you would rather not pay twice; stuck? check.hint("keep_expensive")
    return op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    # END SOLUTION

# %%
# CHECK: no linear matmul recomputed in backward, bit-identical gradients, activations at most the target
check.selective(KeepOutputs, ReuseOutputs, keep_expensive)

# %% [markdown]
# ## 6. Exercise 4: where to checkpoint
#
# Checkpointing is per block: with k of the L blocks checkpointed you choose a point on
# the memory–compute line. Predict the activation bytes alive after the forward of a GPT
# with its **first k blocks** checkpointed (fully), from `estimate.gpt_activation_bytes`
# (no checkpointing: its `"total"` and its `"per_layer"`) and the shapes. Then use it to
# choose: the fewest checkpointed blocks whose activations fit a memory budget (each one
# costs a recompute). The check measures k = 0 … L on two models of different widths and
# compares to the byte, then hands your chooser budgets that sit between measured values.

# %%
def predict_activations(config, batch, seq_len, k):
    """Bytes of activations after the forward, fp32, with the first k blocks checkpointed."""
    plain = estimate.gpt_activation_bytes(config, batch, seq_len)
    # BEGIN SOLUTION
    # HINT: what does each checkpointed block give back? stuck? check.hint("predict_activations")
    kept = batch * seq_len * config.n_embd * FP32
    return plain["total"] - k * (plain["per_layer"] - kept)
    # END SOLUTION


def fewest_checkpointed_blocks(budget, config, batch, seq_len):
    """The smallest k whose activations fit in `budget` bytes (None when even k = L does not fit)."""
    # BEGIN SOLUTION
    # HINT: as few blocks as the budget allows; stuck? check.hint("fewest_checkpointed_blocks")
    for k in range(config.n_layer + 1):
        if predict_activations(config, batch, seq_len, k) <= budget:
            return k
    return None
    # END SOLUTION

# %%
# CHECK: your bytes equal the tracker's measurement for every k on two models; your k fits measured budgets
check.predicted_activations(predict_activations, fewest_checkpointed_blocks)

# %% [markdown]
# Now gpt-mini, measured for every k, beside your prediction and the library's formula
# (`estimate.gpt_checkpoint_activation_bytes`), and the **peak** of the step: the moment
# where parameters, gradients, activations and backward's working set add up most.

# %%
# FIGURE
ks = list(range(CONFIG.n_layer + 1))
measured = [measure_step(with_checkpointing("full", k)) for k in ks]
yours = [predict_activations(CONFIG, BATCH, SEQ, k) for k in ks]
library = [estimate.gpt_checkpoint_activation_bytes(CONFIG, BATCH, SEQ, checkpointed_layers=k)["total"] for k in ks]
MiB = 2**20
fig, ax = plt.subplots(figsize=(6.5, 3.5))
ax.plot(ks, [m[0] / MiB for m in measured], "o-", label="activations after forward, measured")
ax.plot(ks, [y / MiB for y in yours], "x--", label="your prediction")
ax.plot(ks, [v / MiB for v in library], ":", label="estimate.gpt_checkpoint_activation_bytes")
ax.plot(ks, [m[1] / MiB for m in measured], "s-", label="peak of the step, measured")
ax.set_xlabel("checkpointed blocks k (of L = 4)")
ax.set_ylabel("memory (MiB)")
ax.set_xticks(ks)
ax.set_title(f"gpt-mini, B={BATCH}, T={SEQ}, fp32")
ax.legend(fontsize=8)
plt.show()
print("measured == yours == library at every k:",
      all(m[0] == y == v for m, y, v in zip(measured, yours, library)))

# %% [markdown]
# Each checkpointed block lowers the activations by the same step, the straight line of
# your formula; the peak falls only once: from k = 1 on it sits late in the backward,
# where the gradients have built up and block 0 is rebuilt, and more blocks do not move it.
#
# ### Explore: the memory curve of one step
#
# Pick k and the mode, then "draw": the whole step, memory by category over time. At
# k = 0 the activations rise block by block in the forward and drain in the backward;
# each checkpointed block keeps only its input, and rebuilds its insides in the backward.

# %%
def show_step(k=2, mode="full"):
    """The memory of one training step of gpt-mini with its first k blocks checkpointed, as a figure."""
    activations, peak, seconds, tracker = measure_step(with_checkpointing(mode, k))
    return plot.memory(tracker.samples, title=f"{mode} checkpointing of {k} of {CONFIG.n_layer} blocks: "
                                              f"activations {format_bytes(activations)}, peak {format_bytes(peak)}")


wide = {"style": {"description_width": "initial"}, "layout": widgets.Layout(width="420px")}
k_slider = widgets.IntSlider(value=2, min=0, max=CONFIG.n_layer, description="checkpointed blocks k", **wide)
mode_buttons = widgets.ToggleButtons(options=["full", "selective"], value="full", description="mode",
                                     style={"description_width": "initial"})
draw_button = widgets.Button(description="draw")
step_figure = widgets.Output()


def draw_step(_=None):
    with step_figure:
        step_figure.clear_output(wait=True)
        display(show_step(k_slider.value, mode_buttons.value))  # a returned figure shows only if displayed


draw_button.on_click(draw_step)
widgets.VBox([k_slider, mode_buttons, draw_button, step_figure])

# %% [markdown]
# The same function, called plainly:

# %%
# FIGURE
show_step(k=4, mode="full")

# %% [markdown]
# With all 4 blocks checkpointed the activations (red) stay low through the forward, and
# the peak moves from the start of the backward (k = 0: on top of 17.8 MiB of
# activations) to its end, where the gradients (orange) have built up.

# %% [markdown]
# ## 7. With FSDP
#
# PyTorch's recipe: checkpoint the blocks, then wrap with FSDP (minifsdp's FSDP behaves
# the same). FSDP wraps each block inside its checkpoint wrapper; when backward recomputes
# a block, FSDP has already gathered its parameters for that block's backward. The state
# dict's keys are the plain model's (the wrapper's `_checkpoint_wrapped_module.` is
# stripped), so checkpoints load either way:
#
#     apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
#     model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
#
# The trainer does exactly that with `--checkpoint full|selective`: gpt-mini on two ranks
# (one per GPU; on a machine with fewer GPUs `launch` runs CPU ranks and says so).

# %%
N2 = 2
runs = {}
for mode in ("none", "full", "selective"):
    runs[mode] = train(TrainConfig(strategy="fsdp", world_size=N2, model="gpt-mini", steps=2, batch_size=8,
                                   checkpoint=mode, quiet=True, write_plots=False,
                                   out=f"runs/lab06/fsdp-{mode}"))
for mode, m in runs.items():
    print(f"fsdp, --checkpoint {mode:<9}: peak {format_bytes(max(m['peak_bytes'])):>10} per rank, "
          f"losses {[round(v, 4) for v in m['losses']]}")
print("same losses:", all(r["losses"] == runs["none"]["losses"] for r in runs.values()))

# %% [markdown]
# ## Summary
#
# * A checkpointed block keeps its input (B·T·d values) and rebuilds everything else in
#   backward: one extra forward for most of its activation memory.
# * Reentrant: an autograd Function, a nested backward, an input must require grad.
#   Non-reentrant: saved-tensor hooks, no such limits; PyTorch recommends it, though
#   torch 2.13 still defaults to reentrant (with a warning).
# * The recompute repeats the forward exactly: same ops, same RNG state.
# * Selective checkpointing keeps the FLOP-heavy ops' outputs: almost no recompute
#   (1.01× the step's matmul FLOPs here, full 1.22×), but at this lab's size (T = 64,
#   d = 256) a block still keeps 10 of its 17 tensors' worth: activations 17.8 → 10.8 MiB,
#   full 1.8 MiB. It nears full's saving only where attention's B·h·T² scores dominate
#   (long sequences).
# * Activations fall linearly with k, as predicted to the byte; the peak falls less.

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
