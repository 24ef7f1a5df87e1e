"""Is the preemption grace period long enough to write a checkpoint? The measured save of the
last run of this model and stage, else the memory planner's estimate (a warning, not a refusal:
a grace at or above the time limit is refused when the profile loads)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from vitpod.analysis import memory
from vitpod.registry import runfiles

ASSUMED_WRITE_BYTES_PER_S = 1.0 * memory.GIB
"""Write rate per node assumed for the planner's checkpoint-save estimate (no measured save)."""
GRACE_MARGIN = 2.0
"""The signal's lead time wanted per second of save: a slower storage day, the step in flight."""


def check_grace(plan: Any) -> str:
    """preemption.grace_s against the longest checkpoint save of the last run of this model and
    stage (its `timing` records), else the memory planner's state bytes per node at
    ASSUMED_WRITE_BYTES_PER_S; a warning on stderr, with the value to use, when the grace period
    is shorter than GRACE_MARGIN times it. (A grace at or above the time limit is refused when
    the profile is loaded.)"""
    spec = plan.spec
    grace = spec.profile.preemption.grace_s
    measured = last_checkpoint_save(Path(spec.run_dir), spec.model, spec.stage)
    if measured is not None:
        need, source = measured[0], f"the longest checkpoint save of {measured[1]}"
    else:
        estimate = _planned_save_s(plan)
        if estimate is None:
            return f"preemption.grace_s={grace}: no checkpoint save measured or estimated yet"
        need = estimate
        source = (f"the memory planner's model and optimizer state per node at an assumed "
                  f"{ASSUMED_WRITE_BYTES_PER_S / memory.GIB:.0f} GiB/s")  # fmt: skip
    line = f"preemption.grace_s={grace} vs {need:.1f} s, {source}"
    want = math.ceil(GRACE_MARGIN * need)
    if grace < want:
        print(f"warning: {line}: a preemption may end the job before its checkpoint is written; "
              f"set preemption.grace_s to at least {want} ({GRACE_MARGIN:g} x the save)",
              file=sys.stderr)  # fmt: skip
        return f"{line} (WARNING: grace too short, use {want})"
    return line


def last_checkpoint_save(run_dir: Path, model: str, stage: str) -> tuple[float, str] | None:
    """(longest checkpoint save in seconds, run directory) of the newest run of `model` and
    `stage` under run_dir's parent (run_dir itself first: a resumed run) that measured one."""
    root = run_dir.parent
    siblings = sorted(root.glob(f"*-{model}-{stage}-*"), reverse=True) if root.is_dir() else []
    for run in [run_dir, *(r for r in siblings if r != run_dir)]:
        seconds = [
            float(rec["seconds"])
            for rec in runfiles.read_metrics(run)
            if rec.get("kind") == "timing" and rec.get("event") == "checkpoint"
            and isinstance(rec.get("seconds"), (int, float))
        ]  # fmt: skip
        if seconds:
            return max(seconds), str(run)
    return None


def _planned_save_s(plan: Any) -> float | None:
    """Seconds to write one node's share of the weights and optimizer state (memory planner)."""
    settings = dict(plan.memory.get("settings") or {}) if hasattr(plan, "memory") else {}
    if not settings or "mesh" in settings:
        return None
    try:
        est = memory.estimate(batch=1, **settings)
    except (TypeError, ValueError):
        return None
    per_node = (est.weights + est.optimizer + est.buffers) * plan.spec.tasks_per_node
    return per_node / ASSUMED_WRITE_BYTES_PER_S
