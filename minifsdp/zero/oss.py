"""ZeRO stage 1: optimizer-state sharding, the way FairScale's ``OSS`` does it.

Layer 5 (techniques). Mirrors ``fairscale.optim.OSS``; the idea is stage 1 of
ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", 2020, section 5.1). ZeRO-2 (gradient sharding,
``ShardedDataParallel``) lives next door in ``sharded_dp.py``.

The observation: in data parallel training every rank runs *the same*
optimizer step on *the same* gradients and keeps *the same* optimizer state.
AdamW keeps two fp32 tensors per parameter (``exp_avg``, ``exp_avg_sq``): 8
bytes per parameter, twice the weights themselves, held N times over. ZeRO-1
splits the parameters among the ranks; each rank keeps state for, and steps,
only the parameters it *owns*, then every rank sends its freshly updated
parameters to the others:

    rank 0 owns {wte, ln}      rank 1 owns {head, mlp}      (greedy by size)
    backward -> all-reduce grads (every rank has every averaged gradient)
    rank 0: AdamW.step on {wte, ln}   rank 1: AdamW.step on {head, mlp}
    broadcast wte, ln from rank 0;    broadcast head, mlp from rank 1

    >>> # inside minifsdp.launch(fn, 2):
    >>> opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)   # FairScale's default: SGD
    >>> loss_fn(model(x)).backward(); all_reduce_gradients(model)
    >>> opt.step()                      # steps the local shard, then re-assembles
    >>> opt.consolidate_state_dict(0)   # every rank calls it
    >>> full = opt.state_dict()         # on rank 0: same as one AdamW's state_dict

Bytes per step (comm's volume convention, P = bytes of the parameters it holds): the
gradient all-reduce moves 2P, re-assembling the parameters by broadcast from
their owners moves P, so FairScale-style ZeRO-1 costs **3P** where DDP costs
2P. (The ZeRO paper reaches 2P for stage 1 too by replacing the all-reduce
with a reduce-scatter, which is what stage 2 does: see ``sharded_dp.py``.)
``estimate.comm_bytes_per_step(n_params, N, "zero1")`` gives these bytes exactly.
Optimizer state per rank: the state of the owned parameters only, ≈ 1/N.

Read first: ``ddp/`` (the data parallel training this shards); then this
file; then ``sharded_dp.py`` (ZeRO-2) and ``zero_redundancy.py`` (torch's name for OSS).
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable

import torch
from torch.distributed import ProcessGroup

from .. import comm, dist, trace

__all__ = ["OSS", "partition_parameters", "all_reduce_gradients", "local_state_bytes"]


def partition_parameters(params: list[torch.Tensor], world_size: int) -> list[int]:
    """Owner rank of each parameter: greedy, biggest first, onto the least-loaded rank.

    This is the "longest processing time first" heuristic. FairScale's
    ``partition_parameters`` does the same greedy fill (least-loaded rank
    first); sorting by size first keeps the ranks closer to P/N each. Ties
    break by position, so every rank computes the same answer on its own.

    >>> ps = [torch.zeros(10), torch.zeros(7), torch.zeros(5), torch.zeros(4)]
    >>> partition_parameters(ps, 2)   # rank 0: 10 + 4 = 14, rank 1: 7 + 5 = 12
    [0, 1, 1, 0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = load.index(min(load))
        owner[i] = rank
        load[rank] += params[i].numel()
    return owner


def local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds in ``optimizer.state``, measured (for an ``OSS``: its shard only).

    The prediction for a parameter count is ``estimate.optimizer_state_bytes_for``.
    """
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if torch.is_tensor(v))


def all_reduce_gradients(module: torch.nn.Module, group: ProcessGroup | None = None) -> None:
    """Average every gradient over the ranks (plain DDP after backward; volume 2P).

    The non-overlapped, one-call-per-tensor version, good for reading; the
    ``ShardedDataParallel(..., shard_gradients=False)`` wrapper does the same
    from inside backward.
    """
    n = dist.world_size(group)
    if n == 1:
        return
    for p in module.parameters():
        if p.grad is not None:
            p.grad.div_(n)
            comm.all_reduce(p.grad, group=group)


class OSS(torch.optim.Optimizer):
    """Optimizer State Sharding: wraps ``optim`` so each rank keeps 1/N of its state.

    ``OSS(params, optim=torch.optim.SGD, group=None, broadcast_buffer_size=-1, broadcast_fp16=False,
    force_broadcast_object=False, **defaults)`` takes the arguments of ``fairscale.optim.OSS``,
    defaults included (SGD when ``optim`` is not given). ``params`` and ``defaults``
    are what you would give ``optim``. ``param_groups`` holds *every* parameter
    (so ``zero_grad``, LR schedulers and gradient clipping see the whole model);
    ``self.optim`` is the inner optimizer, built on this rank's partition only,
    and ``self.state`` is its state. ``broadcast_buffer_size`` (bytes): small
    parameters of one owner travel packed together in flat buffers up to this
    size, bigger ones alone; 0 broadcasts every parameter by itself, -1
    (FairScale's "unset", the default) means 1 MiB. ``broadcast_fp16=True``
    sends the updated parameters as fp16 (P/2 bytes instead of P for fp32) and
    every rank, the owner too, keeps the fp16-rounded values, as FairScale
    does, so the replicas stay identical. ``force_broadcast_object`` is
    accepted for FairScale's sake and changes nothing.

    Works in a world of one without a process group (then it is just ``optim``). With more ranks the small
    parameters move into flat broadcast buckets when the OSS is built (``_make_flat_buckets``): give a
    memory tracker the model after that (``tracker.track_model(model)``), or it books their old storage.
    """

    def __init__(self, params: Iterable[Any], optim: type[torch.optim.Optimizer] = torch.optim.SGD,
                 group: ProcessGroup | None = None, broadcast_buffer_size: int = -1,
                 broadcast_fp16: bool = False, force_broadcast_object: bool = False, **defaults: Any):
        if not (isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer)):
            raise TypeError(f"OSS(optim=...) takes an optimizer class such as torch.optim.AdamW, got {optim!r}")
        if broadcast_buffer_size < 0:  # FairScale's "unset" (-1): 1 MiB buckets
            broadcast_buffer_size = 2**20
        self.broadcast_fp16 = broadcast_fp16
        del force_broadcast_object  # FairScale's switch for how state dicts travel; ours always serialise
        self._building = True  # Optimizer.__init__ calls add_param_group for every group
        super().__init__(params, defaults)
        self._building = False
        self.group, self.optim_cls, self.broadcast_buffer_size = group, optim, broadcast_buffer_size
        self._optim_kwargs = dict(defaults)  # what the inner optimizer is built with
        self.rank, self.world_size = dist.rank(group), dist.world_size(group)
        self._per_rank_state: list[dict] | None = None  # filled by consolidate_state_dict
        self._build_partition()

    # -- partition ----------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter in param_groups order: the indices of a torch state_dict."""
        return [p for g in self.param_groups for p in g["params"]]

    def _build_partition(self) -> None:
        params = self._all_params()
        owners = partition_parameters(params, self.world_size)
        self.param_to_rank: dict[torch.Tensor, int] = dict(zip(params, owners))
        # Each rank gets *every* group (possibly empty) so group i means the same everywhere.
        self.partition: list[list[dict]] = [
            [{**{k: v for k, v in g.items() if k != "params"},
              "params": [p for p in g["params"] if self.param_to_rank[p] == r]} for g in self.param_groups]
            for r in range(self.world_size)]
        self.local_params = [p for g in self.partition[self.rank] for p in g["params"]]
        self.optim = self.optim_cls(self.partition[self.rank], **self._optim_kwargs)
        # The inner optimizer fills in its defaults (AdamW's betas, eps, ...): copy them
        # up, so our param_groups (and state_dict) read like the plain optimizer's.
        for mine, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in inner.items():
                mine.setdefault(k, v)
        self.defaults = {**self.optim.defaults, **self.defaults}
        self.state = self.optim.state  # the local shard; what memory trackers should see
        # made now, before anyone tracks the model's memory: the flats hold the parameters from here on
        self._flat_buckets = self._make_flat_buckets() if self.world_size > 1 else []

    def partition_parameters(self) -> list[list[dict]]:
        """Per rank, the param groups it steps (FairScale's name and shape)."""
        return self.partition

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_building", False):
            super().add_param_group(param_group)
            return
        if any(len(s) for s in self.optim.state.values()):
            raise RuntimeError("OSS.add_param_group after step() is not supported (the partition would "
                               "move state between ranks); create the OSS with all param groups")
        super().add_param_group(param_group)
        self._build_partition()  # every rank must call this, in the same order

    # -- step ---------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the local shard, then send each parameter from its owner to everyone."""
        for mine, inner in zip(self.param_groups, self.optim.param_groups):  # LR schedulers act on ours
            inner.update({k: v for k, v in mine.items() if k != "params"})
        with trace.span("optimizer_step", shard_numel=sum(p.numel() for p in self.local_params)):
            loss = self.optim.step(closure)
        self._broadcast_params()
        return loss

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Re-assemble the model: P bytes per step, each parameter once, from its owner."""
        if self.world_size == 1:
            return
        in_flight = []
        for src, flat, bucket, half in self._flat_buckets:
            if not half:  # in place, no copy: the flat its small parameters view, or one big parameter
                target = bucket[0].data if flat is None else flat
                in_flight.append((comm.broadcast(target, src, self.group, async_op=True), None, None))
                continue
            flat = torch.cat([p.data.reshape(-1) for p in bucket]).half()  # broadcast_fp16: P/2 bytes
            in_flight.append((comm.broadcast(flat, src, self.group, async_op=True), flat, bucket))
        for handle, flat, bucket in in_flight:
            handle.wait()
            if bucket is not None:  # fp16: every replica, the owner too, keeps the rounded values
                offset = 0
                for p in bucket:
                    p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _make_flat_buckets(self) -> list[tuple[int, torch.Tensor | None, list[torch.Tensor], bool]]:
        """(source rank, flat buffer or None, parameters, as fp16?) per broadcast, the same order on every rank.

        A bucket of small parameters gets one flat buffer, made here once, and its parameters become views
        of it (FairScale's ``ParamBucket``): the broadcast then fills them in place, with no concatenation
        and copy back per step and no memory beyond the parameters'. Not for broadcast_fp16, whose flat
        holds the fp16 copy: that one is made per step.
        """
        out = []
        for owner in range(self.world_size):
            src = dist.global_rank(self.group, owner)
            for bucket in self._buckets([p for g in self.partition[owner] for p in g["params"]]):
                half = self.broadcast_fp16 and bucket[0].is_floating_point()
                flat = None
                if len(bucket) > 1 and not half:
                    flat = torch.cat([p.data.reshape(-1) for p in bucket])
                    offset = 0
                    for p in bucket:
                        p.data = flat[offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
                out.append((src, flat, bucket, half))
        return out

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive runs of parameters of at most broadcast_buffer_size bytes (same dtype/device)."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            fits = (buckets and size + nbytes <= self.broadcast_buffer_size
                    and buckets[-1][0].dtype == p.dtype and buckets[-1][0].device == p.device)
            if fits:
                buckets[-1].append(p)
                size += nbytes
            else:
                buckets.append([p])
                size = nbytes
        return buckets

    # -- gradient clipping ---------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, computed from the shards.

        Each rank measures the gradients of the parameters it owns; one tiny
        all-reduce combines them (sum of ``|g|^p``, or max for ``inf``); each
        rank then scales the gradients it owns, the only ones its step reads.
        Returns the total norm (the same on every rank). Call it on every rank.
        """
        norm_type = float(norm_type)
        inf = norm_type == float("inf")
        grads = [p.grad for p in self.local_params if p.grad is not None]
        device = self.local_params[0].device if self.local_params else dist.device()
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in grads]
                            or [torch.zeros((), device=device)])
        # max of maxima for inf; otherwise the p-th root of the sum of |g|^p over all shards
        total = (norms.max() if inf else norms.pow(norm_type).sum()).reshape(1)
        if self.world_size > 1:
            comm.all_reduce(total, op=comm.ReduceOp.MAX if inf else comm.ReduceOp.SUM, group=self.group)
        total = total[0] if inf else total[0].pow(1.0 / norm_type)
        clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # the formula torch uses
        for g in grads:
            g.mul_(clip_coef.to(g.dtype))
        return total

    # -- state dicts ---------------------------------------------------------
    def local_state_dict(self) -> dict:
        """The inner optimizer's state dict: this rank's shard, local indices."""
        return self.optim.state_dict()

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every rank's shard on ``recipient_rank`` (a rank of ``group``). Call on all ranks.

        Each shard travels as one serialised byte tensor, sent point to point
        (size first, then bytes). Afterwards ``state_dict()`` works on the recipient.
        """
        if not 0 <= recipient_rank < self.world_size:
            raise ValueError(f"recipient_rank must be a rank of the group (0..{self.world_size - 1}), "
                             f"got {recipient_rank}")
        mine = self.local_state_dict()
        if self.world_size == 1:
            self._per_rank_state = [mine]
            return
        dst = dist.global_rank(self.group, recipient_rank)
        device = dist.device()
        if self.rank == recipient_rank:
            shards: list[dict] = []
            for r in range(self.world_size):
                if r == self.rank:
                    shards.append(mine)
                    continue
                src = dist.global_rank(self.group, r)
                size = torch.zeros(1, dtype=torch.long, device=device)
                comm.recv(size, src, self.group)
                data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
                comm.recv(data, src, self.group)
                shards.append(torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu"))
            self._per_rank_state = shards
        else:
            buf = io.BytesIO()
            torch.save(_to_cpu(mine), buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
            comm.send(torch.tensor([data.numel()], dtype=torch.long, device=device), dst, self.group)
            comm.send(data, dst, self.group)
            self._per_rank_state = None

    def state_dict(self) -> dict:
        """The full optimizer state dict, as a single ``optim`` would return it.

        Only after ``consolidate_state_dict()``, on the recipient rank; indices
        number the parameters in ``param_groups`` order, as torch's do.
        """
        if self._per_rank_state is None:
            raise RuntimeError("OSS.state_dict() needs the shards of every rank: call "
                               "consolidate_state_dict(recipient_rank) on all ranks first, then "
                               "state_dict() on the recipient (or local_state_dict() for this rank's shard)")
        index = {p: i for i, p in enumerate(self._all_params())}
        state: dict[int, Any] = {}
        for r, shard in enumerate(self._per_rank_state):
            local_params = [p for g in self.partition[r] for p in g["params"]]
            for local_i, s in shard["state"].items():
                state[index[local_params[local_i]]] = s
        # Hyperparameters from our param_groups, the ones LR schedulers change.
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[p] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a *full* state dict (from ``state_dict()``) on every rank; each keeps its shard."""
        if len(state_dict.get("param_groups", [])) != len(self.param_groups):
            raise ValueError(f"state dict has {len(state_dict.get('param_groups', []))} param groups, this OSS "
                             f"{len(self.param_groups)}; pass the full dict from OSS.state_dict() (after "
                             "consolidate_state_dict) or a plain optimizer's state_dict for the same model")
        params = self._all_params()
        local_index = {p: i for i, p in enumerate(self.local_params)}
        local_state = {local_index[params[i]]: s for i, s in state_dict["state"].items()
                       if params[i] in local_index}
        groups = []
        for mine, g_full, g_local in zip(self.param_groups, state_dict["param_groups"], self.partition[self.rank]):
            hyper = {k: v for k, v in g_full.items() if k != "params"}
            mine.update(hyper)
            groups.append({**hyper, "params": [local_index[p] for p in g_local["params"]]})
        self.optim.load_state_dict({"state": local_state, "param_groups": groups})
        self.state = self.optim.state


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj

