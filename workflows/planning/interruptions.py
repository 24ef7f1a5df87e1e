"""How often a partition's jobs are interrupted: preempted, node-failed and requeued job starts
per job-hour of its Slurm accounting history (the mean time between interruptions, M, of the
checkpoint interval). The one sacct query of it is `partition_history`."""

from __future__ import annotations

from dataclasses import dataclass

from vitpod.workflows import slurm

HISTORY_DAYS = 30
INTERRUPTED = ("PREEMPTED", "NODE_FAIL", "REQUEUED")
"""sacct states of a start that ended before its job did (with -D, a requeued start is listed
as REQUEUED, or PREEMPTED when preemption requeued it)."""

HistoryError = slurm.SlurmError
"""sacct could not be run or failed; the message says why."""


@dataclass(frozen=True)
class History:
    partition: str
    days: int
    starts: int
    """Job starts in the window (sacct -X -D: one line per start, requeued ones included)."""
    job_hours: float
    interruptions: int

    @property
    def mtbi_hours(self) -> float | None:
        """Job-hours per interruption; None when there was none (or no time run)."""
        if not self.interruptions or self.job_hours <= 0:
            return None
        return self.job_hours / self.interruptions

    def source(self) -> str:
        return (
            f"sacct: {self.interruptions} interruption(s) in {self.job_hours:.2f} job-hours of "
            f"{self.starts} start(s) on partition {self.partition}, last {self.days} days"
        )


def partition_history(partition: str, days: int = HISTORY_DAYS) -> History:
    """The partition's starts, job-hours (ElapsedRaw) and interruptions in the last `days`;
    HistoryError when sacct cannot be run or fails."""
    columns = ("JobID", "State", "ElapsedRaw")
    out = slurm.run(["sacct", "-X", "-D", "--partition", partition, "-S", f"now-{days}days",
                     "--parsable2", "-n", "-o", ",".join(columns)])  # fmt: skip
    starts, seconds, interruptions = 0, 0, 0
    for row in slurm.parsable(out, columns):
        if not row["JobID"]:
            continue
        starts += 1
        interruptions += row["State"].split(" ")[0] in INTERRUPTED  # "CANCELLED by 0"
        seconds += int(row["ElapsedRaw"]) if row["ElapsedRaw"].isdigit() else 0
    return History(partition, days, starts, seconds / 3600, interruptions)
