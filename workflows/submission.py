"""Submitting a rendered script with sbatch (the checks before it are workflows/preflight.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vitpod.workflows.errors import ConfigError
from vitpod.workflows.rundir import remove_run_dir


def sbatch(script: Path) -> str:
    """`sbatch --parsable SCRIPT` from the script's directory; returns the job id."""
    out = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        cwd=script.parent,
        timeout=60,
    )
    if out.returncode != 0:
        raise ConfigError(f"sbatch rejected {script}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]


def sbatch_run(script: Path) -> str:
    """sbatch a run directory's script; if sbatch rejects it, the run directory goes too."""
    try:
        return sbatch(script)
    except ConfigError:
        remove_run_dir(script.parent)
        raise
