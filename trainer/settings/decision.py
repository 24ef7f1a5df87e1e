"""The plan a rank starts from: `--plan RUN/plan.json`, whose `trainer` section is the base layer
of the flags (trainer/settings/flags.py), and what an override may not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, RecordError, read_decision
from vitpod.registry.trainsections import groups
from vitpod.trainer.config import ConfigError


def read_plan(path: str) -> Decision:
    """plan.json of a training job; ConfigError names the file and the fix."""
    plan = Path(path)
    if plan.name != runfiles.PLAN:
        raise ConfigError(f"--plan {path}: give a run's {runfiles.PLAN} (RUN_DIR/{runfiles.PLAN})")
    try:
        decision = read_decision(plan.parent)
    except RecordError as exc:
        raise ConfigError(str(exc)) from None
    if decision.trainer is None:
        raise ConfigError(f"--plan {path}: its ranks run no trainer (stage {decision.stage})")
    return decision


def refuse_overrides(values: dict[str, Any], decision: Decision, path: str) -> None:
    """ConfigError naming each parallel setting an override changed (the engine and layout
    are the planner's), with the plan's value and the fix."""
    assert decision.trainer is not None
    planned = decision.trainer.parallel
    changed = [
        f"--{key.replace('_', '-')} {_shown(values[key])} (the plan: {_shown(planned[key])})"
        for key, group in groups().items()
        if group == "parallel" and _shown(values[key]) != _shown(planned[key])
    ]
    if changed:
        raise ConfigError(
            f"{'; '.join(changed)}: {path} decided the engine and layout; drop the flag, or plan "
            "the run again with it (make render/pretrain ARGS=...)"
        )


def _shown(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
