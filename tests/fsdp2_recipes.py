"""FSDP2 (``fully_shard``) recipes written the way a torch user writes them, for torch's and minifsdp's alike.

Each recipe is a function of ``fs``, the namespace that holds ``fully_shard`` and its companions
(``torch.distributed.fsdp`` or ``minifsdp.fsdp``): the only difference between the two runs is
the import. Every recipe trains gpt-tiny data parallel on a fixed *global* batch per step (rank r
of n takes rows ``[r*B/n, (r+1)*B/n)``), so its numbers are those of one process on the whole
batch (``plain_run`` below), within fp32 rounding.

A recipe returns plain data: ``losses`` (the global mean loss per step), ``grads`` (every
parameter's full gradient of the last step, ``p.grad.full_tensor()``) and ``params`` (every
parameter's full value after the last step, ``p.full_tensor()``).

    >>> launch(run_recipe, 2, "minifsdp", "per_block_then_root")      # doctest: +SKIP

Also here, shared with test_fully_shard.py: the data, the tolerance check (``rel_diff``), the
per-parameter byte formula (``expected_bytes``) and ``counted`` (torch's collectives are counted
by ``minifsdp.torch_reference.counting``; minifsdp's record themselves through ``minifsdp.comm``).
"""
from __future__ import annotations

import contextlib
import importlib
import math
import sys
from typing import Any, Callable, Iterator

import cloudpickle
import torch
import torch.distributed as tdist

# launch() sends the test's worker functions by value; the workers cannot import tests/, so what
# they call from here must travel by value too.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

IMPLEMENTATIONS = {"torch": "torch.distributed.fsdp", "minifsdp": "minifsdp.fsdp"}
BATCH, SEQ, VOCAB, LR = 24, 16, 256, 3e-3   # 24 rows: 2 equal micro-batches per rank at 1, 2, 3 and 4 ranks
MICRO = 2                                   # micro-batches per step in the accumulation recipes
RTOL = 1e-5                                 # fp32: relative, per tensor (see rel_diff)
FIELDS = ("first_loss", "losses", "first_grads", "grads", "params")
FP32_TOL = dict.fromkeys(FIELDS, RTOL)
# bf16 (param_dtype=bfloat16, reduce_dtype=float32). At 1 rank a bf16 run equals one process that runs
# forward and backward on a bf16 copy of its fp32 parameters (plain_run(bf16=True)) bit for bit. At N
# ranks each rank rounds the gradient of *its* rows to bf16 (8 significant bits) before the fp32
# reduction, where one process rounds the whole batch's, so (measured on gpt-tiny at 2-4 ranks):
# * the first loss (same parameters, rows computed alike) differs only by fp32 rounding of the mean:
#   measured 8.6e-8; 5e-7 allowed, and an fp32 run would be 2.4e-6 away: this is what proves bf16 ran;
# * later losses: within one bf16 ulp, 2**-8 (measured <= 1.7e-5);
# * gradients that sum over every token in bf16 (LayerNorm weights) move by several bf16 ulps: the
#   first step's up to 2.8e-2 of the tensor's norm (2**-4 allowed); after AdamW (whose first steps,
#   ~lr * sign(g), turn rounding into full-size differences of small gradients' updates) the parameters
#   up to 2.9e-2 (2**-4) and the last step's gradients up to 5.2e-2 (2**-3).
BF16_TOL = {"first_loss": 5e-7, "losses": 2.0**-8, "first_grads": 2.0**-4, "grads": 2.0**-3, "params": 2.0**-4}


def namespace(impl: str) -> Any:
    """``torch.distributed.fsdp`` or ``minifsdp.fsdp``: where ``fully_shard`` and its companions live."""
    return importlib.import_module(IMPLEMENTATIONS[impl])


# ----------------------------------------------------------------------------- data, ranks, results
def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: token ids and next-token targets, ``[BATCH, SEQ]`` each."""
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return data[:, :-1], data[:, 1:]


def world() -> tuple[int, int]:
    """(world size, rank); (1, 0) outside a process group."""
    return (tdist.get_world_size(), tdist.get_rank()) if tdist.is_initialized() else (1, 0)


def my_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch, on this rank's device."""
    from minifsdp import dist

    n, r = world()
    return t[r * len(t) // n:(r + 1) * len(t) // n].to(dist.device() if tdist.is_initialized() else "cpu")


def mesh_1d() -> Any:
    """A 1-D mesh over every rank: FSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import dist

    return init_device_mesh(dist.device().type, (tdist.get_world_size(),))


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (``full_tensor()``), a plain tensor as is; detached, on the CPU."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_optim_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state per parameter name, every tensor full: ``{name: {"step", "exp_avg", "exp_avg_sq"}}``."""
    return {n: {k: full(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters() if p in opt.state}


def mean_over_ranks(loss: torch.Tensor) -> float:
    t = loss.detach().float().clone()
    if tdist.is_initialized():
        tdist.all_reduce(t)
    return t.item() / world()[0]


def rel_diff(a: Any, b: Any) -> float:
    """How far ``a`` is from ``b``, relatively: for a list of losses the largest |a_i - b_i| / |b_i|;
    for a tensor ||a - b|| / ||b|| (2-norm: one tiny element's rounding does not count as a relative
    error of 1); for a dict of either the worst entry."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"different keys: {sorted(set(a) ^ set(b))}"
        return max((rel_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{len(a)} values against {len(b)}"
        return max((abs(x - y) / abs(y) if y else abs(x) for x, y in zip(a, b)), default=0.0)
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    scale = b.norm().item()
    return (a - b).norm().item() / scale if scale else (a - b).norm().item()


def assert_close(a: Any, b: Any, rtol: float, what: str) -> None:
    d = rel_diff(a, b)
    assert d <= rtol, f"{what}: relative difference {d:.3g} > {rtol:.3g}"


def assert_parity(got: dict, ref: dict, tol: dict[str, float], what: str) -> None:
    """Every field of a run (fsdp2_recipes.train's result) within its tolerance of the reference's."""
    assert_close(got["losses"][:1], ref["losses"][:1], tol["first_loss"], f"{what}: first loss")
    for field in FIELDS[1:]:
        assert_close(got[field], ref[field], tol[field], f"{what}: {field}")


def assert_equal(a: Any, b: Any, what: str) -> None:
    """Bit for bit: every tensor of two (nested) dicts or lists."""
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), f"{what}: different keys: {sorted(set(a) ^ set(b))}"
        for k in a:
            assert_equal(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Tensor):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{what}[{i}]")
    else:
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
            f"{what}: not bit-identical (max |diff| {(a.double() - b.double()).abs().max().item():.3g})"


# ----------------------------------------------------------------------------- byte accounting
@contextlib.contextmanager
def counted(fs: Any) -> Iterator[Any]:
    """A tracer that sees this implementation's collectives; yields it.

    minifsdp's collectives record themselves (``minifsdp.comm``); torch's are counted by swapping
    ``torch.distributed``'s functions (``count_collectives``), which must not wrap minifsdp's (each
    call would be counted twice)."""
    from minifsdp import trace
    from minifsdp.torch_reference.counting import count_collectives

    tracer = trace.Tracer()
    with tracer, (count_collectives() if fs.__name__.startswith("torch") else contextlib.nullcontext()):
        yield tracer


def padded_shard_numel(shape: tuple[int, ...], w: int) -> int:
    """Elements of one rank's padded Shard(0) of a parameter: ceil(n0 / W) rows of numel / n0."""
    n0 = shape[0]
    return math.ceil(n0 / w) * (math.prod(shape) // n0)


def group_bytes(shapes: list[tuple[int, ...]], w: int, elem: int) -> int:
    """One all-gather (or reduce-scatter) of a group: W * sum of padded shards * element size."""
    return w * sum(padded_shard_numel(s, w) for s in shapes) * elem


def gpt_groups(n_layer: int = 2) -> dict[str, list[tuple[int, ...]]]:
    """gpt-tiny's FSDP groups when fully_shard is called on each block then the root:
    each block's parameter shapes, and the root's (what no block holds)."""
    from minifsdp.models import build_model

    model = build_model("gpt-tiny", seed=0, device="meta", n_layer=n_layer, bias=False)
    groups = {f"blocks.{i}": [tuple(p.shape) for p in b.parameters()] for i, b in enumerate(model.blocks)}
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    groups["root"] = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]
    return groups


def expected_bytes(w: int, resharded: Callable[[str], bool], n_layer: int = 2, param_elem: int = 4,
                   grad_elem: int = 4, syncs: int = 1, forwards: int = 1, backwards: int | None = None
                   ) -> dict[str, int]:
    """Bytes one rank moves per step, per collective, from the parameter shapes alone.

    all-gather: every group once per forward that finds it sharded (``forwards``), and again in each
    backward (``backwards``, default ``forwards``) for a group resharded after forward; reduce-scatter:
    every group's gradients once per synchronised backward (``syncs``). At 1 rank a group has nobody
    to exchange with: no collective at all (torch issues none)."""
    if w == 1:
        return {}
    backwards = forwards if backwards is None else backwards
    groups = gpt_groups(n_layer)
    ag = sum(group_bytes(s, w, param_elem) * (forwards + (backwards if resharded(g) else 0))
             for g, s in groups.items())
    rs = sum(group_bytes(s, w, grad_elem) for s in groups.values()) * syncs
    return {"all_gather": ag, "reduce_scatter": rs}


# ----------------------------------------------------------------------------- training
def tiny_gpt(n_layer: int = 2) -> torch.nn.Module:
    from minifsdp import dist
    from minifsdp.models import build_model

    # No biases: a GPT's key bias gets an exactly-zero gradient (softmax does not see it), which AdamW
    # turns into steps of +-lr driven by rounding noise: numbers no two runs share.
    model = build_model("gpt-tiny", seed=0, n_layer=n_layer, bias=False)
    return model.to(dist.device() if tdist.is_initialized() else "cpu")


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0,
          micro: int = 1, no_sync: bool = False, keep_unsharded: bool = False,
          on_step: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Train ``steps`` steps from step ``first`` on this rank's rows; ``micro`` micro-batches per
    step (each loss divided by ``micro``), with ``no_sync`` gradients synchronised only on the last
    (and with ``keep_unsharded`` parameters not resharded after the backwards before it either).
    Returns losses (global means), the last step's full gradients and the full parameters after."""
    from minifsdp import trace
    from minifsdp.models import lm_loss

    losses, grads = [], {}
    for step in range(first, first + steps):
        x, y = (my_rows(t) for t in global_batch(step))
        with trace.span("step"), on_step(step) if on_step else contextlib.nullcontext():
            total = 0.0
            for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                if no_sync:
                    model.set_requires_gradient_sync(i == micro - 1)
                if keep_unsharded:
                    model.set_reshard_after_backward(i == micro - 1)
                loss = lm_loss(model(xm).float(), ym) / micro   # the loss in fp32 whatever the param dtype
                loss.backward()
                total = total + loss.detach()
        if step in (first, first + steps - 1):   # outside the "step" span: full_tensor() all-gathers
            grads[step - first and "grads" or "first_grads"] = full_grads(model)
        with trace.span("step"):
            opt.step()
            opt.zero_grad()
        losses.append(mean_over_ranks(total))
    if steps == 1:
        grads["grads"] = grads["first_grads"]
    return {"losses": losses, **grads, "params": full_params(model)}


def plain_run(steps: int, n_layer: int = 2, bf16: bool = False) -> dict[str, Any]:
    """The reference: one process, the unwrapped model, the whole global batch.

    ``bf16`` emulates MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) in one process:
    forward and backward on a bf16 copy of the fp32 parameters, gradients cast to fp32, AdamW on the
    fp32 parameters. Runs on one thread, as the launched ranks do (launch(..., threads_per_rank=1)):
    the thread count can change a kernel's summation order, and at 1 rank the runs must agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _plain_run(steps, n_layer, bf16)
    finally:
        torch.set_num_threads(threads)


def _plain_run(steps: int, n_layer: int, bf16: bool) -> dict[str, Any]:
    master = tiny_gpt(n_layer)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    if not bf16:
        return train(master, opt, steps)
    from minifsdp.models import lm_loss

    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        low = tiny_gpt(n_layer)
        with torch.no_grad():
            for p16, p32 in zip(low.parameters(), master.parameters()):
                p16.data = p32.detach().to(torch.bfloat16)
        loss = lm_loss(low(x).float(), y)
        loss.backward()
        for p16, p32 in zip(low.parameters(), master.parameters()):
            p32.grad = p16.grad.float()
        grads = full_grads(master)
        first_grads = first_grads if step else grads
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "first_grads": first_grads, "grads": grads, "params": full_params(master)}


# ----------------------------------------------------------------------------- the recipes
def per_block_then_root(fs: Any, steps: int = 6) -> dict[str, Any]:
    """(a) fully_shard on each transformer block, then on the root; AdamW."""
    model = tiny_gpt()
    mesh = mesh_1d()
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return train(model, opt, steps)


def bf16_mixed_precision(fs: Any, steps: int = 3) -> dict[str, Any]:
    """(b) MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every call."""
    model = tiny_gpt()
    mesh = mesh_1d()
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh, mp_policy=mp)
    fs.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return train(model, opt, steps)


PREFETCH_LAYERS = 4


def explicit_prefetch(fs: Any, steps: int = 3) -> dict[str, Any]:
    """(c) reshard_after_forward=True everywhere, each block prefetching the next two in forward and the
    previous two in backward, and the root unsharded explicitly ahead of each forward."""
    model = tiny_gpt(PREFETCH_LAYERS)
    mesh = mesh_1d()
    blocks = list(model.blocks)
    for block in blocks:
        fs.fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fs.fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return train(model, opt, steps, on_step=lambda step: _unsharded_first(model))


@contextlib.contextmanager
def _unsharded_first(model: Any) -> Iterator[None]:
    model.unshard()   # the root's all-gather starts before forward asks for it
    yield


def accumulate_without_sync(fs: Any, steps: int = 3) -> dict[str, Any]:
    """(d) gradient accumulation: set_requires_gradient_sync(False) on every micro-batch but the last."""
    model = tiny_gpt()
    mesh = mesh_1d()
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return train(model, opt, steps, micro=MICRO, no_sync=True)


def _sharded_gpt_and_adamw(fs: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_gpt()
    mesh = mesh_1d()
    for block in model.blocks:
        fs.fully_shard(block, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def dcp_save(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """(e) save: torch.distributed.checkpoint of the sharded model and optimizer state dicts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)


def dcp_load(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """(e) load into a model sharded over any number of ranks: DCP reshards on read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def checkpoint_train_and_save(fs: Any, path: str, steps: int) -> dict[str, Any]:
    """(e) train ``steps`` steps, save; return what was saved (full values) and the run's results."""
    model, opt = _sharded_gpt_and_adamw(fs)
    out = train(model, opt, steps)
    dcp_save(model, opt, path)
    return dict(out, saved_params=full_params(model), saved_optim=full_optim_state(model, opt))


def checkpoint_load_and_continue(fs: Any, path: str, first: int, steps: int, save_to: str | None = None
                                 ) -> dict[str, Any]:
    """(e) a fresh sharded model at this world size loads ``path`` (and saves it again to ``save_to``
    before training), then trains steps ``first``... Returns the state as loaded and the run's results."""
    model, opt = _sharded_gpt_and_adamw(fs)
    dcp_load(model, opt, path)
    loaded = {"loaded_params": full_params(model), "loaded_optim": full_optim_state(model, opt)}
    if save_to is not None:
        dcp_save(model, opt, save_to)
    return dict(train(model, opt, steps, first=first), **loaded)


RECIPES: dict[str, Callable[..., dict[str, Any]]] = {
    "per_block_then_root": per_block_then_root, "bf16_mixed_precision": bf16_mixed_precision,
    "explicit_prefetch": explicit_prefetch, "accumulate_without_sync": accumulate_without_sync,
}
