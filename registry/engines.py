"""The gradient engines and the one rule that names a run's engine from its parallel settings.

The planner and the trainer both name the engine through `claimed` (TrainConfig.engine is its
first), so the order in which --deepspeed, --tp/--pp, --fsdp and the ring-or-ps choice win is
written once; plan.json records the result and the trainer builds the engine by that name.
"""

from __future__ import annotations

from typing import Literal

EngineName = Literal["ring", "ps", "deepspeed", "fsdp", "mesh"]
ENGINES: tuple[EngineName, ...] = ("ring", "ps", "deepspeed", "fsdp", "mesh")
DDP_ENGINES: tuple[EngineName, ...] = ("ring", "ps")
"""Engines whose gradient path the cost model chooses between (DDP communication hooks)."""
MESH_ENGINES: tuple[EngineName, ...] = ("fsdp", "mesh")
"""Engines that run on a torch DeviceMesh (FSDP2, tensor and pipeline parallelism)."""


def claimed(*, exchange: str, deepspeed: bool, fsdp: bool, tp: int, pp: int) -> list[EngineName]:
    """Every engine these settings ask for, in the order they win: --deepspeed, then tensor or
    pipeline stages (the mesh engine, FSDP2 over its dp ranks with --fsdp), then --fsdp alone,
    then --exchange ring|ps (auto: none, the planner's cost model chooses). More than one (but
    mesh with fsdp) is a conflict the checks refuse."""
    rules: list[tuple[EngineName, bool]] = [
        ("deepspeed", deepspeed),
        ("mesh", tp > 1 or pp > 1),
        ("fsdp", fsdp and tp * pp == 1),
        ("ring", exchange == "ring"),
        ("ps", exchange == "ps"),
    ]
    return [name for name, asked in rules if asked]
