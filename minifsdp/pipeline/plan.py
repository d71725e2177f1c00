"""A pipeline plan as data, and the plan on paper: its messages, its timeline, its bubble.

Read this file first in ``minifsdp.pipeline``. A *plan* is, for every rank, an
ordered list of actions, in the notation of ``torch.distributed.pipelining``
(its ``_Action``: stage index, kind, micro-batch): ``"1F3"`` is stage 1's
forward of micro-batch 3; ``B`` a full backward; zero bubble splits it into
``I`` (gradient of the stage's *input*, which the previous stage is waiting
for) and ``W`` (gradient of the *weights*, which nobody waits for);
``SEND_F``/``RECV_F`` move an activation to the next stage, ``SEND_B``/``RECV_B``
a gradient to the previous one. Stage ``s`` lives on rank ``s % p`` (torch's
loop layout: with ``v`` stages per rank, rank ``r`` holds ``r, r+p, ...``).

``lower(plan)`` adds the messages; ``simulate(plan)`` runs the plan on paper:
every rank executes its list in order, a compute action takes
``DURATION[kind]`` time units (a forward 1, a backward 2), a send never waits
(the executor sends asynchronously), a receive waits for its send. Out come
the timeline (``table()``, torchgpipe-style), the bubble (idle rank-time over
total rank-time) and the activations each rank holds at its peak; a plan that
deadlocks raises :class:`ScheduleError` naming the cycle of waiting ranks.

    >>> plan = Plan("by hand", p=2, m=1, order={0: [Action.parse("0F0"), Action.parse("0B0")],
    ...                                          1: [Action.parse("1F0"), Action.parse("1B0")]})
    >>> print(plan.with_comms())
    rank 0: 0F0 0SEND_F0 0RECV_B0 0B0
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0
    >>> print(plan.table())
           0  1  2  3  4  5
    rank 0 |F0|  |  |  |B0   |
    rank 1 |  |F0|B0   |  |  |

``schedules.py`` makes the plans of GPipe, 1F1B, interleaved 1F1B and zero
bubble; ``validator.py`` checks any plan, yours included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Action", "Plan", "Timeline", "ScheduleError", "lower", "simulate", "COMPUTE", "COMM", "DURATION"]

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# Cost of each action in time units (a forward = 1). A backward costs about two
# forwards (two matmuls per weight instead of one); zero-bubble's I and W one each.
DURATION = {"F": 1, "B": 2, "I": 1, "W": 1, "SEND_F": 0, "RECV_F": 0, "SEND_B": 0, "RECV_B": 0}


class Action(NamedTuple):
    """One step of one rank: ``Action(stage, kind, mb)``, printed ``"1F3"`` as torch does."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``Action.parse("1RECV_F3") == Action(1, "RECV_F", 3)``."""
        i = 0
        while i < len(text) and text[i].isdigit():
            i += 1
        j = len(text)
        while j > i and text[j - 1].isdigit():
            j -= 1
        kind = text[i:j]
        if i == 0 or j == len(text) or kind not in COMPUTE + COMM:
            raise ValueError(f"cannot read action {text!r}: write stage, kind, micro-batch, e.g. '1F3' or '0SEND_F2'")
        return cls(int(text[:i]), kind, int(text[j:]))


@dataclass
class Plan:
    """A schedule as data: ``order[rank]`` is that rank's list of actions, in order.

    >>> from minifsdp.pipeline.schedules import gpipe
    >>> plan = gpipe(2, 2)
    >>> plan.order
    {0: [0F0, 0F1, 0B0, 0B1], 1: [1F0, 1F1, 1B0, 1B1]}
    >>> plan.bubble()                      # (p-1)/(m+p-1) = 1/3
    0.3333333333333333
    """

    name: str
    p: int                      # ranks (pipeline group size)
    m: int                      # micro-batches
    v: int = 1                  # stages per rank
    order: dict[int, list[Action]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def stages_of(self, rank: int) -> list[int]:
        return [rank + k * self.p for k in range(self.v)]

    def has_comms(self) -> bool:
        return any(a.kind in COMM for acts in self.order.values() for a in acts)

    def with_comms(self) -> "Plan":
        """The plan with the sends and receives the executor runs (see ``lower``)."""
        return self if self.has_comms() else lower(self)

    def compute_only(self) -> "Plan":
        return Plan(self.name, self.p, self.m, self.v,
                    {r: [a for a in acts if a.kind in COMPUTE] for r, acts in self.order.items()})

    # Read off the plan's timeline on paper (``simulate`` below).
    def bubble(self) -> float:
        """Idle fraction of rank-time on the plan's own timeline (F=1, B=2, I=W=1)."""
        return simulate(self).bubble

    def peak_activations(self) -> dict[int, float]:
        """Per rank: most micro-batches whose activations are held at once, in whole-rank units."""
        return simulate(self).peak_activations

    def table(self, width: int | None = None) -> str:
        """torchgpipe-style ASCII table: one row per rank, one column per time unit."""
        return simulate(self).table(width)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in sorted(self.order.items()))


# --------------------------------------------------------------------------
# The schedules (compute actions only; ``lower`` adds the messages)


class ScheduleError(ValueError):
    """A plan that cannot run as written; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        super().__init__("; ".join(problems[:3]) + more)


def _peer_action(plan: Plan, a: Action) -> tuple[int, Action]:
    """The rank and action at the other end of a message."""
    if a.kind == "SEND_F":
        return plan.rank_of(a.stage + 1), Action(a.stage + 1, "RECV_F", a.mb)
    if a.kind == "RECV_F":
        return plan.rank_of(a.stage - 1), Action(a.stage - 1, "SEND_F", a.mb)
    if a.kind == "SEND_B":
        return plan.rank_of(a.stage - 1), Action(a.stage - 1, "RECV_B", a.mb)
    return plan.rank_of(a.stage + 1), Action(a.stage + 1, "SEND_B", a.mb)  # RECV_B


# --------------------------------------------------------------------------
# Lowering: add the messages between ranks
# --------------------------------------------------------------------------
def lower(plan: Plan) -> Plan:
    """Insert the point-to-point messages around each compute action.

    A receive goes right before the action that needs it, a send right after
    the action that produced it (the executor sends asynchronously, so only a
    receive can wait). Neighbouring stages on the same rank hand over in memory.

    >>> from minifsdp.pipeline.schedules import gpipe
    >>> print(lower(gpipe(2, 1)))
    rank 0: 0F0 0SEND_F0 0RECV_B0 0B0
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0
    """
    last = plan.num_stages - 1
    order = {}
    for r, acts in plan.order.items():
        out: list[Action] = []
        for a in acts:
            s, i = a.stage, a.mb
            remote_prev = s > 0 and plan.rank_of(s - 1) != r
            remote_next = s < last and plan.rank_of(s + 1) != r
            if a.kind == "F":
                out += [Action(s, "RECV_F", i)] * remote_prev + [a] + [Action(s, "SEND_F", i)] * remote_next
            elif a.kind in ("B", "I"):
                out += [Action(s, "RECV_B", i)] * remote_next + [a] + [Action(s, "SEND_B", i)] * remote_prev
            else:
                out.append(a)
        order[r] = out
    return Plan(plan.name, plan.p, plan.m, plan.v, order)


# --------------------------------------------------------------------------
# The plan on paper
# --------------------------------------------------------------------------
@dataclass
class Timeline:
    """A plan's simulated run: ``spans[rank]`` = [(start, end, action)], times in units."""

    plan: Plan
    lowered: Plan                                              # the plan with its messages
    spans: dict[int, list[tuple[int, int, Action]]] = field(default_factory=dict)
    peak_held: dict[int, int] = field(default_factory=dict)   # (stage, micro-batch) pairs, at the peak

    @property
    def makespan(self) -> int:
        return max((e for sp in self.spans.values() for _, e, _ in sp), default=0)

    @property
    def bubble(self) -> float:
        busy = sum(e - s for sp in self.spans.values() for s, e, _ in sp)
        total = self.makespan * len(self.spans)
        return (total - busy) / total if total else 0.0

    @property
    def peak_activations(self) -> dict[int, float]:
        """Micro-batches' worth of a rank's layers held at the peak (a stage is 1/v of them)."""
        return {r: n / self.plan.v for r, n in self.peak_held.items()}

    def table(self, width: int | None = None) -> str:
        """One row per rank, one column per time unit; a blank cell is idle (the bubble).

        A cell is ``F3`` (forward of micro-batch 3); with several stages per rank
        a letter says which of the rank's stages (``F3a`` its first, ``F3b`` its second).
        """
        v, p = self.plan.v, self.plan.p
        width = width or (4 if v > 1 else 3) + (self.plan.m > 10)
        cols = self.makespan
        head = " " * 7 + "".join(f"{t:<{width}d}" for t in range(cols))
        rows = [head.rstrip()]
        for r in sorted(self.spans):
            cells, t = [], 0
            for s, e, a in sorted(self.spans[r]):
                cells += [" " * (width - 1)] * (s - t)
                label = f"{a.kind}{a.mb}" + ("abcdefgh"[a.stage // p] if v > 1 else "")
                cells.append(label[: width * (e - s) - 1].ljust(width * (e - s) - 1))
                t = e
            cells += [" " * (width - 1)] * (cols - t)
            rows.append(f"rank {r} |" + "|".join(cells) + "|")
        return "\n".join(rows)


def simulate(plan: Plan) -> Timeline:
    """Run the plan on paper (see the module docstring); raises ScheduleError if it deadlocks."""
    low = plan.with_comms()
    acts = low.order
    # A message is known by (direction, sending stage, micro-batch); sends never wait.
    key = {"SEND_F": lambda a: ("F", a.stage, a.mb), "RECV_F": lambda a: ("F", a.stage - 1, a.mb),
           "SEND_B": lambda a: ("B", a.stage, a.mb), "RECV_B": lambda a: ("B", a.stage + 1, a.mb)}
    pos = {r: 0 for r in acts}
    clock = {r: 0 for r in acts}
    sent: dict[tuple[str, int, int], int] = {}        # message -> time it was sent
    tl = Timeline(plan, low, {r: [] for r in acts})
    held = {r: 0 for r in acts}
    tl.peak_held = {r: 0 for r in acts}
    freeing = "W" if any(a.kind == "W" for aa in acts.values() for a in aa) else "B"
    moved = True
    while moved:
        moved = False
        for r, todo in acts.items():
            i, t, spans = pos[r], clock[r], tl.spans[r]
            while i < len(todo):
                a = todo[i]
                kind = a.kind
                if kind in DURATION and DURATION[kind]:       # compute
                    spans.append((t, t + DURATION[kind], a))
                    t += DURATION[kind]
                    held[r] += (kind == "F") - (kind == freeing)
                    tl.peak_held[r] = max(tl.peak_held[r], held[r])
                elif kind[0] == "S":                             # send: never waits
                    sent[key[kind](a)] = t
                else:                                            # receive: waits for its send
                    when = sent.get(key[kind](a))
                    if when is None:
                        break
                    t = max(t, when)
                i += 1
            moved |= i != pos[r]
            pos[r], clock[r] = i, t
    stuck = [r for r in acts if pos[r] < len(acts[r])]
    if stuck:
        raise ScheduleError([_deadlock(low, pos, stuck)])
    return tl


def _deadlock(plan: Plan, pos: dict[int, int], stuck: list[int]) -> str:
    """Say who waits for whom, following the waits from the first stuck rank to a cycle."""
    waits = {}
    for r in stuck:
        a = plan.order[r][pos[r]]
        waits[r] = (_peer_action(plan, a)[0], a)
    chain, r = [], stuck[0]
    while r in waits and r not in chain:
        chain.append(r)
        r = waits[r][0]
    steps = ", ".join(f"rank {c} waits at {waits[c][1]} for rank {waits[c][0]}" for c in chain)
    if r in chain:
        cycle = chain[chain.index(r):] + [r]
        return f"deadlock: {steps} (cycle {' -> '.join(map(str, cycle))}); move a send before the receive that waits on it"
    return f"deadlock: {steps}, which finished without sending it"
