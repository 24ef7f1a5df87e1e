"""The goodput ledger of a run or pipeline: Slurm's attempts (sacct -D) joined to the trainer's."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from vitpod.analysis.goodput import Attempt, Ledger, assemble, container_seconds, read_rank0

__all__ = ["Ledger", "attempts", "ledger"]


def _epoch(stamp: str) -> float | None:
    """sacct's local time (2026-11-23T22:57:16; "Unknown"/"None" when not yet) -> Unix time."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def attempts(job_ids: list[str]) -> list[Attempt]:
    """Every start of the jobs, requeues included (sacct's --duplicates), oldest first."""
    if not job_ids:
        return []
    try:
        out = subprocess.run(
            ["sacct", "-D", "-X", "-P", "-n", "-j", ",".join(job_ids),
             "-o", "JobID,Submit,Start,End"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    found: list[Attempt] = []
    seen: dict[str, int] = {}
    for line in out.stdout.splitlines():
        job, submit, start, end = (line.split("|") + ["", "", "", ""])[:4]
        when = _epoch(submit)
        if when is None:
            continue
        restart = seen[job] = seen.get(job, -1) + 1
        found.append(Attempt(job, restart, when, _epoch(start), _epoch(end)))
    return sorted(found, key=lambda a: a.submit)


def ledger(run_dir: Path, job_ids: list[str]) -> Ledger:
    return assemble(read_rank0(run_dir), attempts(job_ids), container_seconds(run_dir))


def pipeline_ledger(stages: list[tuple[Path, list[str]]]) -> Ledger:
    """The sum over a pipeline's stages (each stage's wall time is its own jobs')."""
    total = Ledger()
    for run_dir, ids in stages:
        total.add(ledger(run_dir, ids))
    return total
