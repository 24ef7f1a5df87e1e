"""Stragglers: ranks whose own step time stays above the ranks' median (docs/hangs.md), from the
metrics every rank writes; for `make status`, the follow view and a study's report."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles

HEARTBEATS = "heartbeats"  # the ranks' heartbeat files (trainer/telemetry/heartbeat.py)
DEFAULT_RATIO, DEFAULT_STEPS, DEFAULT_MIN_S = 1.3, 20, 0.05  # hang: defaults (profile_hang.py)
MIN_STEPS = 5


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    ratio: float
    own_s: float
    median_s: float
    steps: int  # the rank's steps the medians are over

    def line(self) -> str:
        return (f"straggler: rank {self.rank} on {self.node}: own step time {self.ratio:.2f} x "
                f"the ranks' median ({self.own_s:.3f} s vs {self.median_s:.3f} s, median of "
                f"the last {self.steps} steps)")  # fmt: skip


def thresholds(run_dir: Path) -> tuple[float, int, float]:
    """(ratio, steps, min_s) from plan.json's `hang` (the profile's), else the defaults."""
    try:
        hang = json.loads((Path(run_dir) / runfiles.PLAN).read_text()).get("hang") or {}
        min_s = float(hang.get("straggler_min_s", DEFAULT_MIN_S))  # absent before it existed
        return float(hang["straggler_ratio"]), int(hang["straggler_steps"]), min_s
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return DEFAULT_RATIO, DEFAULT_STEPS, DEFAULT_MIN_S


def own_step_s(record: dict[str, Any]) -> float | None:
    """A step's time on this rank less its waits for the others (the gradient exchange, DDP's
    buffer broadcast, the step boundary): a rank that waits for a slow one spends the
    difference there, the slow one does not."""
    times = record.get("time") or {}
    step = times.get("step")
    if not isinstance(step, int | float) or step <= 0:
        return None
    return max(0.0, float(step) - float(times.get("comm") or 0.0) - float(times.get("sync") or 0.0))


def stragglers(run_dir: Path, ratio: float | None = None, steps: int | None = None
               ) -> list[Straggler]:  # fmt: skip
    """Ranks whose median own step time over their last `steps` steps is above `ratio` x the
    median over the ranks (the lower median: with 2 ranks, the faster one) and at least the
    profile's `straggler_min_s` above it (a few ms on a tiny step are no straggler)."""
    want_ratio, want_steps, min_s = thresholds(run_dir)
    ratio, steps = ratio or want_ratio, steps or want_steps
    per_rank: dict[int, tuple[float, int]] = {}
    for path in runfiles.metrics_files(run_dir):
        try:
            records = runfiles.read_jsonl(path)
        except (OSError, ValueError):
            continue
        own = [s for r in records if r.get("kind") == "step" and not r.get("warmup")
               and (s := own_step_s(r)) is not None]  # fmt: skip
        # A run shorter than the window is judged on what it has, from MIN_STEPS on.
        if len(own) >= min(steps, MIN_STEPS) and path.stem.removeprefix("rank").isdigit():
            kept = own[-steps:]
            per_rank[int(path.stem.removeprefix("rank"))] = (statistics.median(kept), len(kept))
    if len(per_rank) < 2:
        return []
    median = statistics.median_low(own for own, _ in per_rank.values())
    if median <= 0:
        return []
    nodes = rank_nodes(run_dir)
    return [Straggler(rank, nodes.get(rank, "?"), own / median, own, median, n)
            for rank, (own, n) in sorted(per_rank.items())
            if own > ratio * median and own - median >= min_s]  # fmt: skip


def rank_nodes(run_dir: Path) -> dict[int, str]:
    """Each rank's Slurm node, from its newest heartbeat."""
    out = {}
    for path in (Path(run_dir) / HEARTBEATS).glob("rank*"):
        fields = path.read_text(errors="replace").split() if path.is_file() else []
        if len(fields) >= 2 and fields[0].isdigit():
            out[int(fields[0])] = fields[1]
    return out
