"""The checks of lab 09 (minifsdp.labcheck.lab09) judge the learner's code: the solution passes, the blank
lab and typical mistakes (the solution with one small edit) fail with one sentence."""
from __future__ import annotations

from minifsdp.labcheck import lab09
from test_labcheck_00_02 import edits_apply, fails, load

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
TP_ROW = (661504, 2, 32, 256)   # gpt-tiny, tp=2, 8 x 32 tokens: what the tracer records (test_tensor_parallel_train)
ROWS = [{"name": "ddp", "peak": 5, "bytes": 3}, {"name": "fsdp", "peak": 2, "bytes": 4},
        {"name": "tp", "peak": 3, "bytes": 2}, {"name": "single", "peak": 9, "bytes": 0}]
ARGS = ("gpt-mini", 8, 64, 4, 28 * 2**20)


def test_mistakes_still_match_the_solution():
    for edits in (BYTES_ONCE, NO_LOSS, DP_FASTEST, GROUP_BY_DIM, FSDP_OVER_WORLD, IGNORE_CAP, LEAST_MEMORY, NO_FILTER):
        edits_apply(L09, edits)


def test_solution_passes_every_check(capsys):
    ns = load(L09)
    lab09.mesh_coords(ns["mesh_coords"])
    lab09.mesh_groups(ns["mesh_groups"])
    lab09.fsdp_tp(ns["fsdp_tp"])
    lab09.planned_layout(ns["choose_layout"], *ARGS)
    lab09.ranking(ns["rank_runs"], ROWS, 4)
    lab09.tp_bytes(ns["tp_bytes_per_step"], *TP_ROW)
    out = capsys.readouterr().out
    assert out.count("✅") == 6 and "predicted" in out


def test_blank_lab_fails_every_check():
    ns = load(L09, blank=True)
    fails(lab09.mesh_coords, ns["mesh_coords"], words="not written yet")
    fails(lab09.mesh_groups, ns["mesh_groups"], words="not written yet")
    fails(lab09.fsdp_tp, ns["fsdp_tp"], words="not written yet")
    fails(lab09.planned_layout, ns["choose_layout"], *ARGS, words="not written yet")
    fails(lab09.ranking, ns["rank_runs"], ROWS, 4, words="not written yet")
    fails(lab09.tp_bytes, ns["tp_bytes_per_step"], *TP_ROW, words="not written yet")


def test_mistakes_fail():
    fails(lab09.mesh_coords, load(L09, edits=DP_FASTEST)["mesh_coords"], words="tp must vary fastest")
    fails(lab09.mesh_groups, load(L09, edits=GROUP_BY_DIM)["mesh_groups"], words="differ only in their")
    fails(lab09.fsdp_tp, load(L09, edits=FSDP_OVER_WORLD)["fsdp_tp"], words="dp group")
    fails(lab09.planned_layout, load(L09, edits=IGNORE_CAP)["choose_layout"], *ARGS, words="does not fit")
    fails(lab09.planned_layout, load(L09, edits=LEAST_MEMORY)["choose_layout"], *ARGS, words="fewer bytes")
    fails(lab09.ranking, load(L09, edits=NO_FILTER)["rank_runs"], ROWS, 4, words="under the cap")
    fails(lab09.tp_bytes, load(L09, edits=BYTES_ONCE)["tp_bytes_per_step"], *TP_ROW, words="moves 2S")
    fails(lab09.tp_bytes, load(L09, edits=NO_LOSS)["tp_bytes_per_step"], *TP_ROW, words="loss all-reduces too")
