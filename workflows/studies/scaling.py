"""Strong/weak scaling sweeps: one Slurm job per point, each sized to the point (its nodes, its
ranks, a time limit from the step-time model), run one after another, then a report job; one
study directory (docs/scaling-and-reports.md)."""

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
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import (
    check_path_safe,
    create_run_dir,
    new_run_path,
    remove_run_dir,
    runs_root,
    write_json,
)
from vitpod.workflows.planning import preflight, sbatchopts
from vitpod.workflows.planning.flags import request_flags
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.recipe import Recipe, load_recipe
from vitpod.workflows.planning.runmeasure import STUDIES
from vitpod.workflows.planning.spec import JobSpec
from vitpod.workflows.site.profile import Profile, load_profile
from vitpod.workflows.slurm.quantities import count, whole_number
from vitpod.workflows.studies import reportjob
from vitpod.workflows.studies.pointsize import point_time, sizes
from vitpod.workflows.studies.study import (
    STAGE,
    SweepPoint,
    point_states,
    record_states,
    report,
    study_record,
)
from vitpod.workflows.submit import submission
from vitpod.workflows.watching import follow

MODES = ("strong", "weak")


@dataclass(frozen=True)
class Sweep:
    """A validated study, planned in memory; nothing on disk yet."""

    study_dir: Path
    mode: str
    profile: Profile
    recipe: Recipe
    points: list[SweepPoint]
    plans: list[JobPlan]
    """Each point's own job (gpusN/job.sbatch), checked by the preflight before any submission."""
    study: dict[str, Any]
    concurrent: int
    """Points running at once: point i starts after point i-concurrent ended (afterany)."""

    @property
    def report_spec(self) -> JobSpec:
        """The report job's base: the points' launch (image, mounts), logs in the study's."""
        return dataclasses.replace(self.plans[0].spec, log_dir=str(self.study_dir / runfiles.LOGS))

    def waits_for(self, index: int, job_ids: list[str]) -> str:
        """The dependency of point `index` on the points submitted before it ('' none)."""
        before = index - self.concurrent
        return f"afterany:{job_ids[before]}" if before >= 0 else ""


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


def placement_of(gpus: int, per_node: int, max_nodes: int, profile: str) -> tuple[int, int]:
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


# The trainer flags every point sets (sweep_overrides), and what sets them instead: in ARGS they
# would be replaced without a word.
STUDY_FLAGS = {
    "-b": "BATCH=", "--batch-size": "BATCH=", "--accum-steps": "ACCUM=",
    "--grad-accum-steps": "ACCUM=", "--max-steps": "STEPS= (--steps)",
    "--warmup-steps-excluded": "--warmup", "--log-interval": "nothing (a point logs every step)",
}  # fmt: skip


def refuse_study_flags(args: str) -> None:
    """ConfigError naming the first ARGS flag a point sets itself, and what to use instead."""
    for token in shlex.split(args):
        name = token.split("=", 1)[0]
        if name in STUDY_FLAGS:
            raise ConfigError(
                f"ARGS: {name} is set by the study for every point; use {STUDY_FLAGS[name]} "
                "instead and drop it from ARGS"
            )


def sweep_overrides(batch: int, accum: int, steps: int, warmup: int) -> dict[str, int]:
    """Trainer settings every point sets: its batch, a short timed run, a metrics line a step."""
    return {
        "batch_size": batch, "accum_steps": accum, "max_steps": steps,
        "warmup_steps_excluded": warmup, "log_interval": 1,
    }  # fmt: skip


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
    p.add_argument("--concurrent", default="1", help="points at once (point i after point i-N)")
    p.add_argument("--render-only", action="store_true", help="write the study, do not submit")
    p.add_argument(
        "--offline",
        action="store_true",
        help="write the study asking Slurm nothing (make OFFLINE=1; implies --render-only)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="preflight every point, print its script; write nothing",
    )
    p.add_argument("--wait", action="store_true", help="wait for the points, then the report")
    p.add_argument("--follow", action="store_true", help="live view until the report exists")
    p.add_argument("--interval", type=float, default=None, help="seconds between --follow polls")
    sbatchopts.add_flags(p)
    return p


def _study_dir(ns: argparse.Namespace, profile: Profile, model: str, mode: str) -> Path:
    if ns.study_dir:
        path = Path(ns.study_dir).expanduser().absolute()
    else:
        path = new_run_path(runs_root(profile, ns.run_root) / STUDIES, model, mode)
    if path.exists():
        raise ConfigError(f"study directory {path} already exists; choose a new --study-dir")
    check_path_safe(path, "study directory", "choose another --study-dir / --run-root")
    return path


def prepare(ns: argparse.Namespace) -> Sweep:
    """Validate everything and plan every point's job in memory (ConfigError on bad input)."""
    if ns.mode not in MODES:
        raise ConfigError(f"MODE={ns.mode!r}: choose strong or weak")
    profile = load_profile(ns.cluster)
    if profile.scheduler != "slurm":
        raise ConfigError(
            f"CLUSTER={profile.name}: a scaling sweep is Slurm jobs; use a Slurm profile "
            f"(CLUSTER=localslurm for the local test cluster)"
        )
    refuse_study_flags(ns.args)
    recipe = load_recipe(profile.model_for(ns.model))
    stage = recipe.stage(STAGE)
    gpus = parse_gpus(ns.gpus)
    accum = whole_number(ns.accum, "ACCUM", 1)
    steps = whole_number(ns.steps, "--steps", 30)
    warmup = count(ns.warmup, "--warmup")
    if not 0 <= warmup < steps:
        raise ConfigError(f"--warmup={warmup}: must be >= 0 and below --steps={steps}")
    concurrent = whole_number(ns.concurrent, "--concurrent", 1)
    per_node = profile.node_type(STAGE).ranks_per_node
    max_nodes = profile.partition(STAGE).node_limit
    layout = {n: placement_of(n, per_node, max_nodes, profile.name) for n in gpus}
    default = stage.batch_size if ns.mode == "weak" else stage.batch_size * max(gpus) * accum
    batch = whole_number(ns.batch, "BATCH", default)
    batches = per_rank_batches(ns.mode, gpus, batch, accum)
    study_dir = _study_dir(ns, profile, recipe.model, ns.mode)
    points, plans = [], []
    for index, n in enumerate(gpus):
        nodes, ranks = layout[n]
        req = Request(
            cluster=ns.cluster, model=recipe.model, stage=STAGE, nodes=nodes, args=ns.args,
            overrides=sweep_overrides(batches[n], accum, steps, warmup), ranks=n,
            run_dir=study_dir / f"gpus{n}", time=ns.time, slurm=sbatchopts.from_namespace(ns),
            offline=ns.offline,
        )  # fmt: skip
        plan = plan_job(req)
        time, why, run_s = point_time(plan, given=ns.time)
        if time != plan.spec.time:
            plan = plan_job(dataclasses.replace(req, time=time))
        plans.append(plan)
        assert plan.decision is not None  # sweep points run the trainer
        points.append(
            SweepPoint(
                index=index, gpus=n, nodes=nodes, per_node=ranks, batch_size=batches[n],
                global_batch=batches[n] * accum * n, run_dir=str(plan.run_dir),
                decision=plan.decision, time=time, time_source=why, predicted_run_s=run_s,
            )
        )  # fmt: skip
    study = study_record(ns.mode, ns.cluster, ns.args, profile, recipe, points, batch, accum,
                         steps, warmup)  # fmt: skip
    return Sweep(study_dir, ns.mode, profile, recipe, points, plans, study, concurrent)


def materialize(sweep: Sweep) -> list[Path]:
    """Create the study dir, each point's run directory (submission.materialize: job.sbatch,
    bind.sh, plan.json, manifest.json, rendered.sha256) and study.json; the points' scripts."""
    create_run_dir(sweep.study_dir)
    try:
        scripts = [
            submission.materialize(plan, plan.manifest(study=str(sweep.study_dir)))
            for plan in sweep.plans
        ]
        write_json(sweep.study_dir / runfiles.STUDY, sweep.study)
    except BaseException:
        remove_run_dir(sweep.study_dir)
        raise
    return scripts


def submit_points(sweep: Sweep, scripts: list[Path]) -> list[str]:
    """Submit every point's kept script through submission.submit, each after the one
    `concurrent` before it (afterany, on sbatch's command line), and record its job id in its
    manifest.json and in study.json. A refusal after the first point cancels those submitted."""
    ids: list[str] = []
    record = sweep.study_dir / runfiles.STUDY
    for point, script in zip(sweep.points, scripts, strict=True):
        manifest = runfiles.read_manifest(script.parent)
        try:
            job = submission.submit(script, manifest, dependency=sweep.waits_for(point.index, ids),
                                    cluster=sweep.profile.cluster or "")  # fmt: skip
        except submission.SbatchUnanswered:
            raise
        except ConfigError as exc:
            if not ids:
                remove_run_dir(sweep.study_dir)
                raise
            outcome = jobstate.cancel_outcome(ids)
            raise ConfigError(f"point {point.gpus}: {exc}; the points submitted before it "
                              f"({','.join(ids)}): {outcome}; {sweep.study_dir} is kept; "
                              "start a new study") from None  # fmt: skip
        ids.append(job.job_id)
        study = runfiles.read_record(record)
        study["points"][point.index]["job_id"] = job.job_id
        write_json(record, study)
    return ids


def submit_report_job(sweep: Sweep, job_ids: list[str]) -> str | None:
    """Submit the report job (afterany on every point; workflows/studies/reportjob.py); its id,
    or None (with a warning: the points themselves are submitted) when sbatch refused it."""
    try:
        job_id = reportjob.submit(sweep.report_spec, sweep.study_dir, job_ids)
    except ConfigError as exc:
        print(f"warning: no report job ({exc}); when the points are done: make report "
              f"STUDY={shlex.quote(str(sweep.study_dir))}", file=sys.stderr)  # fmt: skip
        return None
    print(f"submitted report job {job_id} (afterany:{':'.join(job_ids)})")
    return job_id


def wait_points(job_ids: list[str], timeout: float | None) -> dict[int, str]:
    """Each point's final state (one batched squeue a poll); on timeout the points are
    cancelled and TimeoutError says whether scancel succeeded."""
    try:
        infos = jobstate.wait_finished(jobstate.JobStatePoller(job_ids), timeout, poll_s=3.0)
    except TimeoutError:
        outcome = jobstate.cancel_outcome(job_ids)
        raise TimeoutError(f"points {','.join(job_ids)} not done after {timeout} s; "
                           f"{outcome}") from None  # fmt: skip
    return point_states(job_ids, infos)


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    ns.render_only = ns.render_only or ns.offline
    sweep = prepare(ns)
    if not ns.render_only:
        hint = f"python -m vitpod.workflows scaling --cluster {ns.cluster} ... --render-only"
        for plan in sweep.plans:
            preflight.check(plan, render_hint=hint)
    print("\n".join(sizes(sweep.points, sweep.plans, sweep.concurrent)))
    if ns.dry_run:
        print(f"# dry run: would write {sweep.study_dir} and submit these {len(sweep.points)} "
              "point jobs and the report job; nothing written or submitted")  # fmt: skip
        for plan in sweep.plans:
            print(f"# {plan.script_path}")
            print(plan.script, end="" if plan.script.endswith("\n") else "\n")
        return 0
    scripts = materialize(sweep)
    print(f"study directory: {sweep.study_dir}")
    if ns.render_only:
        print("\n".join(map(str, scripts)))
        return 0
    job_ids = submit_points(sweep, scripts)
    print(f"submitted point jobs {','.join(job_ids)} ({len(sweep.points)} points)")
    report_job = submit_report_job(sweep, job_ids)
    study_arg = shlex.quote(str(sweep.study_dir))
    if ns.follow:
        return follow.follow(sweep.study_dir, interval=ns.interval)
    if not ns.wait:
        print(f"follow it: make status RUN={study_arg} FOLLOW=1")
        print(sweep.study_dir / runfiles.STUDY_REPORT / runfiles.STUDY_REPORT_HTML)
        return 0
    try:
        states = wait_points(job_ids, ns.timeout)
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
              f"their logs ({sweep.study_dir}/gpusN/logs)", file=sys.stderr)  # fmt: skip
        return 1
    return rc
