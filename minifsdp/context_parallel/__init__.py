"""Context parallelism: the sequence split across ranks, attention computed round a ring.

Long sequences make the activations of every layer grow with T (and the
attention scores with T^2). Context parallelism (cp) gives each rank of a cp
group a share of every sample's sequence: every position-wise layer runs on the
share alone, and attention, the one layer that mixes positions, passes keys and
values round the ring so each rank's queries meet every key (ring attention;
torchtitan's and picotron's context parallel, Megatron-LM's ``--context-parallel-size``).

Read in this order:

1. ``online_softmax.py`` - attention over keys that arrive in pieces: partial
   results ``(out, lse)`` and the rule that merges them exactly (beside the naive
   concatenate-and-softmax); the FlashAttention-2 backward of one block.
2. ``split.py`` - the naive and zig-zag splits, their inverse, the positions each
   rank holds, and the causal work per rank (zig-zag: equal; naive: not).
3. ``ring.py`` - one turn of the ring: isend to the next rank, irecv from the previous.
4. ``ring_attention.py`` - the autograd Function: the forward ring with online
   softmax, the backward ring with dK/dV travelling home; bytes per layer.
5. ``gpt.py`` - ``context_parallel_gpt``: a GPT whose attention is ring
   attention, and the gradient average over the cp group (or DDP / FSDP over it).
6. ``memory.py`` - what one rank holds: the activations of its T/cp positions
   (lab 01's terms, without the T^2 probabilities) and the ring's K/V buffers.

API for a trainer::

    cp_model = context_parallel_gpt(model, cp_group, split="zigzag")   # same parameters as model
    x_local, y_local = (shard_sequence(t, cp, cp_rank, "zigzag") for t in (x, y))   # dim 1 of [B, T]
    loss = cp_model.loss(cp_model(x_local), y_local)          # this share's mean loss
    loss.backward()
    all_reduce_gradients(cp_model, cp_group)                  # or DDP / FSDP over the cp (or dp x cp) group
    global_loss(loss, cp_group)                               # the whole sequence's mean loss, for logging

PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` does not
run on CPU (torch 2.13): its ring replaces only the CUDA SDPA kernels (flash,
efficient, cudnn), and SDPA on CPU dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu``, which raises
``NotImplementedError: ... does not have a sharding strategy registered``
(the math backend: ``aten.add.Tensor got mixed torch.Tensor and DTensor``).
tests/test_context_parallel.py asserts that error, so it notices when torch
starts supporting CPU; until then ring attention is compared with full attention.
"""

from .gpt import (ContextParallelAttention, ContextParallelBlock, ContextParallelGPT, all_reduce_gradients,
                  check_context_parallel, context_parallel_gpt, global_loss)
from .online_softmax import merge_partials, partial_attention, partial_attention_backward, softmax_attention
from .memory import activation_bytes, ring_buffer_bytes
from .ring import Ring, Transfer
from .ring_attention import RingAttention, ring_attention, ring_attention_bytes
from .split import (SPLITS, attention_work, check_sequence_length, chunks_of, imbalance, num_chunks, pair_kind,
                    pair_work, sequence_positions, shard_sequence, unshard_sequence)

__all__ = ["context_parallel_gpt", "ContextParallelGPT", "ContextParallelBlock", "ContextParallelAttention",
           "all_reduce_gradients", "global_loss", "check_context_parallel",
           "ring_attention", "RingAttention", "ring_attention_bytes", "Ring", "Transfer",
           "partial_attention", "merge_partials", "softmax_attention", "partial_attention_backward",
           "SPLITS", "num_chunks", "chunks_of", "check_sequence_length", "shard_sequence", "unshard_sequence",
           "sequence_positions", "pair_kind", "pair_work", "attention_work", "imbalance",
           "activation_bytes", "ring_buffer_bytes"]
