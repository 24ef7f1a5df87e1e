"""One writer per run: the jobs a run directory's manifests name, and whether one still lives.

A run directory is written by one job at a time: a second job (`vitpod resume` right after a
requeue, while the first is pending again) would rewrite job.sbatch and bind.sh under it, and
both would write and prune one checkpoints/ directory. Whatever submits into an existing run
asks Slurm first (one batched squeue over every job id in manifest.json and the
manifest.restart<N>.json kept beside it) and refuses while one is pending, running, requeued or
suspended, or, when asked to, cancels them and waits until they have left the queue.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate

CANCEL_WAIT_S = 300.0
"""How long `--cancel-running` waits for cancelled jobs to leave the queue (a running job
first gets the preemption signal's grace to checkpoint)."""


def run_job_ids(run: Path) -> list[str]:
    """Every job id the run's manifests record, oldest restart first, without repeats."""
    paths = sorted(run.glob("manifest.restart*.json"), key=_restart_number)
    ids: list[str] = []
    for path in [*paths, run / runfiles.MANIFEST]:
        try:
            found = runfiles.read_record(path).get("job_ids") or []
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable manifest names no job; resume reports the current one
        ids += [str(j) for j in found if str(j) not in ids]
    return ids


def _restart_number(path: Path) -> int:
    digits = path.name.removeprefix("manifest.restart").removesuffix(".json")
    return int(digits) if digits.isdigit() else 0


def live_jobs(job_ids: list[str]) -> dict[str, jobstate.JobInfo]:
    """The jobs Slurm still holds (pending, running, requeued, suspended, completing...), from
    one squeue call; ConfigError when squeue does not answer (then nobody can tell)."""
    if not job_ids:
        return {}
    try:
        known = jobstate.squeue(job_ids)
    except slurm.SlurmError as exc:
        raise ConfigError(
            f"cannot tell whether job(s) {','.join(job_ids)} of this run still run ({exc}); "
            "retry when squeue answers"
        ) from None
    return {j: info for j, info in known.items() if not info.terminal}


def refuse_or_cancel(run: Path, cancel: bool, *, flag: str, wait_s: float = CANCEL_WAIT_S) -> None:
    """Refuse (ConfigError, before anything is written) while a job of `run` lives; with
    `cancel`, scancel them and wait until they have left the queue."""
    live = live_jobs(run_job_ids(run))
    if not live:
        return
    ids = list(live)
    states = ", ".join(f"job {j} is {i.state}" for j, i in live.items())
    if not cancel:
        raise ConfigError(
            f"{run}: {states} and writes this run directory; one job per run: wait for it, "
            f"`scancel {' '.join(ids)}`, or add {flag} to cancel it first"
        )
    try:
        slurm.scancel(ids)
    except slurm.SlurmError as exc:
        raise ConfigError(f"{run}: {states}; {exc}; nothing was submitted") from None
    print(f"cancelled {' '.join(ids)} ({states}); waiting for it to leave the queue", flush=True)
    deadline = time.monotonic() + wait_s
    while live := live_jobs(ids):
        if time.monotonic() >= deadline:
            left = ", ".join(f"{j} {i.state}" for j, i in live.items())
            raise ConfigError(
                f"{run}: cancelled job(s) still in the queue after {wait_s:.0f} s ({left}); "
                "nothing was submitted; retry when squeue no longer lists them"
            )
        time.sleep(1.0)


def point_jobs(point: dict[str, Any]) -> list[str]:
    """A study.json point's job id as a list ([]: rendered, never submitted)."""
    return [str(point["job_id"])] if point.get("job_id") else []


def study_jobs(directory: Path, record: dict[str, Any]) -> list[jobstate.JobState]:
    """A study's jobs as its views show them: each point's, then the report job's."""
    jobs = [jobstate.JobState(f"{p['gpus']} GPU(s)", directory / p["run_dir"], point_jobs(p))
            for p in record.get("points", [])]  # fmt: skip
    report = record.get("report_job_id")
    return [*jobs, jobstate.JobState("report", None, [str(report)] if report else [])]
