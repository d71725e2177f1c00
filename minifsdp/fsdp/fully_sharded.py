"""FullyShardedDataParallel: ZeRO-3, one wrapped unit at a time.

Mirrors ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1, Zhao et al.
2023) and FairScale's ``FullyShardedDataParallel``, which implement ZeRO
stage 3 (Rajbhandari et al. 2020): each rank keeps 1/N of every parameter,
gradient and optimizer state, and gathers a unit's full parameters only while
that unit computes.

One training step, followed through this file (units: root and its children)::

    out = model(x)       root._pre_forward: lazy init; unshard (all-gather) root
                           child._pre_forward: unshard child, [forward_prefetch next]
                           child._post_forward: hook the outputs; reshard (FULL_SHARD)
                         root._post_forward: keep root unsharded (backward needs it first)
    loss.backward()      hook on an output's grad = _pre_backward: unshard the unit,
                           [BACKWARD_PRE: start gathering the next unit]
                         hook after _full.grad is accumulated = _post_backward:
                           reduce-scatter the gradient (async), reshard,
                           [BACKWARD_POST: start gathering the next unit]
                         root._finish_backward (queued on the autograd engine): wait
                           for the last reduce-scatter, reshard whatever is left
    optim.step()         a plain torch optimizer updates the shards (model.parameters())

The flat-parameter mechanics (flatten, pad, gather, free, views, reduce) live
in ``flat_param.py``; wrap policies in ``wrap.py``; state dicts in
``state_dict.py``; clipping and full parameters in ``full_params.py``; the
constructor's helpers in ``strategy.py`` (groups) and ``params.py`` (which
parameters, meta-device init). Those files never import this one (``unit.py``
holds what they share), so the imports of ``fsdp/`` run one way, into here.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .. import comm, dist, trace
from ..mixed_precision.policy import cast_floating, check_dtype_supported, keep_fp32
from . import full_params
from . import state_dict as sd
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .flat_param import UNSHARDED_GRADS, FlatParamHandle, label
from .params import install_optimizer_check, managed_buffers, managed_params, materialize_meta
from .strategy import HYBRID, check_arguments, groups, resolve_mixed_precision, resolve_offload, resolve_strategy
from .unit import WRAPPED, FSDPUnit, TrainingState, units
from .wrap import ModuleWrapPolicy, _recursive_wrap

__all__ = ["FullyShardedDataParallel", "MAX_UNSHARDED_UNITS"]

MAX_UNSHARDED_UNITS = 2  # limit_all_gathers: non-root units allowed unsharded when prefetching
_IDLE, _FORWARD, _BACKWARD = TrainingState.IDLE, TrainingState.FORWARD, TrainingState.BACKWARD
_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class FullyShardedDataParallel(sd.StateDictMethods, FSDPUnit):
    """Shard ``module``'s parameters, gradients and optimizer state across ranks.

    Same arguments and meaning as ``torch.distributed.fsdp.FullyShardedDataParallel``;
    works inside ``minifsdp.launch`` and in any process group made by
    ``init_process_group`` (torchrun)::

        model = FSDP(build_model("gpt-tiny"), auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = torch.optim.AdamW(model.parameters())    # after wrapping: the shards
        loss = lm_loss(model(x), y); loss.backward(); opt.step()

    * ``process_group``: ranks to shard over (default: all); for HYBRID_SHARD a
      ``(shard_group, replicate_group)`` pair or None (``init_hybrid_groups``).
      Or ``device_mesh``, as torch's: a ``minifsdp.mesh.DeviceMesh`` (its dp groups;
      HYBRID_SHARD: ``DeviceMesh(dp=4, dp_shard=2)``) or torch's 1-D / 2-D one (``strategy.py``).
    * ``sharding_strategy`` (``api.ShardingStrategy``); FairScale's
      ``reshard_after_forward`` True/False picks FULL_SHARD/SHARD_GRAD_OP.
    * ``auto_wrap_policy`` (``wrap.py``) makes child units, ``ignored_modules``
      stay plain (not sharded, gradients not synchronized).
    * ``backward_prefetch`` / ``forward_prefetch``: gather the next unit early.
      ``limit_all_gathers``: a prefetch is skipped while ``MAX_UNSHARDED_UNITS``
      non-root units are unsharded (torch instead blocks the CPU thread until the
      oldest in-flight all-gather's memory is freed; skipping the prefetch is minifsdp's simplification).
    * ``mixed_precision`` (``MixedPrecision``: ``minifsdp/mixed_precision/policy.py``), ``cpu_offload``
      (``CPUOffload`` or a bool). FairScale's flags, with FairScale's meaning:
      ``mixed_precision=True`` (fp16 compute and reduction), ``fp32_reduce_scatter``,
      ``compute_dtype``, ``buffer_dtype``, ``move_params_to_cpu`` / ``move_grads_to_cpu``,
      ``flatten_parameters`` (False: the original parameters stay visible, ``use_orig_params``).
      With an ``auto_wrap_policy``, modules of ``MixedPrecision._module_classes_to_ignore``
      (BatchNorm) become units of their own in full precision, as in torch.
    * ``device_id``: compute device (default ``dist.device()``); ``sync_module_states``:
      broadcast rank 0's parameters and buffers before sharding.
    * ``use_orig_params``: False (default): ``model.parameters()`` yields one flat
      shard per unit. True: the original parameters, each a 1-D view of its
      piece of the shard (per-parameter optimizer groups work).
    * state dicts (``state_dict``, ``state_dict_type``, ``optim_state_dict``, ...): the methods
      of ``state_dict.StateDictMethods``, torch's names and signatures.
    * ``param_init_fn``: a model built on the meta device is materialized before
      flattening, by ``param_init_fn(module)`` or ``reset_parameters()`` (``params.materialize_meta``).
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 sharding_strategy: ShardingStrategy | None = None, cpu_offload: CPUOffload | bool | None = None,
                 auto_wrap_policy: Callable | None = None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | bool | None = None,
                 ignored_modules: Iterable[nn.Module] | None = None, param_init_fn: Callable | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True, use_orig_params: bool = False,
                 *, reshard_after_forward: bool | None = None, fp32_reduce_scatter: bool = False,
                 compute_dtype: torch.dtype | None = None, buffer_dtype: torch.dtype | None = None,
                 flatten_parameters: bool = True, move_params_to_cpu: bool = False,
                 move_grads_to_cpu: bool | None = None, device_mesh: Any = None):
        super().__init__()
        dist.require_initialized("FullyShardedDataParallel")
        check_arguments(module, sharding_strategy, backward_prefetch, auto_wrap_policy, device_id)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("this module is already wrapped in FullyShardedDataParallel; wrap it once")
        install_optimizer_check()
        strategy = resolve_strategy(sharding_strategy or ShardingStrategy.FULL_SHARD, reshard_after_forward)
        mp = resolve_mixed_precision(mixed_precision, fp32_reduce_scatter, compute_dtype, buffer_dtype)
        cpu_offload = resolve_offload(cpu_offload, move_params_to_cpu, move_grads_to_cpu)
        use_orig_params = use_orig_params or not flatten_parameters
        ignored = {m for root in (ignored_modules or ()) for m in root.modules()}
        self.sharding_strategy, self.mixed_precision = strategy, mp
        self.cpu_offload = cpu_offload
        self._backward_prefetch, self._forward_prefetch = backward_prefetch, forward_prefetch
        self._limit_all_gathers = limit_all_gathers
        self._reshard_after_forward = strategy in _RESHARD_AFTER_FORWARD
        self.compute_device = (torch.device("cuda", device_id) if isinstance(device_id, int)
                               else torch.device(device_id) if device_id is not None else dist.device())
        if mp is not None:  # fp16/bf16 where this device cannot compute it: one line naming the fix
            check_dtype_supported(mp.param_dtype, self.compute_device)
        self._shard_group, self._replicate_group = groups(process_group, strategy, self.compute_device, device_mesh)
        self._dp_size = dist.world_size(self._shard_group) if self._shard_group is not None else 1
        self._dp_size *= dist.world_size(self._replicate_group) if self._replicate_group is not None else 1
        materialize_meta(module, param_init_fn, ignored_modules, self.compute_device)
        if device_id is not None:
            module.to(self.compute_device)
        if strategy in HYBRID:  # children share the root's groups (as torch passes them on)
            process_group = (self._shard_group, self._replicate_group)
        elif device_mesh is not None:
            process_group = self._replicate_group if strategy == ShardingStrategy.NO_SHARD else self._shard_group
        if auto_wrap_policy is not None:  # wrap the children first, with the same options
            kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy, cpu_offload=cpu_offload,
                          backward_prefetch=backward_prefetch, mixed_precision=mp,
                          ignored_modules=ignored_modules, device_id=device_id,
                          sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                          limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params,
                          reshard_after_forward=reshard_after_forward)
            if mp is not None and mp._module_classes_to_ignore:  # torch: own units, full precision, fp32 hooks
                _recursive_wrap(module, ModuleWrapPolicy(mp._module_classes_to_ignore), FullyShardedDataParallel,
                                ignored, only_wrap_children=True, **{**kwargs, "mixed_precision": None})
                for m in module.modules():
                    if isinstance(m, FullyShardedDataParallel) and m.mixed_precision is None:
                        keep_fp32(m.module)  # on the module itself, as torch (its unit sees 16-bit in and out)
            _recursive_wrap(module, auto_wrap_policy, FullyShardedDataParallel, ignored, only_wrap_children=True,
                            **kwargs)
        self._fsdp_wrapped_module = module
        params = managed_params(module, ignored)
        buffers = managed_buffers(module, ignored, self.compute_device)
        if sync_module_states:
            self._sync_module_states([p for *_, p in params] + buffers)
        self._handles: list[FlatParamHandle] = []
        for requires_grad, attr in ((True, "_flat_param"), (False, "_flat_param_frozen")):
            group = [entry for entry in params if entry[3].requires_grad == requires_grad]
            if group:
                handle = FlatParamHandle(group, unit="", shard_group=self._shard_group,
                                         replicate_group=self._replicate_group, device=self.compute_device,
                                         param_dtype=mp.param_dtype if mp else None,
                                         reduce_dtype=mp.reduce_dtype if mp else None,
                                         keep_low_precision_grads=bool(mp and mp.keep_low_precision_grads),
                                         offload=self.cpu_offload.offload_params, use_orig_params=use_orig_params)
                if not use_orig_params:  # else the original parameters stay registered, as shard views
                    self.register_parameter(attr, handle.flat_param)
                if requires_grad:
                    handle._full.register_post_accumulate_grad_hook(lambda _, h=handle: self._post_backward(h))
                self._handles.append(handle)
        self._root: FullyShardedDataParallel | None = None  # set by the root's lazy init
        self._training_state = _IDLE
        self._sync_grads = True
        self._comm_hook: tuple[object, Callable] | None = None  # register_comm_hook's (state, hook)
        self._init_state_dict_settings()
        self._name_units()  # provisional names (relative to this unit); the root's lazy init renames

    def _name_units(self) -> list[FullyShardedDataParallel]:
        found = []
        for path, m in units(self):
            m._name = path or "root"
            for h in m._handles:
                h.unit = m._name
            found.append(m)
        return found

    # -- small helpers ----------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module (as in torch)."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)  # e.g. model.config, like torch's FSDP

    def __getitem__(self, key: Any) -> Any:
        return self._fsdp_wrapped_module[key]  # a wrapped nn.Sequential / ModuleList still indexes

    def _sync_module_states(self, tensors: list[torch.Tensor]) -> None:
        """sync_module_states: every rank starts from rank 0's values (across replicas, then the shard group)."""
        with torch.no_grad():
            for t in tensors:
                buf = t.data.to(self.compute_device)  # nccl broadcasts device tensors only
                for group in (self._replicate_group, self._shard_group):
                    if group is not None and dist.world_size(group) > 1:
                        comm.broadcast(buf, src=dist.global_rank(group, 0), group=group)
                t.data.copy_(buf)

    # -- lazy init (first forward): who is the root -------------------------------
    def _lazy_init(self) -> None:
        """The first FSDP module whose forward runs is the root of the units below it."""
        self._units = self._name_units()
        for m in self._units:
            m.__dict__["_root"] = self  # a plain reference: assigning a Module would register a child
        self._fwd_order: list[FullyShardedDataParallel] = []
        self._prev_fwd_order: list[FullyShardedDataParallel] = []
        self._post_order: list[FullyShardedDataParallel] = []
        self._bwd_started: set[FullyShardedDataParallel] = set()  # units whose backward began, this pass
        self._pending_reduce: Callable[[], None] | None = None
        self._callback_queued = False
        self.stats = {"peak_unsharded_units": 0, "prefetches": 0, "prefetches_skipped": 0}
        for unit in self._units:  # each unit casts the buffers it owns, by its own policy (as torch)
            dtype = unit.mixed_precision.buffer_dtype if unit.mixed_precision is not None else None
            for m in _own_modules(unit) if dtype is not None else ():
                for name, b in m._buffers.items():
                    if b is not None and b.is_floating_point():
                        m.__dict__.setdefault("_fsdp_buffer_dtypes", {}).setdefault(name, b.dtype)  # for state_dict
                        m._buffers[name] = b.to(dtype)

    # -- forward ----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._root is None:
            self._lazy_init()
        if self._training_state == _BACKWARD:  # activation checkpointing re-runs this unit in its backward
            return self._recompute(args, kwargs)
        with trace.span(f"forward {self._name}", unit=self._name):
            args, kwargs = self._pre_forward(args, kwargs)
            output = self._fsdp_wrapped_module(*args, **kwargs)
            return self._post_forward(output)

    def _pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        root = self._root
        if root is self:  # a new iteration: remember the last one's order for forward prefetch
            root._prev_fwd_order = root._fwd_order or root._prev_fwd_order
            root._fwd_order, root._post_order = [], []
            root._bwd_started.clear()
        root._fwd_order.append(self)
        self._training_state = _FORWARD
        for h in self._handles:
            h.unshard()
        root._note_unsharded()
        for h in self._handles:
            h.use_unsharded_views()
        if self._forward_prefetch:
            root._prefetch(_next(self, root._prev_fwd_order))
        mp = self.mixed_precision
        # As torch's FSDP1: cast_forward_inputs acts only in a unit that owns parameters (a handle);
        # cast_root_forward_inputs acts at the root whether or not it owns any.
        if mp is not None and mp.param_dtype is not None and (
                (mp.cast_forward_inputs and self._handles) or (root is self and mp.cast_root_forward_inputs)):
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        return args, kwargs

    def _recompute(self, args: tuple, kwargs: dict) -> Any:
        """The forward again, inside this unit's backward (``minifsdp.checkpoint``, torch's checkpoint_wrapper).

        The parameters are already gathered for the backward, so nothing is
        unsharded, prefetched, hooked or resharded (resharding would free them
        under the backward that needs them; torch's FSDP skips the same steps):
        only the inputs are cast as the forward cast them.
        """
        root = self._root
        order, post, prefetch = list(root._fwd_order), list(root._post_order), self._forward_prefetch
        self._forward_prefetch = False
        try:
            args, kwargs = self._pre_forward(args, kwargs)  # unshard() of a gathered unit is a no-op
        finally:
            root._fwd_order[:], root._post_order[:], self._forward_prefetch = order, post, prefetch
            self._training_state = _BACKWARD
        with trace.span(f"recompute {self._name}", unit=self._name):
            return self._fsdp_wrapped_module(*args, **kwargs)

    def _post_forward(self, output: Any) -> Any:
        root = self._root
        root._post_order.append(self)
        needs_backward = False
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
                    needs_backward = True
        # The root keeps its parameters: backward starts with them (as torch does).
        keep = needs_backward and (self is root or not self._reshard_after_forward)
        if not keep:
            for h in self._handles:
                h.reshard()
        self._training_state = _IDLE
        return output

    # -- backward ---------------------------------------------------------------------
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        """Runs when the gradient of one of this unit's outputs is ready: its backward is next."""
        root = self._root
        if not root._callback_queued:
            root._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._finish_backward)
        first = self._training_state != _BACKWARD
        self._training_state = _BACKWARD
        root._bwd_started.add(self)
        with trace.span(f"pre_backward {self._name}", unit=self._name):
            for h in self._handles:
                h.unshard()
            root._note_unsharded()
            if first and self._backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
                root._prefetch_for_backward(self)

    def _post_backward(self, handle: FlatParamHandle) -> None:
        """Runs once ``_full.grad`` holds this unit's gradient: reduce it, free the parameters."""
        root = self._root
        with trace.span(f"post_backward {self._name}", unit=self._name):
            if self._sync_grads:
                # Finish the previous unit's reduction *before* starting this one (it had this
                # unit's whole backward to overlap with), so the reductions in flight never hold
                # more than one unit's full-size gradient.
                root._wait_reduce()
                root._pending_reduce = handle.reduce_grad(self._dp_size, self._comm_hook)
            else:  # under no_sync() the unsharded gradient stays and accumulates
                label(handle._full.grad, UNSHARDED_GRADS)
            handle.reshard()
            self._training_state = _IDLE
            if self._backward_prefetch == BackwardPrefetch.BACKWARD_POST:
                root._prefetch_for_backward(self)

    def _wait_reduce(self) -> None:
        """At most one reduction in flight: it overlaps the next unit's backward; finish it now."""
        if self._pending_reduce is not None:
            finish, self._pending_reduce = self._pending_reduce, None
            finish()

    def _finish_backward(self) -> None:
        """End of backward (root): wait for the last reduction; reshard units whose hooks never ran."""
        with trace.span("finish_backward", unit=self._name):
            self._wait_reduce()
            for unit in self._units:
                for h in unit._handles:
                    h.reshard()
                unit._training_state = _IDLE
            self._callback_queued = False
            self._bwd_started.clear()

    # -- prefetch and the all-gather limit ----------------------------------------------
    def _prefetch_for_backward(self, unit: FullyShardedDataParallel) -> None:
        """Prefetch the unit whose backward follows ``unit``'s: the next in reversed forward-exit order
        whose backward has not begun. Skipping those that began matters for BACKWARD_POST: the root's
        post-backward runs last, and the unit after it in that order finished long ago (a wasted gather)."""
        order = [u for u in self._post_order[::-1] if u is unit or u not in self._bwd_started]
        self._prefetch(_next(unit, order))

    def _unsharded_units(self) -> list[FullyShardedDataParallel]:
        return [u for u in self._units if u is not self and any(
            not h.aliased and (h.is_unsharded() or h._pending) for h in u._handles)]

    def _note_unsharded(self) -> None:
        self.stats["peak_unsharded_units"] = max(self.stats["peak_unsharded_units"], len(self._unsharded_units()))

    def _prefetch(self, unit: FullyShardedDataParallel | None) -> None:
        """Start ``unit``'s all-gather now (async); its own unshard() will wait for it."""
        if unit is None or all(h.is_unsharded() or h._pending for h in unit._handles):
            return
        if self._limit_all_gathers and len(self._unsharded_units()) >= MAX_UNSHARDED_UNITS:
            self.stats["prefetches_skipped"] += 1  # it will gather on demand instead
            return
        for h in unit._handles:
            h.unshard(async_op=True)
        self.stats["prefetches"] += 1
        self._note_unsharded()

    # -- no_sync, gradient clipping, full parameters ----------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate *unsharded* gradients locally, no communication (FSDP's no_sync).

        The first backward after the block reduces the whole accumulated sum.
        Costs a full-size gradient per unit while inside.
        """
        chosen = [u for _, u in units(self)]
        previous = [u._sync_grads for u in chosen]
        for u in chosen:
            u._sync_grads = False
        try:
            yield
        finally:
            for u, p in zip(chosen, previous):
                u._sync_grads = p

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drop unsharded gradients held by ``no_sync()`` (they are not ``.grad`` of any parameter)."""
        super().zero_grad(set_to_none)
        for _, u in units(self):
            for h in u._handles:
                h._full.grad = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm over every shard; return that norm (see full_params.py)."""
        return full_params.clip_grad_norm_(self, max_norm, norm_type)

    @full_params.module_or_self
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False, *,
                           volatile: bool | None = None) -> contextlib.AbstractContextManager:
        """Inside the block the original parameters are full ``nn.Parameter``s (see full_params.py).

        torch's form ``FSDP.summon_full_params(model)`` and FairScale's ``model.summon_full_params()``
        both work; FairScale's ``volatile=True`` means ``writeback=False``.
        """
        writeback = writeback if volatile is None else not volatile
        return full_params.summon_full_params(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP unit at or below ``module`` (parents first); ``root_only``: those with no unit above."""
        found = [u for _, u in units(module)]
        if not root_only:
            return found
        inner = {id(v) for u in found for _, v in units(u) if v is not u}
        return [u for u in found if id(u) not in inner]

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Reduce gradients with ``hook`` instead of the built-in reduce-scatter / all-reduce (torch's contract).

        Sharded strategies call ``hook(state, grad, output)``: ``grad`` is a unit's full
        flat gradient (padded), ``output`` the shard to fill. NO_SHARD calls
        ``hook(state, grad)``, which reduces in place. The hook averages too (torch's
        ``default_hooks.allreduce_hook`` / ``reduce_scatter_hook`` divide by the world
        size). Call it on the root, once, before the first forward; not for HYBRID_SHARD.
        """
        if self._root is not None and self._root is not self:  # known once a forward has run (as in torch)
            raise ValueError("register_comm_hook() must be called on the root FSDP module (the outermost)")
        found = FullyShardedDataParallel.fsdp_modules(self)
        if not callable(hook):
            raise ValueError(f"the communication hook must be callable, got {hook!r}")
        for u in found:
            if u.sharding_strategy in HYBRID:
                raise ValueError(f"register_comm_hook() does not support {u.sharding_strategy.name} (torch neither); "
                                 "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
            if u._comm_hook is not None:
                raise ValueError("a communication hook is already registered; register it once")
        for u in found:
            u._comm_hook = (state, hook)


# --------------------------------------------------------------------------
# Module-level helpers
# --------------------------------------------------------------------------
def _next(unit: FullyShardedDataParallel, order: list) -> FullyShardedDataParallel | None:
    """The first unit after ``unit`` in ``order`` (forward order, or backward = reversed post-forward)."""
    for i, u in enumerate(order):
        if u is unit:
            return next((v for v in order[i + 1:] if v is not unit), None)
    return None


def _own_modules(unit: FullyShardedDataParallel) -> Iterator[nn.Module]:
    """The modules whose tensors ``unit`` manages: its subtree, minus nested units' subtrees."""
    stack = [unit._fsdp_wrapped_module]
    while stack:
        m = stack.pop()
        yield m
        stack.extend(c for c in m.children() if not isinstance(c, FullyShardedDataParallel))
