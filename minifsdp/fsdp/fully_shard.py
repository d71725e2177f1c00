"""``fully_shard``: per-parameter FSDP (FSDP2), the API torch recommends today.

Mirrors ``torch.distributed.fsdp.fully_shard`` (torch 2.13; Liang et al. 2024,
"TorchTitan", section 2.1 explains why it replaced FSDP1). Code written for
torch's FSDP2 runs here by changing the import::

    from minifsdp.fsdp import fully_shard, MixedPrecisionPolicy   # was: torch.distributed.fsdp
    for block in model.blocks:
        fully_shard(block)                # each block: one all-gather, one reduce-scatter
    fully_shard(model)                    # the root: what is left (embeddings, head)
    optim = torch.optim.AdamW(model.parameters())   # the DTensor shards

Three differences from FSDP1 (``fully_sharded.py``) are the lesson:

* **No wrapper.** The module stays itself; its class becomes ``FSDP<Class>``, a
  subclass that adds ``FSDPModule``'s methods. ``model.blocks[0]`` is still the
  block, and ``state_dict()`` keys do not change.
* **Per-parameter shards.** Each parameter becomes a ``DTensor`` with ``Shard(0)``
  (``fsdp_param.py``): a stock optimizer, ``full_tensor()``, and
  ``torch.distributed.checkpoint`` work on it with no FSDP-specific code.
* **Hooks, not a forward.** ``fully_shard`` registers a forward pre-hook and a
  forward hook; backward is driven by tensor hooks on the outputs, one
  post-accumulate-grad hook per parameter, and one callback at the end.

One training step, followed through this file (states: root and each block)::

    out = model(x)     root pre-forward: lazy init (names, who is root); unshard root
                         block pre-forward: unshard (one all-gather); [forward prefetch list]
                         block post-forward: hook the outputs; reshard (free, or keep k-group rows)
                       root post-forward: keep the root unsharded (backward needs it first)
    loss.backward()    hook on a block's output grad = pre-backward: unshard the block,
                         prefetch the block whose backward comes next (reverse forward order)
                       every gradient of the block accumulated = post-backward:
                         reshard, reduce-scatter (async; waits for the previous one first)
                       root's callback at the end: finish the last reduce-scatter; reshard the rest
    optim.step()       a plain torch optimizer steps the DTensor shards
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils._pytree import tree_flatten

from .. import dist
from ..mixed_precision.policy import cast_floating, check_dtype_supported
from .fsdp_param import FSDPParam
from .param_group import FSDPParamGroup
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]

_IDLE, _FORWARD, _PRE_BACKWARD = "idle", "forward", "pre_backward"
_SHARDED_BY = "_minifsdp_fully_sharded_by"  # on an original parameter: the module that sharded it
_STATE = "_minifsdp_fsdp_state"


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` took) across ``mesh``; return ``module``.

    * ``mesh``: torch's ``DeviceMesh``; 1-D = FSDP over its ranks (default: every rank),
      2-D = HSDP, replicate across dim 0 and shard across dim 1.
    * ``reshard_after_forward``: True frees the parameters after forward (all-gathered
      again in backward), False keeps them, None = True except for the root, an int k
      (a factor of the shard size) keeps k-rank pieces so backward gathers among k ranks.
    * ``mp_policy`` / ``offload_policy``: ``policies.py``. ``ignored_params``: left alone.
    * ``shard_placement_fn``: minifsdp shards on dim 0 only (None or ``Shard(0)``).
    """
    dist.require_initialized("fully_shard")
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("minifsdp's fully_shard takes one module; call it once per module")
    dist.require_module(module, "fully_shard")
    # else an AttributeError deep inside (a dtype for mp_policy), or offloading silently off (True)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard's mp_policy takes a MixedPrecisionPolicy, got {mp_policy!r}; pass e.g. "
                        "MixedPrecisionPolicy(param_dtype=torch.bfloat16)")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard's offload_policy takes an OffloadPolicy, got {offload_policy!r}; pass "
                        "CPUOffloadPolicy() to offload, or leave it out")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; call it once per "
                         "module: each block first, then the root")
    mesh = mesh if mesh is not None else _default_mesh()
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard needs torch's DeviceMesh of 1 dim (FSDP) or 2 dims (replicate, shard = HSDP), "
                         f"got {mesh!r}; make one with init_device_mesh(device_type, (world_size,))")
    shard_group = mesh.get_group(mesh.ndim - 1)
    replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
    shard_size = dist.world_size(shard_group)
    post_forward = _resolve_post_forward(reshard_after_forward, mesh, shard_size)
    device = dist.device() if mesh.device_type == dist.device().type else torch.device(mesh.device_type)
    if mp_policy.param_dtype is not None:
        check_dtype_supported(mp_policy.param_dtype, device)
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    found = _managed_params(module, set(ignored_params or ()))
    params = []
    for fqn, param, uses in found:
        if shard_placement_fn is not None and shard_placement_fn(param) not in (None, Shard(0)):
            raise NotImplementedError(f"minifsdp's fully_shard shards every parameter on dim 0; "
                                      f"shard_placement_fn chose {shard_placement_fn(param)} for {fqn!r}")
        params.append(FSDPParam(param, fqn, uses, mesh=mesh, placements=placements, shard_size=shard_size,
                                shard_rank=dist.rank(shard_group), device=device,
                                param_dtype=mp_policy.param_dtype, offload=offload,
                                pin_memory=offload and offload_policy.pin_memory))
        setattr(param, _SHARDED_BY, type(module).__name__)
    for m in _own_modules(module):
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
    group = None
    if params:
        group = FSDPParamGroup(params, type(module).__name__, shard_group=shard_group,
                               replicate_group=replicate_group, reduce_dtype=mp_policy.reduce_dtype, device=device)
        group.post_forward = post_forward if isinstance(post_forward, tuple) else None
        for p in params:
            p.use_sharded()
    state = _State(module, group, mp_policy, reshard_after_forward)
    module.__dict__[_STATE] = state
    module.__class__ = _fsdp_class(type(module))
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    return module


class FSDPModule:
    """What ``fully_shard`` adds to a module (its class becomes ``FSDP<Class>(FSDPModule, Class)``)."""

    def _state(self) -> _State:
        return self.__dict__[_STATE]

    def _states(self, recurse: bool = True) -> list[_State]:
        return [m.__dict__[_STATE] for m in self.modules() if isinstance(m, FSDPModule)] if recurse \
            else [self._state()]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters now (e.g. ahead of time); async: wait on the returned handle."""
        group = self._state().group
        if group is None:
            return UnshardHandle(None) if async_op else None
        group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its DTensor shards again."""
        if self._state().group is not None:
            self._state().group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: keep (and sum) unsharded gradients, no reduce-scatter, until a backward with True."""
        for s in self._states(recurse):
            s.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        for s in self._states(recurse):
            s.reshard_after_forward = reshard_after_forward
            if s.group is not None:
                post = _resolve_post_forward(reshard_after_forward, s.group.params[0].mesh, s.group.shard_size)
                s.group.post_forward = post if isinstance(post, tuple) else None
            s.resolve_reshard(is_root=s.root is s)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: keep the parameters unsharded after backward (the next forward skips its all-gather)."""
        for s in self._states(recurse):
            s.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In this module's pre-forward, start these modules' all-gathers (explicit forward prefetch)."""
        self._state().forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """In this module's pre-backward, start these modules' all-gathers (instead of the implicit next one)."""
        self._state().backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of backward does not wait for the last reduce-scatter (the next forward does)."""
        for s in self._states():
            s.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's gradients by ``factor`` instead of the data-parallel size before reducing."""
        if self._state().group is not None:
            self._state().group.divide_factor = factor


class UnshardHandle:
    """``unshard(async_op=True)``'s result: ``wait()`` finishes the all-gather."""

    def __init__(self, group: FSDPParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group.use_unsharded()
            self._group = None


class _State:
    """One ``fully_shard`` call: its param group, its options, and (on the root) the step's bookkeeping."""

    def __init__(self, module: nn.Module, group: FSDPParamGroup | None, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int | None):
        self.module, self.group, self.mp = module, group, mp
        self.name = type(module).__name__  # the module's path, once the root's lazy init knows it
        self.reshard_after_forward = reshard_after_forward
        self.resolve_reshard(is_root=False)  # resolved again for the root at lazy init
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.is_last_backward = True
        self.forward_prefetch: list[_State] | None = None
        self.backward_prefetch: list[_State] | None = None
        self.training = _IDLE
        self.root: _State | None = None
        if group is not None:
            group.on_all_grads_ready = self.post_backward
        # the root's: every state below it, forward exit order, whose backward began, the reduction in flight
        self.states: list[_State] = []
        self.post_order: list[_State] = []
        self.backward_started: set[_State] = set()
        self.pending_reduce: Callable[[], None] | None = None
        self.callback_queued = False

    def resolve_reshard(self, is_root: bool) -> None:
        """None means True, except for the root: its parameters are the first the backward needs.
        The int 1 means False, as torch's (pieces for groups of one rank: every rank keeps everything)."""
        option = self.reshard_after_forward
        option = False if type(option) is int and option == 1 else option
        self.reshards = (not is_root) if option is None else option is not False

    def lazy_init(self) -> None:
        """The first FSDP module whose forward runs is the root of every FSDP module below it."""
        self.root = self
        for path, m in self.module.named_modules():
            if isinstance(m, FSDPModule):
                s = m.__dict__[_STATE]
                s.root, s.name = self, path or "root"
                if s.group is not None:
                    s.group.name = s.name
                s.resolve_reshard(is_root=s is self)
                self.states.append(s)

    # -- backward ------------------------------------------------------------------
    def pre_backward(self, _grad: torch.Tensor) -> None:
        """A gradient reached one of this module's outputs: its backward is next; gather its parameters."""
        root = self.root
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root.finish_backward)
        if self.training == _PRE_BACKWARD:
            return
        self.training = _PRE_BACKWARD
        root.backward_started.add(self)
        if self.group is not None:
            self.group.unshard()
            self.group.use_unsharded()
        if self.backward_prefetch is not None:
            targets = self.backward_prefetch
        else:  # implicit: the module whose backward follows is the one that left forward before this one
            order = [s for s in reversed(root.post_order) if s is self or s not in root.backward_started]
            targets = order[order.index(self) + 1:][:1] if self in order else []
        for s in targets:
            if s.group is not None:
                s.group.unshard(async_op=True)

    def post_backward(self) -> None:
        """Every gradient of this module is accumulated: reshard (first, as torch: the parameters are freed
        before the previous reduction finishes), then reduce-scatter the gradients (or keep them)."""
        root = self.root
        if self.reshard_after_backward:
            self.group.reshard()
        if self.requires_gradient_sync:
            # finish the previous module's reduce-scatter first: it overlapped this module's backward,
            # and at most one module's packed gradients are in flight
            root.wait_for_reduce()
            root.pending_reduce = self.group.reduce_grads()
        else:
            self.group.accumulate_unsynced()
        self.training = _IDLE

    def wait_for_reduce(self) -> None:
        if self.pending_reduce is not None:
            finish, self.pending_reduce = self.pending_reduce, None
            finish()

    def finish_backward(self) -> None:
        """Root, at the end of backward: modules with unused parameters, the last reduction, resharding."""
        for s in self.states:
            if s.group is not None and s.group.grads_pending():
                s.post_backward()
        if self.is_last_backward:
            self.wait_for_reduce()
        for s in self.states:
            if s.group is not None and s.reshard_after_backward:
                s.group.reshard()
            s.training = _IDLE
        self.callback_queued = False
        self.backward_started.clear()


# --------------------------------------------------------------------------
# The hooks fully_shard registers
# --------------------------------------------------------------------------
def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    state: _State = module.__dict__[_STATE]
    if state.training == _PRE_BACKWARD:  # activation checkpointing re-runs forward inside backward:
        return _cast_inputs(state, args, kwargs)  # the parameters are gathered already; gather nothing
    if state.root is None:
        state.lazy_init()
    root = state.root
    if root is state:  # a new step
        root.wait_for_reduce()  # left over when set_is_last_backward(False)
        root.post_order = []
    state.training = _FORWARD
    if state.group is not None:
        state.group.unshard()
        state.group.use_unsharded()
    for s in state.forward_prefetch or ():
        if s.group is not None:
            s.group.unshard(async_op=True)
    return _cast_inputs(state, args, kwargs)


def _post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
    state: _State = module.__dict__[_STATE]
    if state.training == _PRE_BACKWARD:  # recomputation: keep the parameters for the backward
        return None
    state.root.post_order.append(state)
    if torch.is_grad_enabled():
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(state.pre_backward)
    if state.group is not None and (state.reshards or not torch.is_grad_enabled()):
        state.group.reshard_after_forward()  # no backward coming (eval): free even the root's
    state.training = _IDLE
    if state.mp.output_dtype is not None:
        return cast_floating(output, state.mp.output_dtype)
    return None


def _cast_inputs(state: _State, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if state.mp.param_dtype is not None and state.mp.cast_forward_inputs:
        return cast_floating((args, kwargs), state.mp.param_dtype)
    return args, kwargs


# --------------------------------------------------------------------------
# Helpers for fully_shard itself
# --------------------------------------------------------------------------
_FSDP_CLASSES: dict[type, type] = {}
_MESHES: dict[tuple, DeviceMesh] = {}


def _fsdp_class(cls: type) -> type:
    """``FSDP<Class>``: ``FSDPModule``'s methods in front of the module's own (one class per class, as torch)."""
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _default_mesh() -> DeviceMesh:
    """Every rank in one dimension, on this process's device type (one mesh per process group)."""
    key = ("default", dist.device().type, dist.world_size(), id(torch.distributed.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(dist.device().type, (dist.world_size(),))
    return _MESHES[key]


def _resolve_post_forward(reshard: bool | int | None, mesh: DeviceMesh, shard_size: int) -> bool | tuple | None:
    """Validate ``reshard_after_forward``; an int k becomes ``(group of k ranks, k)`` (as torch: 1 = False, N = True)."""
    if reshard is None or isinstance(reshard, bool):
        return reshard
    if not isinstance(reshard, int):
        raise ValueError(f"reshard_after_forward must be a bool, None or an int group size, not {reshard!r}")
    if reshard < 1 or shard_size % reshard:
        raise ValueError(f"reshard_after_forward={reshard} does not divide the shard group of {shard_size} ranks; "
                         f"pick a factor of {shard_size} (e.g. the GPUs per machine), or True / False")
    if reshard in (1, shard_size):
        return reshard == shard_size
    key = ("post_forward", tuple(mesh.mesh.flatten().tolist()), reshard)
    if key not in _MESHES:  # consecutive runs of k ranks, as torch (mesh.view(-1, k)); every rank builds every group
        _MESHES[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, reshard))
    return _MESHES[key].get_group(1), reshard


def _own_modules(module: nn.Module) -> list[nn.Module]:
    """``module`` and its descendants, minus the subtrees an inner ``fully_shard`` already took."""
    found, stack = [], [module]
    while stack:
        m = stack.pop()
        found.append(m)
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))
    return found


def _managed_params(module: nn.Module, ignored: set) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """``(fqn, parameter, [(module, attribute), ...])`` for each parameter this call shards, once if tied."""
    own = {id(m) for m in _own_modules(module)}
    found: dict[int, tuple[str, nn.Parameter, list]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        if id(m) not in own:
            continue
        for attr, p in m._parameters.items():
            if p is None or p in ignored:
                continue
            fqn = f"{prefix}.{attr}" if prefix else attr
            if getattr(p, _SHARDED_BY, None) is not None and id(p) not in found:
                raise ValueError(f"parameter {fqn!r} is shared with a module that fully_shard ({getattr(p, _SHARDED_BY)}) "
                                 "already sharded on its own; call fully_shard on a module holding every use, or untie it")
            if id(p) not in found:
                found[id(p)] = (fqn, p, [])
            if (m, attr) not in found[id(p)][2]:
                found[id(p)][2].append((m, attr))
    return list(found.values())


def _states_of(modules: list, what: str) -> list[_State]:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{what} takes modules that fully_shard was applied to; {type(m).__name__} is not one")
    return [m.__dict__[_STATE] for m in modules]
