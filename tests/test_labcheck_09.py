"""The checks of lab 09 (minifsdp.labcheck.lab09) judge the learner's code: the solution passes, the blank
lab and typical mistakes (the solution with one small edit) fail with one sentence."""
from __future__ import annotations

from labcheck_helpers import fails, lab_tests, load, run_cell, shortcut_fails
from minifsdp import planner
from minifsdp.labcheck import lab09

L09 = "09_putting_it_together"

DP_FASTEST = (('return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}',
               'return {"dp": rank % dp, "pp": rank // dp % pp, "tp": rank // (dp * pp)}'),)
GROUP_BY_DIM = (("key = tuple(v for d, v in c.items() if d != dim)", "key = c[dim]"),)
FSDP_OVER_WORLD = (('return FullyShardedDataParallel(parallel, process_group=mesh.get_group("dp"),',
                    'return FullyShardedDataParallel(parallel,'),)
# data parallel only, and the cap forgotten: DDP, the fewest bytes of dp=4, needs 50 MiB
IGNORE_CAP = (("for tp in (1, 2, 4):", "for tp in (1,):"),
              ("if p.fits(cap_bytes) and (best is None or moved < best[0]):", "if best is None or moved < best[0]:"))
LEAST_MEMORY = (("if p.fits(cap_bytes) and (best is None or moved < best[0]):\n"
                 "                best = (moved, {\"dp\": dp, \"tp\": tp, \"zero_stage\": zero})",
                 "if p.fits(cap_bytes) and (best is None or p.total_memory < best[0]):\n"
                 "                best = (p.total_memory, {\"dp\": dp, \"tp\": tp, \"zero_stage\": zero})"),)
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
TP_MEASURED = 661504   # gpt-tiny, tp=2, 8 x 32 tokens: what the tracer records (test_tensor_parallel_train)
ARGS = ("gpt-mini", 8, 64, 4, 28 * 2**20)
COST_ARGS = (TP_MEASURED, "gpt-mini", 8, 64, 4)
CHECKS = [(lab09.mesh, ("mesh_coords", "mesh_groups")), (lab09.two_d, ("fsdp_tp", "pp_dp_step")),
          (lab09.layout_costs, ("tp_bytes_per_step", "state_bytes"), *COST_ARGS),
          (lab09.planned_layout, ("choose_layout",), *ARGS)]
MISTAKES = (BYTES_ONCE, NO_LOSS, DP_FASTEST, GROUP_BY_DIM, FSDP_OVER_WORLD, IGNORE_CAP, LEAST_MEMORY,
            NO_DP_ALL_REDUCE, SUM_NOT_MEAN, WHOLE_BATCH, ZERO1_SHARDS_GRADS, ADAM_ONE_STATE)
test_solution_passes_every_check, test_blank_lab_fails_every_check, test_mistakes_still_match_the_solution = \
    lab_tests(L09, CHECKS, MISTAKES, words=("predicted", "yours", "target"))


def _ex(edits=()):
    return load(L09, edits=edits)


def _defined(source: str) -> dict:
    """Shortcut code as a learner writes it in a notebook cell (module __main__: launch sends it by value)."""
    return run_cell({"__name__": "__main__"}, source)


def test_two_d_mistakes():
    sol = _ex()
    fails(lab09.two_d, _ex(FSDP_OVER_WORLD)["fsdp_tp"], sol["pp_dp_step"], words="dp group")
    fails(lab09.two_d, sol["fsdp_tp"], _ex(NO_DP_ALL_REDUCE)["pp_dp_step"],
          words="all-reduce each gradient over the mesh's dp group")
    fails(lab09.two_d, sol["fsdp_tp"], _ex(SUM_NOT_MEAN)["pp_dp_step"], words="divide by dp")
    fails(lab09.two_d, sol["fsdp_tp"], _ex(WHOLE_BATCH)["pp_dp_step"], words="replica d trains on slice d")


def test_cost_mistakes():
    sol = _ex()
    fails(lab09.layout_costs, _ex(BYTES_ONCE)["tp_bytes_per_step"], sol["state_bytes"], *COST_ARGS, words="moves 2S")
    fails(lab09.layout_costs, _ex(NO_LOSS)["tp_bytes_per_step"], sol["state_bytes"], *COST_ARGS,
          words="loss all-reduces too")
    fails(lab09.layout_costs, sol["tp_bytes_per_step"], _ex(ZERO1_SHARDS_GRADS)["state_bytes"], *COST_ARGS,
          words="ZeRO-1 keeps them whole")
    fails(lab09.layout_costs, sol["tp_bytes_per_step"], _ex(ADAM_ONE_STATE)["state_bytes"], *COST_ARGS,
          words="two moments")


def test_mistakes_fail():
    sol = _ex()
    fails(lab09.mesh, _ex(DP_FASTEST)["mesh_coords"], sol["mesh_groups"], words="tp must vary fastest")
    fails(lab09.mesh, sol["mesh_coords"], _ex(GROUP_BY_DIM)["mesh_groups"], words="differ only in their")
    fails(lab09.planned_layout, _ex(IGNORE_CAP)["choose_layout"], *ARGS, words="does not fit")
    fails(lab09.planned_layout, _ex(LEAST_MEMORY)["choose_layout"], *ARGS, words="fewer bytes")


# ------------------------------------------------------------------ library shortcuts, one per exercise at least
def test_mesh_shortcuts():
    sol = _ex()
    alias = _defined("from minifsdp.mesh import DeviceMesh as M\n"
                     "def mesh_coords(rank, dp, pp, tp):\n    return M(dp, pp, tp, build_groups=False).coords(rank)\n")
    shortcut_fails(lab09.mesh, alias["mesh_coords"], sol["mesh_groups"])
    helper = _defined("import minifsdp.mesh\n"
                      "def groups_of(dim, dp, pp, tp):\n"
                      "    return minifsdp.mesh.DeviceMesh(dp, pp, tp, build_groups=False).groups(dim)\n"
                      "def mesh_groups(dim, dp, pp, tp):\n    return groups_of(dim, dp, pp, tp)\n")
    shortcut_fails(lab09.mesh, sol["mesh_coords"], helper["mesh_groups"])
    hidden = _defined("import importlib\n"   # no library name in the code: the run-time wire sees it
                      "def mesh_coords(rank, dp, pp, tp):\n"
                      "    cls = getattr(importlib.import_module('minifsdp.' + 'mesh'), 'Device' + 'Mesh')\n"
                      "    return cls(dp, pp, tp, build_groups=False).coords(rank)\n")
    shortcut_fails(lab09.mesh, hidden["mesh_coords"], sol["mesh_groups"])


def test_two_d_shortcuts():
    sol = _ex()
    trainer = _defined("from minifsdp import strategies as S\n"
                       "def fsdp_tp(model, mesh):\n"
                       "    cfg = S.TrainConfig(strategy='fsdp+tp', world_size=4, dp=2, tp=2)\n"
                       "    return S._tensor_parallel(model, cfg, S.STRATEGIES['fsdp+tp'].layout(cfg)).model\n")
    shortcut_fails(lab09.two_d, trainer["fsdp_tp"], sol["pp_dp_step"])
    hidden = _defined("import importlib\n"   # the run-time wire, inside the 4 workers
                      "def pp_dp_step(model, mesh, x, y, m):\n"
                      "    pp = importlib.import_module('minifsdp.pipeline.' + 'parallel')\n"
                      "    wrapped = getattr(pp, 'Pipeline' + 'Parallel')(model, 2, m, dp=2)\n"
                      "    return wrapped, []\n")
    shortcut_fails(lab09.two_d, sol["fsdp_tp"], hidden["pp_dp_step"])


def test_cost_shortcuts():
    sol = _ex()
    tp = _defined("from minifsdp import planner, models\n"
                  "def tp_bytes_per_step(n_layer, hidden, tokens):\n"
                  "    cfg = models.MODEL_PRESETS['gpt-tiny']\n"
                  "    return 2 * sum(planner.tp_comm_bytes(cfg, tokens, 2).values())\n")
    shortcut_fails(lab09.layout_costs, tp["tp_bytes_per_step"], sol["state_bytes"], *COST_ARGS)
    states = _defined("from minifsdp.estimate import model_state_bytes_per_device as msb\n"
                      "def state_bytes(n, dp, zero_stage):\n    return msb(n, dp, zero_stage, padding=False)\n")
    shortcut_fails(lab09.layout_costs, sol["tp_bytes_per_step"], states["state_bytes"], *COST_ARGS)
    shortcut_fails(lab09.layout_costs, sol["tp_bytes_per_step"],
                   lambda n, dp, zero: planner.plan("gpt-tiny", batch=8).memory, *COST_ARGS)


def test_choose_layout_shortcut():
    """No library function chooses a layout; the check's own pricing helpers are the shortcut to refuse."""
    peek = _defined("from minifsdp.labcheck.lab09 import _moved as cost\n"
                    "from minifsdp import planner\n"
                    "def choose_layout(model, batch, seq_len, cap_bytes, devices):\n"
                    "    plans = {(devices // t, t, z): planner.plan(model, batch=batch, seq_len=seq_len, dp=devices // t,\n"
                    "             tp=t, zero_stage=z) for t in (1, 2, 4) for z in (0, 3)}\n"
                    "    fit = [(cost(p), k) for k, p in plans.items() if p.fits(cap_bytes)]\n"
                    "    dp, tp, z = min(fit)[1]\n"
                    "    return {'dp': dp, 'tp': tp, 'zero_stage': z}\n")
    shortcut_fails(lab09.planned_layout, peek["choose_layout"], *ARGS)


def test_hints_are_steps_not_code(capsys):
    for name in ("mesh_coords", "mesh_groups", "fsdp_tp", "pp_dp_step", "tp_bytes_per_step", "state_bytes",
                 "choose_layout"):
        lab09.hint.again(name)
        lab09.hint(name)
    out = capsys.readouterr().out
    assert out.count("hint 1 of") == 7 and all(len(line) <= 100 for line in out.splitlines())
