"""One stage of a Chain: its plan (or, reattached from pipeline.json, its record), run
directory, job ids and state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, find_decision
from vitpod.workflows.planning.plan import JobPlan


@dataclass
class StageRecord:
    """One submitted stage: its run directory and job(s). `plan` is None for a stage read back
    from pipeline.json (`Chain.from_dir`): then `recorded` is its entry there."""

    stage: str
    plan: JobPlan | None
    job: Any = None
    job_ids: list[str] = field(default_factory=list)
    state: str = ""
    recorded: dict[str, Any] = field(default_factory=dict)
    manifest_extra: dict[str, Any] = field(default_factory=dict)
    """More keys of the stage's manifest.json (a fine-tune's transfer across clusters)."""

    @property
    def recorded_cluster(self) -> str:
        """The Slurm cluster its profile names ('': the default one)."""
        if self.plan is not None:
            return self.plan.profile.cluster or ""
        return str(self.recorded.get("cluster") or "")

    @property
    def job_plan(self) -> JobPlan:
        if self.plan is None:
            raise RuntimeError(
                f"{self.stage}: reattached from {runfiles.PIPELINE}, which keeps no plan; "
                "submit a new Chain to run it again (or `vitpod resume --run RUN_DIR`)"
            )
        return self.plan

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir if self.plan is not None else Path(self.recorded["run_dir"])

    @property
    def decision(self) -> Decision | None:
        return self.plan.decision if self.plan is not None else find_decision(self.run_dir)

    def record(self) -> dict[str, Any]:
        """The stage's entry in pipeline.json."""
        if self.plan is None:
            return {**self.recorded, "job_ids": self.job_ids, "state": self.state}
        decision = self.plan.decision
        return {
            "run_dir": str(self.run_dir),
            "job_ids": self.job_ids,
            "state": self.state,
            "engine": decision.engine.name if decision else None,
            "partition": self.plan.spec.partition,
            "nodes": self.plan.spec.nodes,
            "time": self.plan.spec.time,
            "profile": self.plan.profile.name,
            "cluster": self.plan.profile.cluster or "",
        }

    @classmethod
    def from_record(cls, stage: str, entry: dict[str, Any]) -> StageRecord:
        ids = [str(j) for j in entry.get("job_ids", [])]
        return cls(stage, None, job_ids=ids, state=entry.get("state", ""), recorded=dict(entry))
