"""Workers for the tensor-parallel tests (sent by value to the ranks; see tests/fsdp_helpers.py).

Each worker runs many checks per launch (launches cost seconds on 2 cores) and
returns the largest differences it saw; the tests assert on them.
"""

import sys

import cloudpickle
import torch

from minifsdp import models, trace
from minifsdp import tensor_parallel as T

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _err(a, b):
    return (a - b).abs().max().item()


def _saved_beyond(fn, *known):
    """fn()'s result and the bytes of storages autograd saved for backward while it ran, beyond ``known``'s."""
    skip, saved = {t.untyped_storage().data_ptr() for t in known}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def layer_checks(tp):
    """Each FairScale-style layer vs the full layer: outputs, input gradients, parameter-gradient slices."""
    T.initialize_model_parallel(tp)
    r, errs = T.get_model_parallel_rank(), {}
    x = torch.randn(3, 5, 8, generator=_gen(1))
    torch.manual_seed(0)

    # ColumnParallelLinear, both gather_output modes
    for gather in (True, False):
        full = torch.nn.Linear(8, 12)
        col = T.ColumnParallelLinear.from_linear(full, gather_output=gather)
        errs[f"col{gather}.shape"] = float(tuple(col.weight.shape) != (12 // tp, 8))
        xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        yf, yp = full(xf), col(xp)
        expect = yf if gather else yf.chunk(tp, -1)[r]
        errs[f"col{gather}.out"] = _err(yp, expect)
        up = torch.randn(yf.shape, generator=_gen(2))
        yf.backward(up)
        yp.backward(up if gather else up.chunk(tp, -1)[r])
        errs[f"col{gather}.dx"] = _err(xp.grad, xf.grad)
        errs[f"col{gather}.dw"] = _err(col.weight.grad, full.weight.grad.chunk(tp, 0)[r])
        errs[f"col{gather}.db"] = _err(col.bias.grad, full.bias.grad.chunk(tp, 0)[r])

    # RowParallelLinear, both input modes
    for parallel_in in (False, True):
        full = torch.nn.Linear(8, 6)
        row = T.RowParallelLinear.from_linear(full, input_is_parallel=parallel_in)
        errs[f"row{parallel_in}.shape"] = float(tuple(row.weight.shape) != (6, 8 // tp) or row.bias.shape != (6,))
        xf = x.clone().requires_grad_()
        xp = (x.chunk(tp, -1)[r] if parallel_in else x).clone().requires_grad_()
        yf, yp = full(xf), row(xp)
        errs[f"row{parallel_in}.out"] = _err(yp, yf)
        up = torch.randn(yf.shape, generator=_gen(3))
        yf.backward(up)
        yp.backward(up)
        expect_dx = xf.grad.chunk(tp, -1)[r] if parallel_in else xf.grad
        errs[f"row{parallel_in}.dx"] = _err(xp.grad, expect_dx)
        errs[f"row{parallel_in}.dw"] = _err(row.weight.grad, full.weight.grad.chunk(tp, 1)[r])
        errs[f"row{parallel_in}.db"] = _err(row.bias.grad, full.bias.grad)

    # VocabParallelEmbedding
    full = torch.nn.Embedding(16, 4)
    emb = T.VocabParallelEmbedding.from_embedding(full)
    ids = torch.randint(0, 16, (3, 7), generator=_gen(4))
    yf = full(ids)
    yp, errs["emb.saved_beyond_ids"] = _saved_beyond(lambda: emb(ids), ids)  # as torch's: ids only, no mask
    errs["emb.shape"] = float(tuple(emb.weight.shape) != (16 // tp, 4))
    errs["emb.out"] = _err(yp, yf)
    up = torch.randn(yf.shape, generator=_gen(5))
    yf.backward(up)
    yp.backward(up)
    errs["emb.dw"] = _err(emb.weight.grad, full.weight.grad.chunk(tp, 0)[r])

    # vocab_parallel_cross_entropy: per-token loss and logits gradient, input untouched
    logits = torch.randn(3, 7, 16, generator=_gen(6)) * 3
    target = torch.randint(0, 16, (3, 7), generator=_gen(7))
    lf = logits.clone().requires_grad_()
    local = logits.chunk(tp, -1)[r].clone().requires_grad_()
    before = local.detach().clone()
    ref = torch.nn.functional.cross_entropy(lf.reshape(-1, 16), target.reshape(-1), reduction="none").view(3, 7)
    loss, saved = _saved_beyond(lambda: T.vocab_parallel_cross_entropy(local, target), local, target)
    errs["ce.saved_beyond_softmax"] = saved - local.numel() * local.element_size()  # no per-token buffers
    errs["ce.out"] = _err(loss, ref)
    errs["ce.inplace"] = _err(local.detach(), before)
    up = torch.randn(3, 7, generator=_gen(8))
    ref.backward(up)
    loss.backward(up, retain_graph=True)
    errs["ce.dlogits"] = _err(local.grad, lf.grad.chunk(tp, -1)[r])
    loss.backward(up)  # a retained graph runs again: backward left the saved softmax as it was
    errs["ce.retained"] = _err(local.grad, 2 * lf.grad.chunk(tp, -1)[r])

    # a second initialize with the same size is harmless; another size is refused
    mesh = T.get_mesh()
    errs["init.twice"] = float(T.initialize_model_parallel(tp) is not mesh)
    try:
        T.initialize_model_parallel(1 if tp > 1 else 2)
        errs["init.other"] = 1.0
    except ValueError as e:
        errs["init.other"] = float("destroy_model_parallel" not in str(e))
    return errs


def fairscale_checks(tp):
    """Our layers beside FairScale's, same master weights: outputs and gradients equal."""
    from fairscale.nn.model_parallel import initialize as fs_init
    from fairscale.nn.model_parallel import layers as fs_layers
    from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy as fs_ce

    fs_init.initialize_model_parallel(tp)
    T.initialize_model_parallel(tp)
    errs = {}
    x = torch.randn(2, 5, 8, generator=_gen(11))
    pairs = [("col", fs_layers.ColumnParallelLinear, T.ColumnParallelLinear, (8, 12), {"gather_output": False}),
             ("row", fs_layers.RowParallelLinear, T.RowParallelLinear, (8, 6), {}),
             ("emb", fs_layers.VocabParallelEmbedding, T.VocabParallelEmbedding, (16, 8), {})]
    for name, fs_cls, our_cls, shape, kw in pairs:
        torch.manual_seed(5)
        theirs = fs_cls(*shape, **kw)
        torch.manual_seed(5)
        ours = our_cls(*shape, **kw)
        errs[f"{name}.weight"] = _err(ours.weight, theirs.weight)
        inp = torch.randint(0, 16, (2, 5), generator=_gen(12)) if name == "emb" else x
        yo, yt = ours(inp), theirs(inp)
        errs[f"{name}.out"] = _err(yo, yt)
        yo.square().sum().backward()
        yt.square().sum().backward()
        errs[f"{name}.dw"] = _err(ours.weight.grad, theirs.weight.grad)
    logits = torch.randn(2, 5, 16 // tp, generator=_gen(13 + T.get_model_parallel_rank()))
    target = torch.randint(0, 16, (2, 5), generator=_gen(14))
    errs["ce"] = _err(T.vocab_parallel_cross_entropy(logits.clone(), target), fs_ce(logits.clone(), target))
    return errs


def gpt_parity(tp, sequence_parallel_modes=(False, True), steps=3, n_head=4):
    """ParallelGPT vs the full GPT on every rank: losses, gradient slices per step, parameters after
    ``steps`` AdamW steps. Returns {mode: {"loss": .., "grad": .., "param": ..}} (max abs differences)."""
    T.initialize_model_parallel(tp)
    out = {}
    for sp in sequence_parallel_modes:
        full = models.build_model("gpt-tiny", n_head=n_head)
        par = T.tensor_parallel_gpt(full, sequence_parallel=sp)
        opt_f = torch.optim.AdamW(full.parameters(), lr=1e-3, weight_decay=0.1)
        opt_p = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.1)
        errs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        for step in range(steps):
            data = torch.randint(0, 256, (4, 17), generator=_gen(100 + step))
            x, y = data[:, :-1], data[:, 1:]
            lf = models.lm_loss(full(x), y)
            lp = par.loss(par(x), y)
            lf.backward()
            lp.backward()
            errs["loss"] = max(errs["loss"], abs(lf.item() - lp.item()) / abs(lf.item()))
            expect = T.local_slices(par, full, grads=True)
            errs["grad"] = max(errs["grad"], max(_err(p.grad, expect[n]) for n, p in par.named_parameters()))
            opt_f.step(), opt_p.step()
            opt_f.zero_grad(), opt_p.zero_grad()
        expect = T.local_slices(par, full)
        errs["param"] = max(_err(p.detach(), expect[n]) for n, p in par.named_parameters())
        out[f"sp={sp}"] = errs
    return out


def block_collectives(tp, sequence_parallel, b=2, s=8):
    """The collectives one ParallelBlock issues forward and backward: [(op, numel)] for each."""
    T.initialize_model_parallel(tp)
    full = models.build_model("gpt-tiny", n_head=4)
    block = T.ParallelBlock(full.blocks[0], sequence_parallel)
    h = full.config.n_embd
    x = torch.randn(b, s // tp if sequence_parallel else s, h, generator=_gen(20), requires_grad=True)
    calls = {}
    for phase in ("forward", "backward"):
        tracer = trace.Tracer()
        with tracer:
            if phase == "forward":
                y = block(x)
            else:
                y.sum().backward()
        calls[phase] = [(sp.name, sp.args["numel"], sp.args["bytes"]) for sp in tracer.trace.comm_spans()]
    return calls


def bad_input(tp, seq_len=16, sequence_parallel=False, **override):
    """The one-line error for a GPT that cannot be split, or None."""
    T.initialize_model_parallel(tp)
    try:
        par = T.tensor_parallel_gpt(models.build_model("gpt-tiny", **override), sequence_parallel=sequence_parallel)
        par(torch.zeros(1, seq_len, dtype=torch.long))
    except ValueError as e:
        return str(e)


def torch_tp_mlp(tp, sequence_parallel):
    """Our ParallelMLP beside torch.distributed.tensor.parallel's Colwise/Rowwise (+ Shard(1) layouts for
    SP) on the same FeedForward: outputs, input gradients and this rank's weight gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    T.initialize_model_parallel(tp)
    r = T.get_model_parallel_rank()
    block = models.build_model("gpt-tiny", seed=9).blocks[0]
    ours = T.ParallelMLP(block.mlp, sequence_parallel)
    theirs = parallelize_module(block.mlp, init_device_mesh("cpu", (tp,)), {
        "c_fc": ColwiseParallel(input_layouts=Shard(1)) if sequence_parallel else ColwiseParallel(),
        "c_proj": RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()})
    x = torch.randn(2, 8, 32, generator=_gen(30))
    if sequence_parallel:
        x = x.chunk(tp, dim=1)[r]
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yt = ours(xo), theirs(xt)
    up = torch.randn(yo.shape, generator=_gen(31 + r))
    yo.backward(up)
    yt.backward(up)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return {"out": _err(yo, yt), "dx": _err(xo.grad, xt.grad),
            "c_fc": _err(ours.c_fc.weight.grad, local(theirs.c_fc.weight.grad)),
            "c_proj": _err(ours.c_proj.weight.grad, local(theirs.c_proj.weight.grad)),
            "bias": _err(ours.c_proj.bias.grad, local(theirs.c_proj.bias.grad).reshape(-1))}


def activations_after_forward(tp, sequence_parallel, batch=4, seq=64, **override):
    """Bytes saved for backward after one forward of the (tensor-parallel) GPT, measured by the tracker."""
    from minifsdp.memory import ACTIVATIONS, MemoryTracker

    T.initialize_model_parallel(tp)
    full = models.build_model("gpt-mini", **override)
    model = T.tensor_parallel_gpt(full, sequence_parallel) if tp > 1 else full
    x = torch.randint(0, 256, (batch, seq), generator=_gen(40))
    tracker = MemoryTracker()
    tracker.track_model(model)
    with tracker:
        logits = model(x)
        loss = T.ParallelGPT.loss(logits, x) if tp > 1 else models.lm_loss(logits, x)
        kept = tracker.snapshot("forward")[ACTIVATIONS] - loss.nbytes
    tracker.close()
    return kept


def fsdp_tp_parity(dp, tp, steps=3):
    """FSDP over the dp dimension of a (dp x tp) DeviceMesh (``device_mesh=``), tensor parallel inside, vs the
    full GPT on the whole batch: global loss, gradient and parameter slices (gathered by summon_full_params)
    each step and after ``steps`` AdamW steps. Returns the largest differences."""
    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ModuleWrapPolicy
    from minifsdp.mesh import DeviceMesh

    mesh = DeviceMesh(dp=dp, tp=tp)
    T.initialize_model_parallel(tp, mesh=mesh)
    full = models.build_model("gpt-tiny", n_head=4)
    layout = T.tensor_parallel_gpt(models.build_model("gpt-tiny", n_head=4))  # names and slices, never trained
    model = FSDP(T.tensor_parallel_gpt(full), device_mesh=mesh, auto_wrap_policy=ModuleWrapPolicy({T.ParallelBlock}))
    opt_f = torch.optim.AdamW(full.parameters(), lr=1e-3, weight_decay=0.1)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    d, rows = mesh.get_local_rank("dp"), 4 // dp
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def compare(key, grads):
        expect = T.local_slices(layout, full, grads=grads)
        with FSDP.summon_full_params(model, with_grads=grads):
            for name, p in model.named_parameters():
                name = name.replace("_fsdp_wrapped_module.", "")
                errs[key] = max(errs[key], _err(p.grad if grads else p.detach(), expect[name]))

    for step in range(steps):
        data = torch.randint(0, 256, (4, 17), generator=_gen(100 + step))
        x, y = data[:, :-1], data[:, 1:]
        lf = models.lm_loss(full(x), y)
        lp = T.ParallelGPT.loss(model(x[d * rows:(d + 1) * rows]), y[d * rows:(d + 1) * rows])
        lf.backward()
        lp.backward()
        total = lp.detach().clone()
        torch.distributed.all_reduce(total, group=mesh.get_group("dp"))
        errs["loss"] = max(errs["loss"], abs(lf.item() - total.item() / dp) / abs(lf.item()))
        compare("grad", True)
        opt_f.step(), opt_p.step()
        opt_f.zero_grad(), opt_p.zero_grad()
    compare("param", False)
    return errs


def three_d_parity(pp, tp, dp, steps=3, micro_batches=2):
    """PP x TP x DP (the trainer's 3d: a DeviceMesh, the tensor-parallel GPT cut into pp stages, DDP over
    dp) vs the full GPT on the whole batch: global loss, and the gradient and parameter slices of this
    rank's stages each step and after ``steps`` AdamW steps. Returns the largest differences."""
    from minifsdp.mesh import DeviceMesh
    from minifsdp.pipeline import PipelineParallel

    mesh = T.initialize_model_parallel(tp, pp, mesh=DeviceMesh(dp=dp, pp=pp, tp=tp))
    full = models.build_model("gpt-tiny", n_head=4)
    par = T.tensor_parallel_gpt(models.build_model("gpt-tiny", n_head=4))  # same init: the seed is fixed
    model = PipelineParallel(par, pp, micro_batches, "1f1b", dp=dp, pp_group=mesh.get_group("pp"),
                             dp_group=mesh.get_group("dp") if dp > 1 else None, loss_fn=T.ParallelGPT.loss)
    mine = {id(p) for p in model.parameters()}
    opt_f = torch.optim.AdamW(full.parameters(), lr=1e-3, weight_decay=0.1)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    d, rows = model.data_parallel_rank, 4 // dp
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "compared": 0}

    def compare(key, grads):
        expect = T.local_slices(par, full, grads=grads)
        for name, p in par.named_parameters():
            if id(p) in mine:  # this rank's stages; the rest of par is another rank's
                errs[key] = max(errs[key], _err(p.grad if grads else p.detach(), expect[name]))
                errs["compared"] += 1

    for step in range(steps):
        data = torch.randint(0, 256, (4, 17), generator=_gen(100 + step))
        x, y = data[:, :-1], data[:, 1:]
        lf = models.lm_loss(full(x), y)
        lf.backward()
        lp = model.train_step(x[d * rows:(d + 1) * rows], y[d * rows:(d + 1) * rows]).detach().clone()
        if dp > 1:
            torch.distributed.all_reduce(lp, group=mesh.get_group("dp"))
        errs["loss"] = max(errs["loss"], abs(lf.item() - lp.item() / dp) / abs(lf.item()))
        compare("grad", True)
        opt_f.step(), opt_p.step()
        opt_f.zero_grad(), opt_p.zero_grad()
    compare("param", False)
    return errs
