"""minifsdp's strategies, one record each, and the trainer's list of every strategy (ours and torch's).

Front layer. A record (``records.Strategy``) says which layout degrees the
strategy reads, its traits, its builder and the bytes it must move per step;
the CLI's ``--strategy`` names are the keys of ``STRATEGIES``. Adding a
strategy is adding one record and its builder. Each builder below takes
``(model, cfg, layout)`` and returns a ``records.Built``:

    single      one process, the whole global batch (the yardstick)
    ddp-naive   all-reduce every gradient after backward       (minifsdp.ddp)
    ddp         bucketed all-reduce overlapped with backward    (minifsdp.ddp)
    zero1/zero2 optimizer-state / gradient sharding             (minifsdp.zero)
    fsdp        fully sharded data parallel, --sharding-strategy (minifsdp.fsdp)
    fsdp2       per-parameter sharding, fully_shard             (minifsdp.fsdp.fully_shard)
    pp, pp+dp   pipeline stages (x data-parallel replicas)      (minifsdp.pipeline)
    tp          Megatron tensor parallel                        (minifsdp.tensor_parallel)
    fsdp+tp     FSDP over --dp replicas of a --tp split model   (minifsdp.mesh)
    3d          --pp stages x --tp split layers x --dp replicas (pipeline + tensor_parallel)
    cp          ring attention over --cp ranks x --dp replicas  (minifsdp.context_parallel)
    ep          a MoE GPT's experts over --ep ranks, inside dp  (minifsdp.expert_parallel)
    torch-*     PyTorch's own, for comparison                   (minifsdp.torch_reference)

Every group comes from the layout: HYBRID_SHARD's (``layout.shard_size``; fsdp2's
2-D mesh, replicate x shard), the pipeline's, tensor parallel's, context parallel's
and expert parallel's (``DeviceMesh.from_layout``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import dist, estimate, models, planner, torch_reference
from .save_resume import ByName, FullFlatFSDP
from .layout import Layout
from .mixed_precision import PRECISIONS, MixedPrecision, policy_for
from .records import Built, Strategy, TrainConfig, adamw, apply_checkpointing, fully_shard_gpt, pipeline_autocast

__all__ = ["STRATEGIES"]


# --------------------------------------------------------------------------
# Data parallel: every rank a replica (dp = --world-size)
# --------------------------------------------------------------------------

def _single(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    return Built(model, adamw(model.parameters(), cfg))


def _reduce_policy(cfg: TrainConfig) -> Any:
    """DDP and ZeRO keep whole fp32 parameters: their share of --precision is the gradient dtype."""
    mp = policy_for(cfg.precision)
    return None if mp is None else MixedPrecision(reduce_dtype=mp.reduce_dtype)


def _ddp_naive(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    from .ddp import NaiveDataParallel

    wrapped = NaiveDataParallel(model)
    return Built(wrapped, adamw(wrapped.parameters(), cfg))


def _ddp(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    from .ddp import DistributedDataParallel

    wrapped = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, mixed_precision=_reduce_policy(cfg))
    return Built(wrapped, adamw(wrapped.parameters(), cfg))


def _zero1(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # DDP's bucketed, overlapped all-reduce + OSS, the pairing torch-zero1 uses
    # (DDP + ZeroRedundancyOptimizer). wrap_zero(stage=1) all-reduces one
    # gradient at a time: the same bytes, more calls.
    from .ddp import DistributedDataParallel
    from .zero import OSS

    wrapped = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb, mixed_precision=_reduce_policy(cfg))
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    return Built(wrapped, OSS(trainable, optim=torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay))


def _zero2(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    from .zero import wrap_zero

    return Built(*wrap_zero(model, stage=2, mixed_precision=_reduce_policy(cfg), lr=cfg.lr,
                            weight_decay=cfg.weight_decay))


def _fsdp(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    from .fsdp import BackwardPrefetch, CPUOffload, ModuleWrapPolicy, ShardingStrategy
    from .fsdp import FullyShardedDataParallel as FSDP
    from .fsdp import init_hybrid_groups, size_based_auto_wrap_policy

    policy = {"block": ModuleWrapPolicy({models.Block}), "none": None,
              "size": functools.partial(size_based_auto_wrap_policy, min_num_params=100_000)}[cfg.wrap]
    # HYBRID_SHARD: the layout's dp_shard x dp_replicate, the groups torch_reference.hybrid_groups gives torch-fsdp
    groups = init_hybrid_groups(shard_size=layout.shard_size) if layout.dp_shard is not None else None
    wrapped = FSDP(model, process_group=groups, auto_wrap_policy=policy,
                   sharding_strategy=ShardingStrategy[cfg.sharding_strategy],
                   backward_prefetch=BackwardPrefetch[cfg.prefetch] if cfg.prefetch != "NONE" else None,
                   cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
                   mixed_precision=policy_for(cfg.precision))
    return Built(wrapped, adamw(wrapped.parameters(), cfg))


def _data_parallel_bytes(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """``estimate.comm_bytes_per_step`` with this model's FSDP units (wrap=block), buffers, the layout's
    HYBRID_SHARD groups and --precision's dtypes: FSDP gathers and reduces 16-bit (policy p, p, p); DDP
    and ZeRO keep fp32 parameters (and buffers) and reduce 16-bit gradients (``reduce_dtype``); fp16's
    sharded gradient scaler all-reduces its found-inf flag (one fp32, counted twice) where gradients are
    sharded. ``paper``: the ZeRO paper's k·4Ψ (``estimate.paper_comm_bytes``; None where it has no row)."""
    model = models.build_model(cfg.model)
    name = cfg.strategy
    strategy = cfg.sharding_strategy.lower() if name == "fsdp" else name
    units, root = estimate.fsdp_unit_numels(model, (models.Block,))
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())
    low = PRECISIONS[cfg.precision]
    dtype = low if name == "fsdp" else torch.float32  # what is gathered / broadcast: FSDP's param_dtype
    grad_dtype = torch.float32 if name == "ddp-naive" else low  # what is reduced (ddp-naive has no policy)
    by_op = estimate.comm_bytes_per_step(units, layout.dp, strategy, dtype, root_numel=root, buffer_bytes=buffers,
                                         shard_size=layout.dp_shard, grad_dtype=grad_dtype)
    found_inf = 2 * 4 if cfg.precision == "fp16" and STRATEGIES[name].sharded_grads else 0
    total = by_op.pop("total") + found_inf
    if found_inf:
        by_op["all_reduce"] = by_op.get("all_reduce", 0) + found_inf
    n_params = sum(units) + root
    paper_key = strategy if strategy in estimate.ZERO_PAPER_PSI else None
    paper = estimate.paper_comm_bytes(n_params, strategy) if paper_key else None
    return {"total": total, "by_op": by_op, "paper": paper, "paper_key": paper_key, "n_params": n_params}


def _fsdp2(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # torch-fsdp2's recipe with minifsdp's fully_shard: each Block, then the root (records.fully_shard_gpt)
    return fully_shard_gpt(model, cfg, layout)


def _fully_shard_bytes(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """``estimate.fully_shard_comm_bytes`` for fsdp2's groups (each Block, then the root; --wrap none: the
    root alone): padded per parameter, reshard_after_forward None (FULL_SHARD, HYBRID_SHARD) or False
    (SHARD_GRAD_OP), --precision's dtype gathered and reduced, HYBRID_SHARD's shard group of
    ``layout.shard_size`` ranks, --grad-accum's forwards; fp16 adds the sharded scaler's found-inf flag."""
    model = models.build_model(cfg.model)
    groups, root = estimate.fully_shard_group_shapes(model, (models.Block,) if cfg.wrap != "none" else ())
    low = PRECISIONS[cfg.precision]
    by_op = estimate.fully_shard_comm_bytes(
        groups, layout.dp, low, root=root, shard_size=layout.shard_size, micro_batches=cfg.grad_accum,
        reshard_after_forward=False if cfg.sharding_strategy == "SHARD_GRAD_OP" else None)
    total = by_op.pop("total") + _found_inf(cfg)
    if _found_inf(cfg):
        by_op["all_reduce"] = by_op.get("all_reduce", 0) + _found_inf(cfg)
    return {"total": total, "by_op": by_op, "paper": None, "paper_key": None,
            "n_params": models.count_parameters(model)}


# --------------------------------------------------------------------------
# Pipeline, tensor parallel and their compositions: groups from the layout's mesh
# --------------------------------------------------------------------------

def _pipeline(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # This rank keeps only its stages; the loop calls train_step(x, y), which runs the
    # schedule (forward and backward, micro-batch by micro-batch).
    from .pipeline import PipelineParallel

    wrapped = PipelineParallel(model, layout.pp, cfg.micro_batches, cfg.schedule, layout.virtual_stages,
                               dp=layout.dp, autocast_dtype=pipeline_autocast(cfg))
    return Built(wrapped, adamw(wrapped.parameters(), cfg), train_step=wrapped.train_step,
                 data_rank=wrapped.data_parallel_rank, data_size=wrapped.data_parallel_size)


def _tensor_parallel(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # Megatron tensor parallel inside groups of --tp consecutive ranks; fsdp+tp (dp > 1 in its
    # layout) also shards each slice with FSDP over the --dp ranks that hold it: 2D.
    from .mesh import DeviceMesh
    from .tensor_parallel import ParallelBlock, ParallelGPT, initialize_model_parallel, tensor_parallel_gpt

    mesh = initialize_model_parallel(layout.tp, mesh=DeviceMesh.from_layout(layout))
    wrapped = tensor_parallel_gpt(model, sequence_parallel=cfg.sequence_parallel)
    if cfg.checkpoint != "none":  # the split blocks, before FSDP wraps them (as _fsdp's order)
        apply_checkpointing(wrapped, cfg.checkpoint, block=ParallelBlock)
    if "dp" in STRATEGIES[cfg.strategy].degrees:
        from .fsdp import FullyShardedDataParallel as FSDP
        from .fsdp import ModuleWrapPolicy, ShardingStrategy

        wrapped = FSDP(wrapped, process_group=mesh.get_group("dp"), auto_wrap_policy=ModuleWrapPolicy({ParallelBlock}),
                       sharding_strategy=ShardingStrategy[cfg.sharding_strategy],
                       mixed_precision=policy_for(cfg.precision))
    # vocab-parallel cross-entropy: the full logits never exist
    return Built(wrapped, adamw(wrapped.parameters(), cfg), loss_fn=ParallelGPT.loss,
                 data_rank=mesh.get_local_rank("dp"), data_size=layout.dp)


def _three_d(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # PP x TP x DP on one DeviceMesh (tp fastest): split every layer --tp ways, cut the split model
    # into --pp stages whose peers are the mesh's pp group, average gradients over its dp group.
    from .mesh import DeviceMesh
    from .pipeline import PipelineParallel
    from .tensor_parallel import ParallelBlock, ParallelGPT, initialize_model_parallel, tensor_parallel_gpt

    mesh = initialize_model_parallel(layout.tp, layout.pp, mesh=DeviceMesh.from_layout(layout))
    split = tensor_parallel_gpt(model)
    if cfg.checkpoint != "none":  # the split blocks, before the pipeline cuts the model (as _tensor_parallel)
        apply_checkpointing(split, cfg.checkpoint, block=ParallelBlock)
    wrapped = PipelineParallel(split, layout.pp, cfg.micro_batches, cfg.schedule,
                               layout.virtual_stages, dp=layout.dp, pp_group=mesh.get_group("pp"),
                               dp_group=mesh.get_group("dp") if layout.dp > 1 else None,
                               loss_fn=ParallelGPT.loss,  # the last stage's head is vocab-parallel
                               autocast_dtype=pipeline_autocast(cfg))
    return Built(wrapped, adamw(wrapped.parameters(), cfg), train_step=wrapped.train_step,
                 data_rank=wrapped.data_parallel_rank, data_size=wrapped.data_parallel_size)


def _split_state(hook: type) -> Any:
    """A record's save/resume hook whose tensors are split over the tensor-parallel group (known once built)."""
    def make(built: Built, cfg: TrainConfig) -> Any:
        from .tensor_parallel import get_model_parallel_group
        return hook(built, cfg, tp_group=get_model_parallel_group())
    return make


def _low_forward(cfg: TrainConfig) -> int:
    """Bytes per element of TP's row-parallel outputs: 2 under autocast or a 16-bit policy, else 4."""
    return 2 if cfg.autocast or cfg.precision != "fp32" else 4


def _recompute_per_token(cfg: TrainConfig) -> int:
    """--checkpoint re-runs each block's forward in backward up to its last saved tensor (early stop):
    the attention's row-parallel all-reduce (2x volume) again, not the MLP's closing one."""
    config = models.MODEL_PRESETS[cfg.model]
    return 0 if cfg.checkpoint == "none" else 2 * config.n_layer * config.n_embd * _low_forward(cfg)


def _found_inf(cfg: TrainConfig) -> int:
    return 2 * 4 if cfg.precision == "fp16" and STRATEGIES[cfg.strategy].sharded_grads else 0


def _result(by_op: dict[str, int], cfg: TrainConfig, total: int | None = -1) -> dict[str, Any]:
    return {"total": sum(by_op.values()) if total == -1 else total, "by_op": by_op, "paper": None,
            "paper_key": None, "n_params": models.count_parameters(models.build_model(cfg.model))}


def _pipeline_bytes(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """Rank 0's sends and receives (``planner.pp_comm_bytes``); no formula for a 16-bit pipeline's activations."""
    if cfg.precision != "fp32" or cfg.autocast:
        return _result({}, cfg, total=None)
    config = models.MODEL_PRESETS[cfg.model]
    holds = [s for s in range(layout.stages) if s % layout.pp == 0]
    return _result(planner.pp_comm_bytes(config, cfg.batch_size * (cfg.seq_len or config.block_size),
                                             layout.stages, holds), cfg)


def _tensor_parallel_bytes(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """tp: Megatron's all-reduces (``planner.tp_comm_bytes``), every rank the whole batch. fsdp+tp: the
    planner's plan, TP's all-reduces + FSDP over dp (units = blocks); 16-bit forward all-reduces under
    autocast, everything 16-bit but the loss under FSDP's policy."""
    config = models.MODEL_PRESETS[cfg.model]
    tokens = cfg.batch_size * (cfg.seq_len or config.block_size)
    if layout.dp == 1:
        by_op = planner.tp_comm_bytes(config, tokens, layout.tp, forward_elem=_low_forward(cfg))
        by_op["all_reduce"] += _recompute_per_token(cfg) * tokens + _found_inf(cfg)
        return _result(by_op, cfg)
    plan = planner.plan(cfg.model, batch=cfg.batch_size, layout=layout, zero_stage=3, precision=cfg.precision,
                        seq_len=cfg.seq_len)
    if cfg.autocast:  # fp32 parameters, autocast compute: only the forward g's are 16-bit
        plan.comm["tp"] = planner.tp_comm_bytes(config, tokens // layout.dp, layout.tp, forward_elem=2)
    by_op = {"all_reduce": _recompute_per_token(cfg) * tokens // layout.dp + _found_inf(cfg)}
    for ops in plan.comm.values():
        for op, b in ops.items():
            by_op[op] = by_op.get(op, 0) + b
    return _result(by_op, cfg)


# --------------------------------------------------------------------------
# Context parallel and expert parallel, each x data parallel: groups from the layout's mesh
# --------------------------------------------------------------------------

def _context_parallel(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # Ring attention inside the mesh's cp groups; every rank of a cp group reads its dp replica's sequences
    # and keeps its share of each (shard_sequence, ids and targets alike). DDP over every rank (dp x cp: the
    # world, as pp = tp = 1) averages the gradients: each rank's mean loss is over equal shares.
    from .context_parallel import context_parallel_gpt, shard_sequence
    from .ddp import DistributedDataParallel
    from .mesh import DeviceMesh

    mesh = DeviceMesh.from_layout(layout)
    cp_model = context_parallel_gpt(model, mesh.get_group("cp"), cfg.cp_split)
    wrapped = DistributedDataParallel(cp_model, bucket_cap_mb=cfg.bucket_cap_mb)
    shard = functools.partial(shard_sequence, cp=layout.cp, rank=mesh.get_local_rank("cp"), split=cfg.cp_split)
    return Built(wrapped, adamw(wrapped.parameters(), cfg), loss_fn=cp_model.loss, shard=shard,
                 data_rank=mesh.get_local_rank("dp"), data_size=layout.dp)


def _expert_parallel(model: torch.nn.Module, cfg: TrainConfig, layout: Layout) -> Built:
    # Each of the mesh's ep groups spreads the experts (E/ep a rank, in place); every rank reads its own
    # sequences (ep inside dp). After the step's last backward: replicated gradients averaged over dp, the
    # experts' summed over the edp group (the ranks holding the same experts) and divided by dp.
    from .expert_parallel import all_reduce_gradients, expert_parallel_gpt
    from .mesh import DeviceMesh

    mesh = DeviceMesh.from_layout(layout)
    expert_parallel_gpt(model, mesh.get_group("ep"))
    edp = mesh.get_group("edp") if layout.expert_replicas > 1 else None
    sync = functools.partial(all_reduce_gradients, model, mesh.get_group("ep"), dp_group=mesh.get_group("dp"),
                             expert_dp_group=edp)
    return Built(model, adamw(model.parameters(), cfg), sync_gradients=sync,
                 data_rank=mesh.get_local_rank("dp"), data_size=layout.dp)


def _check_context_parallel(cfg: TrainConfig, layout: Layout) -> None:
    from .context_parallel import SPLITS, check_sequence_length

    if cfg.cp_split not in SPLITS:
        raise ValueError(f"--cp-split must be one of {', '.join(SPLITS)}, got {cfg.cp_split!r}")
    if layout.cp < 2:
        raise ValueError(f"--strategy cp needs --cp >= 2 (got {layout.cp}); with one rank per sequence use ddp")
    _not_wired(cfg)
    check_sequence_length(cfg.seq_len or models.MODEL_PRESETS[cfg.model].block_size, layout.cp, cfg.cp_split)


def _check_expert_parallel(cfg: TrainConfig, layout: Layout) -> None:
    from .expert_parallel import check_expert_parallel

    if layout.ep < 2:
        raise ValueError(f"--strategy ep needs --ep >= 2 (got {layout.ep}); with every expert on every rank use ddp")
    _not_wired(cfg)
    check_expert_parallel(models.MODEL_PRESETS[cfg.model], layout.ep)


def _not_wired(cfg: TrainConfig) -> None:
    if cfg.checkpoint != "none":
        raise ValueError(f"--checkpoint is not wired into --strategy {cfg.strategy} yet: use --checkpoint none")


def _context_parallel_bytes(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """The planner's: the ring's K/V sends and receives (every layer, forward and backward) and DDP's
    all-reduce of the gradients over dp x cp (no buffers: a context-parallel GPT keeps no mask). Exact."""
    plan = planner.plan(cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len, layout=layout, cp_split=cfg.cp_split)
    return _result(_by_op(plan), cfg)


def _expert_parallel_bytes(cfg: TrainConfig, layout: Layout) -> dict[str, Any]:
    """The planner's: the MoE all-to-alls under the uniform routing (``planner.ep_comm_bytes``: the mean over
    the ep ranks is exact, each rank's own depends on its routing: ``exact`` False) and the gradient
    all-reduces (replicated over dp, experts over edp; exact)."""
    plan = planner.plan(cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len, layout=layout,
                        micro_batches=cfg.grad_accum)
    return {**_result(_by_op(plan), cfg), "exact": False}


def _by_op(plan: planner.Plan) -> dict[str, int]:
    by_op: dict[str, int] = {}
    for ops in plan.comm.values():
        for op, b in ops.items():
            by_op[op] = by_op.get(op, 0) + b
    return by_op


# --------------------------------------------------------------------------
# The records: the CLI's --strategy names
# --------------------------------------------------------------------------

_FSDP_OPTIONS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
_FSDP2_OPTIONS = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")  # FSDP2 has no NO_SHARD (DDP is that)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("single", _single, degrees=(), doc="one process, the whole batch"),
    Strategy("ddp-naive", _ddp_naive, takes_precision=False, expected_bytes=_data_parallel_bytes,
             doc="all-reduce every gradient after backward"),
    Strategy("ddp", _ddp, expected_bytes=_data_parallel_bytes, doc="bucketed all-reduce overlapped with backward"),
    Strategy("zero1", _zero1, expected_bytes=_data_parallel_bytes, doc="DDP + OSS: optimizer state sharded"),
    Strategy("zero2", _zero2, sharded_grads=True, expected_bytes=_data_parallel_bytes, doc="gradients sharded too"),
    Strategy("fsdp", _fsdp, sharding_options=_FSDP_OPTIONS, policy_cast=True, sharded_grads=True,
             expected_bytes=_data_parallel_bytes, state=FullFlatFSDP, doc="fully sharded data parallel"),
    Strategy("fsdp2", _fsdp2, sharding_options=_FSDP2_OPTIONS, policy_cast=True, sharded_grads=True,
             expected_bytes=_fully_shard_bytes, doc="per-parameter FSDP (fully_shard)"),
    Strategy("pp", _pipeline, degrees=("pp",), own_train_step=True, expected_bytes=_pipeline_bytes,
             doc="pipeline parallel"),
    Strategy("pp+dp", _pipeline, degrees=("pp", "dp"), own_train_step=True, doc="pipeline x data parallel"),
    Strategy("tp", _tensor_parallel, degrees=("tp",), sharded_grads=True, checkpoints_split_blocks=True,
             expected_bytes=_tensor_parallel_bytes, state=_split_state(ByName), doc="Megatron tensor parallel"),
    Strategy("fsdp+tp", _tensor_parallel, degrees=("dp", "tp"), sharding_options=_FSDP_OPTIONS[:3],
             policy_cast=True, sharded_grads=True, checkpoints_split_blocks=True,
             expected_bytes=_tensor_parallel_bytes, state=_split_state(FullFlatFSDP),
             doc="FSDP x tensor parallel (2D)"),
    Strategy("3d", _three_d, degrees=("dp", "pp", "tp"), own_train_step=True, checkpoints_split_blocks=True,
             state=_split_state(ByName), doc="pipeline x tensor x data parallel"),
    Strategy("cp", _context_parallel, degrees=("dp", "cp"), takes_precision=False, check=_check_context_parallel,
             expected_bytes=_context_parallel_bytes, doc="context parallel (ring attention) x data parallel"),
    Strategy("ep", _expert_parallel, degrees=("dp", "ep"), sharded_grads=True, takes_precision=False,
             check=_check_expert_parallel, expected_bytes=_expert_parallel_bytes,
             doc="expert parallel (MoE all-to-all) inside data parallel"),
    *torch_reference.STRATEGIES.values(),
)}
