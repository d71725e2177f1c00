"""Check a pipeline plan before it runs, and put it on a timeline.

``validate(plan)`` raises :class:`ScheduleError` naming the first things that
are wrong, in words: a stage on the wrong rank, a micro-batch whose forward
or backward is missing or repeated, a backward before its forward (it needs
the activations the forward saved), a computation whose input was never
received, a message sent but never received (or the reverse), messages
between two ranks received in another order than sent, and a deadlock, with
the cycle of ranks waiting on each other.

``simulate(plan)`` runs the plan on paper: every rank executes its list in
order; a compute action takes ``DURATION[kind]`` time units, a send never
waits (the executor sends asynchronously), a receive waits for its send. Out
come the timeline (``table()``), the bubble (idle rank-time / total
rank-time) and the activations each rank holds at its peak.

    >>> from minifsdp.pipeline.schedules import gpipe
    >>> validate(gpipe(2, 2)).bubble       # valid: its timeline; (p-1)/(m+p-1)
    0.3333333333333333
    >>> print(simulate(gpipe(2, 2)).table())
           0  1  2  3  4  5  6  7  8
    rank 0 |F0|F1|  |  |  |B0   |B1   |
    rank 1 |  |F0|F1|B0   |B1   |  |  |
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .schedules import COMM, COMPUTE, DURATION, Action, Plan

__all__ = ["ScheduleError", "validate", "simulate", "Timeline"]


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


def _static_problems(plan: Plan) -> list[str]:
    p, last, problems = plan.p, plan.num_stages - 1, []
    if sorted(plan.order) != list(range(p)):
        return [f"the plan must list ranks 0..{p - 1}, it lists {sorted(plan.order)}"]
    everywhere: dict[Action, int] = {}
    for r, acts in plan.order.items():
        for a in acts:
            if not 0 <= a.stage <= last or not 0 <= a.mb < plan.m:
                problems.append(f"rank {r}: {a} names stage {a.stage} / micro-batch {a.mb}, outside the "
                                f"{plan.num_stages} stages and {plan.m} micro-batches")
            elif plan.rank_of(a.stage) != r:
                problems.append(f"rank {r} runs {a} but stage {a.stage} lives on rank {plan.rank_of(a.stage)} "
                                f"(stage s on rank s % {p})")
            everywhere[a] = everywhere.get(a, 0) + 1
    if problems:
        return problems
    split = any(a.kind in ("I", "W") for a in everywhere)
    for s in range(plan.num_stages):
        for i in range(plan.m):
            kinds = ("F", "I", "W") if split else ("F", "B")
            for k in kinds:
                n = everywhere.get(Action(s, k, i), 0)
                what = {"F": "forward", "B": "backward", "I": "input-gradient backward",
                        "W": "weight-gradient backward"}[k]
                if n == 0:
                    problems.append(f"stage {s} never runs the {what} of micro-batch {i} ({Action(s, k, i)} is missing)")
                elif n > 1:
                    problems.append(f"stage {s} runs the {what} of micro-batch {i} {n} times ({Action(s, k, i)})")
            if split and everywhere.get(Action(s, "B", i)):
                problems.append(f"stage {s}, micro-batch {i}: a plan with I/W must not also run B ({Action(s, 'B', i)})")
    if problems:
        return problems
    comms = plan.has_comms()
    held = {r: set(acts) for r, acts in plan.order.items()}
    for r, acts in plan.order.items():
        seen: dict[Action, int] = {}
        for pos, a in enumerate(acts):
            s, i = a.stage, a.mb

            def need(dep: Action, why: str) -> None:
                if dep not in seen:
                    problems.append(f"rank {r} runs {a} (position {pos}) before {dep}: {why}")
            if a.kind in ("B", "I"):
                need(Action(s, "F", i), "a backward needs the activations its forward saved")
            if a.kind == "W":
                need(Action(s, "I", i), "the weight gradient needs the output gradient that I receives")
            if a.kind in ("SEND_F",):
                need(Action(s, "F", i), "it sends the output of that forward")
            if a.kind == "SEND_B":
                need(Action(s, "I" if split else "B", i), "it sends the input gradient that backward makes")
            if a.kind == "F" and s > 0 and (comms or plan.rank_of(s - 1) == r):
                src = Action(s, "RECV_F", i) if plan.rank_of(s - 1) != r else Action(s - 1, "F", i)
                need(src, "its input was never received" if src.kind == "RECV_F" else "it needs the previous stage's output")
            if a.kind in ("B", "I") and s < last and (comms or plan.rank_of(s + 1) == r):
                src = Action(s, "RECV_B", i) if plan.rank_of(s + 1) != r else Action(s + 1, "I" if split else "B", i)
                need(src, "its output gradient was never received" if src.kind == "RECV_B"
                     else "it needs the next stage's input gradient")
            if a.kind in COMM:
                peer, match = _peer_action(plan, a)
                if peer == r:
                    problems.append(f"rank {r}: {a} is a message to itself; neighbouring stages on one rank hand "
                                    "over in memory, drop it")
                elif match not in held[peer]:
                    verb = "sends" if a.kind.startswith("SEND") else "waits to receive"
                    problems.append(f"rank {r} {verb} {a} but rank {peer} has no matching {match}")
            seen[a] = pos
    return problems or _order_problems(plan)


def _order_problems(plan: Plan) -> list[str]:
    """Messages between two ranks must be received in the order they were sent.

    gloo could match them by tag, but NCCL ignores tags and matches the sends
    and receives of a pair of ranks in issue order: a plan that receives them
    the other way round would hand one micro-batch's tensor to another's
    receive. (Every plan ``make_plan`` produces keeps the order.)
    """
    sent: dict[tuple[int, int], list[Action]] = {}
    received: dict[tuple[int, int], list[Action]] = {}
    for r, acts in plan.order.items():
        for a in acts:
            if a.kind in COMM:
                peer, match = _peer_action(plan, a)
                if a.kind.startswith("SEND"):
                    sent.setdefault((r, peer), []).append(a)
                else:
                    received.setdefault((peer, r), []).append(match)
    problems = []
    for (src, dst), order in sent.items():
        got = received.get((src, dst), [])
        for x, y in zip(order, got):
            if x != y:
                problems.append(f"rank {src} sends {x} to rank {dst} before {y}, but rank {dst} receives {y} first: "
                                "messages between two ranks must be received in the order they were sent "
                                "(NCCL matches them in order); reorder the receives")
                break
    return problems


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


def validate(plan: Plan) -> Timeline:
    """Raise ScheduleError listing what is wrong; for a valid plan return its ``Timeline``
    (``.lowered`` is the plan with its messages, what the executor runs)."""
    unknown = [f"rank {r}: {a!r} is not an Action" for r, acts in plan.order.items() for a in acts
               if not isinstance(a, tuple) or len(a) != 3 or a[1] not in COMPUTE + COMM]
    if unknown:
        raise ScheduleError(unknown)
    plan.order = {r: [Action(*a) for a in acts] for r, acts in plan.order.items()}
    problems = _static_problems(plan)
    if problems:
        raise ScheduleError(problems)
    dup = [f"rank {r} has {a} {n} times" for r, acts in plan.order.items()
           for a, n in Counter(acts).items() if n > 1]
    if dup:
        raise ScheduleError(dup)
    return simulate(plan)  # raises on a deadlock
