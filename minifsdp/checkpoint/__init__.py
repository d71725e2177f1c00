"""minifsdp.checkpoint: activation checkpointing, mirroring ``torch.utils.checkpoint`` and
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``.

Trade compute for memory: instead of keeping every activation a block's
backward needs, keep only the block's *inputs* and run its forward again in
backward (Chen et al. 2016). A GPT block saves ~16*B*T*d + B*h*T^2 elements;
checkpointed, it keeps B*T*d, at the price of one extra forward of the block.
Change the import and torch code runs::

    from minifsdp.checkpoint import checkpoint, checkpoint_wrapper, CheckpointImpl, apply_activation_checkpointing

    y = checkpoint(block, x, use_reentrant=False)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))

Read in this order, the two implementations side by side:

* ``reentrant.py``     an autograd Function that re-runs the forward in its
                       backward, with a nested ``backward`` call (the original);
* ``non_reentrant.py`` saved-tensor hooks: pack drops each saved tensor,
                       the first unpack recomputes the block (what torch
                       recommends; torch 2.13 still defaults to reentrant);
* ``replay.py``        RNG and autocast state, so dropout recomputes the same mask;
* ``selective.py``     keep chosen ops' outputs (the matmuls), recompute the rest;
* ``offload.py``       the alternative: keep saved tensors in CPU memory;
* ``wrapper.py``       ``checkpoint_wrapper``, ``offload_wrapper``,
                       ``apply_activation_checkpointing`` (state-dict keys unchanged).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

from .non_reentrant import checkpoint_non_reentrant, noop_context_fn
from .offload import offload_saved_tensors
from .reentrant import ReentrantCheckpointFunction, checkpoint_reentrant
from .selective import (LINEAR_OPS, MATMUL_OPS, CheckpointPolicy, SelectiveCheckpointContext,
                        create_selective_checkpoint_contexts)
from .wrapper import (CHECKPOINT_WRAPPED_MODULE, ActivationWrapper, CheckpointImpl, CheckpointWrapper,
                      OffloadWrapper, apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper,
                      selective_checkpoint_wrapper)

__all__ = ["checkpoint", "checkpoint_reentrant", "checkpoint_non_reentrant", "ReentrantCheckpointFunction",
           "noop_context_fn", "CheckpointPolicy", "SelectiveCheckpointContext",
           "create_selective_checkpoint_contexts", "LINEAR_OPS", "MATMUL_OPS", "offload_saved_tensors",
           "CheckpointImpl", "ActivationWrapper", "CheckpointWrapper", "OffloadWrapper", "checkpoint_wrapper",
           "offload_wrapper", "selective_checkpoint_wrapper", "apply_activation_checkpointing",
           "CHECKPOINT_WRAPPED_MODULE"]


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None,
               context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
               preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` whose activations are recomputed in backward (torch's signature).

    ``use_reentrant=None`` means False, the implementation PyTorch recommends
    (torch 2.13 warns and picks True). Under ``torch.no_grad()`` it just calls
    ``function``. Errors name the fix: keyword arguments or ``context_fn`` with
    ``use_reentrant=True``; no output (non-reentrant) or no input (reentrant)
    that requires grad.
    """
    if use_reentrant:
        if kwargs:
            raise ValueError(f"checkpoint(use_reentrant=True) passes only positional arguments through its "
                             f"autograd Function, got keyword arguments {sorted(kwargs)}; pass them positionally, "
                             "use use_reentrant=False, or checkpoint_wrapper(module, CheckpointImpl.REENTRANT) "
                             "(which packs them)")
        if context_fn is not noop_context_fn:
            raise ValueError("checkpoint: context_fn (selective checkpointing) needs use_reentrant=False")
        return checkpoint_reentrant(function, *args, preserve_rng_state=preserve_rng_state)
    return checkpoint_non_reentrant(function, *args, preserve_rng_state=preserve_rng_state,
                                    context_fn=context_fn, **kwargs)
