"""Submitting a job: the pre-submit checks (shared paths, sbatch, partition) and sbatch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from workflows.container import check_container_paths
from workflows.errors import ConfigError
from workflows.spec import JobSpec


def check_can_submit(spec: JobSpec, render_hint: str | None = None) -> None:
    """Raise ConfigError unless `spec` can be submitted (Slurm) or run (local) from here: its
    shared data and code paths exist and, for Slurm, sbatch is on PATH and, when sinfo answers,
    the stage's partition exists. Called before anything is written or submitted by
    `make pretrain/finetune` (cli.submit_main), the submitit pipeline and `make scaling`.
    `render_hint` is the command that only writes the script (default: `make render ...`)."""
    if spec.profile.scheduler == "slurm" and shutil.which("sbatch") is None:
        hint = render_hint or f"make render CLUSTER={spec.profile.name} MODEL={spec.model}"
        raise ConfigError(
            "sbatch is not on PATH (this is not a Slurm login node). To only write the script, "
            f"run `{hint}` and submit it from a login node with `sbatch <script>`"
        )
    check_shared_paths(spec)
    check_container_paths(spec.profile)  # what pyxis would find wrong only on the node
    if spec.profile.scheduler != "slurm":
        return
    partitions = cluster_partitions()
    if partitions is not None and spec.partition not in partitions:
        raise ConfigError(
            f"profile {spec.profile.name}: partitions.{spec.stage}.name={spec.partition!r} does "
            f"not exist on this cluster (sinfo lists {sorted(partitions)}); fix the profile"
        )


def check_shared_paths(spec: JobSpec) -> None:
    """The profile's data and code directories must exist before anything is submitted."""
    for field, path in (("storage.data", spec.data_dir), ("storage.code", spec.code_dir)):
        if path is not None and not Path(path).exists():
            raise ConfigError(
                f"profile {spec.profile.name}: {field} path {path!r} does not exist; create it "
                f"on the shared file system (or fix the profile) before submitting"
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
