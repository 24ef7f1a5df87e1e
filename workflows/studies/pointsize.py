"""How large each point of a scaling study is: its time limit from the step-time model that
`make place` uses (workflows/planning/placement.py), and the lines that tell an admin what the
study will hold (each point's allocation, the total node-hours) before it is queued."""

from __future__ import annotations

import datetime as dt
import math

from vitpod.workflows.planning import placement
from vitpod.workflows.planning.plan import JobPlan
from vitpod.workflows.slurm.quantities import slurm_minutes
from vitpod.workflows.studies.study import STAGE, SweepPoint

MARGIN = 1.5
"""A point's time limit is the step-time model's prediction of its run x this..."""
FLOOR_S = 600
"""...and at least this (a slow start on a busy cluster outweighs a short run's prediction)."""


def point_time(plan: JobPlan, given: str = "") -> tuple[str, str, float | None]:
    """A point's time limit, how it was chosen, and the run seconds the step-time model predicts
    (workflows/planning/placement.py, as `make place`): TIME= when given; else the prediction x
    MARGIN, at least FLOOR_S, at most the partition's limit; the limit when nothing measured a
    step yet."""
    placed = placement.predict(plan, dt.datetime.now().astimezone())
    known = placed.step_time_s is not None and placed.steps is not None
    run_s = placed.run_s if known else None
    if given:
        return plan.spec.time, "TIME=", run_s
    limit = plan.profile.partition(STAGE).time
    if run_s is None:
        why = placed.run_source.partition(": ")[2]  # "the time limit T: why"
        return limit, f"the partition's limit; no prediction: {why}", None
    floor_s = max(FLOOR_S, plan.profile.preemption.grace_s + 60)
    seconds = max(floor_s, MARGIN * run_s)
    why = (f"{MARGIN:g} x the predicted {slurm_time(run_s)} ({placed.run_source}; step time: "
           f"{placed.step_time_source})")  # fmt: skip
    if seconds == floor_s:
        why += f", raised to the floor {slurm_time(floor_s)}"
    limit_s = slurm_minutes(limit) * 60
    if limit_s and seconds >= limit_s:
        return limit, why + f", capped at the partition's limit {limit}", run_s
    return slurm_time(seconds), why, run_s


def slurm_time(seconds: float) -> str:
    """Seconds as a Slurm time in whole minutes, rounded up: 0:10:00, 1-02:30:00."""
    days, minutes = divmod(math.ceil(seconds / 60), 1440)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00" if days else f"{hours}:{minutes:02d}:00"


def sizes(points: list[SweepPoint], plans: list[JobPlan], concurrent: int) -> list[str]:
    """One line per point (its allocation and time limit, and why), then the study's total
    node-hours: what an admin reads before the study is queued."""
    lines = []
    for point, plan in zip(points, plans, strict=True):
        spec = plan.spec
        gpus = f", {spec.gpus_per_node} GPU(s)" if spec.gpus_per_node else ""
        exclusive = ", exclusive" if spec.exclusive else ""
        lines.append(f"point {point.gpus} rank(s): {spec.nodes} node(s) x "
                     f"{spec.tasks_per_node} task(s){gpus}{exclusive}, --time={point.time} "
                     f"({point.time_source})")  # fmt: skip
    total = sum(p.node_hours for p in points)
    predicted = [p.nodes * p.predicted_run_s / 3600 for p in points
                 if p.predicted_run_s is not None]  # fmt: skip
    guess = (f"; predicted {sum(predicted):.3g}" if len(predicted) == len(points)
             else "")  # fmt: skip
    order = ("one after another" if concurrent == 1
             else f"{concurrent} at a time")  # fmt: skip
    lines.append(f"study: {len(points)} point job(s) run {order}, {total:.3g} node-hours "
                 f"at most (each point's nodes x its time limit){guess}")  # fmt: skip
    return lines
