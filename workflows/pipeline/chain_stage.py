"""One stage of a Chain, a JobState (workflows/jobs/jobstate.py) with its plan (or, reattached
from pipeline.json, its entry there): how it is made, planned or read back, and written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, find_decision
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.planning.plan import JobPlan


def planned(stage: str, plan: JobPlan) -> JobState:
    """A stage planned in this process."""
    return JobState(stage, plan.run_dir, cluster=plan.profile.cluster or "", plan=plan)


def reattached(stage: str, entry: dict[str, Any]) -> JobState:
    """A stage read back from its entry in pipeline.json (`Chain.from_dir`): no plan."""
    ids = [str(j) for j in entry.get("job_ids", [])]
    return JobState(stage, Path(entry["run_dir"]), ids, cluster=str(entry.get("cluster") or ""),
                    recorded=entry.get("state", ""), entry=dict(entry))  # fmt: skip


def stage_dir(rec: JobState) -> Path:
    """The stage's run directory (a chain's stage always has one)."""
    if rec.run_dir is None:
        raise RuntimeError(f"{rec.name}: a stage without a run directory")
    return rec.run_dir


def job_plan(rec: JobState) -> JobPlan:
    """The stage's plan; RuntimeError for a stage reattached from pipeline.json."""
    if rec.plan is None:
        raise RuntimeError(
            f"{rec.name}: reattached from {runfiles.PIPELINE}, which keeps no plan; "
            "submit a new Chain to run it again (or `vitpod resume --run RUN_DIR`)"
        )
    return rec.plan  # type: ignore[no-any-return]


def decision_of(rec: JobState) -> Decision | None:
    if rec.plan is not None:
        return rec.plan.decision  # type: ignore[no-any-return]
    return find_decision(rec.run_dir) if rec.run_dir is not None else None


def entry_of(rec: JobState) -> dict[str, Any]:
    """The stage's entry in pipeline.json (its state: the chain's own record, `recorded`)."""
    if rec.plan is None:
        return {**rec.entry, "job_ids": rec.job_ids, "state": rec.recorded}
    plan, decision = rec.plan, rec.plan.decision
    return {
        "run_dir": str(rec.run_dir),
        "job_ids": rec.job_ids,
        "state": rec.recorded,
        "engine": decision.engine.name if decision else None,
        "partition": plan.spec.partition,
        "nodes": plan.spec.nodes,
        "time": plan.spec.time,
        "profile": plan.profile.name,
        "cluster": plan.profile.cluster or "",
    }
