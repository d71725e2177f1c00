"""The runtime: one loop that executes any valid plan, and torch's schedule classes on top of it.

``ScheduleGPipe(stage, n_microbatches, loss_fn)``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B(stages, ...)`` and ``ScheduleInterleavedZeroBubble``
take the arguments of their ``torch.distributed.pipelining`` namesakes and
keep its contract for ``step(*args, target=None, losses=None, **kwargs)``:

* the rank holding stage 0 passes the batch (``step(x)``), the rank holding the
  last stage the target (``out = step(target=y, losses=losses)``), others
  ``step()``;
* the batch splits along dim 0 into ``n_microbatches`` equal, contiguous,
  ordered micro-batches; ``loss_fn(output, target)`` runs once per micro-batch
  and ``losses`` receives the m losses in order;
* the last stage returns the whole batch's output;
* after ``step`` every ``.grad`` holds (1/m) x the sum of the micro-batches'
  gradients (``scale_grads=True``): with a mean loss, the full-batch gradient.

``ScheduleFromPlan(stages, plan, loss_fn)`` runs a plan you wrote yourself
(lab 07). Every plan goes through ``validate`` first, so a plan that would
deadlock is refused with the cycle named instead of hanging. The loop::

    for action in plan.order[my_rank]:         # e.g. 1RECV_F0 1F0 1SEND_F0 ...
        RECV_*  comm.recv into a fresh buffer (on gloo posted ahead, see below)
        SEND_*  comm.isend (async: a send never waits, so only receives order ranks)
        F       forward; on the last stage the loss
        B / I   backward (I: input gradient only); the input's gradient goes
                to the previous stage, in memory when it lives on this rank
        W       weight gradients (zero bubble)

Receives posted ahead (gloo): before a compute action, the receives that
follow it up to the next compute action are posted with ``comm.irecv`` and
waited for at their place in the plan, so the transfer runs while this rank
computes (torch's runtime posts its receives early too). Gloo moves a message
only once its receive is posted and matches it by tag, so this changes no
order; NCCL matches a pair's messages in issue order, so there receives stay
where the validated plan puts them.

Every action is a ``trace`` span (``forward``, ``backward``, ``backward_input``,
``backward_weight`` with ``action="1F3"``) so ``plot.pipeline_schedule`` can
draw the measured timeline under the planned one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as tdist

from .. import comm, trace
from .plan import Action, Plan
from .schedules import make_plan
from .stage import PipelineStage
from .validator import validate

__all__ = ["PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "ScheduleFromPlan", "split_microbatches", "SPAN_NAMES",
           "measured_spans", "measured_bubble"]

_SPAN = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
SPAN_NAMES = tuple(_SPAN.values())


def split_microbatches(t: Any, m: int, what: str = "batch") -> list[Any]:
    """Cut a tensor into m equal contiguous pieces along dim 0 (anything else is repeated)."""
    if not isinstance(t, torch.Tensor):
        return [t] * m
    if t.dim() == 0 or t.shape[0] % m:
        n = t.shape[0] if t.dim() else 0
        raise ValueError(f"{what} of {n} along dim 0 does not split into {m} equal micro-batches: use a batch size "
                         f"that is a multiple of n_microbatches={m}")
    return list(t.split(t.shape[0] // m))


class PipelineSchedule:
    """Base: runs ``plan.order[this rank]`` for the given local stages (see the module docstring)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable[..., torch.Tensor] | None,
                 plan: Plan | str, scale_grads: bool = True, virtual_stages: int | None = None) -> None:
        if not stages:
            raise ValueError("a schedule needs at least one PipelineStage")
        self._stages = {st.stage_index: st for st in stages}
        first = stages[0]
        self.num_stages, p = first.num_stages, first.group_size
        if any(st.num_stages != self.num_stages or st.group_size != p for st in stages):
            raise ValueError("all stages of one schedule must agree on num_stages and process group")
        v = self.num_stages // p
        if len(stages) != v:
            raise ValueError(f"{self.num_stages} stages over {p} ranks is {v} per rank, but this rank passed "
                             f"{len(stages)}: pass every stage this rank holds ({[first.group_rank + k * p for k in range(v)]})")
        if virtual_stages is not None and v != virtual_stages:
            raise ValueError(f"{type(self).__name__} runs {virtual_stages} stage(s) per rank: num_stages "
                             f"({self.num_stages}) must be {virtual_stages} x the pipeline group size ({p})")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.plan = make_plan(plan, p, n_microbatches, v) if isinstance(plan, str) else plan
        if (self.plan.p, self.plan.m, self.plan.v) != (p, n_microbatches, v):
            raise ValueError(f"the plan is for p={self.plan.p}, m={self.plan.m}, v={self.plan.v}; the stages and "
                             f"n_microbatches give p={p}, m={n_microbatches}, v={v}")
        self._lowered = validate(self.plan).lowered
        self.pipeline_order = self.plan.compute_only().order
        if any(a.kind == "W" for acts in self.pipeline_order.values() for a in acts):
            for st in stages:
                st.enable_weight_split()
        self._rank = first.group_rank
        self._recv_ahead = tdist.is_initialized() and tdist.get_backend(first.group) == "gloo"  # see module doc
        # Each local stage's last action that accumulates weight gradients (B, or W): a DDP
        # submodule all-reduces there (stage.py, ``last_backward``).
        self._last_backward = {a.stage: a for a in self._lowered.order[self._rank] if a.kind in ("B", "W")}

    # ------------------------------------------------------------------ step
    def step(self, *args: Any, target: torch.Tensor | None = None, losses: list | None = None,
             return_outputs: bool = True, **kwargs: Any) -> torch.Tensor | None:
        """Run one pipelined forward and backward of the whole batch (torch's contract, see module doc)."""
        m, has_backward = self._n_microbatches, self._loss_fn is not None
        first, last = self._stages.get(0), self._stages.get(self.num_stages - 1)
        if first is not None and not args and not kwargs:
            raise ValueError("this rank holds stage 0: call step(x) with the whole batch")
        if last is not None and has_backward and target is None:
            raise ValueError("this rank holds the last stage and the schedule has a loss_fn: call "
                             "step(target=y, losses=...) with the whole batch's target")
        if has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() runs backward: call it outside torch.no_grad()")
        arg_mbs = list(zip(*[split_microbatches(a, m) for a in args])) if args else [()] * m
        kwarg_mbs = [dict(zip(kwargs, vals)) for vals in zip(*[split_microbatches(v, m, k) for k, v in kwargs.items()])] \
            if kwargs else [{}] * m
        target_mbs = split_microbatches(target, m, "target") if target is not None else None
        for st in self._stages.values():
            st.clear_runtime_states()
        step_losses: dict[int, torch.Tensor] = {}
        sends: list[tuple[Action, comm.Handle]] = []
        posted: dict[Action, comm.Handle] = {}  # receives posted ahead, waited for at their place
        skip = () if has_backward else ("B", "I", "W", "SEND_B", "RECV_B")
        order = [a for a in self._lowered.order[self._rank] if a.kind not in skip]
        for k, a in enumerate(order):
            sends = [(sa, h) for sa, h in sends if not _finished(h)]  # let sent buffers go as soon as they can
            st = self._stages[a.stage]
            if a.kind in ("RECV_F", "RECV_B") and a in posted:
                posted.pop(a).wait()
            elif a.kind == "RECV_F":
                st.recv_activation(a.mb)
            elif a.kind == "RECV_B":
                st.recv_grad(a.mb)
            elif a.kind == "SEND_F":
                sends += [(a, h) for h in st.send_activation(a.mb)]
            elif a.kind == "SEND_B":
                sends += [(a, h) for h in st.send_grad(a.mb, st.input_grads.pop(a.mb))]
            else:
                if self._recv_ahead:
                    self._post_receives(order, k, posted)
                with trace.span(_SPAN[a.kind], stage=a.stage, mb=a.mb, action=str(a)):
                    self._compute(a, st, arg_mbs, kwarg_mbs, target_mbs, step_losses, return_outputs)
        for _, h in sends:
            h.wait()
        for st in self._stages.values():
            if has_backward and st.in_flight():
                raise RuntimeError(f"stage {st.stage_index} still holds micro-batches {st.in_flight()} after the step: "
                                   "the plan never ran their backward")
            if has_backward and self.scale_grads:
                st.scale_grads(m)
        if last is not None and losses is not None and has_backward:
            losses.clear()
            losses.extend(step_losses[i] for i in range(m))
        out = torch.cat([last.output_chunks[i] for i in range(m)]) if last is not None and return_outputs else None
        if not has_backward:  # forward only: nothing will read the saved activations
            for st in self._stages.values():
                st.clear_runtime_states()
        return out

    def _post_receives(self, order: list[Action], k: int, posted: dict[Action, comm.Handle]) -> None:
        """Post the receives between compute action ``k`` and the next one (when their shape is known)."""
        for j in range(k + 1, len(order)):
            a = order[j]
            if a.kind in _SPAN:
                return
            st = self._stages[a.stage]
            if a.kind in ("RECV_F", "RECV_B") and a not in posted and st.can_post_recv(a.kind, a.mb):
                posted[a] = st.recv_activation(a.mb, True) if a.kind == "RECV_F" else st.recv_grad(a.mb, True)

    def _compute(self, a: Action, st: PipelineStage, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None,
                 step_losses: dict[int, torch.Tensor], return_outputs: bool) -> None:
        i, m = a.mb, self._n_microbatches
        if a.kind == "F":
            out = st.forward_one_chunk(i, tuple(arg_mbs[i]), kwarg_mbs[i], m) if st.is_first \
                else st.forward_one_chunk(i, n_microbatches=m)
            if st.is_last:
                if return_outputs:
                    st.output_chunks[i] = out.detach()
                if self._loss_fn is not None:
                    loss = self._loss_fn(out, target_mbs[i])
                    st.set_loss(i, loss)
                    step_losses[i] = loss.detach()
            elif st.is_local(a.stage + 1):  # the next stage is on this rank: hand over in memory
                self._stages[a.stage + 1].inbox[i] = out.detach()
            return
        last = self._last_backward.get(a.stage) == a
        if a.kind == "W":
            st.backward_weight(i, last_backward=last)
            return
        grad = st.backward_one_chunk(i, last_backward=last) if a.kind == "B" else st.backward_input(i)
        if not st.is_first:
            if st.is_local(a.stage - 1):
                self._stages[a.stage - 1].grad_inbox[i] = grad
            else:
                st.input_grads[i] = grad


def _finished(h: comm.Handle) -> bool:
    if h.is_completed():
        h.wait()  # records its span; returns at once
        return True
    return False


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all forwards, then all backwards. ``ScheduleGPipe(stage, n_microbatches, loss_fn)``."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True) -> None:
        super().__init__([stage], n_microbatches, loss_fn, "gpipe", scale_grads, virtual_stages=1)


class Schedule1F1B(PipelineSchedule):
    """1F1B: warm-up, one forward one backward, cool-down. Runs m < p too (torch refuses it)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True) -> None:
        super().__init__([stage], n_microbatches, loss_fn, "1f1b", scale_grads, virtual_stages=1)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: ``stages`` = every stage this rank holds (r, r + p, ...)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True) -> None:
        super().__init__(list(stages), n_microbatches, loss_fn, "interleaved", scale_grads)


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """Zero bubble: (interleaved) 1F1B with backward split into I (input) and W (weights)."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None = None,
                 scale_grads: bool = True) -> None:
        super().__init__(list(stages), n_microbatches, loss_fn, "zero-bubble", scale_grads)


class ScheduleFromPlan(PipelineSchedule):
    """Run a plan you wrote (a ``Plan`` or ``{rank: [actions]}``); it is validated first."""

    def __init__(self, stages: list[PipelineStage], plan: Plan | dict[int, list[Any]], loss_fn: Callable | None = None,
                 scale_grads: bool = True, n_microbatches: int | None = None) -> None:
        if not isinstance(plan, Plan):
            p = stages[0].group_size
            order = {r: [a if isinstance(a, Action) else Action.parse(a) for a in acts] for r, acts in plan.items()}
            m = n_microbatches or 1 + max(a.mb for acts in order.values() for a in acts)
            plan = Plan("custom", p, m, stages[0].num_stages // p, order)
        super().__init__(list(stages), plan.m, loss_fn, plan, scale_grads)


# --------------------------------------------------------------------------
# Measurement: the same quantities as the plan's, from what the tracer recorded
# --------------------------------------------------------------------------
def measured_spans(traces: list[trace.Trace]) -> dict[int, list[tuple[float, float, Action]]]:
    """Per rank, the (start, end, action) of every pipeline compute span recorded, in seconds."""
    return {tr.rank: [(s.start, s.end, Action.parse(s.args["action"])) for s in tr.spans
                      if s.name in SPAN_NAMES and "action" in s.args] for tr in traces}


def measured_bubble(traces: list[trace.Trace]) -> float:
    """Idle fraction of rank-time between the first compute span and the last, over all ranks.

    Waiting on a receive counts as idle, exactly as a blank cell of the plan's table.
    """
    spans = measured_spans(traces)
    starts = [s for sp in spans.values() for s, _, _ in sp]
    ends = [e for sp in spans.values() for _, e, _ in sp]
    if not starts:
        raise ValueError("no pipeline spans in these traces: run schedule.step() inside a trace.Tracer")
    window = (max(ends) - min(starts)) * len(spans)
    busy = sum(e - s for sp in spans.values() for s, e, _ in sp)
    return (window - busy) / window
