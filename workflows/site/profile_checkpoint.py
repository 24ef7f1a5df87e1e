"""A profile's `checkpoint:` block: how often the jobs on this cluster checkpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from vitpod.workflows.site.schema import Strict

DEFAULT_SAVE_COST_S = 10.0
"""Seconds one save blocks training, assumed until a run of the model has measured one."""


class Checkpointing(Strict):
    """`every`: the trainer's --checkpoint-every when neither the recipe nor ARGS gives one
    (steps, 0 = epoch ends, or `auto`: the planner's sqrt(2 x save cost x mean time between
    interruptions), docs/preemption-and-resume.md); unset: the trainer's own default."""

    every: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    save_cost_s: float = Field(
        default=DEFAULT_SAVE_COST_S, gt=0,
        description="blocking seconds of one save until a run has measured it (auto only)",
    )  # fmt: skip
