"""Checks of lab 12 (the capstone): the layout chosen under a memory cap, an atomic multi-rank save that
survives a rank killed in the middle of it, and the test that a resumed run continued exactly.

::

    from minifsdp.labcheck import lab12 as check
    check.choose_layout(choose_layout, CANDIDATES, MODEL, B, T, CAP, calibration)
    check.atomic_save(save, load_latest)
    check.resume_exact(first_divergence, f"{OUT}/A", f"{OUT}/C")
    check.hint("save")                    # the next hint for an exercise, idea first

``choose_layout`` prices the candidates itself with ``minifsdp.planner`` (and the learner's calibration)
under the lab's cap and three more (every candidate fits, one fits, none fits), with one candidate the
planner refuses added (``tp = 3``: to be skipped), and holds the learner's choice to the fastest predicted
layout that fits, or a ``ValueError`` naming the smallest peak.

``atomic_save`` runs the learner's ``save`` and ``load_latest`` on 2 ranks (CPU ranks where the machine
has fewer GPUs): ``(0, None)`` before the first save; steps 1-3 saved keeping 2, the newest loaded on every
rank. Then, in a second launch, rank 1 is killed (SIGKILL) inside its ``torch.save`` of step 4, before it
writes, half a second after rank 0 wrote its own file (time enough for a save without a barrier to
commit). After the kill no folder named ``step_4`` may exist, ``latest`` must still name ``step_3``
(``step_2`` and ``step_3`` remain), and a third launch must load step 3 on every rank: the trainer's
contract (``minifsdp.save_resume``: ``step_N.tmp``, one rename, ``latest``).

``resume_exact`` runs the learner's ``first_divergence`` on seven cases with known answers (aligned by
step number, a relative tolerance, the step returned rather than a position, a resumed run longer than
the reference), then on the lab's runs (the trainer's ``metrics.json`` in each run's folder): the resumed
run must continue the uninterrupted one bit for bit.

Authorship: ``atomic_save`` refuses ``minifsdp.save_resume`` (its atomic write, commit, resolve and
Checkpointer) and ``torch.distributed.checkpoint``'s save and load, statically and at run time (a
:class:`~minifsdp.labcheck.authorship.Wire` around the learner's code in each worker). The library has no
layout chooser and no resume comparison: the planner is the tool exercise 1 uses, and exercise 3's only
shortcut would be the check's own arithmetic, which is not a ``check.*`` name.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import types
from typing import Any, Callable

import torch

from .. import dist, planner, save_resume
from ..estimate import format_bytes
from ..launch import LaunchError, launch
from .authorship import Wire
from .verdict import CheckFailed, Hints, call, failed, figures, passed, require_own, require_written, run

__all__ = ["choose_layout", "atomic_save", "resume_exact", "hint", "SAVE_LIBRARY"]


def _functions(module: types.ModuleType) -> list[Any]:
    """The functions and classes ``module`` defines itself (not what it imports)."""
    return [v for v in vars(module).values()
            if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) == module.__name__]


def _dcp() -> tuple:
    import torch.distributed.checkpoint as dcp
    return (dcp.save, dcp.load)


# The library's save and resume: what exercise 2 builds (an atomic, multi-rank checkpoint and its pointer).
SAVE_LIBRARY = (*_functions(save_resume), *_dcp())

hint = Hints({
    "choose_layout": [
        "Three steps: price every candidate (planner.plan with its keywords and the calibration), keep the "
        "ones whose plan fits under the cap, then take the smallest predicted step (plan.time.step_s).",
        "Return a pair: the candidate's name (a key of candidates) and its plan.",
        "When nothing fits, the learner's next question is how far off: name the candidate with the "
        "smallest peak (plan.total_memory) in the ValueError's message.",
    ],
    "save": [
        "A rank may die at any moment. What must be true of the folder a loader finds, whenever that is?",
        "Write into a folder no loader reads (step_N.tmp); wait until every rank has written its file; "
        "then one rank makes it real with a single rename, which the file system does all at once.",
        "latest is a file holding a folder's name. Replace it the same way: write a new file aside, rename "
        "it over the old one. Then make every rank wait for the commit before going on.",
    ],
    "load_latest": [
        "Do not list the folders: a half-written one may be among them. Read the pointer.",
        "The step is in the folder's name; this rank's file is rank{r}.pt inside it (dist.rank()).",
    ],
    "first_divergence": [
        "resumed[0] is the loss of step first_step, not of step 0: compare it with reference[first_step].",
        "Within rtol means |resumed - reference| <= rtol x |reference|: relative to the reference's loss.",
        "Return the step number (first_step + the position), and raise when the resumed run goes past the "
        "last step of the reference.",
    ],
})


# -- exercise 1: the layout under a cap, in this process -----------------------------------------------------
REFUSED = ("tp3", {"tp": 3})    # a candidate the planner refuses (a GPT's heads do not divide by 3)


def _refusal(model: str, batch: int, seq_len: int) -> str:
    """The planner's message refusing the REFUSED candidate."""
    try:
        planner.plan(model, batch=batch, seq_len=seq_len, **REFUSED[1])
    except ValueError as err:
        return str(err)
    raise AssertionError(f"the planner accepts {REFUSED}: pick a candidate it refuses")


def _attempt(what: str, fn: Callable, *args: Any) -> tuple[str, Any]:
    """("returned", value) or ("raised", the ValueError): a ValueError is an answer here, not a crash."""
    try:
        return "returned", fn(*args)
    except ValueError as err:
        return "raised", err
    except NotImplementedError as err:
        failed(what, f"not written yet (it raised NotImplementedError): {err}")
    except Exception as err:  # noqa: BLE001 - the learner's code: say what it raised, in one line
        failed(what, f"your code raised {type(err).__name__}: {err}")
    raise AssertionError("unreachable")


def choose_layout(fn: Callable, candidates: dict[str, dict], model: str, batch: int, seq_len: int,
                  cap_bytes: float, calibration: Any) -> None:
    """The learner's ``choose_layout`` under ``cap_bytes`` and three more caps, against the planner's prices."""
    what = "choose_layout"
    require_written(what, fn)
    plans = {name: planner.plan(model, batch=batch, seq_len=seq_len, calibration=calibration, **kw)
             for name, kw in candidates.items()}
    candidates = {**candidates, REFUSED[0]: REFUSED[1]}             # the planner refuses it: to be skipped
    refusal = _refusal(model, batch, seq_len)
    peaks = sorted(p.total_memory for p in plans.values())
    caps = [cap_bytes, 2 * peaks[-1], peaks[0], peaks[0] / 2]      # the lab's; all fit; the smallest fits; none
    answers: dict[float, tuple[str, str]] = {}
    for cap in caps:
        fitting = {n: p for n, p in plans.items() if p.fits(cap)}
        kind, got = _attempt(what, fn, candidates, model, batch, seq_len, cap, calibration)
        under = f"under {format_bytes(cap)}"
        if kind == "raised" and str(got) == refusal:
            failed(what, f"{under} the planner refused the candidate {REFUSED[0]} ({REFUSED[1]}) and your code let "
                         f"its ValueError through ({str(got)[:70]}): skip a candidate the planner refuses")
        if not fitting:
            smallest = min(plans, key=lambda n: plans[n].total_memory)
            if kind == "returned":
                failed(what, f"{under} no candidate fits (the smallest peak is {smallest}'s "
                             f"{format_bytes(plans[smallest].total_memory)}), yet you returned {got!r:.60}: "
                             "raise a ValueError")
            if smallest not in str(got):
                failed(what, f"{under} nothing fits and you raised ValueError({str(got)!r:.80}): name the smallest "
                             f"peak in it ({smallest}'s {format_bytes(plans[smallest].total_memory)}), the "
                             "learner's next question")
            continue
        target = min(fitting, key=lambda n: fitting[n].time.step_s)
        if kind == "raised":
            failed(what, f"you raised ValueError {under}, but {', '.join(fitting)} fit(s) (e.g. {target}: peak "
                         f"{format_bytes(fitting[target].total_memory)})")
        if not (isinstance(got, tuple) and len(got) == 2 and got[0] in plans):
            failed(what, f"return a pair (name, plan), the name a key of candidates; got {got!r:.80}")
        name, plan = got
        if name not in fitting:
            failed(what, f"{under} you chose {name}, whose predicted peak {format_bytes(plans[name].total_memory)} "
                         "is above the cap: keep only the layouts that fit")
        if name != target:
            failed(what, f"{under} {name} fits, but {target} is predicted faster "
                         f"({fitting[target].time.step_s * 1e3:.1f} ms against {fitting[name].time.step_s * 1e3:.1f}"
                         " ms): the fastest that fits")
        if getattr(plan, "total_memory", None) != plans[name].total_memory or getattr(plan, "time", None) is None:
            failed(what, f"{under} the plan you returned is not {name}'s plan with the calibration (planner.plan("
                         "..., calibration=calibration)): it must carry its predicted step")
        answers.setdefault(cap, (name, target))
    if cap_bytes not in answers:  # the lab's cap fits nothing: the ValueError was the answer
        passed(what, f"{len(caps)} caps; under {format_bytes(cap_bytes)} nothing fits, and you said so")
        return
    yours, target = answers[cap_bytes]
    passed(what, figures(f"layout under {format_bytes(cap_bytes)}", yours, target) +
           f"; peak {format_bytes(plans[target].total_memory)}, predicted step "
           f"{plans[target].time.step_s * 1e3:.1f} ms; {len(caps)} caps, one with nothing fitting")


# -- exercise 2: an atomic save, a rank killed in the middle -------------------------------------------------
def _state(step: int) -> dict[str, torch.Tensor]:
    """What rank r saves at ``step``: tensors that tell the rank and the step apart."""
    r = dist.rank()
    return {"weight": torch.full((3, 2), 10.0 * r + step), "step": torch.tensor(step)}


def _save_three(save: Callable, load_latest: Callable, root: str) -> tuple:
    """load_latest before any save; steps 1-3 saved, keeping 2; the newest loaded."""
    with Wire(*SAVE_LIBRARY):
        empty = load_latest(root)
        for step in (1, 2, 3):
            save(_state(step), root, step, 2)
        return empty, load_latest(root)


def _killed_while_saving(save: Callable, root: str) -> None:
    """Rank 1 dies inside its torch.save of step 4, before writing, half a second after rank 0 wrote its file."""
    if dist.rank() == 1:
        def die(*args: Any, **kwargs: Any) -> None:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = die
    with Wire(*SAVE_LIBRARY):
        save(_state(4), root, 4, 2)


def _load(load_latest: Callable, root: str) -> tuple:
    with Wire(*SAVE_LIBRARY):
        return load_latest(root)


def _same_state(got: Any, step: int, rank: int) -> bool:
    want = {"weight": torch.full((3, 2), 10.0 * rank + step), "step": torch.tensor(step)}
    return (isinstance(got, dict) and set(got) == set(want)
            and all(torch.equal(got[k].cpu(), v) for k, v in want.items()))


def _check_loaded(what: str, loaded: list, step: int, when: str) -> None:
    for rank, got in enumerate(loaded):
        if not (isinstance(got, tuple) and len(got) == 2):
            failed(what, f"load_latest returned {got!r:.80} on rank {rank}: return (step, this rank's state)")
        if got[0] != step:
            failed(what, f"{when}, load_latest gave step {got[0]!r} on rank {rank}; the newest complete checkpoint "
                         f"is step {step}")
        if not _same_state(got[1], step, rank):
            failed(what, f"{when}, rank {rank} loaded a state that is not the one it saved at step {step} (another "
                         "rank's file, or another step's): each rank reads its own rank{r}.pt")


def _latest(root: str) -> str | None:
    path = os.path.join(root, "latest")
    return open(path).read().strip() if os.path.isfile(path) else None


def _folders(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if d.startswith("step_"))


def atomic_save(save: Callable, load_latest: Callable) -> None:
    """Steps 1-3 saved (keeping 2) and loaded on 2 ranks; rank 1 killed while saving step 4; step 3 still loads."""
    what = "atomic_save"
    require_own(what, SAVE_LIBRARY, save, load_latest)
    root = tempfile.mkdtemp(prefix="lab12-save-")
    try:
        results = run(what, _save_three, 2, save, load_latest, root, timeout=60)
    except CheckFailed as err:
        if "does not exist" in str(err) or "No such file" in str(err):  # a rank wrote where another had renamed
            failed(what, "a rank found its checkpoint's folder gone while saving: rank 0 renamed it before every "
                         f"rank had written its file; wait for every rank first ({str(err).split(': ', 2)[-1][:90]})")
        raise
    for rank, (empty, _) in enumerate(results):
        if empty != (0, None):
            failed(what, f"before any save, load_latest returned {empty!r:.80} on rank {rank}: return (0, None), "
                         "a fresh start")
    if _latest(root) != "step_3":
        failed(what, f"after saving steps 1-3, {root}/latest holds {_latest(root)!r}: it must hold the newest "
                     "complete checkpoint's folder name, 'step_3'")
    if any(d.endswith(".tmp") for d in _folders(root)):
        failed(what, f"after saving steps 1-3 the folder holds {_folders(root)}: a rank wrote into a .tmp folder "
                     "rank 0 had already renamed, so rank 0 committed before every rank had written its file; "
                     "wait for every rank first")
    if _folders(root) != ["step_2", "step_3"]:
        failed(what, f"after saving steps 1-3 with keep=2 the folder holds {_folders(root)}: keep the newest 2 "
                     "complete checkpoints (step_2, step_3), nothing else")
    _check_loaded(what, [loaded for _, loaded in results], 3, "after saving steps 1-3")
    try:
        launch(_killed_while_saving, 2, save, root, timeout=30)
    except LaunchError as err:
        first = str(err).splitlines()[0]
        if "SIGKILL" not in first:
            failed(what, f"saving step 4 failed before the check killed rank 1: {first[:200]}")
    else:
        failed(what, "the check killed rank 1 inside its torch.save of step 4, yet every rank finished: write "
                     "each rank's state with torch.save, as the exercise says")
    if os.path.exists(os.path.join(root, "step_4")):
        failed(what, "rank 1 died before writing its file, yet a folder named step_4 exists: a half checkpoint "
                     "under a complete one's name. Write aside, and rename only once every rank has written its file")
    if _latest(root) != "step_3":
        failed(what, f"rank 1 died while saving step 4 and latest now holds {_latest(root)!r}: it may move only "
                     "once the new checkpoint is complete (every rank's file, then the rename)")
    if not {"step_2", "step_3"} <= set(_folders(root)):
        failed(what, f"rank 1 died while saving step 4 and only {_folders(root)} remain: delete old checkpoints "
                     "only once the new one is complete")
    try:
        again = launch(_load, 2, load_latest, root, timeout=60)
    except LaunchError as err:
        failed(what, f"after the kill, load_latest raised ({str(err).splitlines()[0][:150]}): did it read a "
                     "half-written folder? Trust the pointer, latest")
    _check_loaded(what, again, 3, "after rank 1 was killed saving step 4")
    passed(what, figures("step loaded after a kill during step 4's save", 3, 3) +
           "; no step_4 folder, latest still names step_3, every rank reads its own state, 2 kept")


# -- exercise 3: did the resume continue exactly? ----------------------------------------------------------
REFERENCE = [5.0, 4.0, 3.0, 2.0]
CASES = (  # (resumed, first_step, rtol, expected: a step, None, or ValueError), why
    (([3.0, 2.0], 2, 0.0, None), "a resumed run equal to the reference from step 2"),
    (([3.0, 2.0000002], 2, 0.0, 3), "a loss off in the 7th digit at step 3 (rtol 0: bit for bit)"),
    (([3.0, 2.0000002], 2, 1e-5, None), "the same within rtol 1e-5"),
    (([4.0, 3.0, 2.0], 1, 0.0, None), "a resume from step 1"),
    (([3.0, 2.5], 2, 1e-5, 3), "a difference at step 3"),
    (([3.0, 2.0, 1.0], 2, 0.0, ValueError), "a resumed run past the reference's last step"),
)
LARGE = ([100.0, 50.0], [50.0004], 1, 1e-5, None)  # relative: 4e-4 <= 1e-5 x 50; an absolute test says step 1


def _verdict_for(got: Any, expected: Any, why: str, resumed: list, first_step: int) -> str | None:
    if got == expected and (got is None) == (expected is None):
        return None
    if isinstance(got, int) and expected is not None and got == expected - first_step:
        return (f"{why}: you returned {got}, the position in resumed; return the step number, first_step + "
                "the position")
    aligned = next((i for i, loss in enumerate(resumed) if loss != REFERENCE[i]), None)
    if aligned is not None and got in (aligned, first_step + aligned):
        return (f"{why}: you returned {got!r}; resumed[0] is step {first_step}'s loss: compare it with "
                "reference[first_step], not reference[0]")
    return f"{why}: you returned {got!r}, expected {expected!r}"


def _metrics(what: str, out: str) -> dict:
    """The trainer's metrics.json in the run folder ``out``."""
    path = os.path.join(out, "metrics.json")
    if not os.path.isfile(path):
        failed(what, f"no {path}: run section 2's cells (runs A and C) first")
    with open(path) as f:
        return json.load(f)


def resume_exact(fn: Callable, reference_out: str, resumed_out: str) -> None:
    """The learner's ``first_divergence`` on six cases and a relative-tolerance one, then on the lab's runs
    (their folders: the trainer's metrics.json in each)."""
    what = "first_divergence"
    require_written(what, fn)
    for (resumed, first_step, rtol, expected), why in CASES:
        if expected is ValueError:
            try:
                got = fn(list(REFERENCE), list(resumed), first_step, rtol)
            except ValueError:
                continue
            except NotImplementedError as err:
                failed(what, f"not written yet (it raised NotImplementedError): {err}")
            except Exception as err:  # noqa: BLE001 - the learner's code: say what it raised
                failed(what, f"{why}: your code raised {type(err).__name__}: {err}; raise ValueError")
            failed(what, f"{why}: you returned {got!r}; a step the reference never ran cannot be compared: raise "
                         "ValueError")
        got = call(what, fn, list(REFERENCE), list(resumed), first_step, rtol)
        verdict = _verdict_for(got, expected, why, resumed, first_step)
        if verdict:
            failed(what, verdict)
    reference, resumed, first_step, rtol, expected = LARGE
    got = call(what, fn, reference, resumed, first_step, rtol)
    if got != expected:
        failed(what, f"losses 50 and 50.0004 with rtol 1e-5: you returned {got!r}, expected None: the tolerance is "
                     "relative, |a - b| <= rtol x |reference|")
    reference_metrics, resumed_metrics = _metrics(what, reference_out), _metrics(what, resumed_out)
    losses, first = reference_metrics["losses"], resumed_metrics["first_step"]
    target = next((first + i for i, loss in enumerate(resumed_metrics["losses"]) if loss != losses[first + i]), None)
    got = call(what, fn, list(losses), list(resumed_metrics["losses"]), first, 0.0)
    if got != target:
        failed(what, f"on the lab's runs (resumed from step {first}) you returned {got!r}, expected {target!r}")
    if target is not None:
        failed(what, f"your function is right, and it shows that the resumed run diverged at step {target} "
                     f"({resumed_metrics['losses'][target - first]!r} against {losses[target]!r}): the resume did "
                     "not restore everything (parameters, optimizer state, RNG, data position)")
    passed(what, figures(f"first step that differs after resuming at step {first}", got, target) +
           f"; {len(CASES) + 1} cases")
