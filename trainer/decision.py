"""The planner's engine decision (plan.json in the run directory) applied to the parsed flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vitpod.registry.decision import DDP_ENGINES, Decision, engine_named_by_flags, find_decision


class DecisionConflict(ValueError):
    """A flag disagrees with the run's plan.json; the message names both and the fix."""


def with_decision(cfg: Any) -> tuple[Any, Decision | None]:
    """`cfg` with the engine of `<output>/plan.json` when the planner wrote one.

    Flags stay for direct use (no plan.json: --topology auto runs ring); a flag that names
    another engine, server count or layout than the record is refused, not silently won."""
    decision = find_decision(Path(cfg.output))
    if decision is None:
        return cfg, None
    conflicts = _conflicts(cfg, decision)
    if conflicts:
        fix = "drop the flag, or plan the run again with it (make render/pretrain ARGS=...)"
        raise DecisionConflict(f"{'; '.join(conflicts)} in {Path(cfg.output) / 'plan.json'}; {fix}")
    engine = decision.engine
    if engine.name not in DDP_ENGINES:
        return cfg, decision
    return dataclasses.replace(cfg, topology=engine.name, ps_servers=engine.ps_servers), decision


def _conflicts(cfg: Any, decision: Decision) -> list[str]:
    engine, layout = decision.engine, decision.layout
    named = engine_named_by_flags(
        topology=cfg.topology, deepspeed=cfg.deepspeed, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp
    )
    out = []
    if named is not None and named != engine.name:
        out.append(f"the flags run engine {named!r} but the planner decided {engine.name!r}")
    if engine.name == "ps" and cfg.ps_servers not in (None, engine.ps_servers):
        out.append(f"--ps-servers {cfg.ps_servers} but the planner decided {engine.ps_servers}")
    if (cfg.tp, cfg.pp) != (layout.tp, layout.pp):
        out.append(
            f"--tp {cfg.tp} --pp {cfg.pp} but the planner's layout is tp {layout.tp} pp {layout.pp}"
        )
    return out
