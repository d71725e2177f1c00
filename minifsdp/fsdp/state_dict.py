"""State dicts of a sharded model and of its optimizer: full, sharded, local.

Mirrors ``FullyShardedDataParallel.state_dict_type`` / ``optim_state_dict`` /
``optim_state_dict_to_load`` of PyTorch FSDP. The problem: each rank holds
1/N of a *flat* tensor per unit, while a checkpoint should speak the
unwrapped model's language (``blocks.0.attn.qkv.weight``, shape ``[96, 32]``).

* FULL_STATE_DICT: gather every unit (``summon_full_params``), read the
  original parameters, drop the ``_fsdp_wrapped_module.`` hops from the keys:
  the result loads into the *unwrapped* model, or into FSDP at any world size.
* SHARDED_STATE_DICT: no communication. Same keys; each value is a
  ``FlatShard``: the piece of that parameter (flattened) this rank holds, with
  its offset. Loads back as is at the same world size; ``save_sharded`` /
  ``load_sharded`` (end of this file) load it at *any* world size.
* LOCAL_STATE_DICT: the flat shards under their own names (``_flat_param``).

The optimizer follows the same rule: its state for a flat shard (AdamW's
``exp_avg`` has the shard's shape) is cut at the same boundaries as the
parameters; counters like ``step`` are copied to every original parameter.

A FULL dict needs collectives, so every rank must ask for it; one rank alone
would wait forever. ``unit.all_ranks_enter`` first meets the other ranks
through the process group's key-value store, with a deadline, and names the
ranks that never came.

Read ``fully_sharded.py`` first; FSDP gets the functions here as methods (``StateDictMethods``).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from .. import comm, dist
from .api import (FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig, LocalStateDictConfig,
                  OptimStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictConfig,
                  StateDictSettings, StateDictType)
from .full_params import summon_full_params
from .unit import FSDPUnit, all_ranks_enter, clean_name, units

__all__ = ["FlatShard", "StateDictMethods", "set_state_dict_type", "get_state_dict_type", "state_dict_type", "state_dict",
           "load_state_dict", "optim_state_dict", "optim_state_dict_to_load", "full_optim_state_dict",
           "scatter_full_optim_state_dict", "save_sharded", "load_sharded"]


@dataclass
class FlatShard:
    """This rank's piece of one parameter in a SHARDED_STATE_DICT: flattened elements
    ``[offset, offset + local.numel())`` of a tensor of shape ``shape``."""

    local: torch.Tensor
    offset: int
    shape: torch.Size


# --------------------------------------------------------------------------
# Choosing the type
# --------------------------------------------------------------------------
_DEFAULT_CONFIGS = {  # torch's defaults per type: (model config, optimizer config)
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
    """Set the state dict type of every unit at or below ``module``; return the previous settings.

    ``FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)`` (torch's
    signature); a config left None gets the type's default, as in torch.
    """
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type must be a StateDictType, got {state_dict_type!r}")
    model_cfg, optim_cfg = _DEFAULT_CONFIGS[state_dict_type]
    settings = StateDictSettings(state_dict_type, state_dict_config or model_cfg(),
                                 optim_state_dict_config or optim_cfg())
    previous = [u._set_state_dict_settings(settings) for _, u in units(module)]
    return previous[0] if previous else settings


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings shared by every unit at or below ``module`` (an error if they differ)."""
    found = {repr(u.state_dict_settings): u.state_dict_settings for _, u in units(module)}
    if len(found) != 1:
        raise ValueError(f"get_state_dict_type: {'no FSDP unit under this module' if not found else 'units differ: '}"
                         f"{list(found)[:2] if found else ''}; set it with FSDP.set_state_dict_type(root, ...)")
    return next(iter(found.values()))


@contextlib.contextmanager
def state_dict_type(module: nn.Module, state_dict_type: StateDictType, state_dict_config: StateDictConfig | None = None,
                    optim_state_dict_config: OptimStateDictConfig | None = None) -> Iterator[None]:
    """``with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True)):``"""
    saved = [(u, u.state_dict_settings) for _, u in units(module)]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for u, settings in saved:
            u._set_state_dict_settings(settings)


def _settings(model: nn.Module) -> StateDictSettings:
    return model.state_dict_settings


# --------------------------------------------------------------------------
# Helpers: the units' tensors as plain modules would save them
# --------------------------------------------------------------------------
def _key(prefix: str, fqn: str) -> str:
    return f"{prefix}.{fqn}" if prefix else fqn


@contextlib.contextmanager
def _plain(model: nn.Module, hide_orig: bool = True) -> Iterator[None]:
    """Flat shards (and the sharded original parameters of use_orig_params) hidden: ``_tensors``
    then yields exactly the buffers and the unmanaged (ignored) parameters -- or, inside
    summon_full_params, the full parameters too."""
    hidden = [(u, n, u._parameters.pop(n)) for _, u in units(model) for n in ("_flat_param", "_flat_param_frozen")
              if n in u._parameters]
    orig = [h for _, u in units(model) for h in u._handles if h.orig_params is not None and hide_orig]
    for h in orig:
        for info in h.infos:
            info.module._parameters.pop(info.attr, None)
    try:
        yield
    finally:
        for u, n, p in hidden:
            u._parameters[n] = p
        for h in orig:
            h.use_sharded_views()


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``nn.Module.state_dict``'s traversal with every unit read as the plain module it is.

    ``nn.Module.state_dict`` would call each child unit's own ``state_dict`` (ours,
    which gathers or cuts pieces); here each module saves only its own tensors
    (``_save_to_state_dict``), so nested units add their buffers and nothing else.
    Keys keep the ``_fsdp_wrapped_module.`` hops; callers clean them.
    """
    out: dict[str, torch.Tensor] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        m._save_to_state_dict(out, prefix, False)
        for name, child in m._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")
    visit(model, "")
    return out


def _expected(model: nn.Module) -> dict[str, tuple[Any, Any]]:
    """Every original parameter's clean key -> (its handle, its ParamInfo)."""
    return {_key(prefix, info.fqn): (h, info) for prefix, u in units(model) for h in u._handles for info in h.infos}


# --------------------------------------------------------------------------
# Model state dict
# --------------------------------------------------------------------------
def state_dict(model: nn.Module, *args: Any, destination: dict | None = None, prefix: str = "",
               keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` of a unit, by the type chosen with ``state_dict_type`` (default FULL)."""
    kind = _settings(model).state_dict_type
    if kind == StateDictType.LOCAL_STATE_DICT:
        return nn.Module.state_dict(model, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
    out = _clean_state_dict(model)
    if destination is None:
        return out
    destination.update({prefix + k: v for k, v in out.items()})  # a unit inside a plain (unwrapped) parent
    return destination


def _clean_state_dict(model: nn.Module) -> dict[str, Any]:
    kind, cfg = _settings(model).state_dict_type, _settings(model).state_dict_config
    if kind == StateDictType.FULL_STATE_DICT:
        all_ranks_enter("state_dict", model)
        with summon_full_params(model, writeback=False, offload_to_cpu=cfg.offload_to_cpu), \
                _plain(model, hide_orig=False):  # summon put the full parameters in their place
            raw = _tensors(model)
        out = {clean_name(k): v.detach().clone() for k, v in raw.items()}
        _restore_buffer_dtypes(model, out)
        rank0_only = getattr(cfg, "rank0_only", False)
        return {} if rank0_only and dist.rank() != 0 else out
    with _plain(model):  # SHARDED: buffers and unmanaged parameters as they are, flat pieces per parameter
        out = {clean_name(k): v.detach().clone() for k, v in _tensors(model).items()}
    for key, (h, info) in _expected(model).items():
        start, end = h.local_piece(info)
        lo = h.shard_rank * h.shard_numel
        piece = h.flat_param.detach()[info.offset + start - lo:info.offset + end - lo].clone()
        out[key] = FlatShard(piece.cpu() if cfg.offload_to_cpu else piece, start, info.shape)
    _restore_buffer_dtypes(model, out)
    return out


def _restore_buffer_dtypes(model: nn.Module, out: dict[str, Any]) -> None:
    """Buffers cast by MixedPrecision(buffer_dtype) are saved in their original dtype, as torch does."""
    for path, m in model.named_modules():
        for name, dtype in getattr(m, "_fsdp_buffer_dtypes", {}).items():
            key = clean_name(f"{path}.{name}")
            if key in out and torch.is_tensor(out[key]):
                out[key] = out[key].to(dtype)


def load_state_dict(model: nn.Module, sd: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
    """Load a FULL (any world size) or SHARDED (same world size) dict; names mismatched keys."""
    if _settings(model).state_dict_type == StateDictType.LOCAL_STATE_DICT:
        return nn.Module.load_state_dict(model, sd, strict)
    for _, u in units(model):  # a kept unsharded copy would be stale after loading
        for h in u._handles:
            h.reshard()
    expected = _expected(model)
    with _plain(model):
        others = {clean_name(k): k for k in _tensors(model)}
    missing = sorted((set(expected) | set(others)) - set(sd))
    unexpected = sorted(set(sd) - set(expected) - set(others))
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: checkpoint does not match this model: missing keys {missing[:6]}"
                       f"{'...' if len(missing) > 6 else ''}, unexpected keys {unexpected[:6]}"
                       f"{'...' if len(unexpected) > 6 else ''} (saved from another model?)")
    for key, (h, info) in expected.items():
        v = sd.get(key)
        first = v[0] if isinstance(v, list) and v else v  # load_sharded: the pieces of every saved rank
        shape = first.shape if isinstance(first, FlatShard) else getattr(first, "shape", None)
        if v is not None and tuple(shape) != tuple(info.shape):
            raise ValueError(f"load_state_dict: {key!r} has shape {tuple(shape)} in the checkpoint but "
                             f"{tuple(info.shape)} in the model (saved from another model?)")
    handles = {id(h): h for h, _ in expected.values()}
    for h in handles.values():
        _load_handle(h, [sd.get(k) for k, (hh, info) in expected.items() if hh is h and info.shared_with is None])
    with _plain(model):
        nn.Module.load_state_dict(model, {others[k]: v for k, v in sd.items() if k in others}, strict=False)
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


@torch.no_grad()
def _load_handle(h: Any, values: list[Any]) -> None:
    """Values of a handle's unique parameters (full tensors or FlatShards) -> its shard."""
    if any(v is None for v in values):
        return  # non-strict load of a partial checkpoint: leave this unit as it is
    if isinstance(values[0], (FlatShard, list)):
        h.flat_param.copy_(_shard_from_pieces(h, values))
    else:
        h.write_shard(h.flatten([v.to(h.device, h.dtype) for v in values]))


def _shard_from_pieces(h: Any, values: list[FlatShard | list[FlatShard]]) -> torch.Tensor:
    """This rank's shard, cut from each unique parameter's saved piece(s), then zero padding."""
    flat = torch.cat([_elements(v, *h.local_piece(info), info.fqn).to(h.flat_param.device, h.flat_param.dtype)
                      for info, v in zip(h.unique_infos, values)])
    return torch.cat([flat, flat.new_zeros(h.shard_numel - flat.numel())])


def _elements(value: FlatShard | list[FlatShard], start: int, end: int, name: str) -> torch.Tensor:
    """Flattened elements ``[start, end)`` of one parameter, stitched from saved pieces.

    Saved at 2 ranks, a 10-element parameter is pieces [0, 5) and [5, 10); a rank
    of a 4-rank model that needs [3, 6) takes 2 elements of the first, 1 of the second.
    """
    pieces = sorted((p for p in (value if isinstance(value, list) else [value]) if p.local.numel()),
                    key=lambda p: p.offset)
    out, at = [], start
    for p in pieces:
        lo, hi = max(at, p.offset), min(end, p.offset + p.local.numel())
        if lo > at:
            break  # a gap: no piece holds element ``at``
        if hi > lo:
            out.append(p.local.reshape(-1)[lo - p.offset:hi - p.offset])
            at = hi
    if at < end:
        held = [(p.offset, p.offset + p.local.numel()) for p in pieces]
        raise ValueError(f"sharded checkpoint of {name!r} holds elements {held} but this rank needs [{start}, {end}): "
                         "it was saved at another world size; load it with load_sharded(dir), which reads every "
                         "rank's file (or save and load a FULL_STATE_DICT)")
    return torch.cat(out) if out else torch.zeros(0)


# --------------------------------------------------------------------------
# Optimizer state dict
# --------------------------------------------------------------------------
def _owners(model: nn.Module) -> tuple[dict[int, Any], dict[int, str]]:
    """id(optimizer parameter) -> (handle, unit prefix, which unique param or None for the flat shard);
    id(parameter FSDP does not manage) -> its clean name."""
    owners: dict[int, Any] = {}
    for prefix, u in units(model):
        for h in u._handles:
            if h.orig_params is None:
                owners[id(h.flat_param)] = (h, prefix, None)
            else:
                owners.update({id(p): (h, prefix, j) for j, p in enumerate(h.orig_params)})
    names = {id(p): clean_name(n) for n, p in model.named_parameters() if id(p) not in owners}
    return owners, names


def _flat_layout(h: Any, states: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """A handle's optimizer state in the flat shard's layout. With use_orig_params the optimizer
    holds one state per original parameter (1-D, its piece of the shard): concatenate the pieces."""
    if None in states:
        return states[None]
    per = [states.get(j, {}) for j in range(len(h.unique_infos))]
    out: dict[str, Any] = {}
    for k, v0 in next((st for st in per if st), {}).items():
        if torch.is_tensor(v0) and v0.dim() > 0:
            pieces = [st[k] if k in st else v0.new_zeros(e - s)
                      for st, (s, e) in zip(per, map(h._shard_slice, h.unique_infos))]
            flat = torch.cat(pieces)
            out[k] = torch.cat([flat, flat.new_zeros(h.shard_numel - flat.numel())])
        else:
            out[k] = v0
    return out


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any] | None = None,
                     group: Any = None) -> dict[str, Any]:
    """The optimizer's state keyed by the unwrapped model's parameter names (torch's format).

    ``group`` is accepted for torch's signature; the units' own process groups are used.
    """
    osd = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    kind, ocfg = _settings(model).state_dict_type, _settings(model).optim_state_dict_config
    full = kind != StateDictType.SHARDED_STATE_DICT
    if full:
        all_ranks_enter("optim_state_dict", model)
    owners, names = _owners(model)
    params = [p for g in optim.param_groups for p in g["params"]]
    state: dict[str, Any] = {}
    fqns_of: dict[int, list[str]] = {}
    handles: dict[int, Any] = {}  # id(handle) -> (handle, prefix, {which: state})
    for idx, p in enumerate(params):
        if id(p) not in owners:
            fqns_of[idx] = [names[id(p)]]
            if idx in osd["state"]:
                state[names[id(p)]] = osd["state"][idx]
            continue
        h, prefix, which = owners[id(p)]
        infos = h.unique_infos if which is None else [h.unique_infos[which]]
        fqns_of[idx] = [_key(prefix, i.fqn) for i in infos]
        handles.setdefault(id(h), (h, prefix, {}))[2][which] = osd["state"].get(idx, {})
    for h, prefix, states in handles.values():
        fqns = [_key(prefix, i.fqn) for i in h.unique_infos]
        per: dict[str, dict[str, Any]] = {f: {} for f in fqns}
        for k, v in _flat_layout(h, states).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == (h.shard_numel,):  # sharded like the parameter
                if full:
                    views = h.unflatten(h.gather_full(v, dtype=v.dtype))
                    for f, i in zip(fqns, h.unique_infos):
                        per[f][k] = views[h.infos.index(i)].detach().cpu().clone()
                else:
                    for f, i in zip(fqns, h.unique_infos):
                        lo, hi = h._shard_slice(i)
                        per[f][k] = FlatShard(v[lo:hi].detach().clone(), h.local_piece(i)[0], i.shape)
            else:  # step counters and other scalars: every original parameter gets a copy
                for f in per:
                    per[f][k] = v.clone() if torch.is_tensor(v) else v
        state.update({f: st for f, st in per.items() if st})
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [f for i in g["params"] for f in fqns_of[i]]} for g in osd["param_groups"]]
    if full and isinstance(ocfg, FullOptimStateDictConfig) and ocfg.rank0_only and dist.rank() != 0:
        return {}
    return {"state": state, "param_groups": groups}


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                          rank0_only: bool = True, group: Any = None) -> dict[str, Any]:
    """torch's older ``FSDP.full_optim_state_dict``: ``optim_state_dict`` of type FULL (``{}`` off rank 0 with
    ``rank0_only``). ``optim_input`` (deprecated in torch) is not needed: ``optim`` knows its parameters."""
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, None, FullOptimStateDictConfig(rank0_only=rank0_only)):
        return optim_state_dict(model, optim)


def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None, model: nn.Module,
                                  optim_input: Any = None, optim: torch.optim.Optimizer | None = None,
                                  group: Any = None) -> dict[str, Any]:
    """torch's ``FSDP.scatter_full_optim_state_dict``: rank 0 holds ``full_optim_state_dict``'s result
    (other ranks pass None); every rank gets its own, ready for ``optim.load_state_dict``.

    Rank 0 broadcasts the whole dict (serialized) and each rank cuts its shard, simpler
    than torch, which sends each rank only its piece. The parameter order is
    ``optim``'s, else ``optim_input``'s (parameters or groups), else ``model.parameters()``.
    """
    osd = _broadcast_object(full_optim_state_dict if dist.rank() == 0 else None, model)
    if optim is not None:
        groups = optim.param_groups
    else:
        given = list(optim_input) if optim_input is not None else list(model.parameters())
        groups = given if given and isinstance(given[0], dict) else [{"params": given}]
    return _to_load(model, [list(g["params"]) for g in groups], osd)


def _broadcast_object(obj: Any, model: nn.Module) -> Any:
    """Rank 0's ``obj`` on every rank: its ``torch.save`` bytes, broadcast with comm (so the trace sees them)."""
    device = model.compute_device if isinstance(model, FSDPUnit) else dist.device()
    data = torch.zeros(0, dtype=torch.uint8)
    if dist.rank() == 0:
        if obj is None:
            raise ValueError("scatter_full_optim_state_dict: rank 0 got None; pass it "
                             "FSDP.full_optim_state_dict(model, optim)'s result")
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], device=device)
    comm.broadcast(size, src=0)
    payload = data.to(device) if dist.rank() == 0 else torch.empty(int(size), dtype=torch.uint8, device=device)
    comm.broadcast(payload, src=0)
    with torch.serialization.safe_globals([FlatShard]):
        return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu")


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                             is_named_optimizer: bool = False, load_directly: bool = False,
                             group: Any = None) -> dict[str, Any]:
    """Turn a (full or sharded) name-keyed optimizer state dict back into ``optim.load_state_dict``'s format.

    ``load_directly=True`` also loads it into ``optim`` (as torch); a checkpoint that names
    none of the optimizer's parameters raises instead of leaving the optimizer as it was.
    """
    if is_named_optimizer:
        raise NotImplementedError("is_named_optimizer=True (TorchRec's KeyedOptimizer / NamedOptimizer) is not "
                                  "supported; pass a plain torch.optim optimizer")
    result = _to_load(model, [list(g["params"]) for g in optim.param_groups], optim_state_dict)
    if load_directly:
        optim.load_state_dict(result)
    return result


def _to_load(model: nn.Module, groups: list[list[torch.Tensor]], osd: dict[str, Any]) -> dict[str, Any]:
    """``optim_state_dict_to_load`` for an optimizer over ``groups`` (lists of parameters, in order)."""
    owners, names = _owners(model)
    params = [p for g in groups for p in g]
    state: dict[int, Any] = {}
    shards: dict[int, dict[str, Any] | None] = {}  # id(handle) -> its state in the flat shard's layout
    for idx, p in enumerate(params):
        if id(p) not in owners:
            if names[id(p)] in osd["state"]:
                state[idx] = osd["state"][names[id(p)]]
            continue
        h, prefix, which = owners[id(p)]
        if id(h) not in shards:
            shards[id(h)] = _load_flat_layout(h, prefix, osd)
        flat_state = shards[id(h)]
        if flat_state is None:
            continue
        if which is None:
            state[idx] = flat_state
        else:  # use_orig_params: this parameter's piece of each sharded state
            lo, hi = h._shard_slice(h.unique_infos[which])
            # each its own copy, counters too: AdamW increments ``step`` in place, once per parameter
            state[idx] = {k: (v[lo:hi] if v.dim() > 0 else v).clone() if torch.is_tensor(v) else v
                          for k, v in flat_state.items()}
    if osd["state"] and not state:  # loading would silently leave the optimizer without its state
        raise ValueError(f"optim_state_dict_to_load: no key of the checkpoint ({sorted(osd['state'])[:4]}...) names a "
                         "parameter of this optimizer (saved from another model?); save it with "
                         "FSDP.optim_state_dict(model, optim) of the same model")
    if len(osd["param_groups"]) != len(groups):
        raise ValueError(f"optim_state_dict_to_load: checkpoint has {len(osd['param_groups'])} parameter groups, "
                         f"the optimizer {len(groups)}")
    out, start = [], 0
    for saved_group, group in zip(osd["param_groups"], groups):
        out.append({**{k: v for k, v in saved_group.items() if k != "params"},
                    "params": list(range(start, start + len(group)))})
        start += len(group)
    return {"state": state, "param_groups": out}


def _load_flat_layout(h: Any, prefix: str, osd: dict[str, Any]) -> dict[str, Any] | None:
    """The saved per-name states of a handle's parameters, cut to this rank's flat shard."""
    infos = h.unique_infos
    saved = [osd["state"].get(_key(prefix, i.fqn)) for i in infos]
    if all(s is None for s in saved):
        return None
    absent = [_key(prefix, i.fqn) for i, s in zip(infos, saved) if s is None]
    if absent:
        raise RuntimeError(f"optim_state_dict_to_load: no optimizer state for {absent[:6]} "
                           "(saved from another model?)")
    new: dict[str, Any] = {}
    for k, v0 in saved[0].items():
        values = [s[k] for s in saved]
        if isinstance(v0, (FlatShard, list)):
            new[k] = _shard_from_pieces(h, values)
        elif torch.is_tensor(v0) and k != "step" and v0.shape == infos[0].shape:
            full = h.flatten([v.to(h.device, h.flat_param.dtype) for v in values])
            new[k] = h.shard_of(full).clone().to(h.flat_param.device)
        else:
            new[k] = v0.clone() if torch.is_tensor(v0) else v0
    return new


# --------------------------------------------------------------------------
# The methods FullyShardedDataParallel gets from this file
# --------------------------------------------------------------------------
class StateDictMethods:
    """``FullyShardedDataParallel``'s checkpoint methods: the functions above, under torch's names
    and signatures (``model.state_dict()``, ``FSDP.optim_state_dict(model, optim)``, ...)."""

    state_dict = state_dict
    load_state_dict = load_state_dict
    state_dict_type = staticmethod(state_dict_type)
    set_state_dict_type = staticmethod(set_state_dict_type)
    get_state_dict_type = staticmethod(get_state_dict_type)
    optim_state_dict = staticmethod(optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state_dict_to_load)
    full_optim_state_dict = staticmethod(full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(scatter_full_optim_state_dict)


# --------------------------------------------------------------------------
# A sharded checkpoint folder, loadable at any world size
# --------------------------------------------------------------------------
def save_sharded(path: str, model: nn.Module, optim: torch.optim.Optimizer | None = None) -> str:
    """Every rank writes its SHARDED_STATE_DICT (model, and optimizer if given) to
    ``path/shard-{rank}-of-{world}.pt``; no communication. Returns the file written.

    Each ``FlatShard`` records which flattened elements of which parameter (name,
    shape, offset; padding never saved) it holds, so the folder describes itself.
    """
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        ckpt = {"model": state_dict(model), "optim": optim_state_dict(model, optim) if optim is not None else None}
    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, f"shard-{dist.rank()}-of-{dist.world_size()}.pt")
    torch.save(ckpt, file)
    return file


def load_sharded(path: str, model: nn.Module, optim: torch.optim.Optimizer | None = None) -> None:
    """Load a ``save_sharded`` folder into ``model`` (and ``optim``) at *any* world size.

    Every rank opens every file, memory-mapped (only the bytes it touches are read),
    gathers each parameter's pieces from all of them and cuts out the elements its own
    shard needs (``_elements``). The folder must be visible to every rank (a shared
    filesystem across machines). No communication.
    """
    files = glob.glob(os.path.join(path, "shard-*-of-*.pt"))
    worlds = {int(f.rsplit("-of-", 1)[1][:-3]) for f in files}
    if len(worlds) != 1:
        raise FileNotFoundError(f"load_sharded: {path!r} holds no save_sharded checkpoint (or shards of several "
                                f"world sizes {sorted(worlds)}); point it at the folder save_sharded wrote")
    n = worlds.pop()
    missing = [r for r in range(n) if not os.path.exists(os.path.join(path, f"shard-{r}-of-{n}.pt"))]
    if missing:
        raise FileNotFoundError(f"load_sharded: {path!r} lacks the files of ranks {missing} of {n}; copy every "
                                "rank's file into the folder")
    with torch.serialization.safe_globals([FlatShard]):
        ckpts = [torch.load(os.path.join(path, f"shard-{r}-of-{n}.pt"), map_location="cpu", mmap=True)
                 for r in range(n)]
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        load_state_dict(model, _merge([c["model"] for c in ckpts]))
        if optim is not None:
            if ckpts[0]["optim"] is None:
                raise ValueError(f"load_sharded: {path!r} was saved without an optimizer; pass optim=None")
            names = dict.fromkeys(k for c in ckpts for k in c["optim"]["state"])  # every rank's, in order
            osd = {"state": {k: _merge([c["optim"]["state"].get(k, {}) for c in ckpts]) for k in names},
                   "param_groups": ckpts[0]["optim"]["param_groups"]}
            optim.load_state_dict(optim_state_dict_to_load(model, optim, osd))


def _merge(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """One dict from every rank's: a ``FlatShard`` becomes the list of all ranks' pieces;
    anything else (buffers, step counters) is the same everywhere: rank 0's is kept."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, FlatShard):
                out.setdefault(k, []).append(v)
            else:
                out.setdefault(k, v)
    return out
