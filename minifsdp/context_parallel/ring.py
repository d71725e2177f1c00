"""The ring: every rank of the cp group sends a buffer to the next rank and receives one from the previous.

Layer 5 (techniques). One ``pass_along`` is one turn of the ring (picotron's
``ContextComms.send_recv``): rank ``r`` posts ``comm.isend(buf, r+1)`` and
``comm.irecv(new, r-1)`` (group ranks, modulo cp) and returns at once, so the
caller computes on what it already holds while the next buffer travels; ``wait()``
gives the received buffer. After ``cp - 1`` turns every rank has held every
rank's buffer once::

    cp = 4, buffer of rank r = X_r       step 0   step 1   step 2   step 3
                               rank 0:    X_0      X_3      X_2      X_1
                               rank 1:    X_1      X_0      X_3      X_2     (held = X_{r - step})

Order of posting: even ranks send first, odd ranks receive first. gloo does not
care, but NCCL may run a rank's send and its receive on one stream, one after
the other, and a ring where every rank sends first then waits for its
neighbour's receive (which is queued behind that neighbour's own send): for a
large message, a deadlock. Alternating breaks the cycle (Megatron-LM's p2p
communication does the same; ``torch.distributed.batch_isend_irecv`` is the
other fix). Every byte goes through ``comm``, so the tracer counts it: a
``send`` and a ``recv`` span of the buffer's size per turn.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from .. import comm, dist

__all__ = ["Ring", "Transfer"]


class Transfer:
    """One turn of the ring in flight: ``wait()`` returns the buffer received from the previous rank."""

    def __init__(self, sent: torch.Tensor, received: torch.Tensor, handles: list[comm.Handle]) -> None:
        self._sent, self._received, self._handles = sent, received, handles  # _sent: alive until sent

    def wait(self) -> torch.Tensor:
        for h in self._handles:  # the send too: its buffer may be reused (or freed) after this
            h.wait()
        return self._received


class Ring:
    """The cp group seen as a ring: ``next`` and ``prev`` are global ranks (torch's p2p calls want those)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group
        self.size, self.rank = dist.world_size(group), dist.rank(group)
        self.next = dist.global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.global_rank(group, (self.rank - 1) % self.size)

    def pass_along(self, buf: torch.Tensor, tag: int = 0) -> Transfer:
        """Start sending ``buf`` (contiguous) to the next rank and receiving its like from the previous."""
        received = torch.empty_like(buf)
        send = lambda: comm.isend(buf, self.next, group=self.group, tag=tag)       # noqa: E731
        recv = lambda: comm.irecv(received, self.prev, group=self.group, tag=tag)  # noqa: E731
        handles = [send(), recv()] if self.rank % 2 == 0 else [recv(), send()]
        return Transfer(buf, received, handles)
