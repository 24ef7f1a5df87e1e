"""Placement by predicted finish (`make place`, `--place`): each candidate the profile allows (the
stage's partition and node type x the node counts of its range) is rendered, Slurm says when it
would start (`sbatch --test-only` on that script, nothing queued), a step-time model says how long
it would run, and the earliest finish wins; with DEADLINE=, the fewest GPU-hours (CPU-hours on
CPU profiles) among those that finish by then. Offline (OFFLINE=1) Slurm is not asked: every
start is unknown (taken as now), so the candidates are ranked by the step model alone, and the
table and plan.json say so. docs/workflows.md#placement."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vitpod.analysis import goodput
from vitpod.registry.decision import PlacedCandidate, Placement
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning import noderange, runmeasure, slurmchecks
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.steptime import planned_steps, step_model
from vitpod.workflows.slurm.quantities import slurm_minutes
from vitpod.workflows.watching import runclean

OFFLINE_RULE = "shortest predicted run (OFFLINE: start times unknown, Slurm not asked)"
STARTUP_S = 60.0
"""Seconds from the job's start to its first step when no earlier run measured them."""
DEADLINE_FORMAT = "an ISO time (2026-11-28T06:00, local unless it has an offset) or a duration " \
    "from now (90m, 6h, 2d)"  # fmt: skip
_START = re.compile(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)")
StartFn = Callable[[JobPlan], dt.datetime]


def parse_deadline(text: str, now: dt.datetime | None = None) -> dt.datetime | None:
    """DEADLINE= as an aware time; '' is None; anything else is refused naming the format."""
    text = text.strip()
    if not text:
        return None
    now = now or dt.datetime.now().astimezone()
    try:
        return now + dt.timedelta(seconds=runclean.parse_age(text))
    except ConfigError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"DEADLINE={text!r}: write {DEADLINE_FORMAT}") from None
    return when if when.tzinfo else when.astimezone()


def slurm_start(plan: JobPlan) -> dt.datetime:
    """When Slurm would start the rendered script now: `sbatch --test-only`'s 'to start at T'
    (the controller's local time), through the preflight's one call of it."""
    said = slurmchecks.ask_test_only(plan.spec, plan.script)
    found = _START.search(said)
    if found is None:
        raise ConfigError(f"sbatch --test-only named no start time ({said}); place the job by "
                          "hand with NODES=")  # fmt: skip
    return dt.datetime.fromisoformat(found[1]).astimezone()


def node_counts(req: Request, base: JobPlan) -> list[int]:
    """NODES when given; else every count of the stage partition's range (`nodes: 1-2`); else
    1 to the nodes the partition has (`max_nodes`, default `nodes`)."""
    part = base.profile.partition(req.stage)
    if req.nodes not in (None, ""):
        return [base.spec.nodes]
    if part.nodes_max:
        return list(range(part.nodes, part.nodes_max + 1))
    return list(range(1, part.node_limit + 1))


def candidate_plans(req: Request, base: JobPlan) -> list[JobPlan]:
    """One plan per node count, all in the base plan's run directory; on a range (`nodes:
    MIN-MAX`) with the global batch the range keeps (the base plan's, at its top count), else
    each count as NODES=n would plan it (the recipe's per-rank batch)."""
    counts = node_counts(req, base)
    if counts == [base.spec.nodes] and not base.spec.nodes_max:
        return [base]
    cfg = base.trainer or {}
    pinned: dict[str, Any] = {}
    if base.spec.nodes_max:
        pinned = noderange.pinned(cfg["batch_size"], cfg["global_batch_size"])
    overrides = {**req.overrides, **pinned}
    return [
        plan_job(dataclasses.replace(req, nodes=n, run_dir=base.run_dir, overrides=overrides))
        for n in counts
    ]


def predict(plan: JobPlan, start: dt.datetime) -> PlacedCandidate:
    """One candidate: start (given), start-up + steps x step time + checkpoint saves, finish,
    and the device-hours it holds (GPUs, else the CPUs Slurm allocates)."""
    spec, cfg = plan.spec, plan.trainer or {}
    model, (steps, steps_src) = step_model(plan), planned_steps(plan)
    limit_s = slurm_minutes(spec.time) * 60.0
    if model.seconds is None or steps is None:
        run_s = limit_s
        why = model.source if model.seconds is None else steps_src
        source = f"the time limit {spec.time}: {why}"
    else:
        runs = runmeasure.matching_runs(plan.run_dir, cfg["model"], cfg["img_size"],
                                        cfg["batch_size"])  # fmt: skip
        startup, startup_src = _startup(runs)
        cost = runmeasure.save_cost(runs)
        save_s = cost.seconds if cost else plan.profile.checkpoint.save_cost_s
        every = cfg.get("checkpoint_every")
        if isinstance(every, int) and every > 0:
            saves = steps // every
        else:  # epoch ends; a run cut short by --max-steps (a sweep point): its last step's
            saves = 1 if cfg.get("max_steps") else int(cfg["epochs"])
        run_s = startup + steps * model.seconds + saves * save_s
        source = (f"{startup:.0f} s start-up ({startup_src}) + {steps} steps ({steps_src}) + "
                  f"{saves} save(s) x {save_s:.3g} s")  # fmt: skip
        if limit_s and run_s > limit_s:
            source += f"; above the time limit {spec.time}: it will be requeued or cut"
    node = plan.profile.node_type(spec.stage)
    devices, kind = (node.gpus_per_node, "GPU") if node.gpus_per_node else (
        spec.tasks_per_node * spec.cpus_per_task, "CPU")  # fmt: skip
    return PlacedCandidate(
        partition=spec.partition, node_type=plan.profile.partition(spec.stage).node_type,
        nodes=spec.nodes, world_size=spec.world_size, start=start.isoformat(),
        step_time_s=model.seconds, step_time_source=model.source, steps=steps, run_s=run_s,
        run_source=source, finish=(start + dt.timedelta(seconds=run_s)).isoformat(),
        device_hours=spec.nodes * devices * run_s / 3600, device_kind=kind,
    )  # fmt: skip


def _startup(runs: list[Path]) -> tuple[float, str]:
    """Seconds from a start to its first step in the newest run that stepped (the goodput
    ledger's start-up and container parts of its first start)."""
    for run in runs:
        ledger = goodput.from_trainer(run)
        if ledger.attempts and ledger.ranks:
            first = (ledger.parts["startup"] + ledger.parts["container"]) / ledger.attempts
            return first, f"measured in {run}"
    return STARTUP_S, "vitpod's default; no run measured one"


def choose(
    found: list[PlacedCandidate], deadline: dt.datetime | None, offline: bool = False
) -> tuple[int, str]:
    """The earliest finish (ties: fewer device-hours); with a deadline, the fewest device-hours
    among those finishing by it (ties: the earlier finish). ConfigError when none does.
    `offline`: every start is now, so the earliest finish is the shortest predicted run."""
    finish = [dt.datetime.fromisoformat(c.finish) for c in found]
    if deadline is None:
        rule = OFFLINE_RULE if offline else "earliest finish"
        return min(range(len(found)), key=lambda i: (finish[i], found[i].device_hours)), rule
    kind = found[0].device_kind
    inside = [i for i in range(len(found)) if finish[i] <= deadline]
    if not inside:
        first = min(range(len(found)), key=finish.__getitem__)
        raise ConfigError(
            f"DEADLINE={deadline.isoformat(timespec='minutes')}: no candidate finishes by then; "
            f"the earliest is {found[first].nodes} node(s) on {found[first].partition}, "
            f"predicted to finish {finish[first].isoformat(timespec='minutes')}; give a later "
            "DEADLINE or leave it out (earliest finish)"
        )
    best = min(inside, key=lambda i: (found[i].device_hours, finish[i]))
    return best, f"fewest {kind}-hours by DEADLINE"


def place(req: Request, deadline: str = "", start_of: StartFn = slurm_start) -> JobPlan:
    """The chosen candidate's plan, its plan.json recording every candidate and the prediction
    (nothing written or submitted). `start_of`: when Slurm would start a plan (tests fake it)."""
    when = parse_deadline(deadline)
    base = plan_job(req)
    if base.profile.scheduler != "slurm":
        raise ConfigError(f"--place: profile {base.profile.name} has no scheduler to ask when a "
                          "job would start; use a Slurm profile (CLUSTER=)")  # fmt: skip
    if base.decision is None:
        raise ConfigError("--place predicts a training run; --entry rankinfo runs no trainer")
    plans = candidate_plans(req, base)
    placed_at = dt.datetime.now().astimezone()
    found = [predict(p, placed_at if req.offline else _start(p, start_of, placed_at))
             for p in plans]  # fmt: skip
    index, rule = choose(found, when, req.offline)
    record = Placement(
        rule=rule, deadline=when.isoformat(timespec="seconds") if when else None, chosen=index,
        candidates=[c.model_copy(update={"within_deadline": None if when is None else
                                         dt.datetime.fromisoformat(c.finish) <= when})
                    for c in found],
        starts_known=not req.offline,
        note="; ".join(dict.fromkeys(step_model(p).note for p in plans)),
    )  # fmt: skip
    chosen = plans[index]
    assert chosen.decision is not None
    return dataclasses.replace(chosen, decision=chosen.decision.model_copy(
        update={"placement": record}))  # fmt: skip


def _start(plan: JobPlan, start_of: StartFn, placed_at: dt.datetime) -> dt.datetime:
    """Slurm's start; where it says "at once", the placement's own time: the candidates are
    asked one after another, and a later "now" must not count against the later ones. Slurm's
    "now" falls while it is asked, so it is compared with the moment its answer came."""
    start = start_of(plan)
    answered = dt.datetime.now().astimezone()
    return placed_at if start <= answered + dt.timedelta(seconds=1) else start


def table(record: Placement) -> Any:
    """The candidates as a rich Table, the chosen one marked."""
    from rich.table import Table

    kind = record.candidates[0].device_kind
    out = Table(title=f"placement: {record.rule}"
                + (f" {record.deadline}" if record.deadline else ""),
                caption=f"step s: {record.note}" if record.note else None)  # fmt: skip
    for name in ("", "partition", "node type", "nodes", "start", "step s", "run", "finish",
                 f"{kind}-h"):  # fmt: skip
        out.add_column(name, justify="left" if name in ("partition", "node type") else "right")
    for i, c in enumerate(record.candidates):
        late = c.within_deadline is False
        out.add_row(
            "*" if i == record.chosen else ("late" if late else ""), c.partition, c.node_type,
            str(c.nodes), _clock(c.start) if record.starts_known else "?",
            "?" if c.step_time_s is None else f"{c.step_time_s:.3g}", _span(c.run_s),
            _clock(c.finish) if record.starts_known else "?", f"{c.device_hours:.3g}",
        )  # fmt: skip
    return out


def print_placement(record: Placement) -> None:
    """The table, then one line on how the chosen prediction was made."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 120).print(table(record))
    chosen = record.prediction
    when = (f"predicted start {_clock(chosen.start)}, finish {_clock(chosen.finish)}"
            if record.starts_known else "start and finish unknown (offline: Slurm not asked; "
            "ranked by the step model alone)")  # fmt: skip
    print(f"placed: {chosen.nodes} node(s) on {chosen.partition}, {when}; run time: "
          f"{chosen.run_source}; step time: {chosen.step_time_source}")  # fmt: skip


def _clock(stamp: str) -> str:
    return dt.datetime.fromisoformat(stamp).strftime("%m-%d %H:%M:%S")


def _span(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def check_request(place: bool, deadline: str) -> None:
    """Chain(place=, deadline=) refused before anything is planned."""
    if deadline.strip() and not place:
        raise ConfigError(f"deadline={deadline!r} chooses among placement candidates; pass "
                          "place=True (PLACE=1) or drop it")  # fmt: skip
    parse_deadline(deadline)


def plan_stage(req: Request, placed: bool, deadline: str = "") -> JobPlan:
    """A chain's stage: placed (node count by predicted finish) when `placed`, the first stage
    only (a later one waits for it, so Slurm has no start to tell, and keeps its own count)."""
    if not placed:
        return plan_job(req)
    plan = place(req, deadline)
    assert plan.decision is not None and plan.decision.placement is not None
    print_placement(plan.decision.placement)
    return plan
