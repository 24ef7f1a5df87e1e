"""A planned job onto disk and into sbatch (the checks before it are workflows/preflight.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import write_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.plan import JobPlan
from vitpod.workflows.rundir import create_run_dir, remove_run_dir, write_atomic, write_json


def sbatch(script: Path, extra: Sequence[str] = ()) -> str:
    """`sbatch --parsable [EXTRA] SCRIPT` from the script's directory; returns the job id.
    `extra`: options that override the script's #SBATCH lines (the doctor's --exclude)."""
    out = subprocess.run(
        ["sbatch", "--parsable", *extra, str(script)],
        capture_output=True,
        text=True,
        cwd=script.parent,
        timeout=60,
    )
    if out.returncode != 0:
        raise ConfigError(f"sbatch rejected {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def sbatch_run(script: Path, extra: Sequence[str] = ()) -> str:
    """sbatch a run directory's script; if sbatch rejects it, the run directory goes too."""
    try:
        return sbatch(script, extra)
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
