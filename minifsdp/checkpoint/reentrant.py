"""Reentrant activation checkpointing: an autograd Function that re-runs the forward in backward.

The original recipe (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"; ``torch.utils.checkpoint`` with ``use_reentrant=True``;
FairScale's ``checkpoint_wrapper``). The whole checkpointed block becomes *one*
node of the autograd graph:

    forward   (no_grad)   out = fn(*args)        nothing inside fn is saved;
                                                 the node keeps only args
    backward  (enable_grad, forward's RNG)
              out' = fn(*args.detach())           the graph of fn, built again
              torch.autograd.backward(out', grad_out)   a *nested* backward
                                                 ("re-entering" the engine)
              return args'.grad                   the node's input gradients

Memory: while the rest of the model's backward runs, the block holds only
its inputs; its internals exist only during its own nested backward.

Limits, each a consequence of the design (``non_reentrant.py`` has none):
* gradients reach fn's parameters only through the nested backward, which the
  outer graph triggers only if the node's *output requires grad*, i.e. if some
  *input tensor* does. Checkpointing the first block of a model whose input
  (token ids) does not require grad would silently give its parameters no
  gradient (torch warns; here it is an error that names the fix);
* an autograd Function takes positional inputs only: no keyword arguments;
* outputs must be a tensor or a tuple (non-tensor items pass through);
* ``torch.autograd.grad`` cannot see through the nested ``backward`` call.

    >>> lin = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> checkpoint_reentrant(lin, x).sum().backward()   # lin.weight.grad filled in backward
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .replay import ForwardState

__all__ = ["ReentrantCheckpointFunction", "checkpoint_reentrant"]


class ReentrantCheckpointFunction(torch.autograd.Function):
    """``apply(fn, preserve_rng_state, *args)``: ``fn(*args)`` whose insides are recomputed in backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        ctx.fn = fn
        ctx.state = ForwardState(args, preserve_rng_state)
        # Tensors go through save_for_backward (autograd checks their versions, and an
        # offload hook may move them); everything else is kept as it is.
        ctx.tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_slots))
        with torch.no_grad():  # a Function's forward already runs without grad; said for the reader
            outputs = fn(*args)
        if not isinstance(outputs, (torch.Tensor, tuple)):
            raise TypeError(f"reentrant checkpoint: fn returned a {type(outputs).__name__}, but an autograd "
                            "Function returns a tensor or a tuple; return a tuple or use use_reentrant=False")
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("reentrant checkpoint works with loss.backward() but not with "
                               "torch.autograd.grad(); use use_reentrant=False (CheckpointImpl.NO_REENTRANT)")
        # Fresh leaves holding the saved inputs: the nested backward stops at them and
        # leaves their .grad, which is what this node returns.
        inputs = list(ctx.others)
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors):
            leaf = saved.detach()
            leaf.requires_grad_(saved.requires_grad)
            inputs[slot] = leaf
        with torch.enable_grad(), ctx.state.replay():
            outputs = ctx.fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [x.grad if isinstance(x, torch.Tensor) else None for x in inputs]
        return (None, None, *grads)  # no gradient for fn and preserve_rng_state


def checkpoint_reentrant(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """``fn(*args)`` checkpointed with ``ReentrantCheckpointFunction``; see the module docstring."""
    if not torch.is_grad_enabled():  # evaluation: there is no backward to save for
        return fn(*args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise ValueError("reentrant checkpoint: no input tensor requires grad, so fn's output would not "
                         "either and its parameters would get no gradient; use use_reentrant=False "
                         "(CheckpointImpl.NO_REENTRANT) or pass an input that requires grad")
    return ReentrantCheckpointFunction.apply(fn, preserve_rng_state, *args)
