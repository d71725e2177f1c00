# Lab 03 - ZeRO. Source of solutions/03_zero.ipynb and labs/03_zero.ipynb:
# edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 03 - ZeRO: shard the optimizer state, then the gradients
#
# Lab 02's data parallelism gives every rank a full copy of the parameters, the
# gradients and the optimizer state, and every rank runs *the same* optimizer step
# on *the same* averaged gradients. With AdamW that is 16 bytes per parameter in
# fp32, held `N` times over. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
# Optimizations Toward Training Trillion Parameter Models") removes the
# redundancy in stages:
#
# | stage | each rank keeps | FairScale / PyTorch name |
# |---|---|---|
# | ZeRO-1 | the optimizer state of the parameters it *owns* | `fairscale.optim.OSS`, `torch.distributed.optim.ZeroRedundancyOptimizer` |
# | ZeRO-2 | ... and only the gradients of those parameters | `fairscale.nn.data_parallel.ShardedDataParallel`, FSDP `SHARD_GRAD_OP` |
# | ZeRO-3 | ... and only its shard of the parameters | FSDP `FULL_SHARD` (lab 04) |
#
# **Sections**: 1. the paper's picture: model-state bytes per device, from the
# formulas in `minifsdp.estimate`; 2. exercise: shard the optimizer yourself
# (ZeRO-1), checked against one process; 3. ZeRO-2 with `minifsdp.zero`: gradients
# go to their owner only; 4. measured: memory per rank and bytes moved per step at
# 1, 2 and 4 ranks, next to the formulas, with exercise 2: predict each rank's
# bytes exactly; 5. the same strategies from the trainer.
#
# Everything runs on the CPU (gloo) in under a minute (the last cell prints the
# time). The workers are device-agnostic (`dist.device()`): on a GPU machine they
# run on NCCL, except section 4's, which stay on the CPU so the books are exact to
# the byte (the CUDA allocator rounds blocks up to 512 B).

# %%
import inspect
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import minifsdp
from minifsdp import comm, data, estimate, models, plot, trace

# Small tensors: one compute thread per process is as fast, and several processes
# share the cores without OpenMP threads spinning against each other.
torch.set_num_threads(1)

MiB, GB = 2**20, 1e9
FP32 = 4
# AdamW as in tests/test_zero.py. eps=1e-6 rather than 1e-8: a gradient that is pure
# rounding noise (~1e-9, its sign set by the order of a sum) would otherwise become a
# full-size update of either sign, and N ranks add in a different order than one process.
LR, WD, EPS = 1e-2, 0.1, 1e-6
notebook_start = time.perf_counter()

# %% [markdown]
# ## 1. The paper's picture: model states per device
#
# With `Ψ` parameters, `N` data-parallel ranks and the paper's mixed-precision Adam
# (fp16 parameters and gradients, 2 bytes each; fp32 master weights, momentum and
# variance in the optimizer, `K = 12` bytes per parameter), one rank holds:
#
# | | parameters | gradients | optimizer state | total |
# |---|---|---|---|---|
# | DDP (stage 0) | `2Ψ` | `2Ψ` | `KΨ` | `(4 + K) Ψ` |
# | ZeRO-1 | `2Ψ` | `2Ψ` | `KΨ / N` | `4Ψ + KΨ / N` |
# | ZeRO-2 | `2Ψ` | `2Ψ / N` | `KΨ / N` | `2Ψ + (2 + K) Ψ / N` |
# | ZeRO-3 | `2Ψ / N` | `2Ψ / N` | `KΨ / N` | `(4 + K) Ψ / N` |
#
# In plain fp32 (what we run below) parameters and gradients cost 4 bytes each and
# `K = 8` (AdamW's two moments). `estimate.model_state_bytes_per_device` implements
# the table; here it is for a GPT-3 6.7B-shaped model (32 layers, width 4096) on 64
# GPUs. The cell checks the function against the formulas above as it prints.

# %%
# NBVAL_CHECK_OUTPUT
big = models.GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)
PSI = estimate.gpt_param_count(big)
N_BIG, K = 64, 12
STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
by_formula = {0: (2 * PSI, 2 * PSI, K * PSI), 1: (2 * PSI, 2 * PSI, K * PSI / N_BIG),
              2: (2 * PSI, 2 * PSI / N_BIG, K * PSI / N_BIG),
              3: (2 * PSI / N_BIG, 2 * PSI / N_BIG, K * PSI / N_BIG)}
big_rows = {}
print(f"Psi = {PSI:,} parameters, N = {N_BIG} ranks, mixed-precision Adam (K = {K})")
print(f"{'':8}{'params GB':>11}{'grads GB':>10}{'optim GB':>10}{'total GB':>10}{'vs DDP':>8}")
for stage, name in STAGES.items():
    m = estimate.model_state_bytes_per_device(PSI, N_BIG, stage, mixed_precision=True, padding=False)
    got = (m["parameters"], m["gradients"], m["optimizer"])
    assert all(abs(a - b) < 1 for a, b in zip(got, by_formula[stage])), (stage, got, by_formula[stage])
    big_rows[name] = m
    print(f"{name:8}" + "".join(f"{v / GB:>10.1f}" for v in got)
          + f"{m['total'] / GB:>10.1f}{m['total'] / big_rows['DDP']['total']:>8.1%}")

# %% [markdown]
# Left: where the bytes go at 64 ranks. Right: the total per device as the number of
# ranks grows, against the memory of one 80 GB accelerator (model states only:
# activations and temporaries come on top).

# %%
CATS = ("parameters", "gradients", "optimizer")
ns = [2**i for i in range(11)]   # 1 .. 1024 ranks
fig, (ax_bar, ax_n) = plt.subplots(1, 2, figsize=(11, 3.8))
left = np.zeros(len(big_rows))
for cat in CATS:
    widths = np.array([m[cat] / GB for m in big_rows.values()])
    ax_bar.barh(list(big_rows), widths, left=left, color=plot.color_for(cat), label=cat)
    left += widths
ax_bar.invert_yaxis()
ax_bar.set_xlabel("model-state bytes per device (GB = 1e9 B)")
ax_bar.set_title(f"{PSI / 1e9:.1f}B parameters, N = {N_BIG}")
ax_bar.legend(fontsize=8)
for stage, name in STAGES.items():
    totals = [estimate.model_state_bytes_per_device(PSI, n, stage, mixed_precision=True,
                                                    padding=False)["total"] / GB for n in ns]
    ax_n.plot(ns, totals, "o-", ms=3, label=name)
ax_n.axhline(80, color="k", ls="--", lw=1)
ax_n.text(2**5, 58, "80 GB: one accelerator", fontsize=8)
ax_n.set_xscale("log", base=2)
ax_n.set_yscale("log")
ax_n.set_xlabel("data-parallel ranks N")
ax_n.set_ylabel("model-state bytes per device (GB)")
ax_n.set_title("mixed-precision Adam, K = 12")
ax_n.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
# NBVAL_CHECK_OUTPUT
for stage, name in STAGES.items():
    fits = [n for n in ns if estimate.model_state_bytes_per_device(
        PSI, n, stage, mixed_precision=True, padding=False)["total"] <= 80 * GB]
    floor = {0: 16 * PSI, 1: 4 * PSI, 2: 2 * PSI, 3: 0}[stage]   # what N cannot divide
    print(f"{name:7} fits in 80 GB from N = {fits[0] if fits else 'never':>5};"
          f"  the part N does not divide: {floor / GB:6.1f} GB")

# %% [markdown]
# DDP never fits, however many ranks you add: every term is replicated. ZeRO-1
# removes the biggest term, but its curve flattens at the `4Ψ` of parameters and
# gradients that every rank still holds; ZeRO-2 flattens at `2Ψ`; only ZeRO-3
# keeps falling. Stages 1 and 2 cost no extra communication in the paper's
# accounting (section 7): `2Ψ` per step, the same as DDP's all-reduce. Section 4
# measures that claim, with a twist.

# %% [markdown]
# ## 2. Exercise: shard the optimizer (ZeRO-1)
#
# One training step of ZeRO-1, as FairScale's `OSS` does it, on every rank:
#
# ```
# backward                        every rank: the gradient of its slice of the batch
# all-reduce / N                  every rank: every averaged gradient (as DDP)
# optimizer.step()                each rank: AdamW on the parameters it OWNS only
# broadcast from owners           each parameter, from its owner to everyone
# ```
#
# Ownership is decided once, without communication: every rank runs the same
# deterministic rule on the same list of parameter sizes and gets the same answer.
# The rule is greedy, "longest processing time first": take the parameters from
# the biggest to the smallest and give each one to the rank that owns the fewest
# elements so far. Ties: equal sizes go in parameter order, equal loads to the
# lowest rank. Whole parameters move, so the shards are only *about* `Ψ/N` each.
#
# Here is the worker that trains with it. It calls three functions that you write
# in the next cell: `greedy_partition`, `local_optimizer` and `zero1_step`.

# %%
def zero1_worker(model_name, steps, global_batch, seq_len):
    """ZeRO-1 by hand on this rank: returns what the check needs (nothing printed here)."""
    import torch.distributed as tdist
    from minifsdp import dist

    torch.set_num_threads(1)   # ranks share the cores; more threads per rank only spin
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    model = models.build_model(model_name).to(device)   # same seed everywhere: same start
    params = list(model.parameters())
    owners = greedy_partition([p.numel() for p in params], n)
    optimizer = local_optimizer(params, owners, rank, lr=LR, weight_decay=WD, eps=EPS)
    tracer, losses = trace.Tracer(rank=rank), []
    with tracer:
        for step in range(steps):
            x, y = data.get_batch(step, global_batch, seq_len, rank=rank, world_size=n)
            with trace.span("step"):
                loss = models.lm_loss(model(x.to(device)), y.to(device))
                loss.backward()
                for p in params:                    # DDP's gradient average
                    p.grad.div_(n)
                    comm.all_reduce(p.grad)
                zero1_step(params, owners, optimizer)
            model.zero_grad(set_to_none=True)      # all gradients, not only the owned ones
            total = loss.detach().reshape(1).clone()
            tdist.all_reduce(total)                 # bookkeeping only (outside the "step" span)
            losses.append(total.item() / n)
    mine = [p for p, o in zip(params, owners) if o == rank]
    return {"owners": owners, "losses": losses,
            "state_bytes": sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                               if torch.is_tensor(t)),
            "owned_numel": sum(p.numel() for p in mine), "owned_tensors": len(mine),
            "bytes": tracer.trace.bytes_by_op(within="step"),
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}

# %% [markdown]
# And the yardstick: one process, plain AdamW, the whole global batch. ZeRO-1 must
# end with the same parameters, and its ranks' optimizer states must add up to
# this one's.

# %%
EX_MODEL, EX_STEPS, EX_B, EX_T = "gpt-tiny", 3, 8, 32


def single_process(model_name, steps, global_batch, seq_len):
    """Losses, final parameters and AdamW state bytes of one process on the whole batch."""
    model = models.build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for step in range(steps):
        x, y = data.get_batch(step, global_batch, seq_len)
        loss = models.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.clone() for k, v in model.state_dict().items()},
            "state_bytes": sum(t.nbytes for s in opt.state.values() for t in s.values()),
            "n_params": models.count_parameters(model), "n_tensors": len(list(model.parameters()))}


reference = single_process(EX_MODEL, EX_STEPS, EX_B, EX_T)
print(f"{EX_MODEL}: {reference['n_params']:,} parameters in {reference['n_tensors']} tensors; "
      f"AdamW state {reference['state_bytes']:,} B; losses", [f"{v:.4f}" for v in reference["losses"]])

# %% [markdown]
# ### Your turn
#
# * `greedy_partition(sizes, world_size)`: the owner rank of each parameter, by the
#   rule above.
# * `local_optimizer(params, owners, rank, **adamw_kwargs)`: an AdamW that steps,
#   and keeps state for, only this rank's parameters.
# * `zero1_step(params, owners, optimizer)`: after the gradient average, step the
#   local shard, then make every rank's copy of every parameter equal to its
#   owner's with `comm.broadcast(tensor, src)` (every rank calls it for every
#   parameter, in the same order: a collective is a meeting).

# %%
def greedy_partition(sizes: list[int], world_size: int) -> list[int]:
    """Owner rank of each parameter: biggest first, each onto the least-loaded rank.

    >>> greedy_partition([10, 7, 5, 4], 2)   # rank 0: 10 + 4 = 14, rank 1: 7 + 5 = 12
    [0, 1, 1, 0]
    """
    # BEGIN SOLUTION
    # HINT: keep a load (elements owned so far) per rank; visit the parameter indices sorted by size, biggest first (equal sizes: lower index first), and give each to the rank with the smallest load (equal loads: the lowest rank).
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = load.index(min(load))
        owners[i] = r
        load[r] += sizes[i]
    return owners
    # END SOLUTION


def local_optimizer(params: list[torch.Tensor], owners: list[int], rank: int,
                    **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over the parameters that `rank` owns, and no others."""
    # BEGIN SOLUTION
    # HINT: build torch.optim.AdamW(..., **adamw_kwargs) from a list holding only the parameters whose owner is `rank`.
    return torch.optim.AdamW([p for p, o in zip(params, owners) if o == rank], **adamw_kwargs)
    # END SOLUTION


def zero1_step(params: list[torch.Tensor], owners: list[int], optimizer: torch.optim.Optimizer) -> None:
    """On every rank, after the gradients are averaged: step the shard, then re-assemble the model."""
    # BEGIN SOLUTION
    # HINT: first the local step (it updates the owned parameters only); then each parameter must travel from the rank that updated it to all the others: one comm.broadcast per parameter, on its .data, called by every rank in the same order.
    optimizer.step()
    for p, owner in zip(params, owners):
        comm.broadcast(p.data, src=owner)
    # END SOLUTION

# %%
# CHECK: greedy_partition on small cases, then ZeRO-1 on 1, 2 and 4 ranks against one process
def _check_partition(fn) -> None:
    def lpt(sizes, n, order=None):  # the rule, written independently (order: the visiting order)
        load, owners = [0] * n, [0] * len(sizes)
        for i in order or sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            owners[i] = min(range(n), key=lambda r: (load[r], r))
            load[owners[i]] += sizes[i]
        return owners

    gpt_sizes = [p.numel() for p in models.build_model(EX_MODEL).parameters()]
    cases = [([10, 7, 5, 4], 2), ([4, 5, 7, 10], 2), ([3, 3, 3, 3], 2), ([6, 1, 1, 1, 1, 1, 1], 2),
             ([5, 2], 4), (gpt_sizes, 3), (gpt_sizes, 4)]
    for sizes, n in cases:
        got, want = list(fn(list(sizes), n)), lpt(sizes, n)
        where = f"greedy_partition({sizes if len(sizes) < 10 else 'gpt-tiny sizes'}, {n})"
        assert len(got) == len(sizes), f"{where} returned {len(got)} owners: return one owner rank per parameter"
        assert all(isinstance(r, int) and 0 <= r < n for r in got), \
            f"{where} = {got}: each owner must be a rank, an int in 0..{n - 1}"
        if got == want:
            continue
        load = lambda owners: sorted(sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n))  # noqa: E731
        if got == lpt(sizes, n, order=range(len(sizes))):
            hint = "you visited the parameters in list order: sort them by size, biggest first"
        elif got == [i % n for i in range(len(sizes))]:
            hint = "that is round-robin by position; go by size: biggest first, onto the least-loaded rank"
        elif load(got) == load(want):
            hint = ("the loads are right but the ranks differ: break ties the same way on every rank "
                    "(equal sizes: lower index first; equal loads: lowest rank)")
        elif max(load(got)) > max(load(want)):
            hint = (f"rank loads {load(got)} are less balanced than greedy's {load(want)}: visit the "
                    "parameters biggest first and give each to the rank with the smallest load so far")
        else:
            hint = "follow the rule exactly: biggest first (ties by index), onto the least-loaded rank (ties: lowest)"
        raise AssertionError(f"{where} = {got}, expected {want}: {hint}")


_check_partition(greedy_partition)
print("greedy_partition: right on every case")

ex_runs = {n: minifsdp.launch(zero1_worker, n, EX_MODEL, EX_STEPS, EX_B, EX_T, timeout=60) for n in (1, 2, 4)}
full_state, psi_bytes = reference["state_bytes"], FP32 * reference["n_params"]
for n, results in ex_runs.items():
    states = [r["state_bytes"] for r in results]
    if n > 1 and all(s == full_state for s in states):
        raise AssertionError(f"{n} ranks: every rank keeps the full AdamW state ({full_state:,} B): "
                             "local_optimizer must give AdamW only the parameters this rank owns")
    for r, out in enumerate(results):
        own = 2 * FP32 * out["owned_numel"] + FP32 * out["owned_tensors"]
        assert out["state_bytes"] == own, (
            f"{n} ranks, rank {r}: optimizer state {out['state_bytes']:,} B, but the state of the parameters "
            f"it owns is {own:,} B (exp_avg + exp_avg_sq + step): step only this rank's parameters")
    assert sum(states) == full_state, (
        f"{n} ranks: the shards hold {sum(states):,} B of state, one process {full_state:,} B: "
        "every parameter must be stepped by exactly one rank")
    biggest = 2 * FP32 * max(p.numel() for p in models.build_model(EX_MODEL).parameters()) + FP32
    assert max(states) <= full_state / n + biggest, (
        f"{n} ranks: the largest shard of state is {max(states):,} B, more than 1/N of {full_state:,} B plus "
        "one parameter's state: the partition is unbalanced (check greedy_partition's loads)")
    for r, out in enumerate(results[1:], start=1):
        same = all(torch.equal(out["params"][k], results[0]["params"][k]) for k in out["params"])
        assert same, (f"{n} ranks: after training, rank {r}'s parameters differ from rank 0's: after the step, "
                      "broadcast every parameter from its owner (src=owners[i]), on every rank, in the same order")
    for k, want in reference["params"].items():
        diff = (results[0]["params"][k] - want).abs().max().item()
        assert diff <= 1e-4, (
            f"{n} ranks: the ranks agree, but {k} differs from one process by {diff:.1e} (> 1e-4): the broadcast "
            "must come from each parameter's owner (who stepped it), after optimizer.step()")
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], reference["losses"])) <= 1e-5, \
        f"{n} ranks: losses {results[0]['losses']} differ from one process's {reference['losses']} by > 1e-5"
    if n > 1:
        moved = results[0]["bytes"]
        assert moved.get("broadcast", 0) == EX_STEPS * psi_bytes, (
            f"{n} ranks: the broadcasts moved {moved.get('broadcast', 0) / EX_STEPS:,.0f} B per step, the "
            f"parameters are {psi_bytes:,} B: broadcast each parameter exactly once per step")
print("zero1_step: the same parameters (|diff| <= 1e-4) and losses (<= 1e-5) as one process at 1, 2 and 4 ranks")

# %% [markdown]
# The check compared the parameters after three steps with one process (fp32, at
# most `1e-4` apart: the ranks add the gradient average in a different order) and
# counted each rank's optimizer state to the byte. Each rank's share:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'ranks':>5}  {'optimizer state per rank (B)':<44}{'largest / (full/N)':>18}  broadcast B/step")
for n, results in ex_runs.items():
    states = [r["state_bytes"] for r in results]
    per_step = results[0]["bytes"].get("broadcast", 0) // EX_STEPS
    print(f"{n:>5}  {', '.join(f'{s:,}' for s in states):<44}{max(states) / (full_state / n):>18.3f}"
          f"  {per_step:,}")
print(f"one process: {full_state:,} B of AdamW state; parameters {psi_bytes:,} B")

# %% [markdown]
# Each rank holds about `1/N` of the state; the largest share is a little above
# `1/N` because whole parameters cannot be split (the greedy rule guarantees at most
# `Ψ/N` plus the largest parameter). The price is one broadcast of the parameters
# per step, `Ψ` bytes, on top of DDP's all-reduce. `minifsdp.zero.OSS` is this
# exercise made into a `torch.optim.Optimizer` (param groups, LR schedulers,
# gradient clipping, state dicts) plus packing small parameters into one broadcast:

# %%
from minifsdp.zero import OSS, ShardedDataParallel, partition_parameters, wrap_zero  # noqa: E402

def without_docstring(fn) -> str:
    """The source of `fn` minus its docstring (the code is short; the docstring is in the file)."""
    head, _, rest = inspect.getsource(fn).partition('"""')
    return head.rstrip() + rest.partition('"""')[2]


print(without_docstring(partition_parameters))
print(without_docstring(OSS.step))

# %% [markdown]
# ## 3. ZeRO-2: each gradient goes to its owner only
#
# Look again at your worker: after the all-reduce every rank holds every averaged
# gradient, yet its optimizer reads only the ones it owns. ZeRO-2 sends each
# gradient where it is needed: as soon as backward has produced it, a `reduce`
# sums it onto its owner (`Ψ` bytes in all instead of the all-reduce's `2Ψ`), and
# the other ranks drop their copy as soon as its reduce is done, *during* backward:
# a rank holds its own shard of gradients plus a bounded amount in flight
# (`max_inflight_bytes`), not all of `Ψ`. That is FairScale's
# `ShardedDataParallel`, in `minifsdp.zero.ShardedDataParallel`; its gradient hook:

# %%
print(inspect.getsource(ShardedDataParallel._on_grad_ready))

# %% [markdown]
# `wrap_zero(model, stage, **adamw_kwargs)` builds both pieces (stage 1: all-reduce
# and keep; stage 2: reduce to the owner). The worker trains with each stage on the
# same data as before and records, after each backward, which gradients the rank
# still holds.

# %%
def zero_stage_worker(model_name, steps, global_batch, seq_len, stages):
    """Train with minifsdp.zero at each stage; return gradients held, owners, params, bytes."""
    import torch.distributed as tdist
    from minifsdp import dist

    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    out = {}
    for stage in stages:
        module = models.build_model(model_name).to(device)
        model, opt = wrap_zero(module, stage, lr=LR, weight_decay=WD, eps=EPS)
        params = list(module.parameters())
        losses = []
        for step in range(steps):
            x, y = data.get_batch(step, global_batch, seq_len, rank=rank, world_size=n)
            with trace.Tracer(rank=rank) as tracer, trace.span("step"):   # one trace per step; keep the last
                loss = models.lm_loss(model(x.to(device)), y.to(device))
                loss.backward()
                held = [p.grad is not None for p in params]
                opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().reshape(1).clone()
            tdist.all_reduce(total)
            losses.append(total.item() / n)
        out[stage] = {"held": held, "owners": [opt.param_to_rank[p] for p in params], "losses": losses,
                      "bytes": tracer.trace.bytes_by_op(within="step"),
                      "params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}
    return out


t0 = time.perf_counter()
stage_runs = minifsdp.launch(zero_stage_worker, 4, EX_MODEL, EX_STEPS, EX_B, EX_T, (1, 2), timeout=120)
print(f"4 ranks, stages 1 and 2, {EX_STEPS} steps each: {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# Which rank holds which gradient after backward (columns: the parameters of
# `gpt-tiny` in model order; a cell is coloured when the rank holds that gradient,
# dark when the rank also owns the parameter):

# %%
names = list(dict(models.build_model(EX_MODEL).named_parameters()))
fig, axes = plt.subplots(2, 1, figsize=(11, 3.6), sharex=True)
for ax, stage in zip(axes, (1, 2)):
    grid = np.zeros((len(stage_runs), len(names)))
    for r, out in enumerate(stage_runs):
        for j, (held, owner) in enumerate(zip(out[stage]["held"], out[stage]["owners"])):
            grid[r, j] = 2 if held and owner == r else 1 if held else 0
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=2.4, aspect="auto")
    ax.set_yticks(range(len(stage_runs)), [f"rank {r}" for r in range(len(stage_runs))])
    ax.set_title(f"ZeRO-{stage}: gradients held after backward (dark: owned, light: held but not owned)",
                 fontsize=9)
axes[1].set_xticks(range(len(names)), names, rotation=90, fontsize=7)
axes[1].set_xlabel("parameter")
plt.tight_layout()
plt.show()

# %%
# NBVAL_CHECK_OUTPUT
sizes = [p.numel() for p in models.build_model(EX_MODEL).parameters()]
print(f"{'':8}{'gradient bytes held per rank after backward':<46}{'bytes per step (rank 0)'}")
for stage in (1, 2):
    held = [sum(FP32 * s for s, h in zip(sizes, out[stage]["held"]) if h) for out in stage_runs]
    print(f"ZeRO-{stage}  {', '.join(f'{h:,}' for h in held):<46}{stage_runs[0][stage]['bytes']}")
    assert stage_runs[0][stage]["owners"] == ex_runs[4][0]["owners"], "OSS partitions like greedy_partition"
    for r, out in enumerate(stage_runs):
        owned = [o == r for o in out[stage]["owners"]]
        assert out[stage]["held"] == ([True] * len(sizes) if stage == 1 else owned), (stage, r)
        for k, want in reference["params"].items():   # the same model as one process, 1e-4
            assert (out[stage]["params"][k] - want).abs().max().item() <= 1e-4, (stage, r, k)
        assert max(abs(a - b) for a, b in zip(out[stage]["losses"], reference["losses"])) <= 1e-5
print(f"parameters {psi_bytes:,} B; both stages end with one process's parameters (|diff| <= 1e-4)")

# %% [markdown]
# Same model, same losses; ZeRO-2 keeps only the owned gradients and moves
# `reduce Ψ + broadcast Ψ = 2Ψ` per step where ZeRO-1 moved `3Ψ`. The owners are
# the same in both stages, and the same as your `greedy_partition`'s (the cell
# checked): `partition_parameters` is the same rule.
#
# PyTorch ships ZeRO-1 too: `torch.distributed.optim.ZeroRedundancyOptimizer`,
# used with its own DDP. The same three steps on 4 ranks with it:

# %%
def torch_zero1_worker(model_name, steps, global_batch, seq_len):
    """PyTorch's DDP + ZeroRedundancyOptimizer: final parameters and this rank's state bytes."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from minifsdp import dist

    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    module = models.build_model(model_name).to(device)
    model = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=LR, weight_decay=WD, eps=EPS)
    for step in range(steps):
        x, y = data.get_batch(step, global_batch, seq_len, rank=rank, world_size=n)
        models.lm_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"state_bytes": sum(t.nbytes for s in opt.optim.state.values() for t in s.values()
                               if torch.is_tensor(t)),   # opt.optim: the local shard's AdamW
            "params": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}


torch_runs = minifsdp.launch(torch_zero1_worker, 4, EX_MODEL, EX_STEPS, EX_B, EX_T, timeout=120)
theirs, ours = [r["state_bytes"] for r in torch_runs], [r["state_bytes"] for r in ex_runs[4]]
worst = max((r["params"][k] - want).abs().max().item() for r in torch_runs
            for k, want in reference["params"].items())
print(f"optimizer state per rank, ZeroRedundancyOptimizer: {theirs}")
print(f"optimizer state per rank, your ZeRO-1:             {ours}")
print(f"ZeroRedundancyOptimizer's parameters vs one process: max |diff| {worst:.1e}")
assert worst <= 1e-4, "PyTorch's ZeRO-1 should train the same model"
assert theirs == ours, "the two partitions differ"

# %% [markdown]
# PyTorch's shards hold the same bytes as yours (its partition is the same
# greedy rule; `tests/test_zero.py` also compares the optimizer states element by
# element), and its parameters match one process as well.

# %% [markdown]
# ## 4. Measured: memory per rank and bytes per step, 1 to 4 ranks
#
# Now a model whose states are megabytes: `gpt-mini`. For each world size `N` in
# 1, 2, 4 the worker trains two steps with each strategy, DDP (all-reduce after
# backward, plain AdamW), ZeRO-1 and ZeRO-2, under a `MemoryTracker` (lab 01) and a
# `Tracer`. It reads the tracker's books after backward (parameters, gradients)
# and after the optimizer step (optimizer state), and counts the bytes of every
# collective inside the step.
#
# One detail of measuring on CPU: gloo's worker thread lets go of a finished
# collective's tensor a moment *after* `wait()` returns, so a dropped gradient can
# outlive `p.grad = None` by microseconds. `settled` re-reads the books until they
# stop moving.

# %%
MEM_MODEL, MEM_STEPS, MEM_B, MEM_T = "gpt-mini", 2, 4, 16
STRATEGIES = ("ddp", "zero1", "zero2")


def model_state_worker(model_name, steps, global_batch, seq_len, strategies):
    """Per strategy: model-state bytes by category on this rank, bytes moved per step, losses."""
    import torch.distributed as tdist
    from minifsdp import dist
    from minifsdp.memory import GRADIENTS, OPTIMIZER, PARAMETERS, MemoryTracker
    from minifsdp.zero import all_reduce_gradients

    def settled(tracker, label):
        books = tracker.snapshot(label)
        for _ in range(200):
            time.sleep(0.002)
            again = tracker.snapshot(label)
            if again == books:
                return books
            books = again
        return books

    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    out = {}
    for strategy in strategies:
        module = models.build_model(model_name).to(device)
        if strategy == "ddp":
            model, opt = module, torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, eps=EPS)
            owned = list(module.parameters())
        else:
            model, opt = wrap_zero(module, 1 if strategy == "zero1" else 2, lr=LR, weight_decay=WD, eps=EPS)
            owned = opt.local_params
        tracker, tracer, losses = MemoryTracker(), trace.Tracer(rank=rank), []
        tracker.track_model(module)
        with tracker, tracer:
            for step in range(steps):
                x, y = data.get_batch(step, global_batch, seq_len, rank=rank, world_size=n)
                with trace.span("step"):
                    loss = models.lm_loss(model(x.to(device)), y.to(device))
                    loss.backward()
                    if strategy == "ddp":
                        all_reduce_gradients(module)
                    after_backward = settled(tracker, "backward")
                    opt.step()
                    after_step = settled(tracker, "step")
                opt.zero_grad(set_to_none=True)
                total = loss.detach().reshape(1).clone()
                tdist.all_reduce(total)
                losses.append(total.item() / n)
        tracker.close()
        spans = tracer.trace.comm_spans()   # the tracer opened after wrapping: step traffic only
        out[strategy] = {
            "parameters": after_backward[PARAMETERS], "gradients": after_backward[GRADIENTS],
            "optimizer": after_step[OPTIMIZER], "losses": losses,
            "owned_numel": sum(p.numel() for p in owned), "owned_tensors": len(owned),
            "bytes": {op: b // steps for op, b in tracer.trace.bytes_by_op(within="step").items()},
            "ring_bytes": sum(s.args["ring_bytes"] for s in spans) // steps,
            "calls": len(spans) // steps,
        }
    return out


t0 = time.perf_counter()
mem_runs = {}
for n in (1, 2, 4):
    mem_runs[n] = minifsdp.launch(model_state_worker, n, MEM_MODEL, MEM_STEPS, MEM_B, MEM_T, STRATEGIES,
                                  backend="gloo", timeout=120)   # CPU even on a GPU machine
mem_ref = single_process(MEM_MODEL, MEM_STEPS, MEM_B, MEM_T)
print(f"{MEM_MODEL}: {mem_ref['n_params']:,} parameters; 3 world sizes x 3 strategies x {MEM_STEPS} steps "
      f"in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ### Exercise 2: predict each rank's model states to the byte
#
# The formula divides by `N`; a real rank holds what it *owns*, whole parameters.
# Write `predict_model_states(stage, n_params, owned_numel, owned_tensors)`: the
# bytes of parameters, gradients (after backward) and AdamW state (after a step)
# on one rank, fp32, for stage 0 (DDP), 1 or 2. `owned_numel` and `owned_tensors`
# describe the parameters this rank's optimizer steps (for DDP, all of them).
# The check holds it against the tracker's books of every rank of the nine runs.

# %%
STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2}
psi_mini = mem_ref["n_params"]


def predict_model_states(stage: int, n_params: int, owned_numel: int, owned_tensors: int) -> dict[str, int]:
    """Bytes held by one rank: {"parameters": ..., "gradients": ..., "optimizer": ...} (fp32, AdamW)."""
    # BEGIN SOLUTION
    # HINT: which of the three does each stage shard (section 1's table)? A sharded term counts the owned elements, an unsharded one all n_params; fp32 is 4 B per element, AdamW keeps two moments per element and one 4-byte step counter per tensor it steps.
    grads = owned_numel if stage >= 2 else n_params      # ZeRO-2: only the owned gradients survive
    return {"parameters": FP32 * n_params,                 # stages 0-2 never shard the parameters
            "gradients": FP32 * grads,
            "optimizer": 2 * FP32 * owned_numel + FP32 * owned_tensors}   # exp_avg, exp_avg_sq; step
    # END SOLUTION

# %%
# CHECK: predict_model_states against every rank of every run of section 4
def _diagnose_states(cat: str, got: int, want: int, n: int, out: dict) -> str:
    """The likely slip behind a wrong prediction, in words."""
    owned, k = out["owned_numel"], out["owned_tensors"]
    if got * FP32 == want or (cat == "optimizer" and got == 2 * owned + k):
        return "you counted elements: fp32 is 4 bytes per element"
    per_element = {"parameters": FP32, "gradients": FP32, "optimizer": 2 * FP32}[cat]
    if n > 1 and abs(got - per_element * psi_mini / n) <= FP32 * k + 1:
        return ("you divided all the parameters by N: a rank owns whole parameters, so count owned_numel "
                "(the shards are not equal)")
    hints = {
        ("parameters", FP32 * owned): "stages 0-2 keep every parameter on every rank (sharding them is ZeRO-3)",
        ("gradients", FP32 * owned): "ZeRO-1 keeps every averaged gradient (it all-reduces); only ZeRO-2 shards them",
        ("gradients", FP32 * psi_mini): "ZeRO-2 keeps only the gradients of the owned parameters",
        ("optimizer", 2 * FP32 * owned): f"you forgot AdamW's 4-byte step counter, one per owned tensor ({k} here)",
        ("optimizer", 2 * FP32 * psi_mini + FP32 * len(list(models.build_model(MEM_MODEL, device="meta").parameters()))):
            "from stage 1 on, the optimizer state covers the owned parameters only",
    }
    return hints.get((cat, got), "sharded terms count the owned elements, unsharded ones all n_params; "
                                 "AdamW: 2 x 4 B per element + 4 B per tensor")


for strategy in STRATEGIES:
    for n, results in mem_runs.items():
        for r, out in enumerate(r_out[strategy] for r_out in results):
            stage = STAGE_OF[strategy]
            got = predict_model_states(stage, psi_mini, out["owned_numel"], out["owned_tensors"])
            assert isinstance(got, dict) and set(CATS) <= set(got), \
                f"return a dict with the keys {CATS}, got {got!r}"
            for cat in CATS:
                assert int(got[cat]) == out[cat], (
                    f"stage {stage} ({strategy}), {n} ranks, rank {r}: you predict {int(got[cat]):,} B of {cat}, "
                    f"the tracker measured {out[cat]:,} B: " + _diagnose_states(cat, int(got[cat]), out[cat], n, out))
print("predict_model_states: right to the byte on every rank of the 9 runs")

# %% [markdown]
# The table puts three numbers side by side for each category, on the rank that
# holds the most (the one that decides whether a model fits):
#
# * **measured**: the tracker's books;
# * **formula**: `estimate.model_state_bytes_per_device(Ψ, N, stage, padding=False)`,
#   fp32: `4Ψ + 4Ψ + 8Ψ` bytes for `Ψ` parameters, each term divided by `N` where
#   the stage shards it;
# * **exact**: your `predict_model_states`, from what the rank owns.

# %%
# NBVAL_CHECK_OUTPUT
def exact_bytes(strategy, out):
    return predict_model_states(STAGE_OF[strategy], psi_mini, out["owned_numel"], out["owned_tensors"])


print(f"{'':8}{'N':>2}" + "".join(f"{c + ' MiB':>26}" for c in CATS))
print(f"{'':10}" + f"{'measured formula exact':>26}" * 3)
mem_table = {}
for strategy in STRATEGIES:
    for n, results in mem_runs.items():
        for out in (r[strategy] for r in results):   # exact, on every rank, to the byte
            assert {c: out[c] for c in CATS} == {c: exact_bytes(strategy, out)[c] for c in CATS}, (strategy, n)
        worst = max((r[strategy] for r in results), key=lambda o: sum(o[c] for c in CATS))
        formula = estimate.model_state_bytes_per_device(psi_mini, n, STAGE_OF[strategy], padding=False)
        mem_table[strategy, n] = (worst, formula)
        print(f"{strategy:8}{n:>2}" + "".join(
            f"{worst[c] / MiB:>10.2f}{formula[c] / MiB:>8.2f}{exact_bytes(strategy, worst)[c] / MiB:>8.2f}"
            for c in CATS))
print("measured == exact on every rank, to the byte")

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True)
width = 0.26
for ax, strategy in zip(axes, STRATEGIES):
    for i, cat in enumerate(CATS):
        xs = np.arange(3) + (i - 1) * width
        measured = [mem_table[strategy, n][0][cat] / MiB for n in (1, 2, 4)]
        formula = [mem_table[strategy, n][1][cat] / MiB for n in (1, 2, 4)]
        ax.bar(xs, measured, width, color=plot.color_for(cat), label=f"{cat} (measured)")
        ax.hlines(formula, xs - 0.6 * width, xs + 0.6 * width, color="k", lw=2,
                  label="formula (estimate)" if i == 0 else None)
    ax.set_xticks(range(3), ["N = 1", "N = 2", "N = 4"])
    ax.set_title({"ddp": "DDP", "zero1": "ZeRO-1 (OSS)", "zero2": "ZeRO-2 (ShardedDataParallel)"}[strategy])
axes[0].set_ylabel("bytes on the largest rank (MiB)")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
fig.suptitle(f"{MEM_MODEL} ({psi_mini:,} parameters), fp32 AdamW: model states per rank, measured")
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# Parameters and DDP's or ZeRO-1's gradients match the formula exactly: nothing is
# divided. Where the formula divides by `N`, the measured bars sit a little above
# the black marks: whole parameters cannot be split evenly (a shard is `Ψ/N` plus
# at most one parameter), and AdamW keeps a 4-byte step counter per tensor. The
# "exact" column, counted from the partition, is met to the byte. FSDP (lab 04)
# flattens the parameters into one vector, pads it to a multiple of `N` and gives
# each rank an equal slice, so its shards are exact.
#
# Did all nine runs train the same model? The loss of the second step (after one
# update) against one process:

# %%
worst_loss = max(abs(r[s]["losses"][-1] - mem_ref["losses"][-1])
                 for results in mem_runs.values() for r in results for s in STRATEGIES)
print(f"one process: second-step loss {mem_ref['losses'][-1]:.6f}; "
      f"largest difference over 9 runs and all ranks: {worst_loss:.1e}")
assert worst_loss <= 1e-5, "a strategy trained a different model"

# %% [markdown]
# ### Bytes moved per step
#
# Two ways to count, both recorded by `comm` for every collective:
#
# * **volume**, the ZeRO paper's unit (section 7): an all-reduce of `S` bytes counts
#   `2S` (it is a reduce-scatter plus an all-gather), a reduce, broadcast or
#   all-gather `S`;
# * **sent per rank** with ring algorithms: `(N-1)/N` of the volume.
#
# Here, as in the paper's section 7, `Ψ` counts the *bytes* of the parameters
# (every gradient has the same size). The formula column is
# `estimate.comm_bytes_per_step(n_params, N, strategy, ring=False)`. Note `"oss"` there: FairScale's ZeRO-1 (and ours) all-reduces the gradients and
# then broadcasts the parameters, `3Ψ`; the paper's ZeRO-1 reduce-scatters the
# gradients instead, `2Ψ`, which is in effect what ZeRO-2 does.

# %%
# NBVAL_CHECK_OUTPUT
FORMULA_NAME = {"ddp": "ddp", "zero1": "oss", "zero2": "zero2"}
psi_mini_bytes = FP32 * psi_mini
print(f"parameter bytes: {psi_mini_bytes / MiB:.2f} MiB (= Psi in this table)")
print(f"{'':7}{'N':>2}  {'by collective, MiB':<34}{'volume':>8}{'formula':>9}{'in Psi':>8}"
      f"{'sent/rank':>11}{'(N-1)/N vol':>12}")
comm_table = {}
for strategy in STRATEGIES:
    for n in (2, 4):
        out = mem_runs[n][0][strategy]
        assert all(r[strategy]["bytes"] == out["bytes"] for r in mem_runs[n]), "ranks moved different bytes"
        volume = sum(out["bytes"].values())
        formula = estimate.comm_bytes_per_step(psi_mini, n, FORMULA_NAME[strategy], ring=False)["total"]
        assert volume == formula, (strategy, n, volume, formula)
        ring_formula = volume * (n - 1) / n
        assert abs(out["ring_bytes"] - ring_formula) <= out["calls"], (strategy, n)  # < 1 B rounding per call
        comm_table[strategy, n] = volume
        ops = ", ".join(f"{op} {b / MiB:.2f}" for op, b in sorted(out["bytes"].items()))
        print(f"{strategy:7}{n:>2}  {ops:<34}{volume / MiB:>8.2f}{formula / MiB:>9.2f}"
              f"{volume / psi_mini_bytes:>7.0f}x{out['ring_bytes'] / MiB:>11.2f}{ring_formula / MiB:>12.2f}")
print("1 rank: nothing moves:", {s: mem_runs[1][0][s]["bytes"] for s in STRATEGIES})

# %%
fig, ax = plt.subplots(figsize=(8, 3.6))
OPS = ("all_reduce", "reduce", "broadcast")
labels, seen = [], set()
for x, (strategy, n) in enumerate((strat, n) for strat in STRATEGIES for n in (2, 4)):
    bottom = 0.0
    for op in OPS:
        mib = mem_runs[n][0][strategy]["bytes"].get(op, 0) / MiB
        if mib:   # stacked, one colour per collective, each named once in the legend
            ax.bar(x, mib, 0.6, bottom=bottom, color=plot.color_for(op), label=None if op in seen else op)
            seen.add(op)
            bottom += mib
    labels.append(f"{strategy}\nN = {n}")
ax.axhline(2 * psi_mini_bytes / MiB, color="k", ls="--", lw=1)
ax.text(5.4, 2 * psi_mini_bytes / MiB * 1.03, "2Ψ", fontsize=9)
ax.set_xticks(range(len(labels)), labels)
ax.set_ylabel("volume per step (MiB)")
ax.set_title(f"{MEM_MODEL}: bytes moved per training step, by collective (volume convention)")
ax.legend(fontsize=8, loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# DDP and ZeRO-2 move the same `2Ψ`; FairScale-style ZeRO-1 moves `3Ψ`. None of it
# depends on `N`: per rank, the ring sends `(N-1)/N` of the volume, which tends to
# the volume itself. So ZeRO-2 is the better deal: the same traffic as DDP for
# `1/N` of the gradient and optimizer memory. What neither can divide is the `4Ψ`
# of fp32 parameters every rank still holds: lab 04 shards those too (ZeRO-3,
# FSDP), at the price of gathering them before each use, `3Ψ` per step.

# %% [markdown]
# ## 5. The same strategies from the trainer
#
# `minifsdp.train` runs every strategy with one loop (the model and optimizer come
# from a registry); from a shell it is
# `python -m minifsdp.train --strategy zero2 --world-size 2 --model gpt-mini`.
# It tracks memory over the whole step, so its peak includes what the model states
# leave out: activations, the optimizer's scratch during `step()`, communication
# buffers. Its `zero1` is `OSS` on top of lab 02's bucketed `DistributedDataParallel`
# (the same bytes as `wrap_zero(model, 1)`, in fewer, overlapped all-reduces; it is
# what `torch-zero1` does with PyTorch's DDP and `ZeroRedundancyOptimizer`), so its
# peak also holds DDP's gradient buckets. Two steps of `gpt-mini` on 2 ranks, with
# the trainer's default AdamW:

# %%
import tempfile  # noqa: E402

from minifsdp.train import TrainConfig, train  # noqa: E402

t0 = time.perf_counter()
trained = {}
for strategy, n in (("single", 1), ("ddp", 2), ("zero1", 2), ("zero2", 2)):
    with tempfile.TemporaryDirectory() as out:   # metrics.json, trace.json and plots land here
        trained[strategy] = train(TrainConfig(strategy=strategy, world_size=n, model=MEM_MODEL, steps=2,
                                              batch_size=MEM_B, seq_len=MEM_T, out=out, quiet=True,
                                              timeout=120))
print(f"4 runs of the trainer in {time.perf_counter() - t0:.1f} s")

# %%
print(f"{'':8}{'losses':>22}{'peak MiB per rank':>20}   at rank 0's peak, MiB")
for strategy, m in trained.items():
    at_peak = m["peak_by_category"][0]
    rest = sum(v for k, v in at_peak.items() if k not in CATS)
    print(f"{strategy:8}{', '.join(f'{v:.5f}' for v in m['losses']):>22}"
          f"{', '.join(f'{b / MiB:.1f}' for b in m['peak_bytes']):>20}   "
          + ", ".join(f"{c} {at_peak[c] / MiB:.1f}" for c in CATS) + f", the rest {rest / MiB:.1f}")
    assert max(abs(a - b) for a, b in zip(m["losses"], trained["single"]["losses"])) <= 1e-5, strategy
for strategy in ("zero1", "zero2"):
    assert max(trained[strategy]["peak_bytes"]) < min(trained["ddp"]["peak_bytes"]), strategy
print("every strategy reproduces single's losses (|diff| <= 1e-5); both ZeRO stages peak below DDP")
rest = {s: sum(v for k, v in m["peak_by_category"][0].items() if k not in CATS) for s, m in trained.items()}
print(f"DDP's rest minus one process's: {(rest['ddp'] - rest['single']) / MiB:.2f} MiB "
      f"= {(rest['ddp'] - rest['single']) / psi_mini_bytes:.2f} x the parameter bytes")

# %% [markdown]
# The peaks tell the same story as the model states, plus what ZeRO does not
# touch. Where a peak's "optimizer" column exceeds the state itself, that is
# AdamW's scratch inside `step()`, for the parameters the rank steps, so it shrinks
# with the shard too. DDP's "rest" is bigger than one process's by the amount the
# last line printed: its gradient buckets (lab 02), where the all-reduce runs.
#
# **Summary.** ZeRO-1 gives each rank the optimizer state of the parameters it owns
# (a deterministic greedy partition, no communication needed to agree on it) and
# re-assembles the model with one broadcast per step. ZeRO-2 also sends each
# gradient only to its owner, with a reduce, and frees the rest during backward.
# Both train the very same model as one process; the memory tables above were
# measured to the byte and match the partition exactly and the `Ψ/N` formula up
# to the last whole parameter.

# %%
print(f"the whole notebook ran in {time.perf_counter() - notebook_start:.1f} s")
