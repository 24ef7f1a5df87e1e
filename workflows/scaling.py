"""Strong/weak scaling sweeps: one Slurm job array, one short timed run per point, one study dir."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, write_decision
from vitpod.workflows import follow, jobstate, preflight, reportjob
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.plan import JobPlan, Request, plan_job
from vitpod.workflows.preflight import whole_number
from vitpod.workflows.profile import Profile, load_profile
from vitpod.workflows.recipe import Recipe, load_recipe
from vitpod.workflows.rundir import (
    RUN_ROOT_ENV,
    check_path_safe,
    create_run_dir,
    new_run_path,
    remove_run_dir,
    runs_root,
    write_atomic,
    write_json,
)
from vitpod.workflows.spec import JobSpec, launch_plan
from vitpod.workflows.submission import sbatch_run
from vitpod.workflows.templating import render
from vitpod.workflows.topology import calibration_for

MODES = ("strong", "weak")
STAGE = "pretrain"
SCRIPT_NAME = "sweep.sbatch"
TEMPLATE = "sweep.sh.j2"  # the array body; the #SBATCH header is partials/header.sh.j2


@dataclass(frozen=True)
class SweepPoint:
    """One array task: its ranks, their placement, the per-rank batch and the run it writes."""

    index: int
    gpus: int
    nodes: int
    per_node: int
    batch_size: int
    global_batch: int
    run_dir: str
    argv: tuple[str, ...]
    """srun's command for every rank: bash RUN_DIR/bind.sh python -m vitpod.trainer ..."""
    bind_script: str
    decision: Decision
    """The point's plan.json record."""


@dataclass(frozen=True)
class Sweep:
    """A validated study, rendered in memory; nothing on disk yet."""

    study_dir: Path
    mode: str
    spec: JobSpec
    """The study's own job (its directory, the largest point's allocation): header, checks."""
    profile: Profile
    recipe: Recipe
    points: list[SweepPoint]
    script: str
    study: dict[str, Any]
    plans: list[JobPlan]
    """Each point's plan: what the preflight checks before the array is submitted."""


def parse_gpus(text: str) -> list[int]:
    """'1 2 4' (or '1,2,4') -> [1, 2, 4]; every count a whole number >= 1, no repeats."""
    words = text.replace(",", " ").split()
    if not words:
        raise ConfigError('GPUS is empty; give the GPU counts of the sweep, e.g. GPUS="1 2 4"')
    try:
        counts = [int(w) for w in words]
    except ValueError:
        raise ConfigError(f"GPUS={text!r}: every entry must be a whole number") from None
    if min(counts) < 1 or len(set(counts)) != len(counts):
        raise ConfigError(f"GPUS={text!r}: counts must be >= 1 and distinct")
    return sorted(counts)


def placement(gpus: int, per_node: int, max_nodes: int, profile: str) -> tuple[int, int]:
    """(nodes, ranks per node): fill nodes; a point larger than a node uses whole nodes."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        raise ConfigError(
            f"GPUS: {gpus} does not fill whole nodes of {per_node} ranks (profile {profile}); "
            f"use a multiple of {per_node} above one node"
        )
    nodes = gpus // per_node
    if nodes > max_nodes:
        raise ConfigError(
            f"GPUS: {gpus} needs {nodes} nodes but profile {profile} has nodes={max_nodes}; "
            f"drop the point or use a larger profile"
        )
    return nodes, per_node


def per_rank_batches(mode: str, gpus: list[int], batch: int, accum: int) -> dict[int, int]:
    """Micro-batch per rank of each point. strong: BATCH is the global batch per optimizer
    step, split over ranks x accumulation; weak: BATCH is the micro-batch of every rank."""
    if mode == "weak":
        return dict.fromkeys(gpus, batch)
    bad = [n for n in gpus if batch % (n * accum)]
    if bad:
        raise ConfigError(
            f"BATCH={batch} (global, strong scaling) does not divide over GPUS {bad} x "
            f"ACCUM={accum}; choose a multiple of {math.lcm(*[n * accum for n in gpus])}"
        )
    return {n: batch // (n * accum) for n in gpus}


def sweep_args(batch: int, accum: int, steps: int, warmup: int) -> list[str]:
    """Trainer flags every point adds: its batch, a short timed run, a metrics line a step."""
    return [
        "-b", str(batch), "--accum-steps", str(accum), "--max-steps", str(steps),
        "--warmup-steps-excluded", str(warmup), "--log-interval", "1",
    ]  # fmt: skip


def _count(value: str, name: str) -> int:
    """A whole number >= 0 given on the command line (e.g. --warmup)."""
    try:
        number = int(value or 0)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; write e.g. {name}=5") from None
    if number < 0:
        raise ConfigError(f"{name}={number}: must be 0 or more")
    return number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vitpod.workflows scaling", description=__doc__)
    p.add_argument("--cluster", default="localslurm", help="a Slurm profile name or YAML path")
    p.add_argument("--model", default="volo_tiny", help="recipe name")
    p.add_argument("--mode", default="strong", help="strong | weak")
    p.add_argument("--gpus", default="1 2 4", help='GPU counts, e.g. "1 2 4 8"')
    p.add_argument("--batch", default="", help="strong: global batch; weak: batch per GPU")
    p.add_argument("--accum", default="1", help="gradient accumulation steps")
    p.add_argument("--steps", default="30", help="optimizer steps per point")
    p.add_argument("--warmup", default="10", help="first steps left out of the timing")
    p.add_argument("--args", default="", help="extra trainer flags, shell-quoted")
    p.add_argument("--study-dir", default="", help="new directory for the study")
    p.add_argument("--run-root", default="", help=f"parent of studies/ (or ${RUN_ROOT_ENV})")
    p.add_argument("--concurrent", default="1", help="array tasks running at once (%%N)")
    p.add_argument("--render-only", action="store_true", help="write the study, do not submit")
    p.add_argument("--wait", action="store_true", help="wait for the array, then the report")
    p.add_argument("--timeout", default="", help="seconds to wait (with --wait)")
    p.add_argument("--follow", action="store_true", help="live view until the report exists")
    p.add_argument("--interval", type=float, default=None, help="seconds between --follow polls")
    return p


def _study_dir(ns: argparse.Namespace, profile: Profile, model: str, mode: str) -> Path:
    if ns.study_dir:
        path = Path(ns.study_dir).expanduser().absolute()
    else:
        path = new_run_path(runs_root(profile, ns.run_root) / "studies", model, mode)
    if path.exists():
        raise ConfigError(f"study directory {path} already exists; choose a new --study-dir")
    check_path_safe(path, "study directory", "choose another --study-dir / --run-root")
    return path


def prepare(ns: argparse.Namespace) -> Sweep:
    """Validate everything and render the array script in memory (ConfigError on bad input)."""
    if ns.mode not in MODES:
        raise ConfigError(f"MODE={ns.mode!r}: choose strong or weak")
    profile = load_profile(ns.cluster)
    if profile.scheduler != "slurm":
        raise ConfigError(
            f"CLUSTER={profile.name}: a scaling sweep is a Slurm job array; use a Slurm profile "
            f"(CLUSTER=localslurm for the local test cluster)"
        )
    recipe = load_recipe(ns.model)
    stage = recipe.stage(STAGE)
    gpus = parse_gpus(ns.gpus)
    accum = whole_number(ns.accum, "ACCUM", 1)
    steps = whole_number(ns.steps, "--steps", 30)
    warmup = _count(ns.warmup, "--warmup")
    if not 0 <= warmup < steps:
        raise ConfigError(f"--warmup={warmup}: must be >= 0 and below --steps={steps}")
    per_node = profile.node_type(STAGE).ranks_per_node
    max_nodes = profile.partition(STAGE).node_limit
    layout = {n: placement(n, per_node, max_nodes, profile.name) for n in gpus}
    default = stage.batch_size if ns.mode == "weak" else stage.batch_size * max(gpus) * accum
    batch = whole_number(ns.batch, "BATCH", default)
    batches = per_rank_batches(ns.mode, gpus, batch, accum)
    study_dir = _study_dir(ns, profile, recipe.model, ns.mode)
    points, plans = [], []
    for index, n in enumerate(gpus):
        nodes, ranks = layout[n]
        run_dir = study_dir / f"gpus{n}"
        plan = plan_job(
            Request(
                cluster=ns.cluster, model=recipe.model, stage=STAGE, nodes=nodes, args=ns.args,
                tool_args=tuple(sweep_args(batches[n], accum, steps, warmup)), ranks=n,
                run_dir=run_dir,
            )
        )  # fmt: skip
        plans.append(plan)
        # bind.sh leaves its requeue marker where the array script's teardown (rendered from the
        # study's spec) looks for it: the study's logs/.
        launch = launch_plan(dataclasses.replace(plan.spec, log_dir=str(study_dir / runfiles.LOGS)))
        points.append(
            SweepPoint(
                index=index, gpus=n, nodes=nodes, per_node=ranks, batch_size=batches[n],
                global_batch=batches[n] * accum * n, run_dir=str(run_dir), argv=launch.argv,
                bind_script=launch.bind_script, decision=plan.decision,
            )
        )  # fmt: skip
    head = plan_job(
        Request(
            cluster=ns.cluster, model=recipe.model, stage=STAGE,
            nodes=max(p.nodes for p in points), args=ns.args, run_dir=study_dir,
        )
    )  # fmt: skip
    head_spec = head.spec
    concurrent = whole_number(ns.concurrent, "--concurrent", 1)
    script = render_script(head_spec, points, ns.mode, concurrent)
    study = _study_record(ns, profile, recipe, points, batch, accum, steps, warmup)
    return Sweep(study_dir, ns.mode, head_spec, profile, recipe, points, script, study, plans)


def render_script(
    spec: JobSpec, points: list[SweepPoint], mode: str, concurrent: int | None
) -> str:
    """The readable array script: the usual #SBATCH header plus --array, then the case body."""
    spec = dataclasses.replace(spec, job_name=f"vitpod-scaling-{spec.model}-{mode}")
    header = render("partials/header.sh.j2", {"spec": spec}).rstrip("\n").splitlines()
    array = f"#SBATCH --array=0-{len(points) - 1}" + (f"%{concurrent}" if concurrent else "")
    lines = [header[0], array, *header[1:]]
    lines = [
        line.replace("/sbatch-%j.", "/sweep-%A_%a.") if line.startswith("#SBATCH --") else line
        for line in lines
    ]
    context = {"spec": spec, "plan": launch_plan(spec), "points": points, "mode": mode}
    return "\n".join(lines) + "\n" + render(TEMPLATE, context)


def _study_record(
    ns: argparse.Namespace,
    profile: Profile,
    recipe: Recipe,
    points: list[SweepPoint],
    batch: int,
    accum: int,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """study.json: what analysis needs to read the study (analysis/scaling.py's keys)."""
    return {
        "mode": ns.mode,
        "model": recipe.model,
        "cluster": profile.name,
        "batch": batch,
        "accum": accum,
        "steps": steps,
        "warmup": warmup,
        "args": ns.args or "",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "script": SCRIPT_NAME,
        "job_id": None,
        "fabric": dict(profile.node_type(STAGE).fabric),
        "fabric_source": _fabric_source(points),
        "calibration": _calibration_record(ns.cluster, points),
        "grad_bytes": points[0].decision.costs.grad_bytes if points[0].decision.costs else None,
        "points": [
            {
                "index": p.index,
                "gpus": p.gpus,
                "nodes": p.nodes,
                "run_dir": Path(p.run_dir).name,
                "batch_size": p.batch_size,
                "global_batch": p.global_batch,
                "topology": p.decision.engine.name,
                "algorithm": p.decision.costs.algorithm if p.decision.costs else None,
                "predicted_comm_s": p.decision.costs.predicted_comm_s if p.decision.costs else None,
                "state": None,
            }
            for p in points
        ],
    }


def _fabric_source(points: list[SweepPoint]) -> str:
    """What priced the points' predictions (the planner's decision says it)."""
    costs = points[0].decision.costs
    return costs.priced_by if costs else "profile fabric"


def _calibration_record(cluster: str, points: list[SweepPoint]) -> dict[str, Any] | None:
    """Which stored fit priced the points (None: the profile's fabric numbers)."""
    if _fabric_source(points) == "profile fabric":
        return None
    from vitpod.analysis.calibrate import calibration_path
    from vitpod.workflows.profile import profile_path

    path = calibration_path(profile_path(cluster))
    cal = calibration_for(profile_path(cluster))
    if cal is None:
        return None
    return {
        "path": str(path.resolve()), "date": cal.date, "job_id": cal.job_id,
        "fabric": cal.fabric, "backend": cal.backend, "partition": cal.partition,
    }  # fmt: skip


def materialize(sweep: Sweep) -> Path:
    """Create the study dir, each point's run dir and bind.sh, the script and study.json."""
    create_run_dir(sweep.study_dir)
    try:
        for point in sweep.points:
            create_run_dir(Path(point.run_dir))
            write_decision(point.run_dir, point.decision)
            write_atomic(Path(point.argv[1]), point.bind_script, mode=0o750)
        script = sweep.study_dir / SCRIPT_NAME
        write_atomic(script, sweep.script, mode=0o750)
        write_json(sweep.study_dir / "study.json", sweep.study)
    except BaseException:
        remove_run_dir(sweep.study_dir)
        raise
    return script


def task_ids(job_id: str, points: int) -> list[str]:
    """The array's task ids as Slurm names them: 123_0, 123_1, ..."""
    return [f"{job_id}_{index}" for index in range(points)]


def wait_array(
    job_id: str, points: int, timeout: float | None, poll_s: float = 3.0
) -> dict[int, str]:
    """Wait (one batched squeue a poll, sacct only when squeue forgot a task) until every task has
    ended; returns each task's final state, none for a task whose end nobody recorded."""
    poller = jobstate.JobStatePoller(task_ids(job_id, points))
    try:
        infos = jobstate.wait_finished(poller, timeout=timeout, poll_s=poll_s)
    except TimeoutError:
        subprocess.run(["scancel", job_id], check=False, capture_output=True)
        raise TimeoutError(f"array {job_id} not done after {timeout} s; cancelled it") from None
    return {
        int(info.job_id.rpartition("_")[2]): info.state
        for info in infos.values()
        if info.state != jobstate.GONE
    }


def record_states(study_dir: Path, states: dict[int, str]) -> dict[str, Any]:
    """Write each point's final Slurm state into study.json (None when nobody recorded it)."""
    path = study_dir / "study.json"
    study = json.loads(path.read_text())
    for point in study["points"]:
        point["state"] = states.get(point["index"])
    write_json(path, study)
    return study


def submit_report_job(sweep: Sweep, array_job_id: str) -> str | None:
    """Submit the report job (afterany on the array; workflows/reportjob.py); its id, or None
    (with a warning: the sweep itself is submitted) when sbatch refused it."""
    try:
        job_id = reportjob.submit(sweep.spec, sweep.study_dir, array_job_id)
    except ConfigError as exc:
        print(f"warning: no report job ({exc}); when the array is done: make report "
              f"STUDY={shlex.quote(str(sweep.study_dir))}", file=sys.stderr)  # fmt: skip
        return None
    path = sweep.study_dir / "study.json"
    write_json(path, {**json.loads(path.read_text()), "report_job_id": job_id})
    print(f"submitted report job {job_id} (afterany:{array_job_id})")
    return job_id


def report(study_dir: Path) -> int:
    """`python -m vitpod.analysis report STUDY_DIR` (a separate process: no matplotlib here)."""
    done = subprocess.run(
        [sys.executable, "-m", "vitpod.analysis", "report", str(study_dir)], check=False
    )
    return done.returncode


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    sweep = prepare(ns)
    if not ns.render_only:
        hint = f"python -m vitpod.workflows scaling --cluster {ns.cluster} ... --render-only"
        for plan in sweep.plans:
            preflight.check(plan, render_hint=hint)
    script = materialize(sweep)
    print(f"study directory: {sweep.study_dir}")
    if ns.render_only:
        print(script)
        return 0
    job_id = sbatch_run(script)  # the script lies in the study directory
    write_json(sweep.study_dir / runfiles.STUDY, {**sweep.study, "job_id": job_id})
    print(f"submitted array job {job_id} ({len(sweep.points)} points)")
    report_job = submit_report_job(sweep, job_id)
    study_arg = shlex.quote(str(sweep.study_dir))
    if ns.follow:
        return follow.follow(sweep.study_dir, interval=ns.interval)
    if not ns.wait:
        print(f"follow it: make status RUN={study_arg} FOLLOW=1")
        print(sweep.study_dir / "report" / "report.html")
        return 0
    try:
        states = wait_array(job_id, len(sweep.points), float(ns.timeout) if ns.timeout else None)
        if report_job:  # it records the states and writes the report; wait for it, not twice
            timeout = float(ns.timeout) if ns.timeout else None
            jobstate.wait_finished(jobstate.JobStatePoller([report_job]), timeout, poll_s=2)
    except (TimeoutError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    html = sweep.study_dir / "report" / "report.html"
    study = record_states(sweep.study_dir, states)
    rc = 0 if report_job and html.is_file() else report(sweep.study_dir)
    failed = [p["gpus"] for p in study["points"] if p["state"] not in (None, "COMPLETED")]
    if failed:
        print(f"error: the points with {failed} GPUs did not complete; see the report and "
              f"{sweep.study_dir / 'logs'}", file=sys.stderr)  # fmt: skip
        return 1
    return rc
