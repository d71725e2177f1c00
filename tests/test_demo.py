"""demo: runs end to end on 2 ranks and writes sane files; bad input fails in one line before any process starts."""

import json
import os

import pytest

from minifsdp import comm, demo

KiB = 1 << 10
FILES = ("trace.json", "summary.json", "timeline.png", "memory.png", "bandwidth.png")


@pytest.fixture(scope="module")
def run_2_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "out")   # does not exist yet: the demo makes it
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        summary = demo.main(["--world-size", "2", "--out", out, "--sizes", "16KiB,256KiB", "--repeats", "3",
                             "--timeout", "90", "--train-steps", "2", "--train-model", "gpt-tiny"])
    return out, summary, buf.getvalue()


def test_demo_writes_every_file(run_2_ranks):
    out, summary, _ = run_2_ranks
    for name in FILES:
        path = os.path.join(out, name)
        assert os.path.getsize(path) > 1000, name
    for name in ("timeline.png", "memory.png", "bandwidth.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f) == {k: v for k, v in summary.items() if k != "train"}


def test_summary_bytes_equal_the_formula(run_2_ranks):
    _, summary, _ = run_2_ranks
    n, repeats = 2, 3
    res = summary["results"]
    # 4 collectives on both ranks + send on rank 0 and recv on rank 1, at 2 sizes
    assert len(res) == (4 * 2 + 2) * 2
    assert {(r["op"], r["rank"]) for r in res} >= {("send", 0), ("recv", 1), ("all_reduce", 0), ("all_reduce", 1)}
    assert sorted({r["tensor_bytes"] for r in res}) == [16 * KiB, 256 * KiB]
    for r in res:
        expected = comm.collective_bytes(r["op"], r["tensor_bytes"], n)
        assert r["bytes"] == expected["bytes"], r          # what the tracer recorded on the span
        assert r["ring_bytes"] == expected["ring_bytes"], r
        assert len(r["seconds"]) == repeats and all(s > 0 for s in r["seconds"])
        assert r["algbw_GBps"] == pytest.approx(r["tensor_bytes"] / r["median_s"] / 1e9)
    ar = [r for r in res if r["op"] == "all_reduce"]
    assert all(r["bytes"] == 2 * r["tensor_bytes"] for r in ar)  # all_reduce moves 2S
    # one table row per (op, size), send and recv together
    assert len(summary["rows"]) == 5 * 2
    for row in summary["rows"]:
        assert len(row["median_s_by_rank"]) == 2 and None not in row["median_s_by_rank"]
    # memory: the largest phase holds at least the all_gather input + output (S/2 + S)
    assert all(p >= 256 * KiB * 3 // 2 for p in summary["peak_bytes_by_rank"])


def test_trace_json_has_spans_for_both_ranks(run_2_ranks):
    out, _, _ = run_2_ranks
    with open(os.path.join(out, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank and e["cat"] == "comm"]
        # warm-up + 3 timed calls per size, 2 sizes
        assert sum(e["name"] == "all_reduce" for e in mine) == 2 * (1 + 3)
        assert sum(e["name"] == ("send" if rank == 0 else "recv") for e in mine) == 2 * (1 + 3)
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
    counters = [e for e in events if e["ph"] == "C"]
    assert max(e["args"].get("comm", 0) for e in counters) >= 256 * KiB


def test_progress_and_where_to_look(run_2_ranks):
    out, _, printed = run_2_ranks
    for phase in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert phase in printed
    assert "https://ui.perfetto.dev" in printed and os.path.join(out, "trace.json") in printed
    assert "algbw GB/s" in printed and "reduce_scatter" in printed


def test_one_rank_skips_send_recv(tmp_path):
    summary = demo.main(["--world-size", "1", "--out", str(tmp_path), "--sizes", "4KiB", "--repeats", "1",
                         "--quiet", "--timeout", "60", "--train-steps", "0"])
    assert "train" not in summary
    assert sorted(r["op"] for r in summary["results"]) == ["all_gather", "all_reduce", "broadcast",
                                                           "reduce_scatter"]
    assert all(r["ring_bytes"] == 0 for r in summary["results"])  # nothing leaves a lone rank


@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "--world-size must be between 1 and"),
    (["--world-size", "-3"], "--world-size must be between 1 and"),
    (["--sizes", "lots"], "cannot read size 'lots'"),
    (["--sizes", "2"], "each size must be at least 8 bytes"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_input_one_line_before_any_process(args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "launch", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(SystemExit) as exc:
        demo.main(args + ["--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("python -m minifsdp.demo: error:")


def test_out_folder_not_writable(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "launch", lambda *a, **k: pytest.fail("a process was started"))
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with pytest.raises(SystemExit):
        demo.main(["--out", str(a_file / "demo")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is not a writable folder" in last and "pass --out to a folder you can write" in last


def test_parse_size():
    assert demo.parse_size("64KiB") == 64 * KiB
    assert demo.parse_size("1.5 MiB") == 3 * (1 << 19)
    assert demo.parse_size("2MB") == 2_000_000
    assert demo.parse_size("4096") == 4096


def test_demo_then_trains_with_ddp(run_2_ranks):
    out, summary, printed = run_2_ranks
    train = summary["train"]
    assert train["strategy"] == "ddp" and train["world_size"] == 2 and len(train["losses"]) == 2
    for name in ("metrics.json", "trace.json", "timeline.png", "memory.png"):
        assert os.path.getsize(os.path.join(out, "train", name)) > 0
    assert "training gpt-tiny with ddp on 2 rank(s)" in printed
