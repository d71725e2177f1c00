"""Pictures of what minifsdp records: per-rank timelines, memory by category,
collective bandwidth, and who-holds-what diagrams of the collectives.

Layer 6 (front). Input is plain data from the recording layer
(``trace.Trace``, ``trace.MemorySample``) or lists of dicts; output is a
matplotlib ``Figure``. The pictures mirror the ones a learner meets
elsewhere: the per-rank timeline of Perfetto / ``torch.profiler`` traces, the
stacked memory-by-category plot of PyTorch's memory visualiser
(``torch.cuda.memory._snapshot``) and ``MemTracker``, the bytes-vs-time plot
of ``nccl-tests``, and the before/after block diagrams of the NCCL docs.

    traces = launch(worker, 2)                    # each worker returns tracer.trace
    plot.timeline(traces).savefig("timeline.png")
    plot.memory(traces)                           # in a notebook: shows inline
    plot.collective_diagram("reduce_scatter", 4)

Why no pyplot: ``pyplot`` keeps a global registry of figures and picks a GUI
backend; a script on a headless machine can then fail, and a notebook shows
every registered figure a second time at the end of the cell. A bare
``Figure`` draws with Agg wherever it is, ``savefig`` works, and our subclass
adds ``_repr_png_`` so IPython shows a returned figure inline exactly once,
whatever backend the notebook uses. Pass ``ax=`` to draw into your own
(pyplot or not) axes instead.
"""

from __future__ import annotations

import bisect
import io
import statistics
import zlib
from typing import Any, Iterable, Sequence

import matplotlib.figure
import matplotlib.patches as mpatches
from matplotlib.axes import Axes
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from . import comm
from .estimate import format_bytes
from .trace import COMM, COMPUTE, MemorySample, Trace

COLUMN_WIDTH_IN = 10.5  # inches: a notebook column is ~1100 px, and lab figures are drawn at 100 dpi

__all__ = ["timeline", "memory", "bandwidth", "collective_diagram", "human_bytes",
           "color_for", "Figure", "MiB", "CATEGORY_COLORS", "OP_COLORS"]

MiB = 1 << 20

# One colour per collective, the same in every picture of the lab (tab10 hues).
OP_COLORS = {
    "all_reduce": "#d62728", "all_gather": "#1f77b4", "reduce_scatter": "#2ca02c",
    "broadcast": "#9467bd", "send": "#ff7f0e", "recv": "#e7a53c", "barrier": "#7f7f7f",
}
# Compute spans the techniques open; muted, so communication stands out.
COMPUTE_COLORS = {
    "step": "#e8e8e8", "forward": "#8fb8de", "backward": "#f2b880", "optimizer": "#a8d5a2",
    "wrap": "#d9d9d9",
}
# Memory categories (minifsdp.memory's names), bottom of the stack first.
CATEGORY_COLORS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868",
    "activations": "#c44e52", "temporary": "#e6b0aa", "comm": "#8172b3", "other": "#b0b0b0",
}
_FALLBACK = ["#17becf", "#bcbd22", "#e377c2", "#8c564b", "#aec7e8", "#ffbb78",
             "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5"]


class Figure(matplotlib.figure.Figure):
    """A matplotlib Figure that IPython displays inline as PNG (see module docstring)."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        return buf.getvalue()


def human_bytes(n: float) -> str:
    """Bytes in binary units with one decimal, as the lab prints them everywhere (``estimate.format_bytes``).

    >>> human_bytes(512), human_bytes(4 * 2**20), human_bytes(1536), human_bytes(0)
    ('512 B', '4.0 MiB', '1.5 KiB', '0 B')
    """
    return format_bytes(n, digits=1)


def color_for(name: str) -> str:
    """A stable colour for a span name or memory category (same name, same colour, every plot)."""
    for table in (OP_COLORS, CATEGORY_COLORS, COMPUTE_COLORS):
        if name in table:
            return table[name]
    # crc32, not hash(): Python salts str hashes per process, colours must not change between runs.
    return _FALLBACK[zlib.crc32(name.encode()) % len(_FALLBACK)]


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure | Any, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _as_traces(traces: Trace | Iterable[Trace]) -> list[Trace]:
    out = [traces] if isinstance(traces, Trace) else list(traces)
    if not all(isinstance(t, Trace) for t in out):
        raise TypeError("expected a trace.Trace or a list of them (what tracer.trace holds; "
                        "return it from each launched worker)")
    return out


def _t0(traces: Sequence[Trace]) -> float:
    """The earliest event of any rank: time zero, shared by timeline() and memory()."""
    times = [s.start for t in traces for s in t.spans] + [m.time for t in traces for m in t.memory]
    return min(times, default=0.0)


# --------------------------------------------------------------------------
# timeline
# --------------------------------------------------------------------------
def _depths(spans: list[Any]) -> list[int]:
    """How many earlier spans of the lane are still open when each span starts.

    Compute spans nest ("step" holds "forward"); async collectives overlap. A
    deeper span is drawn thinner on top, so neither hides the other.
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, -spans[i].end))
    open_ends: list[float] = []
    depth = [0] * len(spans)
    for i in order:
        open_ends = [e for e in open_ends if e > spans[i].start]
        depth[i] = len(open_ends)
        open_ends.append(spans[i].end)
    return depth


def _span_labels(s: Any) -> list[str]:
    """Label candidates, longest first: "all_reduce 4.0 MiB", "all_reduce", "4.0 MiB"."""
    if s.kind == COMM and s.args.get("bytes"):
        size = human_bytes(s.args["bytes"])
        return [f"{s.name} {size}", s.name, size]
    return [s.name]


def _place_labels(ax: Axes, spans: list[Any], depths: list[int], t0: float, window: tuple[float, float],
                  y: float, char_ms: float, budget: int) -> int:
    """Label the bars of one lane where the text fits; returns how many labels were drawn.

    Innermost spans first. A span's label goes in the widest stretch of its
    visible bar that no deeper bar and no earlier label covers (so "step"
    is written in a gap between "forward" and "backward", not across them),
    using the longest text candidate that fits there (``_span_labels``).
    """
    lo, hi = window
    ms = [(max((s.start - t0) * 1e3, lo), min((s.end - t0) * 1e3, hi)) for s in spans]
    by_start = sorted(range(len(spans)), key=lambda i: ms[i][0])
    starts = [ms[i][0] for i in by_start]
    placed: list[tuple[float, float]] = []
    for i in sorted(range(len(spans)), key=lambda i: -depths[i]):
        if len(placed) >= budget:
            break
        x0, x1 = ms[i]
        texts = _span_labels(spans[i])
        if x1 - x0 < char_ms * (min(len(t) for t in texts) + 1):
            continue  # too narrow for any label: skip the search below
        # children start inside the parent (nesting): find them by bisection
        j0, j1 = bisect.bisect_left(starts, x0), bisect.bisect_right(starts, x1)
        taken = [ms[k] for k in by_start[j0:j1] if depths[k] > depths[i]]
        taken += [p for p in placed if p[1] > x0 and p[0] < x1]
        gaps, cursor = [], x0
        for a, b in sorted(taken):
            if a > cursor:
                gaps.append((cursor, a))
            cursor = max(cursor, b)
        gaps.append((cursor, x1))
        g0, g1 = max(gaps, key=lambda g: g[1] - g[0])
        for text in texts:
            width = char_ms * (len(text) + 1)
            if width <= g1 - g0:
                mid = (g0 + g1) / 2
                ax.text(mid, y, text, ha="center", va="center", fontsize=7, zorder=20, clip_on=True)
                placed.append((mid - width / 2, mid + width / 2))
                break
    return len(placed)


def timeline(traces: Trace | Sequence[Trace], ax: Axes | None = None, title: str | None = None,
             window: tuple[float, float] | None = None, max_labels: int = 400) -> Figure:
    """One row per rank, two lanes each (compute above, comm below), every span a bar.

    Bars are coloured by name (each collective its own colour, see
    ``OP_COLORS``); a bar wide enough for it carries its name, and for
    collectives the bytes moved (the ``bytes`` the tracer recorded: the
    ZeRO-paper volume, e.g. 2x the tensor for all_reduce). Time is in
    milliseconds from the earliest event of any rank, so ranks line up.
    ``window=(start_ms, end_ms)`` zooms in (e.g. past a slow first step):
    only spans that overlap it are drawn, and labels are fitted to it.

        >>> fig = timeline([tr0, tr1], title="DDP, 2 ranks")   # doctest: +SKIP
        >>> fig.savefig("timeline.png")                         # doctest: +SKIP
    """
    traces = sorted(_as_traces(traces), key=lambda t: t.rank)
    fig, ax = _new_axes(ax, (COLUMN_WIDTH_IN, 0.9 + 1.1 * max(len(traces), 1)))
    t0 = _t0(traces)
    t_end = max((s.end for t in traces for s in t.spans), default=t0 + 1e-3)
    lo_ms, hi_ms = window if window is not None else (0.0, max((t_end - t0) * 1e3, 1e-3) * 1.01)
    if not hi_ms > lo_ms:
        raise ValueError(f"timeline(): window must be (start_ms, end_ms) with end > start; got {window}")
    ax.set_xlim(lo_ms, hi_ms)

    # Where there is room for a label: the bar's width in pixels against the
    # text's (about 0.6 em per character). Measured once, from the axes size.
    fig_w_in = fig.get_size_inches()[0]
    axes_px = fig_w_in * fig.dpi * ax.get_position().width * 0.85
    px_per_ms = axes_px / (hi_ms - lo_ms)
    char_px = 0.6 * 7 * fig.dpi / 72

    lane_h, yticks, ylabels, seen_names = 0.8, [], [], {}
    labels_drawn = 0
    for row, tr in enumerate(traces):
        for lane_i, kind in enumerate((COMPUTE, COMM)):
            y = row * 2.6 + lane_i * 1.0
            yticks.append(y + lane_h / 2)
            ylabels.append(f"rank {tr.rank} {kind}")
            spans = [s for s in tr.spans if (s.kind == COMM) == (kind == COMM)
                     and (s.end - t0) * 1e3 >= lo_ms and (s.start - t0) * 1e3 <= hi_ms]
            depths = _depths(spans)
            # One collection per (name, depth): thousands of spans stay fast to draw.
            groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
            for s, d in zip(spans, depths):
                groups.setdefault((s.name, d), []).append(((s.start - t0) * 1e3, max(s.duration, 0.0) * 1e3))
            for (name, d), xranges in groups.items():
                h = lane_h * max(0.4, 1.0 - 0.25 * d)
                coll = ax.broken_barh(xranges, (y + (lane_h - h) / 2, h), facecolors=color_for(name),
                                      edgecolors="white", linewidth=0.3, zorder=2 + d)
                coll.set_gid("minifsdp-span")  # tests and users can find the bars
                seen_names.setdefault(name, kind)
            labels_drawn += _place_labels(ax, spans, depths, t0, (lo_ms, hi_ms), y + lane_h / 2,
                                          char_px / px_per_ms, max_labels - labels_drawn)

    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(max(yticks, default=0) + 0.8, -0.4)  # rank 0 on top
    ax.set_xlabel("time (ms) from the first event")
    ax.set_ylabel("rank / lane")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"timeline, {len(traces)} rank(s)")
    if not seen_names:
        ax.text(0.5, 0.5, "no spans recorded", transform=ax.transAxes, ha="center", color="gray")
    # Legend: compute names first, then collectives.
    names = sorted(seen_names, key=lambda n: (seen_names[n] == COMM, n))
    handles = [mpatches.Patch(color=color_for(n), label=n) for n in names]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
                  frameon=False, title="span", title_fontsize=8)
    return fig


# --------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------
def _memory_series(obj: Any) -> tuple[list[tuple[str, list[MemorySample]]], float]:
    """Normalise memory()'s input to [(label, samples)] and a time zero."""
    if isinstance(obj, dict) and "samples" in obj:          # MemoryTracker.report()
        obj = obj["samples"]
    elif hasattr(obj, "samples") and not isinstance(obj, (list, tuple)):  # a MemoryTracker
        obj = obj.samples
    if isinstance(obj, Trace) or (isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], Trace)):
        traces = sorted(_as_traces(obj), key=lambda t: t.rank)
        return [(f"rank {t.rank}", sorted(t.memory, key=lambda m: m.time)) for t in traces], _t0(traces)
    samples = list(obj)
    if not all(isinstance(m, MemorySample) for m in samples):
        raise TypeError("memory() takes a Trace, a list of Traces, a list of MemorySamples or a "
                        "MemoryTracker / its report()")
    samples.sort(key=lambda m: m.time)
    return [("", samples)], (samples[0].time if samples else 0.0)


def _categories(samples: Iterable[MemorySample]) -> list[str]:
    """Categories that are ever non-zero: known ones in CATEGORY_COLORS order, then the rest."""
    present: dict[str, None] = {}
    for m in samples:
        for c, b in m.bytes_by_category.items():
            if b:
                present.setdefault(c, None)
    known = [c for c in CATEGORY_COLORS if c in present]
    return known + [c for c in present if c not in CATEGORY_COLORS]


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}


def memory(trace_or_samples: Any, ax: Axes | Sequence[Axes] | None = None,
           title: str | None = None, unit: str = "MiB") -> Figure:
    """Live memory (MiB) over time (ms), stacked by category, peak marked; one subplot per rank.

    Accepts a ``Trace``, a list of them, a list of ``MemorySample`` or a
    ``MemoryTracker`` (or its ``report()``). Each sample holds until the
    next, so the stack is drawn as steps. The peak is the largest sample
    total (the tracker records a sample at its exact peak), annotated as
    "peak 81.2 MiB at 12.3 ms". Colours per category are fixed
    (``CATEGORY_COLORS``) so plots compare at a glance. ``unit``: "B",
    "KiB", "MiB" or "GiB" for the y axis (a toy model fits in KiB).

        >>> memory(tracker.samples)                  # doctest: +SKIP
    """
    if unit not in _UNITS:
        raise ValueError(f"memory(): unit must be one of {list(_UNITS)}; got {unit!r}")
    div = _UNITS[unit]
    series, t0 = _memory_series(trace_or_samples)
    cats = _categories(m for _, ss in series for m in ss)
    if ax is None:
        fig = Figure(figsize=(COLUMN_WIDTH_IN, 0.6 + 2.6 * len(series)), layout="constrained")
        axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0].tolist()
    else:
        axes = [ax] if isinstance(ax, Axes) else list(ax)
        if len(axes) != len(series):
            raise ValueError(f"memory(): {len(series)} series but {len(axes)} axes; pass ax=None "
                             "to get one subplot per rank, or one axes per trace")
        fig = axes[0].figure
    for i, ((label, samples), a) in enumerate(zip(series, axes)):
        if not samples:
            a.text(0.5, 0.5, "no memory samples", transform=a.transAxes, ha="center", color="gray")
        else:
            # Steps: repeat every sample's value up to the next sample's time.
            ts = [(m.time - t0) * 1e3 for m in samples]
            xs = [x for j, t in enumerate(ts) for x in (t, ts[j + 1] if j + 1 < len(ts) else t)]
            ys = [[m.bytes_by_category.get(c, 0) / div for m in samples for _ in (0, 1)] for c in cats]
            a.stackplot(xs, ys, labels=cats, colors=[color_for(c) for c in cats], linewidth=0)
            # The total as a thin outline: a spike narrower than a pixel still shows.
            a.plot(xs, [m.total / div for m in samples for _ in (0, 1)], color="black", linewidth=0.5)
            peak = max(samples, key=lambda m: m.total)
            px, py = (peak.time - t0) * 1e3, peak.total / div
            a.axhline(py, color="black", linestyle="--", linewidth=0.8)
            a.plot([px], [py], marker="v", color="black", markersize=6)
            ann = a.annotate(f"peak {human_bytes(peak.total)} at {px:.1f} ms", (px, py),
                             xytext=(4, 4), textcoords="offset points", fontsize=8,
                             ha="left" if px < 0.6 * xs[-1] else "right", va="bottom")
            ann.set_gid("minifsdp-peak")
            a.set_ylim(0, py * 1.2 if py > 0 else 1)
        a.set_ylabel(f"{label} {unit}" if label else f"live memory ({unit})")
        a.grid(alpha=0.3)
        if i == len(series) - 1:
            a.set_xlabel("time (ms)")
    axes[0].set_title(title or "live memory by category")
    if cats:
        handles = [mpatches.Patch(color=color_for(c), label=c) for c in cats]
        axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
                       frameon=False, title="category", title_fontsize=8)
    return fig


# --------------------------------------------------------------------------
# bandwidth
# --------------------------------------------------------------------------
def _pow2_ticks(lo: float, hi: float, step: int = 2) -> list[float]:
    lo_e, hi_e = int(max(lo, 1)).bit_length() - 1, int(max(hi, 1)).bit_length()
    return [float(2 ** e) for e in range(lo_e, hi_e + 1) if e % step == 0] or [float(lo)]


def bandwidth(results: Sequence[dict[str, Any]], ax: Axes | None = None, title: str | None = None,
              xlabel: str = "message size (bytes per call)") -> Figure:
    """Time per call against message size, log-log, one line per (collective, world size).

    ``results``: dicts ``{"op", "world_size", "bytes", "seconds"}``, one per
    timed call (repeats are fine: the line goes through the median, the dots
    show every call). Dotted diagonals are constant bandwidth (bytes / time):
    a line parallel to them is bandwidth-bound, a flat one latency-bound.

        >>> bandwidth([{"op": "all_reduce", "world_size": 2, "bytes": 4 << 20, "seconds": 0.014}])  # doctest: +SKIP
    """
    need = {"op", "world_size", "bytes", "seconds"}
    for r in results:
        if not need <= set(r):
            raise ValueError(f"bandwidth(): each result needs keys {sorted(need)}; got {sorted(r)}")
        if r["bytes"] <= 0 or r["seconds"] <= 0:
            raise ValueError(f"bandwidth(): bytes and seconds must be > 0 for a log-log plot; got {r}")
    fig, ax = _new_axes(ax, (8, 5))
    groups: dict[tuple[str, int], dict[int, list[float]]] = {}
    for r in results:
        groups.setdefault((r["op"], int(r["world_size"])), {}).setdefault(int(r["bytes"]), []).append(r["seconds"])
    sizes = sorted({int(r["bytes"]) for r in results})
    world_sizes = sorted({ws for _, ws in groups})
    markers = "osD^vP*X"
    for (op, ws), by_size in sorted(groups.items()):
        xs = sorted(by_size)
        style = dict(color=color_for(op), marker=markers[world_sizes.index(ws) % len(markers)],
                     linestyle=["-", "--", ":", "-."][world_sizes.index(ws) % 4])
        ax.plot(xs, [statistics.median(by_size[x]) * 1e3 for x in xs], label=f"{op}, {ws} ranks", **style)
        if any(len(v) > 1 for v in by_size.values()):
            ax.scatter([x for x in xs for _ in by_size[x]], [t * 1e3 for x in xs for t in by_size[x]],
                       color=color_for(op), s=8, alpha=0.3, linewidths=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if results:
        # Reference lines of constant bandwidth, labelled where they leave the plot.
        x_lo, x_hi = sizes[0] / 1.5, sizes[-1] * 1.5
        ax.set_xlim(x_lo, x_hi)
        y_lo, y_hi = ax.get_ylim()
        for gbps in (0.01, 0.1, 1, 10, 100, 1000):
            ms = [x / (gbps * 1e9) * 1e3 for x in (x_lo, x_hi)]
            if ms[1] > y_lo and ms[0] < y_hi:
                ax.plot([x_lo, x_hi], ms, color="gray", linestyle=":", linewidth=0.8, zorder=0)
                # label where the line leaves the plot: the right edge, or the top edge
                at = (x_hi, ms[1]) if ms[1] <= y_hi else (y_hi / 1e3 * gbps * 1e9, y_hi)
                ax.annotate(f"{gbps:g} GB/s", at, fontsize=7, color="gray", ha="right", va="top")
        ax.set_ylim(y_lo, y_hi)
        # the measured sizes themselves when few, else every 4x
        ticks = [float(s) for s in sizes] if len(sizes) <= 8 else _pow2_ticks(sizes[0], sizes[-1], 2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("time per call (ms)")
    ax.grid(which="both", alpha=0.25)
    ax.set_title(title or "collective time vs size (median; dots: every call)")
    if groups:
        ax.legend(fontsize=8, loc="upper left")
    return fig


# --------------------------------------------------------------------------
# collective_diagram
# --------------------------------------------------------------------------
_RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
_SUM_COLOR = "#3a3a3a"
_DIAGRAMS = {
    "all_reduce": "every rank ends with the sum of all ranks' tensors",
    "reduce_scatter": "sum over ranks, then rank i keeps chunk i",
    "all_gather": "every rank ends with every rank's chunk, in rank order",
    "broadcast": "every rank ends with rank {src}'s tensor",
}


def _holdings(op: str, n: int, src: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """(before, after): per rank, per chunk, ``None`` (empty) or ``(value, owner)``.

    owner is the rank the value comes from, or ``"sum"``. Rank r's chunk c
    holds 10r + c + 1, so a value's tens digit names its rank: 1..4, 11..14, ...
    """
    val = [[10 * r + c + 1 for c in range(n)] for r in range(n)]
    full = [[(val[r][c], r) for c in range(n)] for r in range(n)]
    sums = [sum(val[r][c] for r in range(n)) for c in range(n)]
    if op == "all_reduce":
        return full, [[(sums[c], "sum") for c in range(n)] for _ in range(n)]
    if op == "reduce_scatter":
        return full, [[(sums[c], "sum") if c == r else None for c in range(n)] for r in range(n)]
    if op == "all_gather":
        before = [[full[r][c] if c == r else None for c in range(n)] for r in range(n)]
        return before, [[full[c][c] for c in range(n)] for _ in range(n)]
    # broadcast: the other ranks' old contents are overwritten
    before = [full[r] if r == src else [("?", "old")] * n for r in range(n)]
    return before, [list(full[src]) for _ in range(n)]


def collective_diagram(op: str, world_size: int = 4, src: int = 0, ax: Axes | None = None) -> Figure:
    """Who holds what before and after one collective, with small worked values.

    Rows are ranks, blocks are chunks of each rank's tensor, coloured by the
    rank the value came from (dark: a sum over ranks). Rank r's chunk c
    starts as 10r + c + 1. The caption gives the bytes moved, from
    ``comm.collective_bytes``, for a tensor of S bytes.

        >>> collective_diagram("all_reduce", 2)      # doctest: +SKIP
        # before: r0 [1 2]  r1 [11 12]   after: r0 [12 14]  r1 [12 14]
    """
    if op not in _DIAGRAMS:
        raise ValueError(f"collective_diagram(): unknown op {op!r}; choose one of {sorted(_DIAGRAMS)}")
    if not 1 <= world_size <= len(_RANK_COLORS):
        raise ValueError(f"collective_diagram(): world_size must be 1..{len(_RANK_COLORS)} to stay "
                         f"readable; got {world_size}")
    if not 0 <= src < world_size:
        raise ValueError(f"collective_diagram(): src must be a rank in 0..{world_size - 1}; got {src}")
    n = world_size
    gap = 2.6  # room for the arrow and its label between the panels
    width_units, height_units = 2 * n + gap + 1.4, n + 2.2
    fig, ax = _new_axes(ax, (0.55 * width_units + 0.4, 0.55 * height_units + 0.6))
    before, after = _holdings(op, n, src)
    for panel, (x0, holdings) in enumerate(((0.0, before), (n + gap, after))):
        ax.text(x0 + n / 2, -0.35, ("before", "after")[panel], ha="center", va="bottom",
                fontsize=10, fontweight="bold")
        for r in range(n):
            for c in range(n):
                cell = holdings[r][c]
                if cell is None:
                    box = mpatches.Rectangle((x0 + c + 0.05, r + 0.05), 0.9, 0.8, fill=False,
                                             edgecolor="#bbbbbb", linestyle="--", linewidth=0.8)
                    ax.add_patch(box)
                    continue
                value, owner = cell
                color = {"sum": _SUM_COLOR, "old": "#eeeeee"}.get(owner) or _RANK_COLORS[owner]
                ax.add_patch(mpatches.Rectangle((x0 + c + 0.05, r + 0.05), 0.9, 0.8, facecolor=color,
                                                edgecolor="white"))
                ax.text(x0 + c + 0.5, r + 0.45, str(value), ha="center", va="center", fontsize=9,
                        color="black" if owner == "old" else "white")
    for r in range(n):
        ax.text(-0.1, r + 0.45, f"rank {r}", ha="right", va="center", fontsize=9)
    ax.annotate("", xy=(n + gap - 0.2, n / 2), xytext=(n + 0.2, n / 2),
                arrowprops=dict(arrowstyle="-|>", color="black", linewidth=1.5))
    ax.text(n + gap / 2, n / 2 - 0.15, op, ha="center", va="bottom", fontsize=8)
    nb = comm.collective_bytes(op, 1 << 20, n)
    vol, ring = nb["bytes"] / (1 << 20), nb["ring_bytes"] / (1 << 20)
    lines = [f"tensor of S bytes: volume {vol:g}S", f"ring: each rank sends {ring:.3g}S"]
    if op in ("all_reduce", "reduce_scatter"):
        lines.append("dark: summed over ranks")
    if op == "all_reduce":
        lines.append("all_reduce = reduce_scatter + all_gather")
    ax.text((2 * n + gap) / 2, n + 0.1, "\n".join(lines), ha="center", va="top", fontsize=8,
            color="#444444", linespacing=1.3)
    ax.set_xlim(-1.3, 2 * n + gap + 0.1)
    ax.set_ylim(n + 0.35 * len(lines) + 0.2, -0.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ranks = f"{n} rank" + ("s" if n > 1 else "")
    ax.set_title(f"{op}, {ranks}\n{_DIAGRAMS[op].format(src=src)}", fontsize=10, pad=14)
    return fig


def column_figure(nrows: int = 1, ncols: int = 1, height: float = 3.5, **subplot_kw: Any) -> tuple[Figure, Any]:
    """A figure as wide as a notebook column (~1050 px) with ``nrows x ncols`` axes.

    Pass its axes to ``timeline(..., ax=)``, ``memory(..., ax=)`` or ``bandwidth(..., ax=)``
    so a lab figure stays readable at laptop width::

        >>> fig, ax = column_figure(height=3)
        >>> fig.get_size_inches()[0]
        10.5
    """
    fig = Figure(figsize=(COLUMN_WIDTH_IN, height), layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=True, **subplot_kw)


__all__ += ["mesh_diagram"]


def mesh_diagram(mesh: Any, ax: Axes | None = None) -> Figure:
    """Draw a ``minifsdp.mesh.DeviceMesh``: one panel per pipeline stage, a dp x (cp x tp) grid of ranks in each.

    A row is a tensor-parallel group (its ranks split every layer), a column a
    data-parallel group (same slice, different data); a rank keeps its colour
    per tp index, so a column's ranks, which hold the same weights, match.

    With context parallel (``DeviceMesh(dp=2, cp=2)``) the columns are ``cp x tp``
    (``cp=c tp=t``): the ranks of one cp group share a row, each holding a share of
    the same sequences, and a dotted box (a dotted line when tp > 1) joins them.

    With HSDP's split (``DeviceMesh(dp=4, dp_shard=2)``) each column's dp
    ranks fall into ``dp_replicate`` shard groups of ``dp_shard`` consecutive
    rows (a node: FSDP shards inside it), each outlined in solid black and
    named on the left; on the right each row names its replicate group (the
    rows with the same index inside their shard group all-reduce across nodes).
    Expert parallel's split (``DeviceMesh(dp=4, ep=2)``) is drawn the same way in
    orange: each ep group (``ep`` consecutive dp rows: every expert once, E/ep a
    rank) outlined, and on the right the edp group of each row (the ranks holding
    the same experts). Five dimensions: pp panels, dp rows, cp x tp columns, the
    dp_shard and ep boxes.
    """
    D, P, Tn = mesh.shape
    C = getattr(mesh, "cp", 1)
    S = getattr(mesh, "dp_shard", None)
    EP = getattr(mesh, "ep", 1)
    cols = C * Tn
    gap = 1.0
    width_units = P * cols + (P - 1) * gap
    split = S is not None or EP > 1
    left, right = (1.6, 2.2) if split else (0.8, 0.1)  # margins for the HSDP / ep labels
    extra = left + right - 0.9  # 0 without a split: the figure as before
    fig, ax = _new_axes(ax, (min(COLUMN_WIDTH_IN, 1.1 * (width_units + extra) + 1.6),
                             0.9 * D + 1.6 + (0.4 if split else 0)))
    for p in range(P):
        x0 = p * (cols + gap)
        ax.text(x0 + cols / 2, -0.45, f"pipeline stage pp={p}" if P > 1 else "all layers", ha="center",
                va="bottom", fontsize=9, fontweight="bold")
        for d in range(D):
            for c in range(C):
                for t in range(Tn):
                    x = x0 + c * Tn + t
                    color = _RANK_COLORS[t % len(_RANK_COLORS)]
                    ax.add_patch(mpatches.Rectangle((x + 0.05, d + 0.05), 0.9, 0.8, facecolor=color,
                                                    edgecolor="white"))
                    ax.text(x + 0.5, d + 0.45, f"rank {mesh.rank_at(d, p, t, c) if C > 1 else mesh.rank_at(d, p, t)}",
                            ha="center", va="center", fontsize=8, color="white")
                if Tn > 1:  # the tp group: a bracket around the cp share's tp ranks
                    ax.add_patch(mpatches.Rectangle((x0 + c * Tn, d), Tn, 0.9, fill=False, edgecolor="#444444",
                                                    linestyle="--", linewidth=0.8))
            if C > 1 and Tn == 1:  # the cp group: a dotted box round the row
                ax.add_patch(mpatches.Rectangle((x0 - 0.03, d - 0.03), cols + 0.06, 0.96, fill=False,
                                                edgecolor="#2a7f62", linestyle=":", linewidth=2.0))
            elif C > 1:  # cp ranks are tp apart: a dotted line through each cp group's cells
                for t in range(Tn):
                    xs = [x0 + c * Tn + t + 0.5 for c in range(C)]
                    ax.plot(xs, [d + 0.78] * C, linestyle=":", color="#2a7f62", linewidth=2.0)
        for c in range(C):
            for t in range(Tn):
                x = x0 + c * Tn + t
                ax.text(x + 0.5, D + 0.05, f"cp={c} tp={t}" if C > 1 else f"tp={t}", ha="center", va="top",
                        fontsize=8)
                for run, colour, name in ((S, "black", "dp_shard"), (EP if EP > 1 else None, "#d9822b", "ep")):
                    for r in range(D // run if run else 0):  # one group: `run` consecutive dp rows of a column
                        ranks = [mesh.rank_at(d, p, t, c) if C > 1 else mesh.rank_at(d, p, t)
                                 for d in range(r * run, (r + 1) * run)]
                        inset = 0.01 if name == "dp_shard" else 0.06
                        ax.add_patch(mpatches.Rectangle((x + inset, r * run + inset), 1 - 2 * inset,
                                                        run - 0.08 - 2 * inset + 0.02, fill=False, edgecolor=colour,
                                                        linewidth=1.8, label=f"{name} group {ranks}"))
    for d in range(D):
        ax.text(-0.1, d + 0.45, f"dp={d}", ha="right", va="center", fontsize=8)
    labels = []  # (run, colour, left label, right label of row d)
    if S is not None:
        labels.append((S, "black", lambda r: f"shard group {r}\n(node {r})", lambda d: f"replicate group {d % S}"))
    if EP > 1:
        labels.append((EP, "#d9822b", lambda r: f"ep group {r}\n(E/{EP} a rank)", lambda d: f"edp group {d % EP}"))
    for i, (run, colour, group_label, row_label) in enumerate(labels):
        for r in range(D // run):
            ax.text(-0.9 - 0.5 * i, r * run + (run - 0.1) / 2, group_label(r), ha="center", va="center",
                    rotation=90, fontsize=8, fontweight="bold", color=colour)
        for d in range(D):
            ax.text(width_units + 0.15, d + 0.45 + 0.25 * i, row_label(d), ha="left", va="center", fontsize=8,
                    color=_RANK_COLORS[(d % run + Tn) % len(_RANK_COLORS)] if colour == "black" else colour)
    ax.set_xlim(-left - (0.5 if len(labels) > 1 else 0), width_units + right)
    ax.set_ylim(D + 0.5, -0.7)
    ax.set_aspect("equal")
    ax.axis("off")
    hsdp = "" if S is None else (f"\nsolid box = one dp_shard group ({S} ranks: FSDP shards in it)\nsame "
                                 f"replicate group = one dp_replicate group ({D // S} ranks: all-reduce)")
    experts = "" if EP == 1 else (f"\norange box = one ep group ({EP} ranks: the experts spread, tokens all-to-all)"
                                  f"\nsame edp group = the same experts ({D // EP} ranks: their gradients summed)")
    context = "" if C == 1 else f"\ndotted = one context-parallel group ({C} ranks: a share of each sequence)"
    ax.set_title(f"{mesh!r}: {mesh.size()} ranks\ndashed row = one tensor-parallel group, "
                 f"column = one data-parallel group{context}{hsdp}{experts}", fontsize=9)
    return fig


# --------------------------------------------------------------------------
# pipeline schedules: planned (from the plan as data) over measured (from traces)
# --------------------------------------------------------------------------
__all__ += ["pipeline_schedule"]

# Forward blue, backward orange; zero bubble's halves of backward in two shades.
PIPELINE_COLORS = {"F": "#8fb8de", "B": "#f2b880", "I": "#e8a05c", "W": "#c9b3d9"}


def _pipeline_rows(ax: Axes, rows: dict[int, list[tuple[float, float, Any]]], p: int, y0: float,
                   label_fmt: str) -> list[float]:
    """One bar per action, coloured by kind, labelled with its micro-batch; returns the row centres."""
    centres = []
    for r in sorted(rows):
        y = y0 + r
        centres.append(y + 0.4)
        for start, end, a in rows[r]:
            chunk = a.stage // p
            ax.add_patch(mpatches.Rectangle((start, y), end - start, 0.8, facecolor=PIPELINE_COLORS[a.kind],
                                            edgecolor="white", linewidth=0.6, hatch="//" if chunk % 2 else None))
            ax.text((start + end) / 2, y + 0.4, label_fmt.format(kind=a.kind, mb=a.mb), ha="center",
                    va="center", fontsize=7, clip_on=True)
    return centres


def pipeline_schedule(plan: Any, traces: Sequence[Trace] | None = None, title: str | None = None) -> Figure:
    """The plan on its unit timeline (F = 1, B = 2, I = W = 1) and, given traces, the measured run under it.

    ``plan`` is a ``minifsdp.pipeline.Plan`` (or a ``Timeline``); ``traces`` one
    ``trace.Trace`` per rank, recorded around one ``schedule.step`` (the
    executor opens a span per action). Hatched bars are a rank's second stage
    (interleaved). Each panel's title gives its bubble: idle rank-time over
    total rank-time, waiting for a message counted as idle.
    """
    from .pipeline import measured_bubble, measured_spans, simulate

    tl = plan if hasattr(plan, "spans") and hasattr(plan, "lowered") else simulate(plan)
    p = tl.plan.p
    n_panels = 1 if traces is None else 2
    fig = Figure(figsize=(COLUMN_WIDTH_IN, 0.55 * p * n_panels + 1.4 * n_panels))
    axes = [fig.add_subplot(n_panels, 1, k + 1) for k in range(n_panels)]
    centres = _pipeline_rows(axes[0], tl.spans, p, 0, "{kind}{mb}")
    axes[0].set_xlim(0, tl.makespan)
    axes[0].set_xlabel("time (units: a forward = 1)")
    axes[0].set_title(f"planned: {tl.plan.name}, p={p}, m={tl.plan.m}, v={tl.plan.v}; "
                      f"bubble {tl.bubble:.1%}", fontsize=9)
    if traces is not None:
        spans = measured_spans(list(traces))
        t0 = min((s for sp in spans.values() for s, _, _ in sp), default=0.0)
        rows = {r: [((s - t0) * 1e3, (e - t0) * 1e3, a) for s, e, a in sp] for r, sp in spans.items()}
        _pipeline_rows(axes[1], rows, p, 0, "{mb}")
        axes[1].set_xlim(0, max((e for sp in rows.values() for _, e, _ in sp), default=1.0))
        axes[1].set_xlabel("time (ms) from the first forward")
        axes[1].set_title(f"measured: bubble {measured_bubble(list(traces)):.1%}", fontsize=9)
    for ax in axes:
        ax.set_ylim(p, -0.2)
        ax.set_yticks(centres, [f"rank {r}" for r in range(p)], fontsize=8)
    handles = [mpatches.Patch(color=c, label=k) for k, c in PIPELINE_COLORS.items()
               if any(a.kind == k for sp in tl.spans.values() for _, _, a in sp)]
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
