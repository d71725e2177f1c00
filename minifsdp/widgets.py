"""ipywidgets explorers for the labs: move a knob, see the bytes move.

Front layer. Each widget is a thin shell around a plain function that the
next notebook cell also calls directly, so nbval tests the same code path
(LAB-GUIDE.md §6):

    planner_figure(plan("gpt-small", batch=8, tp=2))     # the plain call
    planner_widget("gpt-small", batch=8)                 # sliders around it

Read ``planner.py`` first: this file only draws what it computes.
"""

from __future__ import annotations

from typing import Any

from . import plot
from .estimate import format_bytes
from .models import MODEL_PRESETS
from .planner import Plan, plan

__all__ = ["planner_figure", "planner_widget"]

_MEMORY_ORDER = ("parameters", "gradients", "optimizer", "gathered parameters", "activations")


def planner_figure(p: Plan, cap_bytes: float | None = None) -> plot.Figure:
    """One device's predicted memory by category (left) and bytes moved per step by mesh dimension (right)."""
    fig, (mem_ax, comm_ax) = plot.column_figure(1, 2, height=3.2)
    bottom = 0.0
    for cat in _MEMORY_ORDER:
        value = p.memory.get(cat, 0) / 2**20
        if value:
            color = plot.color_for("parameters" if cat == "gathered parameters" else cat)
            mem_ax.bar(0, value, bottom=bottom, color=color, label=cat, width=0.6,
                       hatch="//" if cat == "gathered parameters" else None)
            bottom += value
    # The bar stacks each category's own largest size; they are not all alive at once (a unit's gathered
    # parameters are freed before the next unit's are gathered), so the bar may rise above the peak line.
    mem_ax.axhline(p.total_memory / 2**20, color="black", linewidth=1,
                   label=f"peak {format_bytes(p.total_memory)} (alive together)")
    if cap_bytes:
        mem_ax.axhline(cap_bytes / 2**20, color="red", linestyle="--", label=f"cap {format_bytes(cap_bytes)}")
    mem_ax.set_xticks([])
    mem_ax.set_ylabel("MiB per device")
    if bottom * 2**20 > p.total_memory * 1.001:
        mem_ax.text(0, bottom, "categories' own maxima:\nnot all alive at once", ha="center", va="bottom",
                    fontsize=7)
    mem_ax.set_xlim(-0.6, 1.8)
    mem_ax.legend(fontsize=7, loc="upper right")
    lay = p.layout
    mem_ax.set_title(f"dp={lay['dp']} pp={lay['pp']} tp={lay['tp']}, ZeRO {lay['zero_stage']}, {lay['precision']}"
                     + (", SP" if lay["sequence_parallel"] else "") + (", ckpt" if lay["checkpointing"] else ""),
                     fontsize=9)
    dims = list(p.comm) or ["none"]
    for i, dim in enumerate(dims):
        left = 0.0
        for op, b in p.comm.get(dim, {}).items():
            comm_ax.barh(i, b / 2**20, left=left, color=plot.color_for(op), label=op)
            left += b / 2**20
    handles, labels = comm_ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        comm_ax.legend(unique.values(), unique.keys(), fontsize=7)
    comm_ax.set_yticks(range(len(dims)), dims)
    comm_ax.set_xlabel("MiB moved per step, per device (comm volume)")
    comm_ax.set_title("communication by mesh dimension", fontsize=9)
    return fig


def planner_widget(model: str = "gpt-small", batch: int = 8, seq_len: int | None = None,
                   cap_bytes: float | None = None) -> Any:
    """Sliders for dp, tp, pp, micro-batches, ZeRO stage, precision, SP and checkpointing around
    ``planner_figure(plan(...))``; a layout the model cannot take prints why instead."""
    import ipywidgets as w
    from IPython.display import display

    config = MODEL_PRESETS[model]
    # one slider a row, 420 px wide: each value of a 1-8 slider is ~50 px of track, easy to pick with a mouse
    wide = {"style": {"description_width": "110px"}, "layout": w.Layout(width="420px")}
    controls = {
        "dp": w.IntSlider(1, 1, 8, description="dp", **wide), "tp": w.IntSlider(1, 1, 8, description="tp", **wide),
        "pp": w.IntSlider(1, 1, config.n_layer, description="pp", **wide),
        "micro_batches": w.IntSlider(1, 1, 8, description="micro-batches", **wide),
        "zero_stage": w.IntSlider(0, 0, 3, description="ZeRO stage", **wide),
        "precision": w.Dropdown(options=["fp32", "bf16"], value="fp32", description="precision", **wide),
        "sequence_parallel": w.Checkbox(False, description="sequence parallel", indent=False),
        "checkpointing": w.Checkbox(False, description="checkpointing", indent=False),
    }
    out = w.Output()

    def redraw(*_: Any) -> None:
        out.clear_output(wait=True)
        with out:
            try:
                p = plan(config, batch=batch, seq_len=seq_len, **{k: c.value for k, c in controls.items()})
            except ValueError as exc:
                print(f"not possible: {exc}")
                return
            print(p)
            display(planner_figure(p, cap_bytes))

    for c in controls.values():
        c.observe(redraw, names="value")
    redraw()
    sliders, boxes = list(controls.values())[:6], list(controls.values())[6:]
    return w.HBox([w.VBox([*sliders, w.HBox(boxes)]), out])
