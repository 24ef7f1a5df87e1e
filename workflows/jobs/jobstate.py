"""Job state: one type for a job as vitpod shows it (JobState), and the batched Slurm poll behind
it: one squeue (plus sacct when accounting works) per poll for all jobs."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.workflows import slurm

#: States after which a job never runs again (a requeued job goes back to PENDING instead).
#: PREEMPTED is left out: with requeue it is a passing state; without, the job later leaves the
#: queue and counts as GONE.
TERMINAL = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
#: Reported when neither squeue nor accounting knows the job (it left the controller's memory).
GONE = "GONE"
#: Recorded for a stage that will never be submitted (a pipeline's fine-tune across clusters
#: whose pretrain failed or whose model could not be carried across: chain_cross.py).
NOT_STARTED = "NOT_STARTED"

# JobArrayID and sacct's JobID name an array task `123_4` (a plain job: `123`); a pending
# array's tasks not yet split off share one line, `123_[0-2%1]` or `123_[0,2]`.
SQUEUE_FIELDS = ("JobArrayID", "State", "Reason", "RestartCnt", "Exit_Code")
SACCT_FIELDS = ("JobID", "State", "ExitCode", "Reason")
_TASK_RANGE = re.compile(r"^(\d+)_\[([\d,-]+)(%\d+)?\]$")


@dataclass(frozen=True)
class JobInfo:
    """What one poll knows about one job."""

    job_id: str
    state: str
    reason: str = ""
    restarts: int = 0
    exit_code: str = ""
    source: str = "squeue"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL or self.state == GONE


@dataclass
class JobState:
    """A job as vitpod tracks and shows it: a run, a pipeline's stage, a study's point or report
    job, a labeling array. The one type behind `make status`, FOLLOW=1, `vitpod list` and the
    Chain: each fills in what it knows (Slurm's poll through `observe`, the run directory's
    metrics and logs); its views format it with functions (status.status_line, follow.cells)."""

    name: str
    """The stage (pretrain), the point ("2 GPU(s)"), "report", "labels-pretrain"."""
    run_dir: Path | None = None
    """None: a job that writes no run directory of its own (a study's report job)."""
    job_ids: list[str] = field(default_factory=list)
    """Oldest first (a resumed run's earlier jobs too)."""
    cluster: str = ""
    """The Slurm cluster of its jobs (multicluster.py); '' the default one."""
    state: str = ""
    """Slurm's state of its newest job, or what the directory tells (COMPLETED, NOT_SUBMITTED)."""
    recorded: str = ""
    """The state pipeline.json keeps (the local executor's; a stage not submitted yet)."""
    reason: str = ""
    """Slurm's reason (why it is PENDING), or why a running job looks stuck."""
    restarts: int = 0
    exit_code: str = ""
    ended: bool = False
    """It will never run again (follow: a job gone from squeue counts on the second poll)."""
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    images_per_s: float | None = None
    mfu: float | None = None
    top1: float | None = None
    eta_s: float | None = None
    ckpt_age_s: float | None = None
    sizes: tuple[int, ...] = ()
    """Ranks of each stretch, when a restart changed the world size."""
    engine: str | None = None
    """From plan.json: "ring", or "mesh(dp=2,tp=2,pp=1)"."""
    traceback: Any = None
    """Why it failed and what it cost (watching's rootcause.Traceback, triage.Diagnosis and
    goodput.Ledger; this layer does not import watching)."""
    diagnosis: Any = None
    ledger: Any = None
    plan: Any = None
    """A Chain's stage planned in this process: its JobPlan (None when read back from
    pipeline.json); `job` its submitted job handle."""
    job: Any = None
    entry: dict[str, Any] = field(default_factory=dict)
    """Its entry in pipeline.json as read back (Chain.from_dir)."""
    manifest_extra: dict[str, Any] = field(default_factory=dict)
    """More keys of its manifest.json (a fine-tune's transfer across clusters)."""

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED"

    def observe(self, infos: list[JobInfo]) -> bool:
        """Take Slurm's word on its jobs (their polls, oldest first): the newest's state, reason
        and exit code, the most restarts. False when Slurm knows none of them."""
        if not infos:
            return False
        newest = infos[-1]
        self.state, self.reason, self.exit_code = newest.state, newest.reason, newest.exit_code
        self.restarts = max(i.restarts for i in infos)
        return True


def _base_state(state: str) -> str:
    # sacct writes "CANCELLED by 0"; squeue may add flags such as "+" on some versions.
    return state.split()[0].rstrip("+") if state else ""


def expand_job_id(job_id: str) -> list[str]:
    """`123_[0-2,5%1]` -> ['123_0', '123_1', '123_2', '123_5']; any other id as it is."""
    match = _TASK_RANGE.match(job_id)
    if match is None:
        return [job_id]
    ids = []
    for part in match[2].split(","):
        first, _, last = part.partition("-")
        ids += [f"{match[1]}_{i}" for i in range(int(first), int(last or first) + 1)]
    return ids


def _info(job_id: str, row: dict[str, str], source: str) -> JobInfo:
    reason = row.get("Reason", "")
    restarts = row.get("RestartCnt", "")
    return JobInfo(
        job_id=job_id,
        state=_base_state(row["State"]),
        reason="" if reason == "None" else reason,
        restarts=int(restarts) if restarts.isdigit() else 0,
        exit_code=row.get("Exit_Code", row.get("ExitCode", "")),
        source=source,
    )


def squeue_infos(rows: list[dict[str, str]]) -> dict[str, JobInfo]:
    """squeue rows (SQUEUE_FIELDS) -> each job's or array task's state."""
    return {j: _info(j, row, "squeue") for row in rows if row["JobArrayID"]
            for j in expand_job_id(row["JobArrayID"])}  # fmt: skip


def sacct_infos(rows: list[dict[str, str]]) -> dict[str, JobInfo]:
    """sacct rows (SACCT_FIELDS) -> each allocation's state (steps such as 123.batch left out)."""
    return {j: _info(j, row, "sacct") for row in rows if row["JobID"] and "." not in row["JobID"]
            for j in expand_job_id(row["JobID"])}  # fmt: skip


def squeue(job_ids: list[str]) -> dict[str, JobInfo]:
    """One squeue call for all jobs, including finished ones still in the controller's memory;
    SlurmError when squeue fails."""
    return squeue_infos(slurm.squeue(job_ids, SQUEUE_FIELDS))


def sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """One sacct call for all jobs; SlurmError when accounting does not answer."""
    return sacct_infos(slurm.sacct(job_ids, SACCT_FIELDS))


@dataclass
class JobStatePoller:
    """Polls the state of a set of jobs with one squeue per poll and sacct only when it works.

    sacct is consulted only for jobs that squeue no longer lists; after it fails once it is
    retried at most every `sacct_retry_s` seconds, so a cluster without accounting costs one
    squeue call per poll.
    """

    job_ids: list[str]
    sacct_retry_s: float = 60.0
    accounting: bool | None = None
    cluster: str = ""
    """The Slurm cluster asked (-M); '': the one the caller's block is on (the default)."""
    _sacct_failed_at: float = field(default=-1e9, repr=False)

    def poll(self) -> dict[str, JobInfo]:
        with slurm.on_cluster(self.cluster or slurm.current_cluster()):
            return self._poll()

    def _poll(self) -> dict[str, JobInfo]:
        ids = [str(j) for j in self.job_ids]
        if not ids:
            return {}
        known = squeue(ids)
        missing = [j for j in ids if j not in known]
        if missing and self._sacct_allowed():
            try:
                found = sacct(missing)
            except slurm.SlurmError:
                self.accounting, self._sacct_failed_at = False, time.monotonic()
            else:
                self.accounting = True
                known.update({j: found[j] for j in missing if j in found})
        return {j: known.get(j, JobInfo(job_id=j, state=GONE, source="none")) for j in ids}

    def _sacct_allowed(self) -> bool:
        return time.monotonic() - self._sacct_failed_at >= self.sacct_retry_s


def poll_once(job_ids: Iterable[str]) -> dict[str, JobInfo]:
    """Convenience: the state of these jobs right now."""
    return JobStatePoller(list(job_ids)).poll()


class JobFailedError(RuntimeError):
    """A job ended in a state other than COMPLETED, or left the queue with no trace."""

    def __init__(self, info: JobInfo, message: str) -> None:
        super().__init__(message)
        self.info = info


def failure(info: JobInfo) -> str | None:
    """Why this job will never complete, or None while it may still."""
    if info.state == GONE:
        return (
            f"job {info.job_id} is no longer known to squeue and accounting (sacct) does not "
            "answer, so its final state is unknown; check its logs"
        )
    if info.state in TERMINAL and info.state != "COMPLETED":
        why = f" ({info.reason})" if info.reason else ""
        code = f", exit code {info.exit_code}" if info.exit_code else ""
        return f"job {info.job_id} ended {info.state}{why}{code}"
    return None


def _settled_polls(
    poller: JobStatePoller,
    timeout: float | None,
    poll_s: float,
    on_poll: Callable[[dict[str, JobInfo]], None] | None,
) -> Iterator[tuple[dict[str, JobInfo], set[str]]]:
    """Each poll's states and the jobs seen GONE for the first time (not to be trusted yet: a
    job between queue states is missing for a moment); TimeoutError once `timeout` has passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    gone_before: set[str] = set()
    while True:
        infos = poller.poll()
        if on_poll is not None:
            on_poll(infos)
        gone = {j for j, i in infos.items() if i.state == GONE}
        yield infos, gone - gone_before
        gone_before = gone
        if deadline is not None and time.monotonic() >= deadline:
            states = ", ".join(f"{j}={i.state}" for j, i in infos.items())
            raise TimeoutError(f"jobs not finished after {timeout:.0f} s: {states}")
        time.sleep(poll_s)


def wait_jobs(
    poller: JobStatePoller,
    timeout: float | None = None,
    poll_s: float = 2.0,
    on_poll: Callable[[dict[str, JobInfo]], None] | None = None,
) -> dict[str, JobInfo]:
    """Poll until every job is COMPLETED; raise JobFailedError as soon as one cannot complete.

    A job must be missing from squeue on two polls in a row before it counts as gone.
    """
    for infos, unsure in _settled_polls(poller, timeout, poll_s, on_poll):
        for info in infos.values():
            if info.job_id not in unsure and (reason := failure(info)) is not None:
                raise JobFailedError(info, reason)
        if all(i.state == "COMPLETED" for i in infos.values()):
            return infos
    raise AssertionError("unreachable")


def wait_finished(
    poller: JobStatePoller, timeout: float | None = None, poll_s: float = 2.0
) -> dict[str, JobInfo]:
    """Poll until every job has ended, however (e.g. each task of a job array); returns the
    final states. A job missing from squeue on two polls in a row counts as GONE."""
    for infos, unsure in _settled_polls(poller, timeout, poll_s, None):
        if not unsure and all(i.terminal for i in infos.values()):
            return infos
    raise AssertionError("unreachable")


def task_ids(job_id: str, tasks: int) -> list[str]:
    """An array's task ids as Slurm names them: 123_0, 123_1, ..."""
    return [f"{job_id}_{index}" for index in range(tasks)]


def cancel_outcome(job_ids: Iterable[str]) -> str:
    """scancel the jobs and say what happened, for a message: 'cancelled it' or the failure."""
    try:
        slurm.scancel(list(job_ids))
    except slurm.SlurmError as exc:
        return f"could not cancel it ({exc})"
    return "cancelled it"


def wait_array(
    job_id: str, tasks: int, timeout: float | None, poll_s: float = 3.0
) -> dict[int, str]:
    """Wait (one batched squeue a poll, sacct only when squeue forgot a task) until every task has
    ended; returns each task's final state, none for a task whose end nobody recorded. On timeout
    the array is cancelled and TimeoutError says whether scancel succeeded."""
    poller = JobStatePoller(task_ids(job_id, tasks))
    try:
        infos = wait_finished(poller, timeout=timeout, poll_s=poll_s)
    except TimeoutError:
        outcome = cancel_outcome([job_id])
        raise TimeoutError(f"array {job_id} not done after {timeout} s; {outcome}") from None
    return task_states(infos)


def task_states(infos: dict[str, JobInfo]) -> dict[int, str]:
    """Array task index -> final state, leaving out tasks nobody recorded (GONE)."""
    return {
        int(job_id.rpartition("_")[2]): info.state
        for job_id, info in infos.items()
        if info.state != GONE
    }
