"""A device mesh: the world's ranks laid out as a (dp x pp x tp) grid, one process group per line.

Layer 5 (techniques). Combining techniques means every rank belongs to several
groups at once: the ranks that hold the *same* model slice but different data
(data parallel, ``dp``), the consecutive pipeline stages (``pp``), and the
ranks that split each layer between them (tensor parallel, ``tp``). This file
lays the ranks out and builds those groups once; tensor parallel
(``minifsdp.tensor_parallel.initialize_model_parallel``), the trainer's FSDP x
TP and the pipeline take their groups from it instead of making their own.

The layout is Megatron-LM's and FairScale's (``initialize_model_parallel``
with ``pipeline_length``): ``tp`` varies fastest, so the ranks of one
tensor-parallel group are consecutive - on a GPU machine, the GPUs of one
node, joined by the fastest links, since TP talks in every layer::

    rank = d * (pp * tp) + p * tp + t

    >>> m = DeviceMesh(dp=2, pp=1, tp=2)          # printable without processes
    >>> m.coords(3)
    {'dp': 1, 'pp': 0, 'tp': 1}
    >>> m.groups("tp"), m.groups("dp")
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    >>> print(m)                                   # doctest: +NORMALIZE_WHITESPACE
    DeviceMesh(dp=2, pp=1, tp=2): 4 ranks, rank = dp*2 + pp*2 + tp
                  tp=0  tp=1
      dp=0 pp=0      0     1
      dp=1 pp=0      2     3
      dp groups: [0, 2] [1, 3]
      pp groups: [0] [1] [2] [3]
      tp groups: [0, 1] [2, 3]

Inside a process group (``minifsdp.launch`` or torchrun) the constructor also
builds the groups: every rank calls ``torch.distributed.new_group`` for every
group in the same order (torch requires it), and keeps the ones it belongs to.
``get_group("tp")`` / ``get_local_rank("tp")`` / ``size("tp")`` are named as
on ``torch.distributed.device_mesh.DeviceMesh``. ``plot.mesh(m)`` draws it.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as tdist

from . import dist

__all__ = ["DeviceMesh", "DIMS"]

DIMS = ("dp", "pp", "tp")


class DeviceMesh:
    """The (dp x pp x tp) layout of ``dp * pp * tp`` ranks and, when distributed, its process groups."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *, build_groups: bool | None = None) -> None:
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for name, n in sizes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"DeviceMesh: {name}={n!r}; every mesh dimension must be a positive integer "
                                 "(use 1 for a technique you do not use)")
        self.shape = (dp, pp, tp)
        self.world_size = dp * pp * tp
        self._groups: dict[str, Any] = {}
        if build_groups is None:
            build_groups = dist.is_initialized()
        if build_groups:
            world = dist.world_size()
            if world != self.world_size:
                raise ValueError(f"DeviceMesh(dp={dp}, pp={pp}, tp={tp}) needs dp*pp*tp = {self.world_size} ranks "
                                 f"but the world has {world}; choose sizes whose product is {world}")
            self._build_groups()

    # -- layout (pure arithmetic, no processes needed) -------------------------
    def size(self, dim: str | None = None) -> int:
        """Ranks along ``dim`` (``"dp"``, ``"pp"``, ``"tp"``), or the whole mesh."""
        return self.world_size if dim is None else self.shape[self._axis(dim)]

    def rank_at(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates."""
        _, P, T = self.shape
        return dp * P * T + pp * T + tp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{"dp": d, "pp": p, "tp": t}`` of ``rank`` (default: this process)."""
        rank = dist.rank() if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        _, P, T = self.shape
        return {"dp": rank // (P * T), "pp": rank // T % P, "tp": rank % T}

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``: the ranks that differ only in that coordinate, in order."""
        axis = self._axis(dim)
        others = [range(n) if i != axis else range(1) for i, n in enumerate(self.shape)]
        out = []
        for fixed in itertools.product(*others):
            ranks = []
            for k in range(self.shape[axis]):
                c = list(fixed)
                c[axis] = k
                ranks.append(self.rank_at(*c))
            out.append(ranks)
        return out

    def ranks_along(self, dim: str, rank: int | None = None) -> list[int]:
        """The group along ``dim`` that ``rank`` (default: this process) belongs to."""
        rank = dist.rank() if rank is None else rank
        return next(g for g in self.groups(dim) if rank in g)

    # -- process groups ----------------------------------------------------------
    def _build_groups(self) -> None:
        me = dist.rank()
        for dim in DIMS:
            for ranks in self.groups(dim):
                # Every rank must take part in creating every group, in the same order.
                group = tdist.new_group(ranks) if len(ranks) < self.world_size else tdist.group.WORLD
                if me in ranks:
                    self._groups[dim] = group

    def get_group(self, dim: str) -> Any:
        """This rank's process group along ``dim`` (as ``torch``'s ``DeviceMesh.get_group``)."""
        self._axis(dim)
        if dim not in self._groups:
            raise RuntimeError("this DeviceMesh has no process groups: build it inside a process group "
                               "(minifsdp.launch or torchrun) to use get_group")
        return self._groups[dim]

    def get_local_rank(self, dim: str) -> int:
        """This process's coordinate along ``dim`` (its rank inside that group)."""
        return self.coords()[dim]

    # -- printing ---------------------------------------------------------------
    def __repr__(self) -> str:
        D, P, T = self.shape
        return f"DeviceMesh(dp={D}, pp={P}, tp={T})"

    def __str__(self) -> str:
        D, P, T = self.shape
        lines = [f"{self!r}: {self.world_size} ranks, rank = dp*{P * T} + pp*{T} + tp",
                 " " * 12 + "".join(f"{'tp=' + str(t):>6}" for t in range(T))]
        for d in range(D):
            for p in range(P):
                lines.append(f"  dp={d:<2}pp={p:<2}" + "".join(f"{self.rank_at(d, p, t):>6}" for t in range(T)))
        for dim in DIMS:
            lines.append(f"  {dim} groups: " + " ".join(str(g) for g in self.groups(dim)))
        return "\n".join(lines)

    @staticmethod
    def _axis(dim: str) -> int:
        if dim not in DIMS:
            raise ValueError(f"unknown mesh dimension {dim!r}; use one of {', '.join(DIMS)}")
        return DIMS.index(dim)
