"""Tests for minifsdp.data: corpus, tokenizer, and the sharding contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minifsdp.data import (
    VOCAB_SIZE,
    BatchIterator,
    corpus_text,
    decode,
    encode,
    get_batch,
    load_corpus,
)

REPO = Path(__file__).resolve().parents[1]


def test_corpus_ships_in_package_and_is_utf8():
    files = list((REPO / "minifsdp" / "corpus").glob("*.txt"))
    assert files
    total = sum(f.stat().st_size for f in files)
    assert 50_000 <= total <= 300_000
    for f in files:
        f.read_bytes().decode("utf-8")  # raises if not valid UTF-8
    text = corpus_text()
    assert text.startswith("First Citizen:")
    tokens = load_corpus()
    assert tokens.dtype == torch.long and len(tokens) == len(text.encode("utf-8"))
    assert 0 <= int(tokens.min()) and int(tokens.max()) < VOCAB_SIZE


def test_load_corpus_returns_a_copy_and_splits():
    a = load_corpus()
    a[0] = 0
    assert load_corpus()[0] == ord("F")
    train, val = load_corpus("train"), load_corpus("val")
    assert torch.equal(torch.cat([train, val]), load_corpus())
    assert 0.05 < len(val) / len(a) < 0.15
    with pytest.raises(ValueError, match="split"):
        load_corpus("test")


def test_byte_tokenizer_round_trip():
    for text in ["", "Hello, world!", "naïve café — 日本語 🎉"]:
        ids = encode(text)
        assert ids.dtype == torch.long
        assert decode(ids) == text
    assert encode("Hi").tolist() == [72, 105]
    assert len(encode("é")) == 2  # two UTF-8 bytes
    assert decode(torch.tensor([0xC3])) == "\ufffd"  # half a character: replaced


def test_batch_shapes_and_shift():
    x, y = get_batch(step=0, global_batch_size=6, seq_len=16)
    assert x.shape == y.shape == (6, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = load_corpus("train")
    for row_x, row_y in zip(x, y):  # each row is a real window of the corpus
        starts = (data[: len(data) - 16] == row_x[0]).nonzero().flatten()
        assert any(torch.equal(data[s:s + 17], torch.cat([row_x, row_y[-1:]])) for s in starts)


@pytest.mark.parametrize("world_size,grad_accum", [(2, 1), (4, 1), (2, 2), (1, 4), (3, 2)])
def test_shards_reassemble_the_single_process_batch(world_size, grad_accum):
    gbs, T = 12, 24
    for step in (0, 5):
        full_x, full_y = get_batch(step, gbs, T, seed=3)
        pieces = [
            get_batch(step, gbs, T, seed=3, rank=r, world_size=world_size,
                      micro_step=m, grad_accum=grad_accum)
            for m in range(grad_accum) for r in range(world_size)
        ]
        assert all(p[0].shape == (gbs // (world_size * grad_accum), T) for p in pieces)
        assert torch.equal(torch.cat([p[0] for p in pieces]), full_x)
        assert torch.equal(torch.cat([p[1] for p in pieces]), full_y)


def test_steps_seeds_and_splits_differ():
    a = get_batch(0, 8, 32)[0]
    assert torch.equal(a, get_batch(0, 8, 32)[0])
    assert not torch.equal(a, get_batch(1, 8, 32)[0])
    assert not torch.equal(a, get_batch(0, 8, 32, seed=1)[0])
    assert not torch.equal(a, get_batch(0, 8, 32, split="val")[0])


def test_same_seed_same_batch_in_a_fresh_process():
    x, _ = get_batch(step=7, global_batch_size=4, seq_len=32, seed=11)
    code = (
        "from minifsdp.data import get_batch\n"
        "x, _ = get_batch(step=7, global_batch_size=4, seq_len=32, seed=11)\n"
        "print(x.flatten().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=120)
    assert eval(out.stdout) == x.flatten().tolist()


def test_clear_errors():
    with pytest.raises(ValueError, match=r"not divisible.*multiple of 4 \(e.g. 8 or 12\)"):
        get_batch(0, 10, 8, world_size=2, grad_accum=2)
    with pytest.raises(ValueError, match="too long"):
        get_batch(0, 2, len(load_corpus("val")), split="val")
    with pytest.raises(ValueError, match="rank"):
        get_batch(0, 4, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="micro_step"):
        get_batch(0, 4, 8, micro_step=1)
    with pytest.raises(ValueError, match="global_batch_size"):
        get_batch(0, 0, 8)


def test_batch_iterator_and_resume():
    it = BatchIterator(8, 16, seed=2, rank=1, world_size=2, grad_accum=2, num_steps=3)
    items = list(it)
    assert [s for s, _ in items] == [0, 1, 2]
    for step, micro in items:
        for m, (x, y) in enumerate(micro):
            ex, ey = get_batch(step, 8, 16, seed=2, rank=1, world_size=2, micro_step=m, grad_accum=2)
            assert torch.equal(x, ex) and torch.equal(y, ey)
    fresh = BatchIterator(8, 16, seed=2, rank=1, world_size=2, grad_accum=2)
    next(fresh)
    resumed = BatchIterator(8, 16, seed=2, rank=1, world_size=2, grad_accum=2)
    resumed.load_state_dict(fresh.state_dict())
    assert torch.equal(next(resumed)[1][0][0], items[1][1][0][0])
    with pytest.raises(ValueError, match="divisible"):
        BatchIterator(6, 16, world_size=4)
