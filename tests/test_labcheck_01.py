"""The checks of lab 01 (minifsdp.labcheck.lab01) judge the learner's code.

Each check must pass with the solution, and fail with a clear sentence
(``CheckFailed``) on the blank lab, on typical mistakes and on a library
shortcut. See labcheck_helpers.py for how the notebook's cells are loaded.
"""
from __future__ import annotations

import pytest

from labcheck_helpers import edits_apply, fails, load, run_cell, shortcut_fails  # noqa: F401

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
                                                     ('print("gpt-tiny: Ψ =", predict_gpt_params(tiny.config), "parameters")', "")))
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


# ------------------------------------------------------------------ library shortcuts, one (or more) per exercise
# "Predicting" with the library: its formulas (minifsdp.estimate) behind a helper or an alias, counting a built
# model, measuring with the tracker or with the check's own (private) measuring helpers, or a name built at run
# time that no reading of the code can see (the run-time wire catches it).
SHORTCUTS = {
    "states-helper": ("model_states", ["predict_model_states"],
                      "def states_helper(psi, tensors):\n"
                      "    m = estimate.model_state_bytes_per_device(psi)\n"
                      "    return {'parameters': m['parameters'], 'gradients': m['gradients'],\n"
                      "            'optimizer': m['optimizer'] + 4 * tensors}\n\n"
                      "def predict_model_states(shapes):\n"
                      "    return states_helper(sum(math.prod(s) for s in shapes.values()), len(shapes))\n"),
    "gpt-params-runtime-only": ("model_states", ["predict_model_states", "predict_gpt_params"],
                                "def predict_gpt_params(config):\n"
                                "    return getattr(estimate, 'gpt_param' + '_count')(config)\n"),
    "gpt-params-built-model": ("model_states", ["predict_model_states", "predict_gpt_params"],
                               "from minifsdp.models import GPT as Sized\n\n"
                               "def predict_gpt_params(config):\n"
                               "    return sum(p.numel() for p in Sized(config).parameters())\n"),
    "mlp-check-measures": ("mlp_activations", ["predict_mlp_activation_bytes"],
                           "def predict_mlp_activation_bytes(B):\n    return check._measure_mlp_activations(B)\n"),
    "mlp-runtime-only": ("mlp_activations", ["predict_mlp_activation_bytes"],
                         "def predict_mlp_activation_bytes(B):\n"
                         "    return getattr(check, '_measure_' + 'mlp_activations')(B)\n"),
    "block-alias": ("block_activations", ["predict_block_activation_bytes"],
                    "from minifsdp.estimate import gpt_layer_activation_breakdown as per_op\n\n"
                    "def predict_block_activation_bytes(config, B, T):\n"
                    "    return sum(per_op(config, B, T).values())\n"),
    "block-tracker": ("block_activations", ["predict_block_activation_bytes"],
                      "def predict_block_activation_bytes(config, B, T):\n"
                      "    layer = torch.nn.LayerNorm(config.n_embd)\n"
                      "    x = torch.randn(B, T, config.n_embd, requires_grad=True)\n"
                      "    tracker = MemoryTracker()\n"
                      "    with tracker:\n        tracker.register([x], ACTIVATIONS)\n        layer(x)\n"
                      "        return tracker.live()[ACTIVATIONS]\n"),
    "gpt-helper": ("gpt_activations", ["predict_gpt_activation_bytes", "predict_block_activation_bytes"],
                   "def total_of(config, B, T):\n    return estimate.gpt_activation_bytes(config, B, T)['total']\n\n"
                   "def predict_gpt_activation_bytes(config, B, T):\n    return total_of(config, B, T)\n"),
    "gpt-runtime-only": ("gpt_activations", ["predict_gpt_activation_bytes", "predict_block_activation_bytes"],
                         "def predict_gpt_activation_bytes(config, B, T):\n"
                         "    return getattr(check, '_measure_gpt' + '_activations')(config, B, T)\n"),
}


@pytest.mark.parametrize("name", list(SHORTCUTS))
def test_lab01_library_shortcut_fails(lab01, name):
    check, names, code = SHORTCUTS[name]
    ns = run_cell(load(L01, extra=EXTRA01), code)
    shortcut_fails(getattr(lab01, check), *(ns[n] for n in names))


def test_lab01_measuring_helpers_are_private(lab01):
    public = [n for n in dir(lab01) if n.startswith("measure")]
    assert not public, f"the check's measuring helpers must not be check.* names a learner would call: {public}"


def test_lab01_hints_come_one_at_a_time(lab01, capsys):
    for name, steps in lab01.hint.table.items():
        assert 2 <= len(steps) <= 4, name
    lab01.hint.again("predict_model_states")
    lab01.hint("predict_model_states")
    out = capsys.readouterr().out
    assert out.startswith("hint 1 of") and all(len(line) <= 100 for line in out.splitlines())


def test_lab01_stepping_a_real_optimizer_is_not_predicting(lab01):
    """Measuring AdamW's state by stepping one, with the names hidden from a reading of the code: caught at run
    time (torch's Adam step is watched inside the prediction)."""
    ns = load(L01, extra=EXTRA01)
    exec("def predict_model_states(shapes):\n"
         "    params = [torch.zeros(s, requires_grad=True) for s in shapes.values()]\n"
         "    for p in params:\n        p.grad = torch.zeros_like(p)\n"
         "    opt = getattr(torch.optim, 'Adam' + 'W')(params)\n    getattr(opt, 'st' + 'ep')()\n"
         "    state = sum(t.nbytes for s in opt.state.values() for t in s.values())\n"
         "    n = sum(p.nbytes for p in params)\n"
         "    return {'parameters': n, 'gradients': n, 'optimizer': state}\n", ns)
    fails(lab01.model_states, ns["predict_model_states"], words="Adam.step")
