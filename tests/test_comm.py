"""Instrumented collectives against hand-computed results at world sizes 1, 2, 4; byte counts equal the formula."""

import pytest
import torch
import torch.distributed as tdist

from minifsdp import WorkerError, comm, launch, trace


def _all_collectives():
    r, n = tdist.get_rank(), tdist.get_world_size()
    out = {}
    with trace.Tracer() as tracer:
        # all_reduce: rank r holds [r+1, 2(r+1)]
        t = torch.tensor([r + 1.0, 2.0 * (r + 1)])
        comm.all_reduce(t)
        out["all_reduce"] = t
        # all_gather: rank r holds [10r, 10r+1]
        out["all_gather"] = comm.all_gather(torch.tensor([10.0 * r, 10.0 * r + 1]))
        # reduce_scatter: every rank holds arange(2n) * (r+1)
        out["reduce_scatter"] = comm.reduce_scatter(torch.arange(2.0 * n) * (r + 1))
        # broadcast from the last rank
        b = torch.full((3,), float(r))
        comm.broadcast(b, src=n - 1)
        out["broadcast"] = b
        # async all_reduce with MAX
        m = torch.tensor([float(r)])
        handle = comm.all_reduce(m, op=comm.ReduceOp.MAX, async_op=True)
        handle.wait()
        out["max"] = m
        # ring of send/recv: send to the right, receive from the left
        if n > 1:
            got = torch.zeros(2)
            send_to, recv_from = (r + 1) % n, (r - 1) % n
            hs = comm.isend(torch.tensor([float(r), float(r)]), send_to)
            comm.recv(got, recv_from)
            hs.wait()
            out["ring"] = got
    out["spans"] = [(s.name, s.args["bytes"], s.args["ring_bytes"], s.args["group_size"], s.kind)
                    for s in tracer.trace.spans]
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_collectives_match_hand_computed(n):
    results = launch(_all_collectives, n)
    tri = n * (n + 1) / 2  # sum of (r+1) over ranks
    for r, out in enumerate(results):
        assert torch.equal(out["all_reduce"], torch.tensor([tri, 2 * tri]))
        assert torch.equal(out["all_gather"], torch.tensor([v for k in range(n) for v in (10.0 * k, 10.0 * k + 1)]))
        # chunk r of arange(2n) * sum(r+1) is [2r, 2r+1] * tri
        assert torch.equal(out["reduce_scatter"], torch.tensor([2.0 * r, 2.0 * r + 1]) * tri)
        assert torch.equal(out["broadcast"], torch.full((3,), float(n - 1)))
        assert out["max"].item() == n - 1
        if n > 1:
            assert torch.equal(out["ring"], torch.full((2,), float((r - 1) % n)))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_byte_counts_equal_formula(n):
    spans = {name: (b, ring, g) for name, b, ring, g, kind in launch(_all_collectives, n)[0]["spans"] if kind == "comm"}
    f = 4  # fp32 bytes
    assert spans["all_gather"] == (2 * n * f, 2 * n * f * (n - 1) // n, n)       # output is 2n floats
    assert spans["reduce_scatter"] == (2 * n * f, 2 * n * f * (n - 1) // n, n)   # input is 2n floats
    assert spans["broadcast"] == (3 * f, 3 * f * (n - 1) // n, n)
    # the first all_reduce (2 floats) is 2x the tensor; the async MAX one (1 float) is recorded last
    all_reduce_spans = [s for s in launch(_all_collectives, n)[0]["spans"] if s[0] == "all_reduce"]
    assert [(b, ring) for _, b, ring, _, _ in all_reduce_spans] == [(2 * 2 * f, 2 * 2 * f * (n - 1) // n),
                                                                  (2 * 1 * f, 2 * 1 * f * (n - 1) // n)]
    if n > 1:
        assert spans["send"] == (2 * f, 2 * f, n) and spans["recv"] == (2 * f, 2 * f, n)


def test_collective_bytes_formula():
    assert comm.collective_bytes("all_reduce", 1000, 4) == {"bytes": 2000, "ring_bytes": 1500}
    assert comm.collective_bytes("all_gather", 1000, 4) == {"bytes": 1000, "ring_bytes": 750}
    assert comm.collective_bytes("reduce_scatter", 1000, 1) == {"bytes": 1000, "ring_bytes": 0}


def _uneven_gather():
    comm.all_gather_into_tensor(torch.zeros(7), torch.zeros(3))


def _uneven_across_ranks():
    comm.CHECK_ACROSS_RANKS = True
    comm.all_gather(torch.zeros(3 + tdist.get_rank()))


def test_uneven_inputs_rejected_with_fix():
    with pytest.raises(WorkerError, match="size the output N x input"):
        launch(_uneven_gather, 2)
    with pytest.raises(WorkerError, match="ranks hold different sizes \\[3, 4\\].*pad"):
        launch(_uneven_across_ranks, 2)
    with pytest.raises(WorkerError, match="divisible by the group size") as info:
        launch(lambda: comm.reduce_scatter(torch.zeros(3)), 2)
    assert isinstance(info.value.__cause__, ValueError)


def test_collective_outside_group_names_the_fix():
    with pytest.raises(RuntimeError, match="inside minifsdp.launch"):
        comm.all_reduce(torch.zeros(2))


def test_pad_to_multiple():
    assert torch.equal(comm.pad_to_multiple(torch.tensor([1.0, 2.0, 3.0]), 2), torch.tensor([1.0, 2.0, 3.0, 0.0]))
    assert comm.pad_to_multiple(torch.ones(2, 2), 4).shape == (4,)


def _traced_run():
    tracer = trace.Tracer()
    with tracer, tracer.span("forward", step=0):
        comm.all_reduce(torch.ones(4))
    return tracer.trace


def test_traces_return_and_export(tmp_path):
    import json

    traces = launch(_traced_run, 2)
    assert [t.rank for t in traces] == [0, 1]
    path = trace.save_chrome_trace(traces, tmp_path / "trace.json")
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["name"], e["tid"]) for e in spans} == {(0, "forward", 0), (1, "forward", 0),
                                                                (0, "all_reduce", 1), (1, "all_reduce", 1)}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert traces[0].bytes_by_op() == {"all_reduce": 32}


def test_spans_appear_in_torch_profiler():
    tracer = trace.Tracer(rank=0)
    with torch.profiler.profile() as prof, tracer, tracer.span("my_forward_span"):
        torch.ones(3).sum()
    assert "my_forward_span" in {e.key for e in prof.key_averages()}


def _annotated_run():
    tracer = trace.Tracer()
    with tracer:
        with comm.annotate(unit="blocks.0"):
            comm.all_reduce(torch.ones(2))                                            # sync
            handle = comm.all_gather_into_tensor(torch.empty(2 * tdist.get_world_size()), torch.ones(2),
                                                 async_op=True)
            with comm.annotate(phase="backward", unit="blocks.1"):                     # nesting: merge, inner wins
                comm.broadcast(torch.ones(1), src=0)
                comm.barrier()
        handle.wait()                      # recorded after the block: keeps the labels it was called with
        comm.all_reduce(torch.ones(1))     # outside any block: no labels
        inside = comm.annotations()
    return [(s.name, {k: s.args[k] for k in ("unit", "phase") if k in s.args}, s.args["bytes"])
            for s in tracer.trace.spans], inside


def test_annotate_labels_sync_and_async_spans_and_nests():
    spans, inside = launch(_annotated_run, 2, timeout=60)[1]
    assert inside == {}
    assert [(name, labels) for name, labels, _ in spans] == [
        ("all_reduce", {"unit": "blocks.0"}),
        ("broadcast", {"unit": "blocks.1", "phase": "backward"}),
        ("barrier", {"unit": "blocks.1", "phase": "backward"}),
        ("all_gather", {"unit": "blocks.0"}),
        ("all_reduce", {}),
    ]
    assert [b for *_, b in spans] == [16, 4, 0, 16, 8]  # comm's own arguments untouched


def test_annotate_rejects_reserved_names():
    with pytest.raises(ValueError, match=r"\['bytes'\] are span arguments comm records itself; choose other"):
        with comm.annotate(bytes=3):
            pass
    assert comm.annotations() == {}
