"""The world size of each stretch of a run (elastic restarts), from its step records."""

from __future__ import annotations

import json
from pathlib import Path

from vitpod.registry import runfiles


def world_sizes(run_dir: Path) -> list[int]:
    """Ranks of each stretch of rank 0's step records, in order (one entry per size change)."""
    path = run_dir / runfiles.METRICS / "rank0.jsonl"
    if not path.is_file():
        return []
    sizes: list[int] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        if record.get("kind") == "step" and "world_size" in record:
            size = int(record["world_size"])
            if not sizes or sizes[-1] != size:
                sizes.append(size)
    return sizes
