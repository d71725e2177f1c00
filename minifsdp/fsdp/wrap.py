"""Wrap policies: which submodules become FSDP units of their own.

Mirrors ``torch.distributed.fsdp.wrap`` (size_based_auto_wrap_policy,
transformer_auto_wrap_policy, lambda_auto_wrap_policy, always_wrap_policy,
ModuleWrapPolicy, enable_wrap, wrap) and ``fairscale.nn.wrap`` (auto_wrap,
default_auto_wrap_policy).

Why units at all: a unit is what FSDP gathers at once. One unit for the whole
model means the whole model is unsharded during forward -- no memory saved at
the peak. One unit per transformer block means at most a block or two are
full at any time; each unit costs one all-gather (twice with FULL_SHARD) and
one reduce-scatter per step, so too many tiny units waste latency.

A policy is asked twice per module, bottom-up (as torch does)::

    policy(module=m, recurse=True,  nonwrapped_numel=n)  # look inside m's children?
    policy(module=m, recurse=False, nonwrapped_numel=r)  # wrap m itself? (r: what its children left)

Worked example, GPT with 2 ``Block`` s: ``ModuleWrapPolicy({Block})`` gives
units ``blocks.0``, ``blocks.1`` and the root (embeddings, final norm, head).
``size_based_auto_wrap_policy`` with ``min_num_params=10_000`` wraps each
block (12,704 params) and leaves the rest to the root.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch.nn as nn

__all__ = ["always_wrap_policy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
           "lambda_auto_wrap_policy", "ModuleWrapPolicy", "default_auto_wrap_policy", "enable_wrap", "wrap",
           "auto_wrap"]

# torch's defaults: never look inside MultiheadAttention; never wrap a bare container.
FORCE_LEAF_MODULES = {nn.MultiheadAttention}
EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **kwargs: Any) -> bool:
    """Every module becomes a unit."""
    return True


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8), force_leaf_modules: set[type] | None = None,
                                exclude_wrap_modules: set[type] | None = None) -> bool:
    """Wrap a module once what is left unwrapped under it reaches ``min_num_params``.

    Use with ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``.
    """
    leaf = tuple(FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    exclude = tuple(EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    if recurse:
        return not isinstance(module, leaf)
    return nonwrapped_numel >= min_num_params and not isinstance(module, exclude)


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type]) -> bool:
    """Wrap every instance of the given layer classes (e.g. ``{Block}``)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


class ModuleWrapPolicy:
    """Wrap every instance of ``module_classes`` (torch's class-based policy)."""

    def __init__(self, module_classes: Iterable[type]):
        self._classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0, **kwargs: Any) -> bool:
        return True if recurse else isinstance(module, self._classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self._classes]})"


def default_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int | None = None,
                             module_is_root: bool = False, min_num_params: int = int(1e8),
                             force_leaf_modules: set[type] | None = None,
                             exclude_wrap_modules: set[type] | None = None,
                             nonwrapped_numel: int | None = None) -> bool:
    """FairScale's size policy (its argument is called ``unwrapped_params``)."""
    numel = unwrapped_params if unwrapped_params is not None else nonwrapped_numel or 0
    return size_based_auto_wrap_policy(module, recurse, numel, min_num_params, force_leaf_modules,
                                       exclude_wrap_modules)


def _ask(policy: Callable, module: nn.Module, recurse: bool, numel: int) -> bool:
    """Call a torch-style (``nonwrapped_numel``) or FairScale-style (``unwrapped_params``) policy."""
    target = policy.func if isinstance(policy, functools.partial) else policy
    try:
        names = set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        names = {"nonwrapped_numel"}
    if "nonwrapped_numel" in names or "kwargs" in names:
        return bool(policy(module=module, recurse=recurse, nonwrapped_numel=numel))
    if "unwrapped_params" in names:
        return bool(policy(module=module, recurse=recurse, unwrapped_params=numel))
    return bool(policy(module, recurse, numel))


def _unwrapped_numel(module: nn.Module, wrapper_cls: type, ignored: set[nn.Module]) -> int:
    """Parameters under ``module`` not yet in a unit and not ignored (a tied tensor counts once)."""
    seen: dict[int, int] = {}

    def visit(m: nn.Module) -> None:
        for p in m._parameters.values():
            if p is not None:
                seen[id(p)] = p.numel()
        for child in m.children():
            if not isinstance(child, wrapper_cls) and child not in ignored:
                visit(child)
    visit(module)
    return sum(seen.values())


def _recursive_wrap(module: nn.Module, policy: Callable, wrapper_cls: type, ignored: set[nn.Module],
                    only_wrap_children: bool = False, **kwargs: Any) -> tuple[nn.Module, int]:
    """Wrap ``module``'s subtree bottom-up; returns (module or its wrapper, parameters wrapped)."""
    if isinstance(module, wrapper_cls) or module in ignored:
        return module, 0
    numel = _unwrapped_numel(module, wrapper_cls, ignored)
    if not _ask(policy, module, True, numel):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        new_child, n = _recursive_wrap(child, policy, wrapper_cls, ignored, **kwargs)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += n
    if not only_wrap_children and _ask(policy, module, False, numel - wrapped):
        return wrapper_cls(module, **kwargs), numel
    return module, wrapped


# --------------------------------------------------------------------------
# enable_wrap / wrap / auto_wrap: wrapping by hand, with shared defaults
# --------------------------------------------------------------------------
_wrap_context: list[tuple[type, dict[str, Any]]] = []


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: type | None = None, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block ``wrap(m)`` / ``auto_wrap(m)`` wrap with ``wrapper_cls(m, **wrapper_kwargs)``.

        with enable_wrap(wrapper_cls=FSDP, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP):
            model = wrap(nn.Sequential(wrap(nn.Linear(8, 8)), wrap(nn.Linear(8, 8))))
    """
    if wrapper_cls is None:
        from .fully_sharded import FullyShardedDataParallel as wrapper_cls  # FairScale's default
    _wrap_context.append((wrapper_cls, wrapper_kwargs))
    try:
        yield
    finally:
        _wrap_context.pop()


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` inside ``enable_wrap`` (keyword overrides win); outside, return it unchanged."""
    if not _wrap_context:
        return module
    wrapper_cls, kwargs = _wrap_context[-1]
    kwargs = {k: v for k, v in {**kwargs, **wrap_overrides}.items() if k != "auto_wrap_policy"}
    return wrapper_cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: Callable | None = None, **kwargs: Any) -> nn.Module:
    """FairScale's auto_wrap: inside ``enable_wrap``, wrap ``module``'s subtree by the policy.

    The default policy is ``default_auto_wrap_policy`` (100M parameters). The
    module itself is wrapped too if the policy says so; wrap the result with
    ``wrap`` (or the wrapper class) to make it the root.
    """
    if not _wrap_context:
        return module
    wrapper_cls, defaults = _wrap_context[-1]
    policy = auto_wrap_policy or defaults.get("auto_wrap_policy") or default_auto_wrap_policy
    options = {k: v for k, v in {**defaults, **kwargs}.items() if k != "auto_wrap_policy"}
    ignored = {m for root in options.get("ignored_modules") or () for m in root.modules()}
    wrapped, _ = _recursive_wrap(module, policy, wrapper_cls, ignored, **options)
    return wrapped
