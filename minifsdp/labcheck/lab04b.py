"""Checks for lab 04b (per-parameter sharding, FSDP2's ``fully_shard``): the learner's Shard(0) pieces, the
group's all-gather and reduce-scatter, and gradient accumulation with and without sync.

The learner shards every parameter on its own along dim 0, as PyTorch's FSDP2 does
(``torch.chunk``'s pieces, each padded to ``ceil(n/N)`` rows), gathers a whole group
(a Block, or the root's leftovers) with one all-gather (copy-in, gather, copy-out
without the padding), reduce-scatters the group's gradients with one call, and
writes FSDP2's post-backward with and without gradient sync. Each check runs the
learner's code (on 3 ranks where it communicates: CPU ranks where the machine has
fewer GPUs), compares with one process and with the library's FSDP2
(``minifsdp.fsdp.fully_shard``; torch's own is only a tripwire here), and prints one verdict::

    from minifsdp.labcheck import lab04b as check
    check.shard_param(shard_param, real_rows)
    check.unshard(shard_model, unshard, reshard)
    check.reduce_scatter_grads(reduce_scatter_grads)
    check.post_backward(shard_model, post_backward, train_step)
    check.hint("unshard")            # the next hint for an exercise, idea first

Targets (Ψ = the number of parameters; "padded Ψ" = the sum over parameters of
``N x ceil(n/N)`` rows times the row's numbers): torch's ``Shard(0)`` split; one
process's logits, gradients and parameters (fp32 tolerances below); one all-gather
per group and ``4 B x`` padded Ψ per forward; one reduce-scatter per group; per
accumulation step of ``k`` micro-batches ``2k`` all-gathers of the parameters and
``k`` reduce-scatters with sync every micro-batch, 1 without, and without sync
exactly ``4Ψ`` bytes of full-size gradients held between micro-batches.

Authorship: every check refuses the library's per-parameter FSDP and its flat FSDP
(minifsdp's and torch's: ``fully_shard`` and FSDP2's internals, DTensor's Shard(0)
split and gathers, ``minifsdp.fsdp``'s flat units) statically and at run time, a
:class:`~minifsdp.labcheck.authorship.Wire` around the learner's code in each worker.
"""

from __future__ import annotations

import importlib
import math
import types
from typing import Any, Callable

import torch

from .. import data, dist, models, trace
from ..fsdp import FullyShardedDataParallel, naive
from ..fsdp.flat_param import FlatParamHandle
from .authorship import Wire, watched
from .verdict import Hints, call, check_world, failed, figures, passed, require_own, run_explained

__all__ = ["shard_param", "unshard", "reduce_scatter_grads", "post_backward", "hint", "results", "LIBRARY"]


def _functions(module: types.ModuleType) -> list[Any]:
    """The functions and classes ``module`` defines itself (not what it imports)."""
    return [v for v in vars(module).values()
            if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) == module.__name__]


def _torch_fsdp2() -> tuple:
    """torch's per-parameter FSDP: ``fully_shard``, FSDP2's collectives (copy-in, all-gather, copy-out,
    reduce-scatter), every Python method of its FSDPParam and FSDPParamGroup (a Wire follows only minifsdp's
    classes), and DTensor's Shard(0) split and the gathers and reductions it would do for you."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    classes = (_fsdp_param.FSDPParam, _fsdp_param_group.FSDPParamGroup)
    methods = tuple(f for c in classes for f in vars(c).values() if isinstance(f, types.FunctionType))
    shard = tuple(getattr(Shard, name) for name in ("_split_tensor", "_to_replicate_tensor", "_reduce_shard_tensor")
                  if hasattr(Shard, name))
    return (fully_shard, *_functions(_fsdp_collectives), *classes, *methods, distribute_tensor, DTensor.full_tensor,
            DTensor.redistribute, redistribute_local_tensor, *shard)


def _minifsdp_fully_shard() -> tuple:
    """minifsdp's own per-parameter FSDP: every function and class of ``fully_shard.py`` (``fully_shard``,
    ``FSDPModule``, the hooks), ``fsdp_param.py`` (``FSDPParam``, ``ShardLayout``) and ``param_group.py``.
    (By module path: ``minifsdp.fsdp`` re-exports the function ``fully_shard`` under its module's name.)"""
    modules = [importlib.import_module(f"minifsdp.fsdp.{name}")
               for name in ("fully_shard", "fsdp_param", "param_group")]
    return tuple(obj for module in modules for obj in _functions(module))


# The library's implementation of what the exercises build: per-parameter sharding, the group's gather and
# reduce-scatter, post-backward -- minifsdp's and torch's -- and lab 04's flat FSDP beside them.
FLAT = (naive.NaiveFullyShardedDataParallel, naive.FlatUnit, FullyShardedDataParallel, FlatParamHandle)
LIBRARY = (*_minifsdp_fully_shard(), *_torch_fsdp2(), *FLAT)

results: dict[str, Any] = {}   # what the last run of each check measured, for the lab's plots
RANKS = 3                      # N = 3: gpt-tiny's 32-row parameters pad (11, 11, 10 rows)
MODEL, BATCH, SEQ, LR, MICRO = "gpt-tiny", 12, 16, 1e-3, 2   # 12 rows: 3 ranks split them evenly
MLP_DIMS = (6, 4, 3)           # at 3 ranks the first layer's 4 rows split 2, 2, 0: rank 2 holds none
SHAPES = ((5, 3), (4, 6), (7,), (2, 4), (96, 32), (1, 5))
WORLDS = (2, 3, 4, 8)
GRAD_SHAPES = ((5, 3), (4, 6), (7,), (2, 4), (32, 8))   # at 3 ranks rank 2 holds no row of (4, 6) nor (2, 4)
ATOL, RTOL = 1e-5, 1e-4        # fp32, another order of additions than one process
FP32 = 4

hint = Hints({
    "shard_param": [
        "Cut dim 0 as torch.chunk does: ceil(n/N) rows per rank, in rank order, until the rows run out. "
        "The last ranks may get fewer rows, or none at all.",
        "Every rank's piece then has ceil(n/N) rows: its real rows first, zero rows after them. The other "
        "dimensions stay as they are: a row of a [5, 3] weight is 3 numbers.",
        "The piece becomes a Parameter of its own: a new tensor (not a view into the parameter, which would "
        "keep all of it alive), with no autograd history.",
        "real_rows: rank r's piece starts at row r x ceil(n/N). Count what is left of the n rows from there: "
        "at most ceil(n/N), never fewer than 0.",
    ],
    "unshard": [
        "Copy-in: every padded shard of the group flattened, all of them end to end in one tensor. Each rank's "
        "buffer then has the same size, as the all-gather needs.",
        "The all-gather's output is N of those buffers, in rank order. Seen as N rows, the columns that belong to "
        "parameter i are its padded pieces from every rank.",
        "Copy-out: a parameter's pieces stacked in rank order are its rows, then the padding rows at the end. "
        "Keep its first n rows, in its shape, in the unsharded parameter itself.",
        "Write through .data: autograd saved the unsharded parameters in forward and would see a write into them. "
        "The modules hold parameters in module._parameters[name]; reshard swaps back, then frees.",
    ],
    "reduce_scatter_grads": [
        "Pad each gradient's dim 0 to N x ceil(n/N) rows: N equal pieces, piece r = rank r's rows, as shard_param "
        "cuts them.",
        "Piece r of the reduce-scatter's input must hold piece r of every gradient. Lay the input out as N rows: "
        "row r = rank r's piece of each gradient, one after the other.",
        "The output is this rank's row of that layout, summed over the ranks: divide by N for the average, then "
        "cut it into each gradient's padded piece.",
        "Give each piece the gradient's shape (ceil(n/N) rows), and return only its real rows.",
    ],
    "post_backward": [
        "With sync: the group's full gradients go through your reduce_scatter_grads, and each sharded "
        "parameter's .grad adds the result (the second micro-batch adds to the first).",
        "Without sync: leave the gradients where they are. Autograd adds the next micro-batch into the same "
        "unsharded .grad; the last backward, with sync, reduces the sum once.",
        "After a sync no full-size gradient stays: take it off the unsharded parameters. Reshard in both cases: "
        "the weights are not needed again until the next forward.",
        "train_step: before each backward, say whether it syncs (every micro-batch, or only the last), as FSDP2's "
        "set_requires_gradient_sync does. One optimizer step, then zero the gradients.",
    ],
})


# -- how a raw torch error reads, in the lab's words -----------------------------------------------------
_WRITTEN = ("an unsharded parameter was written where autograd sees it (it saved the unsharded parameters in "
            "forward and counts writes to them): write the gathered values through .data")
_TRANSLATIONS = (
    ("modified by an inplace operation", _WRITTEN),
    ("leaf Variable that requires grad is being used in an in-place", _WRITTEN),
    ("a view of a leaf Variable that requires grad", _WRITTEN),
    ("setStorage", "a group's unsharded parameters held no memory when they were written or read: unshard gives "
                   "them memory (group.allocate()) before the copy-out"),
    ("storage of size 0", "a group's unsharded parameters held no memory when they were written or read: unshard "
                          "gives them memory (group.allocate()) before the copy-out"),
    ("cannot be multiplied", "a module computed with a sharded parameter: during the group's forward each module "
                             "must hold the unsharded parameter in its slot (module._parameters)"),
    ("must match the size of tensor", "a gathered parameter did not fit its unsharded parameter: in the copy-out "
                                      "keep each parameter's own rows, in its shape, and drop the padding rows"),
)


def _beside(label: str, yours: str, target: str, library: str) -> str:
    """'label: yours X, target Y, library (fully_shard) Z': the learner's figure, the target, minifsdp's FSDP2."""
    return f"{label}: yours {yours}, target {target}, library (fully_shard) {library}"


def _run(what: str, fn: Callable, world_size: int, *args: Any) -> list:
    """``verdict.run``, with the raw torch errors a learner meets said in one sentence of the lab."""
    return run_explained(what, fn, world_size, *args, translations=_TRANSLATIONS)


# -- the layout, computed here (never handed to the learner) ------------------------------------------------
def _rows(n: int, world: int) -> int:
    return math.ceil(n / world)


def _piece(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """torch.chunk's piece ``rank`` of dim 0 (empty past the last row): a rank's real rows."""
    rows = _rows(t.shape[0], world)
    return t[rank * rows:(rank + 1) * rows]


def _padded_numel(shapes: list[tuple[int, ...]], world: int) -> int:
    """Numbers one rank's padded pieces hold, times N: what the group's collectives move, in elements."""
    return sum(world * _rows(s[0], world) * math.prod(s[1:]) for s in shapes)


def _param_shapes(name: str) -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in _build(name, device="meta").parameters()]


def _build(name: str, device: str = "cpu") -> torch.nn.Module:
    if name == "mlp":
        return models.build_model("mlp", dims=MLP_DIMS, device=device)
    return models.build_model(name, device=device)


def _reference_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """torch's own Shard(0) piece of ``t`` for ``rank``, padded (DTensor's split, with_padding=True)."""
    from torch.distributed.tensor import Shard
    pieces, _ = Shard(0)._split_tensor(t, world, with_padding=True)
    return pieces[rank]


# -- exercise 1: the Shard(0) piece, in this process ------------------------------------------------------------
def _piece_verdict(got: Any, t: torch.Tensor, rank: int, world: int) -> str | None:
    """What is wrong with the learner's piece ``got`` of ``t`` for ``rank`` (None: torch's Shard(0) piece)."""
    n, rows = t.shape[0], _rows(t.shape[0], world)
    want, real = _reference_shard(t.detach(), rank, world), _piece(t.detach(), rank, world).shape[0]
    if not isinstance(got, torch.Tensor):
        return f"shard_param returned {type(got).__name__}: return a tensor, the padded piece"
    if got.shape != want.shape:
        if got.dim() == 1 and t.dim() > 1:
            why = ("keep the parameter's other dimensions: FSDP2 cuts rows (dim 0), not a flat vector (that was "
                   "lab 04's flat unit)")
        elif got.shape[0] == real and real != rows:
            why = (f"that is its {real} real row(s) only: pad with zero rows to ceil({n}/{world}) = {rows}, so every "
                   "rank sends the same bytes")
        else:
            why = f"every rank's piece has ceil({n}/{world}) = {rows} row(s), real ones first"
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}: {why}"
    if got.requires_grad or got.grad_fn is not None:
        return "the piece carries autograd history (requires_grad): detach it, it becomes a parameter of its own"
    if not torch.equal(got.detach(), want):
        if torch.equal(got.detach()[:real], want[:real]):
            return f"the padding rows after the {real} real row(s) must be zeros"
        spread = torch.tensor_split(t.detach(), world)[rank]
        if spread.shape[0] != real and torch.equal(got.detach()[:spread.shape[0]], spread):
            return (f"the real rows differ from torch's Shard(0) piece: your cut spreads the rows evenly (n // N, one "
                    f"more for the first ranks); torch.chunk gives every rank ceil(n/N) = {rows} until the rows run out")
        return (f"the real rows differ from torch's Shard(0) piece: rank r keeps rows r x {rows} to (r + 1) x {rows} "
                "of the parameter, in order (the order the all-gather puts them back in)")
    held, own = got.untyped_storage().nbytes(), got.numel() * got.element_size()
    if held != own:
        return (f"the piece is a view into {held:,} bytes, not {own:,} bytes of its own: return a new tensor, or "
                "every rank keeps the whole parameter alive")
    return None


def shard_param(shard_param: Callable[[torch.Tensor, int, int], torch.Tensor],
                real_rows: Callable[[int, int, int], int]) -> None:
    """``shard_param`` and ``real_rows`` on 6 shapes at N = 2, 3, 4, 8 against torch's Shard(0) split."""
    what = "Shard(0) piece"
    require_own(what, LIBRARY, shard_param, real_rows)
    shard_param, real_rows = watched(shard_param, *LIBRARY), watched(real_rows, *LIBRARY)
    gen = torch.Generator().manual_seed(0)
    empty_seen = 0
    for shape in SHAPES:
        t = torch.randn(shape, generator=gen, requires_grad=True)   # a parameter: the piece must not keep autograd
        n = shape[0]
        for world in WORLDS:
            rows = _rows(n, world)
            for rank in range(world):
                real = _piece(t.detach(), rank, world).shape[0]
                empty_seen += real == 0
                why = _piece_verdict(call(what, shard_param, t, rank, world), t, rank, world)
                if why:
                    failed(what, f"a [{', '.join(map(str, shape))}] parameter, rank {rank} of {world}: {why}")
                answer = call(what, real_rows, n, rank, world)
                if answer != real:
                    extra = f": rank {rank} starts at row {rank * rows}, past the last row" if real == 0 else ""
                    failed(what, f"real_rows({n}, {rank}, {world}) = {answer!r}, expected {real} (torch.chunk cuts "
                                 f"{n} rows into pieces of {rows}){extra}")
    shapes = _param_shapes(MODEL)
    yours = RANKS * sum(call(what, shard_param, torch.zeros(s), 0, RANKS).numel() for s in shapes)
    psi = sum(math.prod(s) for s in shapes)
    torch_padded = RANKS * sum(_reference_shard(torch.zeros(s), 0, RANKS).numel() for s in shapes)
    passed(what, f"torch's Shard(0) pieces for {len(SHAPES)} shapes at N = {', '.join(map(str, WORLDS))} "
                 f"({empty_seen} ranks holding no real row), each a copy with zeros after the real rows; "
                 + figures(f"{MODEL}'s padding at N = {RANKS} (target: torch's Shard(0); Ψ = {psi:,} parameters)",
                           yours - psi, torch_padded - psi, unit="numbers"))


# -- exercise 2: unshard and reshard, a forward on 3 ranks -----------------------------------------------------
def _inputs(name: str) -> torch.Tensor:
    if name == "mlp":
        return torch.randn(BATCH, MLP_DIMS[0], generator=torch.Generator().manual_seed(1))
    return data.get_batch(0, BATCH, SEQ)[0]


def _forward_single() -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: _build(name)(_inputs(name)) for name in ("mlp", MODEL)}


def _slot_names(model: torch.nn.Module, group: Any) -> list[str]:
    paths = {id(m): p for p, m in model.named_modules()}
    return [f"{paths.get(id(m), '?')}.{attr}".lstrip(".") for m, attr in group.slots]


def _forward_worker(shard_model: Callable, library: bool) -> dict:
    """A forward through the learner's groups on each model: what the modules held, the bytes, the logits."""
    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    out: dict[str, Any] = {}
    for name in ("mlp", MODEL):
        model = _build(name).to(device)
        full = {k: p.detach().clone() for k, p in model.named_parameters()}
        with Wire(*LIBRARY):
            groups = list(shard_model(model))
        res: dict[str, Any] = {"groups": [], "during": {}, "swapped": []}
        for g in groups:
            names = _slot_names(model, g)
            res["groups"].append(names)
            bad = [k for k, s in zip(names, g.padded) if not torch.equal(s, _piece_padded(full[k], rank, n))]
            if bad:
                res["bad_shards"] = bad
        if "bad_shards" in res:
            out[name] = res
            continue
        originals = {id(g): [(id(u), u._version) for u in g.unsharded] for g in groups}

        def during(module: Any, args: Any, g: Any) -> None:   # registered after the scaffold's: after unshard
            for (m, attr), u, k in zip(g.slots, g.unsharded, _slot_names(model, g)):
                held = m._parameters.get(attr)
                res["during"][k] = ("unsharded" if held is u else "sharded" if any(held is p for p in g.sharded)
                                    else "other", (u.detach() - full[k]).abs().max().item()
                                    if u.untyped_storage().nbytes() and u.shape == full[k].shape else None)
        for g in groups:
            g.module.register_forward_pre_hook(lambda m, a, g=g: during(m, a, g))
        with trace.Tracer(rank=rank) as tracer:
            with trace.span("measured"), Wire(*LIBRARY):
                logits = model(_inputs(name)[rows].to(device))
        res["logits"] = logits.detach().cpu()
        res["bytes"] = tracer.trace.bytes_by_op(within="measured")
        res["gathers"] = sum(1 for s in tracer.trace.spans if s.name == "all_gather")
        for g in groups:
            for (m, attr), p, u, (uid, version), k in zip(g.slots, g.sharded, g.unsharded, originals[id(g)],
                                                            _slot_names(model, g)):
                state = []
                if m._parameters.get(attr) is not p:
                    state.append("not the sharded parameter in its slot")
                if u.untyped_storage().nbytes():
                    state.append("unsharded memory not freed")
                if id(u) != uid:
                    state.append("unsharded parameter replaced")
                if u._version != version:
                    state.append("written in place")
                if state:
                    res["swapped"].append((k, state))
        out[name] = res
    if library:   # minifsdp's fully_shard: its all-gathered bytes for the same forward
        model = _fsdp2(_build(MODEL).to(device))
        with trace.Tracer(rank=rank) as tracer, torch.no_grad():
            model(_inputs(MODEL)[rows].to(device))
        out["library_bytes"] = tracer.trace.bytes_by_op()
    return out


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with minifsdp's ``fully_shard`` on every Block, then on the root (FSDP2's recipe)."""
    from ..fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _piece_padded(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = _rows(t.shape[0], world)
    out = t.new_zeros((rows, *t.shape[1:]))
    piece = _piece(t, rank, world)
    out[:piece.shape[0]] = piece
    return out


def unshard(shard_model: Callable, unshard: Callable, reshard: Callable) -> None:
    """Forwards on 3 ranks through the learner's groups (gpt-tiny, and an MLP with an empty rank) against one
    process: the modules hold the gathered parameters in forward and the sharded ones after; one all-gather per
    group, 4 B x padded Ψ in all, beside the library's fully_shard."""
    what = "unshard"
    require_own(what, LIBRARY, shard_model, unshard, reshard)
    n = check_world(RANKS)
    want = _forward_single()
    res = _run(what, _forward_worker, n, shard_model, True)
    for name in ("mlp", MODEL):
        label = f"{n} ranks, {'an MLP ' + str(MLP_DIMS) if name == 'mlp' else name}"
        first = res[0][name]
        if any("bad_shards" in r[name] for r in res):
            bad = next(r[name]["bad_shards"] for r in res if "bad_shards" in r[name])
            failed(what, f"{label}: the groups' padded shards of {bad[:3]} are not torch's Shard(0) pieces: pass "
                         "exercise 1's check first (shard_param)")
        shapes = _param_shapes(name)
        flat = sorted(k for g in first["groups"] for k in g)
        if flat != sorted(k for k, _ in _build(name, device="meta").named_parameters()):
            failed(what, f"{label}: the groups hold {flat}: every parameter in exactly one group")
        for r, out in enumerate(res):
            out = out[name]
            seen = out["during"]
            missing = [k for k in flat if k not in seen]
            if missing:
                failed(what, f"{label}, rank {r}: the forward never reached the groups of {missing[:3]}")
            not_held = [k for k, (held, _) in seen.items() if held != "unsharded"]
            if not_held:
                failed(what, f"{label}, rank {r}: during its group's forward, {not_held[0]}'s module held "
                             f"{'its sharded parameter' if seen[not_held[0]][0] == 'sharded' else 'another tensor'}, "
                             "not the unsharded one: unshard puts each unsharded parameter in its module's slot")
            wrong = [(k, d) for k, (_, d) in seen.items() if d is None or d > 0]
            if wrong:
                k, d = wrong[0]
                why = ("it held no memory: unshard gives the unsharded parameters memory first (group.allocate())"
                       if d is None else f"they differ by {d:.2g}: copy each parameter's rows out of every rank's "
                       "piece, in rank order, dropping the padding rows")
                failed(what, f"{label}, rank {r}: during forward the unsharded {k} is not the full parameter: {why}")
            if out["swapped"]:
                k, state = out["swapped"][0]
                if "written in place" in state:
                    failed(what, f"{label}: {_WRITTEN}")
                if "unsharded parameter replaced" in state:
                    failed(what, f"{label}, rank {r}: {k}: the group's unsharded parameter was replaced by another "
                                 "tensor: fill the same object (autograd saved it, and its hook tells post_backward)")
                failed(what, f"{label}, rank {r}: after forward, {k}: {state[0]}: reshard puts the sharded "
                             "parameter back in its slot and frees the unsharded memory (group.free())")
            rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
            got, ref = out["logits"], want[name][rows]
            if got.shape != ref.shape or not torch.allclose(got, ref, atol=ATOL, rtol=RTOL):
                failed(what, f"{label}, rank {r}: the output differs from one process's although the gathered "
                             "parameters are right: did the modules compute with them?")
        target = FP32 * _padded_numel(shapes, n)
        got_bytes, calls, groups = first["bytes"], first["gathers"], len(first["groups"])
        if set(got_bytes) - {"all_gather"}:
            failed(what, f"{label}: a forward moved {got_bytes}: unshard only all-gathers")
        if calls != groups:
            failed(what, f"{label}: {calls} all-gathers for {groups} group(s): FSDP2 gathers a whole group with "
                         "one call (copy every shard into one buffer first)")
        if got_bytes.get("all_gather", 0) != target:
            failed(what, f"{label}: all-gathered {got_bytes.get('all_gather', 0):,} B per forward, target {target:,} B "
                         "(4 B x N x ceil(n/N) rows of each parameter): send the padded shards, each once")
    library_bytes = res[0]["library_bytes"].get("all_gather", 0)
    passed(what, f"one process's outputs at {n} ranks ({MODEL}, and an MLP whose rank {n - 1} holds no row of its "
                 f"first layer); the modules held the gathered parameters in forward, the sharded ones after; "
                 + _beside(f"{MODEL} all-gathered per forward", f"{got_bytes['all_gather']:,} B in {calls} calls",
                           f"{target:,} B, one call per group", f"{library_bytes:,} B"))


# -- exercise 3: one reduce-scatter for a group's gradients ------------------------------------------------------
def _grad(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank ``rank``'s full gradient of a parameter of ``shape`` (deterministic, the same in every process)."""
    seed = 1000 * rank + sum(shape) * 7 + len(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _reduce_worker(fn: Callable) -> dict:
    torch.set_num_threads(1)
    rank, device = dist.rank(), dist.device()
    grads = [_grad(s, rank).to(device) for s in GRAD_SHAPES]
    with trace.Tracer(rank=rank) as tracer, Wire(*LIBRARY):
        got = fn(grads)
    out = {"bytes": tracer.trace.bytes_by_op(),
           "calls": sum(1 for s in tracer.trace.spans if s.name == "reduce_scatter")}
    if not isinstance(got, (list, tuple)):
        out["type"] = type(got).__name__
    else:
        out["got"] = [g.detach().cpu().clone() if isinstance(g, torch.Tensor) else type(g).__name__ for g in got]
    return out


def reduce_scatter_grads(reduce_scatter_grads: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
    """5 gradients of awkward shapes on 3 ranks: each rank's real rows of the average, with one reduce-scatter."""
    what = "reduce_scatter_grads"
    require_own(what, LIBRARY, reduce_scatter_grads)
    n = check_world(RANKS)
    res = _run(what, _reduce_worker, n, reduce_scatter_grads)
    target = FP32 * _padded_numel(list(GRAD_SHAPES), n)
    for r, out in enumerate(res):
        if "type" in out:
            failed(what, f"it returned {out['type']}: return a list, one tensor per gradient")
        if len(out["got"]) != len(GRAD_SHAPES):
            failed(what, f"rank {r}: {len(out['got'])} tensors back for {len(GRAD_SHAPES)} gradients: one each")
        for i, (shape, got) in enumerate(zip(GRAD_SHAPES, out["got"])):
            every = [_grad(shape, k) for k in range(n)]
            mean = torch.stack(every).mean(0)
            want = _piece(mean, r, n)
            where = f"rank {r}, the [{', '.join(map(str, shape))}] gradient"
            if not isinstance(got, torch.Tensor):
                failed(what, f"{where}: got {got}, expected a tensor")
            if got.shape != want.shape:
                rows = _rows(shape[0], n)
                if got.shape[0] == rows and got.shape[1:] == want.shape[1:]:
                    why = (f"those are its {rows} padded rows: return only the {want.shape[0]} real one(s) "
                           "(the padding rows belong to no parameter)")
                else:
                    why = "each result has the gradient's shape, with this rank's real rows"
                failed(what, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}: {why}")
            if torch.allclose(got, want, atol=ATOL, rtol=RTOL):
                continue
            if torch.allclose(got, n * want, atol=ATOL * n, rtol=RTOL):
                failed(what, f"{where}: {n} x the right values: the reduce-scatter SUMS over the ranks; the average "
                             "divides by the world size")
            failed(what, f"{where}: not rank {r}'s rows of the average over ranks: piece r of the reduce-scatter's "
                         "input must hold rank r's padded rows of every gradient, one gradient after another")
    got_bytes, calls = res[0]["bytes"], res[0]["calls"]
    if set(got_bytes) - {"reduce_scatter"}:
        failed(what, f"{n} ranks moved {got_bytes}: the exercise is one reduce-scatter, nothing else")
    if calls != 1:
        failed(what, f"{calls} reduce-scatters for one group of {len(GRAD_SHAPES)} gradients: FSDP2 reduces the whole "
                     "group in one call (one buffer laid out so that piece r holds rank r's rows of every gradient)")
    if got_bytes["reduce_scatter"] != target:
        failed(what, f"reduce-scattered {got_bytes['reduce_scatter']:,} B, target {target:,} B (4 B x N x ceil(n/N) "
                     "rows of each gradient): pad each gradient to N x ceil(n/N) rows, no more")
    passed(what, f"rank r's real rows of the average over {n} ranks for {len(GRAD_SHAPES)} gradients (rank {n - 1} "
                 "holds no row of two of them); "
                 + figures("reduce-scattered", f"{got_bytes['reduce_scatter']:,} B in {calls} call",
                           f"{target:,} B in 1 call"))


# -- exercise 4: post-backward with and without sync, whole steps on 3 ranks ------------------------------
def _micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [data.get_batch(step + 100 * micro, BATCH, SEQ) for micro in range(MICRO)]


def _train_single() -> dict:
    """One process: per step, the gradient of each micro-batch alone and of the step; the final parameters."""
    model = models.build_model(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {"grads": [], "micro": []}
    for step in range(2):
        alone = []
        for x, y in _micro_batches(step):
            before = {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                      for k, p in model.named_parameters()}
            models.lm_loss(model(x), y).backward()
            alone.append({k: p.grad - before[k] for k, p in model.named_parameters()})
        out["micro"].append(alone)
        out["grads"].append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


class _Recording(torch.optim.AdamW):
    """AdamW that keeps, at each step, every parameter's gradient and the full-size gradients still held."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], held: Callable[[], int], **kw: Any):
        self.named, self.held, self.records = named, held, []
        super().__init__([p for _, p in named], **kw)

    def step(self, closure: Any = None) -> Any:
        self.records.append({"grads": {k: None if p.grad is None else p.grad.detach().cpu().clone()
                                       for k, p in self.named}, "held": self.held()})
        return super().step(closure)


def _accumulate(model: torch.nn.Module, opt: Any, batches: list, sync_every: bool) -> None:
    """The check's own FSDP2 loop, for the library's fully_shard (not the learner's)."""
    for i, (x, y) in enumerate(batches):
        model.set_requires_gradient_sync(sync_every or i == len(batches) - 1)
        models.lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train_worker(shard_model: Callable, train_step: Callable) -> dict:
    """Two accumulation steps through the learner's groups (sync every micro-batch, then once); then the library's."""
    torch.set_num_threads(1)
    rank, n, device = dist.rank(), dist.world_size(), dist.device()
    rows = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    model = models.build_model(MODEL).to(device)
    with Wire(*LIBRARY):
        groups = list(shard_model(model))
    unsharded = [u for g in groups for u in g.unsharded]
    held = lambda: sum(u.grad.nbytes for u in unsharded if u.grad is not None)   # noqa: E731
    named = list(model.named_parameters())
    out: dict[str, Any] = {"shapes": {k: tuple(p.shape) for k, p in named}, "held": [], "bytes": []}
    opt = _Recording(named, held, lr=LR)
    model.register_forward_pre_hook(lambda m, a: out["held"].append(held()))   # at each micro-batch's start
    with trace.Tracer(rank=rank) as tracer:
        for step in range(2):
            batches = [(x[rows].to(device), y[rows].to(device)) for x, y in _micro_batches(step)]
            with trace.span(f"step {step}"), Wire(*LIBRARY):
                train_step(model, opt, batches, step == 0)
            out["bytes"].append(tracer.trace.bytes_by_op(within=f"step {step}"))
    out["records"] = opt.records
    out["held_after"] = held()
    out["params"] = {k: p.detach().cpu().clone() for k, p in model.named_parameters()}
    # minifsdp's fully_shard, the same two steps by the check's own loop: its reduce-scattered bytes per step
    ref = _fsdp2(models.build_model(MODEL).to(device))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    out["library_bytes"] = []
    for step in range(2):
        batches = [(x[rows].to(device), y[rows].to(device)) for x, y in _micro_batches(step)]
        with trace.Tracer(rank=rank) as tracer:
            _accumulate(ref, ref_opt, batches, step == 0)
        out["library_bytes"].append(tracer.trace.bytes_by_op())
    return out


def _grad_verdict(n: int, r: int, step: int, k: str, got: Any, want: torch.Tensor, micro: list) -> str:
    """Why rank r's sharded gradient of k differs from one process's at ``step``, in words."""
    if got is None:
        return (f"{k} has no gradient at step {step}'s optimizer step: with sync, post_backward adds this rank's "
                "reduced rows to the sharded parameter's .grad")
    if got.shape != want.shape:
        return f"{k}'s gradient has shape {tuple(got.shape)}, the sharded parameter {tuple(want.shape)}"
    last = _piece(micro[-1][k], r, n)
    if torch.allclose(got, last, atol=ATOL, rtol=RTOL):
        if step == 0:
            return ("only the last micro-batch's gradient reached the step: post_backward must add to the sharded "
                    ".grad, not replace it")
        return ("only the last micro-batch's gradient reached the step: without sync the first one must stay in "
                "the unsharded .grad (autograd adds the next micro-batch into it) until the backward with sync")
    if torch.allclose(got, n * want, atol=ATOL * n, rtol=RTOL):
        return f"{n} x the right gradient: divide the reduce-scatter's sum by the world size (exercise 3's check)"
    twice = torch.allclose(got, 2 * want, atol=2 * ATOL, rtol=RTOL)
    if twice or torch.allclose(got, want + last, atol=ATOL, rtol=RTOL):
        return ("a micro-batch's gradient was counted twice: after a sync, take the full gradients off the unsharded "
                "parameters, or the next backward adds to them again")
    return "it differs from one process's: run exercise 3's check, then look at post_backward"


def post_backward(shard_model: Callable, post_backward: Callable, train_step: Callable) -> None:
    """Two steps of 2 micro-batches on 3 ranks (sync every micro-batch, then once) against one process: gradients,
    parameters, bytes per step and the full-size gradients held between micro-batches, beside the library's."""
    what = "post_backward"
    require_own(what, LIBRARY, shard_model, post_backward, train_step)
    n = check_world(RANKS)
    ref = _train_single()
    res = _run(what, _train_worker, n, shard_model, train_step)
    shapes = _param_shapes(MODEL)
    psi = sum(math.prod(s) for s in shapes)
    padded = FP32 * _padded_numel(shapes, n)
    worst = 0.0
    for r, out in enumerate(res):
        records = out["records"]
        if len(records) != 2:
            failed(what, f"rank {r}: {len(records)} optimizer step(s) in 2 calls of train_step: one step per call, "
                         "after the last micro-batch")
        for step, record in enumerate(records):
            if record["held"]:
                failed(what, f"rank {r}, step {step}: {record['held']:,} B of full-size gradients still on the "
                             "unsharded parameters at the optimizer step: after a sync post_backward takes them off")
            for k, want_full in ref["grads"][step].items():
                want = _piece(want_full, r, n)
                got = record["grads"][k]
                if got is not None and got.shape == want.shape and torch.allclose(got, want, atol=ATOL, rtol=RTOL):
                    continue
                mode = "sync every micro-batch" if step == 0 else "sync once"
                failed(what, f"{n} ranks, rank {r}, step {step} ({mode}): "
                             + _grad_verdict(n, r, step, k, got, want, ref["micro"][step]))
        held = out["held"]   # at the start of each micro-batch: step 0's two, then step 1's two
        if len(held) != 2 * MICRO:
            failed(what, f"rank {r}: {len(held)} forwards in 2 steps of {MICRO} micro-batches: one per micro-batch")
        if any(held[:MICRO]):
            failed(what, f"rank {r}: with sync every micro-batch, {max(held[:MICRO]):,} B of full-size gradients were "
                         "held between micro-batches (target 0): after the reduce-scatter, take them off")
        if held[MICRO + 1] != FP32 * psi:
            failed(what, f"rank {r}: without sync, {held[MICRO + 1]:,} B of full-size gradients held after the first "
                         f"micro-batch, target 4Ψ = {FP32 * psi:,} B: without sync post_backward keeps every unsharded "
                         ".grad (and with sync only the last micro-batch reduces)")
    for k, want in ref["params"].items():
        got = torch.cat([out["params"][k] for out in res])
        diff = (got - want).abs().max().item()
        worst = max(worst, diff)
        if not torch.allclose(got, want, atol=ATOL, rtol=RTOL):
            failed(what, f"{n} ranks: {k} differs from one process after 2 steps by {diff:.1e}")
    first = res[0]["bytes"]
    targets = [{"all_gather": 2 * MICRO * padded, "reduce_scatter": MICRO * padded},
               {"all_gather": 2 * MICRO * padded, "reduce_scatter": padded}]
    for step, (got, target) in enumerate(zip(first, targets)):
        if got == target:
            continue
        if step == 1 and got.get("reduce_scatter") == MICRO * padded:
            why = ("the step without sync still reduce-scattered after every micro-batch: post_backward reduces only "
                   "when group.sync is set, and train_step sets it for the last micro-batch only")
        elif step == 0 and got.get("reduce_scatter") == padded:
            why = "with sync every micro-batch, train_step must ask for the sync before every backward"
        else:
            why = "each micro-batch gathers every group twice (forward, backward) and reduces it when it syncs"
        failed(what, f"{n} ranks, step {step}: moved {got}, target {target}: {why}")
    library_rs = [b.get("reduce_scatter", 0) for b in res[0]["library_bytes"]]
    results["post_backward"] = {"bytes": first, "library_bytes": res[0]["library_bytes"], "held": res[0]["held"],
                                "world_size": n, "psi": psi, "padded_bytes": padded, "micro_batches": MICRO}
    passed(what, f"one process's gradients and parameters at {n} ranks (max |diff| {worst:.1e}); "
                 + _beside("reduce-scattered per step, sync every micro-batch / once",
                           f"{first[0]['reduce_scatter']:,} / {first[1]['reduce_scatter']:,} B",
                           f"{MICRO * padded:,} / {padded:,} B", f"{library_rs[0]:,} / {library_rs[1]:,} B")
                 + f"; full-size gradients held between micro-batches without sync: yours {res[0]['held'][MICRO + 1]:,}"
                 f" B, target 4Ψ = {FP32 * psi:,} B")
