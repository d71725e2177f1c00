# Lab 09 - putting it together. Source of solutions/09_putting_it_together.ipynb and
# labs/09_putting_it_together.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 09 - Putting it together: meshes, 2D layouts and the planner
#
# Real training combines techniques on a **mesh** of ranks, one group per dimension.
#
# **You will be able to**: place any rank on a (dp × pp × tp) mesh and list its groups;
# build FSDP × TP and PP × DP from the mesh's groups; price a layout's bytes and model
# states by hand; choose a layout under a memory cap and see a run confirm it.
#
# **Prerequisites**: labs 02-04 (DDP, ZeRO, FSDP), 07 (pipelines) and 08 (tensor parallel).
# **Time**: 60 minutes of work; about 2 minutes of compute on a laptop or a GPU VM (with
# fewer than 4 GPUs, the 4-rank runs use CPU ranks).
#
# **Exercises**: 1. the mesh · 2. FSDP × TP and PP × DP · 3. costs by hand · 4. a layout
# under a cap. Stuck? `check.hint("mesh_groups")` (any exercise's name).

# %%
import statistics
import tempfile
import time

from minifsdp import comm, dist, models, planner, plot, tensor_parallel, widgets
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from minifsdp.estimate import format_bytes
from minifsdp.labcheck import lab09 as check
from minifsdp.mesh import DeviceMesh
from minifsdp.pipeline import PipelineStage, Schedule1F1B, split_gpt
from minifsdp.train import TrainConfig, train

notebook_start = time.perf_counter()
DEVICES = 4                                        # the lab's layouts use 4 ranks (CPU ranks where GPUs are fewer)
MODEL, B, T, CAP = "gpt-mini", 8, 64, 28 * 2**20   # section 5: a model, a batch, a memory cap per device

# %% [markdown]
# ## 1. Exercise 1: the mesh
#
# Megatron-LM and FairScale number the ranks with **tp varying fastest**, then pp, then
# dp: the ranks of one tensor-parallel group are consecutive, which on a GPU machine
# means the GPUs of one node, joined by the fastest links (TP talks in every layer).
#
# A group along a dimension is the ranks that differ **only** in that coordinate. Each
# becomes one `torch.distributed` process group (every rank creates every group, in the
# same order).
#
# **Goal**: `mesh_coords` gives a rank's place; `mesh_groups` lists every group along one
# dimension. **Target**: every rank and every group of five meshes equal
# `minifsdp.mesh.DeviceMesh`'s, which you may not call.

# %%
def mesh_coords(rank, dp, pp, tp):
    """{"dp": d, "pp": p, "tp": t}: where ``rank`` sits on a (dp x pp x tp) mesh, tp fastest."""
    # BEGIN SOLUTION
    # HINT: place a rank on the mesh, then group the ranks; stuck? check.hint("mesh_coords")
    return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}
    # END SOLUTION


def mesh_groups(dim, dp, pp, tp):
    """Every group along ``dim`` ("dp", "pp" or "tp"): a list of groups, each a list of ranks."""
    # BEGIN SOLUTION
    # HINT: ranks that differ only in ``dim``; stuck? check.hint("mesh_groups")
    groups = {}
    for rank in range(dp * pp * tp):
        c = mesh_coords(rank, dp, pp, tp)
        key = tuple(v for d, v in c.items() if d != dim)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())
    # END SOLUTION

# %%
# CHECK: every rank and every group of five meshes, against minifsdp.mesh.DeviceMesh
check.mesh(mesh_coords, mesh_groups)

# %% [markdown]
# `minifsdp.mesh.DeviceMesh` is that arithmetic plus the process groups; tensor parallel
# and the trainer's FSDP × TP take their groups from it. Drawn for 8 ranks:

# %%
# FIGURE
mesh = DeviceMesh(dp=2, pp=2, tp=2)
print(mesh)
plot.mesh_diagram(mesh)

# %% [markdown]
# *Takeaway: a row (dashed) splits every layer; a column holds the same weights and sees
# different data; each panel is one pipeline stage.*

# %% [markdown]
# ## 2. Exercise 2: two 2D layouts from the mesh
#
# **FSDP × TP** on `DeviceMesh(dp=2, tp=2)`: split the GPT with tensor parallel over the
# mesh's tp dimension (lab 08), then shard each rank's slices with FSDP (lab 04) over the
# ranks that hold the **same** slices, one unit per parallel block.
#
# **PP × DP** on `DeviceMesh(dp=2, pp=2)`: two pipelines of two stages. Each replica runs
# a 1F1B step (lab 07) on its own slice of the batch; the ranks holding the same stage
# then average their gradients (lab 02).
#
# Your building blocks: `tensor_parallel` (lab 08), `FullyShardedDataParallel` with
# `ModuleWrapPolicy` (lab 04), `split_gpt`, `PipelineStage`, `Schedule1F1B` (lab 07),
# `comm`, and the mesh's `get_group`, `get_local_rank`, `size`.
#
# **Targets** on 4 ranks: losses (FSDP × TP) and gradients (PP × DP) equal one process's;
# PP × DP all-reduces each stage gradient once (2·4 bytes per stage parameter).

# %%
def fsdp_tp(model, mesh):
    """``model`` (a GPT) split by tensor parallel over the mesh's tp dimension, then sharded with FSDP
    over the ranks holding the same slices. Returns the wrapped module."""
    # BEGIN SOLUTION
    # HINT: TP first, FSDP around it; stuck? check.hint("fsdp_tp")
    tensor_parallel.initialize_model_parallel(mesh.size("tp"), mesh=mesh)
    parallel = tensor_parallel.tensor_parallel_gpt(model)
    return FullyShardedDataParallel(parallel, process_group=mesh.get_group("dp"),
                                    auto_wrap_policy=ModuleWrapPolicy({tensor_parallel.ParallelBlock}))
    # END SOLUTION


def pp_dp_step(model, mesh, x, y, m):
    """On this rank: its pipeline stage of ``model``, one 1F1B step of m micro-batches on this replica's
    slice of (x, y), gradients averaged over the replicas. Returns (stage module, the last stage's losses:
    a list of m floats on the last stage, empty elsewhere)."""
    losses = []
    # BEGIN SOLUTION
    # HINT: this rank's stage, its replica's slice, then the average; stuck? check.hint("pp_dp_step")
    d, s, pp, dp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp"), mesh.size("pp"), mesh.size("dp")
    x, y = x.chunk(dp)[d], y.chunk(dp)[d]
    part = split_gpt(model, pp)[s]
    stage = PipelineStage(part, s, pp, dist.device(), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, m, loss_fn=models.lm_loss)
    last = {"target": y, "losses": losses} if s == pp - 1 else {}
    schedule.step(*((x,) if s == 0 else ()), **last)
    for q in part.parameters():
        comm.all_reduce(q.grad, group=mesh.get_group("dp"))
        q.grad /= dp
    # END SOLUTION
    return part, losses

# %%
# CHECK: both layouts on 4 ranks against one process: losses, gradients, collectives, bytes
check.two_d(fsdp_tp, pp_dp_step)

# %% [markdown]
# *Takeaway: in PP × DP the sends and receives (pp) carry one micro-batch's activations or
# their gradients, tokens × d values; the all-reduce (dp) carries only the rank's own
# stage's gradients.*
#
# ## 3. Two dimensions at once, measured
#
# The trainer has both layouts you just built: `--strategy fsdp+tp` and `--strategy pp+dp`.
# Both reproduce one process's losses. They, and one run of each single technique, give
# the measurements the last section ranks (`gpt-tiny`, B = 8, T = 32, memory tracked).

# %%
RUNS = {"single": dict(strategy="single", world_size=1), "ddp": dict(strategy="ddp", world_size=4),
        "fsdp": dict(strategy="fsdp", world_size=4), "tp": dict(strategy="tp", world_size=2, tp=2),
        "fsdp+tp": dict(strategy="fsdp+tp", world_size=4, dp=2, tp=2),
        "pp+dp": dict(strategy="pp+dp", world_size=4, pp=2, dp=2, micro_batches=2)}
runs, out = {}, tempfile.mkdtemp(prefix="lab09-")
for name, kw in RUNS.items():
    runs[name] = train(TrainConfig(model="gpt-tiny", steps=2, batch_size=8, quiet=True, write_plots=False,
                                   out=f"{out}/{name}", **kw))
rows = [{"name": name, "ranks": m["world_size"], "peak": max(p for p in m["peak_bytes"] if p),
         "bytes": sum(m["bytes_per_step"][0].values()),
         "step_ms": 1e3 * statistics.median(max(t) for t in zip(*m["step_time_s"])),
         "same_loss": all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(m["losses"], runs["single"]["losses"]))}
        for name, m in runs.items()]
print(f"{'run':>8} {'ranks':>5} {'peak/rank':>11} {'moved/step':>11} {'step ms':>8}  losses = single")
for r in rows:
    print(f"{r['name']:>8} {r['ranks']:>5} {format_bytes(r['peak']):>11} {format_bytes(r['bytes']):>11} "
          f"{r['step_ms']:8.1f}  {r['same_loss']}")
measured = {r["name"]: r for r in rows}

# %% [markdown]
# *Takeaway: every layout reproduces one process's losses; the bytes per step are what
# separates them (on 2 CPU cores the step times say little: the ranks share the cores).*

# %% [markdown]
# ## 4. Exercise 3: a layout's cost, by hand
#
# **TP's bytes.** Explain the `tp` row above to the byte from the model's shape (lab 08
# names every all-reduce tensor parallel makes, forward and backward, the loss's
# included). `comm` records an all-reduce of S bytes as 2S (a reduce-scatter, then an
# all-gather). gpt-tiny: L = 2 blocks, d = 32; the tp run sees 8 × 32 tokens per step.
#
# **Model states.** fp32 AdamW keeps 4 bytes of weight, 4 of gradient and 8 of optimizer
# state per parameter; each ZeRO stage shards one more of them over dp (lab 03). For n
# parameters on a device (what tp and pp leave it), return what one device keeps.
#
# **Targets**: the tracer's bytes, exactly; the ZeRO paper's states (every stage, dp
# 1-8). `minifsdp.planner` and `minifsdp.estimate` compute both: not allowed here.

# %%
def tp_bytes_per_step(n_layer, hidden, tokens):
    """Bytes the tp run's all-reduces move per step (comm's volume, an int), from the model's shape."""
    # BEGIN SOLUTION
    # HINT: count tensor parallel's all-reduces and their sizes; stuck? check.hint("tp_bytes_per_step")
    activations = (4 * n_layer + 2) * tokens * hidden * 4
    loss = 3 * tokens * 4
    return 2 * (activations + loss)
    # END SOLUTION


def state_bytes(n, dp, zero_stage):
    """{"parameters", "gradients", "optimizer"}: bytes one device keeps for n parameters, fp32 AdamW."""
    # BEGIN SOLUTION
    # HINT: the replicated figures first, then what each stage shards; check.hint("state_bytes")
    parameters, gradients, optimizer = 4 * n, 4 * n, 8 * n
    if zero_stage >= 1:
        optimizer /= dp
    if zero_stage >= 2:
        gradients /= dp
    if zero_stage >= 3:
        parameters /= dp
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer}
    # END SOLUTION

# %%
# CHECK: TP's bytes against the tracer; model states against the ZeRO paper and the planner
check.layout_costs(tp_bytes_per_step, state_bytes, measured["tp"]["bytes"], MODEL, B, T, DEVICES)

# %% [markdown]
# Your `state_bytes` on `gpt-mini` (3.3 M parameters) over 4 devices: model states per
# device, every ZeRO stage beside tensor parallel.

# %%
print(f"{'layout':>16} {'params/dev':>11} {'parameters':>11} {'gradients':>10} {'optimizer':>10} {'states':>9}")
for dp, tp, zero in [(4, 1, 0), (4, 1, 1), (4, 1, 2), (4, 1, 3), (1, 4, 0), (2, 2, 3)]:
    n = planner.plan(MODEL, batch=B, seq_len=T, dp=dp, tp=tp).params_per_device
    mine = state_bytes(n, dp, zero)
    print(f"{f'dp{dp} tp{tp} ZeRO-{zero}':>16} {n:>11,} " + " ".join(
        f"{format_bytes(mine[k]):>{w}}" for k, w in (("parameters", 11), ("gradients", 10), ("optimizer", 10)))
          + f" {format_bytes(sum(mine.values())):>9}")

# %% [markdown]
# *Takeaway: ZeRO-3 and TP both divide the states by 4 here; what differs is what they
# move per step and whether the activations shrink too.*
#
# ## 5. The planner
#
# `planner.plan(model, batch=, seq_len=, dp=, tp=, pp=, zero_stage=, ...)` prices a layout
# without running it: bytes per device by category (`.memory`, `.total_memory` the peak,
# `.fits(cap)`) and bytes moved per step by mesh dimension (`.comm`). Move the sliders.

# %%
print(planner.plan(MODEL, batch=B, seq_len=T))
widgets.planner_widget(MODEL, batch=B, seq_len=T, cap_bytes=CAP)

# %%
# FIGURE
widgets.planner_figure(planner.plan(MODEL, batch=B, seq_len=T, dp=2, tp=2, zero_stage=3), cap_bytes=CAP)

# %% [markdown]
# *Takeaway: the stacked bar adds every category's own largest size, but they are not all
# alive at once (a unit's gathered parameters are freed before the next is gathered), so
# the bar can rise above the black peak line, which is the largest sum alive together.*

# %% [markdown]
# ## 6. Exercise 4: a layout for a model that does not fit
#
# `gpt-mini` with B = 8, T = 64 and fp32 AdamW needs about 73 MiB on one device; ours hold
# 28 MiB each, and there are 4. **Goal**: among tp in 1, 2, 4 (dp = devices / tp) and ZeRO
# stage 0 or 3 (3 whenever both dp and tp exceed 1: FSDP × TP), return the layout that
# fits under the cap and moves the fewest bytes per step. Use the planner to price each
# candidate. **Target**: the check runs your layout for real: its peak within 10 % of the
# prediction and its bytes exact.

# %%
def choose_layout(model, batch, seq_len, cap_bytes, devices):
    """{"dp": .., "tp": .., "zero_stage": ..}: fits under cap_bytes on every device, fewest bytes per step.
    Raises ValueError when no candidate fits."""
    # BEGIN SOLUTION
    # HINT: price every candidate, keep those that fit, pick the cheapest; check.hint("choose_layout")
    best = None
    for tp in (1, 2, 4):
        dp = devices // tp
        for zero in (0, 3):
            if dp > 1 and tp > 1 and zero == 0:
                continue
            p = planner.plan(model, batch=batch, seq_len=seq_len, dp=dp, tp=tp, zero_stage=zero)
            moved = sum(sum(ops.values()) for ops in p.comm.values())
            if p.fits(cap_bytes) and (best is None or moved < best[0]):
                best = (moved, {"dp": dp, "tp": tp, "zero_stage": zero})
    if best is None:
        raise ValueError(f"no layout of {devices} devices fits {model} under {format_bytes(cap_bytes)}")
    return best[1]
    # END SOLUTION

# %%
# CHECK: your layout fits, moves the fewest bytes, and a real run matches the prediction (peak 10 %, bytes exact)
check.planned_layout(choose_layout, MODEL, B, T, DEVICES, CAP)

# %% [markdown]
# ## 7. Which to choose
#
# Back to the runs of section 3: under a memory cap (here half the single process's peak),
# the runs that fit, fewest bytes per step first.

# %%
cap = runs["single"]["peak_bytes"][0] / 2
fitting = sorted((r for r in rows if r["peak"] <= cap), key=lambda r: r["bytes"])
print(f"under {format_bytes(cap)} per rank, fewest bytes first: "
      + ", ".join(f"{r['name']} ({format_bytes(r['bytes'])}/step)" for r in fitting))

# %% [markdown]
# ## Summary: which to choose
#
# * **DDP** (lab 02): whole model on every rank, 2·4Ψ bytes per step (Ψ parameters); the default when it fits.
# * **ZeRO / FSDP** (labs 03-04): shard optimizer state, gradients, parameters over dp:
#   memory falls by up to dp, at 3·4Ψ bytes (1.5× DDP's) for FULL_SHARD. The first tool when
#   the *model states* do not fit.
# * **TP** (lab 08): splits every layer and its activations; 4 all-reduces of B·T·d values
#   per block, so it stays inside a machine (NVLink).
# * **PP** (lab 07): splits the layers into stages; only activations cross stage borders,
#   so it crosses slow links well; it pays a bubble that shrinks with more micro-batches.
# * Combined: TP inside a node × PP across nodes × DP/FSDP over the rest: the mesh of
#   section 1. The planner says what fits; the tracer and memory tracker confirm it.

# %% [markdown]
# **Next**: sequences too long for one device? Lab 10 splits each sequence across ranks (context parallel).
# A mixture of experts' experts too many for one device? Lab 11 spreads them across ranks (expert parallel).

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
