"""Strong/weak scaling sweeps: one Slurm job array, one short timed run per point, one study dir."""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.registry.decision import write_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning import preflight, sbatchopts
from vitpod.workflows.planning.flags import request_flags
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.quantities import count, whole_number
from vitpod.workflows.planning.recipe import Recipe, load_recipe
from vitpod.workflows.planning.spec import JobSpec, launch_for
from vitpod.workflows.planning.templating import render
from vitpod.workflows.site.profile import Profile, load_profile
from vitpod.workflows.studies import reportjob
from vitpod.workflows.studies.study import (
    SCRIPT_NAME,
    STAGE,
    SweepPoint,
    record_states,
    report,
    study_record,
)
from vitpod.workflows.submit import jobstate, submission
from vitpod.workflows.submit.rundir import (
    check_path_safe,
    create_run_dir,
    new_run_path,
    remove_run_dir,
    runs_root,
    write_atomic,
    write_json,
)
from vitpod.workflows.submit.submission import record_checksums
from vitpod.workflows.watching import follow

MODES = ("strong", "weak")
TEMPLATE = "sweep.sh.j2"  # the array body; the #SBATCH header is partials/header.sh.j2


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vitpod.workflows scaling", description=__doc__,
        parents=[request_flags("cluster", "model", "args", "run-root", "timeout",
                               cluster="a Slurm profile name or YAML path",
                               run_root="parent of studies/ (or $VITPOD_RUN_ROOT)",
                               timeout="seconds to wait (with --wait)")],
    )  # fmt: skip
    p.add_argument("--mode", default="strong", help="strong | weak")
    p.add_argument("--gpus", default="1 2 4", help='GPU counts, e.g. "1 2 4 8"')
    p.add_argument("--batch", default="", help="strong: global batch; weak: batch per GPU")
    p.add_argument("--accum", default="1", help="gradient accumulation steps")
    p.add_argument("--steps", default="30", help="optimizer steps per point")
    p.add_argument("--warmup", default="10", help="first steps left out of the timing")
    p.add_argument("--study-dir", default="", help="new directory for the study")
    p.add_argument("--concurrent", default="1", help="array tasks running at once (%%N)")
    p.add_argument("--render-only", action="store_true", help="write the study, do not submit")
    p.add_argument(
        "--offline",
        action="store_true",
        help="write the study asking Slurm nothing (make OFFLINE=1; implies --render-only)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="preflight every point, print the array script; write nothing",
    )
    p.add_argument("--wait", action="store_true", help="wait for the array, then the report")
    p.add_argument("--follow", action="store_true", help="live view until the report exists")
    p.add_argument("--interval", type=float, default=None, help="seconds between --follow polls")
    sbatchopts.add_flags(p)
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
    recipe = load_recipe(profile.model_for(ns.model))
    stage = recipe.stage(STAGE)
    gpus = parse_gpus(ns.gpus)
    accum = whole_number(ns.accum, "ACCUM", 1)
    steps = whole_number(ns.steps, "--steps", 30)
    warmup = count(ns.warmup, "--warmup")
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
                run_dir=run_dir, time=ns.time, slurm=sbatchopts.from_namespace(ns),
                offline=ns.offline,
            )
        )  # fmt: skip
        plans.append(plan)
        assert plan.decision is not None  # sweep points run the trainer
        # bind.sh leaves its requeue marker where the array script's teardown (rendered from the
        # study's spec) looks for it: the study's logs/.
        launch = launch_for(dataclasses.replace(plan.spec, log_dir=str(study_dir / runfiles.LOGS)))
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
            nodes=max(p.nodes for p in points), args=ns.args, run_dir=study_dir, time=ns.time,
            slurm=sbatchopts.from_namespace(ns), offline=ns.offline,
        )
    )  # fmt: skip
    head_spec = head.spec
    concurrent = whole_number(ns.concurrent, "--concurrent", 1)
    script = render_script(head_spec, points, ns.mode, concurrent)
    study = study_record(ns.mode, ns.cluster, ns.args, profile, recipe, points, batch, accum,
                         steps, warmup)  # fmt: skip
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
    context = {"spec": spec, "launch": launch_for(spec), "points": points, "mode": mode}
    return "\n".join(lines) + "\n" + render(TEMPLATE, context)


def materialize(sweep: Sweep) -> Path:
    """Create the study dir, each point's run dir and bind.sh, the script and study.json."""
    create_run_dir(sweep.study_dir)
    try:
        written = []
        for point in sweep.points:
            create_run_dir(Path(point.run_dir))
            write_decision(point.run_dir, point.decision)
            write_atomic(Path(point.argv[1]), point.bind_script, mode=0o750)
            written += [Path(point.run_dir) / runfiles.PLAN, Path(point.argv[1])]
        script = sweep.study_dir / SCRIPT_NAME
        write_atomic(script, sweep.script, mode=0o750)
        write_json(sweep.study_dir / runfiles.STUDY, sweep.study)
        record_checksums(sweep.study_dir, [script, *written])
    except BaseException:
        remove_run_dir(sweep.study_dir)
        raise
    return script


def submit_report_job(sweep: Sweep, array_job_id: str) -> str | None:
    """Submit the report job (afterany on the array; workflows/studies/reportjob.py); its id, or
    None (with a warning: the sweep itself is submitted) when sbatch refused it."""
    try:
        job_id = reportjob.submit(sweep.spec, sweep.study_dir, array_job_id)
    except ConfigError as exc:
        print(f"warning: no report job ({exc}); when the array is done: make report "
              f"STUDY={shlex.quote(str(sweep.study_dir))}", file=sys.stderr)  # fmt: skip
        return None
    print(f"submitted report job {job_id} (afterany:{array_job_id})")
    return job_id


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    ns.render_only = ns.render_only or ns.offline
    sweep = prepare(ns)
    if not ns.render_only:
        hint = f"python -m vitpod.workflows scaling --cluster {ns.cluster} ... --render-only"
        for plan in sweep.plans:
            preflight.check(plan, render_hint=hint)
    if ns.dry_run:
        print(f"# dry run: would write {sweep.study_dir} and submit this array "
              f"({len(sweep.points)} points) and its report job; "
              "nothing written or submitted")  # fmt: skip
        print(sweep.script, end="" if sweep.script.endswith("\n") else "\n")
        return 0
    script = materialize(sweep)
    print(f"study directory: {sweep.study_dir}")
    if ns.render_only:
        print(script)
        return 0
    job_id = submission.submit(script, sweep.study, record_name=runfiles.STUDY, id_key="job_id",
                               remove_on_refusal=True).job_id  # fmt: skip
    print(f"submitted array job {job_id} ({len(sweep.points)} points)")
    report_job = submit_report_job(sweep, job_id)
    study_arg = shlex.quote(str(sweep.study_dir))
    if ns.follow:
        return follow.follow(sweep.study_dir, interval=ns.interval)
    if not ns.wait:
        print(f"follow it: make status RUN={study_arg} FOLLOW=1")
        print(sweep.study_dir / runfiles.STUDY_REPORT / runfiles.STUDY_REPORT_HTML)
        return 0
    try:
        states = jobstate.wait_array(job_id, len(sweep.points), ns.timeout)
        if report_job:  # it records the states and writes the report; wait for it, not twice
            poller = jobstate.JobStatePoller([report_job])
            jobstate.wait_finished(poller, ns.timeout, poll_s=2)
    except (TimeoutError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    html = sweep.study_dir / runfiles.STUDY_REPORT / runfiles.STUDY_REPORT_HTML
    study = record_states(sweep.study_dir, states)
    rc = 0 if report_job and html.is_file() else report(sweep.study_dir)
    failed = [p["gpus"] for p in study["points"] if p["state"] not in (None, "COMPLETED")]
    if failed:
        print(f"error: the points with {failed} GPUs did not complete; see the report and "
              f"{sweep.study_dir / runfiles.LOGS}", file=sys.stderr)  # fmt: skip
        return 1
    return rc
