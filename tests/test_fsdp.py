"""FSDP core: flat parameters, the four sharding strategies and clipping, against one process.

The reference is the unwrapped model on the whole global batch in this
process; each rank of an FSDP run gets its slice of that batch. Losses,
gradient norms and parameters after several AdamW steps must agree within
fp32 tolerances (ATOL/RTOL below), at world sizes 1, 2, 3 and 4.
"""

import functools

import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_helpers import gpt_batch, train_steps
from minifsdp import WorkerError, launch
from minifsdp.fsdp import (FullyShardedDataParallel as FSDP, ModuleWrapPolicy, ShardingStrategy, StateDictType,
                           init_hybrid_groups, size_based_auto_wrap_policy)

ATOL, RTOL = 1e-5, 1e-4  # fp32: reduction order differs between 1 and N ranks
STEPS, BATCH, SEQ, VOCAB = 3, 12, 5, 11  # 12 rows split evenly over 1, 2, 3 or 4 ranks
HYBRID_SHARD_SIZE = {1: 1, 2: 1, 3: 3, 4: 2}  # 4 ranks: shard in {0,1},{2,3}, replicate across {0,2},{1,3}


class Toy(nn.Module):
    """Everything FSDP must cope with, in 190 parameters: an embedding tied to the head, nested
    containers, a parameter smaller than any world size, a frozen layer and a buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.layers = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 6))
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.scale = nn.Parameter(torch.ones(1))            # 1 element < world size
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.register_buffer("shift", torch.full((6,), 0.1))
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight                  # tied weights, one unit

    def forward(self, idx):
        h = self.emb(idx) + self.shift
        h = h + self.layers(h)
        h = self.inner(h) * self.scale
        h = h + self.frozen(h)
        return self.head(h)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _fsdp_kwargs(strategy, auto):
    kw = {"sharding_strategy": ShardingStrategy[strategy]}
    if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        kw["process_group"] = init_hybrid_groups(HYBRID_SHARD_SIZE[tdist.get_world_size()])
    if auto:
        kw["auto_wrap_policy"] = ModuleWrapPolicy({nn.Sequential})
    return kw


def _toy_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(kwargs, steps=STEPS, max_norm=0.5):
    """Train Toy (wrapped if kwargs is not None); return global losses, grad norms, full state dict."""
    torch.manual_seed(0)
    model = Toy() if kwargs is None else FSDP(Toy(), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = train_steps(model, opt, _batch, _toy_loss, steps, max_norm=max_norm)
    if kwargs is None:
        return losses, norms, model.state_dict()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return losses, norms, model.state_dict()


def _all_strategies():
    runs = [(s, auto) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD") for auto in (False, True)]
    return {(s, auto): _train(_fsdp_kwargs(s, auto)) for s, auto in runs + [("_HYBRID_SHARD_ZERO2", True)]}


@pytest.fixture(scope="module")
def reference():
    return _train(None)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_parity_every_strategy_with_and_without_auto_wrap(n, reference):
    ref_losses, ref_norms, ref_sd = reference
    assert ref_norms[0] > 0.5, "max_norm must actually clip for the check to mean something"
    for rank_out in launch(_all_strategies, n, timeout=120):
        for (strategy, auto), (losses, norms, sd) in rank_out.items():
            what = f"{strategy} auto_wrap={auto} world={n}"
            torch.testing.assert_close(losses, ref_losses, atol=ATOL, rtol=RTOL, msg=what)
            torch.testing.assert_close(norms, ref_norms, atol=ATOL, rtol=RTOL, msg=what)
            assert sorted(sd) == sorted(ref_sd), what  # the unwrapped model's keys, tied and frozen included
            for k in sd:
                torch.testing.assert_close(sd[k], ref_sd[k], atol=ATOL, rtol=RTOL, msg=f"{what}: {k}")


def _layout_and_bytes():
    """Shards, padding, what model.parameters() yields, and the bytes each rank keeps."""
    n, r = tdist.get_world_size(), tdist.get_rank()
    torch.manual_seed(0)
    ref = Toy()
    flat_ref = {k: v.clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(0)
    model = FSDP(Toy(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    out = {"units": [], "params": [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]}
    for u in units:
        for h in u._handles:
            # the shard is exactly rank r's slice of [unique params..., zero padding]
            full = h.flatten([flat_ref[_ref_key(u, i.fqn)] for i in h.unique_infos])
            out["units"].append({"numel": h.numel, "padded": h.padded_numel, "shard": h.flat_param.numel(),
                                 "exact": torch.equal(h.flat_param.detach(), full.chunk(n)[r]),
                                 "trainable": h.requires_grad, "full_bytes_at_rest": h._full.untyped_storage().nbytes(),
                                 "shared": [i.fqn for i in h.infos if i.shared_with is not None]})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(0)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()
    out["inf_norm"] = model.clip_grad_norm_(1e9, norm_type=float("inf")).item()  # max |g| over every shard
    opt.step()
    out["persistent"] = {
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
        "optim": sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step"),
        "unsharded_left": sum(h._full.untyped_storage().nbytes() for u in units for h in u._handles),
    }
    return out


def _ref_key(unit, fqn):
    return ".".join(p for p in (unit._name if unit._name != "root" else "", fqn) if p)


@pytest.mark.parametrize("n", [3, 4])
def test_flat_layout_padding_and_persistent_bytes(n):
    outs = launch(_layout_and_bytes, n, timeout=120)
    torch.manual_seed(0)
    ref = Toy()
    trainable = sum(p.numel() for p in ref.parameters() if p.requires_grad)  # tied head counted once
    frozen = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
    x, y = _batch(0)
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    ref_inf = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=float("inf")).item()
    for r, out in enumerate(outs):
        assert out["inf_norm"] == pytest.approx(ref_inf, rel=RTOL, abs=ATOL)
        # model.parameters() yields only flat shards: 1 trainable per unit + the frozen one of the root
        assert [name for name, _, _ in out["params"]] == [
            "_flat_param", "_flat_param_frozen", "_fsdp_wrapped_module.layers._flat_param",
            "_fsdp_wrapped_module.inner._flat_param"]
        units = out["units"]
        assert all(u["exact"] for u in units), f"rank {r}: shard is not the rank's slice of the padded flat tensor"
        assert all(u["padded"] % n == 0 and u["padded"] - u["numel"] < n and u["shard"] == u["padded"] // n
                   for u in units)
        assert sum(u["numel"] for u in units if u["trainable"]) == trainable
        assert sum(u["numel"] for u in units if not u["trainable"]) == frozen
        assert units[0]["shared"] == ["head.weight"]          # tied weight stored once
        assert all(u["full_bytes_at_rest"] == 0 for u in units)  # sharded at rest
        # persistent bytes per rank = (params + grads + AdamW's 2 states) / N + padding, exactly
        pad_t = sum(u["padded"] - u["numel"] for u in units if u["trainable"])
        pad_f = sum(u["padded"] - u["numel"] for u in units if not u["trainable"])
        p = out["persistent"]
        assert p["params"] == 4 * ((trainable + pad_t) + (frozen + pad_f)) // n
        assert p["grads"] == 4 * (trainable + pad_t) // n
        assert p["optim"] == 2 * 4 * (trainable + pad_t) // n
        assert p["unsharded_left"] == 0                      # every unit freed after backward


def _gpt_parity(kind):
    from minifsdp.models import Block, build_model, lm_loss

    model = build_model("gpt-tiny", seed=0)
    if kind == "minifsdp":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:  # PyTorch's own FSDP1 on CPU (PLATFORM-NOTES: needs device_id=cpu)
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
        model = TorchFSDP(model, auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu"))
    return train_steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3), gpt_batch, lm_loss, 3)[0]


def test_gpt_tiny_matches_torch_fsdp_and_single_process():
    from minifsdp.models import build_model, lm_loss

    model = build_model("gpt-tiny", seed=0)
    ref = train_steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3), gpt_batch, lm_loss, 3)[0]
    ours = launch(_gpt_parity, 2, "minifsdp", timeout=120)[0]
    theirs = launch(_gpt_parity, 2, "torch", timeout=120)[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def _accumulate(use_no_sync):
    n, r = tdist.get_world_size(), tdist.get_rank()
    torch.manual_seed(0)
    model = FSDP(Toy(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(0)
    half = BATCH // 2  # two micro-batches of the global batch, each split over the ranks
    for micro in range(2):
        rows = slice(micro * half + r * half // n, micro * half + (r + 1) * half // n)
        ctx = model.no_sync() if use_no_sync and micro == 0 else torch.enable_grad()
        with ctx:
            (F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()) / 2).backward()
        if use_no_sync and micro == 0:  # no communication yet: the unsharded gradients are held locally
            held = [h._full.grad is not None for u in model.modules() if isinstance(u, FSDP) for h in u._handles
                    if h.requires_grad]
            assert all(held) and all(p.grad is None for p in model.parameters())
    opt.step()
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return model.state_dict()


@pytest.mark.parametrize("use_no_sync", [False, True])
def test_gradient_accumulation_with_and_without_no_sync(use_no_sync):
    torch.manual_seed(0)
    ref = Toy()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = _batch(0)
    for micro in range(2):
        rows = slice(micro * BATCH // 2, (micro + 1) * BATCH // 2)
        (F.cross_entropy(ref(x[rows]).flatten(0, 1), y[rows].flatten()) / 2).backward()
    opt.step()
    sd = launch(_accumulate, 2, use_no_sync, timeout=120)[1]
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=ATOL, rtol=RTOL, msg=k)


# --------------------------------------------------------------------------
# Bad input: one-line errors that name the fix
# --------------------------------------------------------------------------
def _mixed_dtypes():
    FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))


def _tied_across_units():
    model = Toy()
    FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1))


def _optimizer_before_wrapping():
    model = Toy()
    opt = torch.optim.AdamW(model.parameters())
    model = FSDP(model)
    x, y = _batch(0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.step()


def _hybrid_bad_group():
    FSDP(Toy(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=tdist.group.WORLD)


def _hybrid_bad_size():
    init_hybrid_groups(3)


@pytest.mark.parametrize("fn, message", [
    (_hybrid_bad_size, r"shard_size=3 must divide the world size 2"),
    (_mixed_dtypes, r"mixes parameter dtypes \['torch.float32', 'torch.float64'\].*cast the model"),
    (_tied_across_units, r"tied weights across units.*wrap every module that uses it in one unit"),
    (_optimizer_before_wrapping, r"built before wrapping.*build it after"),
    (_hybrid_bad_group, r"HYBRID_SHARD takes process_group=\(shard_group, replicate_group\)"),
])
def test_bad_input_names_the_fix(fn, message):
    with pytest.raises(WorkerError, match=message):
        launch(fn, 2, timeout=60)


# --------------------------------------------------------------------------
# Memory by category (minifsdp.memory): what FULL_SHARD saves over SHARD_GRAD_OP
# --------------------------------------------------------------------------
def _memory_by_category(strategy):
    from minifsdp.memory import MemoryTracker
    from minifsdp.models import Block, build_model, lm_loss

    model = FSDP(build_model("gpt-tiny", seed=0, n_layer=4), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 sharding_strategy=ShardingStrategy[strategy])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker(sample_every=1)  # a sample after every op: exact per-category peaks
    tracker.track_model(model)
    with tracker:
        data = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
        lm_loss(model(data[:, :-1]), data[:, 1:]).backward()
        opt.step()
        live = tracker.snapshot("after step")
    peak = {c: max(s.bytes_by_category.get(c, 0) for s in tracker.samples) for c in ("unsharded_params",
                                                                                    "unsharded_grads")}
    units = {u._name: 4 * h.padded_numel for u in model.modules() if isinstance(u, FSDP) for h in u._handles}
    shards = sum(4 * p.numel() for p in model.parameters())
    return peak, live, units, shards


def test_memory_by_category_full_shard_vs_shard_grad_op():
    full_peak, full_live, units, shards = launch(_memory_by_category, 2, "FULL_SHARD", timeout=120)[0]
    zero2_peak, _, _, _ = launch(_memory_by_category, 2, "SHARD_GRAD_OP", timeout=120)[0]
    block = units["blocks.0"]
    assert set(units) == {"root", "blocks.0", "blocks.1", "blocks.2", "blocks.3"}
    # FULL_SHARD: at most the root (kept from forward to backward), the block computing and the one
    # prefetched (BACKWARD_PRE) are unsharded at once; SHARD_GRAD_OP keeps every unit from forward on.
    assert full_peak["unsharded_params"] == units["root"] + 2 * block
    assert zero2_peak["unsharded_params"] == sum(units.values())
    # unsharded gradients: the unit being reduced and the next one, never the whole model
    assert 0 < full_peak["unsharded_grads"] <= units["root"] + block
    # after the step: only shards are left (parameters exactly the flat shards)
    assert full_live["unsharded_params"] == 0 and full_live.get("unsharded_grads", 0) == 0
    assert full_live["parameters"] == shards == sum(units.values()) // 2


# --------------------------------------------------------------------------
# use_orig_params=True: original parameters as views of the shard, per-parameter groups
# --------------------------------------------------------------------------
def _param_groups(model):
    """Weight decay on matrices only: needs per-parameter groups, which flat shards cannot give."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in trainable if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for _, p in trainable if p.dim() <= 1], "weight_decay": 0.0}]


def _orig_params_steps(model, opt, steps, first=0):
    return train_steps(model, opt, _batch, _toy_loss, steps, first, max_norm=0.5)[0]


def _orig_params_run():
    out = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        torch.manual_seed(0)
        model = Toy()
        opt = torch.optim.AdamW(_param_groups(model), lr=1e-2)  # built BEFORE wrapping: still valid
        model = FSDP(model, use_orig_params=True, sharding_strategy=ShardingStrategy[strategy],
                     auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
        names = [n.replace("_fsdp_wrapped_module.", "") for n, _ in model.named_parameters()]
        losses = _orig_params_steps(model, opt, 2)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            sd = model.state_dict()
        kind = StateDictType.SHARDED_STATE_DICT if strategy == "FULL_SHARD" else StateDictType.FULL_STATE_DICT
        with FSDP.state_dict_type(model, kind):
            ckpt, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
        losses += _orig_params_steps(model, opt, 2, first=2)
        torch.manual_seed(1)  # a fresh, differently initialised model resumes from the checkpoint
        fresh = Toy()
        # groups chosen on the unwrapped model: once wrapped, every original parameter is a 1-D view at rest
        fresh_opt = torch.optim.AdamW(_param_groups(fresh), lr=1e-2)
        fresh = FSDP(fresh, use_orig_params=True, sharding_strategy=ShardingStrategy[strategy],
                     auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
        with FSDP.state_dict_type(fresh, kind):
            fresh.load_state_dict(ckpt)
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
        resumed = _orig_params_steps(fresh, fresh_opt, 2, first=2)  # 2: a shared step counter shows
        out[strategy] = (names, losses, resumed, sd)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_use_orig_params_per_parameter_groups_and_resume(n):
    torch.manual_seed(0)
    ref = Toy()
    ref_names = [name for name, _ in ref.named_parameters()]
    opt = torch.optim.AdamW(_param_groups(ref), lr=1e-2)
    ref_losses = _orig_params_steps(ref, opt, 2)
    ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_losses += _orig_params_steps(ref, opt, 2, first=2)
    for strategy, (names, losses, resumed, sd) in launch(_orig_params_run, n, timeout=120)[0].items():
        assert names == ref_names, strategy       # the original parameters, in the original order
        torch.testing.assert_close(losses, ref_losses, atol=ATOL, rtol=RTOL, msg=strategy)
        for k, v in ref_sd.items():
            torch.testing.assert_close(sd[k], v, atol=ATOL, rtol=RTOL, msg=f"{strategy}: {k}")
        assert resumed == losses[2:], strategy    # resumed from the checkpoint: bit-identical


def test_without_a_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match=r"needs a process group: call it inside minifsdp.launch"):
        FSDP(nn.Linear(2, 2))


# --------------------------------------------------------------------------
# repr: reads like torch's FSDP (wrapped units shown nested), before and after use
# --------------------------------------------------------------------------
def _reprs():
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    from minifsdp.models import Block, build_model, lm_loss

    ours = FSDP(build_model("gpt-tiny", seed=0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    theirs = TorchFSDP(build_model("gpt-tiny", seed=0), auto_wrap_policy=TorchPolicy({Block}),
                       device_id=torch.device("cpu"))
    out = {"fresh": repr(ours), "torch": repr(theirs), "n_layer": ours.config.n_layer}  # __getattr__ fallback
    data = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    lm_loss(ours(data[:, :-1]), data[:, 1:]).backward()
    out["after_step"] = repr(ours)
    with FSDP.summon_full_params(ours):
        pass
    out["after_summon"] = repr(ours)
    return out


def test_repr_reads_like_torch_fsdp():
    from minifsdp.models import build_model

    out = launch(_reprs, 2, timeout=120)[0]
    assert out["fresh"].startswith("FullyShardedDataParallel(\n  (_fsdp_wrapped_module): GPT(\n")
    assert "(0-1): 2 x FullyShardedDataParallel(\n        (_fsdp_wrapped_module): Block(" in out["fresh"]
    assert "LayerNorm((32,), eps=1e-05, elementwise_affine=True, bias=True)" in out["fresh"]
    assert out["fresh"] == out["torch"] == out["after_step"] == out["after_summon"]
    assert out["n_layer"] == build_model("gpt-tiny").config.n_layer


# --------------------------------------------------------------------------
# param_init_fn: a model built on the meta device, materialized by FSDP before flattening
# --------------------------------------------------------------------------
def _seeded_init(module, name):
    """A user's deterministic per-module init: values drawn from a generator seeded by the module's name."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    with torch.no_grad():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None:
                t.copy_(torch.ones_like(t).triu(1) if t.dtype == torch.bool else torch.randn(t.shape, generator=g) / 8)


def _gpt_losses(model):
    from minifsdp.models import lm_loss

    return train_steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3), gpt_batch, lm_loss, 3)[0]


def _meta_gpt():
    from minifsdp.models import Block, build_model

    meta = build_model("gpt-tiny", device="meta", tie_embeddings=True)  # to_empty unties; FSDP re-ties
    names = {id(m): name for name, m in meta.named_modules()}
    called = []

    def param_init_fn(m):
        called.append(names[id(m)])
        m.to_empty(device=torch.device("cpu"), recurse=False)
        _seeded_init(m, names[id(m)])
    model = FSDP(meta, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=param_init_fn)
    return sorted(called), _gpt_losses(model)


def test_param_init_fn_materializes_a_meta_model_like_one_built_normally():
    from minifsdp.models import build_model

    ref = build_model("gpt-tiny", seed=0, tie_embeddings=True)
    seen = set()  # the tied head.weight keeps tok_emb's values (its first owner), as FSDP re-ties it
    for name, m in ref.named_modules():
        if not any(id(t) in seen for t in m.parameters(recurse=False)):
            _seeded_init(m, name)
        seen.update(id(t) for t in m.parameters(recurse=False))
    ref_losses = _gpt_losses(ref)
    called, losses = launch(_meta_gpt, 2, timeout=120)[0]
    assert called == sorted(name for name, _ in ref.named_modules())  # once per module, as torch
    torch.testing.assert_close(losses, ref_losses, atol=ATOL, rtol=RTOL)


def _meta_defaults_and_errors():
    from minifsdp.models import build_model

    def make():
        return nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.Sequential(nn.Linear(7, 3)))
    with torch.device("meta"):
        meta = make()
    torch.manual_seed(0)  # reset_parameters() draws from the global RNG, in construction order
    model = FSDP(meta, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
    errors = []
    for fn in (None, lambda m: None):
        try:
            FSDP(build_model("gpt-tiny", device="meta"), param_init_fn=fn)
        except ValueError as e:
            errors.append(str(e))
    return sd, errors


def test_meta_model_without_param_init_fn_uses_reset_parameters_or_names_the_fix():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.Sequential(nn.Linear(7, 3))).state_dict()
    sd, errors = launch(_meta_defaults_and_errors, 2, timeout=60)[1]
    assert sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert len(errors) == 2
    assert errors[0].startswith("module 'blocks.0.attn' (CausalSelfAttention) is on the meta device and has no "
                                "reset_parameters()") and "param_init_fn=fn" in errors[0]
    assert errors[1].startswith("param_init_fn left ['tok_emb.weight'") and "module.to_empty(" in errors[1]
