"""The parallel layout: how many ways each dimension splits the work, validated once.

Layer 4 (leaves): plain arithmetic, no processes. torchtitan's ``ParallelDims``
is the model. Every parallel run is a grid of ranks, one degree per dimension:

    dp    data parallel: replicas of the model, each on a slice of the batch;
          for HYBRID_SHARD (HSDP) dp = dp_replicate x dp_shard, sharded inside
          a group of dp_shard ranks, replicated across the dp_replicate groups
    pp    pipeline parallel: consecutive stages, each rank ``virtual_stages`` of them
    tp    tensor parallel: every layer split between tp ranks
    cp    context parallel: every sequence split between cp ranks (ring attention);
          the cp ranks of one sample read the same sequences, so the gradients are
          averaged over dp x cp (torchtitan's ``dp_shard_cp``)
    ep    expert parallel, *inside* dp: the dp ranks fall into dp / ep groups of ep
          consecutive ranks; each group spreads every MoE layer's experts over its ep
          ranks (E / ep each) and the groups replicate them (the "expert data parallel"
          groups: the dp / ep ranks that hold the same experts). ep is not a factor of
          the world size; it must divide dp (DeepSpeed-MoE's and Megatron-LM's rule)

    world size = dp x pp x tp x cp        (ep divides dp)

Context and expert parallel compose with data parallel here (cp x dp, ep x dp),
not with pipeline or tensor parallel, nor with each other: ``validate`` says so
in one line naming the fix.

The trainer builds one ``Layout`` from its flags and the strategy's record
(``minifsdp.strategies``), and everything that needs a degree reads it there:
its validation, the default ``--world-size``, the batch split, the mesh
(``mesh.DeviceMesh.from_layout``), HYBRID_SHARD's groups, the pipeline's stages,
bench and the planner.

    >>> Layout(dp=2, tp=2).world_size
    4
    >>> Layout.hybrid(4).dp_shard, Layout.hybrid(4).dp_replicate   # 2 "nodes" of 2 ranks
    (2, 2)
    >>> Layout(pp=2, virtual_stages=2).stages
    4
    >>> Layout(dp=2, cp=2).world_size, Layout(dp=4, ep=2).world_size, Layout(dp=4, ep=2).expert_replicas
    (4, 4, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "MULTI_STAGE_SCHEDULES", "virtual_stages_for"]

# Pipeline schedules that place several stages on one rank (the others: one stage per rank).
MULTI_STAGE_SCHEDULES = ("interleaved", "zero-bubble")


def virtual_stages_for(schedule: str, requested: int = 1) -> int:
    """Stages per rank a schedule runs: ``requested`` for interleaved and zero-bubble, else 1."""
    return requested if schedule in MULTI_STAGE_SCHEDULES else 1


@dataclass(frozen=True)
class Layout:
    """The degrees of one run. ``dp_shard`` (default: all of dp) splits dp for HYBRID_SHARD."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    virtual_stages: int = 1
    dp_shard: int | None = None
    cp: int = 1
    ep: int = 1

    @classmethod
    def hybrid(cls, dp: int, **degrees: int) -> "Layout":
        """HYBRID_SHARD on one machine: 2 x (N/2), shard groups of N/2 consecutive ranks replicated twice
        (at dp 2: shard 1 x replicate 2)."""
        return cls(dp=dp, dp_shard=max(1, dp // 2), **degrees)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def expert_replicas(self) -> int:
        """How many ep groups hold the same experts (expert data parallel): dp / ep."""
        return self.dp // self.ep

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.shard_size

    @property
    def shard_size(self) -> int:
        """Ranks one data-parallel shard group spans: dp_shard under HYBRID_SHARD, else all of dp."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        """``"dp x pp x tp = 2 x 1 x 2"`` (``x cp`` when cp > 1): what the world size is the product of."""
        if self.cp > 1:
            return f"dp x pp x tp x cp = {self.dp} x {self.pp} x {self.tp} x {self.cp}"
        return f"dp x pp x tp = {self.dp} x {self.pp} x {self.tp}"

    def validate(self, world_size: int | None = None, n_layers: int | None = None, what: str = "this run",
                 model: str = "the model") -> None:
        """One-line errors that name the fix: degrees >= 1, HSDP's split, cp and ep's compositions (ep divides
        dp), the world size, pipeline stages."""
        for name in ("dp", "pp", "tp", "virtual_stages", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("cp", "ep"):
            if getattr(self, name) > 1 and (self.pp > 1 or self.tp > 1 or self.dp_shard is not None):
                what = {"cp": "context", "ep": "expert"}[name]
                raise ValueError(f"{what} parallel composes with data parallel only here (--{name} x --dp), not with "
                                 f"pipeline, tensor parallel or HYBRID_SHARD: use --pp 1 --tp 1, or --{name} 1")
        if self.cp > 1 and self.ep > 1:
            raise ValueError("context and expert parallel together are not built: ring attention splits each sequence "
                             "while the MoE loss balances whole sequences; use --cp 1 or --ep 1")
        if self.dp % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the data-parallel degree {self.dp} (expert parallel runs "
                             f"inside data parallel: each ep group is {self.ep} of the dp ranks); use --world-size a "
                             f"multiple of {self.ep}, or an --ep that divides {self.dp}")
        if self.dp_shard is not None and (self.dp % 2 or self.dp % self.dp_shard):
            raise ValueError(f"HYBRID_SHARD here is 2 x (N/2) ranks: use an even --world-size, got {self.dp}")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"{what} runs {self.describe()} ranks: use --world-size {self.world_size} "
                             f"(got {world_size})")
        if n_layers is not None and self.stages > n_layers:
            raise ValueError(f"{self.pp} x {self.virtual_stages} stages but {model} has {n_layers} layers "
                             "(embed, blocks, head): use fewer stages (--pp / --virtual-stages)")

    def mesh_degrees(self) -> dict[str, int]:
        """The arguments of ``mesh.DeviceMesh``: dp, pp, tp, dp_shard under HYBRID_SHARD, cp and ep when > 1."""
        extra = {} if self.dp_shard is None else {"dp_shard": self.dp_shard}
        extra.update({name: getattr(self, name) for name in ("cp", "ep") if getattr(self, name) > 1})
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, **extra}
