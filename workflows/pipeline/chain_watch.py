"""Watching a Chain: states of its stages, waiting for them, the live view, failure causes.

Functions of the chain (workflows/pipeline/chain.py keeps the public methods that call them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.pipeline import chain_cross
from vitpod.workflows.pipeline.chain_stage import stage_dir
from vitpod.workflows.watching import follow, status
from vitpod.workflows.watching.rootcause import first_error_line, root_cause


class Chain(Protocol):
    """What watching needs of workflows.pipeline.chain.Chain (which calls these functions)."""

    stages: dict[str, JobState]
    directory: Path | None
    label_jobs: dict[str, Any]
    crossing: bool  # the fine-tune goes to another cluster after the pretrain (chain_cross.py)

    @property
    def uses_slurm(self) -> bool: ...
    def _submit_stage(self, rec: Any, dependency: str | None) -> None: ...
    def _save(self) -> None: ...
    def _cancel_submitted(self) -> str: ...
    def report(self) -> dict[str, Any]: ...


class ChainError(RuntimeError):
    """A stage failed or was cancelled; the message carries the root-cause traceback if found."""


def _local_state(rec: JobState) -> str:
    if rec.job is None:
        return rec.recorded or "NOT_SUBMITTED"
    if rec.job.state == "RUNNING":
        return "RUNNING"
    try:
        rec.job.results()
    except Exception:  # the task raised (its traceback is in the rank logs)
        return "FAILED"
    return "COMPLETED"


def advance_local(chain: Chain) -> None:
    """Local profile: record states, and start the finetune once the pretrain completed."""
    for rec in chain.stages.values():
        if rec.recorded not in jobstate.TERMINAL:
            rec.recorded = _local_state(rec)
    pre, fin = chain.stages.get("pretrain"), chain.stages.get("finetune")
    if pre and fin and fin.job is None and fin.recorded != "CANCELLED":
        if pre.recorded == "COMPLETED":
            chain._submit_stage(fin, dependency=None)
        elif pre.recorded in jobstate.TERMINAL:
            fin.recorded = "CANCELLED"  # as Slurm's kill_invalid_depend would
    chain._save()


def status_of(chain: Chain) -> list[JobState]:
    if not chain.stages:
        raise RuntimeError("submit() first")
    if chain.uses_slurm:
        if chain.crossing:
            advance_cross(chain)
        ids: dict[str, list[str]] = {}  # one poll per Slurm cluster
        for rec in chain.stages.values():
            ids.setdefault(rec.cluster, []).extend(rec.job_ids)
        polled = {}
        for cluster, jobs in ids.items():
            with slurm.on_cluster(cluster):
                polled[cluster] = jobstate.poll_once(jobs) if jobs else {}
        infos = {n: [polled[r.cluster][j] for j in r.job_ids]
                 for n, r in chain.stages.items()}  # fmt: skip
    else:
        advance_local(chain)
        infos = {n: [] for n in chain.stages}
    statuses = [
        status.stage_status(rec, infos[name], accounting=chain.uses_slurm, with_ledger=False)
        for name, rec in chain.stages.items()
    ]
    return status.add_ledgers(statuses, chain.uses_slurm)


def wait(chain: Chain, timeout: float | None, poll_s: float) -> dict[str, Any]:
    if not chain.stages:
        raise RuntimeError("submit() first")
    if chain.uses_slurm and chain.crossing:
        _wait_cross(chain, timeout, poll_s)
    elif chain.uses_slurm:
        _wait_slurm(chain, timeout, poll_s)
    else:
        _wait_local(chain, timeout, poll_s)
    return chain.report()


def _wait_slurm(chain: Chain, timeout: float | None, poll_s: float) -> None:
    ids = [j for rec in chain.stages.values() for j in rec.job_ids]
    try:
        jobstate.wait_jobs(jobstate.JobStatePoller(ids), timeout=timeout, poll_s=poll_s)
    except jobstate.JobFailedError as exc:
        stage = next(n for n, r in chain.stages.items() if exc.info.job_id in r.job_ids)
        chain.stages[stage].recorded = exc.info.state
        chain._save()
        raise ChainError(failure_message(chain, stage, str(exc))) from None
    for rec in chain.stages.values():
        rec.recorded = "COMPLETED"
    chain._save()


def advance_cross(chain: Chain) -> None:
    """The handover's look at the pretrain (chain_cross.py); its failure is recorded in the
    stages' states, which status and follow show."""
    try:
        chain_cross.advance(chain)
    except chain_cross.HandoverError as exc:
        print(f"error: {exc}", flush=True)


def _wait_cross(chain: Chain, timeout: float | None, poll_s: float) -> None:
    try:
        chain_cross.wait(chain, timeout, poll_s)
    except chain_cross.HandoverError as exc:
        stage = "pretrain" if chain.stages["pretrain"].recorded != "COMPLETED" else "finetune"
        raise ChainError(failure_message(chain, stage, str(exc))) from None
    except jobstate.JobFailedError as exc:
        chain.stages["finetune"].recorded = exc.info.state
        chain._save()
        raise ChainError(failure_message(chain, "finetune", str(exc))) from None
    for rec in chain.stages.values():
        rec.recorded = "COMPLETED"
    chain._save()


def _wait_local(chain: Chain, timeout: float | None, poll_s: float) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        advance_local(chain)
        for name, rec in chain.stages.items():
            if rec.recorded in jobstate.TERMINAL and rec.recorded != "COMPLETED":
                raise ChainError(failure_message(chain, name, f"{name} ended {rec.recorded}"))
        if all(r.recorded == "COMPLETED" for r in chain.stages.values()):
            return
        if deadline is not None and time.monotonic() >= deadline:
            outcome = chain._cancel_submitted()
            raise TimeoutError(f"pipeline not finished after {timeout:.0f} s; {outcome}")
        time.sleep(min(poll_s, 1.0))


def follow_chain(chain: Chain, interval: float | None, console: Any) -> int:
    if not chain.stages or chain.directory is None:
        raise RuntimeError("submit() first")
    advance = None if chain.uses_slurm else (lambda: advance_local(chain))
    if chain.uses_slurm and chain.crossing:
        advance = lambda: advance_cross(chain)  # noqa: E731
    return follow.follow(chain.directory, interval, console, before_poll=advance)


def failure_message(chain: Chain, stage: str, reason: str) -> str:
    logs_dir = stage_dir(chain.stages[stage]) / runfiles.LOGS
    tb = root_cause(logs_dir)
    where = f"\nlogs: {logs_dir}"
    for job in chain.label_jobs.values():  # a failed labeling array cancels the pretrain
        logs = job.plan.run_dir / runfiles.LOGS
        where += f"\nlabeling logs (the pretrain waits for them): {logs}"
    line = _refusal_line(logs_dir) or first_error_line(logs_dir)
    if tb is None:
        return f"{stage}: {reason}" + (f"\nfirst error: {line}" if line else "") + where
    # torchrun's own ChildFailedError (the local profile's job.sh) can be the only traceback,
    # after the ranks' one-line refusals: those come first
    said = f"\nfirst error: {line}" if line and line.split(": ", 1)[-1] not in tb.text else ""
    return f"{stage}: {reason}{said}\nroot cause ({tb.path}:{tb.line}):\n{tb.text}{where}"


def _refusal_line(log_dir: Path) -> str | None:
    """The first `error: ...` line a rank printed (the trainer's one-line refusals), before
    other lines that merely mention an error (torchrun's and the rendezvous' own, which the
    local profile's job.sh interleaves into one log)."""
    for path in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        for text in path.read_text(errors="replace").splitlines():
            if text.lstrip().startswith("error: "):
                return f"{path.name}: {text.strip()}"
    return None
