"""A scaling study's record (study.json): what the sweep planned, each point's job and its end."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import write_json
from vitpod.workflows.jobs.runjobs import point_jobs
from vitpod.workflows.planning.exchange import calibration_for
from vitpod.workflows.planning.recipe import Recipe
from vitpod.workflows.site.profile import Profile, profile_path
from vitpod.workflows.slurm.quantities import slurm_minutes
from vitpod.workflows.watching import goodput

STAGE = "pretrain"


@dataclass(frozen=True)
class SweepPoint:
    """One point: its own job (nodes, ranks, time limit), the per-rank batch and its run."""

    index: int
    gpus: int
    nodes: int
    per_node: int
    batch_size: int
    global_batch: int
    run_dir: str
    decision: Decision
    time: str
    """The point's Slurm time limit (#SBATCH --time of its job.sbatch)."""
    time_source: str
    """How it was chosen: TIME=, the step-time model's prediction x a margin, or the limit."""
    predicted_run_s: float | None
    """The step-time model's seconds for the whole run (None: no earlier run to go by)."""

    @property
    def node_hours(self) -> float:
        """Nodes x the time limit: the most the point can hold."""
        return self.nodes * slurm_minutes(self.time) / 60


def study_record(
    mode: str,
    cluster: str,
    args: str,
    profile: Profile,
    recipe: Recipe,
    points: list[SweepPoint],
    batch: int,
    accum: int,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """study.json: what analysis needs to read the study (analysis/scaling.py's keys)."""
    return {
        "mode": mode,
        "model": recipe.model,
        "cluster": profile.name,
        "batch": batch,
        "accum": accum,
        "steps": steps,
        "warmup": warmup,
        "args": args or "",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "node_hours": round(sum(p.node_hours for p in points), 4),
        "report_job_id": None,
        "fabric": dict(profile.node_type(STAGE).fabric),
        "fabric_source": _fabric_source(points),
        "calibration": _calibration_record(cluster, points),
        "grad_bytes": points[0].decision.costs.grad_bytes if points[0].decision.costs else None,
        "points": [
            {
                "index": p.index,
                "gpus": p.gpus,
                "nodes": p.nodes,
                "run_dir": Path(p.run_dir).name,
                "batch_size": p.batch_size,
                "global_batch": p.global_batch,
                "engine": p.decision.engine.name,
                "algorithm": p.decision.costs.algorithm if p.decision.costs else None,
                "predicted_comm_s": p.decision.costs.predicted_comm_s if p.decision.costs else None,
                "time": p.time,
                "time_source": p.time_source,
                "predicted_run_s": p.predicted_run_s,
                "job_id": None,
                "state": None,
            }
            for p in points
        ],
    }


def point_states(job_ids: list[str], infos: dict[str, jobstate.JobInfo]) -> dict[int, str]:
    """Point index -> its job's final state (job_ids[i]: point i's id, '' none), leaving out
    the points nobody recorded (GONE)."""
    return {
        index: infos[job].state
        for index, job in enumerate(job_ids)
        if job in infos and infos[job].state != jobstate.GONE
    }


def _fabric_source(points: list[SweepPoint]) -> str:
    """What priced the points' predictions (the planner's decision says it)."""
    costs = points[0].decision.costs
    return costs.priced_by if costs else "profile fabric"


def _calibration_record(cluster: str, points: list[SweepPoint]) -> dict[str, Any] | None:
    """Which stored fit priced the points (None: the profile's fabric numbers)."""
    if _fabric_source(points) == "profile fabric":
        return None
    from vitpod.analysis.calibrate import calibration_path

    path = calibration_path(profile_path(cluster))
    cal = calibration_for(profile_path(cluster))
    if cal is None:
        return None
    return {
        "path": str(path.resolve()), "date": cal.date, "job_id": cal.job_id,
        "fabric": cal.fabric, "backend": cal.backend, "partition": cal.partition,
    }  # fmt: skip


def record_states(study_dir: Path, states: dict[int, str]) -> dict[str, Any]:
    """Write each point's final Slurm state into study.json (None when nobody recorded it)."""
    path = study_dir / runfiles.STUDY
    study = json.loads(path.read_text())
    for point in study["points"]:
        point["state"] = states.get(point["index"])
    write_json(path, study)
    return study


def record_ledgers(study_dir: Path) -> dict[str, Any]:
    """Write each point's allocated and useful GPU-hours (CPU-hours on CPU profiles) into
    study.json, from ONE sacct for every point's job (workflows/watching/goodput.py); a point
    sacct could not account for keeps None."""
    path = study_dir / runfiles.STUDY
    study = json.loads(path.read_text())
    points = study["points"]
    runs = [(study_dir / p["run_dir"], point_jobs(p)) for p in points]
    if not any(jobs for _, jobs in runs):
        return study  # rendered, never submitted: no accounting to read
    try:
        found = goodput.ledgers(runs)
    except runfiles.RunFileError as exc:  # the report must still appear; its hours say n/a
        print(f"warning: GPU-hours not recorded: {exc}", file=sys.stderr)
        return study
    for point, ledger in zip(points, found, strict=True):
        known = goodput.is_complete(ledger) and bool(ledger.device_kind)
        point["device_kind"] = ledger.device_kind if known else None
        point["device_hours"] = ledger.device_hours if known else None
        point["useful_device_hours"] = ledger.useful_device_hours if known else None
    write_json(path, study)
    return study


def report(study_dir: Path) -> int:
    """Record the points' GPU-hours, then `python -m vitpod.analysis report STUDY_DIR` (a
    separate process: no matplotlib here)."""
    record_ledgers(study_dir)
    done = subprocess.run(
        [sys.executable, "-m", "vitpod.analysis", "report", str(study_dir)], check=False
    )
    return done.returncode
