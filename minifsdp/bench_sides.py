"""What ``python -m minifsdp.bench`` compares: the sides of a pair and the named lists of pairs.

Front layer, read with ``bench.py`` (which runs the pairs) and ``bench_report.py`` (which prints them). A
side is ``strategy[@OPTION][#CHECKPOINT][%PRECISION]``, parsed once into a ``Side``; ``PRESETS`` are the
``--preset`` lists, ``PRESET_MODELS`` their default models where gpt-small does not fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .records import TrainConfig
from .strategies import STRATEGIES

__all__ = ["PRESETS", "PRESET_MODELS", "Side", "parse_pair"]

PRESETS: dict[str, tuple[str, ...]] = {
    # ZeRO-1/2/3 and each sharding strategy beside torch's own
    "sharding": ("ddp:torch-ddp", "zero1:torch-zero1", "zero2:torch-fsdp@SHARD_GRAD_OP",
                 "fsdp@FULL_SHARD:torch-fsdp@FULL_SHARD", "fsdp@SHARD_GRAD_OP:torch-fsdp@SHARD_GRAD_OP",
                 "fsdp@NO_SHARD:torch-fsdp@NO_SHARD", "fsdp@HYBRID_SHARD:torch-fsdp@HYBRID_SHARD",
                 "fsdp@FULL_SHARD:torch-fsdp2", "fsdp@SHARD_GRAD_OP:torch-fsdp2@SHARD_GRAD_OP",
                 # per-parameter sharding (fully_shard) beside torch's, and beside our flat-unit FSDP
                 "fsdp2:torch-fsdp2", "fsdp2:fsdp"),
    # activation checkpointing of every Block (train --checkpoint), ours beside torch's checkpoint_wrapper
    "checkpoint": ("fsdp:torch-fsdp", "fsdp#full:torch-fsdp#full", "fsdp#selective:torch-fsdp#selective"),
    # mixed precision (train --precision / --autocast): side%bf16 casts FSDP's parameters (a MixedPrecision
    # policy, torch's own on torch's side), side%autocast runs forward under torch.autocast. %fp16 adds the
    # gradient scaler: ShardedGradScaler beside torch's (FSDP), GradScaler beside torch.amp's (DDP).
    "precision": ("fsdp:torch-fsdp", "fsdp%bf16:torch-fsdp%bf16", "fsdp%autocast:torch-fsdp%autocast",
                  "fsdp#full%bf16:torch-fsdp#full%bf16", "fsdp%bf16:torch-fsdp2%bf16", "fsdp2%bf16:torch-fsdp2%bf16",
                  "fsdp2%bf16:fsdp%bf16", "ddp%bf16:torch-ddp%bf16",
                  "fsdp%fp16:torch-fsdp%fp16", "ddp%fp16:torch-ddp%fp16"),
    # each pipeline schedule beside torch.distributed.pipelining's (pp = world size, m = 2 x pp
    # micro-batches, v = 2 stages per rank for interleaved and zero-bubble)
    "pipeline": ("pp@gpipe:torch-pp@gpipe", "pp@1f1b:torch-pp@1f1b", "pp@interleaved:torch-pp@interleaved",
                 "pp@zero-bubble:torch-pp@zero-bubble"),
    # Megatron tensor parallel beside torch.distributed.tensor.parallel (tp = world size);
    # tp%bf16: autocast, its forward all-reduces 16-bit
    "tensor": ("tp:torch-tp", "fsdp+tp:torch-fsdp+tp", "tp#full:torch-tp#full", "tp%bf16:torch-tp%bf16"),
    # torch's context_parallel does not run on CPU (tests/test_context_parallel.py): ring attention (cp = world
    # size, each split) against full attention on one rank doing the same total work
    "context": ("cp@zigzag:single", "cp@naive:single"),
    # expert parallel (ep = world size, dropless all-to-all) against the single-process MoE
    "experts": ("ep:single",),
    # one pair per technique (README's overview table: run with --malloc both --compute --phases)
    "overview": ("ddp:torch-ddp", "zero1:torch-zero1", "zero2:torch-fsdp@SHARD_GRAD_OP",
                 "fsdp@FULL_SHARD:torch-fsdp@FULL_SHARD", "fsdp@SHARD_GRAD_OP:torch-fsdp@SHARD_GRAD_OP",
                 "fsdp@HYBRID_SHARD:torch-fsdp@HYBRID_SHARD", "fsdp%bf16:torch-fsdp%bf16", "fsdp#full:torch-fsdp#full",
                 "fsdp2:torch-fsdp2", "pp@gpipe:torch-pp@gpipe", "pp@1f1b:torch-pp@1f1b",
                 "pp@interleaved:torch-pp@interleaved", "pp@zero-bubble:torch-pp@zero-bubble",
                 "fsdp+tp:torch-fsdp+tp"),  # tp alone: --preset tensor (gpt-small's 6 heads do not split 4 ways)
}
# A preset's model when --model is not given: tensor parallel at 4 ranks needs heads divisible by 4
# (gpt-small has 6). On a CPU without AVX512-BF16 bf16 is emulated and slow: run --preset precision
# with --model gpt-mini there.
PRESET_MODELS = {"tensor": "gpt-mini", "experts": "gpt-moe-small"}
LOSS_RTOL = 1e-5  # fp32, a few AdamW steps: as tests/test_train.py

PRECISION_SUFFIXES = {"fp32": ("fp32", False), "bf16": ("bf16", False), "fp16": ("fp16", False),
                      "autocast": ("fp32", True)}
LOSS_RTOL_BY_PRECISION = {"fp32": LOSS_RTOL, "bf16": 2.0**-8, "fp16": 2.0**-11}  # one ulp of the compute dtype


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a pair, ``name@option#checkpoint%precision`` parsed once: ``Side.parse("fsdp@SHARD_GRAD_OP#full")``."""

    text: str
    name: str
    option: str | None = None      # the sharding strategy, or a pipeline's schedule
    checkpoint: str = "none"       # none | full | selective
    precision: str = "fp32"
    autocast: bool = False

    @classmethod
    def parse(cls, side: str) -> "Side":
        head, _, precision = side.partition("%")
        head, _, mode = head.partition("#")
        if "#" in precision:  # "%bf16#full" as well as "#full%bf16"
            precision, _, mode = precision.partition("#")
        name, _, option = head.partition("@")
        record = STRATEGIES.get(name)
        if record is None:
            raise ValueError(f"unknown strategy {name!r} in --pairs; choose from: {', '.join(STRATEGIES)}")
        options = record.option_choices
        if option and not options:
            takes = ", ".join(n for n, r in STRATEGIES.items() if r.option_choices)
            raise ValueError(f"{name!r} takes no @option in --pairs (only {takes} do); write {name!r} alone")
        if option and option not in options:
            raise ValueError(f"unknown option {option!r} for {name} in --pairs; choose from: {', '.join(options)}")
        if (mode or "none") not in ("none", "full", "selective"):
            raise ValueError(f"unknown checkpointing {mode!r} in --pairs side {side!r}; write side#full or "
                             "side#selective")
        if (precision or "fp32") not in PRECISION_SUFFIXES:
            raise ValueError(f"unknown precision {precision!r} in --pairs side {side!r}; write side%bf16, side%fp16 "
                             "or side%autocast")
        dtype, autocast = PRECISION_SUFFIXES[precision or "fp32"]
        return cls(side, name, option or None, mode or "none", dtype, autocast)

    @property
    def record(self) -> Any:
        return STRATEGIES[self.name]

    @property
    def loss_rtol(self) -> float:
        return LOSS_RTOL_BY_PRECISION["bf16" if self.autocast else self.precision]

    def train_config(self, model: str, world_size: int, batch_size: int = 8, **kw: Any) -> TrainConfig:
        """The trainer's config for this side at ``world_size`` ranks (``Strategy.bench_flags``: a pipeline over
        all of them, tp = world size, fsdp+tp's 2D as (world/2) x 2, cp / ep = world size, single on one rank)."""
        return TrainConfig(strategy=self.name, model=model, batch_size=batch_size, checkpoint=self.checkpoint,
                           precision=self.precision, autocast=self.autocast,
                           **self.record.bench_flags(world_size, self.option), **kw)


def parse_pair(pair: str) -> tuple[Side, Side]:
    """``"ours:theirs"``, each side parsed by ``Side.parse``."""
    sides = pair.split(":")
    if len(sides) != 2 or not all(sides):
        raise ValueError(f"a pair is ours:theirs, e.g. fsdp@FULL_SHARD:torch-fsdp@FULL_SHARD; got {pair!r}")
    return Side.parse(sides[0]), Side.parse(sides[1])
