"""What a strategy is: one record (the degrees it uses, its traits, its builder) and what its builder returns.

Front layer. The trainer's loop is the same for every strategy; what differs
is written down once, in a ``Strategy`` record:

* ``degrees``: which of the layout's degrees the strategy reads from the flags
  (``"dp"`` alone: every rank is a replica, dp = ``--world-size``; ``"pp"``:
  ``--pp`` and ``--virtual-stages``; ``"tp"``: ``--tp``; with pp or tp, ``"dp"``
  is ``--dp``). ``Strategy.layout(cfg)`` turns them into a ``layout.Layout``.
* traits: whether a MixedPrecision policy casts its parameters (else autocast
  does), whether its gradients are sharded (the fp16 scaler's found-inf flag
  is then all-reduced), whether it runs its own train step (pipelines, torch's
  DTensor loss), whether it checkpoints tensor parallel's split blocks itself,
  and whose implementation it is (``"minifsdp"`` or ``"torch"``: torch's get
  torch's checkpoint wrapper and gradient scaler, and their collectives counted).
* ``build(model, cfg, layout) -> Built``: the wrapped model, its optimizer, the
  loss function, the train step (None: the loop's forward and backward), how
  backward skips the gradient sync on the micro-batches before the last
  (``no_sync``: DDP's and FSDP1's method, FSDP2's ``set_requires_gradient_sync``),
  which slice of the global batch this rank reads (``data_rank`` of ``data_size``),
  which share of each sequence (``shard``: context parallel), and a gradient sync
  run once after the last backward (``sync_gradients``: expert parallel).
* ``check(cfg, layout)``: the record's own one-line refusals (``check_config`` adds
  the model's: a mixture-of-experts GPT runs on data parallel and expert parallel only).

A MoE GPT's loss is ``lm_loss + model.aux_loss()`` (the load-balancing loss) under every
strategy: ``Built.loss`` adds the aux losses of the model's MoE layers to ``loss_fn``'s, so
``metrics.json``'s losses are the same function of the model everywhere (0 added for a dense GPT).
* ``state(built, cfg)``: how ``--save-every`` / ``--resume`` see its model and optimizer, keyed by the
  single model's parameter names (``minifsdp.save_resume``; None: ``save_resume.ByName``).
* ``expected_bytes(cfg, layout)``: what minifsdp's side moves per step, from
  ``estimate`` / ``planner`` (bench's *expected* column); None for torch's.

The CLI names (``--strategy fsdp``, ``torch-pp``, ...) are records in
``minifsdp.strategies`` (ours) and ``minifsdp.torch_reference`` (torch's).
``TrainConfig`` (the flags) and the helpers every builder shares (AdamW,
checkpointing, autocast, FSDP2's recipe) live here too, so that both can build
without the trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from . import dist, models
from .layout import MULTI_STAGE_SCHEDULES, Layout, virtual_stages_for
from .mixed_precision import PRECISIONS

__all__ = ["TrainConfig", "Strategy", "Built", "RoutingCounter", "adamw", "apply_checkpointing", "autocast",
           "pipeline_autocast", "fully_shard_gpt", "PIPELINE_SCHEDULES", "CP_SPLITS"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
CP_SPLITS = ("zigzag", "naive")  # context_parallel.SPLITS (a leaf of the front cannot import it at load)


@dataclass
class TrainConfig:
    strategy: str = "single"
    world_size: int = 1
    model: str = "gpt-tiny"
    steps: int = 10
    batch_size: int = 8           # global batch (sequences per optimizer step)
    seq_len: int | None = None    # default: the model's block size
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    out: str = "runs/train"
    track_memory: bool = True     # ~1.3x slower on CPU; off for benchmarks
    write_plots: bool = True      # timeline.png / memory.png (a few seconds)
    timeout: float = 900.0
    quiet: bool = False
    # sharding options (fsdp / zero)
    sharding_strategy: str = "FULL_SHARD"
    wrap: str = "block"           # none | block | size
    prefetch: str = "BACKWARD_PRE"
    cpu_offload: bool = False
    bucket_cap_mb: float = 25.0
    checkpoint: str = "none"     # activation checkpointing of every Block: none | full | selective
    # fsdp: MixedPrecision(p, p, p); ddp / zero1 / zero2: autocast compute + gradients reduced in p
    precision: str = "fp32"       # fp32 | bf16 | fp16 (fp16 also turns the gradient scaler on)
    autocast: bool = False        # forward + loss under torch.autocast (bf16, or fp16 with --precision fp16)
    # pipeline options (pp, pp+dp, 3d)
    pp: int = 2
    dp: int = 1
    micro_batches: int = 4
    schedule: str = "1f1b"        # gpipe | 1f1b | interleaved | zero-bubble
    virtual_stages: int = 1       # stages per rank (interleaved, zero-bubble)
    # tensor parallel options (tp, fsdp+tp, 3d)
    tp: int = 2
    sequence_parallel: bool = False
    # context parallel (cp: x --dp) and expert parallel (ep: inside --world-size data-parallel ranks)
    cp: int = 2
    cp_split: str = "zigzag"      # zigzag | naive
    ep: int = 2
    # save and resume (minifsdp.save_resume): a checkpoint every K steps under <out>/checkpoints; where to resume
    save_every: int = 0
    resume: str | None = None


@dataclass
class Built:
    """What a builder hands the loop. ``train_step(x, y) -> loss``: the strategy runs forward and backward
    itself (None: the loop's ``loss(model(x), y).backward()``). ``no_sync()``: a context in which
    backward keeps its gradients local (None: the model's own ``no_sync``, if it has one). ``data_rank`` /
    ``data_size``: the slice of the global batch this rank reads (None: its own rank of the world).
    ``shard(t)``: this rank's share of each sequence of ``t`` (ids and targets; context parallel).
    ``sync_gradients()``: run once per step after the last backward, before the optimizer (expert
    parallel's gradient all-reduces; None: the wrapper synchronised them during backward)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = models.lm_loss
    train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    data_rank: int | None = None
    data_size: int | None = None
    no_sync: Callable[[], ContextManager] | None = None
    shard: Callable[[torch.Tensor], torch.Tensor] | None = None
    sync_gradients: Callable[[], None] | None = None

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What this rank computes on from the slice it read: every sequence whole, or its share (``shard``)."""
        return (x, y) if self.shard is None else (self.shard(x), self.shard(y))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` plus the load-balancing losses of the last forward's MoE layers (a MoE GPT's
        ``lm_loss + model.aux_loss()``, whatever wraps the model); ``loss_fn`` alone for a dense model."""
        loss = self.loss_fn(logits, targets)
        aux = [m.aux_loss for m in self.model.modules() if isinstance(m, models.MoE) and m.aux_loss is not None]
        return loss + torch.stack(aux).sum().to(loss.dtype) if aux else loss

    def finish_backward(self) -> None:
        """After the step's last backward: the strategy's own gradient sync, if it has one."""
        if self.sync_gradients is not None:
            self.sync_gradients()

    def micro_batch(self, last: bool) -> ContextManager:
        """--grad-accum: the context of one micro-batch's forward and backward. Every micro-batch but the
        last runs without gradient sync (the gradients accumulate locally); the last one reduces the sum."""
        no_sync = self.no_sync or getattr(self.model, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()


Builder = Callable[[torch.nn.Module, TrainConfig, Layout], Built]


@dataclass(frozen=True)
class Strategy:
    name: str
    build: Builder
    degrees: tuple[str, ...] = ("dp",)
    implementation: str = "minifsdp"              # or "torch": PyTorch's own, for comparison
    sharding_options: tuple[str, ...] = ()        # the --sharding-strategy values it takes (others ignore it)
    policy_cast: bool = False                     # a MixedPrecision policy casts its parameters: no autocast
    sharded_grads: bool = False                   # each rank holds part of the gradients
    own_train_step: bool = False                  # runs forward + backward itself: no fp16 loss scaling
    checkpoints_split_blocks: bool = False        # --checkpoint wraps tensor parallel's blocks, in the builder
    takes_precision: bool = True                  # --precision / --autocast are wired in
    expected_bytes: Callable[[TrainConfig, Layout], dict[str, Any]] | None = None
    check: Callable[[TrainConfig, Layout], None] | None = None   # the record's own one-line refusals
    state: Callable[[Built, TrainConfig], Any] | None = None      # save/resume: its state by name (None: ByName)
    doc: str = ""

    @property
    def is_torch(self) -> bool:
        return self.implementation == "torch"

    def layout(self, cfg: TrainConfig) -> Layout:
        """The degrees this strategy runs with ``cfg``'s flags (HYBRID_SHARD: 2 x (N/2)). Expert parallel
        runs inside data parallel: its dp is ``--world-size``, as data parallel's alone, and ``--ep`` divides it."""
        alone = self.degrees in (("dp",), ("dp", "ep"))
        dp = cfg.world_size if alone else cfg.dp if "dp" in self.degrees else 1
        pp = cfg.pp if "pp" in self.degrees else 1
        tp = cfg.tp if "tp" in self.degrees else 1
        cp = cfg.cp if "cp" in self.degrees else 1
        ep = cfg.ep if "ep" in self.degrees else 1
        if "HYBRID_SHARD" in self.sharding_options and cfg.sharding_strategy == "HYBRID_SHARD":
            return Layout.hybrid(dp, pp=pp, tp=tp)
        v = virtual_stages_for(cfg.schedule, cfg.virtual_stages) if "pp" in self.degrees else 1
        return Layout(dp=dp, pp=pp, tp=tp, virtual_stages=v, cp=cp, ep=ep)

    def default_world_size(self, cfg: TrainConfig) -> int:
        """``--world-size`` when the flag is not given: the layout's, data parallel alone at 2 ranks
        (expert parallel: at least ``--ep``)."""
        floor = max(2, cfg.ep) if "ep" in self.degrees else 2
        return self.layout(dataclasses.replace(cfg, world_size=floor)).world_size

    @property
    def option_choices(self) -> tuple[str, ...]:
        """What a bench side's ``@option`` may be: a pipeline's schedule, context parallel's split, else the
        sharding strategies the record takes (none: it takes no option)."""
        if "pp" in self.degrees:
            return PIPELINE_SCHEDULES
        return CP_SPLITS if "cp" in self.degrees else self.sharding_options

    def bench_flags(self, world_size: int, option: str | None = None) -> dict[str, Any]:
        """The trainer's flags that run this record as one side of a bench pair at ``world_size`` ranks
        (``option``: the side's ``@option``): a pipeline over all of them (m = 2 x pp, v = 2 for interleaved and
        zero-bubble), tp = world size, fsdp+tp's 2D as (world/2) x 2, cp or ep = world size (cp's split the
        option), one rank for single (the same total work on one process); else the sharding strategy."""
        degrees = self.degrees
        if "pp" in degrees:
            schedule = option or "1f1b"
            return dict(world_size=world_size, pp=world_size, schedule=schedule, micro_batches=2 * world_size,
                        virtual_stages=2 if schedule in MULTI_STAGE_SCHEDULES else 1)
        if "tp" in degrees:
            return dict(world_size=world_size, tp=world_size) if degrees == ("tp",) else \
                dict(world_size=world_size, dp=world_size // 2, tp=2)
        if "cp" in degrees or "ep" in degrees:
            return dict(world_size=world_size, cp=world_size, cp_split=option or CP_SPLITS[0], ep=world_size)
        return dict(world_size=world_size if degrees else 1, sharding_strategy=option or "FULL_SHARD")

    def grad_scaler(self, cfg: TrainConfig, device: torch.device) -> Any:
        """fp16 needs loss scaling (a pass-through otherwise); sharded gradients need the found-inf flag agreed on
        by every rank. torch's strategies get torch's scalers, so the benchmark compares like with like."""
        enabled = cfg.precision == "fp16"
        if self.is_torch:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
            return (TorchSharded(device.type, enabled=enabled) if self.sharded_grads
                    else torch.amp.GradScaler(device.type, enabled=enabled))
        from .mixed_precision import GradScaler, ShardedGradScaler, check_dtype_supported

        check_dtype_supported(PRECISIONS[cfg.precision], device)
        cls = ShardedGradScaler if self.sharded_grads else GradScaler
        return cls(device, enabled=enabled)

    def check_config(self, cfg: TrainConfig, layout: Layout) -> None:
        """One-line errors naming the fix for a model or flags this record cannot run (after ``layout.validate``)."""
        config = models.MODEL_PRESETS[cfg.model]
        if config.n_expert and not set(self.degrees) <= {"dp", "ep"}:
            raise ValueError(f"--model {cfg.model} is a mixture of experts, which --strategy {self.name} does not "
                             "split (pipeline, tensor and context parallel are built for dense GPTs): use data "
                             "parallel (single, ddp, fsdp, ...) or --strategy ep, or a dense model")
        if self.check is not None:
            self.check(cfg, layout)


class RoutingCounter:
    """A MoE GPT's routing, counted on this rank: each MoE layer's kept assignments per expert (this rank's
    tokens), summed over every forward of the run. A forward hook on each layer, no communication; a dense
    model has no layer and ``totals()`` is ``{}``. The trainer writes every rank's totals to
    ``metrics.json`` (``routing``): the load each expert got, and, for ``--strategy ep``, what
    ``planner.moe_all_to_all_volume`` turns into each rank's all-to-all bytes exactly. (``--checkpoint``
    re-runs forwards in backward, and they count too.)"""

    def __init__(self, model: torch.nn.Module) -> None:
        self._totals: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, models.MoE):
                module.register_forward_hook(functools.partial(self._count, name))

    def _count(self, name: str, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        kept = (module.tokens_per_expert - module.dropped_per_expert).detach().cpu()
        self._totals[name] = self._totals[name] + kept if name in self._totals else kept

    def totals(self) -> dict[str, list[int]]:
        return {name: t.tolist() for name, t in self._totals.items()}


def adamw(params: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def apply_checkpointing(model: torch.nn.Module, checkpoint: str, implementation: str = "minifsdp",
                        block: type = models.Block) -> None:
    """--checkpoint: wrap every ``block`` (a Block, or tensor parallel's ParallelBlock). full recomputes
    the whole block in backward; selective keeps its linear layers' outputs and recomputes the rest
    (minifsdp.checkpoint.selective). torch's strategies get torch's own checkpoint_wrapper, so the
    benchmark compares like with like."""
    from .checkpoint import LINEAR_OPS

    if implementation == "torch":
        import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as ac
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
    else:
        from . import checkpoint as ac
        from .checkpoint import create_selective_checkpoint_contexts
    selective = {"context_fn": functools.partial(create_selective_checkpoint_contexts, list(LINEAR_OPS))}
    wrapper = functools.partial(ac.checkpoint_wrapper, checkpoint_impl=ac.CheckpointImpl.NO_REENTRANT,
                                **(selective if checkpoint == "selective" else {}))
    ac.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, block))


def autocast(cfg: TrainConfig, device: torch.device, policy_cast: bool) -> Any:
    """One autocast region per forward (autocast caches 16-bit weight copies until its region ends):
    on with --autocast, or with --precision bf16/fp16 where no policy casts the parameters."""
    on = cfg.autocast or (cfg.precision != "fp32" and not policy_cast)
    return torch.autocast(device.type, dtype=PRECISIONS["fp16" if cfg.precision == "fp16" else "bf16"], enabled=on)


def pipeline_autocast(cfg: TrainConfig) -> torch.dtype | None:
    """A pipeline's share of --precision bf16 / --autocast: each stage's forward under bf16 autocast
    (fp16 is refused in validate: its loss scaling would have to run inside the schedule)."""
    return torch.bfloat16 if cfg.precision == "bf16" or cfg.autocast else None


def fully_shard_gpt(model: torch.nn.Module, cfg: TrainConfig, layout: Layout, implementation: str = "minifsdp") -> Built:
    """FSDP2's recipe: ``fully_shard`` each ``models.Block``, then the root; AdamW on the DTensor shards.

    One function for ``--strategy fsdp2`` (``minifsdp.fsdp``) and ``torch-fsdp2``
    (``torch.distributed.fsdp``): the two runs differ only by the import. The flags map
    as torch's FSDP1 names do onto FSDP2's arguments:

    ===================  ==========================================================
    --sharding-strategy  fully_shard
    ===================  ==========================================================
    FULL_SHARD           ``reshard_after_forward=None``: True for every block, the
                         root kept from forward to backward (its backward is first)
    SHARD_GRAD_OP        ``reshard_after_forward=False``: gathered once per step
    HYBRID_SHARD         FULL_SHARD on a 2-D mesh (replicate x shard) from the layout:
                         4 ranks = [[0, 1], [2, 3]], shard inside a row, all-reduce
                         the reduced shards down a column (HSDP)
    ===================  ==========================================================

    ``--precision bf16`` is ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``;
    ``--wrap none`` shards the root only; ``--checkpoint`` wrapped the blocks before this
    (the trainer's order). ``--grad-accum``: ``Built.no_sync`` turns
    ``set_requires_gradient_sync(False)`` on for every micro-batch but the last, so
    gradients are reduce-scattered once per step.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if implementation == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from .fsdp import MixedPrecisionPolicy, fully_shard
    if cfg.sharding_strategy == "HYBRID_SHARD":  # torch's HSDP asks for the dimensions' names
        mesh = init_device_mesh(dist.device().type, (layout.dp_replicate, layout.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(dist.device().type, (layout.dp,))
    reshard = False if cfg.sharding_strategy == "SHARD_GRAD_OP" else None
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
    for module in model.modules():
        if isinstance(module, models.Block) and cfg.wrap != "none":
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return Built(model, adamw(model.parameters(), cfg), no_sync=functools.partial(_without_gradient_sync, model))


@contextlib.contextmanager
def _without_gradient_sync(model: Any) -> Iterator[None]:
    """FSDP2's ``no_sync``: backward keeps the unsharded gradients (summed) instead of reduce-scattering them."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
