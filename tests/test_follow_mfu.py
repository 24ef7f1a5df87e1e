"""The follow view's MFU: live from rank 0's step times and start-up record, then the summary's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.watching import follow
from vitpod.workflows.watching.metricstail import MetricsTail


def _write(run: Path, records: list[dict]) -> None:
    path = run / "metrics" / "rank0.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def _step(step: int, seconds: float) -> dict:
    return {"kind": "step", "step": step, "rank": 0, "loss": 1.0, "images_per_s": 10.0,
            "total_steps": 10, "wall_time": 100.0 + step, "time": {"step": seconds}}  # fmt: skip


def test_live_mfu_is_flops_per_step_over_mean_step_time_over_peak(tmp_path):
    _write(tmp_path, [{"kind": "mfu", "flops_per_step": 4e14, "peak_flops": 1e15},
                      _step(1, 0.5), _step(2, 1.5)])  # fmt: skip
    tail = MetricsTail(tmp_path)
    tail.update()
    assert tail.mfu == pytest.approx(4e14 / 1.0 / 1e15)
    row = JobState("train", tmp_path)
    follow.take_tail(row, tail)
    assert follow.cells(row)["MFU"] == "40.0%"


def test_the_summary_mfu_wins_and_an_unknown_peak_shows_a_dash(tmp_path):
    _write(tmp_path, [{"kind": "mfu", "flops_per_step": 4e14, "peak_flops": None},
                      _step(1, 0.5)])  # fmt: skip
    tail = MetricsTail(tmp_path)
    tail.update()
    assert tail.mfu is None
    follow.take_tail(row := JobState("train", tmp_path), tail)
    assert follow.cells(row)["MFU"] == "-"
    _write(tmp_path, [{"kind": "summary", "steps": 1, "images_per_s": 9.0, "mfu": 0.31}])
    tail.update()
    assert tail.mfu == pytest.approx(0.31)
