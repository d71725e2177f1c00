"""Save and resume for the trainer: ``--save-every K`` and ``--resume DIR``, atomic, for every strategy.

Front layer. Mirrors ``torch.distributed.checkpoint`` (DCP: every rank writes the tensors it holds to
its own file, the coordinator writes the metadata; a load reads what each rank will hold, from whichever
files hold it, at any world size) and torchtitan's ``CheckpointManager`` (``step_N`` folders holding the
model, optimizer, RNG and data position of one step, saved every K steps; the latest complete one resumed).

One checkpoint is one DCP state dict, keyed by the *single model's* parameter names (FQNs)::

    model.<fqn>                   the parameter, or this rank's piece of it (a DTensor / ShardedTensor)
    optim.<fqn>.<exp_avg|...>     its optimizer state, the same way
    scaler.<scale|...>            the fp16 gradient scaler (scale, growth tracker)
    rank<r>.rng_cpu / .rng_cuda   each rank's RNG states (CUDA's where there is a GPU)
    + meta.json (rank 0)          the step (the data position: batch ``step`` is next), strategy, model,
                                  layout and the model's parameter shapes (the checks before a resume)

How a strategy's model and optimizer become name-keyed is its record's ``state`` (``records.Strategy``):

* ``ByName`` (the default): the wrapped model's parameters under their names, wrappers' hops dropped
  (``module.``, ``stage_modules.N.``, ``_checkpoint_wrapped_module.``), the optimizer's state under the same
  names. A replicated tensor (DDP's) is the same on every rank: DCP writes it once. ZeRO's partitioned
  optimizer names only the parameters its rank owns, a pipeline rank its stages', expert parallel its
  experts. Pieces are DTensors: ``fully_shard``'s (fsdp2), torch's tensor parallel, and a Megatron split
  (tp, 3d) made one over the tp group, sharded where its shape differs from the model's (q, k, v in their
  split's order: a resume keeps ``--tp``). Each rank saves what it holds, loads what it will hold: DCP reshards.
* ``FullFlatFSDP`` (fsdp, fsdp+tp): a flat shard mixes parameters, so it is gathered (FULL_STATE_DICT on
  every rank) and loaded back through FSDP's own load; DCP still writes each tensor once.
* ``TorchState`` (torch-fsdp): ``torch.distributed.checkpoint.state_dict``'s get / set (ShardedTensors).

Atomic writes: every rank writes into ``step_N.tmp`` (``dcp.save``: its ``.distcp`` file; the coordinator,
rank 0, gathers every rank's result, then writes ``.metadata``); rank 0 adds ``meta.json``, renames
``step_N.tmp`` to ``step_N`` (one rename) and replaces ``latest`` (written, then renamed). A run
killed before the rename leaves ``step_N.tmp``, which is never loaded: ``--resume`` takes the checkpoints
folder (``latest``, else its newest complete ``step_N``) or one complete ``step_N``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as tdist

from . import dist, models, trace
from .records import Built, Strategy, TrainConfig

__all__ = ["Checkpointer", "StateHook", "ByName", "FullFlatFSDP", "TorchState", "check_resume", "resolve",
           "read_meta", "fqn", "init_optimizer_state", "META", "LATEST"]

META, LATEST = "meta.json", "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_WRAPPER_HOPS = {"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


class StateHook(Protocol):
    """A record's ``state(built, cfg)``: its model and optimizer as one DCP state dict, and back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def fqn(name: str) -> str:
    """A wrapped model's parameter name as the single model's: ``module.blocks.0...`` and
    ``stage_modules.1.blocks.0...`` are ``blocks.0...``."""
    out, parts = [], iter(name.split("."))
    for part in parts:
        if part == "stage_modules":
            next(parts)  # the stage's index among this rank's stages
        elif part not in _WRAPPER_HOPS:
            out.append(part)
    return ".".join(out)


def model_shapes(model_name: str) -> dict[str, tuple[int, ...]]:
    """The single model's parameter names and shapes (built on the meta device: no memory)."""
    return {n: tuple(p.shape) for n, p in models.build_model(model_name, device="meta").named_parameters()}


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer has no state for DCP to load into: one step on zero gradients at lr 0 creates it
    (torch's ``_init_optim_state``; the parameters do not move, and the load overwrites the state)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads, lrs = [p.grad for p in params], [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


class ByName:
    """The wrapped model's parameters and its optimizer's state under the single model's names; the values
    are the live tensors (``dcp.load`` writes into them), a Megatron split's as a DTensor over ``tp_group``."""

    def __init__(self, built: Built, cfg: TrainConfig, tp_group: Any = None) -> None:
        self.model, self.optimizer = built.model, getattr(built.optimizer, "optim", built.optimizer)  # ZeRO: the shard
        self.shapes = model_shapes(cfg.model)
        self.mesh = None
        if tp_group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            self.mesh = DeviceMesh.from_group(tp_group, dist.device().type)

    def named(self, name: str, t: torch.Tensor) -> Any:
        """``t`` as DCP should see it: itself if whole (or a DTensor already), else this rank's piece of a split."""
        from torch.distributed.tensor import DTensor, Shard

        whole = self.shapes.get(name)
        if whole is None:
            raise ValueError(f"parameter {name!r} is not one of --model's; save_resume.fqn does not know a wrapper "
                             "of this strategy: give its record a state hook")
        if isinstance(t, DTensor) or t.dim() == 0 or tuple(t.shape) == whole:
            return t
        if self.mesh is None:
            raise ValueError(f"{name}: shape {tuple(t.shape)} is not the model's {whole}, and the record names no "
                             "tensor-parallel group: give it state=functools.partial(ByName, tp_group=...)")
        dim = next(d for d, (a, b) in enumerate(zip(t.shape, whole)) if a != b)
        return DTensor.from_local(t, self.mesh, [Shard(dim)], run_check=False)

    def state_dict(self) -> dict[str, Any]:
        init_optimizer_state(self.optimizer)
        params = {fqn(n): p for n, p in self.model.named_parameters()}
        names = {id(p): n for n, p in params.items()}
        optim = {names[id(p)]: {k: self.named(names[id(p)], v) if torch.is_tensor(v) else v for k, v in st.items()}
                 for p, st in self.optimizer.state.items()}
        return {"model": {n: self.named(n, p.detach()) for n, p in params.items()}, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing left to do: ``state_dict``'s values share storage with the parameters and the state."""


class FullFlatFSDP(ByName):
    """minifsdp's flat FSDP (fsdp, fsdp+tp): the FULL state dicts of model and optimizer (every rank gathers
    them), named as ``ByName`` names them; loaded back through FSDP's FULL load, which cuts each rank's shard."""

    def __init__(self, built: Built, cfg: TrainConfig, tp_group: Any = None) -> None:
        super().__init__(built, cfg, tp_group)
        self.optimizer = built.optimizer
        self.keys: dict[str, str] = {}
        self.param_groups: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        from .fsdp import FullyShardedDataParallel as FSDP
        from .fsdp import StateDictType

        init_optimizer_state(self.optimizer)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT):
            model, osd = self.model.state_dict(), FSDP.optim_state_dict(self.model, self.optimizer)
        self.keys = {fqn(k): k for k in model}  # FSDP's own names, for the load
        self.param_groups = osd["param_groups"]
        return {"model": {fqn(k): self.named(fqn(k), v) for k, v in model.items()},
                "optim": {fqn(k): {s: self.named(fqn(k), v) if torch.is_tensor(v) else v for s, v in st.items()}
                          for k, st in osd["state"].items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from .fsdp import FullyShardedDataParallel as FSDP
        from .fsdp import StateDictType

        local = _to_local(state)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT):
            self.model.load_state_dict({self.keys[n]: v for n, v in local["model"].items()})
            osd = {"state": {self.keys[n]: st for n, st in local["optim"].items()}, "param_groups": self.param_groups}
            self.optimizer.load_state_dict(FSDP.optim_state_dict_to_load(self.model, self.optimizer, osd))


def _to_local(obj: Any) -> Any:
    """DTensors back to this rank's pieces, through nested dicts."""
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    return obj.to_local() if hasattr(obj, "to_local") else obj


class TorchState:
    """torch's own recipe (``torch.distributed.checkpoint.state_dict``): torch-fsdp's FSDP1 gives ShardedTensors."""

    def __init__(self, built: Built, cfg: TrainConfig) -> None:
        self.model, self.optimizer = built.model, built.optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


# --------------------------------------------------------------------------
# Which folder: complete checkpoints only
# --------------------------------------------------------------------------

def _complete(path: str) -> bool:
    """A committed ``step_N``: renamed from its ``.tmp`` after every rank wrote, with DCP's and our metadata."""
    return (bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path))))
            and os.path.isfile(os.path.join(path, META)) and os.path.isfile(os.path.join(path, ".metadata")))


def resolve(path: str) -> str:
    """The complete ``step_N`` folder ``--resume path`` means: ``path`` itself, or the newest in a checkpoints
    folder (its ``latest``, else its highest complete ``step_N``; ``<out>`` stands for ``<out>/checkpoints``).
    One-line ``ValueError`` for anything else, a half-written save above all."""
    if not os.path.isdir(path):
        raise ValueError(f"--resume {path!r} is not a folder: give a checkpoints folder (<out>/checkpoints) or one "
                         "of its step_N folders")
    name = os.path.basename(os.path.normpath(path))
    if _complete(path):
        return path
    if name.endswith(".tmp") or _STEP_DIR.match(name):
        raise ValueError(f"--resume {path!r} is a half-written checkpoint (its save did not finish): resume from "
                         f"{os.path.dirname(os.path.normpath(path)) or '.'!r}, which takes the latest complete one")
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            latest = os.path.join(root, f.read().strip())
        if _complete(latest):
            return latest
    steps = sorted((int(m.group(1)), d) for d in os.listdir(root) if (m := _STEP_DIR.match(d))
                   and _complete(os.path.join(root, d)))
    if not steps:
        raise ValueError(f"--resume {path!r} holds no complete checkpoint: point it at the checkpoints folder a run "
                         "with --save-every wrote (<out>/checkpoints), or drop --resume to start afresh")
    return os.path.join(root, steps[-1][1])


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def _layout(cfg: TrainConfig, record: Strategy) -> dict[str, int]:
    return {d: getattr(record.layout(cfg), d) for d in ("dp", "pp", "tp", "cp", "ep")}


def check_resume(cfg: TrainConfig, record: Strategy) -> None:
    """Before any process starts: ``--resume`` names a complete checkpoint this run can load (the same model
    and strategy, the same tensor-parallel split, fp16's scaler on both sides, steps left to run)."""
    if cfg.save_every < 0:
        raise ValueError(f"--save-every must be >= 0 (0: never save), got {cfg.save_every}")
    if not cfg.resume:
        return
    path = resolve(cfg.resume)
    meta = read_meta(path)
    fresh = "or drop --resume to start a fresh run"
    if meta["model"] != cfg.model:
        raise ValueError(f"checkpoint {path!r} holds --model {meta['model']}: resume with --model {meta['model']}, "
                         f"{fresh}")
    if {n: tuple(s) for n, s in meta["params"].items()} != model_shapes(cfg.model):
        raise ValueError(f"checkpoint {path!r} holds a {meta['model']} whose parameters differ from this version's "
                         f"(names or shapes): resume with the code that saved it, {fresh}")
    if meta["strategy"] != cfg.strategy:
        raise ValueError(f"checkpoint {path!r} was saved by --strategy {meta['strategy']}: resume with --strategy "
                         f"{meta['strategy']} (at any data-parallel world size), {fresh}")
    tp = _layout(cfg, record)["tp"]
    if meta["layout"]["tp"] != tp:
        raise ValueError(f"checkpoint {path!r} holds tensors split {meta['layout']['tp']} ways (tensor parallel): "
                         f"resume with --tp {meta['layout']['tp']}, {fresh}")
    if (meta["precision"] == "fp16") != (cfg.precision == "fp16"):
        raise ValueError(f"checkpoint {path!r} was saved with --precision {meta['precision']} (its gradient scaler "
                         f"state {'is' if meta['precision'] == 'fp16' else 'is not'} in it): resume with "
                         f"--precision {meta['precision']}")
    if meta["step"] >= cfg.steps:
        raise ValueError(f"checkpoint {path!r} is at step {meta['step']} already: pass --steps > {meta['step']}")


# --------------------------------------------------------------------------
# The trainer's side: load once, save every K steps
# --------------------------------------------------------------------------

def _barrier() -> None:
    if tdist.is_initialized():
        tdist.distributed_c10d.barrier()  # bookkeeping: past torch_reference's counter


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when there is no process group (--strategy single): we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_atomic(path: str, text: str) -> None:
    """``path`` holds the old text or the new one, never half of either: write aside, flush, rename."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _commit(tmp: str, final: str, root: str, step: int) -> None:
    """Rank 0, once every rank's files are written: the one rename that makes ``step_N`` exist, then ``latest``."""
    if os.path.isdir(final):  # a step saved again (a rerun into the same --out): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(os.path.join(root, LATEST), os.path.basename(final) + "\n")


class Checkpointer:
    """One rank's ``--resume`` (``resume()``, before the first step) and ``--save-every`` (``maybe_save(step)``
    after each). ``record.state`` (default ``ByName``) names the model and optimizer; the scaler's state,
    the RNG states and the step are added here."""

    def __init__(self, cfg: TrainConfig, record: Strategy, built: Built, scaler: Any) -> None:
        self.cfg, self.record, self.built, self.scaler = cfg, record, built, scaler
        self._hook: StateHook | None = None
        self.root = os.path.join(cfg.out, "checkpoints")

    @property
    def hook(self) -> StateHook:
        """Made on first use: a run that neither saves nor resumes builds nothing (no tp mesh, no meta model)."""
        if self._hook is None:
            self._hook = (self.record.state or ByName)(self.built, self.cfg)
        return self._hook

    def _state_dict(self, ranks: set[int]) -> dict[str, Any]:
        state = self.hook.state_dict()
        scaler = self.scaler.state_dict()
        if scaler:
            state["scaler"] = scaler
        rank = dist.rank()
        if rank in ranks:  # a rank of the run that saved: its RNG streams go on (another world size: new ones)
            rng = {"rng_cpu": torch.get_rng_state()}
            if torch.cuda.is_available() and dist.device().type == "cuda":
                rng["rng_cuda"] = torch.cuda.get_rng_state(dist.device())
            state[f"rank{rank}"] = rng
        return state

    def resume(self) -> int:
        """Load ``--resume``'s checkpoint into this rank; return the step to run next (0 without ``--resume``)."""
        if not self.cfg.resume:
            return 0
        import torch.distributed.checkpoint as dcp

        path = resolve(self.cfg.resume)
        meta = read_meta(path)
        with trace.span("resume", step=meta["step"]):
            state = self._state_dict(set(range(meta["world_size"])))
            with _one_process_quiet():
                dcp.load(state, checkpoint_id=path, no_dist=not tdist.is_initialized())
            self.hook.load_state_dict(state)
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        rng = state.get(f"rank{dist.rank()}", {})
        if "rng_cpu" in rng:
            torch.set_rng_state(rng["rng_cpu"])
        if "rng_cuda" in rng:
            torch.cuda.set_rng_state(rng["rng_cuda"], dist.device())
        return int(meta["step"])

    def maybe_save(self, step: int) -> str | None:
        """After ``step`` steps: save if ``--save-every`` divides it; returns the committed folder."""
        every = self.cfg.save_every
        return self.save(step) if every and step % every == 0 else None

    def save(self, step: int) -> str:
        with trace.span("save", step=step):
            return self._save(step)

    def _save(self, step: int) -> str:
        import torch.distributed.checkpoint as dcp

        final = os.path.join(self.root, f"step_{step}")
        tmp = final + ".tmp"  # a save killed earlier left one? its files are overwritten, and it was never read
        os.makedirs(tmp, exist_ok=True)
        with _one_process_quiet():  # returns once the coordinator has every rank's files and wrote .metadata
            dcp.save(self._state_dict({dist.rank()}), checkpoint_id=tmp, no_dist=not tdist.is_initialized())
        if dist.rank() == 0:
            meta = {"step": step, "strategy": self.cfg.strategy, "model": self.cfg.model,
                    "world_size": dist.world_size(), "layout": _layout(self.cfg, self.record),
                    "precision": self.cfg.precision, "batch_size": self.cfg.batch_size, "seed": self.cfg.seed,
                    "params": model_shapes(self.cfg.model)}
            _write_atomic(os.path.join(tmp, META), json.dumps(meta, indent=1))
            _commit(tmp, final, self.root, step)
        _barrier()  # no rank goes on before the checkpoint exists
        return final
