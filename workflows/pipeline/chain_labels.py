"""A Chain's token labels: reuse a stage's labels when they fit, else plan the labeling job that
makes them (queued before the pretrain)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from vitpod.registry import labelset
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.pipeline import labels
from vitpod.workflows.planning import preflight
from vitpod.workflows.planning.plan import JobPlan


def plan_labels(chain: Any, plan: JobPlan, directory: Path) -> bool:
    """Token labels for a stage: reuse them when they pass the checks against the data set
    and the stage's grid; plan a labeling job when none exist and a teacher is given.
    Returns whether labels are pending (made by a job queued before the pretrain)."""
    found = preflight.token_label_problems(plan)
    label_dir = (plan.trainer or {}).get("token_label_data")
    mismatch = (
        label_dir
        and chain.teacher
        and labels.teacher_problem(label_dir, chain.teacher, chain.teacher_checkpoint)
    )  # labels of another teacher are never reused
    if mismatch:
        raise ConfigError(mismatch)
    if not found or not label_dir or not chain.teacher:
        return False  # fine as is, or preflight.check refuses with the command to run
    if labelset.read_manifest(label_dir) is not None:
        return False  # labels exist but do not fit: never overwrite them; preflight refuses
    for other, job in chain.label_jobs.items():
        if job.label_dir == Path(label_dir).absolute():
            raise ConfigError(
                f"{other} and {plan.spec.stage} both read token labels from {label_dir}, "
                f"but labels are made per grid (img_size/16); give the {plan.spec.stage} "
                f"stage its own --token-label-data"
            )
    stage = plan.spec.stage
    chain.label_jobs[stage] = labels.prepare(
        chain.cluster, plan.spec.model, stage, teacher=chain.teacher,
        teacher_checkpoint=chain.teacher_checkpoint, shards=chain.label_shards,
        nodes=None, run_dir=directory / f"labels-{stage}", slurm=plan.request.slurm,
        args=shlex.join(["--label-dir", str(label_dir),
                         "--img-size", str((plan.trainer or {})["img_size"])]),
    )  # fmt: skip
    return True


def cancel_labels(job_ids: list[str]) -> str | None:
    """Cancel the labeling arrays; None when done (or none), else what scancel said."""
    try:
        slurm.scancel(job_ids)
    except slurm.SlurmError as exc:
        print(f"warning: labeling jobs left queued: {exc}", file=sys.stderr)
        return str(exc)
    return None
