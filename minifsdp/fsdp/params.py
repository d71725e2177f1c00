"""Which parameters a unit owns, and how they get real values before they are flattened.

Helpers for the constructor in ``fully_sharded.py`` (read it first), kept apart
so that file reads as one training step:

* ``managed_params`` / ``managed_buffers``: what a unit flattens (its own
  parameters, not those of nested units or ignored modules), with the check
  that catches a weight tied across two units;
* ``materialize_meta``: deferred initialization -- a model built on the meta
  device gets real tensors (``param_init_fn``, or ``reset_parameters()``),
  torch FSDP1's contract;
* ``install_optimizer_check``: an optimizer built *before* wrapping holds the
  original parameters, which flattening emptied; its first ``step()`` says so.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .flat_param import FLATTENED_MARK, RETIRED_MARK
from .unit import FSDPUnit

__all__ = ["managed_params", "managed_buffers", "materialize_meta", "install_optimizer_check"]


def managed_params(module: nn.Module, ignored: set[nn.Module]) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """This unit's parameters: everything below ``module`` except nested units and ignored modules."""
    out: list[tuple[str, nn.Module, str, nn.Parameter]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for attr, p in m._parameters.items():
            if p is not None:
                if hasattr(p, FLATTENED_MARK):
                    raise ValueError(f"parameter {prefix + attr!r} is also used by FSDP unit "
                                     f"{getattr(p, FLATTENED_MARK)!r} (tied weights across units); wrap every "
                                     "module that uses it in one unit (e.g. keep it out of the wrap policy)")
                out.append((prefix + attr, m, attr, p))
        for name, child in m._modules.items():
            if child is not None and not isinstance(child, FSDPUnit) and child not in ignored:
                visit(child, f"{prefix}{name}.")
    visit(module, "")
    return out


def managed_buffers(module: nn.Module, ignored: set[nn.Module], device: torch.device) -> list[torch.Tensor]:
    """Buffers are not sharded (every rank keeps them whole); move them to the compute device."""
    out = []
    for m in module.modules():
        if m not in ignored:
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b = b.to(device)
                    out.append(b)
    return out


def materialize_meta(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None,
                     ignored_modules: Any, device: torch.device) -> None:
    """Give a module built on the meta device real tensors before it is flattened (torch FSDP1's contract).

    Nothing happens unless a parameter or buffer below ``module`` (outside units and
    ignored modules) is on the meta device. Then, visiting ``module`` and its
    descendants breadth-first:

    * with ``param_init_fn``: ``param_init_fn(m)`` is called on *every* visited
      module, which must materialize (e.g. ``m.to_empty(device=..., recurse=False)``)
      and initialize ``m``'s own tensors;
    * without: each module that owns tensors gets ``m.to_empty(device, recurse=False)``
      and ``m.reset_parameters()`` (what torch does; built-in layers have one).

    ``to_empty`` gives every module a tensor of its own, which silently unties
    weights (GPT's head and token embedding); a parameter two modules shared on
    the meta device is shared again afterwards (the first owner's values win).

        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())      # no memory, no init yet
        FSDP(model, param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False))
    """
    ignored = {m for root in (ignored_modules or ()) for m in root.modules()}
    modules, queue = [], collections.deque([module])
    while queue:  # breadth-first, stopping at nested units and ignored modules (as torch does)
        m = queue.popleft()
        modules.append(m)
        queue.extend(c for c in m.children() if not isinstance(c, FSDPUnit) and c not in ignored)
    owned = [(m, name, t) for m in modules for name, t in [*m._parameters.items(), *m._buffers.items()]
             if t is not None]
    if not any(t.is_meta for *_, t in owned):
        return
    first_owner: dict[int, tuple[nn.Module, str]] = {}
    ties = []  # (module, name, first module, first name) of parameters seen twice
    for m, name, t in owned:
        if id(t) in first_owner and name in m._parameters:
            ties.append((m, name, *first_owner[id(t)]))
        first_owner.setdefault(id(t), (m, name))
    names = {id(m): path for path, m in module.named_modules()}
    with torch.no_grad():
        for m in modules:
            if param_init_fn is not None:
                param_init_fn(m)
            elif any(t is not None and t.is_meta for t in [*m._parameters.values(), *m._buffers.values()]):
                if not hasattr(m, "reset_parameters"):
                    raise ValueError(f"module {names[id(m)] or 'root'!r} ({type(m).__name__}) is on the meta device "
                                     "and has no reset_parameters() "
                                     "to initialize it; pass FSDP(..., param_init_fn=fn) where fn(module) materializes "
                                     "and initializes it, or build the model on a real device")
                m.to_empty(device=device, recurse=False)
                m.reset_parameters()
    for m, name, first, first_name in ties:
        m._parameters[name] = first._parameters[first_name]
    left = [f"{names[id(m)]}.{name}".lstrip(".") for m in modules for name, t in [*m._parameters.items(), *m._buffers.items()]
            if t is not None and t.is_meta]
    if left:
        raise ValueError(f"param_init_fn left {left[:4]} on the meta device; it must materialize every module it is "
                         "given, e.g. module.to_empty(device=..., recurse=False), then initialize it")


_optimizer_check_installed = False


def install_optimizer_check() -> None:
    global _optimizer_check_installed
    if not _optimizer_check_installed:  # once per process: the hook is global to torch.optim
        register_optimizer_step_pre_hook(_check_optimizer)
        _optimizer_check_installed = True


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer built *before* wrapping holds the original parameters, which FSDP emptied."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.grad.dtype != p.dtype and not isinstance(optimizer, torch.optim.SGD) \
                    and type(optimizer).__module__.startswith("torch.optim"):
                raise RuntimeError(f"{type(optimizer).__name__} cannot step {p.dtype} parameters with {p.grad.dtype} "
                                   "gradients (MixedPrecision(keep_low_precision_grads=True)); set "
                                   "keep_low_precision_grads=False (fp32 gradients) or use an optimizer that "
                                   "accepts them (torch.optim.SGD)")
            if p.numel() == 0 and getattr(p, RETIRED_MARK, False):
                raise RuntimeError(f"{type(optimizer).__name__} holds parameters that FullyShardedDataParallel "
                                   "flattened into shards (it was built before wrapping); build it after: "
                                   "optim = torch.optim.AdamW(fsdp_model.parameters())")
