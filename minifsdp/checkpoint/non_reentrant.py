"""Non-reentrant activation checkpointing: saved-tensor hooks that recompute on demand.

What ``torch.utils.checkpoint`` does with ``use_reentrant=False`` (the default
PyTorch recommends), in its simplest form. The checkpointed block's ops stay
ordinary nodes of the one autograd graph; only *what they save* changes:

    forward   with saved_tensors_hooks(pack, unpack):  out = fn(*args)
                pack(t)   -> the number of t (0, 1, 2, ...); t itself is dropped
              the frame keeps only args (detached aliases: no new memory)
    backward  the first unpack(i) of this frame:
                recompute: fn(*args) again with the forward's RNG, and under a
                second pack hook that *keeps* every saved tensor, in order
              unpack(i) -> recomputed[i], handed out once and then dropped

Both passes run the same ops in the same order, so the i-th tensor saved by
the recompute is the i-th the forward would have kept (checked: the counts
must match). The recompute stops as soon as it has saved as many tensors as
the forward did (torch's *early stop*, on by default there too): whatever the
block does after its last saved tensor - a residual add, tensor parallel's
closing all-reduce - backward never needs, so it is not run again. Compared with the reentrant Function: no nested ``backward``
call, so ``torch.autograd.grad`` works, keyword arguments and any output
structure work, and parameters get gradients even when no input requires grad.

``context_fn`` (torch's argument) returns two context managers, one around the
forward and one around the recompute; ``selective.py`` uses them to keep
chosen ops' outputs and recompute only the rest.

    >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    >>> ids = torch.randn(2, 4)                 # requires_grad=False: fine here
    >>> checkpoint_non_reentrant(mlp, ids).sum().backward()
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .replay import ForwardState, tensors_in

__all__ = ["checkpoint_non_reentrant", "noop_context_fn"]


class _StopRecomputation(Exception):
    """Raised by the recompute's pack hook once every tensor backward needs is back (early stop)."""


def noop_context_fn() -> tuple[ContextManager, ContextManager]:
    """The default ``context_fn``: nothing around the forward, nothing around the recompute."""
    return contextlib.nullcontext(), contextlib.nullcontext()


class _Frame:
    """One checkpointed call: its inputs, its forward state, and (in backward) its recomputed tensors."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, state: ForwardState,
                 recompute_context: ContextManager, offload_inputs: bool) -> None:
        self.fn, self.state, self.recompute_context = fn, state, recompute_context
        # What the checkpoint keeps across forward and backward: the inputs (detached
        # aliases: no new memory), nothing else. With offload_inputs (FairScale's
        # offload_to_cpu) the kept tensors wait in host memory until the recompute.
        leaves, self.spec = tree_flatten((args, kwargs))
        self.grads = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
        self.devices = [x.device if isinstance(x, torch.Tensor) else None for x in leaves]
        self.leaves = [(x.detach().cpu() if offload_inputs else x.detach()) if isinstance(x, torch.Tensor) else x
                       for x in leaves]
        self.n_saved = 0                       # tensors the forward packed
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, tensor: torch.Tensor) -> int:
        """Forward: remember only the position of the saved tensor."""
        index = self.n_saved
        self.n_saved += 1
        return index

    def unpack(self, index: int) -> torch.Tensor:
        """Backward: recompute the whole block the first time one of its tensors is needed."""
        if index not in self.recomputed:
            self.recompute()
        return self.recomputed.pop(index)  # handed out once: the block's memory drains as backward goes

    def recompute(self) -> None:
        kept: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            kept.append(t.detach())
            if len(kept) == self.n_saved:  # all that backward needs: skip the rest of the block
                raise _StopRecomputation

        def never(_: None) -> torch.Tensor:  # the recompute's own graph is thrown away unused
            raise RuntimeError("checkpoint: a recomputed graph was used in backward")

        leaves = [x.to(d, non_blocking=True).detach().requires_grad_(g) if isinstance(x, torch.Tensor) else x
                  for x, d, g in zip(self.leaves, self.devices, self.grads)]
        args, kwargs = tree_unflatten(leaves, self.spec)
        try:
            with torch.enable_grad(), self.state.replay(), \
                    torch.autograd.graph.saved_tensors_hooks(keep, never), self.recompute_context:
                self.fn(*args, **kwargs)
        except _StopRecomputation:
            pass
        if len(kept) != self.n_saved:
            raise RuntimeError(f"checkpoint: the recompute saved {len(kept)} tensors but the forward saved "
                               f"{self.n_saved}; fn must run the same ops both times (no branching on global "
                               "state or on which pass it is)")
        self.recomputed = dict(enumerate(kept))


def checkpoint_non_reentrant(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True,
                             context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
                             offload_inputs: bool = False, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its saved tensors recomputed in backward; see the module docstring.

    ``offload_inputs=True`` keeps the checkpointed inputs on the CPU until the
    recompute (FairScale's ``checkpoint_wrapper(offload_to_cpu=True)``).
    """
    if not torch.is_grad_enabled():  # evaluation: there is no backward to save for
        return fn(*args, **kwargs)
    forward_context, recompute_context = context_fn()
    frame = _Frame(fn, args, kwargs, ForwardState((args, kwargs), preserve_rng_state), recompute_context,
                   offload_inputs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack), forward_context:
        out = fn(*args, **kwargs)
    if not any(t.requires_grad for t in tensors_in(out)):
        raise ValueError("checkpoint: no output of fn requires grad, so backward never reaches it and there is "
                         "nothing to recompute; call fn without checkpoint (or make its parameters or inputs "
                         "require grad)")
    return out
