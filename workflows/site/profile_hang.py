"""A profile's `hang:` block: when a rank that makes no progress counts as hung, how often the
job restarts its ranks in place, and when a slow rank counts as a straggler
(docs/hangs.md)."""

from __future__ import annotations

from pydantic import Field

from vitpod.workflows.site.schema import Strict

SECTIONS = ("startup", "step", "checkpoint", "eval")
"""What a rank can be doing; each has its own timeout."""


class Hang(Strict):
    """A section's timeout is 2 x its measured time (this run's, else the last run's of the same
    model, image size and batch) + `floor_s`, at most its ceiling; the ceiling alone while
    nothing is measured."""

    enabled: bool = Field(default=True, description="watch the ranks' heartbeats (job.sbatch)")
    floor_s: float = Field(
        default=300, ge=1, le=86400,
        description="seconds added to 2 x the measured time of a section (minutes on a cluster)",
    )  # fmt: skip
    startup_s: float = Field(
        default=1800, ge=1, description="ceiling of start-up: process start to the first step"
    )
    step_s: float = Field(default=1800, ge=1, description="ceiling of one optimizer step")
    checkpoint_s: float = Field(default=1800, ge=1, description="ceiling of one checkpoint save")
    eval_s: float = Field(default=3600, ge=1, description="ceiling of one evaluation")
    max_restarts: int = Field(
        default=2, ge=0, le=100,
        description="in-job restarts of the ranks after a hang, then the job requeues",
    )  # fmt: skip
    straggler_ratio: float = Field(
        default=1.3, gt=1,
        description="a rank whose own step time (step minus communication wait) stays this many "
        "times the ranks' median over the last `straggler_steps` steps is a straggler",
    )  # fmt: skip
    straggler_min_s: float = Field(
        default=0.05, ge=0,
        description="and stays at least this many seconds above the median: on steps of tens of "
        "ms a rank with extra host work (rank 0) reads 1.5-1.8 x by a few ms, no straggler",
    )  # fmt: skip
    straggler_steps: int = Field(default=20, ge=3, le=10000)

    def ceiling(self, section: str) -> float:
        return float(getattr(self, f"{section}_s"))
