"""The goodput ledger of a run or pipeline: Slurm's attempts (sacct -D) joined to the trainer's."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Sequence
from pathlib import Path

from vitpod.analysis.goodput import Attempt, Ledger, assemble, container_seconds, read_rank0
from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.jobs import multicluster

__all__ = ["Ledger", "allocated_devices", "attempts", "ledger", "ledgers"]

INCOMPLETE = "INCOMPLETE"  # the first note of a ledger whose Slurm accounting could not be read
_FIELDS = ("JobID", "Submit", "Start", "End", "AllocTRES")


def _epoch(stamp: str) -> float | None:
    """sacct's local time (2026-11-23T22:57:16; "Unknown"/"None" when not yet) -> Unix time."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def attempts(job_ids: list[str]) -> list[Attempt]:
    """Every start of the jobs, requeues included (sacct's --duplicates), oldest first, from
    ONE sacct; SlurmError when sacct cannot be run or fails."""
    if not job_ids:
        return []
    found: list[Attempt] = []
    seen: dict[str, int] = {}
    for row in slurm.sacct(job_ids, _FIELDS, "-D"):
        job, when = row["JobID"], _epoch(row["Submit"])
        if when is None:
            continue
        restart = seen[job] = seen.get(job, -1) + 1
        devices, kind = allocated_devices(row["AllocTRES"])
        found.append(Attempt(job, restart, when, _epoch(row["Start"]), _epoch(row["End"]),
                             devices, kind))  # fmt: skip
    return sorted(found, key=lambda a: a.submit)


def allocated_devices(tres: str) -> tuple[int, str]:
    """sacct's AllocTRES ('billing=4,cpu=4,gres/gpu=8,mem=8G,node=2') -> (8, 'GPU'); a job
    without GPUs counts its CPUs (CPU profiles); (0, '') when the field is empty."""
    fields = dict(item.partition("=")[::2] for item in tres.split(",") if "=" in item)
    for key, kind in (("gres/gpu", "GPU"), ("cpu", "CPU")):
        if fields.get(key, "").isdigit() and int(fields[key]) > 0:
            return int(fields[key]), kind
    return 0, ""


def ledger(run_dir: Path, job_ids: list[str]) -> Ledger:
    """The run's ledger; when sacct fails, the trainer's records alone, marked INCOMPLETE (its
    first note says why) rather than passed off as a run without accounting."""
    return ledgers([(run_dir, job_ids)])[0]


def ledgers(runs: Sequence[tuple[Path, list[str]]]) -> list[Ledger]:
    """Each run's ledger from ONE sacct for the jobs of all of them (a study's 500 points: one
    call, not 500); runs on several clusters: one sacct per cluster (multicluster.py)."""

    def ask(ids: list[str]) -> tuple[list[Attempt], slurm.SlurmError | None]:
        try:
            return attempts(ids), None
        except slurm.SlurmError as exc:
            return [], exc

    out = []
    answers = multicluster.per_cluster(list(runs), ask)
    for (run_dir, job_ids), (found, problem) in zip(runs, answers, strict=True):
        mine = since_created(run_dir, [a for a in found if _of(a.job_id, job_ids)])
        result = assemble(read_rank0(run_dir), mine, container_seconds(run_dir))
        if problem is not None and job_ids:
            unknown = "queue wait and requeued attempts unknown, ask again later"
            note = f"{INCOMPLETE}: {problem}; {unknown}"
            rest = [n for n in result.notes if not n.startswith("no Slurm accounting")]
            result.notes = [note, *rest]
        out.append(result)
    return out


def since_created(run_dir: Path, found: list[Attempt]) -> list[Attempt]:
    """The attempts submitted since the run was created, restarts counted among them alone: a
    controller whose state was reset (or whose ids wrapped at MaxJobId) hands out an id again,
    and sacct -D then also lists the older job of that id."""
    try:
        created = dt.datetime.fromisoformat(runfiles.read_manifest(run_dir)["created"])
    except (FileNotFoundError, KeyError, ValueError):
        return found
    since = created.timestamp() - 1.0  # sacct's whole seconds
    kept = [a for a in found if a.submit >= since]
    return [dataclasses.replace(a, restart=sum(b.job_id == a.job_id for b in kept[:i]))
            for i, a in enumerate(kept)]  # fmt: skip


def _of(job: str, job_ids: list[str]) -> bool:
    """sacct's JobID `job` is one of `job_ids`, or a task of one of its arrays (123_4 of 123)."""
    return job in job_ids or job.partition("_")[0] in job_ids


def is_complete(ledger: Ledger) -> bool:
    return not any(n.startswith(INCOMPLETE) for n in ledger.notes)


def pipeline_ledger(stages: list[tuple[Path, list[str]]]) -> Ledger:
    """The sum over a pipeline's stages (each stage's wall time is its own jobs')."""
    total = Ledger()
    for stage in ledgers(stages):
        total.add(stage)
    return total
