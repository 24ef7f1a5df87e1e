"""--checkpoint-every auto: the interval between checkpoints, sqrt(2 x C x M) (Young 1974, "A first
order approximation to the optimum checkpoint interval", CACM 17(9); Daly 2006, FGCS 22(3)), with
C the seconds one save blocks training and M the mean time between the job's interruptions, in
steps of the measured step time. docs/preemption-and-resume.md#checkpoint-interval."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from pathlib import Path

from vitpod.registry.checkpoint_every import AUTO
from vitpod.registry.decision import CheckpointInterval
from vitpod.trainer.config import TrainConfig
from vitpod.workflows.planning import runmeasure
from vitpod.workflows.planning.interruptions import History, HistoryError, partition_history
from vitpod.workflows.site.profile import Profile

HistoryFn = Callable[[str], History]


def young_daly_s(save_cost_s: float, mtbi_s: float) -> float:
    """The first-order optimum seconds of work between checkpoints: sqrt(2 C M)."""
    return math.sqrt(2.0 * save_cost_s * mtbi_s)


def interval_steps(interval_s: float, step_s: float | None) -> int:
    """The interval in optimizer steps (at least 1); 0 (epoch ends): the step time unknown."""
    if not step_s or step_s <= 0:
        return 0
    return max(1, round(interval_s / step_s))


def decide(
    profile: Profile, partition: str, cfg: TrainConfig, given: Collection[str], run_dir: Path,
    ask_slurm: bool, history: HistoryFn | None = None,
) -> tuple[CheckpointInterval | None, int]:  # fmt: skip
    """The record (None: a number was given) and the --checkpoint-every the ranks run: the
    recipe's or ARGS's (`given` names it) wins, else the profile's checkpoint.every, else the
    trainer's default; `auto` is resolved here (never by the ranks)."""
    every = cfg.checkpoint_every
    if "checkpoint_every" not in given and profile.checkpoint.every is not None:
        every = profile.checkpoint.every
    if every != AUTO:
        return None, int(every)
    record = resolve(profile, partition, cfg, run_dir, ask_slurm, history)
    return record, record.steps


def resolve(
    profile: Profile, partition: str, cfg: TrainConfig, run_dir: Path, ask_slurm: bool,
    history: HistoryFn | None = None,
) -> CheckpointInterval:  # fmt: skip
    runs = runmeasure.matching_runs(run_dir, cfg.model, cfg.img_size, cfg.batch_size)
    what = f"{cfg.model} at {cfg.img_size} px, batch {cfg.batch_size}"
    cost, step = runmeasure.save_cost(runs), runmeasure.step_time(runs)
    if cost is not None:
        save_s, save_src = cost.seconds, cost.source("blocking save")
    else:
        save_s = profile.checkpoint.save_cost_s
        save_src = f"{_profile_value(profile, 'checkpoint', 'save_cost_s')}; no run of {what} " \
            "measured a save"  # fmt: skip
    mtbi_h, mtbi_src, found = mtbi(profile, partition, ask_slurm, history)
    interval = young_daly_s(save_s, mtbi_h * 3600)
    steps = interval_steps(interval, step.seconds if step else None)
    if step is None:
        step_src = f"unknown: no run of {what} measured its steps"
        reason = "step time unknown: checkpoints at epoch ends; plan again once a run has steps"
    else:
        step_src = step.source("step time (warm-up left out)")
        reason = f"{interval:.0f} s / {step.seconds:.3g} s per step"
    return CheckpointInterval(
        save_cost_s=save_s, save_cost_source=save_src, mtbi_hours=mtbi_h, mtbi_source=mtbi_src,
        interruptions=found.interruptions if found else None,
        job_hours=found.job_hours if found else None,
        step_time_s=step.seconds if step else None, step_time_source=step_src,
        interval_s=interval, steps=steps, reason=reason,
    )  # fmt: skip


def mtbi(
    profile: Profile, partition: str, ask_slurm: bool, history: HistoryFn | None = None
) -> tuple[float, str, History | None]:
    """M in hours, where it came from, and the sacct history read (None: not asked or failed):
    the partition's job-hours per interruption, else the profile's preemption.mtbi_hours."""
    fallback = profile.preemption.mtbi_hours
    named = _profile_value(profile, "preemption", "mtbi_hours")
    if not ask_slurm:
        why = "offline: Slurm not asked" if profile.scheduler == "slurm" else "no Slurm"
        return fallback, f"{named}; {why}", None
    try:
        found = (history or partition_history)(partition)
    except HistoryError as exc:
        return fallback, f"{named}; {exc}", None
    if found.mtbi_hours is None:
        return fallback, f"{named}; {found.source()}: none to divide by", found
    return found.mtbi_hours, found.source(), found


def _profile_value(profile: Profile, block: str, key: str) -> str:
    """'profile P's preemption.mtbi_hours' (', default' when the profile does not set it)."""
    given = key in getattr(profile, block).model_fields_set
    return f"profile {profile.name}'s {block}.{key}{'' if given else ' (default)'}"
