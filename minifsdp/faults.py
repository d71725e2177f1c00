"""Why did a run fail? One message that names the rank and the cause, for each way a rank fails.

Layer 1 (runtime), beside ``launch`` (which calls ``failure`` once its workers
are stopped) and ``flight_recorder`` (which says what collective each rank
was in). docs/faults.md has the table: each mode, how soon the run ends, the
message.

* **A rank raises**: its error once, the ranks that raised it, the line of
  *your* code (``WorkerError``). A peer's "Connection reset by peer" is a
  symptom of that failure and is reported only when nothing else failed.
* **A rank runs out of memory**: the same, plus the fix (a smaller batch,
  more sharding, activation checkpointing).
* **A rank is killed by a signal**: which signal, and what usually sends it
  (SIGKILL: the kernel's out-of-memory killer; SIGTERM: a scheduler; SIGSEGV
  and SIGABRT: native code, with the Python stack faulthandler wrote).
* **A rank is stuck while the others wait** (``LaunchTimeout`` at the
  deadline): which rank is outside any collective and where, and which
  collective the others wait in.
* **Ranks disagree** (the desync): which collective each rank was in, from
  the flight recorder — "ranks disagree: rank 0 in all_reduce #3
  (float32[4]), rank 1 in all_gather #3 (...)".

Under ``torchrun`` there is no launcher to read the ranks: ``install()`` makes
each rank print its own one-line cause to stderr when it dies of an
exception, before torchrun's failure report. ``inject(step)``, called once
per training step, fails a rank on purpose (``MINIFSDP_FAULT=RANK:MODE:STEP``)
so every mode above can be seen and tested, under ``launch`` and torchrun.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import sysconfig
import time
from typing import Any

import cloudpickle
import torch
import torch.distributed as tdist

from . import dist, flight_recorder

__all__ = ["LaunchError", "WorkerError", "LaunchTimeout", "failure", "explain_exit", "OOM_FIX", "install",
           "inject", "FAULT_ENV", "FAULT_MODES"]


class LaunchError(RuntimeError):
    """A launched run failed; the message says which rank(s) and why."""


class WorkerError(LaunchError):
    """One or more ranks failed. The message is short: each distinct cause once, with the ranks
    it hit and the line of *your* code it came from, no library frames.

    ``tracebacks`` (alias ``failures``) maps rank -> that worker's full formatted traceback (for a
    rank killed by a signal: the explanation and faulthandler's stack); ``ranks`` lists the failing
    ranks. The original exception, when it could be pickled back, is the ``__cause__``::

        >>> try:                                              # doctest: +SKIP
        ...     launch(my_exercise, 4)
        ... except WorkerError as err:
        ...     print(err)                # ranks 0-3 failed: NotImplementedError: ...
        ...     print(err.tracebacks[0])  # rank 0's whole traceback
    """

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures
        self.tracebacks = failures
        self.ranks = sorted(failures)

    def _render_traceback_(self) -> list[str]:
        # IPython/Jupyter shows this instead of a traceback through launch's internals.
        return [f"WorkerError: {self}"]


class LaunchTimeout(LaunchError, TimeoutError):
    """The deadline passed; ``running`` lists the ranks that had not finished."""

    def __init__(self, message: str, running: list[int]):
        super().__init__(message)
        self.running = running


# --------------------------------------------------------------------------
# Saying what each rank died of
# --------------------------------------------------------------------------
# Errors that a *surviving* rank raises because a peer died: symptoms, not causes.
_PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "DistBackendError",
                         "Broken pipe", "connection refused", "Socket Timeout", "ProcessGroupGloo")
_OOM_MARKERS = ("OutOfMemoryError", "out of memory", "can't allocate memory", "not enough memory")
OOM_FIX = ("fix: a smaller batch (or gradient accumulation), more sharding (ZeRO-3 / FSDP, a larger dp_shard), "
           "or activation checkpointing; minifsdp.planner predicts the peak")
_SIGNALS = {  # what usually sends each signal, said once
    signal.SIGKILL: "a kill Python cannot catch: most often the kernel's out-of-memory killer (the machine ran "
                    "out of RAM: see `dmesg`; use less memory per rank), else `kill -9` or a scheduler",
    signal.SIGTERM: "asked to stop from outside: a scheduler's time limit or preemption, `kill`, or torchrun "
                    "stopping the group",
    signal.SIGSEGV: "a segmentation fault in native code: a C++/CUDA extension or driver bug, or memory used "
                    "after it was freed",
    signal.SIGABRT: "native code gave up: gloo and NCCL abort like this when the ranks' collectives disagree "
                    "(the rank's stderr has the reason)",
    signal.SIGBUS: "a bus error: often shared memory (/dev/shm) too small, e.g. docker without --shm-size",
    signal.SIGINT: "interrupted (Ctrl-C)",
}
_CRASHES = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)


def explain_exit(exitcode: int, where: str = "") -> str:
    """'was killed by signal SIGKILL (exit code -9)<where>: <what usually sends it>' for a rank that died
    without a word; ``where`` says what it was doing (' in all_reduce #3 (float32[4])')."""
    if exitcode >= 0:
        return (f"exited with code {exitcode}{where} without reporting a result (it called os._exit or exit, "
                "or crashed)")
    try:
        sig = signal.Signals(-exitcode)
    except ValueError:
        return f"was killed by signal {-exitcode} (exit code {exitcode}){where}"
    why = _SIGNALS.get(sig)
    return f"was killed by signal {sig.name} (exit code {exitcode}){where}" + (f": {why}" if why else "")


def _is_peer_failure(outcome: tuple) -> bool:
    return outcome[1] == "error" and any(m.lower() in outcome[3].lower() for m in _PEER_FAILURE_MARKERS)


def _is_out_of_memory(message: str) -> bool:
    return any(m.lower() in message.lower() for m in _OOM_MARKERS)


def _rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 3] -> 'ranks 0-3'; [1] -> 'rank 1'; [0, 2] -> 'ranks 0, 2'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


# Frames that are not the caller's code: the launcher, torch, Python's own library (ctypes, threading, ...).
_LIBRARY = ("/minifsdp/launch.py", "/minifsdp/faults.py", "/minifsdp/flight_recorder.py", "/torch/", "site-packages",
            sysconfig.get_paths()["stdlib"] + os.sep)


def _where(frames: list[tuple[str, str, str]], skip: tuple[str, ...] = _LIBRARY) -> str:
    """' (in fn, line N of file.py)' for the innermost of ``frames`` (outermost first) outside ``skip``."""
    mine = [(f, ln, fn) for f, ln, fn in frames if not any(x in f for x in skip)]
    if not mine:
        return ""
    f, ln, fn = mine[-1]
    where = "a notebook cell" if f.startswith("<") or "ipykernel" in f else os.path.basename(f)
    return f" (in {fn}, line {ln} of {where})"


def _traceback_frames(tb: str) -> list[tuple[str, str, str]]:
    return re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb)


def _user_frame(tb: str) -> str:
    """'(in fn, line N of file)' of the innermost frame of a traceback outside launch/multiprocessing/torch."""
    return _where(_traceback_frames(tb), _LIBRARY + ("/minifsdp/",))


def _stack_frames(text: str) -> list[tuple[str, str, str]]:
    """The frames of the main thread in a faulthandler dump, outermost first (the dump is innermost first)."""
    sections = text.split("\nThread ")
    main = [s for s in sections if "_run_rank" in s] or sections[:1]
    return list(reversed(re.findall(r'File "([^"]+)", line (\d+) in (\S+)', main[0])))


def _cause(outcome: tuple, call: flight_recorder.Collective | None, stack: str) -> str:
    """What one rank died of, without its rank: 'failed: ValueError: ... (in f, line 3 of x.py)'."""
    inside = f" in {call.call()}" if call is not None and call.state == "in" else ""
    if outcome[1] == "exit":
        code = outcome[2]
        where = _where(_stack_frames(stack)) if stack and -code in _CRASHES else ""
        return explain_exit(code, f"{inside}{where}")
    message, tb = outcome[2], outcome[3]
    if _is_out_of_memory(message):
        asked = re.search(r"tried to allocate ([\d.]+ ?\w+)", message, re.IGNORECASE)
        what = f"tried to allocate {_readable(asked.group(1))}" if asked else message
        return f"ran out of memory ({what}){_user_frame(tb)}; {OOM_FIX}"
    return f"failed: {message}{_user_frame(tb)}"


def _readable(amount: str) -> str:
    """'1152921504606846976 bytes' -> '1.0 EiB' (the CPU allocator's unit); '2.00 GiB' stays."""
    if not amount.endswith(" bytes"):
        return amount
    size = float(amount.split()[0])
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            return f"{size:.1f} {unit}" if unit != "bytes" else f"{size:.0f} bytes"
        size /= 1024
    return f"{size:.1f} EiB"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def stack_path(run_dir: str, rank: int) -> str:
    """Where a launched rank's faulthandler writes its stack (at the deadline, or on a crash)."""
    return os.path.join(run_dir, f"rank{rank}.stack")


def slot_path(run_dir: str, rank: int) -> str:
    """Where a launched rank's flight recorder publishes its current collective."""
    return os.path.join(run_dir, f"rank{rank}.collective")


def failure(outcomes: dict[int, tuple], world_size: int, timeout: float, run_dir: str) -> LaunchError | None:
    """The error a launch raises, or None when every rank returned.

    ``outcomes[rank]``: ``(rank, "ok", result)``, ``(rank, "error", message, traceback, exception)`` or
    ``(rank, "exit", exitcode)`` (died without a word); a rank missing from it was still running at
    the deadline.
    """
    calls = {r: flight_recorder.read(slot_path(run_dir, r)) for r in range(world_size)}
    stacks = {r: _read(stack_path(run_dir, r)) for r in range(world_size)}
    failed = {r: o for r, o in outcomes.items() if o[1] != "ok"}
    if failed:
        return _worker_error(failed, calls, stacks)
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        return _timeout_error(timeout, missing, calls, stacks)
    return None


def _worker_error(failed: dict[int, tuple], calls: dict, stacks: dict[int, str]) -> WorkerError:
    # Root causes first: a peer's "connection reset" only when nothing else failed.
    causes = {r: o for r, o in failed.items() if not _is_peer_failure(o)} or failed
    # Each distinct error once, with the ranks that raised it (and the first one's line of code).
    by_error: dict[str, list[int]] = {}
    for r in sorted(causes):
        key = causes[r][2] if causes[r][1] == "error" else _cause(causes[r], calls[r], stacks[r])
        by_error.setdefault(key, []).append(r)
    lines = [f"{_rank_list(ranks)} {_cause(causes[ranks[0]], calls[ranks[0]], stacks[ranks[0]])}"
             for ranks in by_error.values()]
    desync = flight_recorder.disagreement(calls)
    if desync and not any(desync in line for line in lines):
        lines.insert(0, desync)
    tracebacks = {r: o[3] if o[1] == "error" else f"rank {r} {_cause(o, calls[r], stacks[r])}\n{stacks[r]}"
                  for r, o in causes.items()}
    error = WorkerError("\n".join(lines) + "\n(each rank's full traceback: err.tracebacks[rank])", tracebacks)
    first = causes[min(causes)]
    if first[1] == "error" and first[4]:
        try:
            error.__cause__ = cloudpickle.loads(first[4])
        except Exception:  # noqa: BLE001 - the traceback text is already in the message
            pass
    return error


def _timeout_error(timeout: float, missing: list[int], calls: dict, stacks: dict[int, str]) -> LaunchTimeout:
    running = {r: calls[r] for r in missing}
    summary = flight_recorder.disagreement(running)
    if not summary:
        parts = []
        outside = [r for r, c in running.items() if c is None or c.state != "in"]
        for r in outside:
            last = running[r]
            after = "" if last is None else f" after {last.call()}" + (" (async, in flight)" if last.state == "issued"
                                                                          else "")
            parts.append(f"rank {r} is stuck outside any collective{_where(_stack_frames(stacks[r]))}{after}")
        waits: dict[str, list[int]] = {}
        for r, c in running.items():
            if c is not None and c.state == "in":
                waits.setdefault(c.call(), []).append(r)
        parts += [f"{_rank_list(ranks)} wait{'s' if len(ranks) == 1 else ''} in {call}"
                  for call, ranks in waits.items()]
        summary = "; ".join(parts)
    excerpts = "".join(_stack_excerpt(r, stacks[r]) for r in missing)
    return LaunchTimeout(f"timed out after {timeout:g} s; ranks still running: {missing}: {summary}{excerpts}",
                         missing)


def _stack_excerpt(rank: int, text: str, max_lines: int = 8) -> str:
    """The user's frames of a hung rank, from the faulthandler dump (most recent call first)."""
    frames = [(f, ln, fn) for f, ln, fn in reversed(_stack_frames(text))
              if not any(x in f for x in ("minifsdp/launch.py", "minifsdp/flight_recorder.py", "/multiprocessing/"))
              and f != "<string>"][:max_lines]
    lines = [f'File "{f}", line {ln} in {fn}' for f, ln, fn in frames]
    return f"\n--- where rank {rank} was (most recent call first) ---\n" + "\n".join(lines) if lines else ""


# --------------------------------------------------------------------------
# Under torchrun: each rank says its own cause; fault injection
# --------------------------------------------------------------------------
FAULT_ENV = "MINIFSDP_FAULT"
FAULT_MODES = ("raise", "oom", "kill", "term", "segv", "hang", "desync")
_state: dict[str, Any] = {"installed": False, "step": None}


def _rank() -> int:
    return tdist.get_rank() if tdist.is_available() and tdist.is_initialized() else int(os.environ.get("RANK", 0))


def install() -> None:
    """Under torchrun: record collectives, and on an uncaught exception print one line to stderr after the
    traceback, before torchrun's report: '[minifsdp] rank 1 failed at step 2: ValueError: ... (in ...)'."""
    if _state["installed"]:
        return
    _state["installed"] = True
    if not flight_recorder.recording():  # launch's workers record already
        flight_recorder.enable()
    previous = sys.excepthook

    def one_line(exc_type: type, exc: BaseException, tb: Any) -> None:
        previous(exc_type, exc, tb)
        import traceback

        text = "".join(traceback.format_exception(exc_type, exc, tb))
        outcome = (_rank(), "error", f"{exc_type.__name__}: {exc}".splitlines()[0], text, None)
        step = f" at step {_state['step']}" if _state["step"] is not None else ""
        if _is_peer_failure(outcome):
            cause = "lost a peer: the cause is on another rank (its line above, or torchrun's report below)"
        else:
            cause = _cause(outcome, None, "")
        call = flight_recorder.current()
        inside = f" in {call.call()}" if call is not None and call.state == "in" else ""
        print(f"[minifsdp] rank {outcome[0]}{step}{inside} {cause}", file=sys.stderr, flush=True)

    sys.excepthook = one_line


def inject(step: int, spec: str | None = None) -> None:
    """Fail this rank on purpose at ``step`` when ``spec`` (default: ``$MINIFSDP_FAULT``) says so.

    ``spec`` is ``RANK:MODE:STEP``, e.g. ``1:kill:2``; MODE is one of ``raise`` (a RuntimeError),
    ``oom`` (an impossible allocation), ``kill`` / ``term`` (SIGKILL / SIGTERM to itself), ``segv``
    (a real segmentation fault), ``hang`` (sleeps outside any collective) or ``desync`` (an
    all-gather only this rank calls, while its peers go on to their next collective). A trainer
    calls it once per step; the first call also runs ``install()`` so that, under torchrun, a
    failing rank prints its one-line cause. A malformed spec is refused before anything runs.
    """
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    parts = spec.split(":")
    if spec and (len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit() or parts[1] not in FAULT_MODES):
        raise ValueError(f"{FAULT_ENV}={spec!r} must be RANK:MODE:STEP with MODE one of {', '.join(FAULT_MODES)} "
                         "(e.g. MINIFSDP_FAULT=1:kill:2)")
    _state["step"] = step
    if not spec:  # the common case: nothing to inject, and nothing installed in this process
        return
    install()
    if int(parts[0]) != _rank() or int(parts[2]) != step:
        return
    rank, mode = int(parts[0]), parts[1]
    print(f"[minifsdp] rank {rank}: {FAULT_ENV} injects '{mode}' at step {step}", file=sys.stderr, flush=True)
    if mode == "raise":
        raise RuntimeError(f"{FAULT_ENV} injected a failure at step {step}")
    if mode == "oom":
        torch.empty(1 << 60, dtype=torch.uint8)  # an exabyte: no machine has it
    if mode in ("kill", "term"):
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        time.sleep(60)  # the signal arrives asynchronously
    if mode == "segv":
        ctypes.string_at(0)  # reads address 0: a real segmentation fault
    if mode == "hang":
        time.sleep(10**6)
    if mode == "desync":
        shard = torch.zeros(2, device=dist.device())
        gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor  # torch < 2.13
        gather(shard.new_empty(2 * dist.world_size()), shard)
