"""The gradient engines and the one rule that names a run's engine from its parallel settings.

The planner, the trainer and the readers of plan.json all go through `engine_for`, so the order
in which --deepspeed, --tp/--pp, --fsdp and the ring-or-ps choice win is written once.
"""

from __future__ import annotations

from typing import Literal

EngineName = Literal["ring", "ps", "deepspeed", "fsdp", "mesh"]
ENGINES: tuple[EngineName, ...] = ("ring", "ps", "deepspeed", "fsdp", "mesh")
DDP_ENGINES: tuple[EngineName, ...] = ("ring", "ps")
"""Engines whose gradient path the cost model chooses between (DDP communication hooks)."""
MESH_ENGINES: tuple[EngineName, ...] = ("fsdp", "mesh")
"""Engines that run on a torch DeviceMesh (FSDP2, tensor and pipeline parallelism)."""
CHOOSE = "auto"
"""The gradient exchange left to the planner's cost model (ring or parameter server)."""


def claimed(*, exchange: str, deepspeed: bool, fsdp: bool, tp: int, pp: int) -> list[EngineName]:
    """Every engine these settings ask for, in the order they win: --deepspeed, then tensor or
    pipeline stages (the mesh engine, FSDP2 over its dp ranks with --fsdp), then --fsdp alone,
    then --topology ring|ps. More than one (but mesh with fsdp) is a conflict the checks refuse."""
    rules: list[tuple[EngineName, bool]] = [
        ("deepspeed", deepspeed),
        ("mesh", tp > 1 or pp > 1),
        ("fsdp", fsdp and tp * pp == 1),
        ("ring", exchange == "ring"),
        ("ps", exchange == "ps"),
    ]
    return [name for name, asked in rules if asked]


def engine_for(
    *, exchange: str, deepspeed: bool, fsdp: bool, tp: int, pp: int
) -> EngineName | None:
    """The engine these settings name, first rule winning; None: ring-or-ps is left to the
    planner (`exchange` auto)."""
    names = claimed(exchange=exchange, deepspeed=deepspeed, fsdp=fsdp, tp=tp, pp=pp)
    return names[0] if names else None
