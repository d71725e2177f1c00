"""Which ranks split a layer, and which hold copies: FairScale's ``initialize_model_parallel``.

Layer 5 (techniques). Read this file first in ``minifsdp.tensor_parallel``;
then ``mappings.py`` (the f and g operators), ``layers.py``,
``cross_entropy.py`` and ``gpt.py``.

The world of ``N`` ranks is split into groups of ``tp`` consecutive ranks (the
*model-parallel* group: together they hold one copy of the model, each rank a
slice of every layer) and, across them, *data-parallel* groups (the ranks with
the same slice, fed different data). The layout comes from
``minifsdp.mesh.DeviceMesh`` (dp x pp x tp, tp fastest), as in
``fairscale.nn.model_parallel.initialize`` and Megatron-LM::

    N = 4, tp = 2:   model-parallel groups [0, 1] [2, 3]
                     data-parallel groups  [0, 2] [1, 3]

    >>> initialize_model_parallel(2)              # after init_process_group  # doctest: +SKIP
    >>> get_model_parallel_rank(), get_data_parallel_world_size()              # doctest: +SKIP
    (1, 2)                                                                      # on global rank 3

Unlike FairScale's, calling it again with the same sizes is harmless (it says
so on rank 0 and keeps the groups); different sizes are refused with the fix
(``destroy_model_parallel()`` first).
"""

from __future__ import annotations

from typing import Any

from .. import dist
from ..mesh import DeviceMesh

__all__ = ["initialize_model_parallel", "model_parallel_is_initialized", "destroy_model_parallel", "get_mesh",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_model_parallel_src_rank", "get_data_parallel_group", "get_data_parallel_rank",
           "get_data_parallel_world_size", "get_pipeline_parallel_group"]

_MESH: DeviceMesh | None = None


def initialize_model_parallel(model_parallel_size: int, pipeline_length: int = 1, *,
                              mesh: DeviceMesh | None = None) -> DeviceMesh:
    """Build (or adopt ``mesh``) the model-, data- and pipeline-parallel groups; returns the mesh.

    Call it on every rank after ``torch.distributed.init_process_group``.
    """
    global _MESH
    dist.require_initialized("initialize_model_parallel")
    world = dist.world_size()
    if mesh is None:
        if model_parallel_size < 1 or pipeline_length < 1:
            raise ValueError(f"initialize_model_parallel({model_parallel_size}, pipeline_length={pipeline_length}): "
                             "both sizes must be >= 1")
        if world % (model_parallel_size * pipeline_length):
            raise ValueError(f"world size {world} is not divisible by model_parallel_size x pipeline_length = "
                             f"{model_parallel_size * pipeline_length}; choose sizes that divide {world}")
        shape = (world // (model_parallel_size * pipeline_length), pipeline_length, model_parallel_size)
    else:
        shape = mesh.shape
        if shape[2] != model_parallel_size:
            raise ValueError(f"mesh has tp={shape[2]} but model_parallel_size={model_parallel_size}; pass the same")
    if _MESH is not None:
        if _MESH.shape == shape:
            if dist.rank() == 0:
                print(f"initialize_model_parallel({model_parallel_size}): already initialized as {_MESH!r}; "
                      "kept the existing groups")
            return _MESH
        raise ValueError(f"model parallel is already initialized as {_MESH!r}, not dp={shape[0]}, pp={shape[1]}, "
                         f"tp={shape[2]}; call destroy_model_parallel() first")
    _MESH = mesh if mesh is not None else DeviceMesh(*shape)
    return _MESH


def model_parallel_is_initialized() -> bool:
    return _MESH is not None


def destroy_model_parallel() -> None:
    """Forget the groups (the next ``initialize_model_parallel`` builds new ones)."""
    global _MESH
    _MESH = None


def get_mesh() -> DeviceMesh:
    if _MESH is None:
        raise RuntimeError("model parallel is not initialized: call "
                           "minifsdp.tensor_parallel.initialize_model_parallel(tp) on every rank first")
    return _MESH


def get_model_parallel_group() -> Any:
    """The ranks that split every layer with this one (consecutive ranks)."""
    return get_mesh().get_group("tp")


def get_model_parallel_world_size() -> int:
    return get_mesh().size("tp")


def get_model_parallel_rank() -> int:
    """This rank's slice index ``r``: it holds rows/columns ``[r*n/tp, (r+1)*n/tp)``."""
    return get_mesh().get_local_rank("tp")


def get_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this model-parallel group (for broadcasts)."""
    return get_mesh().ranks_along("tp")[0]


def get_data_parallel_group() -> Any:
    """The ranks that hold the same slices as this one and see different data."""
    return get_mesh().get_group("dp")


def get_data_parallel_world_size() -> int:
    return get_mesh().size("dp")


def get_data_parallel_rank() -> int:
    return get_mesh().get_local_rank("dp")


def get_pipeline_parallel_group() -> Any:
    return get_mesh().get_group("pp")
