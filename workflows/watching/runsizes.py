"""The world size of each stretch of a run (elastic restarts), from its step records."""

from __future__ import annotations

from pathlib import Path

from vitpod.registry import runfiles


def world_sizes(run_dir: Path) -> list[int]:
    """Ranks of each stretch of rank 0's step records, in order (one entry per size change)."""
    sizes: list[int] = []
    for record in runfiles.read_metrics(run_dir, rank=0):
        if record.get("kind") == "step" and "world_size" in record:
            size = int(record["world_size"])
            if not sizes or sizes[-1] != size:
                sizes.append(size)
    return sizes
