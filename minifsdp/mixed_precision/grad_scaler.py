"""Dynamic loss scaling for fp16: ``GradScaler`` and, for sharded gradients, ``ShardedGradScaler``.

Mirrors ``torch.amp.GradScaler`` and
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (same
constructor, methods and ``state_dict`` keys: code using torch's runs on these
by changing the import). The idea is Micikevicius et al. 2018, section 3.2:

    fp16's smallest subnormal is 2**-24 ~ 6e-8. Many gradients are smaller and
    become 0 in an fp16 backward. Multiply the loss by S (2**16 to start):
    every gradient is S times larger, so it survives; divide by S again in
    fp32 before the optimizer sees it. If S was too large some gradient
    overflowed (inf/NaN): skip that step and halve S. After
    ``growth_interval`` clean steps, try doubling S.

One iteration::

    scaler.scale(loss).backward()   loss * S: the backward sees S-times gradients
    scaler.unscale_(opt)            (optional, e.g. before clipping) grads *= 1/S,
                                    found_inf = any non-finite gradient
    scaler.step(opt)                unscale_ if not done; opt.step() only if not found_inf
    scaler.update()                 found_inf: S *= backoff_factor, clean count = 0
                                    else clean count += 1; at growth_interval:
                                    S *= growth_factor, clean count = 0

Sharded gradients (ZeRO-2/3, FSDP): each rank checks only *its* shard, so an
overflow in rank 1's shard is invisible to rank 0. ``ShardedGradScaler``
all-reduces the found-inf flag (MAX) over the data-parallel group through
``minifsdp.comm``, so every rank skips the same step and backs off the same
scale; otherwise ranks would step different parameters and drift apart.

``unscale_grads_`` and ``update_scale`` are the whole arithmetic, as plain
functions (the lab writes them). Read ``policy.py`` first.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any, Iterable

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from .. import comm, dist
from .policy import warn_if_unnecessary_scaler

__all__ = ["GradScaler", "ShardedGradScaler", "OptState", "unscale_grads_", "update_scale"]


class OptState(enum.Enum):
    READY = 0      # gradients still scaled
    UNSCALED = 1   # unscale_ ran this iteration
    STEPPED = 2    # step ran this iteration; update() comes next


# -- the arithmetic ---------------------------------------------------------------------
def unscale_grads_(grads: Iterable[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply each gradient by ``inv_scale`` in place; return 1.0 if any value is inf/NaN, else 0.0.

    Multiplying by the fp32 reciprocal (rather than dividing by S) is what
    torch's ``_amp_foreach_non_finite_check_and_unscale_`` kernel does, so the
    results are bit-identical.

    >>> g = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    >>> unscale_grads_(g, torch.tensor(0.5)).item(), g[0].tolist()
    (1.0, [1.0, 2.0])
    """
    found_inf = inv_scale.new_zeros(())   # new_*: on the scale's device (a GPU's, under MINIFSDP_FAKE_GPU too)
    with torch.no_grad():
        for g in grads:
            finite = torch.isfinite(g).all()
            if finite.device != found_inf.device:   # gradients offloaded to the CPU, the scale on the GPU
                finite = finite.to(found_inf.device)
            found_inf = torch.maximum(found_inf, (~finite).float())
            g.mul_(inv_scale if g.device == inv_scale.device else inv_scale.to(g.device))
    return found_inf


def update_scale(scale: float, growth_tracker: int, found_inf: bool, growth_factor: float,
                 backoff_factor: float, growth_interval: int) -> tuple[float, int]:
    """One ``update()``: the next (scale, number of clean steps in a row).

    >>> update_scale(1024.0, 5, True, 2.0, 0.5, 10)       # overflow: back off, start counting again
    (512.0, 0)
    >>> update_scale(1024.0, 9, False, 2.0, 0.5, 10)      # the 10th clean step: grow
    (2048.0, 0)
    """
    if found_inf:
        return scale * backoff_factor, 0
    growth_tracker += 1
    if growth_tracker == growth_interval:
        grown = scale * growth_factor
        # fp32 arithmetic, as torch's kernel: a scale that would overflow fp32 stays where it is
        grown32 = torch.tensor(grown, dtype=torch.float32)
        return (grown32.item() if torch.isfinite(grown32) else scale), 0
    return scale, growth_tracker


# -- the scaler -----------------------------------------------------------------------------
class GradScaler:
    """``torch.amp.GradScaler``: scale the loss, unscale and check the gradients, skip bad steps.

    >>> scaler = GradScaler("cpu", init_scale=2.0**16)
    >>> scaler.scale(torch.tensor(1.0)).item()
    65536.0

    ``device``: where the scale lives (default ``minifsdp.dist.device()``).
    ``enabled=False`` makes every method a pass-through (``step`` just steps),
    so one training loop serves fp32, bf16 and fp16.
    """

    def __init__(self, device: str | torch.device | None = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        if not 0.0 < init_scale < float("inf"):  # a zero scale zeroes every gradient; inf makes every step overflow
            raise ValueError(f"init_scale must be a positive, finite loss scale, got {init_scale}; torch's default "
                             "is 2.0**16")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1.0 (it multiplies the scale after clean steps), "
                             f"got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1) (it shrinks the scale after an overflow), "
                             f"got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        # a torch.device is kept as it is (dist.device()'s own object, which MINIFSDP_FAKE_GPU tells apart)
        self._device = (device if isinstance(device, torch.device) else torch.device(device) if device is not None
                        else dist.device())
        if self._device.type == "cuda" and not torch.cuda.is_available():
            warnings.warn("GradScaler: device 'cuda' but CUDA is not available; disabling it", stacklevel=2)
            enabled = False
        self._enabled = enabled
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        # The scale is a tensor on the device so scale(loss) needs no host sync. A disabled
        # scaler allocates nothing (as torch's), so memory compares like with like.
        self._scale = (torch.full((), float(init_scale), dtype=torch.float32, device=self._device) if enabled
                       else None)
        self._growth_tracker = 0
        self._warned_bf16 = False
        self._per_optimizer: dict[int, dict[str, Any]] = {}

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._per_optimizer.setdefault(id(optimizer), {"stage": OptState.READY, "found_inf": None})

    # -- the four calls of an iteration ----------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """``outputs * S`` (a tensor, or a list/tuple of them, nested)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if not self._warned_bf16 and (outputs.dtype == torch.bfloat16 or _autocast_bf16(outputs.device)):
                self._warned_bf16 = True
                warn_if_unnecessary_scaler(torch.bfloat16)
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError(f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by S in place and record whether any is inf/NaN.

        Call it before anything that reads gradient values (clipping:
        ``model.clip_grad_norm_(max_norm)`` then sees true gradients). Once per
        optimizer per iteration.
        """
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update(); "
                               "call it once per iteration")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() after step(): unscale before stepping, then call update()")
        inv_scale = self._scale.double().reciprocal().float()  # as torch: reciprocal in fp64, used in fp32
        found_inf = unscale_grads_(self._grads(optimizer), inv_scale)
        state["found_inf"] = self._sync_found_inf(found_inf)
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``unscale_`` (unless done), then ``optimizer.step()`` only if no gradient was inf/NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("GradScaler.step does not support closures (as torch); call the loss yourself")
        state = self._state(optimizer)
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() was already called since the last update(); call update() once per iteration")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = None
        if state["found_inf"].item() == 0.0:  # one host sync per step, as torch's
            result = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (``update_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale.fill_(float(new_scale))
        else:
            flags = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
            if not flags:
                raise RuntimeError("update() found no inf checks this iteration: call step(optimizer) "
                                   "(or unscale_) before update()")
            found_inf = bool(sum(f.item() for f in flags))
            scale, self._growth_tracker = update_scale(
                self._scale.item(), self._growth_tracker, found_inf, self._growth_factor,
                self._backoff_factor, self._growth_interval)
            self._scale.fill_(scale)
        self._per_optimizer = {}

    # -- overridden by ShardedGradScaler -------------------------------------------------------
    def _grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):
            raise ValueError("GradScaler: the optimizer holds fp16 gradients (fp16 parameters?); keep fp32 master "
                             "weights (MixedPrecision(param_dtype=torch.float16) on fp32 parameters, or autocast), "
                             "or use ShardedGradScaler, which accepts them")
        return grads

    def _sync_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        return found_inf  # every rank holds whole (e.g. DDP-averaged) gradients: nothing to agree on

    # -- inspection and checkpoints ---------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        return self._scale.item() if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def state_dict(self) -> dict[str, Any]:
        """torch's keys, so a checkpoint moves between torch's scaler and this one ({} when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the scaler state dict is empty: it was saved from a disabled scaler")
        self._scale.fill_(float(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


class ShardedGradScaler(GradScaler):
    """``GradScaler`` for sharded gradients (FSDP, ZeRO-2): the found-inf flag is agreed on by all ranks.

    ``process_group``: the data-parallel group whose ranks hold the shards
    (default: all ranks). Accepts fp16 gradients (``keep_low_precision_grads``),
    as torch's does. Every rank must call ``unscale_``/``step`` (a collective),
    also a rank whose shard has no gradient.
    """

    def __init__(self, device: str | torch.device | None = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, process_group: tdist.ProcessGroup | None = None) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group

    def _grads(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # fully_shard's gradients are DTensors: check and unscale each rank's own rows (its local shard)
        return [g.to_local() if isinstance(g, DTensor) else g for g in grads]

    def _sync_found_inf(self, found_inf: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.world_size(self.process_group) > 1:
            # MAX of 0/1 flags: one rank's overflow makes every rank skip and back off
            comm.all_reduce(found_inf, op=comm.ReduceOp.MAX, group=self.process_group)
        return found_inf


def _autocast_bf16(device: torch.device) -> bool:
    return torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
