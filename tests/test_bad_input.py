"""Bad input is refused early, in one line that names the fix: every row of tests/bad_input_cases.py.

Each row runs in this process (the multi-rank ones on rank 0 of torch's in-process ``fake``
group): it must raise its exception with its fragment, in one line, before any
``torch.distributed`` collective runs or any process starts (``bad_input_run.run`` turns
either into a ``Forbidden`` error and records it). docs/bad_input.md is generated from the same
rows and must be up to date.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import bad_input_cases as cases
import bad_input_run as runner

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import bad_input_table  # noqa: E402


@pytest.mark.parametrize("row", cases.ROWS, ids=[row.id for row in cases.ROWS])
def test_refused_in_one_line_before_any_rank_starts(row: cases.Row) -> None:
    out = runner.run(row)
    assert not out.forbidden, f"{out.forbidden} happened before the refusal: check earlier ({out.message})"
    assert type(out.error) is row.raises, f"expected {row.raises.__name__}, got {out.error!r}"
    assert row.fragment in out.message, f"{row.fragment!r} not in {out.message!r}"
    assert out.message.strip() and "\n" not in out.message, f"not one line: {out.message!r}"


def test_the_table_spans_the_package() -> None:
    ids = [row.id for row in cases.ROWS]
    assert len(ids) == len(set(ids)), "row ids must be unique (they are the test ids)"
    areas = {row.area for row in cases.ROWS}
    assert {"launch", "layout", "models", "ddp", "zero", "fsdp", "fully_shard", "pipeline", "tensor parallel",
            "context parallel", "expert parallel", "mixed precision", "trainer", "resume"} <= areas
    assert len(cases.ROWS) >= 35


@pytest.mark.parametrize("source, attempted", [
    ("import torch.distributed as d; d.all_reduce(torch.ones(2))", ["all_reduce"]),
    ("DistributedDataParallel(mlp())", ["all_reduce"]),   # a valid wrap: its model check is a collective
    ("launch(work, 2)", ["process start"]),
])
def test_a_late_check_fails_its_row(source: str, attempted: list[str]) -> None:
    """The watch is real: a row that reaches a collective or starts a rank is caught, not run."""
    out = runner.run(cases.py("late", "test", source, ValueError, "", world=2))
    assert out.forbidden == attempted
    assert isinstance(out.error, runner.Forbidden)


def test_docs_table_is_up_to_date(capsys: pytest.CaptureFixture) -> None:
    assert bad_input_table.main(["--check"]) == 0, capsys.readouterr().err
