"""The plan a rank starts from: `--plan RUN/plan.json`, whose `trainer` section is the base layer
of the flags (trainer/flags.py), and what an override may not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitpod.registry.decision import Decision, RecordError, read_decision
from vitpod.registry.trainsections import groups


class DecisionConflict(ValueError):
    """An override disagrees with the engine or layout of the plan; the message names both."""


def read_plan(path: str) -> Decision:
    """plan.json of a training job; RecordError names the file and the fix."""
    plan = Path(path)
    if plan.name != "plan.json":
        raise RecordError(f"--plan {path}: give a run's plan.json (RUN_DIR/plan.json)")
    decision = read_decision(plan.parent)
    if decision.trainer is None:
        raise RecordError(f"{path}: its ranks run no trainer (stage {decision.stage})")
    return decision


def conflicts(values: dict[str, Any], decision: Decision) -> list[str]:
    """The parallel settings an override changed: the engine and layout are the planner's."""
    assert decision.trainer is not None
    planned = decision.trainer.parallel
    changed = [
        f"--{key.replace('_', '-')} {_shown(values[key])} (the plan: {_shown(planned[key])})"
        for key, group in groups().items()
        if group == "parallel" and _shown(values[key]) != _shown(planned[key])
    ]
    return changed


def refuse(changed: list[str], path: str) -> None:
    if changed:
        raise DecisionConflict(
            f"{'; '.join(changed)}: {path} decided the engine and layout; drop the flag, or plan "
            "the run again with it (make render/pretrain ARGS=...)"
        )


def _shown(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
