"""One pipeline stage: a submodule, its place in the pipeline, and its micro-batches in flight.

Mirrors ``torch.distributed.pipelining.PipelineStage`` (same constructor), so a
script that builds stages by hand runs on minifsdp by changing the import.
The stage knows *how* to run one action on one micro-batch; *which* action
comes next is the schedule's business (``executor.py``).

Per micro-batch ``i`` a stage keeps what its backward will need (``_saved[i]``):
the input it received (a leaf that requires grad, so backward leaves the
gradient for the previous stage in ``input.grad``), its output, and on the last
stage the loss. The entry is deleted by the micro-batch's last backward action,
which frees the activations autograd saved: what 1F1B exploits.

Three backward flavours:

* ``B``  full backward: ``torch.autograd.backward(output, grad)``.
* ``I``  (zero bubble) gradient of the *input* only, sent upstream at once, and
  the gradient of every parameterised layer's *output* (captured by forward
  hooks), all in one autograd pass that keeps the graph.
* ``W``  (zero bubble) each layer's weight gradient from its output gradient:
  ``autograd.grad(layer_out, layer.params, g)``, which walks only that layer's
  own few nodes (for a Linear: ``g^T @ x``). Nothing waits for W, so the
  schedule parks it in a bubble. (Qi et al., "Zero Bubble Pipeline
  Parallelism", 2024; torch does the same split in ``pipelining/_backward.py``.)

What I keeps for W is the layers' *graph edges* (``get_gradient_edge``), not
their output tensors, and the stage's input, output and loss are dropped: the
autograd nodes W walks keep what they saved (a Linear's input), while a
layer's output that nothing saved (the logits, a projection before a
residual add) is freed at I. Holding the output tensors instead would keep
each of them alive from I to W, the bubble W waits in (README's measurement
notes give the peak it cost); torch's ``stage_backward_input`` keeps graph
nodes too.

Data parallel over replicas of a stage (``PipelineParallel(dp=...)``): the
submodule may be a ``minifsdp.ddp.DistributedDataParallel``, as with torch's
stage. Every forward runs under ``no_sync()`` and so does every backward but
the stage's last of the step (``last_backward=True``), which all-reduces the
accumulated gradients in DDP's buckets, overlapped with that backward.

Activation checkpointing per stage, torchgpipe's modes: ``always`` recompute
every micro-batch's forward in backward, ``except_last`` all but the last
micro-batch (its backward comes right after its forward anyway), ``never``.

Messages carry one tensor. The first activation a stage ever sends is preceded
by a small header (dtype, shape) so the receiver can allocate: shapes are
inferred at the first step, as torch does when ``input_args`` is not given.
(torch's stages also pass tuples; a GPT's stages hand over one hidden state,
and a tuple would need a header, a tag and a returned gradient per element,
so minifsdp refuses it with a one-line error instead.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import checkpoint as _checkpoint

from .. import comm, dist
from ..ddp import BucketedDataParallel

__all__ = ["PipelineStage", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("always", "except_last", "never")
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # dtype, ndim, up to 8 sizes
_ACT, _GRAD, _META = 0, 1, 2


@dataclass
class _Saved:
    """What micro-batch i's backward needs on this stage."""

    input: torch.Tensor | None = None      # received activation (leaf, requires grad)
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None       # last stage only
    # zero bubble: each parameterised layer's output edge and parameters (forward), the edge's
    # gradient (I); parameters no captured layer owns get their gradient in I, accumulated in W.
    layer_outputs: list[tuple[GradientEdge, list[nn.Parameter]]] = field(default_factory=list)
    layer_grads: list[torch.Tensor | None] = field(default_factory=list)
    loose: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)


def _accumulate(params: list[nn.Parameter], grads: tuple[torch.Tensor | None, ...]) -> None:
    """``param.grad += grad`` as autograd would (the first gradient is stored as is)."""
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else p.grad.add_(g)


def _prepare_for_backward(ddp: BucketedDataParallel) -> None:
    """Make the next backward of ``ddp`` all-reduce, although its forwards ran under ``no_sync()``.

    DDP decides at *forward* time whether a backward synchronises (torch's
    ``reducer.prepare_for_backward``; minifsdp's ``_armed``). A pipeline runs
    all m forwards of a stage before (GPipe) or between (1F1B) its backwards,
    so no forward can decide for the last backward: the stage decides here,
    right before it. torch's PipelineStage reaches into DDP the same way
    (``backward_maybe_with_nosync``; its source calls it a hack).
    """
    ddp._armed = True


def _as_tensor(args: Any, what: str) -> torch.Tensor | None:
    if args is None:
        return None
    if isinstance(args, (tuple, list)):
        if len(args) != 1:
            raise ValueError(f"{what}: minifsdp.pipeline passes one tensor between stages, got {len(args)}")
        args = args[0]
    if not isinstance(args, torch.Tensor):
        raise ValueError(f"{what}: expected a tensor, got {type(args).__name__}")
    return args


class PipelineStage:
    """``PipelineStage(submodule, stage_index, num_stages, device)``: torch's signature.

    ``input_args`` / ``output_args``: example micro-batch input / output (a
    tensor or 1-tuple); when given, the first step checks the shapes against
    them. ``group``: the pipeline's process group (default: the world); stage
    ``s`` must be built on the group rank ``s % group size``. ``checkpoint``
    (minifsdp's, torchgpipe's): ``always | except_last | never``.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device | str,
                 input_args: Any = None, output_args: Any = None, group: tdist.ProcessGroup | None = None,
                 *, checkpoint: str = "never") -> None:
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1} (num_stages={num_stages})")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={checkpoint!r}; choose one of: {', '.join(CHECKPOINT_MODES)}")
        self.submod = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        # Keep the caller's device object (dist.device()): a fresh torch.device("cpu") compares equal but
        # is not the one minifsdp.fake_gpu tells GPU tensors by.
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        self.group = group
        self.group_size, self.group_rank = dist.world_size(group), dist.rank(group)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.checkpoint = checkpoint
        self._ddp = submodule if isinstance(submodule, BucketedDataParallel) else None
        if num_stages % self.group_size:
            raise ValueError(f"{num_stages} stages do not spread evenly over a pipeline group of {self.group_size} "
                             f"ranks: use a multiple of {self.group_size} stages")
        if stage_index % self.group_size != self.group_rank:
            raise ValueError(f"stage {stage_index} lives on rank {stage_index % self.group_size} (stage s on rank "
                             f"s % {self.group_size}); this is rank {self.group_rank}: build it there")
        self.input_example = _as_tensor(input_args, f"stage {stage_index} input_args")
        self.output_example = _as_tensor(output_args, f"stage {stage_index} output_args")
        self._saved: dict[int, _Saved] = {}
        self.inbox: dict[int, torch.Tensor] = {}       # micro-batch -> input activation (received or handed over)
        self.grad_inbox: dict[int, torch.Tensor] = {}  # micro-batch -> gradient of this stage's output
        self.input_grads: dict[int, torch.Tensor] = {}  # micro-batch -> gradient of its input, to send
        self.output_chunks: dict[int, torch.Tensor] = {}
        self._recv_meta: tuple[torch.dtype, tuple[int, ...]] | None = None
        self._free: dict[int, list[torch.Tensor]] = {_ACT: [], _GRAD: []}  # receive buffers to reuse (_recv_buffer)
        self._lent: dict[tuple[int, int], torch.Tensor] = {}  # (_ACT or _GRAD, micro-batch) -> its buffer
        self._meta_sent = False
        self._split_weights = False
        self._capture: list[tuple[torch.Tensor, list[nn.Parameter]]] | None = None
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ peers
    def rank_of(self, stage: int) -> int:
        """Global rank holding ``stage`` (send/recv take global ranks, as in torch)."""
        r = stage % self.group_size
        return dist.global_rank(self.group, r)

    def is_local(self, stage: int) -> bool:
        return stage % self.group_size == self.group_rank

    def _tag(self, kind: int, stage: int, mb: int) -> int:
        # gloo matches a receive to the send with its tag; NCCL ignores tags and matches the
        # messages of two ranks in order, which validate() guarantees for every plan it passes.
        return (mb * self.num_stages + stage) * 3 + kind

    # ---------------------------------------------------------------- forward
    def _checkpointed(self, mb: int, n_microbatches: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and mb < n_microbatches - 1)

    def forward_one_chunk(self, mb: int, args: tuple = (), kwargs: dict | None = None,
                          n_microbatches: int = 1) -> torch.Tensor:
        """Run micro-batch ``mb`` through the submodule; keep what backward needs."""
        saved = _Saved()
        if not self.is_first:
            x = self.inbox.pop(mb).detach()  # a new leaf: a reused receive buffer never holds a .grad
            if x.is_floating_point():
                x.requires_grad_(True)
            saved.input, args, kwargs = x, (x,), {}
        kwargs = kwargs or {}
        self._capture = saved.layer_outputs if self._split_weights else None
        # DDP: no forward decides to synchronise (see _prepare_for_backward).
        no_sync = self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()
        try:
            with no_sync:
                if self._checkpointed(mb, n_microbatches) and torch.is_grad_enabled():
                    out = _checkpoint(self.submod, *args, use_reentrant=False, **kwargs)
                else:
                    out = self.submod(*args, **kwargs)
        finally:
            self._capture = None
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {self.stage_index} returned {type(out).__name__}; minifsdp.pipeline passes one "
                            "tensor between stages: return a single tensor")
        if self.output_example is not None and out.shape != self.output_example.shape:
            raise ValueError(f"stage {self.stage_index} produced shape {tuple(out.shape)} but its output_args say "
                             f"{tuple(self.output_example.shape)}: fix the submodule or output_args")
        saved.output = out
        self._saved[mb] = saved
        return out

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        self._saved[mb].loss = loss

    # --------------------------------------------------------------- backward
    def _root(self, mb: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        saved = self._saved[mb]
        if self.is_last:
            if saved.loss is None:
                raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {mb} needs a loss; "
                                   "give the schedule a loss_fn")
            return saved.loss, None
        return saved.output, self.grad_inbox.pop(mb)

    def backward_one_chunk(self, mb: int, last_backward: bool = False) -> torch.Tensor | None:
        """Full backward (B) of micro-batch ``mb``; returns the gradient of its input.

        ``last_backward``: the stage's last backward of the step, the one a DDP submodule
        all-reduces in (torch's argument of the same name).
        """
        root, grad = self._root(mb)
        saved = self._saved.pop(mb)
        if last_backward and self._ddp is not None:
            _prepare_for_backward(self._ddp)
        torch.autograd.backward(root, grad)
        self._give_back(_ACT, mb)
        self._give_back(_GRAD, mb)
        return None if saved.input is None else saved.input.grad

    def backward_input(self, mb: int) -> torch.Tensor | None:
        """Zero bubble's I: the input gradient (returned) and each layer output's gradient (kept for W)."""
        root, grad = self._root(mb)
        saved = self._saved[mb]
        firsts = [] if saved.input is None else [saved.input]
        edges = [e for e, _ in saved.layer_outputs]
        # Parameters whose layer never ran its forward (used directly by a parent, say) have no
        # captured output: their gradient is computed here, in I, and accumulated with W's.
        seen = {id(q) for _, ps in saved.layer_outputs for q in ps}
        loose = [q for q in self.submod.parameters() if q.requires_grad and id(q) not in seen]
        grads = torch.autograd.grad(root, firsts + edges + loose, grad, retain_graph=True, allow_unused=True)
        saved.layer_grads = list(grads[len(firsts):len(firsts) + len(edges)])
        saved.loose = [(q, g) for q, g in zip(loose, grads[len(firsts) + len(edges):]) if g is not None]
        # Drop the stage's input, output and loss: what only the input gradient needed is freed
        # now; W's edges keep the layers' own nodes (and what they saved) alive.
        saved.input = saved.output = saved.loss = None
        return grads[0] if firsts else None

    def backward_weight(self, mb: int, last_backward: bool = False) -> None:
        """Zero bubble's W: every layer's weight gradient from its output gradient, accumulated.

        Layer by layer, so only one layer's weight gradient exists beside ``.grad`` at a time;
        on the step's last W of a stage wrapped in DDP, all of them go to autograd's
        accumulator in one ``torch.autograd.backward(params, grads)``: one backward for DDP's
        gradient hooks to see, which all-reduces the buckets.
        """
        saved = self._saved.pop(mb)
        sync = last_backward and self._ddp is not None
        params, grads = [q for q, _ in saved.loose], [g for _, g in saved.loose]
        if not sync:
            _accumulate(params, grads)
        for k, (edge, ps) in enumerate(saved.layer_outputs):
            g, saved.layer_grads[k] = saved.layer_grads[k], None  # each output gradient freed once used (torch's
            if g is None:                                          # W drops each group's grads as it goes)
                continue
            gs = torch.autograd.grad(edge, ps, g, allow_unused=True)
            del g
            if sync:
                params += [q for q, gq in zip(ps, gs) if gq is not None]
                grads += [gq for gq in gs if gq is not None]
            else:
                _accumulate(ps, gs)
        if sync:
            _prepare_for_backward(self._ddp)
            torch.autograd.backward(params, grads)
        # only now: W's layers may view the input; I's last output gradient can be the received one itself
        self._give_back(_ACT, mb)
        self._give_back(_GRAD, mb)

    def enable_weight_split(self) -> None:
        """Capture each parameterised layer's output in forward (for I/W); needs no checkpointing."""
        if self.checkpoint != "never":
            raise ValueError("zero-bubble schedules split backward into I and W, which activation checkpointing "
                             "does not support here: build the stage with checkpoint='never'")
        if self._split_weights:
            return
        self._split_weights = True
        owned = {m: list(m.parameters(recurse=False)) for m in self.submod.modules()}
        for module, params in owned.items():
            params = [p for p in params if p.requires_grad]
            if params:
                self._hooks.append(module.register_forward_hook(self._capture_hook(params)))
        # Assumed: a layer's weights act only through its own forward (nn.Linear, LayerNorm,
        # Embedding do). A layer returning a tuple is refused by the hook below.

    def _capture_hook(self, params: list[nn.Parameter]) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self._capture is None or not torch.is_grad_enabled():
                return
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"zero bubble: {type(module).__name__} returns {type(output).__name__}; the I/W "
                                "split needs every layer with weights to return one tensor")
            self._capture.append((get_gradient_edge(output), params))
        return hook

    # --------------------------------------------------------------- messages
    def send_activation(self, mb: int) -> list[comm.Handle]:
        """Send micro-batch ``mb``'s output to the next stage (async); the first time, a shape header first."""
        out = self._saved[mb].output.detach()
        dst, handles = self.rank_of(self.stage_index + 1), []
        if not self._meta_sent:
            if out.dtype not in _DTYPES or out.dim() > _HEADER - 2:
                raise ValueError(f"stage {self.stage_index} output: dtype {out.dtype} / {out.dim()} dims cannot be "
                                 f"sent; use one of {_DTYPES} with at most {_HEADER - 2} dims")
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[0], header[1] = _DTYPES.index(out.dtype), out.dim()
            header[2:2 + out.dim()] = torch.tensor(out.shape)
            # Metadata, not training traffic (torch's shape inference is not counted either): sent past
            # the tracer, so traced bytes per step are the activations and gradients alone (planner.pp_comm_bytes).
            handles.append(tdist.isend(header, dst, group=self.group, tag=self._tag(_META, self.stage_index + 1, 0)))
            self._meta_sent = True
        handles.append(comm.isend(out.contiguous(), dst, group=self.group,
                                  tag=self._tag(_ACT, self.stage_index + 1, mb)))
        return handles

    def can_post_recv(self, kind: str, mb: int) -> bool:
        """Is the receive buffer's shape known yet (to post the receive ahead of time)?"""
        return self._recv_meta is not None if kind == "RECV_F" else mb in self._saved

    def recv_activation(self, mb: int, async_op: bool = False) -> comm.Handle | None:
        """Receive micro-batch ``mb``'s input into ``inbox[mb]``; ``async_op``: post it, ``wait()`` later."""
        src = self.rank_of(self.stage_index - 1)
        if self._recv_meta is None:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            tdist.recv(header, src, group=self.group, tag=self._tag(_META, self.stage_index, 0))  # untraced metadata
            dtype, shape = _DTYPES[int(header[0])], tuple(int(s) for s in header[2:2 + int(header[1])])
            ex = self.input_example
            if ex is not None and (tuple(ex.shape) != shape or ex.dtype != dtype):
                raise ValueError(f"stage {self.stage_index - 1} sends {dtype} {shape} but stage {self.stage_index} "
                                 f"expects {ex.dtype} {tuple(ex.shape)} (its input_args): make stage "
                                 f"{self.stage_index - 1}'s output match stage {self.stage_index}'s input")
            self._recv_meta = (dtype, shape)
        buf = self._recv_buffer(_ACT, mb, *self._recv_meta)
        self.inbox[mb] = buf  # read by the forward, after the receive completed
        tag = self._tag(_ACT, self.stage_index, mb)
        return comm.irecv(buf, src, group=self.group, tag=tag) if async_op else comm.recv(buf, src, self.group, tag)

    def send_grad(self, mb: int, grad: torch.Tensor) -> list[comm.Handle]:
        """Send the gradient of micro-batch ``mb``'s input to the previous stage (async)."""
        return [comm.isend(grad.contiguous(), self.rank_of(self.stage_index - 1), group=self.group,
                           tag=self._tag(_GRAD, self.stage_index, mb))]

    def recv_grad(self, mb: int, async_op: bool = False) -> comm.Handle | None:
        """Receive the gradient of micro-batch ``mb``'s output into ``grad_inbox[mb]`` (``async_op``: post it)."""
        out = self._saved[mb].output
        buf = self._recv_buffer(_GRAD, mb, out.dtype, tuple(out.shape))
        self.grad_inbox[mb] = buf
        src, tag = self.rank_of(self.stage_index + 1), self._tag(_GRAD, self.stage_index + 1, mb)
        return comm.irecv(buf, src, group=self.group, tag=tag) if async_op else comm.recv(buf, src, self.group, tag)

    def _recv_buffer(self, kind: int, mb: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Micro-batch ``mb``'s receive buffer: a free one from an earlier micro-batch or step, else a new one.
        Reused as torch's PipelineStage does (a new block per receive is mapped and faulted in every step);
        free again after its backward (``_give_back``): no more alive at once than before, the same peak."""
        free = self._free[kind]
        i = next((i for i, b in enumerate(free) if b.dtype == dtype and tuple(b.shape) == shape), None)
        buf = torch.empty(shape, dtype=dtype, device=self.device) if i is None else free.pop(i)
        self._lent[(kind, mb)] = buf
        return buf

    def _give_back(self, kind: int, mb: int) -> None:
        buf = self._lent.pop((kind, mb), None)
        if buf is not None:
            self._free[kind].append(buf)

    # ------------------------------------------------------------------ state
    def in_flight(self) -> list[int]:
        """Micro-batches whose activations this stage still holds."""
        return sorted(self._saved)

    def clear_runtime_states(self) -> None:
        for kind, mb in list(self._lent):  # nothing reads them any more: back to the free lists
            self._give_back(kind, mb)
        self._saved.clear()
        self.inbox.clear()
        self.grad_inbox.clear()
        self.input_grads.clear()
        self.output_chunks.clear()

    def scale_grads(self, factor: int) -> None:
        """Divide every gradient by ``factor`` (torch: the number of micro-batches for a mean loss)."""
        if factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(factor)

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, rank {self.group_rank}, {self.device})"
