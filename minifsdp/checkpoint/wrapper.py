"""Module wrappers: checkpoint (or offload) a module's activations without touching its code.

Mirrors ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``
(``checkpoint_wrapper``, ``CheckpointImpl``, ``offload_wrapper``,
``apply_activation_checkpointing``) and FairScale's
``checkpoint_wrapper(module, offload_to_cpu=...)``. The usual recipe, which
works on minifsdp's FSDP as on torch's::

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))   # FSDP(Block) inside each wrapper

A wrapper is a module holding the original under ``_checkpoint_wrapped_module``.
Its state dict drops that hop from every key (a post-hook) and puts it back
when loading (a pre-hook), and ``named_parameters`` drops it too, so a
checkpoint saved with activation checkpointing loads into the plain model and
back, as with torch:

    >>> m = checkpoint_wrapper(torch.nn.Linear(2, 2))
    >>> list(m.state_dict())
    ['weight', 'bias']
"""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from .non_reentrant import checkpoint_non_reentrant
from .offload import offload_saved_tensors
from .reentrant import checkpoint_reentrant
from .selective import LINEAR_OPS, create_selective_checkpoint_contexts

__all__ = ["CheckpointImpl", "ActivationWrapper", "CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper",
           "offload_wrapper", "selective_checkpoint_wrapper", "apply_activation_checkpointing",
           "CHECKPOINT_WRAPPED_MODULE"]

CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
_PREFIX = CHECKPOINT_WRAPPED_MODULE + "."


class CheckpointImpl(enum.Enum):
    """Which checkpoint runs the wrapped module (torch's names)."""

    REENTRANT = enum.auto()     # reentrant.py: an autograd Function, nested backward
    NO_REENTRANT = enum.auto()  # non_reentrant.py: saved-tensor hooks


def _replace_prefix(state_dict: dict[str, Any], old: str, new: str) -> None:
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


class ActivationWrapper(nn.Module):
    """The wrapped module under ``_checkpoint_wrapped_module``, invisible in names and state dicts."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):  # else the error comes at the first forward
            raise TypeError(f"{type(self).__name__} wraps a torch.nn.Module, got {type(module).__name__}; pass the "
                            "block itself")
        self._checkpoint_wrapped_module = module
        self._register_state_dict_hook(ActivationWrapper._strip_prefix)
        self.register_load_state_dict_pre_hook(ActivationWrapper._add_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # block.attn, block.config, ...: the wrapped module's
            return getattr(self._checkpoint_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:  # a wrapped nn.Sequential still indexes
        return self._checkpoint_wrapped_module[key]  # type: ignore[index]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(_PREFIX, ""), p

    @staticmethod
    def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> dict[str, Any]:
        _replace_prefix(state_dict, prefix + _PREFIX, prefix)
        return state_dict

    @staticmethod
    def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        _replace_prefix(state_dict, prefix, prefix + _PREFIX)


class CheckpointWrapper(ActivationWrapper):
    """Runs the wrapped module under activation checkpointing; build it with ``checkpoint_wrapper``."""

    def __init__(self, module: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                 checkpoint_fn: Callable[..., Any] | None = None, offload_to_cpu: bool = False,
                 **checkpoint_fn_kwargs: Any) -> None:
        super().__init__(module)
        if not isinstance(checkpoint_impl, CheckpointImpl):
            raise TypeError(f"checkpoint_impl must be CheckpointImpl.NO_REENTRANT or CheckpointImpl.REENTRANT, "
                            f"got {checkpoint_impl!r}")
        self.checkpoint_impl, self.offload_to_cpu = checkpoint_impl, offload_to_cpu
        if checkpoint_fn is not None:
            self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)
        elif checkpoint_impl == CheckpointImpl.REENTRANT:
            if "context_fn" in checkpoint_fn_kwargs:
                raise ValueError("context_fn (selective checkpointing) needs CheckpointImpl.NO_REENTRANT")
            self.checkpoint_fn = functools.partial(checkpoint_reentrant, **checkpoint_fn_kwargs)
        else:
            self.checkpoint_fn = functools.partial(checkpoint_non_reentrant, offload_inputs=offload_to_cpu,
                                                   **checkpoint_fn_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self._checkpoint_wrapped_module
        if self.checkpoint_impl == CheckpointImpl.REENTRANT:
            # An autograd Function takes positional inputs only: pass kwargs' values positionally
            # and rebuild them inside (torch's wrapper does the same).
            keys = tuple(kwargs)

            def positional(*flat: Any) -> Any:
                n = len(flat) - len(keys)
                return module(*flat[:n], **dict(zip(keys, flat[n:])))

            run, inputs = (positional, (*args, *kwargs.values())) if keys else (module, args)
            if self.offload_to_cpu:  # the Function's saved inputs go through the offload hooks
                with offload_saved_tensors():
                    return self.checkpoint_fn(run, *inputs)
            return self.checkpoint_fn(run, *inputs)
        return self.checkpoint_fn(module, *args, **kwargs)


class OffloadWrapper(ActivationWrapper):
    """Every tensor the wrapped module saves for backward waits in CPU memory (``offload.py``)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with offload_saved_tensors(pin_memory=True):
            return self._checkpoint_wrapped_module(*args, **kwargs)


def checkpoint_wrapper(module: nn.Module, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                       checkpoint_fn: Callable[..., Any] | None = None, offload_to_cpu: bool = False,
                       **checkpoint_fn_kwargs: Any) -> nn.Module:
    """Wrap ``module`` so every call is checkpointed (torch's and FairScale's signature).

    ``checkpoint_fn_kwargs`` go to the checkpoint function, e.g. ``context_fn``
    for selective checkpointing or ``preserve_rng_state=False``;
    ``offload_to_cpu=True`` (FairScale) keeps the checkpointed inputs on the CPU.
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, offload_to_cpu, **checkpoint_fn_kwargs)


def selective_checkpoint_wrapper(module: nn.Module, ops: Any = LINEAR_OPS) -> nn.Module:
    """``checkpoint_wrapper`` that keeps the outputs of ``ops`` (default: the linear layers') and
    recomputes the rest (``selective.py``)."""
    return checkpoint_wrapper(module, CheckpointImpl.NO_REENTRANT,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, list(ops)))


def offload_wrapper(module: nn.Module) -> nn.Module:
    """Wrap ``module`` so the tensors it saves for backward are kept in CPU memory (torch's name)."""
    return OffloadWrapper(module)


def apply_activation_checkpointing(model: nn.Module, checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module]
                                   = checkpoint_wrapper, check_fn: Callable[[nn.Module], bool] = lambda _: True,
                                   auto_wrap_policy: Callable[..., bool] | None = None) -> None:
    """Replace, in place, every submodule for which ``check_fn`` is True by ``checkpoint_wrapper_fn(it)``.

    The root is never wrapped, and nothing inside a wrapped module is visited
    (torch's contract). ``auto_wrap_policy(module=, recurse=False, nonwrapped_numel=)``,
    an FSDP-style policy function, replaces ``check_fn`` when given::

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=offload_wrapper, check_fn=...)
    """
    if auto_wrap_policy is not None:
        if not callable(auto_wrap_policy):
            raise TypeError("auto_wrap_policy must be a policy function (module, recurse, nonwrapped_numel); "
                            "for a set of classes pass check_fn=lambda m: isinstance(m, (Block,))")
        policy = auto_wrap_policy
        check_fn = lambda m: bool(policy(module=m, recurse=False,  # noqa: E731
                                         nonwrapped_numel=sum(p.numel() for p in m.parameters())))
    for name, child in list(model.named_children()):
        if isinstance(child, ActivationWrapper):
            continue
        if check_fn(child):
            setattr(model, name, checkpoint_wrapper_fn(child))
        else:
            apply_activation_checkpointing(child, checkpoint_wrapper_fn, check_fn)
