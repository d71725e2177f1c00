"""Every bad input minifsdp refuses, as data: one row per input.

One table is the source of both ``tests/test_bad_input.py`` (each row run: the
exception type, a fragment of the message that names the fix, one line, no
process started, no collective run) and ``docs/bad_input.md``
(``tools/bad_input_table.py`` runs each row and writes the message it got);
``bad_input_run.py`` runs a row.

A row is ``(id, area, what the user did, exception, fragment)``. What the user
did is Python source run with ``exec`` in ``bad_input_run.namespace()`` (the
package's public names and three small models: ``mlp()``, ``gpt()``, ``moe()``),
or the trainer's argv (``python -m minifsdp.train ...``): ``parse_args`` then
``validate``, or ``main`` where the check is ``launch``'s own, made before any
rank starts. ``world=N`` runs the source on rank 0 of an in-process group of N
ranks, so a constructor that needs N ranks is checked in one process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    id: str
    area: str
    source: str | None                  # Python run with exec in namespace(), or None for a CLI row
    raises: type[BaseException]
    fragment: str                       # part of the message: the fix it names
    argv: tuple[str, ...] | None = None  # python -m minifsdp.train ARGV
    world: int = 1                      # ranks of the in-process group the source runs in (1: no group)
    main: bool = False                  # CLI: train.main(argv) instead of parse_args + validate


def py(id: str, area: str, source: str, raises: type[BaseException], fragment: str, world: int = 1) -> Row:
    return Row(id, area, source, raises, fragment, world=world)


def cli(id: str, area: str, argv: str, raises: type[BaseException], fragment: str, main: bool = False) -> Row:
    return Row(id, area, None, raises, fragment, argv=tuple(argv.split()), main=main)


V, T, N = ValueError, TypeError, NotImplementedError
ROWS: list[Row] = [
    # ---- launch: checked before any rank starts
    py("launch-world-0", "launch", "launch(work, 0)", V, "world_size must be an integer >= 1"),
    py("launch-world-float", "launch", "launch(work, 2.0)", V, "world_size must be an integer >= 1, got 2.0"),
    py("launch-world-too-big", "launch", "launch(work, 64)", V, "use world_size <= 8, or torchrun across machines"),
    py("launch-not-callable", "launch", "launch('work', 2)", T, "fn must be callable"),
    py("launch-timeout-0", "launch", "launch(work, 2, timeout=0)", V, "timeout must be positive, finite seconds"),
    py("launch-timeout-str", "launch", "launch(work, 2, timeout='10')", V, "(e.g. timeout=120)"),
    py("launch-timeout-nan", "launch", "launch(work, 2, timeout=float('nan'))", V, "timeout must be positive, finite"),
    py("launch-backend-mpi", "launch", "launch(work, 2, backend='mpi')", V, "backend must be 'gloo'"),
    py("launch-threads", "launch", "launch(work, 2, threads_per_rank=-1)", V, "threads_per_rank must be an integer >= 1"),
    py("launch-nccl-no-gpu", "launch", "launch(work, 2, backend='nccl')", V, "or backend='gloo' to run 2 ranks"),
    # ---- the layout: world size = dp x pp x tp x cp, ep inside dp
    py("layout-degree-0", "layout", "Layout(dp=0).validate()", V, "--dp must be >= 1"),
    py("layout-world-size", "layout", "Layout(dp=2, tp=2).validate(world_size=6)", V, "use --world-size 4"),
    py("layout-cp-with-tp", "layout", "Layout(dp=2, tp=2, cp=2).validate()", V, "use --pp 1 --tp 1, or --cp 1"),
    py("layout-cp-with-ep", "layout", "Layout(dp=2, cp=2, ep=2).validate()", V, "use --cp 1 or --ep 1"),
    py("layout-ep-divides-dp", "layout", "Layout(dp=3, ep=2).validate()", V, "or an --ep that divides 3"),
    py("layout-hsdp-odd", "layout", "Layout.hybrid(3).validate()", V, "use an even --world-size"),
    py("layout-stages", "layout", "Layout(pp=4, virtual_stages=2).validate(n_layers=6)", V, "use fewer stages"),
    py("mesh-world-size", "layout", "DeviceMesh(dp=2, tp=2)", V, "choose sizes whose product is 2", world=2),
    py("mesh-degree-0", "layout", "DeviceMesh(dp=0)", V, "use 1 for a technique you do not use"),
    py("mesh-ep", "layout", "DeviceMesh(dp=4, ep=3)", V, "ep=3 must divide dp=4", world=4),
    py("mesh-dp-shard", "layout", "DeviceMesh(dp=4, dp_shard=3)", V, "dp_shard=3 must divide dp=4", world=4),
    # ---- model presets and their sizes
    py("model-unknown", "models", "build_model('gpt-huge')", V, "valid names: gpt-mini"),
    py("model-override", "models", "build_model('gpt-tiny', n_heads=4)", V, "GPTConfig fields:"),
    py("model-heads", "models", "GPTConfig(n_layer=2, n_head=4, n_embd=30, block_size=8)", V,
       "choose n_head among [1, 2, 3, 5, 6, 10, 15, 30]"),
    py("model-size-0", "models", "GPTConfig(n_layer=0, n_head=2, n_embd=8, block_size=8)", V,
       "sizes must be positive integers, got n_layer=0"),
    py("model-dropout", "models", "GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, dropout=1.5)", V,
       "must be in [0, 1)"),
    py("model-moe-every", "models", "GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, n_expert=4, moe_every=0)",
       V, "moe_every=0 must be >= 1"),
    py("model-top-k", "models", "GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, n_expert=2, top_k=3)", V,
       "choose top_k <= 2 or more experts"),
    # ---- dtypes and mixed precision
    py("dtype-policy-string", "mixed precision", "MixedPrecision(param_dtype='bf16')", T,
       "pass e.g. param_dtype=torch.bfloat16"),
    py("dtype-policy-int", "mixed precision", "MixedPrecisionPolicy(reduce_dtype=torch.int32)", T,
       "a policy dtype is a floating torch.dtype or None"),
    py("dtype-not-on-this-device", "mixed precision",
       "fully_shard(mlp(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float8_e4m3fn))", V,
       "cpu cannot compute in torch.float8_e4m3fn here", world=2),
    py("dtype-autocast-fp64", "mixed precision", "autocast('cpu', torch.float64)", V,
       "pass one of them, or enabled=False to run in fp32"),
    py("dtype-precision-name", "mixed precision", "policy_for('fp8')", V, "precision must be one of"),
    py("scaler-init-scale", "mixed precision", "GradScaler('cpu', init_scale=0)", V, "torch's default is 2.0**16"),
    py("scaler-growth", "mixed precision", "GradScaler('cpu', growth_factor=0.5)", V, "growth_factor must be > 1.0"),
    # ---- DDP
    py("ddp-not-a-module", "ddp", "DistributedDataParallel(mlp().state_dict())", T, "wraps a torch.nn.Module",
       world=2),
    py("ddp-bucket-cap", "ddp", "DistributedDataParallel(mlp(), bucket_cap_mb=0)", V,
       "bucket_cap_mb must be positive", world=2),
    py("ddp-frozen", "ddp", "DistributedDataParallel(mlp().requires_grad_(False))", V, "(do not wrap it)", world=2),
    py("ddp-device-ids-cpu", "ddp", "DistributedDataParallel(mlp(), device_ids=[0])", V, "pass device_ids=None",
       world=2),
    py("ddp-mixed-precision", "ddp", "DistributedDataParallel(mlp(), mixed_precision=torch.bfloat16)", T,
       "pass e.g. MixedPrecision(reduce_dtype=torch.bfloat16)", world=2),
    py("ddp-param-dtype", "ddp", "DistributedDataParallel(mlp(), mixed_precision=MixedPrecision(torch.bfloat16))",
       N, "compute in 16 bits with torch.autocast", world=2),
    py("ddp-unsupported", "ddp", "DistributedDataParallel(mlp(), skip_all_reduce_unused_params=True)", N,
       "leave it at its default", world=2),
    py("ddp-group-size", "ddp", "DistributedDataParallel(mlp(), process_group=2)", T,
       "takes a process group or None", world=2),
    py("ddp-naive-frozen", "ddp", "NaiveDataParallel(mlp().requires_grad_(False))", V, "(do not wrap it)", world=2),
    py("ddp-outside-group", "ddp", "DistributedDataParallel(mlp())", RuntimeError, "call it inside minifsdp.launch"),
    # ---- ZeRO
    py("zero-optim-name", "zero", "OSS(mlp().parameters(), optim='adam')", T, "such as torch.optim.AdamW"),
    py("zero-stage-3", "zero", "wrap_zero(mlp(), stage=3)", V, "for stage 3 use minifsdp.fsdp"),
    py("zero-plain-optimizer", "zero", "ShardedDataParallel(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1))",
       T, "needs the OSS optimizer(s)"),
    py("zero-other-params", "zero", "ShardedDataParallel(mlp(), OSS(mlp().parameters(), lr=0.1))", V,
       "build the OSS from this module's parameters", world=2),
    py("zero-overlap", "zero", "ZeroRedundancyOptimizer(mlp().parameters(), torch.optim.SGD, overlap_with_ddp=True)",
       N, "leave it False"),
    # ---- FSDP (flat parameters)
    py("fsdp-strategy-string", "fsdp", "FSDP(mlp(), sharding_strategy='SHARD_GRAD_OP')", T,
       "pass ShardingStrategy.SHARD_GRAD_OP", world=2),
    py("fsdp-prefetch-string", "fsdp", "FSDP(mlp(), backward_prefetch='BACKWARD_POST')", T,
       "pass BackwardPrefetch.BACKWARD_POST", world=2),
    py("fsdp-wrap-policy-set", "fsdp", "FSDP(gpt(), auto_wrap_policy={Block})", T,
       "pass ModuleWrapPolicy({Block})", world=2),
    py("fsdp-mixed-precision-dtype", "fsdp", "FSDP(mlp(), mixed_precision=torch.bfloat16)", T,
       "pass e.g. MixedPrecision(param_dtype=torch.bfloat16)", world=2),
    py("fsdp-mixed-dtypes", "fsdp", "FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double()))", V,
       "cast the model (model.float()) or wrap those modules separately", world=2),
    py("fsdp-wrapped-twice", "fsdp", "FSDP(FSDP(mlp()))", V, "wrap it once", world=2),
    py("fsdp-group-pair", "fsdp", "FSDP(mlp(), process_group=(None, None))", V,
       "or sharding_strategy=ShardingStrategy.HYBRID_SHARD", world=2),
    py("fsdp-grads-to-cpu", "fsdp", "FSDP(mlp(), move_grads_to_cpu=True)", V, "drop move_grads_to_cpu", world=2),
    py("fsdp-device-id-no-cuda", "fsdp", "FSDP(mlp(), device_id=0)", V, "leave device_id=None", world=2),
    py("fsdp-hybrid-shard-size", "fsdp", "init_hybrid_groups(shard_size=3)", V, "must divide the world size 4",
       world=4),
    py("fsdp-not-a-module", "fsdp", "FSDP(mlp().parameters())", T, "pass the model (or block) itself", world=2),
    # ---- per-parameter FSDP: fully_shard misuse
    py("fully-shard-twice", "fully_shard", "fully_shard(fully_shard(mlp()))", V, "call it once per module",
       world=2),
    py("fully-shard-list", "fully_shard", "fully_shard([nn.Linear(2, 2), nn.Linear(2, 2)])", N,
       "call it once per module", world=2),
    py("fully-shard-reshard-int", "fully_shard", "fully_shard(mlp(), reshard_after_forward=3)", V,
       "pick a factor of 4", world=4),
    py("fully-shard-scalar", "fully_shard", "m = mlp(); m.scale = nn.Parameter(torch.tensor(1.0)); fully_shard(m)",
       V, "make it a 1-D tensor of one element", world=2),
    py("fully-shard-mixed-dtypes", "fully_shard",
       "fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double()))", V, "cast the module to one dtype first",
       world=2),
    py("fully-shard-minifsdp-mesh", "fully_shard", "fully_shard(mlp(), mesh=DeviceMesh(dp=2))", V,
       "make one with init_device_mesh", world=2),
    py("fully-shard-mp-dtype", "fully_shard", "fully_shard(mlp(), mp_policy=torch.bfloat16)", T,
       "MixedPrecisionPolicy(param_dtype=torch.bfloat16)", world=2),
    py("fully-shard-offload-bool", "fully_shard", "fully_shard(mlp(), offload_policy=True)", T,
       "pass CPUOffloadPolicy()", world=2),
    # ---- pipeline: schedules, micro-batches, virtual stages
    py("pp-schedule-name", "pipeline", "make_plan('pipedream', 2, 4)", V, "choose one of: gpipe, 1f1b"),
    py("pp-virtual-stages", "pipeline", "make_plan('gpipe', 2, 4, v=2)", V, "use 'interleaved' or 'zero-bubble'"),
    py("pp-micro-batches-0", "pipeline", "ScheduleGPipe(PipelineStage(nn.Linear(2, 2), 0, 1, 'cpu'), 0)", V,
       "n_microbatches must be >= 1"),
    py("pp-micro-batch-split", "pipeline", "split_microbatches(torch.zeros(6, 3), 4)", V,
       "use a batch size that is a multiple of n_microbatches=4"),
    py("pp-stage-index", "pipeline", "PipelineStage(nn.Linear(2, 2), 5, 4, 'cpu')", V, "outside 0..3"),
    py("pp-stages-per-rank", "pipeline", "PipelineStage(nn.Linear(2, 2), 1, 3, 'cpu')", V,
       "use a multiple of 2 stages", world=2),
    py("pp-too-many-stages", "pipeline", "split_gpt(gpt(), 8)", V, "use at most 4 stages"),
    py("pp-balance", "pipeline", "split_gpt(gpt(), 2, balance=[1, 1])", V, "e.g. [2, 2]"),
    py("pp-tied-embeddings", "pipeline", "split_gpt(gpt(tie_embeddings=True), 2)", V, "tie_embeddings=False"),
    py("pp-world-size", "pipeline", "PipelineParallel(gpt(), pp=3, n_microbatches=4)", V, "launch 3 ranks",
       world=4),
    py("pp-virtual-stages-0", "pipeline",
       "PipelineParallel(gpt(), pp=1, n_microbatches=4, schedule='interleaved', virtual_stages=0)", V,
       "virtual_stages=0 must be >= 1"),
    py("pp-fp16", "pipeline", "PipelineParallel(gpt(), pp=1, n_microbatches=4, autocast_dtype=torch.float16)", V,
       "use torch.bfloat16 or None"),
    # ---- tensor parallel: divisibility of heads, hidden size, vocabulary, sequence
    py("tp-heads", "tensor parallel", "check_divisible(MODEL_PRESETS['gpt-tiny'], tp=3)", V,
       "n_head=2 is not divisible by tp=3"),
    py("tp-vocab", "tensor parallel", "initialize_model_parallel(4); VocabParallelEmbedding(250, 16)", V,
       "choose a tp that divides 250", world=4),
    py("tp-columns", "tensor parallel", "initialize_model_parallel(2); ColumnParallelLinear(16, 7)", V,
       "choose a tp that divides 7", world=2),
    py("tp-sequence", "tensor parallel", "check_divisible(MODEL_PRESETS['gpt-tiny'], 2, 7, sequence_parallel=True)",
       V, "use a sequence length that is a multiple of 2"),
    py("tp-row-sequence-parallel", "tensor parallel",
       "initialize_model_parallel(2); RowParallelLinear(8, 8, sequence_parallel=True)", V,
       "needs input_is_parallel=True", world=2),
    py("tp-world-size", "tensor parallel", "initialize_model_parallel(3)", V, "choose sizes that divide 4", world=4),
    py("tp-not-initialized", "tensor parallel", "tensor_parallel_gpt(gpt())", RuntimeError,
       "initialize_model_parallel(tp) on every rank first", world=2),
    py("tp-moe", "tensor parallel", "initialize_model_parallel(2); tensor_parallel_gpt(moe())", V,
       "split the experts with expert_parallel_gpt", world=2),
    py("tp-dropout", "tensor parallel", "initialize_model_parallel(2); tensor_parallel_gpt(gpt(dropout=0.1))", V,
       "needs dropout=0", world=2),
    # ---- context parallel: the sequence split
    py("cp-sequence", "context parallel", "check_sequence_length(6, cp=4, split='zigzag')", V,
       "use a sequence length that is a multiple of 8"),
    py("cp-split-name", "context parallel", "context_parallel_gpt(gpt(), split='stripes')", V,
       "split must be one of ('zigzag', 'naive')", world=2),
    py("cp-moe", "context parallel", "context_parallel_gpt(moe())", V, "train this one with expert parallel",
       world=2),
    py("cp-dropout", "context parallel", "context_parallel_gpt(gpt(dropout=0.1))", V, "needs dropout=0", world=2),
    # ---- expert parallel: ep vs experts
    py("ep-dense-model", "expert parallel", "expert_parallel_gpt(gpt())", V, "build gpt-moe-tiny or gpt-moe-small",
       world=2),
    py("ep-experts", "expert parallel", "expert_parallel_gpt(moe())", V, "choose an ep that divides 8", world=3),
    py("ep-group-size", "expert parallel", "expert_parallel_gpt(moe(), ep_group=2)", T,
       "pass e.g. mesh.DeviceMesh(...).get_group(dim)", world=2),
    py("ep-dispatcher", "expert parallel", "expert_parallel_gpt(moe(), dispatcher='ring')", V,
       "is not one of ('all_to_all', 'all_gather')", world=2),
    # ---- activation checkpointing
    py("ac-impl-string", "checkpoint", "checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl='no_reentrant')", T,
       "CheckpointImpl.NO_REENTRANT or CheckpointImpl.REENTRANT"),
    py("ac-not-a-module", "checkpoint", "checkpoint_wrapper(gpt().blocks.parameters())", T,
       "wraps a torch.nn.Module"),
    py("ac-policy-set", "checkpoint", "apply_activation_checkpointing(gpt(), auto_wrap_policy={Block})", T,
       "pass check_fn=lambda m: isinstance(m, (Block,))"),
    # ---- data: batch sizes vs ranks
    py("data-batch-vs-ranks", "data", "get_batch(0, 6, 8, rank=0, world_size=4)", V, "use a multiple of 4"),
    py("data-rank", "data", "get_batch(0, 8, 8, rank=4, world_size=4)", V, "outside [0, world_size=4)"),
    py("data-seq-len", "data", "get_batch(0, 8, 100_000)", V, "use seq_len <= 57499"),
    # ---- the trainer's CLI (python -m minifsdp.train ...)
    cli("cli-strategy", "trainer", "--strategy fsdp3", V, "choose one of: single, ddp-naive"),
    cli("cli-model", "trainer", "--model gpt-huge", V, "choose one of: gpt-tiny"),
    cli("cli-steps", "trainer", "--steps 0", V, "--steps must be >= 1"),
    cli("cli-world-size-0", "trainer", "--strategy ddp --world-size 0", V, "--world-size must be >= 1"),
    cli("cli-grad-accum", "trainer", "--grad-accum 0", V, "--grad-accum must be >= 1"),
    cli("cli-batch-vs-ranks", "trainer", "--strategy ddp --world-size 4 --batch-size 6", V, "(e.g. --batch-size 4)"),
    cli("cli-batch-vs-accum", "trainer", "--strategy ddp --world-size 2 --grad-accum 3", V,
        "world size x grad accum = 6"),
    cli("cli-seq-len", "trainer", "--seq-len 1000", V, "between 1 and the model's block size 32"),
    cli("cli-out", "trainer", "--out /dev/null/run", V, "choose another folder"),
    cli("cli-fsdp2-no-shard", "trainer", "--strategy fsdp2 --sharding-strategy NO_SHARD", V,
        "choose one of: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD"),
    cli("cli-sharding-name", "trainer", "--strategy fsdp --sharding-strategy FULL", V, "choose one of: FULL_SHARD"),
    cli("cli-hsdp-odd", "trainer", "--strategy fsdp --sharding-strategy HYBRID_SHARD --world-size 3", V,
        "use an even --world-size"),
    cli("cli-tp-world-size", "trainer", "--strategy tp --world-size 3", V, "use --world-size 2"),
    cli("cli-tp-heads", "trainer", "--strategy tp --tp 4 --world-size 4", V, "n_head=2 is not divisible by tp=4"),
    cli("cli-3d-world-size", "trainer", "--strategy 3d --world-size 4 --dp 3 --pp 1", V, "use --world-size 6"),
    cli("cli-pp-stages", "trainer", "--strategy pp --pp 8 --world-size 8", V, "use fewer stages"),
    cli("cli-pp-virtual-stages", "trainer", "--strategy pp --schedule gpipe --virtual-stages 2", V,
        "needs --schedule interleaved or zero-bubble"),
    cli("cli-pp-micro-batches", "trainer", "--strategy pp --micro-batches 3", V, "use a multiple of 3"),
    cli("cli-pp-grad-accum", "trainer", "--strategy pp --grad-accum 2", V, "use --micro-batches, not --grad-accum"),
    cli("cli-pp-fp16", "trainer", "--strategy pp --precision fp16", V, "use --precision bf16"),
    cli("cli-zero-bubble-recompute", "trainer", "--strategy pp --schedule zero-bubble --virtual-stages 2 "
        "--checkpoint full", V, "use --checkpoint none or another schedule"),
    cli("cli-torch-tp-accum", "trainer", "--strategy torch-tp --grad-accum 2", V, "drop --grad-accum"),
    cli("cli-torch-tp-fp16", "trainer", "--strategy torch-tp --precision fp16", V, "use --precision bf16"),
    cli("cli-precision-not-wired", "trainer", "--strategy cp --precision bf16", V, "use them with single, ddp"),
    cli("cli-single-world-size", "trainer", "--strategy single --world-size 2", V, "use --world-size 1"),
    cli("cli-torch-fsdp2-no-shard", "trainer", "--strategy torch-fsdp2 --sharding-strategy NO_SHARD", V,
        "choose one of: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD"),
    cli("cli-pp-dp-batch", "trainer", "--strategy pp+dp --dp 2 --world-size 4 --batch-size 4", V,
        "2 replica(s) x 4 micro-batches: use a multiple of 8"),
    cli("cli-sequence-parallel", "trainer", "--strategy tp --sequence-parallel --seq-len 7", V,
        "use a sequence length that is a multiple of 2"),
    cli("cli-cp-3", "trainer", "--strategy cp --cp 3 --world-size 3", V, "a multiple of 6"),
    cli("cli-tp-moe", "trainer", "--strategy tp --model gpt-moe-tiny", V, "or --strategy ep, or a dense model"),
    cli("cli-cp-sequence", "trainer", "--strategy cp --seq-len 6", V, "a multiple of 4"),
    cli("cli-ep-dense", "trainer", "--strategy ep", V, "build gpt-moe-tiny or gpt-moe-small"),
    cli("cli-ep-vs-world", "trainer", "--strategy ep --model gpt-moe-tiny --ep 3 --world-size 4", V,
        "use --world-size a multiple of 3"),
    cli("cli-ep-vs-experts", "trainer", "--strategy ep --model gpt-moe-tiny --ep 3 --world-size 3", V,
        "choose an ep that divides 8"),
    cli("cli-timeout", "trainer", "--strategy ddp --timeout 0", SystemExit, "error: timeout must be positive",
        main=True),
    cli("cli-world-size-too-big", "trainer", "--strategy ddp --world-size 64 --batch-size 64", SystemExit,
        "use world_size <= 8", main=True),
    cli("cli-pp-0", "trainer", "--strategy pp --pp 0", V, "--pp must be >= 1, got 0"),
    cli("cli-micro-batches-0", "trainer", "--strategy pp --micro-batches 0", V, "--micro-batches must be >= 1"),
    cli("cli-prefetch", "trainer", "--strategy fsdp --world-size 2 --prefetch EARLY", V,
        "--prefetch must be BACKWARD_PRE, BACKWARD_POST or NONE"),
    cli("cli-lr", "trainer", "--lr -1", V, "--lr must be a non-negative learning rate"),
    cli("cli-save-every", "trainer", "--save-every -1", V, "--save-every must be >= 0"),
    # ---- resume: --resume is read before any process starts
    cli("resume-not-a-folder", "resume", "--resume nowhere/checkpoints", V, "is not a folder"),
    py("resume-another-model", "resume",
       "trainer('--strategy fsdp --world-size 2 --model gpt-mini --resume ' + saved(model='gpt-tiny'))", V,
       "resume with --model gpt-tiny"),
    py("resume-another-strategy", "resume",
       "trainer('--strategy ddp --world-size 2 --resume ' + saved(strategy='fsdp'))", V,
       "resume with --strategy fsdp (at any data-parallel world size)"),
    py("resume-half-written", "resume", "trainer('--strategy fsdp --world-size 2 --resume ' + saved(complete=False))",
       V, "is a half-written checkpoint"),
    py("resume-no-checkpoint", "resume", "saved(complete=False); trainer('--strategy fsdp --world-size 2 --resume .')",
       V, "holds no complete checkpoint"),
    py("resume-steps-done", "resume", "trainer('--strategy fsdp --world-size 2 --steps 2 --resume ' + saved(step=2))",
       V, "pass --steps > 2"),
]
