"""A small text corpus, a byte tokenizer and a deterministic sharded loader.

Layer 4 (leaves): no ``torch.distributed`` here; ranks are just numbers.

Corpus: ``minifsdp/corpus/tinyshakespeare.txt`` is the first 63,889
characters (Coriolanus, Act I to Act II scene 3) of "tiny shakespeare", the
file ``data/tinyshakespeare/input.txt`` of Andrej Karpathy's char-rnn
repository, itself cut from the works of William Shakespeare (died 1616),
which are in the public domain. It ships inside the package; nothing is
downloaded at run time. Plain ASCII, so valid UTF-8.

Tokenizer: bytes of the UTF-8 encoding, vocabulary 256, as in byte-level
models (e.g. ByT5): any text works and nothing needs training.

Loader: the global batch of step k is a pure function of (seed, k, split):
``global_batch_size`` random start offsets drawn from a ``torch.Generator``
seeded from (seed, step). It is cut first into ``grad_accum`` micro-batches,
then each micro-batch into ``world_size`` contiguous rank slices, the same
order as ``DistributedSampler`` hands out contiguous shards. Hence the
parity contract of the whole project: N ranks x batch b, or 1 rank with b*N
and any gradient accumulation, see exactly the same sequences in each step.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from typing import Iterator

import torch

__all__ = [
    "VOCAB_SIZE",
    "encode",
    "decode",
    "corpus_text",
    "load_corpus",
    "get_batch",
    "BatchIterator",
]

VOCAB_SIZE = 256
CORPUS_FILE = "tinyshakespeare.txt"
VAL_FRACTION = 0.1  # the last 10 % of the corpus is held out as "val"


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor: ``encode("Hi") -> [72, 105]``."""
    raw = bytearray(text.encode("utf-8"))
    if not raw:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(raw, dtype=torch.uint8).long()


def decode(tokens: torch.Tensor) -> str:
    """Inverse of ``encode``; bytes that do not form valid UTF-8 become U+FFFD
    (a model may well emit half of a multi-byte character)."""
    return bytes(torch.as_tensor(tokens).reshape(-1).tolist()).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=None)
def corpus_text() -> str:
    """The shipped corpus as a string (read once)."""
    return resources.files("minifsdp").joinpath("corpus", CORPUS_FILE).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def _tokens() -> torch.Tensor:
    return encode(corpus_text())


def load_corpus(split: str = "all") -> torch.Tensor:
    """Token ids of the corpus: ``"all"``, ``"train"`` (first 90 %) or ``"val"``.

    Encoded once and cached; a fresh copy is returned, so callers may modify it.
    """
    return _split(split).clone()


def _split(split: str) -> torch.Tensor:
    data = _tokens()
    cut = int(len(data) * (1 - VAL_FRACTION))
    if split == "all":
        return data
    if split == "train":
        return data[:cut]
    if split == "val":
        return data[cut:]
    raise ValueError(f"split must be 'all', 'train' or 'val', got {split!r}")


def _step_seed(seed: int, step: int, split: str) -> int:
    # A hash, not seed*K + step: no two (seed, step) pairs can collide, and
    # neighbouring steps get unrelated generator states.
    digest = hashlib.blake2b(f"minifsdp:{seed}:{step}:{split}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def get_batch(
    step: int,
    global_batch_size: int,
    seq_len: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    micro_step: int = 0,
    grad_accum: int = 1,
    split: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x`` and next-token targets ``y`` (int64, ``[local, seq_len]``).

    ``local = global_batch_size // (world_size * grad_accum)`` rows: the
    ``rank``-th slice of the ``micro_step``-th micro-batch of the global
    batch of ``step``. ``y[:, t] == x[:, t + 1]`` inside the window, and
    ``y[:, -1]`` is the byte after it.

    >>> x, y = get_batch(step=0, global_batch_size=8, seq_len=16, rank=1, world_size=2)
    >>> x.shape
    torch.Size([4, 16])
    """
    for name, value in (("global_batch_size", global_batch_size), ("seq_len", seq_len),
                        ("world_size", world_size), ("grad_accum", grad_accum)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step={micro_step} is outside [0, grad_accum={grad_accum})")
    parts = world_size * grad_accum
    if global_batch_size % parts:
        lower = global_batch_size // parts * parts
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by "
            f"world_size*grad_accum = {world_size}*{grad_accum} = {parts}: every rank "
            f"must get the same number of rows; use a multiple of {parts} "
            f"(e.g. {lower or parts} or {lower + parts})"
        )
    data = _split(split)
    n_starts = len(data) - seq_len  # a window needs seq_len + 1 tokens (x and y)
    if n_starts < 1:
        raise ValueError(
            f"seq_len={seq_len} is too long: the {split!r} split has only {len(data)} "
            f"tokens and a sample needs seq_len + 1; use seq_len <= {len(data) - 1}"
        )

    gen = torch.Generator().manual_seed(_step_seed(seed, step, split))
    starts = torch.randint(0, n_starts, (global_batch_size,), generator=gen)
    micro = global_batch_size // grad_accum
    local = micro // world_size
    first = micro_step * micro + rank * local
    mine = starts[first:first + local]
    window = data[mine[:, None] + torch.arange(seq_len + 1)]  # [local, T+1] gather
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class BatchIterator:
    """Steps of micro-batches for one rank, resumable from a checkpoint.

    Each item is ``(step, [(x, y), ...])`` with ``grad_accum`` micro-batches,
    exactly what ``get_batch`` returns for this rank. ``state_dict()`` holds
    the next step, so a resumed run continues with the batches it would have
    seen.

    >>> it = BatchIterator(8, 16, world_size=2, rank=0, grad_accum=2, num_steps=3)
    >>> [(step, len(micro)) for step, micro in it]
    [(0, 2), (1, 2), (2, 2)]
    """

    def __init__(
        self,
        global_batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        start_step: int = 0,
        num_steps: int | None = None,
        split: str = "train",
    ) -> None:
        self.kwargs = dict(global_batch_size=global_batch_size, seq_len=seq_len, seed=seed,
                           rank=rank, world_size=world_size, grad_accum=grad_accum, split=split)
        self.grad_accum = grad_accum
        self.step = start_step
        self.stop = None if num_steps is None else start_step + num_steps
        get_batch(step=start_step, **self.kwargs)  # fail early on a bad configuration

    def __iter__(self) -> Iterator[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
        return self

    def __next__(self) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        if self.stop is not None and self.step >= self.stop:
            raise StopIteration
        step = self.step
        micro = [get_batch(step=step, micro_step=i, **self.kwargs) for i in range(self.grad_accum)]
        self.step += 1
        return step, micro

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
