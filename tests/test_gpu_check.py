"""tools/gpu_check.py, ready for a GPU machine: tested here on the CPU under pretend GPU counts.

A small notebook that launches 2 ranks and prints one verdict runs as a 1-GPU VM (its 2 ranks are CPU
ranks, gloo) and as a 2-GPU VM (pretend GPU ranks); the table names the launches, counts the verdict,
and the memory / bf16 step rows run on 2 ranks.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402
import make_labs  # noqa: E402

NOTEBOOK = """\
# %% [markdown]
# # Two ranks

# %%
from minifsdp import launch, dist
ranks = launch(dist.rank, 2)
print("✅ passed - two ranks:", ranks)
"""


def test_gpu_check_table_under_pretend_counts(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "solutions" / "src").mkdir(parents=True)
    (tmp_path / "solutions" / "src" / "01_two.py").write_text(NOTEBOOK, encoding="utf-8")
    make_labs.main(["--root", str(tmp_path)])
    path = tmp_path / "solutions" / "01_two.ipynb"
    one = gpu_check.run_notebook(path, {"MINIFSDP_FAKE_GPU": "1"})
    two = gpu_check.run_notebook(path, {"MINIFSDP_FAKE_GPU": "2"})
    assert one["error"] == "" and one["passed"] == 1 and one["not_yet"] == 0, one
    assert one["launches"] == "2r gloo x1", one      # more ranks than GPUs: CPU ranks
    assert two["launches"] == "2r gpu x1", two       # fits: pretend GPU ranks (device discipline on)
    monkeypatch.setenv("MINIFSDP_FAKE_GPU", "2")
    steps = gpu_check.device_rows(2)
    assert [r["lab"] for r in steps] == ["step fp32", "step bf16"] and all(not r["error"] for r in steps), steps
    assert steps[1]["passed"] == 1 and "vs fp32" in steps[1]["detail"], steps  # bf16 held to fp32's loss
    text = gpu_check.table([one, two, *steps], "CPU, pretend 2 GPU(s)")
    assert text.count("\n| ") == 5 and "| 01_two | 2r gloo x1 | 1 | 0 |" in text
