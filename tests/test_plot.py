"""plot: figures have the expected bars, labels and units; numbers drawn equal the numbers given.

The collective diagrams are checked against real collectives: the values the
diagram says each rank holds *after* are what ``comm`` returns on 3 ranks.
"""

import re

import pytest
import torch
import torch.distributed as tdist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb

from minifsdp import comm, launch, plot
from minifsdp.trace import COMM, COMPUTE, MemorySample, Span, Trace

MiB = 1 << 20


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _bars(fig):
    """(axes, [(x_left_ms, width_ms, y_bottom, height)]) of every span bar in the figure."""
    out = []
    for ax in fig.axes:
        for coll in ax.collections:
            if coll.get_gid() == "minifsdp-span":
                for path in coll.get_paths():
                    (x0, y0), (x1, y1) = path.get_extents().get_points()
                    out.append((x0, x1 - x0, y0, y1 - y0))
    return out


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def _synthetic_traces():
    """Two ranks; rank 1 listed first to check ordering. Times in seconds from 100.0."""
    t = 100.0
    r0 = Trace(rank=0, spans=[
        Span("step", COMPUTE, t + 0.000, t + 0.100),
        Span("forward", COMPUTE, t + 0.000, t + 0.030),     # nested in step
        Span("backward", COMPUTE, t + 0.030, t + 0.080),
        Span("all_reduce", COMM, t + 0.040, t + 0.090, {"bytes": 4 * MiB, "ring_bytes": 2 * MiB}),
        Span("optimizer", COMPUTE, t + 0.085, t + 0.100),
    ])
    r1 = Trace(rank=1, spans=[
        Span("forward", COMPUTE, t + 0.002, t + 0.032),
        Span("all_gather", COMM, t + 0.035, t + 0.036, {"bytes": 1024}),
        Span("all_reduce", COMM, t + 0.042, t + 0.095, {"bytes": 4 * MiB}),
    ])
    return [r1, r0]


# --------------------------------------------------------------------------
# human_bytes, colours, Figure
# --------------------------------------------------------------------------
@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (4 * MiB, "4.0 MiB"), (int(81.2 * MiB), "81.2 MiB"), (3 << 30, "3.0 GiB"),
    (5 << 40, "5.0 TiB"), (-2 * MiB, "-2.0 MiB"), (2048.0, "2.0 KiB"),
])
def test_human_bytes(n, text):
    assert plot.human_bytes(n) == text


def test_colours_stable_and_distinct_per_collective():
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"]
    assert len({plot.color_for(op) for op in ops}) == len(ops)
    assert plot.color_for("my_custom_span") == plot.color_for("my_custom_span")
    assert plot.color_for("parameters") == plot.CATEGORY_COLORS["parameters"]


def test_figure_renders_png_for_notebooks():
    fig = plot.timeline(_synthetic_traces())
    assert isinstance(fig, plot.Figure)
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------
# timeline
# --------------------------------------------------------------------------
def test_timeline_one_bar_per_span_at_the_right_place():
    traces = _synthetic_traces()
    fig = plot.timeline(traces, title="two ranks")
    (ax,) = fig.axes
    bars = _bars(fig)
    assert len(bars) == sum(len(t.spans) for t in traces) == 8
    # x in ms from the earliest event (100.000 s): the bars' left edges and widths, in order
    got = sorted((round(x, 6), round(w, 6)) for x, w, _, _ in bars)
    want = sorted((round((s.start - 100.0) * 1e3, 6), round(s.duration * 1e3, 6))
                  for t in traces for s in t.spans)
    assert got == want
    assert ax.get_xlabel() == "time (ms) from the first event"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    assert ax.get_title() == "two ranks"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(legend) == {"step", "forward", "backward", "optimizer", "all_reduce", "all_gather"}
    # the wide all_reduce carries op + bytes; the 1 ms all_gather has no room for a label
    texts = _texts(fig)
    assert "all_reduce 4.0 MiB" in texts
    assert not any(t.startswith("all_gather") for t in texts)


def test_timeline_nested_spans_drawn_thinner_on_top():
    fig = plot.timeline(_synthetic_traces()[1:])  # rank 0 only
    heights = sorted({round(h, 3) for _, _, _, h in _bars(fig)})
    assert heights == [0.6, 0.8]  # "step" full height, spans inside it 3/4
    assert plot._depths([Span("a", COMPUTE, 0, 10), Span("b", COMPUTE, 1, 2), Span("c", COMPUTE, 3, 4),
                         Span("d", COMPUTE, 11, 12)]) == [0, 1, 1, 0]


def test_timeline_labels_never_overprint():
    # a DDP-like step: step > forward, backward > ddp.backward, optimizer; with gaps in the step
    t, spans = 0.0, []
    for k in range(3):
        b = t + k * 0.1
        spans += [Span("step", COMPUTE, b, b + 0.09), Span("forward", COMPUTE, b + 0.01, b + 0.03),
                  Span("backward", COMPUTE, b + 0.03, b + 0.07), Span("ddp.backward", COMPUTE, b + 0.035, b + 0.065),
                  Span("optimizer", COMPUTE, b + 0.07, b + 0.085),
                  Span("all_reduce", COMM, b + 0.04, b + 0.07, {"bytes": 3 * MiB})]
    # the geometry this test was written for: a 12 in axis (lab figures are a 10.5 in column; a
    # narrower axis drops the labels that no longer fit, which is the rule under test too)
    fig = plot.Figure(figsize=(12, 2.0), layout="constrained")
    plot.timeline(Trace(rank=0, spans=spans), window=(0.0, 190.0), ax=fig.add_subplot())
    FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    boxes = [(t.get_text(), t.get_window_extent()) for t in fig.axes[0].texts]
    # "backward" is hidden by its child but for 5 ms slivers: no room, no label
    assert {"step", "forward", "ddp.backward", "optimizer", "all_reduce 3.0 MiB"} <= {b[0] for b in boxes}
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            assert not a.overlaps(b), (ta, tb)


def test_timeline_window_draws_only_overlapping_spans():
    traces = _synthetic_traces()
    fig = plot.timeline(traces, window=(33.0, 50.0))
    overlapping = [s for t in traces for s in t.spans
                   if (s.end - 100.0) * 1e3 >= 33.0 and (s.start - 100.0) * 1e3 <= 50.0]
    assert len(_bars(fig)) == len(overlapping) == 5  # step, backward, all_reduce x2, all_gather
    assert fig.axes[0].get_xlim() == (33.0, 50.0)
    with pytest.raises(ValueError, match="end > start"):
        plot.timeline(traces, window=(5.0, 5.0))


def test_timeline_into_given_axes_and_empty_trace():
    base = plot.Figure()
    ax = base.add_subplot()
    assert plot.timeline([Trace(rank=0)], ax=ax) is base
    assert "no spans recorded" in _texts(base)
    with pytest.raises(TypeError, match="trace.Trace"):
        plot.timeline([{"rank": 0}])


# --------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------
def _samples(t0=50.0):
    cats = [
        {"parameters": 10 * MiB, "gradients": 0, "activations": 1 * MiB},
        {"parameters": 10 * MiB, "gradients": 0, "activations": 30 * MiB, "comm": 2 * MiB},
        {"parameters": 10 * MiB, "gradients": 10 * MiB, "activations": 5 * MiB, "custom": 1 * MiB},
        {"parameters": 10 * MiB, "gradients": 10 * MiB, "optimizer": 20 * MiB},
    ]
    return [MemorySample(t0 + 0.004 * i, c) for i, c in enumerate(cats)]


def test_memory_peak_annotation_equals_computed_max():
    samples = _samples()
    fig = plot.memory(samples)
    (ax,) = fig.axes
    peak = max(samples, key=lambda m: m.total)            # 42 MiB at 4 ms
    assert peak.total == 42 * MiB
    (ann,) = [t for t in ax.texts if t.get_gid() == "minifsdp-peak"]
    assert ann.get_text() == "peak 42.0 MiB at 4.0 ms"
    m = re.fullmatch(r"peak ([\d.]+) MiB at ([\d.]+) ms", ann.get_text())
    assert float(m.group(1)) == pytest.approx(peak.total / MiB, abs=0.05)
    # the top of the stack is the peak, in MiB
    top = max(p.get_extents().y1 for c in ax.collections for p in c.get_paths())
    assert top == pytest.approx(42.0)
    assert ax.get_xlabel() == "time (ms)" and "MiB" in ax.get_ylabel()
    # one stacked layer per category that is ever non-zero, known ones in the fixed order
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["parameters", "gradients", "optimizer", "activations", "comm", "custom"]
    assert len(ax.collections) == len(legend)
    for coll, cat in zip(ax.collections, legend):
        assert tuple(coll.get_facecolor()[0][:3]) == pytest.approx(to_rgb(plot.color_for(cat)))


def test_memory_per_rank_subplots_share_time_zero():
    traces = [Trace(rank=r, memory=_samples(t0=50.0 + 0.010 * r)) for r in (1, 0)]
    traces[0].spans.append(Span("forward", COMPUTE, 49.99, 50.0))  # the earliest event: time zero
    fig = plot.memory(traces, title="2 ranks")
    assert len(fig.axes) == 2
    assert [ax.get_ylabel() for ax in fig.axes] == ["rank 0 MiB", "rank 1 MiB"]
    anns = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "minifsdp-peak"]
    assert anns == ["peak 42.0 MiB at 14.0 ms", "peak 42.0 MiB at 24.0 ms"]
    assert fig.axes[-1].get_xlabel() == "time (ms)"


def test_memory_accepts_tracker_report_and_checks_axes():
    fig = plot.memory({"samples": _samples(), "peak_total": 42 * MiB})
    assert any(t.get_text().startswith("peak 42.0 MiB") for t in fig.axes[0].texts)
    small = plot.memory([MemorySample(0.0, {"parameters": 848}), MemorySample(0.001, {"parameters": 848,
                                                                                      "gradients": 848})], unit="KiB")
    assert small.axes[0].get_ylabel() == "live memory (KiB)"
    assert max(p.get_extents().y1 for c in small.axes[0].collections for p in c.get_paths()) == pytest.approx(
        2 * 848 / 1024)
    with pytest.raises(ValueError, match="unit must be one of"):
        plot.memory(_samples(), unit="MB")
    with pytest.raises(ValueError, match="one axes per trace"):
        plot.memory([Trace(rank=0), Trace(rank=1)], ax=plot.Figure().add_subplot())
    with pytest.raises(TypeError, match="MemorySample"):
        plot.memory([1, 2, 3])


# --------------------------------------------------------------------------
# bandwidth
# --------------------------------------------------------------------------
def test_bandwidth_lines_through_medians_log_log():
    results = [{"op": op, "world_size": ws, "bytes": b, "seconds": b / 1e9 * k + 1e-4}
               for op in ("all_reduce", "all_gather") for ws in (2, 4)
               for b in (1 << 12, 1 << 16, 1 << 20) for k in (1.0, 2.0, 9.0)]
    fig = plot.bandwidth(results)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "bytes" in ax.get_xlabel() and ax.get_ylabel() == "time per call (ms)"
    lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert set(lines) == {"all_reduce, 2 ranks", "all_reduce, 4 ranks", "all_gather, 2 ranks",
                          "all_gather, 4 ranks"}
    x, y = lines["all_reduce, 4 ranks"].get_data()
    assert list(x) == [1 << 12, 1 << 16, 1 << 20]
    assert list(y) == pytest.approx([(b / 1e9 * 2.0 + 1e-4) * 1e3 for b in x])  # median of k = 1, 2, 9
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4.0 KiB", "64.0 KiB", "1.0 MiB"]
    assert any(t.get_text().endswith("GB/s") for t in ax.texts)


def test_bandwidth_bad_input_names_the_keys():
    with pytest.raises(ValueError, match=r"\['bytes', 'op', 'seconds', 'world_size'\]"):
        plot.bandwidth([{"op": "all_reduce", "bytes": 10}])
    with pytest.raises(ValueError, match="> 0"):
        plot.bandwidth([{"op": "all_reduce", "world_size": 2, "bytes": 10, "seconds": 0}])


# --------------------------------------------------------------------------
# collective_diagram: what it draws is what the collectives do
# --------------------------------------------------------------------------
def _run_diagram_ops(n):
    r = tdist.get_rank()
    out = {}
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        before, _ = plot._holdings(op, n, src=1)
        mine = [cell[0] if cell is not None and cell[1] != "old" else 0 for cell in before[r]]
        t = torch.tensor(mine, dtype=torch.float32)
        if op == "all_reduce":
            comm.all_reduce(t)
            out[op] = t.tolist()
        elif op == "reduce_scatter":
            out[op] = comm.reduce_scatter(t).tolist()
        elif op == "all_gather":
            out[op] = comm.all_gather(t[r:r + 1]).tolist()
        else:
            comm.broadcast(t, src=1)
            out[op] = t.tolist()
    return out


def test_diagram_after_values_are_what_comm_returns():
    n = 3
    results = launch(_run_diagram_ops, n, n, timeout=60)
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        _, after = plot._holdings(op, n, src=1)
        for r in range(n):
            drawn = [cell[0] for cell in after[r] if cell is not None]
            assert drawn == results[r][op], (op, r)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_diagram_draws_every_block_with_its_value(op):
    n = 4
    fig = plot.collective_diagram(op, n)
    (ax,) = fig.axes
    before, after = plot._holdings(op, n, src=0)
    cells = [c for grid in (before, after) for row in grid for c in row]
    assert len(ax.patches) == len(cells) == 2 * n * n
    values = {str(c[0]) for c in cells if c is not None}
    assert values <= set(_texts(fig))
    assert ax.get_title().startswith(f"{op}, {n} ranks")
    vol = comm.collective_bytes(op, 1, n)["bytes"]
    assert any(f"volume {vol}S" in t for t in _texts(fig))


def test_diagram_bad_input():
    with pytest.raises(ValueError, match="choose one of"):
        plot.collective_diagram("all_to_all", 2)
    with pytest.raises(ValueError, match="world_size must be 1..8"):
        plot.collective_diagram("all_reduce", 9)
    with pytest.raises(ValueError, match="src must be a rank"):
        plot.collective_diagram("broadcast", 2, src=2)


@pytest.mark.notebook  # a Jupyter kernel, started through a name conftest.py cannot follow
def test_notebook_shows_a_returned_figure_once():
    """In a Jupyter kernel (inline backend, nothing forced) a returned figure is one PNG output."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from minifsdp import plot\nplot.collective_diagram('all_gather', 2)"),
                nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplot.human_bytes(3 << 20)")]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    first, second = (c.outputs for c in nb.cells)
    assert [o.output_type for o in first] == ["execute_result"]
    assert first[0].data["image/png"]  # base64 PNG, shown inline
    assert second[0].data["text/plain"] == "'3.0 MiB'"


def test_figures_fit_a_notebook_column():
    """Labs are read at laptop width (~1100 px at 100 dpi): no figure is wider than a column."""
    traces = [Trace(rank=r, memory=_samples(t0=50.0)) for r in (0, 1)]
    for r, t in enumerate(traces):
        t.spans.append(Span("forward", COMPUTE, 50.0, 50.002 + r * 0.001))
    for fig in (plot.timeline(traces), plot.memory(traces), plot.memory(_samples())):
        width, _ = fig.get_size_inches()
        assert width <= plot.COLUMN_WIDTH_IN, f"{width} in wide > {plot.COLUMN_WIDTH_IN} in column"


# --------------------------------------------------------------------------
# mesh diagram: HSDP's dp split
# --------------------------------------------------------------------------
def test_mesh_diagram_outlines_hsdp_shard_groups():
    from minifsdp.mesh import DeviceMesh

    mesh = DeviceMesh(dp=4, tp=2, dp_shard=2)  # 2 "nodes" of 2 dp ranks, each split over tp=2
    ax = plot.mesh_diagram(mesh).axes[0]
    outlined = sorted(p.get_label() for p in ax.patches if p.get_label().startswith("dp_shard group"))
    assert outlined == sorted(f"dp_shard group {g}" for g in mesh.groups("dp_shard"))  # [0, 2] [1, 3] [4, 6] [5, 7]
    texts = [t.get_text() for t in ax.texts]
    assert [t for t in texts if t.startswith("shard group")] == ["shard group 0\n(node 0)", "shard group 1\n(node 1)"]
    # each dp row names its replicate group; the ranks of one column whose rows share a name = mesh's groups
    row_label = {t.get_position()[1]: t.get_text() for t in ax.texts if t.get_text().startswith("replicate group")}
    assert sorted(row_label.values()) == ["replicate group 0"] * 2 + ["replicate group 1"] * 2
    drawn: dict = {}
    for t in ax.texts:
        if t.get_text().startswith("rank "):
            x, y = t.get_position()
            drawn.setdefault((x, row_label[y]), []).append(int(t.get_text().split()[1]))
    assert sorted(sorted(g) for g in drawn.values()) == sorted(mesh.groups("dp_replicate"))  # [0, 4] [1, 5] ...
    assert "dp_shard group" in ax.get_title()
    plain = plot.mesh_diagram(DeviceMesh(dp=4, tp=2)).axes[0]  # no split: nothing of it drawn
    assert not any(p.get_label().startswith("dp_shard") for p in plain.patches)
    assert not any("group" in t.get_text() and "shard" in t.get_text() for t in plain.texts)
