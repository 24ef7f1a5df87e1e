"""Submitting from a Slurm login node: the pre-submit check (sbatch, partition) and sbatch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from workflows.errors import ConfigError
from workflows.spec import JobSpec


def check_can_submit(spec: JobSpec) -> None:
    """Raise ConfigError unless this machine can submit `spec`: sbatch is on PATH and, when sinfo
    answers, the stage's partition exists. Called before anything is written or submitted, by
    `make pretrain/finetune` (cli.submit_main) and by the submitit pipeline alike."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "sbatch is not on PATH (this is not a Slurm login node). To only write the script, "
            f"run `make render CLUSTER={spec.profile.name} MODEL={spec.model}` and submit it "
            "from a login node with `sbatch <script>`"
        )
    partitions = cluster_partitions()
    if partitions is not None and spec.partition not in partitions:
        raise ConfigError(
            f"profile {spec.profile.name}: partitions.{spec.stage}.name={spec.partition!r} does "
            f"not exist on this cluster (sinfo lists {sorted(partitions)}); fix the profile"
        )


def cluster_partitions() -> set[str] | None:
    """Partition names from sinfo, or None when sinfo cannot tell."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.split()) if out.returncode == 0 else None


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
