"""Checks for lab 11 (mixture of experts, expert parallel): the learner's router top-k and split sizes,
the dispatch (counts all-to-all, rows all-to-all as an autograd Function, grouped by expert), and the
combine with the gradient sync, against one process.

The learner routes each token to k of E experts, computes where every assignment goes (sorted by
expert, counts, rows per destination rank), moves the rows to the ranks holding their experts with a
counts all-to-all then the rows' all-to-all (differentiable: backward is the all-to-all the other way),
groups them by local expert, then sends the experts' outputs home (the permutation back) and mixes them
with the router's weights; and syncs the gradients (replicated ones averaged over the ranks, experts'
already complete on their rank, divided by ep). Each check runs the learner's code (on 2 ranks where it
communicates: CPU ranks where the machine has fewer GPUs), compares with one process's ``models.MoE``
and with the library's ``minifsdp.expert_parallel``, and prints one verdict::

    from minifsdp.labcheck import lab11 as check
    check.route(route, split_sizes)
    check.dispatch(dispatch, AllToAll)
    check.combine(expert_parallel, combine, sync_gradients)
    check.hint("dispatch")            # the next hint for an exercise, idea first

Targets: torch's softmax and top-k (k > 1 renormalised, k = 1 the raw probability) and the gradient
reaching the logits; the split sizes; one process's rows for each expert, x's gradient, one counts
all-to-all (E int64) and one rows all-to-all forward, one backward, each rank's ``ring_bytes`` equal to
``expert_parallel.moe_all_to_all_bytes`` of the routing; one process's MoE layer (outputs, input,
expert and router gradients; dropless and with a capacity factor) and two AdamW steps of
``gpt-moe-tiny`` (loss, gradients, parameters), with each rank's bytes per step equal to the formula.

Authorship: every check refuses the library's expert parallel (``minifsdp.expert_parallel``'s dispatch,
layer, naive all-gather and gradient functions, ``models.top_k_routing``) and torch's differentiable
all-to-all (``torch.distributed.nn.functional.all_to_all_single``, ``all_to_all_single_autograd``)
statically and at run time, a :class:`~minifsdp.labcheck.authorship.Wire` around the learner's code in
each worker.
"""

from __future__ import annotations

import copy
import math
import types
from typing import Any, Callable

import torch

from .. import comm, data, dist, models, trace
from ..expert_parallel import dispatch as _ep_dispatch
from ..expert_parallel import gpt as _ep_gpt
from ..expert_parallel import moe_layer as _ep_layer
from ..expert_parallel import naive as _ep_naive
from .authorship import LibraryShortcut, Wire, watched
from .verdict import CheckFailed, Hints, call, check_world, failed, figures, passed, require_own, run

__all__ = ["route", "dispatch", "combine", "hint", "results", "LIBRARY"]


def _functions(module: types.ModuleType) -> list[Any]:
    """The functions and classes ``module`` defines itself (not what it imports)."""
    return [v for v in vars(module).values()
            if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) == module.__name__]


def _torch_all_to_all() -> tuple:
    """torch's differentiable all-to-alls: the functions and their autograd Functions' forward / backward
    (a Wire follows the methods of minifsdp's classes only, so torch's are listed one by one)."""
    import torch.distributed._functional_collectives as fc
    import torch.distributed.nn.functional as nnf
    found: list[Any] = [nnf.all_to_all_single, nnf.all_to_all]
    for name in ("all_to_all_single_autograd",):
        if hasattr(fc, name):
            found.append(getattr(fc, name))
    for cls in (getattr(nnf, "_AlltoAllSingle", None), getattr(nnf, "_AlltoAll", None)):
        if cls is not None:
            found.append(cls)
            found += [getattr(v, "__func__", v) for k, v in vars(cls).items() if k in ("forward", "backward")]
    return tuple(found)


# The library's implementation of what the exercises build: the routing, the dispatch and its autograd
# Function, the expert-parallel layer (and the one-process layer's methods it inherits), the naive
# all-gather exchange, the gradient functions; and torch's differentiable all-to-all.
LIBRARY = (models.top_k_routing, *_functions(_ep_dispatch), *_functions(_ep_layer), *_functions(_ep_naive),
           *_functions(_ep_gpt), *_torch_all_to_all())

results: dict[str, Any] = {}   # what the last run of each check measured
RANKS = 2
E, D, TOKENS, K = 8, 6, 10, 2                  # exercise 2: 8 experts, rows of 6 values, 10 tokens per rank
ROUTE_CASES = ((8, 2, (4, 5)), (8, 1, (4, 5)), (4, 3, (3, 4)), (16, 4, (2, 6)), (2, 2, (7,)), (6, 1, (9,)))
MODEL, LAYERS, BATCH, SEQ, LR, STEPS = "gpt-moe-tiny", 4, 8, 16, 1e-3, 2
ATOL, RTOL = 1e-5, 1e-4                        # fp32, another order of additions than one process
CAPACITY = 1.0                                 # exercise 3's capacity factor (some assignments drop)

hint = Hints({
    "route": [
        "The router's logits become probabilities over the E experts (the last dimension). Each token keeps "
        "its k most probable experts, best first: torch has an op that returns both values and indices.",
        "With k > 1 the k kept probabilities are rescaled to sum to 1 per token. With k = 1 they stay as they "
        "are: rescaled, the weight would always be 1 and the loss could not teach the router.",
        "split_sizes: a stable sort of the expert ids gives the order; counting per expert must give E numbers, "
        "zeros included. Rank j holds a block of E/ep consecutive experts: add their counts up.",
        "send is a Python list of ints (split sizes go to the all-to-all as a list), one per rank.",
    ],
    "dispatch": [
        "AllToAll forward: an output with one row per row that arrives (the sum of output_split_sizes), then "
        "one all-to-all. Keep what backward needs on ctx.",
        "AllToAll backward: row i of the output came from some rank; its gradient goes back there. It is "
        "the same exchange in reverse: which split sizes swap places?",
        "dispatch: your split_sizes gives the order and how many rows go to each rank. How does a rank learn "
        "how many rows it will receive? Every rank holds counts for every expert: one all-to-all of them.",
        "What arrives is a (ep, E/ep) table: rows from rank s for local expert l. The rows come source by "
        "source, each source's block expert by expert. A stable sort of each row's local expert groups them.",
    ],
    "combine": [
        "The outputs are in dispatch's grouped order; the rows must go back in the order they arrived, "
        "source by source. Keep the permutation you applied, and apply its inverse.",
        "Then the reverse exchange through your AllToAll: what you received from rank s goes back to s. "
        "Home, the rows are in the order you sent them: sorted by expert.",
        "y[t] adds weight x output over t's assignments: put token and weight in that same sorted order, "
        "then add each weighted row into its token's row of y.",
        "sync_gradients: a replicated parameter's gradient covers this rank's sequences; an expert's already "
        "holds every rank's tokens routed to it. The loss is the mean over ranks: what does each need?",
    ],
})


# -- how a raw torch error reads, in the lab's words -----------------------------------------------------
_SPLITS = {"dispatch": "the all-to-all's split sizes do not fit its tensors: output_split_sizes are the rows "
                       "arriving from each rank (what the counts all-to-all told you), input_split_sizes the rows "
                       "going to each rank (send), and the output has room for exactly the rows that arrive",
           "combine": "the way back's split sizes do not fit its tensors: each rank returns what it received "
                      "(recv rows to each rank) and gets back what it sent (send rows from each rank): the split "
                      "sizes swap places"}
_TRANSLATIONS = (
    ("split_sizes", None),
    ("contiguous", "a tensor handed to the all-to-all is not contiguous in memory: .contiguous() first"),
    ("incorrect number of gradients", "AllToAll.backward returns one gradient per input of forward: the rows' "
                                      "gradient, then None for the split sizes and the group"),
)


def _translate(what: str, message: str) -> str | None:
    for needle, sentence in _TRANSLATIONS:
        if needle in message and "library" not in message:
            return sentence or _SPLITS[what]
    return None


def _run(what: str, fn: Callable, world_size: int, *args: Any) -> list:
    """``verdict.run``, with the raw torch errors a learner meets said in one sentence of the lab."""
    try:
        return run(what, fn, world_size, *args, timeout=120)
    except CheckFailed as err:
        sentence = _translate(what, str(err))
        if sentence:
            failed(what, f"{sentence} ({str(err).split(': ', 1)[-1].split(' (in ')[0]})")
        raise
    raise AssertionError("unreachable")


# -- exercise 1: the router's top-k and the split sizes, in this process --------------------------------------
def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check_route_case(what: str, route: Callable, E_: int, k: int, shape: tuple, gen: torch.Generator) -> None:
    logits = (2 * torch.randn(*shape, E_, generator=gen)).requires_grad_()
    where = f"E = {E_}, k = {k}, logits of shape {tuple(logits.shape)}"
    got = call(what, route, logits, k)
    if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        failed(what, f"route returned {type(got).__name__}: return three tensors, (probs, expert_idx, weights)")
    probs, idx, weights = got
    want_probs, want_idx, want_w = models.top_k_routing(logits.detach(), k)
    if probs.shape != want_probs.shape or not torch.allclose(probs.detach(), want_probs, atol=ATOL, rtol=RTOL):
        sums = probs.detach().sum(-1) if probs.shape == want_probs.shape else None
        why = ("they do not sum to 1 over the E experts: a softmax over the last dimension"
               if sums is not None and not torch.allclose(sums, torch.ones_like(sums), atol=1e-4)
               else f"shape {tuple(probs.shape)}, expected {tuple(want_probs.shape)}: the router's softmax over "
                    "the E experts, for every token" if sums is None else "they are not the softmax of the logits")
        failed(what, f"{where}: probs: {why}")
    if idx.shape != want_idx.shape:
        failed(what, f"{where}: expert_idx has shape {tuple(idx.shape)}, expected {tuple(want_idx.shape)}: "
                     "k expert ids per token")
    if not torch.equal(idx.long(), want_idx):
        if torch.equal(idx.long().sort(-1).values, want_idx.sort(-1).values):
            failed(what, f"{where}: the right experts in another order: best first (the most probable expert "
                         "in slot 0): the capacity factor keeps a token's slots in that order")
        failed(what, f"{where}: expert_idx are not each token's k most probable experts")
    if weights.shape != want_w.shape:
        failed(what, f"{where}: weights has shape {tuple(weights.shape)}, expected {tuple(want_w.shape)}")
    w = weights.detach()
    if not torch.allclose(w, want_w, atol=ATOL, rtol=RTOL):
        top = want_probs.gather(-1, want_idx)
        if k == 1 and torch.allclose(w, torch.ones_like(w)):
            why = ("with k = 1 the weight is the raw probability: renormalised it is always 1, and the loss "
                   "would teach the router nothing (Switch Transformer)")
        elif k > 1 and torch.allclose(w, top, atol=ATOL, rtol=RTOL):
            why = "with k > 1 the k probabilities are renormalised to sum to 1 per token (Mixtral, GShard)"
        else:
            why = "each weight is its expert's probability (renormalised over the k when k > 1)"
        failed(what, f"{where}: weights differ from the target: {why}")
    probe = torch.randn(want_w.shape, generator=gen)
    ref_logits = logits.detach().clone().requires_grad_()
    (models.top_k_routing(ref_logits, k)[2] * probe).sum().backward()
    try:
        (weights * probe).sum().backward()
    except RuntimeError:
        failed(what, f"{where}: no gradient flows from the weights back to the logits: the router learns "
                     "through the weights (do not detach them)")
    if logits.grad is None or not torch.allclose(logits.grad, ref_logits.grad, atol=ATOL, rtol=RTOL):
        failed(what, f"{where}: the gradient reaching the logits through the weights differs from torch's: "
                     "compute the weights from the softmax's probabilities, with autograd on")


def _split_cases() -> list[tuple[torch.Tensor, int, str]]:
    gen = torch.Generator().manual_seed(3)
    spread = torch.randint(0, 8, (40,), generator=gen)
    few = torch.randint(0, 6, (30,), generator=gen)          # experts 6 and 7 never chosen
    one_rank = torch.randint(0, 4, (20,), generator=gen)      # ep = 2: rank 1's experts get nothing
    return [(spread, ep, "40 assignments over 8 experts") for ep in (1, 2, 4, 8)] + \
        [(few, 2, "30 assignments, experts 6 and 7 never chosen"), (one_rank, 2, "20 assignments, all to rank 0")]


def _check_split_case(what: str, split_sizes: Callable, expert: torch.Tensor, ep: int, label: str) -> None:
    n_expert = 8
    where = f"{label}, ep = {ep}"
    try:
        got = call(what, split_sizes, expert.clone(), n_expert, ep)
    except CheckFailed as err:
        if "is invalid for input of size" in str(err):
            failed(what, f"{where}: your code raised {str(err).split('raised ', 1)[-1]}: are there E = {n_expert} "
                         "counts, the experts nobody chose included (zeros)?")
        raise
    if not (isinstance(got, tuple) and len(got) == 3):
        failed(what, f"split_sizes returned {type(got).__name__}: return (order, counts, send)")
    order, counts, send = got
    want_counts = torch.bincount(expert, minlength=n_expert)
    want_send = want_counts.view(ep, n_expert // ep).sum(1).tolist()
    if not isinstance(order, torch.Tensor) or order.shape != expert.shape:
        failed(what, f"{where}: order must be a tensor of {expert.numel()} indices, one per assignment")
    if not torch.equal(order.sort().values, torch.arange(expert.numel())):
        failed(what, f"{where}: order is not a permutation of the assignments: each index once")
    sorted_ids = expert[order]
    if not bool((sorted_ids[1:] >= sorted_ids[:-1]).all()):
        failed(what, f"{where}: expert[order] is not sorted by expert: the rows for one rank must be contiguous "
                     "(and its experts' in expert order)")
    for e in range(n_expert):
        mine = order[sorted_ids == e]
        if not bool((mine[1:] > mine[:-1]).all()):
            failed(what, f"{where}: expert {e}'s assignments are out of token order after the sort: a stable sort "
                         "keeps them in the order one process feeds the expert")
    if not isinstance(counts, torch.Tensor) or counts.shape != want_counts.shape:
        n = counts.numel() if isinstance(counts, torch.Tensor) else type(counts).__name__
        failed(what, f"{where}: counts has {n} entries, expected E = {n_expert}: count the experts nobody chose "
                     "too (zeros): every rank must send the same number of counts")
    if not torch.equal(counts.long(), want_counts):
        failed(what, f"{where}: counts = {counts.tolist()}, expected {want_counts.tolist()}: assignments per expert")
    if not _is_int_list(send):
        failed(what, f"{where}: send is a {type(send).__name__}: make it a Python list of ints (split sizes go to "
                     "the all-to-all as a list)")
    if send != want_send:
        why = (f"{len(send)} numbers for {ep} ranks: one per rank" if len(send) != ep else
               f"rank j holds experts j*E/ep .. (j+1)*E/ep - 1 ({n_expert // ep} consecutive experts): send[j] adds "
               "up their counts")
        failed(what, f"{where}: send = {send}, expected {want_send}: {why}")


def _lab_routing(route: Callable, split_sizes: Callable) -> tuple[list[int], list[int]]:
    """Rank 0's send at ep = 2 for the lab's model and batch (block 1's router): the learner's and the target."""
    model = models.build_model(MODEL, n_layer=LAYERS)
    seen: dict[str, torch.Tensor] = {}
    model.blocks[1].mlp.register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0].detach()))
    x, _ = data.get_batch(0, BATCH, SEQ)
    with torch.no_grad():
        model(x[:BATCH // 2])
        logits = model.blocks[1].mlp.router(seen["x"])
        idx = models.top_k_routing(logits, 2)[1].reshape(-1)
        target = torch.bincount(idx, minlength=E).view(2, -1).sum(1).tolist()
        yours = call("route", route, logits, 2)[1].reshape(-1)
    return call("route", split_sizes, yours, E, 2)[2], target


def route(route: Callable, split_sizes: Callable) -> None:
    """``route`` on 6 cases (k = 1 to 4) against torch's softmax and top-k, weights and their gradient;
    ``split_sizes`` on 6 cases (ep = 1, 2, 4, 8, experts nobody chose, a rank receiving nothing)."""
    what = "route"
    require_own(what, LIBRARY, route, split_sizes)
    route, split_sizes = watched(route, *LIBRARY), watched(split_sizes, *LIBRARY)
    gen = torch.Generator().manual_seed(0)
    for E_, k, shape in ROUTE_CASES:
        _check_route_case(what, route, E_, k, shape, gen)
    for expert, ep, label in _split_cases():
        _check_split_case(what, split_sizes, expert, ep, label)
    yours, target = _lab_routing(route, split_sizes)
    if yours != target:
        failed(what, f"{MODEL}'s routing at ep = 2: rank 0 sends {yours}, target {target}")
    results["route"] = {"send": yours}
    passed(what, f"torch's top-k routing on {len(ROUTE_CASES)} cases (k = 1 raw, k > 1 renormalised; the gradient "
                 "to the logits); split sizes for ep = 1, 2, 4, 8, with experts and a rank receiving nothing; "
                 + figures(f"rows rank 0 sends to ranks 0, 1 ({MODEL}, block 1, {BATCH // 2}x{SEQ} tokens)",
                           yours, target))


# -- exercise 2: the dispatch, on 2 ranks ---------------------------------------------------------------------
def _assignments(ep: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per source rank s: x_s (TOKENS, D), token_s and expert_s (the kept assignments, token by token): K
    distinct experts per token, skewed (the last rank prefers rank 0's experts: uneven splits), expert E-1
    never chosen, every 7th assignment dropped (as a capacity factor would)."""
    out = []
    for s in range(ep):
        gen = torch.Generator().manual_seed(11 + s)
        x = torch.randn(TOKENS, D, generator=gen)
        p = torch.ones(E)
        p[E - 1] = 0.0
        if s == ep - 1:
            p[:E // ep] *= 4.0
        experts = torch.stack([torch.multinomial(p, K, replacement=False, generator=gen) for _ in range(TOKENS)])
        token = torch.arange(TOKENS).repeat_interleave(K)
        keep = torch.ones(TOKENS * K, dtype=torch.bool)
        keep[3::7] = False
        out.append((x, token[keep], experts.reshape(-1)[keep]))
    return out


def _coef() -> torch.Tensor:
    """A fixed vector per expert: the check's loss is sum over received rows of row . coef[its expert]."""
    return torch.randn(E, D, generator=torch.Generator().manual_seed(5))


def _reference_rows(ep: int, r: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """For each of rank r's experts: its rows grouped (source by source, token order), and per source."""
    routing = _assignments(ep)
    n_local = E // ep
    grouped, by_source = [], []
    for e in range(r * n_local, (r + 1) * n_local):
        parts = [x[token[expert == e]] for x, token, expert in routing]
        grouped.append(torch.cat(parts))
        by_source.append(parts)
    return grouped, by_source


def _spans(tracer: trace.Tracer) -> list[tuple]:
    return [(s.args.get("phase"), s.name, s.args.get("dtype"), int(s.args["bytes"]), int(s.args["ring_bytes"]))
            for s in tracer.trace.comm_spans()]


def _dispatch_worker(dispatch: Callable) -> dict:
    torch.set_num_threads(1)
    r, n, device = dist.rank(), dist.world_size(), dist.device()
    x_cpu, token, expert = _assignments(n)[r]
    x = x_cpu.to(device).requires_grad_()
    token, expert = token.to(device), expert.to(device)
    n_local = E // n
    out: dict[str, Any] = {}
    with trace.Tracer(rank=r) as tracer:
        with comm.annotate(phase="forward"), Wire(*LIBRARY):
            got = dispatch(x, token, expert, E, None)
        if not (isinstance(got, tuple) and len(got) == 3):
            return {"bad": f"dispatch returned {type(got).__name__}: return (rows, per_expert, plan)"}
        rows, per_expert, _ = got
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != D:
            return {"bad": f"rows must be a (rows, {D}) tensor, one row of x per assignment received; got "
                           f"{tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__}"}
        if not _is_int_list(per_expert) or len(per_expert) != n_local or sum(per_expert) != rows.shape[0]:
            return {"bad": f"per_expert = {per_expert!r}: a list of {n_local} ints (rows for each of this rank's "
                           f"{n_local} experts) adding up to the {rows.shape[0]} rows received"}
        local = torch.repeat_interleave(torch.arange(n_local) + r * n_local, torch.tensor(per_expert))
        loss = (rows * _coef()[local].to(device)).sum()
        if rows.grad_fn is None:
            out["backward_error"] = "no_graph"
        else:
            try:
                with comm.annotate(phase="backward"), Wire(*LIBRARY):
                    loss.backward()
            except (LibraryShortcut, NotImplementedError):
                raise
            except Exception as err:  # noqa: BLE001 - the learner's backward: said in one line by the check
                out["backward_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    out.update(rows=rows.detach().cpu(), per_expert=list(per_expert), spans=_spans(tracer),
               grad=None if x.grad is None else x.grad.cpu())
    # The library's exchange of the same rows, measured the same way: its bytes beside the learner's.
    with trace.Tracer(rank=r) as lib:
        from ..expert_parallel import all_to_all, exchange_counts
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=E)
        received = exchange_counts(counts)
        moved = all_to_all(x.detach()[token[order]].requires_grad_(), received.sum(1).tolist(),
                           counts.view(n, -1).sum(1).tolist())
        moved.sum().backward()
    out["library"] = _spans(lib)
    return out


def _formula(ep: int, r: int, d: int, counts: torch.Tensor) -> dict[str, int]:
    from ..expert_parallel import moe_all_to_all_bytes
    return moe_all_to_all_bytes(counts, r, d)


def dispatch(dispatch: Callable, all_to_all_cls: Any) -> None:
    """2 ranks, 10 tokens each with uneven routing (an expert nobody picks, dropped assignments): the rows each
    rank's experts receive, grouped by expert, against one process's; x's gradient through the learner's
    backward; one counts and one rows all-to-all forward, one backward, with the formula's bytes."""
    what = "dispatch"
    require_own(what, LIBRARY, dispatch, all_to_all_cls)
    n = check_world(RANKS)
    res = _run(what, _dispatch_worker, n, dispatch)
    routing = _assignments(n)
    counts = torch.stack([torch.bincount(expert, minlength=E) for _, _, expert in routing])   # (ep, E)
    coef = _coef()
    for r, out in enumerate(res):
        if "bad" in out:
            failed(what, f"rank {r}: {out['bad']}")
        grouped, by_source = _reference_rows(n, r)
        want_per = [g.shape[0] for g in grouped]
        if out["per_expert"] != want_per:
            failed(what, f"rank {r}: per_expert = {out['per_expert']}, target {want_per}: the rows every rank sends "
                         "to each of this rank's experts")
        rows, want = out["rows"], torch.cat(grouped)
        if rows.shape != want.shape or not torch.allclose(rows, want, atol=ATOL, rtol=RTOL):
            arrival = torch.cat([torch.cat([parts[s] for parts in by_source]) for s in range(n)])
            if rows.shape == arrival.shape and torch.allclose(rows, arrival, atol=ATOL, rtol=RTOL):
                why = ("those are the rows as they arrived, source by source: group them by local expert (expert "
                       "l's rows together, l = 0, 1, ...), each source's rows still in token order")
            elif rows.shape == want.shape and torch.allclose(rows.sort(0).values, want.sort(0).values):
                why = ("the right rows in another order: expert by expert, each expert's rows from rank 0 first, "
                       "each source's in token order (a stable sort keeps it)")
            else:
                why = ("they are not x[token] of the assignments routed to its experts: send x[token] sorted by "
                       "expert, with send[j] rows to rank j and each rank's counts telling it what arrives")
            failed(what, f"rank {r}: the rows received for its experts differ from one process's: {why}")
    for r, out in enumerate(res):
        x, token, expert = routing[r]
        want_grad = torch.zeros(TOKENS, D).index_add(0, token, coef[expert])
        error = out.get("backward_error")
        if error == "no_graph":
            failed(what, f"rank {r}: the rows have no autograd history: send them with your AllToAll (.apply), so "
                         "backward can send their gradients home")
        if error:
            sentence = _translate("combine", error) if "split_sizes" in error else _translate(what, error)
            failed(what, f"rank {r}: your AllToAll's backward raised {error}: " + (
                sentence or "the gradient of what arrived goes back to where it came from, the same exchange with "
                            "the split sizes swapped"))
        if out["grad"] is None or not torch.allclose(out["grad"], want_grad, atol=ATOL, rtol=RTOL):
            failed(what, f"rank {r}: x's gradient differs from one process's: backward must send each received "
                         "row's gradient back to the rank that sent the row (the split sizes swap places)")
    targets = []
    for r, out in enumerate(res):
        formula = _formula(n, r, D, counts)
        spans = out["spans"]
        forward = [s for s in spans if s[0] == "forward"]
        backward = [s for s in spans if s[0] == "backward"]
        if any(s[1] != "all_to_all" for s in spans):
            ops = sorted({s[1] for s in spans})
            failed(what, f"rank {r}: the dispatch called {ops}: it needs all-to-alls only (one for the counts, one "
                         "for the rows; backward one)")
        rows_fw = [s for s in forward if s[2] != "int64"]
        counts_fw = [s for s in forward if s[2] == "int64"]
        if len(counts_fw) != 1 or counts_fw[0][3] != E * 8:
            failed(what, f"rank {r}: {len(counts_fw)} all-to-all(s) of int64 counts, {sum(s[3] for s in counts_fw)} B: "
                         f"one all-to-all of this rank's E = {E} counts ({E * 8} B) tells every rank what it receives")
        if len(rows_fw) != 1 or len(backward) != 1:
            failed(what, f"rank {r}: {len(rows_fw)} all-to-all(s) of rows forward and {len(backward)} backward: one "
                         "each way (all the rows in one call, with split sizes)")
        got = {"counts": counts_fw[0][4], "dispatch": rows_fw[0][4], "backward": backward[0][4]}
        want = {"counts": formula["counts"], "dispatch": formula["dispatch"], "backward": formula["combine"]}
        if got != want:
            failed(what, f"rank {r}: sent {got} B, target {want} B (moe_all_to_all_bytes of the routing): send each "
                         "row once, to the rank of its expert")
        targets.append((got, want, sum(s[4] for s in out["library"])))
    got, want, library = targets[0]
    results["dispatch"] = {"bytes": [t[0] for t in targets], "targets": [t[1] for t in targets]}
    passed(what, f"one process's rows for each expert at {n} ranks (uneven splits, an expert nobody picks), grouped "
                 "by expert; x's gradient through your backward; "
                 + figures("rank 0's ring bytes (counts + rows forward + rows backward)", sum(got.values()),
                           sum(want.values()), library, unit="B"))


# -- exercise 3: the combine and the gradients, on 2 ranks ----------------------------------------------------
def _layer_input(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, 32, generator=gen), torch.randn(BATCH, SEQ, 32, generator=gen)


def _err(a: torch.Tensor | None, b: torch.Tensor) -> float:
    return math.inf if a is None or a.shape != b.shape else (a.detach().cpu() - b.detach().cpu()).abs().max().item()


def _layer_case(expert_parallel: Callable, capacity: float | None) -> dict:
    """One MoE layer (block 1 of the lab's model) on this rank's sequences against models.MoE on the batch."""
    r, n, device = dist.rank(), dist.world_size(), dist.device()
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    full = models.build_model(MODEL, n_layer=LAYERS, capacity_factor=capacity).to(device)
    copied = copy.deepcopy(full)
    with Wire(*LIBRARY):
        mine = expert_parallel(copied).blocks[1].mlp
    ref = full.blocks[1].mlp
    h, up = (t.to(device) for t in _layer_input(7))
    h_full, h_mine = h.clone().requires_grad_(), h[rows].clone().requires_grad_()
    y_full = ref(h_full)
    (y_full * up).sum().backward()
    with Wire(*LIBRARY):
        y = mine(h_mine)
    if not isinstance(y, torch.Tensor) or y.shape != h_mine.shape:
        return {"bad": f"the layer returned {tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}"
                       f", expected {tuple(h_mine.shape)}: combine returns (n_tokens, d)"}
    backward_error = None
    if y.requires_grad:
        with Wire(*LIBRARY):
            (y * up[rows]).sum().backward()
    else:
        backward_error = "no_graph"
    router = mine.router.weight.grad
    router = torch.zeros_like(ref.router.weight) if router is None else router.clone()
    comm.all_reduce(router)                            # the router is replicated: its gradient is the ranks' sum
    experts = {e: max(_err(p.grad, ref.experts[int(e)].get_parameter(k).grad) for k, p in m.named_parameters())
               for e, m in mine.experts.items()}
    # alternatives a learner's mistake may produce: outputs not mixed by the weights
    with torch.no_grad():
        probs, idx, w = models.top_k_routing(ref.router(h), ref.top_k)
        keep = torch.ones_like(idx, dtype=torch.bool) if capacity is None else models.capacity_mask(
            idx, ref.n_expert, models.expert_capacity(SEQ, ref.top_k, ref.n_expert, capacity))
        token = torch.arange(BATCH * SEQ, device=device).repeat_interleave(ref.top_k)[keep.reshape(-1)]
        unweighted = ref.apply_experts(h.reshape(-1, h.shape[-1]), token, idx[keep], torch.ones_like(w[keep]))
    return {"out": _err(y, y_full[rows]), "unweighted": _err(y, unweighted.view_as(h)[rows]),
            "dx": _err(h_mine.grad, h_full.grad[rows]), "experts": experts, "backward_error": backward_error,
            "router": _err(router, ref.router.weight.grad), "dropped": int(ref.dropped_per_expert.sum())}


def _named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: None if p.grad is None else p.grad.detach().cpu().clone() for k, p in model.named_parameters()}


def _train_case(expert_parallel: Callable, sync_gradients: Callable) -> dict:
    """Two AdamW steps of the lab's model: the learner's expert-parallel model on this rank's sequences, one
    process on the whole batch; the library's ExpertParallelMoE for the bytes beside the learner's."""
    r, n, device = dist.rank(), dist.world_size(), dist.device()
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    full = models.build_model(MODEL, n_layer=LAYERS).to(device)
    mine = models.build_model(MODEL, n_layer=LAYERS).to(device)
    with Wire(*LIBRARY):
        mine = expert_parallel(mine)
    lib = _ep_gpt.expert_parallel_gpt(models.build_model(MODEL, n_layer=LAYERS)).to(device)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (full, mine)]
    out: dict[str, Any] = {"steps": [], "names": sorted(k for k, _ in mine.named_parameters())}
    for step in range(STEPS):
        x, y = (t.to(device) for t in data.get_batch(step, BATCH, SEQ))
        loss_full = models.lm_loss(full(x), y) + full.aux_loss()
        loss_full.backward()
        with trace.Tracer(rank=r) as tracer:
            with Wire(*LIBRARY):
                loss = models.lm_loss(mine(x[rows]), y[rows]) + mine.aux_loss()
                loss.backward()
            before = _named_grads(mine)
            with Wire(*LIBRARY):
                sync_gradients(mine, None)
        moes = [m for m in mine.modules() if isinstance(m, models.MoE)]
        kept = [(m.tokens_per_expert - m.dropped_per_expert).to(device) for m in moes]
        gathered = [comm.all_gather(k_.unsqueeze(0)).cpu() for k_ in kept]   # (ep, E) per layer, for the formula
        mean = loss.detach().reshape(1).clone()
        comm.all_reduce(mean)
        full_grads = _named_grads(full)
        out["steps"].append({"loss": mean.item() / n, "loss_full": loss_full.item(), "grads": _named_grads(mine),
                             "before": before, "full": {k: full_grads[k] for k in before},
                             "ring": sum(s[4] for s in _spans(tracer) if s[1] == "all_to_all"),
                             "ops": sorted({s[1] for s in _spans(tracer)}), "kept": gathered})
        if step == 0:
            with trace.Tracer(rank=r) as lib_tracer:
                (models.lm_loss(lib(x[rows]), y[rows]) + lib.aux_loss()).backward()
            out["library_ring"] = sum(s[4] for s in _spans(lib_tracer) if s[1] == "all_to_all")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    full_params = dict(full.named_parameters())
    out["params"] = max(_err(p, full_params[k]) for k, p in mine.named_parameters())
    return out


def _combine_worker(expert_parallel: Callable, sync_gradients: Callable) -> dict:
    torch.set_num_threads(1)
    out = {"layer": {cf: _layer_case(expert_parallel, cf) for cf in (None, CAPACITY)}}
    if any("bad" in v for v in out["layer"].values()):
        return out
    out["train"] = _train_case(expert_parallel, sync_gradients)
    return out


def _layer_verdict(n: int, r: int, cf: float | None, o: dict) -> None:
    what = "combine"
    label = f"{n} ranks, rank {r}, one MoE layer, " + ("dropless" if cf is None else f"capacity factor {cf}")
    if "bad" in o:
        failed(what, f"{label}: {o['bad']}")
    if o["out"] > ATOL * 10:
        if o["unweighted"] <= ATOL * 10:
            why = "the outputs are not mixed by the router's weights: y[t] adds weight x output over t's assignments"
        else:
            why = ("back home the rows come in the order dispatch sent them (sorted by expert): undo the grouping "
                   "before the reverse all-to-all, and take token and weight in that same order")
        failed(what, f"{label}: the output differs from one process's by {o['out']:.2g}: {why}")
    if o["backward_error"] == "no_graph":
        failed(what, f"{label}: the output has no autograd history: send the rows home with your AllToAll (.apply)")
    worst_expert = max(o["experts"].values())
    if worst_expert > ATOL * 10:
        how = "got no gradient" if math.isinf(worst_expert) else f"differ by {worst_expert:.2g}"
        failed(what, f"{label}: this rank's experts' gradients {how} (one process's as target): the reverse exchange "
                     "must be differentiable (your AllToAll), so that backward brings every rank's output gradients "
                     "to the experts")
    if o["dx"] > ATOL * 10:
        failed(what, f"{label}: the layer's input gradient differs from one process's by {o['dx']:.2g}: it must come "
                     "back through both all-to-alls (AllToAll's backward)")
    if o["router"] > ATOL * 10:
        failed(what, f"{label}: the router's gradient differs from one process's by {o['router']:.2g}: it reaches "
                     "the router through the weights: keep them in the graph")


def _train_verdict(n: int, r: int, o: dict) -> float:
    what = "combine"
    worst = 0.0
    for step, s in enumerate(o["steps"]):
        label = f"{n} ranks, rank {r}, step {step} of {MODEL}"
        if abs(s["loss"] - s["loss_full"]) > RTOL * abs(s["loss_full"]):
            failed(what, f"{label}: the mean loss over the ranks {s['loss']:.6f}, one process {s['loss_full']:.6f}")
        for k, want in s["full"].items():
            got, before = s["grads"][k], s["before"][k]
            err = _err(got, want)
            worst = max(worst, err)
            if err <= ATOL * 10:
                continue
            expert = ".experts." in k
            if got is None:
                why = "it has no gradient"
            elif before is not None and _err(got, before) == 0:
                why = ("sync_gradients left it as backward made it: " + (
                       "an expert's gradient covers every rank's tokens, and the loss is the mean over the ranks: "
                       "divide by ep" if expert else "it covers this rank's sequences only: average over the ranks"))
            elif before is not None and _err(got, before * n) <= ATOL * 10 * n:
                why = ("it is ep x backward's: an expert's gradient already holds every rank's tokens; it needs only "
                       "the 1/ep of the mean" if expert else "all-reduce SUMS: divide by the number of ranks")
            elif expert:
                why = ("an expert is a different parameter on every rank (rank 0's expert 0, rank 1's expert 4): "
                       "all-reducing them adds two experts together. Its gradient is already complete here")
            elif _err(got, want * n) <= ATOL * 10 * n:
                why = "it is ep x the target: all-reduce SUMS: divide by the number of ranks"
            else:
                why = "the global batch's gradient is the mean over the ranks of their gradients"
            failed(what, f"{label}: {k}'s gradient after sync_gradients differs from one process's by {err:.2g}: "
                         f"{why}")
    if o["params"] > ATOL * 10:
        failed(what, f"{n} ranks, rank {r}: the parameters after {STEPS} AdamW steps differ from one process's by "
                     f"{o['params']:.2g}")
    return worst


def combine(expert_parallel: Callable, combine: Callable, sync_gradients: Callable) -> None:
    """2 ranks: one MoE layer (dropless, and with capacity factor 1.0) and 2 AdamW steps of gpt-moe-tiny
    through the learner's layers and sync_gradients, against one process; bytes against the formula."""
    what = "combine"
    require_own(what, LIBRARY, expert_parallel, combine, sync_gradients)
    n = check_world(RANKS)
    res = _run(what, _combine_worker, n, expert_parallel, sync_gradients)
    for r, out in enumerate(res):
        for cf, o in out["layer"].items():
            _layer_verdict(n, r, cf, o)
    worst = max(_train_verdict(n, r, out["train"]) for r, out in enumerate(res))
    ring, target = [], []
    for r, out in enumerate(res):
        step = out["train"]["steps"][0]
        if set(step["ops"]) - {"all_reduce", "all_to_all"}:
            failed(what, f"rank {r}: a step called {step['ops']}: the layers exchange rows by all-to-all, and "
                         "sync_gradients all-reduces")
        formula = [_formula(n, r, 32, kept) for kept in step["kept"]]
        want = sum(f["counts"] + 2 * (f["dispatch"] + f["combine"]) for f in formula)
        if step["ring"] != want:
            failed(what, f"rank {r}: the MoE layers sent {step['ring']:,} B of all-to-alls in a step, target {want:,} B "
                         "(per layer: the counts, dispatch and combine, and both again in backward): each row once "
                         "each way")
        ring.append(step["ring"])
        target.append(want)
    dropped = res[0]["layer"][CAPACITY]["dropped"]
    results["combine"] = {"ring": ring, "target": target, "library": [out["train"]["library_ring"] for out in res]}
    passed(what, f"one process's MoE layer at {n} ranks (outputs, input, expert and router gradients; dropless and "
                 f"with capacity factor {CAPACITY}: {dropped} assignments dropped) and {STEPS} AdamW steps of "
                 f"{MODEL} (loss, gradients, parameters; max |diff| {worst:.1e}); "
                 + figures("rank 0's all-to-all bytes per step", ring[0], target[0], res[0]["train"]["library_ring"],
                           unit="B"))
