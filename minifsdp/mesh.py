"""A device mesh: the world's ranks laid out as a (dp x pp x cp x tp) grid, one process group per line.

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

HYBRID_SHARD (HSDP) has two data-parallel dimensions: it shards inside a
group of ``dp_shard`` ranks (a node) and replicates across the
``dp_replicate = dp / dp_shard`` groups. ``dp_shard=`` splits the ``dp``
dimension that way (torchtitan's names; ``dp_shard`` fastest, so a shard group
is consecutive along dp), and the mesh builds those groups too. FSDP takes
them with ``FullyShardedDataParallel(..., device_mesh=m)``, as torch's FSDP1
takes a 2-D (replicate, shard) mesh::

    >>> h = DeviceMesh(dp=4, dp_shard=2)           # 2 "nodes" of 2 ranks
    >>> h.groups("dp_shard"), h.groups("dp_replicate")
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    >>> print(h)                                   # doctest: +NORMALIZE_WHITESPACE
    DeviceMesh(dp=4, pp=1, tp=1, dp_shard=2): 4 ranks, rank = dp*1 + pp*1 + tp
                  tp=0
      dp=0 pp=0      0
      dp=1 pp=0      1
      dp=2 pp=0      2
      dp=3 pp=0      3
      dp groups: [0, 1, 2, 3]
      pp groups: [0] [1] [2] [3]
      tp groups: [0] [1] [2] [3]
      dp = dp_replicate 2 x dp_shard 2, dp index = dp_replicate*2 + dp_shard
      dp_replicate groups: [0, 2] [1, 3]
      dp_shard groups: [0, 1] [2, 3]

Context parallel (``cp``) is a fourth axis, between pp and tp: the ranks of one
cp group hold the same weights and the same sequences, a share of each (ring
attention passes K/V round them in every layer, so they are consecutive when
tp = 1)::

    rank = ((d * pp + p) * cp + c) * tp + t

    >>> c = DeviceMesh(dp=2, cp=2)
    >>> c.groups("cp"), c.groups("dp"), c.coords(3)
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]], {'dp': 1, 'pp': 0, 'tp': 0, 'cp': 1})

Expert parallel (``ep``) is not an axis: like ``dp_shard`` it splits dp. Each dp
group falls into ``dp / ep`` runs of ``ep`` consecutive ranks (the ``ep`` groups,
which spread the experts and exchange tokens by all-to-all) and the ranks at the
same place in every run form the ``edp`` groups (expert data parallel: they hold
the same experts, and sum those experts' gradients)::

    >>> e = DeviceMesh(dp=4, ep=2)
    >>> e.groups("ep"), e.groups("edp")
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])

Five dimensions, one picture: ``print(DeviceMesh(dp=4, ep=2))`` lists every
group, and ``plot.mesh_diagram`` draws pp as panels, dp as rows, cp x tp as
columns, cp groups as dotted boxes and ep groups as orange ones.

Inside a process group (``minifsdp.launch`` or torchrun) the constructor also
builds the groups: every rank calls ``torch.distributed.new_group`` for every
group in the same order (torch requires it), and keeps the ones it belongs to.
``get_group("tp")`` / ``get_local_rank("tp")`` / ``size("tp")`` are named as
on ``torch.distributed.device_mesh.DeviceMesh``. ``plot.mesh_diagram(m)`` draws it.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as tdist

from . import dist

__all__ = ["DeviceMesh", "DIMS", "DP_SPLIT", "EP_SPLIT"]

DIMS = ("dp", "pp", "tp")
AXES = ("dp", "pp", "cp", "tp")  # the grid's axes, slowest first (cp is 1 unless given)
DP_SPLIT = ("dp_replicate", "dp_shard")  # HSDP's two views of dp, built only when dp_shard= is given
EP_SPLIT = ("ep", "edp")  # expert parallel's two views of dp, built only when ep= is given (> 1)
# a split of dp: (the dimension of consecutive runs, the strided one) and the attribute holding the run length
_SPLITS = {"dp_shard": ("dp_shard", True), "dp_replicate": ("dp_shard", False), "ep": ("ep", True),
           "edp": ("ep", False)}


class DeviceMesh:
    """The (dp x pp x cp x tp) layout of ``dp * pp * cp * tp`` ranks and, when distributed, its process groups.

    ``dp_shard``: split dp into ``dp_replicate x dp_shard`` for HYBRID_SHARD (default: no split).
    ``cp``: context-parallel ranks per sequence (default 1: no cp axis). ``ep``: split dp into ``dp / ep``
    expert-parallel groups of ``ep`` ranks (``ep`` groups) and their ``edp`` groups (default 1: no split).
    """

    @classmethod
    def from_layout(cls, layout: Any, build_groups: bool | None = None) -> "DeviceMesh":
        """The mesh of a ``minifsdp.layout.Layout``: its dp, pp, tp, cp and ep (and dp_shard under HYBRID_SHARD)."""
        return cls(**layout.mesh_degrees(), build_groups=build_groups)

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *, dp_shard: int | None = None, cp: int = 1,
                 ep: int = 1, build_groups: bool | None = None) -> None:
        sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp, "ep": ep}
        sizes |= {} if dp_shard is None else {"dp_shard": dp_shard}
        for name, n in sizes.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"DeviceMesh: {name}={n!r}; every mesh dimension must be a positive integer "
                                 "(use 1 for a technique you do not use)")
        if dp_shard is not None and dp % dp_shard:
            raise ValueError(f"DeviceMesh: dp_shard={dp_shard} must divide dp={dp} "
                             "(HYBRID_SHARD: dp = dp_replicate x dp_shard, dp_shard = ranks per node)")
        if dp % ep:
            raise ValueError(f"DeviceMesh: ep={ep} must divide dp={dp} (expert parallel runs inside data parallel: "
                             "dp = ep x the expert data-parallel replicas)")
        self.shape = (dp, pp, tp)
        self.cp, self.ep = cp, ep
        self.world_size = dp * pp * cp * tp
        self.dp_shard = dp_shard  # None: dp is not split (no dp_replicate / dp_shard groups)
        self._groups: dict[str, Any] = {}
        if build_groups is None:
            build_groups = dist.is_initialized()
        if build_groups:
            world = dist.world_size()
            if world != self.world_size:
                raise ValueError(f"{self!r} needs {self._product()} = {self.world_size} ranks "
                                 f"but the world has {world}; choose sizes whose product is {world}")
            self._build_groups()

    # -- layout (pure arithmetic, no processes needed) -------------------------
    @property
    def dims(self) -> tuple[str, ...]:
        """Every dimension this mesh has groups for: dp, pp, tp, then cp and the splits of dp it was given."""
        return (DIMS + (("cp",) if self.cp > 1 else ()) + (DP_SPLIT if self.dp_shard is not None else ())
                + (EP_SPLIT if self.ep > 1 else ()))

    def _sizes(self) -> dict[str, int]:
        dp, pp, tp = self.shape
        return {"dp": dp, "pp": pp, "cp": self.cp, "tp": tp}

    def size(self, dim: str | None = None) -> int:
        """Ranks along ``dim`` (``"dp"``, ``"pp"``, ``"tp"``, ``"cp"``, ``"dp_replicate"``, ``"dp_shard"``,
        ``"ep"``, ``"edp"``), or the whole mesh."""
        if dim in _SPLITS:
            run = self._split_size(dim)
            return run if _SPLITS[dim][1] else self.shape[0] // run
        return self.world_size if dim is None else self._sizes()[self._axis(dim)]

    def rank_at(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at these coordinates."""
        _, P, T = self.shape
        return ((dp * P + pp) * self.cp + cp) * T + tp

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """``{"dp": d, "pp": p, "tp": t}`` of ``rank`` (default: this process), and ``"cp"`` when cp > 1."""
        rank = dist.rank() if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        _, P, T = self.shape
        C = self.cp
        out = {"dp": rank // (P * C * T), "pp": rank // (C * T) % P, "tp": rank % T}
        return out | ({"cp": rank // T % C} if C > 1 else {})

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``: the ranks that differ only in that coordinate, in order."""
        if dim in _SPLITS:  # each dp group cut in consecutive runs (dp_shard, ep) or strided picks (dp_replicate, edp)
            s, runs = self._split_size(dim), _SPLITS[dim][1]
            if runs:
                return [g[i:i + s] for g in self.groups("dp") for i in range(0, len(g), s)]
            return [g[i::s] for g in self.groups("dp") for i in range(s)]
        axis = self._axis(dim)
        sizes = self._sizes()
        others = [range(n) if name != axis else range(1) for name, n in sizes.items()]
        out = []
        for fixed in itertools.product(*others):
            ranks = []
            for k in range(sizes[axis]):
                c = dict(zip(sizes, fixed))
                c[axis] = k
                ranks.append(self.rank_at(**c))
            out.append(ranks)
        return out

    def ranks_along(self, dim: str, rank: int | None = None) -> list[int]:
        """The group along ``dim`` that ``rank`` (default: this process) belongs to."""
        rank = dist.rank() if rank is None else rank
        return next(g for g in self.groups(dim) if rank in g)

    # -- process groups ----------------------------------------------------------
    def _build_groups(self) -> None:
        me = dist.rank()
        for dim in self.dims:
            for ranks in self.groups(dim):
                # Every rank must take part in creating every group, in the same order.
                group = tdist.new_group(ranks) if len(ranks) < self.world_size else tdist.group.WORLD
                if me in ranks:
                    self._groups[dim] = group

    def get_group(self, dim: str) -> Any:
        """This rank's process group along ``dim`` (as ``torch``'s ``DeviceMesh.get_group``)."""
        self._split_size(dim) if dim in _SPLITS else self._axis(dim)
        if dim not in self._groups:
            if dim == "cp":  # no cp axis: a group of one is asked for; no process group holds just this rank
                raise ValueError(f"{self!r} has no cp axis: build it with cp=<ranks per sequence> for context parallel")
            raise RuntimeError("this DeviceMesh has no process groups: build it inside a process group "
                               "(minifsdp.launch or torchrun) to use get_group")
        return self._groups[dim]

    def get_local_rank(self, dim: str) -> int:
        """This process's coordinate along ``dim`` (its rank inside that group)."""
        if dim in _SPLITS:  # dp index = strided index * run + (index inside the run)
            d, run = self.coords()["dp"], self._split_size(dim)
            return d % run if _SPLITS[dim][1] else d // run
        return self.coords().get(dim, 0)

    # -- printing ---------------------------------------------------------------
    def _product(self) -> str:
        return "dp*pp*tp" + ("*cp" if self.cp > 1 else "")

    def __repr__(self) -> str:
        D, P, T = self.shape
        split = "" if self.dp_shard is None else f", dp_shard={self.dp_shard}"
        extra = "".join(f", {name}={getattr(self, name)}" for name in ("cp", "ep") if getattr(self, name) > 1)
        return f"DeviceMesh(dp={D}, pp={P}, tp={T}{split}{extra})"

    def __str__(self) -> str:
        D, P, T = self.shape
        C = self.cp
        if C > 1:
            formula = f"rank = dp*{P * C * T} + pp*{C * T} + cp*{T} + tp"
            cols = [(c, t) for c in range(C) for t in range(T)]
            header = "".join(f"{f'cp={c},tp={t}':>10}" for c, t in cols)
            width = 10
        else:
            formula = f"rank = dp*{P * T} + pp*{T} + tp"
            cols = [(0, t) for t in range(T)]
            header = "".join(f"{'tp=' + str(t):>6}" for t in range(T))
            width = 6
        lines = [f"{self!r}: {self.world_size} ranks, {formula}", " " * 12 + header]
        for d in range(D):
            for p in range(P):
                lines.append(f"  dp={d:<2}pp={p:<2}" + "".join(f"{self.rank_at(d, p, t, c):>{width}}" for c, t in cols))
        for dim in DIMS + (("cp",) if C > 1 else ()):
            lines.append(f"  {dim} groups: " + " ".join(str(g) for g in self.groups(dim)))
        if self.dp_shard is not None:
            R, S = self.size("dp_replicate"), self.dp_shard
            lines.append(f"  dp = dp_replicate {R} x dp_shard {S}, dp index = dp_replicate*{S} + dp_shard")
            for dim in DP_SPLIT:
                lines.append(f"  {dim} groups: " + " ".join(str(g) for g in self.groups(dim)))
        if self.ep > 1:
            lines.append(f"  dp = edp {D // self.ep} x ep {self.ep}: each ep group holds every expert once "
                         "(E/ep a rank), each edp group the same experts")
            for dim in EP_SPLIT:
                lines.append(f"  {dim} groups: " + " ".join(str(g) for g in self.groups(dim)))
        return "\n".join(lines)

    def _split_size(self, dim: str) -> int:
        """The run length of a split of dp: dp_shard for HSDP's dimensions, ep for expert parallel's."""
        if dim in EP_SPLIT:
            if self.ep == 1:
                raise ValueError(f"{self!r} does not split dp for expert parallel, so it has no {dim!r} dimension: "
                                 f"build it with DeviceMesh(dp={self.shape[0]}, ..., ep=<ranks per expert group>)")
            return self.ep
        if self.dp_shard is None:
            raise ValueError(f"{self!r} does not split dp, so it has no {dim!r} dimension: build it with "
                             f"DeviceMesh(dp={self.shape[0]}, ..., dp_shard=<ranks per node>) for HYBRID_SHARD")
        return self.dp_shard

    @staticmethod
    def _axis(dim: str) -> str:
        if dim not in AXES:
            raise ValueError(f"unknown mesh dimension {dim!r}; use one of {', '.join(AXES + DP_SPLIT + EP_SPLIT)}")
        return dim
