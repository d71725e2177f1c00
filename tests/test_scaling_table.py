"""tools/scaling_table.py's core on 1 and 2 ranks: measured bytes equal the prediction, memory within the margin.

The tool's claim, checked where it is cheap: ``measure`` trains gpt-mini at N = 1
(``single``) and N = 2 (ZeRO-3, flat ``fsdp``), with the memory tracker on; each
point's bytes per step equal the record's prediction exactly, its measured peak is
at or above the planner's (the planner leaves temporaries out) and within the tool's
``MEMORY_MARGIN`` of it, and sharding over 2 ranks halves the parameters. The outputs
(table, figure, numbers) are written from those points.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import scaling_table  # noqa: E402


@pytest.fixture(scope="module")
def points():
    return scaling_table.measure(["fsdp"], [1, 2], log=lambda line: None, timeout=300)


def test_measured_agrees_with_predicted(points):
    assert [(p.strategy, p.world_size) for p in points] == [("fsdp", 1), ("fsdp", 2)]
    for p in points:
        assert p.bytes_per_step == p.predicted_bytes, p
        assert p.predicted_peak <= p.peak <= (1 + scaling_table.MEMORY_MARGIN) * p.predicted_peak, p
    single, sharded = points
    assert single.bytes_per_step == 0 and sharded.bytes_per_step > 0
    # parameters and optimizer state: exactly the planner's, half of single's each (gpt-mini's blocks split evenly)
    assert sharded.by_category["parameters"] == sharded.predicted_by_category["parameters"] \
        == single.by_category["parameters"] / 2
    assert sharded.peak < single.peak


def test_outputs(points, tmp_path):
    scaling_table.write(points, str(tmp_path), "gpt-mini test")
    table = (tmp_path / "scaling.md").read_text()
    assert "| single | 1 |" in table and "| ZeRO-3 (fsdp) | 2 |" in table
    saved = json.loads((tmp_path / "scaling.json").read_text())["points"]
    assert [p["peak"] for p in saved] == [p.peak for p in points]
    assert scaling_table.load(str(tmp_path)) == (points, "gpt-mini test")  # what --replot redraws from
    png = (tmp_path / "scaling.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) < 150_000


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="unknown strategies \\['tp'\\]"):
        scaling_table.measure(["tp"], [2])
    with pytest.raises(ValueError, match="must divide --batch-size 8"):
        scaling_table.measure(["ddp"], [3])
