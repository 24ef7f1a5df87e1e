"""Scaling study -> throughput, speedup, efficiency, step-time breakdown and predicted comm."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vitpod.analysis.runlogs import TIME_PARTS, RunLog, read_run
from vitpod.registry import runfiles
from vitpod.registry.decision import find_decision
from vitpod.registry.io import check_keys

MODES = ("strong", "weak")
STUDY_FILE = runfiles.STUDY
OFF_BY = 0.25
"""A predicted step time further than this fraction from the measured one is called out."""

DEFINITIONS = {
    "strong": (
        "Strong scaling: the global batch is fixed and split over more GPUs. "
        "Speedup S(N) = X(N)/X(N0), the images/s at N GPUs over the images/s of the smallest "
        "successful point N0 (equal to T(N0)/T(N) for the step time T, since the work per step "
        "is fixed). Efficiency E(N) = S(N)/(N/N0); ideal is 1."
    ),
    "weak": (
        "Weak scaling: the batch per GPU is fixed, so the global batch grows with N. "
        "Speedup S(N) = X(N)/X(N0) (scaled speedup); efficiency E(N) = (X(N)/N)/(X(N0)/N0), "
        "the images/s per GPU relative to the baseline (equal to T(N0)/T(N) for the step time "
        "T); ideal is 1."
    ),
}


@dataclass(frozen=True, slots=True)
class Point:
    """One sweep point: its GPU count, nodes, run directory, and the state the sweep saw."""

    gpus: int
    run_dir: Path
    nodes: int = 1
    state: str | None = None
    predicted_comm_s: float | None = None
    """The orchestrator's prediction when the sweep was submitted (its chosen algorithm)."""
    device_kind: str | None = None
    """'GPU', or 'CPU' on CPU profiles; None where Slurm's accounting was not read."""
    device_hours: float | None = None
    """Allocated device-hours of the point's job, from sacct (study.record_ledgers)."""
    useful_device_hours: float | None = None
    """Its devices x the training time of the steps it kept."""


@dataclass(slots=True)
class Study:
    """What study.json says: mode, model, batch, accumulation, points, and the fabric."""

    root: Path
    mode: str
    points: list[Point]
    model: str = ""
    batch: int | None = None
    accum: int = 1
    fabric: dict[str, Any] | None = None
    grad_bytes: float | None = None
    fabric_source: str = "profile fabric"
    """What priced the predictions: the profile's numbers or 'calibration of DATE, job ID'."""
    calibration: dict[str, Any] | None = None


@dataclass(slots=True)
class Row:
    """One line of the scaling table; numbers are None for a failed point."""

    gpus: int
    nodes: int
    run_dir: str
    state: str = "ok"
    error: str | None = None
    global_batch: int | None = None
    images_per_s: float | None = None
    images_per_s_per_gpu: float | None = None
    speedup: float | None = None
    ideal_speedup: float | None = None
    efficiency: float | None = None
    time: dict[str, float] = field(default_factory=dict)
    comm_pct: float | None = None
    engine: str | None = None
    """The engine the run's plan.json names (fsdp, not the trainer's summary's "mesh")."""
    predicted_comm_s: float | None = None
    comm_ratio: float | None = None
    exchange_s: float | None = None
    """Median over steps of the least comm time over ranks: the exchange without the wait for
    slower peers (the last rank to finish its backward pass waits for nobody)."""
    exchange_ratio: float | None = None
    mfu: float | None = None
    """The trainer's model FLOPs utilisation (summary.json); None where the peak is unknown."""
    device_kind: str | None = None
    device_hours: float | None = None
    """Allocated GPU-hours (CPU-hours on CPU profiles) of the point, failed points included."""
    useful_device_hours: float | None = None
    predicted_step_s: float | None = None
    """The step-time model's (scaled_step_s) from the baseline point: its compute per image
    scaled to this point's images per rank, plus this point's predicted communication."""
    step_error: float | None = None
    """(predicted - measured) / measured step time."""


# study.json keys (written by workflows/studies/scaling.py); unknown ones are rejected.
_STUDY_KEYS = {
    "mode", "points", "model", "batch", "accum", "fabric", "grad_bytes", "cluster", "steps",
    "warmup", "args", "created", "script", "job_id", "report_job_id", "fabric_source",
    "calibration", "node_hours",
}  # fmt: skip
_POINT_KEYS = {
    "gpus", "nodes", "run_dir", "state", "batch_size", "global_batch", "index", "engine",
    "algorithm", "predicted_comm_s", "device_kind", "device_hours", "useful_device_hours",
    "job_id", "time", "time_source", "predicted_run_s",  # the point's own job
    "topology",  # an older study's name for "engine"
}  # fmt: skip


def load_study(root: Path) -> Study:
    """Read STUDY_DIR/study.json; unknown keys and a bad mode raise naming the field."""
    root = Path(root)
    path = root / STUDY_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    check_keys(data, sorted(_STUDY_KEYS), str(path))
    if data.get("mode") not in MODES:
        raise ValueError(f"{path}: mode must be one of {MODES}, got {data.get('mode')!r}")
    points = []
    for i, raw in enumerate(data.get("points") or []):
        check_keys(raw, sorted(_POINT_KEYS), f"{path}: points[{i}]")
        points.append(
            Point(
                gpus=int(raw["gpus"]),
                nodes=int(raw.get("nodes", 1)),
                run_dir=root / raw["run_dir"],
                state=raw.get("state"),
                predicted_comm_s=raw.get("predicted_comm_s"),
                device_kind=raw.get("device_kind"),
                device_hours=raw.get("device_hours"),
                useful_device_hours=raw.get("useful_device_hours"),
            )
        )
    if not points:
        raise ValueError(f"{path}: points is empty; a study needs at least one sweep point")
    return Study(
        root=root,
        mode=data["mode"],
        points=points,
        model=data.get("model", ""),
        batch=data.get("batch"),
        accum=int(data.get("accum", 1)),
        fabric=data.get("fabric"),
        grad_bytes=data.get("grad_bytes"),
        fabric_source=data.get("fabric_source") or "profile fabric",
        calibration=data.get("calibration"),
    )


def study_from_runs(run_dirs: list[Path], mode: str) -> Study:
    """A study over loose run directories; GPU counts come from each run's own logs."""
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
    points = []
    for run_dir in run_dirs:
        run = read_run(Path(run_dir))
        gpus = _logged_world_size(run)
        if gpus is None:
            raise ValueError(f"{run_dir}: no step or summary line tells its GPU count")
        points.append(Point(gpus=gpus, run_dir=Path(run_dir)))
    return Study(root=Path(run_dirs[0]).parent, mode=mode, points=points)


def _logged_world_size(run: RunLog) -> int | None:
    if run.summary and "world_size" in run.summary:
        return int(run.summary["world_size"])
    return run.steps[0].world_size if run.steps else None


def speedup_efficiency(
    gpus: int, images_per_s: float, base_gpus: int, base_images_per_s: float
) -> tuple[float, float]:
    """(speedup, efficiency) of a point against the baseline: X/X0 and (X/X0)/(N/N0)."""
    speedup = images_per_s / base_images_per_s
    return speedup, speedup / (gpus / base_gpus)


def mean_times(run: RunLog) -> dict[str, float]:
    """Mean seconds per optimizer step of each part over the timed steps of all ranks."""
    steps = run.timed_steps
    return {part: sum(s.time[part] for s in steps) / len(steps) for part in (*TIME_PARTS, "step")}


def scaled_step_s(
    step_s: float, comm_s: float, work_from: float, work_to: float, predicted_comm_s: float
) -> float:
    """The step-time model placement and the scaling report share: a measured step's compute
    (step - comm) scaled by the work per rank (images or micro-batches a rank computes each
    step), plus the communication the cost model predicts where the step will run."""
    return (step_s - comm_s) * work_to / work_from + predicted_comm_s


def predicted_comm_s(point: Point) -> float | None:
    """The prediction the planner recorded: the sweep's, else the run's plan.json (None when
    neither priced the run; nothing is re-priced here)."""
    if point.predicted_comm_s is not None:
        return float(point.predicted_comm_s)
    decision = find_decision(point.run_dir)
    return decision.costs.predicted_comm_s if decision and decision.costs else None


def _measured_row(study: Study, point: Point, run: RunLog) -> Row:
    row = Row(gpus=point.gpus, nodes=point.nodes, run_dir=str(point.run_dir),
              device_kind=point.device_kind, device_hours=point.device_hours,
              useful_device_hours=point.useful_device_hours)  # fmt: skip
    summary = run.summary or {}
    logged = _logged_world_size(run)
    if point.state not in (None, "ok", "COMPLETED", "completed"):
        row.error = f"sweep reported state {point.state}"
    elif run.error:
        row.error = run.error
    elif logged != point.gpus:
        row.error = f"ran on {logged} ranks, the study expected {point.gpus}"
    if row.error:
        row.state = "failed"
        return row
    timed = run.timed_steps
    row.global_batch = int(summary.get("global_batch") or timed[0].batch_size * point.gpus)
    row.images_per_s = float(summary["images_per_s"])
    row.images_per_s_per_gpu = row.images_per_s / point.gpus
    row.time = mean_times(run)
    row.comm_pct = 100.0 * row.time["comm"] / row.time["step"] if row.time["step"] else None
    decision = find_decision(point.run_dir)
    row.engine = decision.engine.name if decision else None
    row.mfu = summary.get("mfu")
    row.predicted_comm_s = predicted_comm_s(point)
    row.exchange_s = exchange_s(run)
    if row.predicted_comm_s:
        row.comm_ratio = row.time["comm"] / row.predicted_comm_s
        row.exchange_ratio = row.exchange_s / row.predicted_comm_s
    return row


def exchange_s(run: RunLog) -> float:
    """Median over timed steps of the least comm seconds over ranks (see Row.exchange_s)."""
    per_step: dict[int, float] = {}
    for s in run.timed_steps:
        per_step[s.step] = min(per_step.get(s.step, math.inf), s.time["comm"])
    return statistics.median(per_step.values())


def scaling_table(study: Study) -> list[Row]:
    """One row per point, sorted by GPUs; speedup/efficiency against the smallest good point."""
    rows = [_measured_row(study, p, read_run(p.run_dir)) for p in study.points]
    rows.sort(key=lambda r: (r.gpus, r.run_dir))
    good = [r for r in rows if r.state == "ok"]
    if good:
        base = good[0]
        assert base.images_per_s is not None
        for row in good:
            assert row.images_per_s is not None
            row.speedup, row.efficiency = speedup_efficiency(
                row.gpus, row.images_per_s, base.gpus, base.images_per_s
            )
            row.ideal_speedup = row.gpus / base.gpus
            _predict_step(row, base)
    return rows


def _predict_step(row: Row, base: Row) -> None:
    """The point's step time as the model predicts it from the baseline's, and its error."""
    if row.predicted_comm_s is None or not (row.global_batch and base.global_batch):
        return
    measured = row.time["step"]
    row.predicted_step_s = scaled_step_s(
        base.time["step"], base.time["comm"], base.global_batch / base.gpus,
        row.global_batch / row.gpus, row.predicted_comm_s,
    )  # fmt: skip
    row.step_error = (row.predicted_step_s - measured) / measured if measured else None


def off_points(rows: list[Row]) -> list[Row]:
    """The points whose predicted step time is off by more than OFF_BY."""
    return [r for r in rows if r.step_error is not None and abs(r.step_error) > OFF_BY]


def baseline(rows: list[Row]) -> Row | None:
    """The smallest successful point, the one speedups are measured against."""
    return next((r for r in rows if r.state == "ok"), None)


def rows_as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
