"""The checks of lab 01 (minifsdp.labcheck.lab01) judge the learner's code.

Each check must pass with the solution, and fail with a clear sentence
(``CheckFailed``) on the blank lab, on typical mistakes and on a library
shortcut. See labcheck_helpers.py for how the notebook's cells are loaded.
"""
from __future__ import annotations

import pytest

from labcheck_helpers import edits_apply, fails, load, shortcut_fails  # noqa: F401

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
