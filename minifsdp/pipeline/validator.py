"""Check a pipeline plan before it runs: what would make it wrong, hang or mismatch.

``validate(plan)`` raises :class:`ScheduleError` naming the first things that
are wrong, in words: a stage on the wrong rank, a micro-batch whose forward
or backward is missing or repeated, a backward before its forward (it needs
the activations the forward saved), a computation whose input was never
received, a message sent but never received (or the reverse), messages
between two ranks received in another order than sent, and a deadlock, with
the cycle of ranks waiting on each other (found by running the plan on paper,
``plan.simulate``). A valid plan returns its ``Timeline``; ``.lowered`` is the
plan with its messages, what the executor runs.

    >>> from minifsdp.pipeline.schedules import gpipe
    >>> validate(gpipe(2, 2)).bubble       # valid: its timeline; (p-1)/(m+p-1)
    0.3333333333333333
"""

from __future__ import annotations

from collections import Counter

from .plan import COMM, COMPUTE, Action, Plan, ScheduleError, Timeline, _peer_action, simulate

__all__ = ["validate", "ScheduleError"]


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
