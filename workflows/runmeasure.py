"""What earlier runs of the same model, image size and batch measured: the seconds one checkpoint
save blocked training and the median step time (rank 0's metrics records)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles


@dataclass(frozen=True)
class Measured:
    seconds: float
    run: str
    samples: int

    def source(self, what: str) -> str:
        return f"median {what} of {self.samples} in {self.run}"


def matching_runs(run_dir: Path, model: str, img_size: int, batch_size: int) -> list[Path]:
    """run_dir itself (a resumed run), then the newest first (run names start with their UTC
    time) of the runs beside it whose config.json has the same model, img_size and per-rank
    batch_size."""
    root = run_dir.parent
    siblings = sorted(root.iterdir(), reverse=True) if root.is_dir() else []
    want = {"model": model, "img_size": img_size, "batch_size": batch_size}
    out = []
    for run in [run_dir, *(r for r in siblings if r != run_dir)]:
        try:
            config = json.loads((run / runfiles.CONFIG).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and all(config.get(k) == v for k, v in want.items()):
            out.append(run)
    return out


def save_cost(runs: list[Path]) -> Measured | None:
    """The median blocking cost of one save in the newest run that measured one: its
    `checkpoint` timing span plus the host-copy wait (time.checkpoint_wait) of the step after
    it, as the trainer's Checkpointer.last_stall_s counts it."""
    for run in runs:
        records = _rank0(run)
        waits = {r.get("step"): _num((r.get("time") or {}).get("checkpoint_wait"))
                 for r in records if r.get("kind") == "step"}  # fmt: skip
        costs = [
            _num(r.get("seconds")) + waits.get(_int(r.get("step")) + 1, 0.0)
            for r in records
            if r.get("kind") == "timing" and r.get("event") == "checkpoint"
        ]
        if costs:
            return Measured(statistics.median(costs), str(run), len(costs))
    return None


def step_time(runs: list[Path]) -> Measured | None:
    """The median step time (time.step, warm-up steps left out) of the newest run with steps."""
    for run in runs:
        times = [_num((r.get("time") or {}).get("step")) for r in _rank0(run)
                 if r.get("kind") == "step" and not r.get("warmup")]  # fmt: skip
        times = [t for t in times if t > 0]
        if times:
            return Measured(statistics.median(times), str(run), len(times))
    return None


def _rank0(run: Path) -> list[dict[str, Any]]:
    try:
        return runfiles.read_metrics(run, 0)
    except runfiles.RunFileError:
        return []  # a damaged earlier run measures nothing; the next one may


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _int(value: Any) -> int:
    return value if isinstance(value, int) else -2
