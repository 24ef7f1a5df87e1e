"""Communication the trainer measured in a run's metrics, for tests that hold it to a prediction."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from vitpod.registry import runfiles


def _comm_by_step(run_dir: Path) -> dict[int, list[float]]:
    """Each timed (non-warmup) step's communication seconds on every rank."""
    steps: dict[int, list[float]] = {}
    for path in sorted((Path(run_dir) / runfiles.METRICS).glob("rank*.jsonl")):
        for index, line in enumerate(path.read_text().splitlines()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "step" and not rec.get("warmup", False):
                step = int(rec.get("step", index))  # the trainer always writes it
                steps.setdefault(step, []).append(float(rec["time"]["comm"]))
    return steps


def measured_comm_s(run_dir: Path) -> float | None:
    """Median communication seconds per step the trainer measured (non-warmup steps, all ranks)."""
    values = [v for per_rank in _comm_by_step(run_dir).values() for v in per_rank]
    return statistics.median(values) if values else None


def measured_exchange_s(run_dir: Path) -> dict[str, float] | None:
    """The trainer's comm time split into the exchange itself and waiting for peers.

    A rank's comm clock starts when its gradient bucket is ready, so a rank that finishes its
    backward pass early also counts the wait for the slowest rank (load imbalance, not the
    network). The rank that arrives last waits for nobody: per step, the minimum over ranks is
    the exchange alone, which is what the cost model (and `make calibrate`'s benchmark, timed
    the same way) predicts. Returns the medians over steps of: `exchange_s` (min over ranks),
    `mean_s` (mean over ranks, what the scaling report shows) and `wait_s` (their difference).
    """
    steps = _comm_by_step(run_dir)
    if not steps:
        return None
    mins = [min(v) for v in steps.values()]
    means = [statistics.fmean(v) for v in steps.values()]
    return {
        "exchange_s": statistics.median(mins),
        "mean_s": statistics.median(means),
        "wait_s": statistics.median(m - x for m, x in zip(means, mins, strict=True)),
        "steps": float(len(steps)),
    }


def compare(predicted_s: float, run_dir: Path) -> dict[str, float | None]:
    """Predicted vs measured communication per step, and measured / predicted."""
    measured = measured_comm_s(run_dir)
    ratio = measured / predicted_s if measured and predicted_s > 0 else None
    return {"predicted_s": predicted_s, "measured_s": measured, "ratio": ratio}
