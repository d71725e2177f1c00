"""The checks of lab 09 (minifsdp.labcheck.lab09) judge the learner's code: the solution passes, the blank
lab and typical mistakes (the solution with one small edit) fail with one sentence."""
from __future__ import annotations

from labcheck_helpers import fails, lab_tests, load
from minifsdp import planner
from minifsdp.labcheck import lab09

L09 = "09_putting_it_together"

DP_FASTEST = (('return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}',
               'return {"dp": rank % dp, "pp": rank // dp % pp, "tp": rank // (dp * pp)}'),)
GROUP_BY_DIM = (("key = tuple(c[d] for d in sizes if d != dim)", "key = c[dim]"),)
FSDP_OVER_WORLD = (('return FullyShardedDataParallel(parallel, process_group=mesh.get_group("dp"),',
                    'return FullyShardedDataParallel(parallel,'),)
# data parallel only, and the cap forgotten: DDP, the fewest bytes of dp=4, needs 50 MiB
IGNORE_CAP = (("for tp in (1, 2, 4):", "for tp in (1,):"),
              ("if p.fits(cap_bytes) and (best is None or moved < best[0]):", "if best is None or moved < best[0]:"))
LEAST_MEMORY = (("if p.fits(cap_bytes) and (best is None or moved < best[0]):\n"
                 "                best = (moved, {\"dp\": dp, \"tp\": tp, \"zero_stage\": zero})",
                 "if p.fits(cap_bytes) and (best is None or p.total_memory < best[0]):\n"
                 "                best = (p.total_memory, {\"dp\": dp, \"tp\": tp, \"zero_stage\": zero})"),)
NO_FILTER = (('sorted((r for r in rows if r["peak"] <= cap_bytes), key=lambda r: r["bytes"])',
              'sorted(rows, key=lambda r: r["bytes"])'),)
BYTES_ONCE = (("return 2 * (activations + loss)", "return activations + loss"),)
NO_LOSS = (("return 2 * (activations + loss)", "return 2 * activations"),)
NO_DP_ALL_REDUCE = (('''    for q in part.parameters():
        comm.all_reduce(q.grad, group=mesh.get_group("dp"))
        q.grad /= dp
''', ""),)
SUM_NOT_MEAN = (("        q.grad /= dp\n", ""),)
WHOLE_BATCH = (("    x, y = x.chunk(dp)[d], y.chunk(dp)[d]\n", ""),)
ZERO1_SHARDS_GRADS = (("    if zero_stage >= 2:\n        gradients /= dp",
                       "    if zero_stage >= 1:\n        gradients /= dp"),)
ADAM_ONE_STATE = (("parameters, gradients, optimizer = 4 * n, 4 * n, 8 * n",
                   "parameters, gradients, optimizer = 4 * n, 4 * n, 4 * n"),)
TP_ROW = (661504, 2, 32, 256)   # gpt-tiny, tp=2, 8 x 32 tokens: what the tracer records (test_tensor_parallel_train)
ROWS = [{"name": "ddp", "peak": 5, "bytes": 3}, {"name": "fsdp", "peak": 2, "bytes": 4},
        {"name": "tp", "peak": 3, "bytes": 2}, {"name": "single", "peak": 9, "bytes": 0}]
ARGS = ("gpt-mini", 8, 64, 4, 28 * 2**20)
STATE_ARGS = ("gpt-mini", 8, 64, 4)
CHECKS = [(lab09.mesh_coords, ("mesh_coords",)), (lab09.mesh_groups, ("mesh_groups",)),
          (lab09.fsdp_tp, ("fsdp_tp",)), (lab09.pp_dp, ("pp_dp_step",)),
          (lab09.state_bytes, ("state_bytes",), *STATE_ARGS), (lab09.planned_layout, ("choose_layout",), *ARGS),
          (lab09.ranking, ("rank_runs",), ROWS, 4), (lab09.tp_bytes, ("tp_bytes_per_step",), *TP_ROW)]
MISTAKES = (BYTES_ONCE, NO_LOSS, DP_FASTEST, GROUP_BY_DIM, FSDP_OVER_WORLD, IGNORE_CAP, LEAST_MEMORY,
            NO_FILTER, NO_DP_ALL_REDUCE, SUM_NOT_MEAN, WHOLE_BATCH, ZERO1_SHARDS_GRADS, ADAM_ONE_STATE)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L09, CHECKS, MISTAKES, words=("predicted",))


def test_pp_dp_mistakes():
    fails(lab09.pp_dp, load(L09, edits=NO_DP_ALL_REDUCE)["pp_dp_step"],
          words="all-reduce each gradient over the mesh's dp group")
    fails(lab09.pp_dp, load(L09, edits=SUM_NOT_MEAN)["pp_dp_step"], words="divide by dp")
    fails(lab09.pp_dp, load(L09, edits=WHOLE_BATCH)["pp_dp_step"], words="replica d trains on slice d")

    def uses_library(model, mesh, x, y, m):
        from minifsdp.pipeline import PipelineParallel
        return PipelineParallel(model, 2, m, dp=2).train_step(x, y)
    fails(lab09.pp_dp, uses_library, words="build the stage, the schedule and the gradient average yourself")


def test_state_bytes_mistakes():
    fails(lab09.state_bytes, load(L09, edits=ZERO1_SHARDS_GRADS)["state_bytes"], *STATE_ARGS,
          words="ZeRO-1 keeps them whole")
    fails(lab09.state_bytes, load(L09, edits=ADAM_ONE_STATE)["state_bytes"], *STATE_ARGS, words="two moments")
    fails(lab09.state_bytes, lambda n, dp, zero: planner.plan("gpt-tiny", batch=8).memory, *STATE_ARGS,
          words="write the ZeRO sum yourself")


def test_mistakes_fail():
    fails(lab09.mesh_coords, load(L09, edits=DP_FASTEST)["mesh_coords"], words="tp must vary fastest")
    fails(lab09.mesh_groups, load(L09, edits=GROUP_BY_DIM)["mesh_groups"], words="differ only in their")
    fails(lab09.fsdp_tp, load(L09, edits=FSDP_OVER_WORLD)["fsdp_tp"], words="dp group")
    fails(lab09.planned_layout, load(L09, edits=IGNORE_CAP)["choose_layout"], *ARGS, words="does not fit")
    fails(lab09.planned_layout, load(L09, edits=LEAST_MEMORY)["choose_layout"], *ARGS, words="fewer bytes")
    fails(lab09.ranking, load(L09, edits=NO_FILTER)["rank_runs"], ROWS, 4, words="under the cap")
    fails(lab09.tp_bytes, load(L09, edits=BYTES_ONCE)["tp_bytes_per_step"], *TP_ROW, words="moves 2S")
    fails(lab09.tp_bytes, load(L09, edits=NO_LOSS)["tp_bytes_per_step"], *TP_ROW, words="loss all-reduces too")
