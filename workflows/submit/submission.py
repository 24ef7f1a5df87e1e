"""A planned job onto disk and into sbatch (the checks before it are
workflows/planning/preflight.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import write_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.plan import JobPlan
from vitpod.workflows.submit import slurm
from vitpod.workflows.submit.rundir import create_run_dir, remove_run_dir, write_atomic, write_json


class SbatchUnanswered(ConfigError):
    """sbatch timed out: the controller may have queued the job without our hearing back."""


def sbatch(script: Path, extra: Sequence[str] = ()) -> str:
    """`sbatch --parsable [EXTRA] SCRIPT` from the script's directory; returns the job id.
    `extra`: options that override the script's #SBATCH lines (the doctor's --exclude)."""
    try:
        return slurm.sbatch(script, extra)
    except slurm.SlurmUnanswered as exc:
        name = _job_name(script)
        raise SbatchUnanswered(
            f"{exc}: the job may be queued anyway; check with `squeue --me --name {name}` (or "
            f"`sacct --name {name}`) before submitting again; {script.parent} is kept"
        ) from None


def _job_name(script: Path) -> str:
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH --job-name="):
            return line.split("=", 1)[1].strip()
    return script.parent.name


def sbatch_run(script: Path, extra: Sequence[str] = ()) -> str:
    """sbatch a run directory's script; only a clear rejection removes the run directory (after
    a timeout the job may be queued and will write there)."""
    try:
        return sbatch(script, extra)
    except SbatchUnanswered:
        raise
    except ConfigError:
        remove_run_dir(script.parent)
        raise


def materialize(plan: JobPlan, manifest: dict[str, Any] | None = None) -> Path:
    """Create the run dir and write the script, bind.sh and manifest; nothing left on failure."""
    run_dir = plan.run_dir
    create_run_dir(run_dir)
    try:
        write_atomic(plan.script_path, plan.script, mode=0o750)
        if plan.profile.scheduler == "slurm":
            plan.launch.write_bind_script()
        if plan.decision is not None:
            write_decision(run_dir, plan.decision)
        write_json(run_dir / runfiles.MANIFEST, manifest or plan.manifest())
    except BaseException:
        remove_run_dir(run_dir)
        raise
    return plan.script_path
