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

A FairScale-style policy (one that names ``unwrapped_params``) is asked the same
questions in FairScale's words: ``policy(module=m, recurse=..., unwrapped_params=n,
module_is_root=...)``, ``module_is_root`` True for the module being wrapped.

Worked example, GPT with 2 ``Block`` s: ``ModuleWrapPolicy({Block})`` gives
units ``blocks.0``, ``blocks.1`` and the root (embeddings, final norm, head).
``size_based_auto_wrap_policy`` with ``min_num_params=10_000`` wraps each
block (12,704 params) and leaves the rest to the root.

``enable_wrap`` / ``wrap`` follow torch (``wrap`` passes every context keyword,
``auto_wrap_policy`` included, to the wrapper class); ``auto_wrap`` follows
FairScale. ``fully_sharded.py`` calls ``_recursive_wrap`` for its
``auto_wrap_policy``; this file imports nothing else from ``fsdp/``. Read
``fully_sharded.py`` first.
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


def default_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool = False,
                             min_num_params: int = int(1e8), force_leaf_modules: set[type] | None = None,
                             exclude_wrap_modules: set[type] | None = None,
                             skip_params_check_for_root: bool = False) -> bool:
    """FairScale's size policy: look inside, and wrap, only what holds ``min_num_params``.

    Unlike torch's ``size_based_auto_wrap_policy`` it does not look inside a module
    too small to wrap (the outcome is the same: nothing below it is larger).
    ``skip_params_check_for_root``: wrap the root whatever its size.
    """
    leaf = tuple(FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules)
    exclude = tuple(EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, leaf)
    return (is_large or (module_is_root and skip_params_check_for_root)) and not isinstance(module, exclude)


def _ask(policy: Callable, module: nn.Module, recurse: bool, numel: int, module_is_root: bool) -> bool:
    """Ask a policy in its own words: FairScale's (``unwrapped_params``, ``module_is_root``) or torch's."""
    target = policy.func if isinstance(policy, functools.partial) else policy
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin or C callable: torch's keywords
        return bool(policy(module=module, recurse=recurse, nonwrapped_numel=numel))
    any_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    root = {"module_is_root": module_is_root} if "module_is_root" in params or any_keyword else {}
    if "unwrapped_params" in params:  # FairScale (>= 0.4.6 passes module_is_root too)
        return bool(policy(module=module, recurse=recurse, unwrapped_params=numel, **root))
    if "nonwrapped_numel" in params or any_keyword:  # torch
        return bool(policy(module=module, recurse=recurse, nonwrapped_numel=numel, **root))
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
                    only_wrap_children: bool = False, module_is_root: bool = True,
                    **kwargs: Any) -> tuple[nn.Module, int]:
    """Wrap ``module``'s subtree bottom-up; returns (module or its wrapper, parameters wrapped)."""
    if isinstance(module, wrapper_cls) or module in ignored:
        return module, 0
    numel = _unwrapped_numel(module, wrapper_cls, ignored)
    if not _ask(policy, module, True, numel, module_is_root):
        return module, 0
    wrapped = 0
    for name, child in list(module.named_children()):
        new_child, n = _recursive_wrap(child, policy, wrapper_cls, ignored, module_is_root=False, **kwargs)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped += n
    if not only_wrap_children and _ask(policy, module, False, numel - wrapped, module_is_root):
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

    ``wrapper_cls`` is required, as in torch and FairScale.
    """
    if wrapper_cls is None:
        raise TypeError("enable_wrap() needs the wrapper class, as in torch and FairScale: "
                        "enable_wrap(wrapper_cls=FullyShardedDataParallel, ...)")
    _wrap_context.append((wrapper_cls, wrapper_kwargs))
    try:
        yield
    finally:
        _wrap_context.pop()


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` inside ``enable_wrap`` (keyword overrides win); outside, return it unchanged.

    Every keyword goes to the wrapper, ``auto_wrap_policy`` too, as in torch:
    ``with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=ModuleWrapPolicy({Block})): wrap(gpt)``
    makes one unit per ``Block`` and the root.
    """
    if not _wrap_context:
        return module
    wrapper_cls, kwargs = _wrap_context[-1]
    return wrapper_cls(module, **{**kwargs, **wrap_overrides})


def auto_wrap(module: nn.Module, auto_wrap_policy: Callable | None = None, **kwargs: Any) -> nn.Module:
    """FairScale's auto_wrap: inside ``enable_wrap``, wrap ``module``'s subtree by the policy.

    The policy is ``auto_wrap_policy``, else the context's, else
    ``default_auto_wrap_policy`` (100M parameters); ``module`` is asked with
    ``module_is_root=True``. The module itself is wrapped too if the policy says
    so; wrap the result with ``wrap`` (or the wrapper class) to make it the root.
    Units are built without ``auto_wrap_policy``: the recursion here already chose them.
    """
    if not _wrap_context:
        return module
    wrapper_cls, defaults = _wrap_context[-1]
    policy = auto_wrap_policy or defaults.get("auto_wrap_policy") or default_auto_wrap_policy
    options = {k: v for k, v in {**defaults, **kwargs}.items() if k != "auto_wrap_policy"}
    ignored = {m for root in options.get("ignored_modules") or () for m in root.modules()}
    wrapped, _ = _recursive_wrap(module, policy, wrapper_cls, ignored, **options)
    return wrapped
