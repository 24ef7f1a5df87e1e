"""The goodput ledger of a run or pipeline: Slurm's attempts (sacct -D) joined to the trainer's."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from vitpod.analysis.goodput import Attempt, Ledger, assemble, container_seconds, read_rank0

__all__ = ["AccountingError", "Ledger", "allocated_devices", "attempts", "ledger", "sacct"]

INCOMPLETE = "INCOMPLETE"  # the first note of a ledger whose Slurm accounting could not be read


class AccountingError(RuntimeError):
    """sacct did not answer: the attempts (queue waits, requeues) are unknown, not absent."""


def _epoch(stamp: str) -> float | None:
    """sacct's local time (2026-11-23T22:57:16; "Unknown"/"None" when not yet) -> Unix time."""
    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def sacct(
    args: list[str],
    timeout: float = 30.0,
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> str:
    """`sacct ARGS`'s output; AccountingError saying why when sacct cannot be run or fails
    (`run` replaces the subprocess call in tests)."""
    cmd = ["sacct", *args]
    try:
        out = run(cmd) if run else subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise AccountingError(f"sacct did not answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise AccountingError(f"sacct could not run ({exc.strerror or exc})") from None
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise AccountingError(f"sacct failed (exit {out.returncode}: {why})")
    return out.stdout


def attempts(job_ids: list[str]) -> list[Attempt]:
    """Every start of the jobs, requeues included (sacct's --duplicates), oldest first;
    AccountingError when sacct cannot be run or fails."""
    if not job_ids:
        return []
    out = sacct(["-D", "-X", "-P", "-n", "-j", ",".join(job_ids),
                 "-o", "JobID,Submit,Start,End,AllocTRES"])  # fmt: skip
    found: list[Attempt] = []
    seen: dict[str, int] = {}
    for line in out.splitlines():
        job, submit, start, end, tres = (line.split("|") + [""] * 5)[:5]
        when = _epoch(submit)
        if when is None:
            continue
        restart = seen[job] = seen.get(job, -1) + 1
        devices, kind = allocated_devices(tres)
        found.append(Attempt(job, restart, when, _epoch(start), _epoch(end), devices, kind))
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
    try:
        found, problem = attempts(job_ids), None
    except AccountingError as exc:
        found, problem = [], exc
    result = assemble(read_rank0(run_dir), found, container_seconds(run_dir))
    if problem is not None:
        note = f"{INCOMPLETE}: {problem}; queue wait and requeued attempts unknown, ask again later"
        result.notes = [note, *(n for n in result.notes if not n.startswith("no Slurm accounting"))]
    return result


def is_complete(ledger: Ledger) -> bool:
    return not any(n.startswith(INCOMPLETE) for n in ledger.notes)


def pipeline_ledger(stages: list[tuple[Path, list[str]]]) -> Ledger:
    """The sum over a pipeline's stages (each stage's wall time is its own jobs')."""
    total = Ledger()
    for run_dir, ids in stages:
        total.add(ledger(run_dir, ids))
    return total
