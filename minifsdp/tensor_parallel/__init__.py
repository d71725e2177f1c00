"""Tensor parallelism (Megatron-LM) under FairScale's ``fairscale.nn.model_parallel`` names.

Code written for FairScale runs by changing the import::

    from minifsdp.tensor_parallel import initialize_model_parallel, ColumnParallelLinear, ...

Read in this order: ``initialize.py`` (the groups), ``mappings.py`` (f and g),
``layers.py`` (column/row/vocab-parallel layers), ``cross_entropy.py``,
``gpt.py`` (a whole GPT split, and sequence parallel).
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .gpt import (ParallelAttention, ParallelBlock, ParallelGPT, ParallelMLP, check_divisible, local_slices,
                  tensor_parallel_gpt)
from .initialize import (destroy_model_parallel, get_data_parallel_group, get_data_parallel_rank,
                         get_data_parallel_world_size, get_mesh, get_model_parallel_group, get_model_parallel_rank,
                         get_model_parallel_src_rank, get_model_parallel_world_size, get_pipeline_parallel_group,
                         initialize_model_parallel, model_parallel_is_initialized)
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (copy_to_model_parallel_region, gather_from_model_parallel_region,
                       gather_from_sequence_parallel_region, reduce_from_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_model_parallel_region,
                       scatter_to_sequence_parallel_region)

__all__ = ["initialize_model_parallel", "model_parallel_is_initialized", "destroy_model_parallel", "get_mesh",
           "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
           "get_model_parallel_src_rank", "get_data_parallel_group", "get_data_parallel_rank",
           "get_data_parallel_world_size", "get_pipeline_parallel_group",
           "copy_to_model_parallel_region", "reduce_from_model_parallel_region",
           "scatter_to_model_parallel_region", "gather_from_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ParallelAttention", "ParallelMLP", "ParallelBlock", "ParallelGPT", "tensor_parallel_gpt",
           "check_divisible", "local_slices"]
