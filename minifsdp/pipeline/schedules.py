"""The plans of GPipe, 1F1B, interleaved 1F1B and zero bubble: who runs which micro-batch when.

Each function returns a ``Plan`` (``plan.py``): per rank, the ordered compute
actions (``"1F3"``: stage 1's forward of micro-batch 3; ``B`` a backward;
``I``/``W`` its input and weight halves), before anything runs. Stage ``s``
lives on rank ``s % p``; with ``v`` stages per rank, rank ``r`` holds
``r, r+p, ...`` (torch's loop layout).

The four schedules, p = 4 ranks, m = 4 micro-batches (``plan.table()``; time in
units where a forward takes 1 and a backward 2; a blank cell is the bubble)::

    GPipe (Huang et al. 2019): every forward, then every backward. Bubble 3/7.
           0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20
    rank 0 |F0|F1|F2|F3|  |  |  |  |  |  |  |  |  |B0   |B1   |B2   |B3   |
    rank 1 |  |F0|F1|F2|F3|  |  |  |  |  |  |B0   |B1   |B2   |B3   |  |  |
    rank 2 |  |  |F0|F1|F2|F3|  |  |  |B0   |B1   |B2   |B3   |  |  |  |  |
    rank 3 |  |  |  |F0|F1|F2|F3|B0   |B1   |B2   |B3   |  |  |  |  |  |  |

    1F1B (PipeDream-Flush, Narayanan et al. 2021): after p-1-r warm-up forwards
    rank r alternates one forward, one backward. The same bubble, but rank r
    never holds more than p-r micro-batches' activations (GPipe: all m).
           0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20
    rank 0 |F0|F1|F2|F3|  |  |  |  |  |  |B0   |  |B1   |  |B2   |  |B3   |
    rank 1 |  |F0|F1|F2|  |  |  |  |B0   |F3|B1   |  |B2   |  |B3   |  |  |
    rank 2 |  |  |F0|F1|  |  |B0   |F2|B1   |F3|B2   |  |B3   |  |  |  |  |
    rank 3 |  |  |  |F0|B0   |F1|B1   |F2|B2   |F3|B3   |  |  |  |  |  |  |

    Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v stages per rank
    (a = the rank's first, b its second); each is 1/v of the rank's layers, so
    the bubble shrinks by v: (p-1)/(v*m+p-1), for v times more messages.

    Zero bubble (ZB-H1, Qi et al. 2024): 1F1B's order with B split into I
    (input gradient, in B's place) and W (weight gradient), each W moved into
    a slot where its rank would wait. Bubble (p-1)/(3m+p-1) for m >= p:
           0  1  2  3  4  5  6  7  8  9  10 11 12 13 14
    rank 0 |F0|F1|F2|F3|  |  |  |I0|W0|I1|W1|I2|W2|I3|W3|
    rank 1 |  |F0|F1|F2|  |  |I0|F3|I1|W0|I2|W1|I3|W2|W3|
    rank 2 |  |  |F0|F1|  |I0|F2|I1|F3|I2|W0|I3|W1|W2|W3|
    rank 3 |  |  |  |F0|I0|F1|I1|F2|I2|F3|I3|W0|W1|W2|W3|

The bubble of a plan is measured on its own timeline (``simulate``): idle
rank-time over total rank-time. For GPipe and 1F1B it is ``(p-1)/(m+p-1)``,
for interleaved ``(p-1)/(v*m+p-1)`` (``minifsdp.estimate``); the tests hold
every plan to these.
"""

from __future__ import annotations

from .plan import Action, Plan

__all__ = ["SCHEDULES", "make_plan", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble"]

# --------------------------------------------------------------------------
def _check(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"a pipeline needs p >= 1 ranks, m >= 1 micro-batches, v >= 1 stages per rank; "
                         f"got p={p}, m={m}, v={v}")


def gpipe(p: int, m: int) -> Plan:
    """Fill, then drain: all m forwards, then all m backwards (stage s = rank s).

    >>> print(gpipe(2, 3))
    rank 0: 0F0 0F1 0F2 0B0 0B1 0B2
    rank 1: 1F0 1F1 1F2 1B0 1B1 1B2
    """
    _check(p, m)
    return Plan("gpipe", p, m, 1, {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
                                   for r in range(p)})


def one_f_one_b(p: int, m: int) -> Plan:
    """Warm-up, steady state, cool-down (PipeDream-Flush / torch's Schedule1F1B).

    Rank r first runs ``w = min(p-1-r, m)`` forwards: the micro-batches in
    flight while the first one reaches the last stage and comes back. Then
    each forward is followed by the oldest waiting backward; the cool-down
    runs the w backwards left. At most ``w + 1 <= p - r`` micro-batches are
    held at once, whatever m is.

    >>> print(one_f_one_b(2, 3))
    rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    _check(p, m)
    order = {}
    for r in range(p):
        w = min(p - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(w)]                 # warm-up
        for i in range(m - w):                                       # steady: 1 forward, 1 backward
            acts += [Action(r, "F", w + i), Action(r, "B", i)]
        acts += [Action(r, "B", i) for i in range(m - w, m)]         # cool-down
        order[r] = acts
    return Plan("1f1b", p, m, 1, order)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Plan:
    """Megatron-LM's interleaved 1F1B: v stages per rank, depth first.

    Micro-batches go in *rounds* of g (g = p when p divides m; torch's flexible
    rule: ``rounds = max(1, m // p)``, g = m / rounds): a rank runs the round's
    g forwards on its first stage, then on its second, ... then the next
    round. Warm-up: ``(v-1)*g + 2*(p-1-r)`` forwards (Megatron's count, with g
    for p), then one forward / one backward, backwards walking the stages in
    reverse.
    """
    return Plan("interleaved", p, m, v, _interleaved(p, m, v, hops=2))


def _interleaved(p: int, m: int, v: int, hops: int) -> dict[int, list[Action]]:
    """Interleaved order with a warm-up of ``(v-1)*g + hops*(p-1-r)`` forwards (v = 1: 1F1B's order)."""
    _check(p, m, v)
    rounds = max(1, m // p) if v > 1 else 1  # one stage per rank: no rounds to keep apart
    if m % rounds:
        raise ValueError(f"interleaved 1F1B runs micro-batches in {rounds} equal rounds; {m} micro-batches "
                         f"do not split into them: use a multiple of {p} micro-batches (or fewer than {p})")
    g = m // rounds
    total = v * m

    def fwd(j: int, r: int) -> Action:
        k, i = (j // g) % v, (j // (g * v)) * g + j % g
        return Action(r + k * p, "F", i)

    def bwd(j: int, r: int) -> Action:
        k, i = v - 1 - (j // g) % v, (j // (g * v)) * g + j % g
        return Action(r + k * p, "B", i)

    order = {}
    for r in range(p):
        w = min(total, (v - 1) * g + hops * (p - 1 - r))
        acts = [fwd(j, r) for j in range(w)]
        for j in range(total - w):
            acts += [fwd(w + j, r), bwd(j, r)]
        acts += [bwd(j, r) for j in range(total - w, total)]
        order[r] = acts
    return order


def zero_bubble(p: int, m: int, v: int = 1) -> Plan:
    """Zero bubble (ZB-H1 for v = 1; torch's ScheduleInterleavedZeroBubble for v > 1).

    The order of 1F1B (v = 1) or interleaved 1F1B with each B split into I
    then W. I, the input gradient, keeps B's place: the previous stage waits
    for it. W, the weight gradient, has no reader but the optimizer, so it
    moves: rank r runs the W of the I it ran r backwards ago, right after its
    current I, and the r W's still owed at the end last. Rank r's 1F1B idles
    about r slots waiting for its first backward to come back; those r
    deferred W's are what fills them (Qi et al. 2024, ZB-H1).

    The interleaved warm-up is one forward per hop, ``(v-1)*g + (p-1-r)``,
    not interleaved 1F1B's two: an I takes a forward's time, so the backward
    comes back sooner. Fewer micro-batches are in flight; at p = 2, m = 4,
    v = 2 every rank holds 2 ranks' worth of micro-batches at its peak where
    the same split laid on interleaved 1F1B's order held 2.5 (25% more
    activation memory for the same bubble, 4%). Both the order and the W lag
    are torch's (``schedules._get_1f1b_rank_ops(enable_zero_bubble=True)``).

    >>> print(zero_bubble(2, 2))
    rank 0: 0F0 0F1 0I0 0W0 0I1 0W1
    rank 1: 1F0 1I0 1F1 1I1 1W0 1W1
    """
    order = {}
    for r, acts in _interleaved(p, m, v, hops=1).items():
        out, inputs = [], []
        for a in acts:
            if a.kind != "B":
                out.append(a)
                continue
            out.append(Action(a.stage, "I", a.mb))
            inputs.append(out[-1])
            if len(inputs) > r:                      # W of the I run r backwards ago
                late = inputs[len(inputs) - 1 - r]
                out.append(Action(late.stage, "W", late.mb))
        out += [Action(a.stage, "W", a.mb) for a in inputs[max(0, len(inputs) - r):]]
        order[r] = out
    return Plan("zero-bubble", p, m, v, order)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b, "zero-bubble": zero_bubble}


def make_plan(schedule: str, p: int, m: int, v: int = 1) -> Plan:
    """``make_plan("1f1b", 4, 8)``; ``v`` (stages per rank) for interleaved and zero-bubble."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    if schedule in ("gpipe", "1f1b"):
        if v != 1:
            raise ValueError(f"{schedule} runs one stage per rank; use 'interleaved' or 'zero-bubble' for v={v}")
        return SCHEDULES[schedule](p, m)
    return SCHEDULES[schedule](p, m, v)
