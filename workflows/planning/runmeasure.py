"""What earlier runs of the same model, image size and batch measured: the seconds one checkpoint
save blocked training, the median step time and its communication part, the ranks it ran on and
the steps it planned (rank 0's metrics records)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles

STUDIES = "studies"
"""Scaling studies live in RUNS/studies (workflows/studies/scaling.py)."""


@dataclass(frozen=True)
class Measured:
    seconds: float
    run: str
    samples: int
    comm_s: float = 0.0
    """Median communication seconds of the same steps (step_time only)."""
    world_size: int = 0
    """Ranks the measured steps ran on (step_time only; 0: not recorded)."""
    total_steps: int = 0
    """Optimizer steps the run planned (step_time only; 0: not recorded)."""

    def source(self, what: str) -> str:
        return f"median {what} of {self.samples} in {self.run}"


def matching_runs(run_dir: Path, model: str, img_size: int, batch_size: int) -> list[Path]:
    """run_dir itself (a resumed run), then the newest first (run names start with their UTC
    time) of the runs beside it whose config.json has the same model, img_size and per-rank
    batch_size."""
    want = {"model": model, "img_size": img_size, "batch_size": batch_size}
    return [run for run, config in configs(run_dir) if all(config.get(k) == v
                                                           for k, v in want.items())]  # fmt: skip


def configs(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """run_dir, then the runs beside it newest first, each with its config.json (runs without a
    readable one are left out). A scaling study's point (RUNS/studies/STUDY/gpusN) then reads
    the points of the earlier studies and the runs in RUNS, newest first."""
    root = run_dir.parent
    runs = [run_dir, *_newest_first(root)]
    if root.parent.name == STUDIES:
        runs += [p for study in _newest_first(root.parent) for p in _newest_first(study)]
        runs += _newest_first(root.parent.parent)
    out = []
    for run in dict.fromkeys(runs):
        try:
            config = json.loads((run / runfiles.CONFIG).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict):
            out.append((run, config))
    return out


def _newest_first(folder: Path) -> list[Path]:
    """The folders in `folder`, newest first (run and study names start with their UTC time)."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True)


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
    """The median step time (time.step, warm-up steps left out) of the newest run with steps,
    with the median of its communication part (time.comm), its ranks and its planned steps."""
    for run in runs:
        steps = [r for r in _rank0(run) if r.get("kind") == "step" and not r.get("warmup")
                 and _num((r.get("time") or {}).get("step")) > 0]  # fmt: skip
        if steps:
            return Measured(
                statistics.median(_num(r["time"]["step"]) for r in steps), str(run), len(steps),
                comm_s=statistics.median(_num(r["time"].get("comm")) for r in steps),
                world_size=_int(steps[-1].get("world_size"), 0),
                total_steps=_int(steps[-1].get("total_steps"), 0),
            )  # fmt: skip
    return None


def device(run: Path) -> str:
    """What the run's steps ran on, as its start-up `mfu` record names it (torch's GPU name or
    `cpu`); '' where it names none (a run from before vitpod recorded it)."""
    found = next((r.get("device") for r in _rank0(run) if r.get("kind") == "mfu"), None)
    return found if isinstance(found, str) else ""


def _rank0(run: Path) -> list[dict[str, Any]]:
    try:
        return runfiles.read_metrics(run, 0)
    except runfiles.RunFileError:
        return []  # a damaged earlier run measures nothing; the next one may


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _int(value: Any, default: int = -2) -> int:
    return value if isinstance(value, int) else default
