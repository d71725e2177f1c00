# Lab 09 - putting it together. Source of solutions/09_putting_it_together.ipynb and
# labs/09_putting_it_together.ipynb: edit this file, then run tools/make_labs.py.

# %% [markdown]
# # 09 - Putting it together: meshes, 2D layouts and the planner
#
# Each lab so far used one technique. Real training combines them: data parallel across
# machines, tensor parallel inside one, pipeline stages between. The ranks form a
# **mesh**, and every rank belongs to one group per dimension. This lab builds the mesh
# arithmetic, runs FSDP × TP and PP × DP on 4 ranks, lets the **planner** choose a layout
# for a model that does not fit one device, runs it, and ends with a which-to-choose
# table made of this notebook's own measurements.
#
# **You will be able to**: place any rank on a (dp × pp × tp) mesh and list its groups;
# build FSDP × TP and PP × DP from the mesh's groups; price a layout's model states per
# device; choose a layout under a memory cap and see the prediction confirmed by a run;
# rank strategies by what they cost.
#
# **Prerequisites**: labs 02-04 (DDP, ZeRO, FSDP), 07 (pipeline parallel) and 08 (tensor
# parallel).
# **Time**: about 60 minutes of work; the cells compute for about a minute on a laptop
# (runs of 2 and 4 ranks), the same on a GPU VM.
#
# **Exercises**: 1. mesh coordinates · 2. mesh groups · 3. FSDP × TP from the mesh ·
# 4. PP × DP from the mesh · 5. TP's bytes by hand · 6. model states per device ·
# 7. choose a layout under a cap · 8. which to choose.
#
# **Symbols**: dp, pp, tp = ranks along each mesh dimension; Ψ = parameters; B = batch,
# T = sequence length.

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
DEVICES = 4
MODEL, B, T, CAP = "gpt-mini", 8, 64, 28 * 2**20   # section 5: a model, a batch, a memory cap per device

# %% [markdown]
# ## 1. Exercise 1: where a rank sits
#
# Megatron-LM and FairScale number the ranks with **tp varying fastest**, then pp, then
# dp: the ranks of one tensor-parallel group are consecutive, which on a GPU machine
# means the GPUs of one node, joined by the fastest links (TP talks in every layer). So
# `rank = d·(pp·tp) + p·tp + t`. Write the inverse.

# %%
def mesh_coords(rank, dp, pp, tp):
    """{"dp": d, "pp": p, "tp": t} of ``rank`` on a (dp x pp x tp) mesh, tp fastest."""
    # BEGIN SOLUTION
    # HINT: the last coordinate is the remainder by its size; divide it away and repeat
    return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}
    # END SOLUTION

# %%
# CHECK: every rank of five meshes, against minifsdp.mesh.DeviceMesh
check.mesh_coords(mesh_coords)

# %% [markdown]
# ## 2. Exercise 2: the groups
#
# A group along a dimension is the ranks that differ **only** in that coordinate: the
# tp group of rank 5 holds the ranks with rank 5's dp and pp. Each such group becomes one
# `torch.distributed` process group (every rank must create every group, in the same
# order). Return all the groups along `dim`.

# %%
def mesh_groups(dim, dp, pp, tp):
    """Every group along ``dim`` ("dp", "pp" or "tp") of a (dp x pp x tp) mesh, each a list of ranks."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    # BEGIN SOLUTION
    # HINT: group the ranks by their other two coordinates (your mesh_coords gives them)
    groups = {}
    for rank in range(dp * pp * tp):
        c = mesh_coords(rank, dp, pp, tp)
        key = tuple(c[d] for d in sizes if d != dim)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())
    # END SOLUTION

# %%
# CHECK: dp, pp and tp groups of five meshes
check.mesh_groups(mesh_groups)

# %% [markdown]
# `minifsdp.mesh.DeviceMesh` is that arithmetic plus the process groups; tensor parallel
# and the trainer's FSDP × TP take their groups from it. Drawn for 8 ranks:

# %%
mesh = DeviceMesh(dp=2, pp=2, tp=2)
print(mesh)
plot.mesh_diagram(mesh)

# %% [markdown]
# Takeaway: a row (dashed) splits every layer; a column holds the same weights and sees
# different data; each panel is one pipeline stage.
#
# ## 3. Exercise 3: FSDP × TP from the mesh
#
# Build the 2D layout yourself on a `DeviceMesh(dp=2, tp=2)`: give the mesh to tensor
# parallel (`tensor_parallel.initialize_model_parallel(tp, mesh=mesh)`), split the GPT
# (`tensor_parallel.tensor_parallel_gpt`, lab 08), then shard each rank's slices with FSDP
# over the ranks that hold the **same** slices: the mesh's dp group
# (`mesh.get_group("dp")`), one FSDP unit per `tensor_parallel.ParallelBlock`
# (`ModuleWrapPolicy`, lab 04). The check trains it on 4 ranks against one process.

# %%
def fsdp_tp(model, mesh):
    """``model`` (a GPT) as FSDP over the mesh's dp dimension of its tensor-parallel version."""
    # BEGIN SOLUTION
    # HINT: TP first (it needs the whole model to cut), FSDP around it; which group holds the same slices?
    tensor_parallel.initialize_model_parallel(mesh.size("tp"), mesh=mesh)
    parallel = tensor_parallel.tensor_parallel_gpt(model)
    return FullyShardedDataParallel(parallel, process_group=mesh.get_group("dp"),
                                    auto_wrap_policy=ModuleWrapPolicy({tensor_parallel.ParallelBlock}))
    # END SOLUTION

# %%
# CHECK: 4 ranks, losses equal one process's, both FSDP's and TP's collectives seen
check.fsdp_tp(fsdp_tp)

# %% [markdown]
# ## 4. Exercise 4: PP × DP from the mesh
#
# Now the other 2D layout on `DeviceMesh(dp=2, pp=2)`: two pipelines of two stages. A
# pipeline's stages talk over the mesh's **pp** group (activations forward, gradients
# back, lab 07); replica d trains on slice d of the batch (`x.chunk(dp)[d]`); after the
# step, the ranks that hold the **same stage** average their gradients over the **dp**
# group (DDP's all-reduce, lab 02, once per step). Build this rank's stage with
# `split_gpt` and `PipelineStage(..., group=...)`, run `Schedule1F1B` as in lab 07 (the
# first stage calls `step(x)`, the last `step(target=y, losses=losses)`), then average.
# Target: one process's gradients on every rank, each gradient all-reduced once.

# %%
def pp_dp_step(model, mesh, x, y, m):
    """On this rank: its pipeline stage of ``model``, one 1F1B step of m micro-batches on this replica's
    slice of (x, y), gradients averaged over the replicas. Returns (stage module, the last stage's losses)."""
    losses = []
    # BEGIN SOLUTION
    # HINT: mesh.get_local_rank / size / get_group give this rank's place, the sizes and the groups. The stage
    # HINT: index is the pp coordinate. Which group holds the other copies of this stage, and is a sum an average?
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
# CHECK: 4 ranks (dp 2 x pp 2): every rank's gradients equal one process's, each replica's losses its own slice's
check.pp_dp(pp_dp_step)

# %% [markdown]
# *Takeaway: sends and receives (pp) carry one micro-batch's activations or their gradients,
# tokens × d values; the all-reduce (dp) carries only the rank's own stage's gradients, 4 bytes
# a parameter (`comm` records an all-reduce of S bytes as 2S: a reduce-scatter, then an all-gather).*
#
# ## 5. Two dimensions at once, measured
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
# On 2 CPU cores the step times say little (the ranks share the cores); on GPUs, compare
# bytes per step with the link: TP's all-reduces are in every layer's critical path.
#
# ## 6. Exercise 5: TP's bytes, by hand
#
# Explain the `tp` row to the byte. Per block, attention and MLP each all-reduce their
# output forward (g) and their input's gradient backward (f); the embedding's g adds one
# forward, the head's f one backward; the vocab-parallel loss all-reduces a max per token,
# then two sums per token (lab 08). All fp32; `comm` records an all-reduce of S bytes as
# 2S (a reduce-scatter then an all-gather). gpt-tiny: L = 2 blocks, d = 32, and the tp run
# sees 8 × 32 tokens per step.

# %%
def tp_bytes_per_step(n_layer, hidden, tokens):
    """Bytes the tp run's all-reduces move per step (comm's volume), from the model's shape."""
    # BEGIN SOLUTION
    # HINT: count the all-reduces of tokens x hidden values and of per-token values; each moves twice its size
    activations = (4 * n_layer + 2) * tokens * hidden * 4
    loss = 3 * tokens * 4
    return 2 * (activations + loss)
    # END SOLUTION

# %%
# CHECK: your bytes equal what the tracer measured in the tp run above
check.tp_bytes(tp_bytes_per_step, measured["tp"]["bytes"], 2, 32, 8 * 32)

# %% [markdown]
# ## 7. Exercise 6: the model states of a layout
#
# `gpt-mini` (3.3 M parameters), B = 8, T = 64, AdamW in fp32 needs about 73 MiB on one
# device. Our devices hold 28 MiB each, and there are 4. The **planner** prices a layout
# without running it: `planner.plan(MODEL, batch=B, seq_len=T, dp=..., tp=...,
# zero_stage=...)` returns bytes per device by category (`.total_memory` is the peak,
# `.fits(cap)`) and bytes moved per step by mesh dimension (`.comm`).
#
# Most of it is the **model states**. tp and pp decide how many parameters a device holds
# (`.params_per_device`, call it n); dp and the ZeRO stage decide how much of their state
# it keeps: fp32 AdamW keeps 4 bytes of weight, 4 of gradient and 8 of optimizer state
# (two moments) per parameter; ZeRO-1 shards the optimizer state over dp, ZeRO-2 the
# gradients too, ZeRO-3 (FSDP) the parameters too (lab 03). Write the planner's sum.

# %%
def state_bytes(n, dp, zero_stage):
    """{"parameters", "gradients", "optimizer"}: bytes one device keeps for n parameters, fp32 AdamW."""
    # BEGIN SOLUTION
    # HINT: start from the replicated figures (16 bytes a parameter in all), then divide by dp what the stage shards
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
# CHECK: every ZeRO stage at dp 1-8 against the ZeRO paper's formula, and gpt-mini's layouts against the planner
check.state_bytes(state_bytes, MODEL, B, T, DEVICES)

# %% [markdown]
# Your function on `gpt-mini` over 4 devices: model states per device, every ZeRO stage
# beside tensor parallel.

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
# move per step and whether the activations shrink too.* The planner adds the activations
# and the collectives; try it with the widget.

# %%
print(planner.plan(MODEL, batch=B, seq_len=T))
widgets.planner_widget(MODEL, batch=B, seq_len=T, cap_bytes=CAP)

# %%
widgets.planner_figure(planner.plan(MODEL, batch=B, seq_len=T, dp=2, tp=2, zero_stage=3), cap_bytes=CAP)

# %% [markdown]
# ## 8. Exercise 7: a layout for a model that does not fit
#
# Write `choose_layout`: among tp in 1, 2, 4 (dp = devices / tp) and ZeRO stage 0 or 3
# (3 whenever both dp and tp are above 1: FSDP × TP), the layout that fits under the cap
# and moves the fewest bytes per step. The check runs your choice and compares.

# %%
def choose_layout(cap_bytes, devices):
    """{"dp": .., "tp": .., "zero_stage": ..}: fits under cap_bytes on every device, fewest bytes per step."""
    # BEGIN SOLUTION
    # HINT: price every candidate with planner.plan; keep those that fit; the bytes per step are the sum over .comm
    best = None
    for tp in (1, 2, 4):
        dp = devices // tp
        for zero in (0, 3):
            if dp > 1 and tp > 1 and zero == 0:
                continue
            p = planner.plan(MODEL, batch=B, seq_len=T, dp=dp, tp=tp, zero_stage=zero)
            moved = sum(sum(ops.values()) for ops in p.comm.values())
            if p.fits(cap_bytes) and (best is None or moved < best[0]):
                best = (moved, {"dp": dp, "tp": tp, "zero_stage": zero})
    return best[1]
    # END SOLUTION

# %%
# CHECK: your layout fits, moves the fewest bytes, and a real run matches the prediction (peak 10 %, bytes exact)
check.planned_layout(choose_layout, MODEL, B, T, DEVICES, CAP)

# %% [markdown]
# ## 9. Exercise 8: which to choose
#
# Back to the table of section 5. Given a memory cap per device, which runs would you
# keep, and in which order? Return the names of the runs whose measured peak fits, fewest
# bytes per step first (the cap below is half the single process's peak).

# %%
def rank_runs(rows, cap_bytes):
    """Names of the runs with peak <= cap_bytes, ordered by bytes moved per step."""
    # BEGIN SOLUTION
    # HINT: filter on the measured peak, then sort on the bytes
    return [r["name"] for r in sorted((r for r in rows if r["peak"] <= cap_bytes), key=lambda r: r["bytes"])]
    # END SOLUTION

# %%
# CHECK: the runs under the cap, fewest bytes first
check.ranking(rank_runs, rows, runs["single"]["peak_bytes"][0] / 2)

# %% [markdown]
# ## Summary: which to choose
#
# * **DDP** (lab 02): whole model on every rank, 2Ψ per step; the default when it fits.
# * **ZeRO / FSDP** (labs 03-04): shard optimizer state, gradients, parameters over dp:
#   memory falls by up to dp, at 1.5× DDP's bytes for FULL_SHARD. The first tool when
#   the *model states* do not fit.
# * **TP** (lab 08): splits every layer and its activations; 4 all-reduces of B·T·d per
#   block, so it stays inside a machine (NVLink). The tool when one layer's activations or
#   weights are too big, or FSDP's all-gathers cannot hide behind compute.
# * **PP** (lab 07): splits the layers into stages; only activations cross stage borders,
#   so it crosses slow links well; it pays a bubble that shrinks with more micro-batches.
#   PP × DP (section 4): each replica all-reduces only its own stage's gradients.
# * Combined: TP inside a node × PP across a few nodes × DP/FSDP over the rest, which is
#   the mesh of section 2. The planner tells what fits before anything runs; the tracer and
#   the memory tracker tell whether it did.

# %%
print(f"notebook ran in {time.perf_counter() - notebook_start:.0f} s")
