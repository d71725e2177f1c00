"""The checks of labs 00-02 (minifsdp.labcheck.lab00/01/02) judge the learner's code.

Each check must pass with the solution, and fail with a clear sentence
(``CheckFailed``) on the blank lab (the exercise still raising
``NotImplementedError``) and on typical mistakes. The learner's code is taken
from the real notebook sources (solutions/src/NN_*.py), run the way a notebook
runs it: exec'd in a ``__main__`` namespace, so ``launch`` sends it to the
workers by value. A mistake is the solution with one small edit.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minifsdp.labcheck.verdict import CheckFailed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import notebooks as nbt  # noqa: E402


def _cells(stem: str) -> list:
    text = (ROOT / "solutions" / "src" / f"{stem}.py").read_text(encoding="utf-8")
    return [c for c in nbt.parse_source(text, stem) if c.cell_type == "code"]


def load(stem: str, *, blank: bool = False, edits: tuple[tuple[str, str], ...] = (),
         extra: tuple[str, ...] = ()) -> dict:
    """The notebook's import cell, then every exercise cell (blank: the lab's version, or with ``edits``)."""
    cells = _cells(stem)
    ns: dict = {"__name__": "__main__"}
    exec(compile(cells[0].source, f"<{stem} imports>", "exec"), ns)
    for cell in cells[1:]:
        source = cell.source
        if any(marker in source for marker in extra) and "# BEGIN SOLUTION" not in source:
            exec(compile(source, f"<{stem}>", "exec"), ns)
            continue
        if "# BEGIN SOLUTION" not in source:
            continue
        if blank:
            source = nbt.make_lab_source(source)[0]
        for old, new in edits:
            if old in source:
                source = source.replace(old, new)
        exec(compile(source, f"<{stem} exercise>", "exec"), ns)
    return ns


def edits_apply(stem: str, edits: tuple[tuple[str, str], ...]) -> None:
    """A mistake that no longer matches the solution's text would test nothing: fail loudly instead."""
    text = (ROOT / "solutions" / "src" / f"{stem}.py").read_text(encoding="utf-8")
    missing = [old for old, _ in edits if old not in text]
    assert not missing, f"the mistake no longer matches {stem}.py: {missing}"


def fails(check, *args, words: str) -> str:
    with pytest.raises(CheckFailed) as info:
        check(*args)
    message = str(info.value)
    assert words.lower() in message.lower(), f"expected {words!r} in the verdict, got: {message}"
    assert "\n" not in message.strip(), "a verdict is one line"
    return message


# ---------------------------------------------------------------- lab 00
L00 = "00_collectives"


@pytest.fixture(scope="module")
def lab00():
    from minifsdp.labcheck import lab00
    return lab00


def test_lab00_solution_passes(lab00, capsys):
    ns = load(L00)
    lab00.ring_all_gather(ns["my_all_gather"])
    lab00.ring_reduce_scatter(ns["my_reduce_scatter"])
    lab00.ring_all_reduce(ns["my_all_reduce"], ns["ring_bytes_sent"], ns["bus_bandwidth"])
    fig = lab00.ring_timeline(ns["draw_ring_timeline"], ns["my_all_reduce"])
    assert fig.get_size_inches()[0] <= 11, "a figure no wider than a notebook column"
    out = capsys.readouterr().out
    assert out.count("✅") == 4 and "yours" in out and "target" in out and "library" in out


def test_lab00_blank_fails(lab00):
    ns = load(L00, blank=True)
    fails(lab00.ring_all_gather, ns["my_all_gather"], words="not written yet")
    fails(lab00.ring_reduce_scatter, ns["my_reduce_scatter"], words="not written yet")
    fails(lab00.ring_all_reduce, ns["my_all_reduce"], ns["ring_bytes_sent"], words="not written yet")
    solved = load(L00)
    fails(lab00.ring_all_reduce, solved["my_all_reduce"], solved["ring_bytes_sent"], ns["bus_bandwidth"],
          words="not written yet")
    fails(lab00.ring_timeline, ns["draw_ring_timeline"], load(L00)["my_all_reduce"], words="not written yet")


AG_WRONG_WAY = (("chunks[(r - step - 1) % n], left)", "chunks[(r + step + 1) % n], left)"),
                ("chunks[(r - step) % n], right)", "chunks[(r + step) % n], right)"))
AG_LAZY = (("    for step in range(n - 1):\n        sending = comm.isend(chunks[(r - step) % n], right)",
            "    comm.all_reduce(out)\n    for step in range(0):\n        sending = comm.isend(chunks[(r - step) % n], right)"),)
RS_COPY = (("chunks[(r - step - 2) % n].add_(incoming)", "chunks[(r - step - 2) % n].copy_(incoming)"),)
RS_SHORT = (("    for step in range(n - 1):\n        sending = comm.isend(chunks[(r - step - 1) % n], right)",
             "    for step in range(n - 2):\n        sending = comm.isend(chunks[(r - step - 1) % n], right)"),)
AR_VOLUME = (("return 2 * (world_size - 1) * nbytes // world_size", "return 2 * nbytes"),)
AR_NO_CUT = (("return summed[:x.numel()]", "return summed"),)
BUS_ALGBW = (("    return algbw * factor\n", "    return algbw\n"),)
BUS_ONE_FACTOR = (('"all_gather": (n - 1) / n,', '"all_gather": 2 * (n - 1) / n,'),)
TL_SECONDS = (("ax.barh(rank, (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3,",
               "ax.barh(rank, (s.end - s.start), left=(s.start - t0),"),)
TL_ROWS = (("ax.barh(rank, (s.end - s.start) * 1e3,", "ax.barh(i, (s.end - s.start) * 1e3,"),)


@pytest.mark.parametrize("check, names, edits, words", [
    ("ring_all_gather", ["my_all_gather"], AG_WRONG_WAY, "chunk"),
    ("ring_all_gather", ["my_all_gather"], AG_LAZY, "all_reduce"),
    ("ring_reduce_scatter", ["my_reduce_scatter"], RS_COPY, "missing"),
    ("ring_reduce_scatter", ["my_reduce_scatter"], RS_SHORT, "nothing was added"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent"], AR_VOLUME, "2S"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent"], AR_NO_CUT, "padding"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"], BUS_ALGBW, "algbw"),
    ("ring_all_reduce", ["my_all_reduce", "ring_bytes_sent", "bus_bandwidth"], BUS_ONE_FACTOR, "factor for all_gather"),
    ("ring_timeline", ["draw_ring_timeline", "my_all_reduce"], TL_SECONDS, "milliseconds"),
    ("ring_timeline", ["draw_ring_timeline", "my_all_reduce"], TL_ROWS, "row"),
], ids=["ag-wrong-way", "ag-all-reduce", "rs-copy", "rs-short", "ar-volume", "ar-no-cut", "bus-algbw", "bus-factor",
        "tl-seconds", "tl-rows"])
def test_lab00_mistakes_fail(lab00, check, names, edits, words):
    edits_apply(L00, edits)
    ns = load(L00, edits=edits)
    fails(getattr(lab00, check), *(ns[n] for n in names), words=words)


# ---------------------------------------------------------------- lab 01
L01 = "01_memory_anatomy"
EXTRA01 = ("mlp_shapes = {", "tiny = models.build_model")


@pytest.fixture(scope="module")
def lab01():
    from minifsdp.labcheck import lab01
    return lab01


def test_lab01_solution_passes(lab01, capsys):
    ns = load(L01, extra=EXTRA01)
    lab01.model_states(ns["predict_model_states"], ns["predict_gpt_params"])
    lab01.mlp_activations(ns["predict_mlp_activation_bytes"])
    lab01.block_activations(ns["predict_block_activation_bytes"])
    lab01.gpt_activations(ns["predict_gpt_activation_bytes"], ns["predict_block_activation_bytes"])
    assert capsys.readouterr().out.count("✅") == 4


def test_lab01_blank_fails(lab01):
    with pytest.raises(NotImplementedError):  # the exercise cell itself calls it on the MLP's shapes
        load(L01, blank=True, extra=EXTRA01)
    ns = load(L01, blank=True, extra=EXTRA01, edits=(('print("the MLP:", predict_model_states(mlp_shapes))', ""),
                                                     ('print("gpt-tiny: Ψ =", predict_gpt_params(tiny.config))', "")))
    fails(lab01.model_states, ns["predict_model_states"], words="not written yet")
    solved = load(L01, extra=EXTRA01)
    fails(lab01.model_states, solved["predict_model_states"], ns["predict_gpt_params"], words="not written yet")
    fails(lab01.mlp_activations, ns["predict_mlp_activation_bytes"], words="not written yet")
    fails(lab01.block_activations, ns["predict_block_activation_bytes"], words="not written yet")
    fails(lab01.gpt_activations, ns["predict_gpt_activation_bytes"], ns["predict_block_activation_bytes"],
          words="not written yet")


@pytest.mark.parametrize("check, names, edits, words", [
    ("model_states", ["predict_model_states"],
     (('"optimizer": 2 * FP32 * psi + FP32 * len(shapes),', '"optimizer": FP32 * psi,'),), "two"),
    ("model_states", ["predict_model_states"],
     (('"optimizer": 2 * FP32 * psi + FP32 * len(shapes),', '"optimizer": 2 * FP32 * psi,'),), "step"),
    ("model_states", ["predict_model_states"], (('"parameters": FP32 * psi,', '"parameters": psi,'),), "elements"),
    ("model_states", ["predict_model_states", "predict_gpt_params"],
     (("head = 0 if config.tie_embeddings else V * d", "head = V * d"),), "tie_embeddings=True"),
    ("mlp_activations", ["predict_mlp_activation_bytes"],
     (("    labels = INT64 * B\n", "    labels = 0\n"),), "per sample"),
    ("mlp_activations", ["predict_mlp_activation_bytes"],
     (("relu_2 = FP32 * B * 16", "relu_2 = 3 * FP32 * B * 16"),), "too much"),
    ("block_activations", ["predict_block_activation_bytes"],
     (('"softmax output": B * h * T * T,', '"softmax output": 0,'),), "B·h·T²"),
    ("block_activations", ["predict_block_activation_bytes"],
     (('"q, k, v": 3 * btd,', '"q, k, v": 0,'),), "3 tensor(s) of B·T·d"),
    ("gpt_activations", ["predict_gpt_activation_bytes", "predict_block_activation_bytes"],
     (('"position ids": INT64 * T,', '"position ids": 0,'),), "position"),
    ("gpt_activations", ["predict_gpt_activation_bytes", "predict_block_activation_bytes"],
     (('"loss: log-probs, total weight": FP32 * (B * T * V + 1),', '"loss": 0,'),), "loss"),
], ids=["adamw-one-moment", "adamw-no-step", "elements", "gpt-params-tied", "mlp-no-labels", "mlp-relu-twice", "block-no-probs",
        "block-no-qkv", "gpt-no-positions", "gpt-no-loss"])
def test_lab01_mistakes_fail(lab01, check, names, edits, words):
    edits_apply(L01, edits)
    ns = load(L01, extra=EXTRA01, edits=edits)
    fails(getattr(lab01, check), *(ns[n] for n in names), words=words)


def test_lab01_library_call_is_told_apart(lab01):
    ns = load(L01, extra=EXTRA01)
    exec("def lazy(config, B, T):\n    return sum(estimate.gpt_layer_activation_breakdown(config, B, T).values())\n", ns)
    fails(lab01.block_activations, ns["lazy"], words="minifsdp.estimate")


# ---------------------------------------------------------------- lab 02
L02 = "02_data_parallel"
EXTRA02: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def lab02():
    from minifsdp.labcheck import lab02
    return lab02


def test_lab02_solution_passes(lab02, capsys):
    ns = load(L02, extra=EXTRA02)
    lab02.hook_ddp(ns["make_data_parallel"])
    lab02.bucket_layout(ns["bucket_layout"])
    fig = lab02.bucketed_ddp(ns["BucketedDDP"])
    assert fig.get_size_inches()[0] <= 11
    lab02.accumulation(ns["accumulation_step"])
    out = capsys.readouterr().out
    assert out.count("✅") == 4 and "2·4Ψ" in out and "library" in out


def test_lab02_blank_fails(lab02):
    ns = load(L02, blank=True, extra=EXTRA02,
              edits=(("layout = bucket_layout(list(mini.parameters()), int(cap * MiB))", "continue"),))
    fails(lab02.hook_ddp, ns["make_data_parallel"], words="not written yet")
    fails(lab02.bucket_layout, ns["bucket_layout"], words="not written yet")
    fails(lab02.bucketed_ddp, ns["BucketedDDP"], words="not written yet")
    fails(lab02.accumulation, ns["accumulation_step"], words="not written yet")


@pytest.mark.parametrize("check, name, edits, words", [
    ("hook_ddp", "make_data_parallel", (("        p.grad.div_(world)\n", "        pass\n"),), "too large"),
    ("hook_ddp", "make_data_parallel", (("            comm.broadcast(p, src=0)\n", "            pass\n"),),
     "different weights"),
    ("bucket_layout", "bucket_layout", (("for i in reversed(range(len(params))):", "for i in range(len(params)):"),),
     "reverse"),
    ("bucket_layout", "bucket_layout", (("    if current:\n        buckets.append(current)\n", ""),),
     "exactly one bucket"),
    ("bucketed_ddp", "BucketedDDP", (("            self.flat[k].div_(self.world)\n", ""),), "too large"),
    ("bucketed_ddp", "BucketedDDP",
     (("self.handles.append((k, comm.all_reduce(self.flat[k], async_op=True)))",
       "handle = comm.all_reduce(self.flat[k], async_op=True); handle.wait(); self.handles.append((k, handle))"),),
     "nothing overlapped"),
    ("bucketed_ddp", "BucketedDDP", (("        self.pending = [len(bucket) for bucket in self.buckets]\n        # END",
                                      "        # END"),), "step 1"),
    ("accumulation", "accumulation_step", (("    with model.no_sync():\n", "    if True:\n"),), "every micro-batch"),
    ("accumulation", "accumulation_step", (("(models.lm_loss(model(x), y) / k).backward()\n    # END",
                                            "models.lm_loss(model(x), y).backward()\n    # END"),), "divided by k"),
], ids=["hook-no-divide", "hook-no-broadcast", "layout-forward", "layout-drops-last", "bucketed-no-divide",
        "bucketed-blocking", "bucketed-no-reset", "accum-no-nosync", "accum-last-not-divided"])
def test_lab02_mistakes_fail(lab02, check, name, edits, words):
    edits_apply(L02, edits)
    ns = load(L02, extra=EXTRA02, edits=edits)
    fails(getattr(lab02, check), ns[name], words=words)


def test_the_library_itself_is_told_apart(lab00, lab02):
    from minifsdp import comm
    from minifsdp.ddp import bucket_assignment
    fails(lab00.ring_all_gather, comm.all_gather, words="library's own")
    fails(lab02.bucket_layout, bucket_assignment, words="library's own")
