"""Which collective is each rank in? A flight recorder for ``torch.distributed``, one slot per rank.

Layer 1 (runtime), beside ``launch`` and ``faults``. When a run hangs or
crashes, the question is *where* each rank was: rank 0 waiting in its third
all-reduce while rank 1 sits in its third all-gather is the classic desync,
and it hangs (or, when the byte counts differ, gloo aborts the process) with
nothing in the error that says so. PyTorch answers it for NCCL with its
*flight recorder* (``TORCH_NCCL_TRACE_BUFFER_SIZE``: a ring buffer of recent
collectives dumped on a timeout); this is the same idea, for every backend,
one entry deep:

* ``record_collectives(path)`` wraps the collectives of ``torch.distributed``
  (the names code calls: ``comm`` goes through them, and so does torch's own
  FSDP or DDP from Python). Before each call the rank writes *what* it is
  entering — op, call count on that group, tensors, group — into a small file
  mapped into memory (``mmap``), and flips one byte when the call returns.
  A memory-mapped file survives the process: the launcher reads it after a
  rank died by a signal or was stopped at the deadline. Cost: formatting one
  short line and copying it, a few microseconds a collective.
* ``read(path)`` is the launcher's side: the rank's last ``Collective``.
* ``check=True`` (``launch(..., check_collectives=True)``, or
  ``MINIFSDP_CHECK_COLLECTIVES=1``) compares op, tensors and call count across
  the group *before* each collective (one ``all_gather_object``, i.e. two small
  collectives more per call) and raises ``CollectiveMismatchError`` on every
  rank at the first disagreement, instead of a hang or an abort. A debugging
  mode: a small all-reduce takes several times as long (docs/faults.md).

Blocking point-to-point calls (send/recv) are recorded too but never compared: a
send on one rank and a recv on its peer is the matching pair, not a desync.
``isend``/``irecv`` are not wrapped (torch tells a ``P2POp``'s direction by the
function's identity), so a pipeline's async transfers do not show.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as tdist

__all__ = ["Collective", "CollectiveMismatchError", "record_collectives", "enable", "read", "note", "current",
           "recording", "disagreement", "CHECK_ENV"]

CHECK_ENV = "MINIFSDP_CHECK_COLLECTIVES"
SLOT_BYTES = 512
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "broadcast", "all_to_all",
                "all_to_all_single", "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list")
_POINT_TO_POINT = ("send", "recv")  # not isend / irecv: batch_isend_irecv checks `op is isend`
# torch.distributed's name -> the op it performs (old and new spellings of one collective are one op).
_OP_NAME = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
            "all_to_all_single": "all_to_all"}
_STATES = {"I": "in", "D": "done", "A": "issued"}  # issued: an async call that returned a handle
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64"}


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called different collectives (op, tensors or order): a desync."""


@dataclass(frozen=True)
class Collective:
    """One rank's current or last collective."""

    op: str        # "all_reduce", "all_gather", ... (torch's old and new names merged)
    seq: int       # 1 for the first collective this rank called on ``group``
    tensors: str   # "float32[4]", "float32[8] <- float32[4]", "2 x float32[4]"
    group: str     # "" for the default group, else "ranks [0, 2]"
    state: str     # "in" (entered, not returned), "done", or "issued" (async)

    @property
    def point_to_point(self) -> bool:
        return self.op in ("send", "recv")

    def call(self) -> str:
        """What the rank called, without the state: 'all_reduce #3 (float32[4])'."""
        where = f" on {self.group}" if self.group else ""
        what = f" ({self.tensors})" if self.tensors else ""
        count = f" #{self.seq}" if self.seq else ""  # 0: a wait named with ``note``, not a counted call
        return f"{self.op}{count}{where}{what}"

    def __str__(self) -> str:
        return self.call() if self.state == "in" else f"{self.call()}, {self.state}"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{_DTYPE_NAMES.get(x.dtype) or str(x.dtype)[6:]}{list(x.shape)}"
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        same = all(t.shape == x[0].shape and t.dtype == x[0].dtype for t in x)
        return f"{len(x)} x {_describe(x[0])}" if same else ", ".join(_describe(t) for t in x)
    return ""


def _tensors(args: tuple, kwargs: dict) -> str:
    """The tensors of a call, output first as torch orders them: 'float32[8] <- float32[4]'."""
    parts = [d for d in (_describe(a) for a in (*args, *kwargs.values())) if d]
    return " <- ".join(parts[:2])


class _Recorder:
    """This process's slot: the last collective, in memory and (with a path) in a mapped file."""

    def __init__(self, path: str | None, check: bool):
        self.check = check
        self._call: tuple[str, int, str, str] | None = None  # op, seq, tensors, group of the last call
        self._state = "done"
        self._seq: dict[Any, int] = {}
        self._groups: dict[Any, str] = {}
        self._local = threading.local()  # a collective called inside one (all_gather_object) is not counted
        self._map: mmap.mmap | None = None
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, SLOT_BYTES)
                self._map = mmap.mmap(fd, SLOT_BYTES)
            finally:
                os.close(fd)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _group_name(self, group: Any) -> str:
        if group is None or group is tdist.GroupMember.WORLD:
            return ""
        key = id(group)
        if key not in self._groups:
            self._groups[key] = f"ranks {tdist.get_process_group_ranks(group)}"
        return self._groups[key]

    @property
    def last(self) -> Collective | None:
        return None if self._call is None else Collective(*self._call, self._state)

    def _publish(self, call: tuple[str, int, str, str]) -> None:
        """Entering ``call``: the whole line (state "I"), one copy into the mapped file."""
        self._call, self._state = call, "in"
        if self._map is not None:
            op, seq, tensors, group = call
            line = f"I\t{seq}\t{op}\t{tensors}\t{group}".encode()[:SLOT_BYTES - 1]
            self._map[:] = line.ljust(SLOT_BYTES, b" ")

    def _finished(self, state: str) -> None:
        """The call returned: only the state byte changes."""
        self._state = state
        if self._map is not None:
            self._map[0:1] = b"D" if state == "done" else b"A"

    def wrap(self, name: str, fn: Callable) -> Callable:
        op = _OP_NAME.get(name, name)
        point_to_point = op in ("send", "recv")

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            if "group" in kwargs:  # how comm, and most code, passes it
                group = kwargs["group"]
            else:
                group = next((a for a in args if isinstance(a, tdist.ProcessGroup)), None)
            key = (None if group is None else id(group), point_to_point)
            seq = self._seq[key] = self._seq.get(key, 0) + 1
            self._publish((op, seq, _tensors(args, kwargs), self._group_name(group)))
            self._local.inside = True
            try:
                if self.check and not point_to_point:
                    _compare_across(self.last, group)
                result = fn(*args, **kwargs)
            finally:  # an exception leaves the state "in": the rank was in this call when it failed
                self._local.inside = False
            self._finished("issued" if kwargs.get("async_op") else "done")
            return result

        return recorded


def _compare_across(call: Collective, group: Any) -> None:
    """Every rank of ``group`` shows the others what it is about to call; raise on any difference."""
    seen: list[Any] = [None] * tdist.get_world_size(group)
    tdist.distributed_c10d.all_gather_object(seen, (tdist.get_rank(), call), group=group)
    calls = dict(seen)
    message = disagreement(calls)
    if message:
        raise CollectiveMismatchError(f"{message} (caught before the call by check_collectives)")


def disagreement(calls: dict[int, Collective | None]) -> str:
    """'ranks disagree: rank 0 in all_reduce #3 (float32[4]), rank 1 in all_gather #3 (...)', or ''.

    Only ranks *inside* a collective (not done, not point-to-point) are compared, group by group:
    they disagree when op, tensors or call count differ.
    """
    inside = {r: c for r, c in calls.items() if c is not None and c.state == "in" and not c.point_to_point}
    by_group: dict[str, dict[int, Collective]] = {}
    for r, c in sorted(inside.items()):
        by_group.setdefault(c.group, {})[r] = c
    for members in by_group.values():
        if len({(c.op, c.seq, c.tensors) for c in members.values()}) > 1:
            return "ranks disagree: " + ", ".join(f"rank {r} in {c.call()}" for r, c in members.items())
    return ""


_active: _Recorder | None = None


@contextlib.contextmanager
def record_collectives(path: str | None = None, check: bool | None = None) -> Iterator[None]:
    """Inside: every ``torch.distributed`` collective publishes itself (and, with ``check``, is compared first).

    ``path``: the file the rank's slot lives in (``read`` it from another process); ``None`` keeps
    it in memory only (``current()``). ``check`` defaults to ``MINIFSDP_CHECK_COLLECTIVES=1``.
    """
    global _active
    previous = _active
    originals = enable(path, check)
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(tdist, n, fn)
        _active.close()  # type: ignore[union-attr]
        _active = previous


def enable(path: str | None = None, check: bool | None = None) -> dict[str, Callable]:
    """Record from now on, for the rest of the process (as ``faulthandler.enable``); returns the originals."""
    global _active
    if check is None:
        check = os.environ.get(CHECK_ENV, "0") == "1"
    _active = _Recorder(path, check)
    names = [n for n in (*_COLLECTIVES, *_POINT_TO_POINT) if hasattr(tdist, n)]
    originals = {n: getattr(tdist, n) for n in names}
    for n, fn in originals.items():
        setattr(tdist, n, _active.wrap(n, fn))
    return originals


def recording() -> bool:
    """Whether this process records its collectives (``record_collectives`` or ``enable``)."""
    return _active is not None


def note(what: str) -> None:
    """Publish a wait that is no collective of the caller's (``launch``'s end-of-run barrier), as "in"."""
    if _active is not None:
        _active._publish((what, 0, "", ""))


def current() -> Collective | None:
    """This process's current or last collective (inside ``record_collectives``), else None."""
    return _active.last if _active is not None else None


def read(path: str) -> Collective | None:
    """The collective a rank published in ``path`` (it may have died since), or None."""
    try:
        with open(path, "rb") as f:
            fields = f.read(SLOT_BYTES).decode(errors="replace").rstrip(" \x00").split("\t")
    except OSError:
        return None
    if len(fields) != 5 or fields[0] not in _STATES:
        return None
    state, seq, op, tensors, group = fields
    return Collective(op, int(seq), tensors, group, _STATES[state])
