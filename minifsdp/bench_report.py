"""The tables ``python -m minifsdp.bench`` prints (README.md quotes them), and the activation rows.

Front layer, read with ``bench.py``: ``table`` is one line per pair and world size (step time, peak
memory, bytes moved against the expected and the ZeRO paper's, same losses; with ``--malloc both`` the
pinned-malloc ratio too, with ``--compute`` each side's step over the compute-only floor);
``phase_rows``/``phases.table`` where the time goes (``--phases``); ``activation_rows`` estimate's
activations beside the memory tracker's, per ``--checkpoint`` mode.
"""

from __future__ import annotations

from typing import Any

import torch

from . import estimate, models, phases
from .memory import ACTIVATIONS, MemoryTracker
from .records import apply_checkpointing


# --------------------------------------------------------------------------
# Activations: estimate's prediction beside the tracker, per --checkpoint mode
# --------------------------------------------------------------------------

def activation_rows(model_name: str, batch: int) -> list[dict[str, Any]]:
    """Bytes autograd holds after one forward of ``batch`` sequences (one rank's share), for each
    ``--checkpoint`` mode: ``estimate.gpt_checkpoint_activation_bytes`` and the memory tracker's
    ``activations`` after the forward, on one process (sharding changes parameters, not activations).
    The tracker also sees the 4-byte loss itself, which the estimate (what backward saves) leaves out."""
    config = models.MODEL_PRESETS[model_name]
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g) for _ in range(2))
    rows = []
    for mode in ("none", "full", "selective"):
        model = models.build_model(model_name, seed=0)
        if mode != "none":  # as train --checkpoint wraps minifsdp's sides
            apply_checkpointing(model, mode)
        tracker = MemoryTracker()
        tracker.track_model(model)
        with tracker:
            loss = models.lm_loss(model(x.clone()), y.clone())  # ids made inside count, as in training
            measured = tracker.snapshot()[ACTIVATIONS]
            loss.backward()
        tracker.close()
        predicted = estimate.gpt_checkpoint_activation_bytes(config, batch, config.block_size, checkpoint=mode)
        rows.append({"checkpoint": mode, "batch": batch, "predicted": predicted["total"], "measured": measured})
    return rows


def activation_table(rows: list[dict[str, Any]]) -> str:
    mib = 2 ** 20
    lines = ["| sequences per rank | --checkpoint | predicted MiB | measured MiB | measured − predicted (B) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['checkpoint']} | {r['predicted'] / mib:.3f} | {r['measured'] / mib:.3f} | "
                     f"{r['measured'] - r['predicted']:+d} |")
    return "\n".join(lines)


_PAPER_LABEL = {k: f"{v}·4Ψ" for k, v in estimate.ZERO_PAPER_PSI.items()}  # Ψ fp32 parameters


def table(rows: list[dict[str, Any]]) -> str:
    """The README table: one line per pair and world size. Rows from ``--malloc both`` add the ratio with
    glibc's malloc pinned, rows with page faults their faults per step, ``--compute`` rows each side's step
    over the compute-only floor."""
    mib = 2 ** 20
    extra = [(key, title) for key, title in (("step_ratio_pinned", "step ratio, malloc pinned"),
                                             ("faults_per_step", "page faults per step (ours / ref)"),
                                             ("over_compute", "step / compute-only (ours / ref)"))
             if any(key in r for r in rows)]
    head = ("| world | minifsdp | reference | step ms (ours / ref) | predicted ms (ours / ref) | step ratio | peak MiB"
            " (ours / ref) | peak ratio | MiB moved per step (ours / ref / expected) | paper | ours = expected "
            "| same losses |" + "".join(f" {title} |" for _, title in extra))
    lines = [head, "|" + "---|" * (12 + len(extra))]
    for r in rows:
        ours, theirs = r["ours"], r["theirs"]
        s, peak, moved, p = r["step_s"], r.get("peak_bytes"), r["bytes_per_step"], r.get("predicted_s")
        peak_txt = f"{peak[ours] / mib:.1f} / {peak[theirs] / mib:.1f}" if peak else "-"
        peak_ratio = f"{r['peak_ratio']:.3f}" if peak else "-"
        expected = "-" if r["bytes_expected"] is None else f"{r['bytes_expected'] / mib:.3f}"
        moved_txt = f"{moved[ours] / mib:.3f} / {moved[theirs] / mib:.3f} / {expected}"
        paper = (f"{_PAPER_LABEL[r['bytes_paper_key']]} = {r['bytes_paper'] / mib:.3f}"
                 if r["bytes_paper"] is not None else "-")
        predicted = " / ".join("-" if p[k] is None else f"{p[k] * 1e3:.0f}" for k in (ours, theirs)) if p else "-"
        cells = []
        for key, _ in extra:
            v = r.get(key)
            if v is None or (isinstance(v, dict) and any(v.get(k) is None for k in (ours, theirs))):
                cells.append("-")
            elif key == "step_ratio_pinned":
                cells.append(f"{v:.3f}")
            else:
                cells.append(" / ".join(f"{v[k]:.0f}" if key == "faults_per_step" else f"{v[k]:.2f}"
                                        for k in (ours, theirs)))
        lines.append(f"| {r['world_size']} | {ours} | {theirs} | {s[ours] * 1e3:.1f} / {s[theirs] * 1e3:.1f} | "
                     f"{predicted} | {r['step_ratio']:.3f} | {peak_txt} | {peak_ratio} | {moved_txt} | {paper} | "
                     f"{({True: 'yes', False: 'NO'}).get(r['bytes_match'], '-')} | "
                     f"{'yes' if r['same_losses'] else 'NO'} |" + "".join(f" {c} |" for c in cells))
    return "\n".join(lines)


def phase_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """bench rows (``--phases``) -> ``phases.table``'s: one per world size and side (the compute floor too)."""
    out = []
    for r in rows:
        for side, split in r.get("phases", {}).items():
            out.append({"world_size": r["world_size"], "side": side, "phases": split,
                        "faults": r.get("faults_per_step", {}).get(side),
                        "allocated": r.get("allocated_per_step", {}).get(side)})
    return out
