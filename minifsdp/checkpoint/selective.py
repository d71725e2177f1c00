"""Selective activation checkpointing: keep chosen ops' outputs, recompute the rest.

Full checkpointing recomputes a whole block in backward: one extra forward.
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models") observed that the memory and the compute of a
transformer block are in *different* ops: the linear layers (matmuls) cost
almost all the FLOPs but their outputs are a minority of the bytes, while
softmax, dropout, GELU and LayerNorm are cheap to recompute and their saved
tensors (the B*h*T*T attention probabilities above all) are large. So: save
the matmul outputs, recompute everything else.

This is torch's ``create_selective_checkpoint_contexts`` (the contexts go to
non-reentrant checkpoint's ``context_fn``), built from two dispatch modes that
sit *below* autograd and see every aten op:

    forward    _Caching: run each op; if the policy says save, keep its output
               (a plain tensor: the memory we choose to spend)
    recompute  _Cached:  for an op the forward kept, return the kept output
               instead of running it (in the same order: k-th addmm <- k-th kept);
               run every other op

Autograd, above both modes, builds the same graph either way; the recompute
simply finds some results ready. Policies: a list of ops (those are saved)
or ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``::

    from functools import partial
    ctx = partial(create_selective_checkpoint_contexts, LINEAR_OPS)
    out = checkpoint(block, x, use_reentrant=False, context_fn=ctx)
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = ["CheckpointPolicy", "SelectiveCheckpointContext", "create_selective_checkpoint_contexts",
           "LINEAR_OPS", "MATMUL_OPS"]

aten = torch.ops.aten
# The ops a Linear layer becomes on CPU and CUDA (2-D input: addmm; 3-D: a view and addmm; no bias: mm).
LINEAR_OPS = (aten.mm.default, aten.addmm.default)
# ... and attention's batched matmuls (q @ k^T, probs @ v) too: saves the B*h*T*T scores.
MATMUL_OPS = LINEAR_OPS + (aten.bmm.default, aten.baddbmm.default)
# Ops whose count differs between forward and recompute (checkpointing itself detaches).
_IGNORED = {aten.detach.default}


class CheckpointPolicy(enum.Enum):
    """torch.utils.checkpoint.CheckpointPolicy: SAVE keeps the op's output, RECOMPUTE runs it again."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3


_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


@dataclasses.dataclass
class SelectiveCheckpointContext:
    """Passed to a policy function: which pass is asking."""

    is_recompute: bool


_RECOMPUTE = object()  # a placeholder in the cache: this op's output was not kept
_CONSUMED = object()   # ... its kept output was handed to the recompute already


class _Caching(TorchDispatchMode):
    """Forward: keep the outputs of the ops the policy saves, in order, per op."""

    def __init__(self, policy_fn: Callable[..., Any], cache: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.policy_fn, self.cache = policy_fn, cache

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _IGNORED:
            policy = self.policy_fn(SelectiveCheckpointContext(is_recompute=False), func, *args, **kwargs)
            if isinstance(policy, bool):
                policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
            keep = policy in _SAVE
            self.cache[func].append(tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
                                    if keep else _RECOMPUTE)
        return out


class _Cached(TorchDispatchMode):
    """Recompute: hand back what the forward kept, run everything else."""

    def __init__(self, cache: dict[Any, list[Any]]) -> None:
        super().__init__()
        self.cache = cache
        self.seen: dict[Any, int] = defaultdict(int)

    def __enter__(self) -> "_Cached":
        self.seen.clear()  # each recompute replays from the first call of each op
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        k = self.seen[func]
        self.seen[func] += 1
        if k >= len(self.cache[func]):
            raise RuntimeError(f"selective checkpoint: the recompute ran {func} more often than the forward; "
                               "fn must run the same ops both times")
        kept = self.cache[func][k]
        if kept is _RECOMPUTE:
            return func(*args, **kwargs)
        if kept is _CONSUMED:
            raise RuntimeError("selective checkpoint: a second backward through the same forward; a kept output "
                               "is handed out once (as torch), so run the forward again")
        # Handed out once: from now on only autograd's saved copy keeps it alive, and it is freed as soon as
        # the op that needs it has run its backward, not when the whole block is done (torch does the same).
        self.cache[func][k] = _CONSUMED
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, kept)


def create_selective_checkpoint_contexts(
        policy_fn_or_list: Callable[..., Any] | Iterable[Any]) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """(forward context, recompute context) for ``checkpoint(..., use_reentrant=False, context_fn=...)``.

    A list (or tuple, set) of aten ops means: save those, recompute the rest.
    ``context_fn`` must return a *fresh* pair per call, hence
    ``functools.partial(create_selective_checkpoint_contexts, ops)``.
    """
    if callable(policy_fn_or_list):
        policy_fn = policy_fn_or_list
    elif isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        ops = set(policy_fn_or_list)
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"selective checkpoint: {op!r} is not an aten op overload; write e.g. "
                                "torch.ops.aten.mm.default (not torch.mm or torch.ops.aten.mm)")

        def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    else:
        raise TypeError(f"selective checkpoint: expected a list of ops or a policy function, got "
                        f"{type(policy_fn_or_list).__name__}")
    cache: dict[Any, list[Any]] = defaultdict(list)
    return _Caching(policy_fn, cache), _Cached(cache)
