"""What Slurm says about a partition (sinfo, scontrol), for the preflight's cluster checks."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from vitpod.workflows.quantities import slurm_minutes


@dataclass(frozen=True)
class PartitionInfo:
    """What Slurm says about one partition."""

    name: str
    total_nodes: int
    max_nodes: int | None
    max_minutes: int | None
    gpus_per_node: int


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def cluster_partitions() -> set[str] | None:
    """Partition names from sinfo, or None when sinfo cannot tell."""
    out = _run(["sinfo", "-h", "-o", "%R"])
    return set(out.split()) if out is not None else None


def partition_info(name: str) -> PartitionInfo | None:
    """scontrol's view of a partition (None: no such partition, or Slurm did not answer)."""
    out = _run(["scontrol", "show", "partition", name, "--oneliner"])
    if not out or "PartitionName=" not in out:
        return None
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    gres = _run(["sinfo", "-h", "-p", name, "-N", "-o", "%G"]) or ""
    gpus = [_gres_gpus(g) for g in gres.split()]
    return PartitionInfo(
        name=name,
        total_nodes=int(fields.get("TotalNodes", "0")),
        max_nodes=None
        if fields.get("MaxNodes") in (None, "UNLIMITED")
        else int(fields["MaxNodes"]),
        max_minutes=None
        if fields.get("MaxTime") in (None, "UNLIMITED")
        else slurm_minutes(fields["MaxTime"]),
        gpus_per_node=min(gpus) if gpus else 0,
    )


def _gres_gpus(gres: str) -> int:
    """'gpu:2', 'gpu:a100:8(S:0-1)', 'gpu:8,shard:0' -> GPUs a node; '(null)' -> 0."""
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            return int(parts[-1])
    return 0
