"""minifsdp.memory: exact byte counts, categories, peak, samples, cross-check."""

import pickle

import pytest
import torch
import torch.nn as nn

from minifsdp import memory, trace
from minifsdp.memory import (ACTIVATIONS, COMM, GRADIENTS, OPTIMIZER, OTHER, PARAMETERS,
                             TEMPORARY, MemoryTracker)

F32 = 4  # bytes per fp32 element


def mlp() -> nn.Module:
    torch.manual_seed(0)
    # 8*16 + 16 + 16*4 + 4 = 212 parameters in 4 tensors
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_mlp_parameters_gradients_adamw_exact():
    model = mlp()
    assert sum(p.numel() for p in model.parameters()) == 212
    opt = torch.optim.AdamW(model.parameters())
    tr = MemoryTracker()
    tr.track_model(model)
    x = torch.randn(32, 8)
    with tr:
        assert tr.live()[PARAMETERS] == 212 * F32
        loss = model(x).square().mean()
        assert tr.live()[ACTIVATIONS] > 0          # saved for backward
        loss.backward()
        del loss
        live = tr.live()
        assert live[GRADIENTS] == 212 * F32
        assert live[ACTIVATIONS] == 0 and live[TEMPORARY] == 0  # all freed
        opt.step()
        snap = tr.snapshot("after step")
    # torch's AdamW keeps, per parameter, exp_avg and exp_avg_sq (param-shaped,
    # fp32) and a scalar fp32 `step` tensor: 2 * 212 * 4 + 4 params * 4 B = 1712 B.
    assert snap[OPTIMIZER] == 2 * 212 * F32 + 4 * F32 == 1712
    by_hand = sum(t.nbytes for s in opt.state.values() for t in s.values())
    assert snap[OPTIMIZER] == by_hand
    assert snap[PARAMETERS] == 212 * F32 and snap[GRADIENTS] == 212 * F32
    assert tr.total() == 848 + 848 + 1712
    opt.zero_grad()                                # set_to_none frees the grads
    assert tr.live()[GRADIENTS] == 0
    tr.close()


def test_second_backward_accumulates_in_place():
    model = mlp()
    tr = MemoryTracker()
    tr.track_model(model)
    with tr:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
        assert tr.live()[GRADIENTS] == 212 * F32
        assert tr.live()[TEMPORARY] == 0
    tr.close()


def test_views_count_once_and_freeing_releases():
    tr = MemoryTracker()
    with tr:
        a = torch.empty(1000)
        views = [a[10:20], a.view(10, 100), a.view(10, 100).t(), a.reshape(-1), a.detach()]
        assert tr.total() == 1000 * F32
        del a
        assert tr.total() == 1000 * F32            # views keep the storage alive
        del views
        assert tr.total() == 0
        b = torch.empty(10, 10).t().contiguous()   # the transposed temp is freed at once
        assert tr.total() == 100 * F32
    assert tr.peak_total == 1000 * F32


def test_storage_resize_is_seen():
    original = torch.UntypedStorage.resize_
    tr = MemoryTracker()
    with tr:
        a = torch.empty(256)
        assert tr.total() == 256 * F32
        a.untyped_storage().resize_(0)             # FSDP's way of freeing
        assert tr.total() == 0
        a.untyped_storage().resize_(256 * F32)     # and of re-allocating
        assert tr.total() == 256 * F32
        a.resize_(512)                             # aten.resize_ grows the same storage
        assert tr.total() == 512 * F32
        a.untyped_storage().resize_(0)
    assert tr.total() == 0 and tr.peak_total == 512 * F32
    assert torch.UntypedStorage.resize_ is original  # unpatched after exit


def test_register_preexisting_and_relabel_moves_bytes():
    w = torch.zeros(50)                            # made before tracking
    tr = MemoryTracker()
    with tr:
        assert tr.total() == 0                     # invisible until registered
        assert tr.register(w, "unsharded params") == 50 * F32
        assert tr.live()["unsharded params"] == 50 * F32
        assert tr.register([w, w[:5]], OTHER) == 50 * F32  # same storage once
        live = tr.live()
        assert live[OTHER] == 50 * F32 and live["unsharded params"] == 0
        assert tr.total() == 50 * F32
        del w
        assert tr.total() == 0


def test_category_context():
    tr = MemoryTracker()
    with tr:
        with tr.category(COMM):
            buf = torch.empty(100)
            with tr.category("sharded params"):
                shard = torch.empty(25)
            out = buf + 1
        act = buf * 2
        buf.add_(1)                                # in place: keeps its category
        live = tr.live()
    assert live[COMM] == 200 * F32
    assert live["sharded params"] == 25 * F32
    assert live[ACTIVATIONS] == 100 * F32
    assert tr.live(device="cpu") == live and tr.live(device="cuda")[COMM] == 0
    assert tr.device_bytes() == {"cpu": 325 * F32}
    del out, act, shard


def test_peak_is_exact_for_a_hand_made_sequence():
    tr = MemoryTracker()
    with tr:
        a = torch.empty(1000)                      # 4000
        with tr.category(COMM):
            b = torch.empty(2000)                  # 12000  <- peak
        del a                                      # 8000
        c = torch.empty(500)                       # 10000
        assert tr.peak_total == 12000
        assert tr.peak_by_category[ACTIVATIONS] == 4000 and tr.peak_by_category[COMM] == 8000
        tr.reset_peak()
        assert tr.peak_total == 10000
        del b                                      # 2000
        d = torch.empty(2500)                      # 12000 again, a new window
        assert tr.peak_total == 12000 and tr.peak_by_category[COMM] == 0
    assert tr.peak_by_device == {"cpu": 12000}
    del c, d


def test_samples_go_to_tracer_and_keep_the_exact_peak():
    tracer = trace.Tracer(rank=0)
    tr = MemoryTracker(sample_change=0.25)
    with tracer, tr:
        xs = [torch.empty(1000) for _ in range(20)]   # climbs to 80000
        del xs[:]                                     # falls to 0
        tr.snapshot("empty")
        y = torch.empty(10)
    totals = [s.total for s in tr.samples]
    assert max(totals) == tr.peak_total == 80000      # the peak sample is kept
    assert len(tr.samples) < 20                       # bounded: not one per op
    assert any(s.label == "empty" and s.total == 0 for s in tr.samples)
    assert [s.total for s in tracer.trace.memory] == totals
    times = [s.time for s in tr.samples]
    assert times == sorted(times)
    report = pickle.loads(pickle.dumps(tr.report()))   # a worker can return it
    assert report["peak_total"] == 80000 and len(report["samples"]) == len(totals)
    del y


def test_device_filter_and_nesting():
    tr = MemoryTracker(device="cuda")                 # no CUDA storage here
    with tr:
        with tr:
            x = torch.empty(100)
    assert tr.total() == 0 and tr.peak_total == 0
    assert (tr.cuda_allocated() is None) == (not torch.cuda.is_available())
    del x


def test_gpt_peak_matches_memtracker():
    models = pytest.importorskip("minifsdp.models")
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = models.build_model("gpt-mini", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (8, 64))
    y = torch.randint(0, vocab, (8, 64))

    def step() -> None:
        opt.zero_grad()
        models.lm_loss(model(x), y).backward()
        opt.step()

    step()                                            # optimizer state now exists
    ours = MemoryTracker()
    ours.track_model(model)
    ours.track_optimizer(opt)
    ours.register([x, y], OTHER)
    with ours:                                        # both watch the same step
        theirs = MemTracker()                         # made inside: see the FSDP2 test
        theirs.track_external(model, opt, x, y)
        with theirs:
            step()
    ref = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours.peak_total - ref) <= 0.05 * ref, (ours.peak_total, ref)
    # and the static parts are exact
    n = sum(p.numel() for p in model.parameters())    # tied weights counted once
    live = ours.snapshot("after step")
    assert live[PARAMETERS] == n * F32
    assert live[GRADIENTS] == n * F32
    n_tensors = len(list(model.parameters()))
    assert live[OPTIMIZER] == 2 * n * F32 + n_tensors * F32
    assert ours.peak_by_category[ACTIVATIONS] > 0
    ours.close()


def test_fsdp2_resize_and_comm_single_rank(tmp_path):
    """torch FSDP2 frees unsharded params with storage.resize_(0): the tracker
    must see it, and agree with MemTracker to the byte on a 1-rank gloo group."""
    models = pytest.importorskip("minifsdp.models")
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        tr = MemoryTracker()
        with tr:
            x = torch.ones(100)
            dist.all_reduce(x)                        # in place: still an activation
            gathered = fc.wait_tensor(fc.all_gather_single(x, 0, dist.group.WORLD))
            assert tr.live()[COMM] == 100 * F32 and tr.live()[ACTIVATIONS] == 100 * F32
        del gathered

        model = models.build_model("gpt-tiny", seed=0)
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randint(0, model.config.vocab_size, (8, 32))
        y = torch.randint(0, model.config.vocab_size, (8, 32))

        def step() -> None:
            opt.zero_grad()
            models.lm_loss(model(x), y).backward()
            opt.step()

        step()
        ours = MemoryTracker()
        ours.track_model(model)                       # DTensor params: their local shards
        ours.track_optimizer(opt)
        ours.register([x, y])
        with ours:
            # Made inside ours so its own resize_ wrapper calls ours (see limitations).
            theirs = MemTracker()
            theirs.track_external(model, opt, x, y)
            with theirs:
                step()
        assert ours.peak_total == theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        assert ours.live()[ACTIVATIONS] == 0          # unsharded params were resize_(0)-ed
        n = sum(p.numel() for p in model.parameters())
        assert ours.live()[PARAMETERS] == n * F32
        ours.close()
    finally:
        dist.destroy_process_group()


def test_module_constants():
    assert memory.CATEGORIES == (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS,
                                 TEMPORARY, COMM, OTHER)


def test_active_trackers_lists_the_open_ones():
    outer, inner = MemoryTracker(), MemoryTracker()
    assert memory.active_trackers() == []
    with outer:
        with inner:
            got = memory.active_trackers()
            got.clear()                                   # a copy: the module's list is untouched
            assert memory.active_trackers() == [outer, inner]
        with outer:                                       # re-entering does not list it twice
            assert memory.active_trackers() == [outer]
    assert memory.active_trackers() == []
