"""The ranks' progress timeouts recorded in plan.json (`hang`): per section, 2 x the seconds the
newest matching run measured + the profile's floor, at most the profile's ceiling
(docs/hangs.md). The ranks refine `measured_s` with their own run's times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import HangTimeouts
from vitpod.trainer.config import TrainConfig
from vitpod.trainer.telemetry.heartbeat import timeout
from vitpod.workflows.planning import runmeasure
from vitpod.workflows.site.profile_hang import SECTIONS, Hang

SAME_PLAN = (
    "compile",
    "deepspeed",
    "zero_stage",
    "fsdp",
    "tp",
    "pp",
    "loader",
    "amp",
    "grad_checkpointing",
    "accum_steps",
)
"""Besides model, image size and per-rank batch, what a measured run must share with this one:
each can change a section's time by more than the floor (a cold torch.compile in the start-up and
the first evaluation, a DeepSpeed engine's start, another loader)."""


def decide(hang: Hang, cfg: TrainConfig, run_dir: Path) -> HangTimeouts | None:
    if not hang.enabled:
        return None
    matching = runmeasure.matching_runs(run_dir, cfg.model, cfg.img_size, cfg.batch_size)
    runs = [run for run, config in runmeasure.configs(run_dir) if run in matching
            and all(config.get(k) == getattr(cfg, k, None) for k in SAME_PLAN)]  # fmt: skip
    measured: dict[str, float | None] = dict.fromkeys(SECTIONS)
    sources = dict.fromkeys(SECTIONS, "not measured: the profile's ceiling")
    step = runmeasure.step_time(runs)
    if step is not None:
        measured["step"], sources["step"] = step.seconds, step.source("step time")
    for run in runs:  # the newest run that measured each of the others
        found = longest_sections(_rank0(run))
        for section, seconds in found.items():
            if measured[section] is None:
                measured[section] = seconds
                sources[section] = f"longest {section} in {run}"
    return HangTimeouts(
        floor_s=hang.floor_s, measured_s=measured, sources=sources,
        ceilings_s={s: hang.ceiling(s) for s in SECTIONS},
        timeouts_s={s: timeout(hang.floor_s, hang.ceiling(s), measured[s]) for s in SECTIONS},
        max_restarts=hang.max_restarts, straggler_ratio=hang.straggler_ratio,
        straggler_steps=hang.straggler_steps, straggler_min_s=hang.straggler_min_s,
    )  # fmt: skip


def longest_sections(records: list[dict[str, Any]]) -> dict[str, float]:
    """The longest start-up (process start to the first step's end), save and evaluation in
    rank 0's records."""
    out: dict[str, float] = {}
    started: float | None = None
    for rec in records:
        if rec.get("kind") == "timing" and rec.get("event") == "start":
            started = rec.get("process_start")
        elif rec.get("kind") == "timing" and rec.get("event") in ("checkpoint", "eval"):
            name = rec["event"]
            out[name] = max(out.get(name, 0.0), float(rec.get("seconds") or 0.0))
        elif rec.get("kind") == "step" and started is not None and "wall_time" in rec:
            out["startup"] = max(out.get("startup", 0.0), float(rec["wall_time"]) - started)
            started = None
    return out


def _rank0(run: Path) -> list[dict[str, Any]]:
    try:
        return runfiles.read_metrics(run, 0)
    except (runfiles.RunFileError, OSError):
        return []  # a damaged or empty earlier run measures nothing
