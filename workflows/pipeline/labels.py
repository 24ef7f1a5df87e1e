"""`make token-labels`: a Slurm job array that labels a stage's training set, one shard per rank.

The labeling job is planned like training (plan_job with entry "labels"): the same partition,
binding (bind.sh), container flags and environment, one rank per GPU. Every array task holds
NODES node(s) (default 1) and each of its ranks runs `python -m vitpod.trainer.tokenlabels.label` on
one shard, so SHARDS = array tasks x ranks per task. Shards are written atomically and a requeued or
resubmitted array skips the finished ones; the rank that completes the last shard writes the
manifest that preflight checks before a training job may read the labels.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import labelset, runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import new_run_path, runs_root
from vitpod.workflows.planning import preflight, sbatchopts, teachercheck
from vitpod.workflows.planning.flags import request_flags
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.recipe import load_recipe, recipe_name
from vitpod.workflows.planning.sbatchopts import SbatchOptions
from vitpod.workflows.site.profile import Profile, load_profile, resolve_path
from vitpod.workflows.slurm.quantities import whole_number
from vitpod.workflows.submit import submission
from vitpod.workflows.submit.submission import materialize


@dataclass(frozen=True)
class LabelJob:
    """A planned labeling array: the plan of one array task, the array size and the settings."""

    plan: JobPlan
    tasks: int
    shards: int
    label_dir: Path
    img_size: int
    teacher: str
    script: str
    data_dir: str
    teacher_sha256: str

    def manifest(self, job_ids: list[str] | None = None) -> dict[str, Any]:
        return self.plan.manifest(
            job_ids,
            labels={
                "label_dir": str(self.label_dir), "img_size": self.img_size,
                "grid": labelset.grid_of(self.img_size), "array_tasks": self.tasks,
                "shards": self.shards, "teacher": self.teacher,
                "teacher_sha256": self.teacher_sha256,
            },
        )  # fmt: skip


def default_label_dir(profile: Profile, model: str, stage: str, teacher_sha256: str) -> Path:
    """The recipe's token_label_data (under storage.data), else
    token_labels/<model>-<stage>-t<first 12 hex of the teacher's weights sha256>."""
    recipe = load_recipe(model).stage(stage)
    if recipe.token_label_data:
        return resolve_path(profile.storage.data) / recipe.token_label_data
    name = f"{model}-{stage}-t{teacher_sha256[:12]}"
    return resolve_path(profile.storage.data) / "token_labels" / name


def teacher_weights(teacher: str, checkpoint: str) -> Path:
    """The weights file of TEACHER/TEACHER_CKPT (after `teacher_flags` accepted them)."""
    path = Path(checkpoint or teacher).expanduser().absolute()
    return runfiles.final_model(path) if path.is_dir() else path


def teacher_problem(label_dir: str | Path, teacher: str, checkpoint: str) -> str | None:
    """Labels in `label_dir` made by another teacher than TEACHER: the refusal and its fix."""
    manifest = labelset.read_manifest(label_dir)
    if manifest is None and labelset.recorded_teacher(label_dir) is None:
        return None
    teacher_flags(teacher, checkpoint)
    digest = labelset.weights_digest(teacher_weights(teacher, checkpoint))
    if manifest is None:  # being labeled (claimed by its first rank), not finished
        return labelset.claim_problem(label_dir, digest)
    problem = labelset.teacher_problem(manifest, str(label_dir), digest)
    return problem and (
        f'{problem}; make this teacher\'s labels in a new directory (ARGS="--label-dir DIR") '
        f"and train with --token-label-data DIR"
    )


def teacher_flags(teacher: str, checkpoint: str) -> list[str]:
    """TEACHER (a run dir or weights file; or a timm name with TEACHER_CKPT) as labeler flags;
    ConfigError when the weights are not there (nothing is downloaded inside a job)."""
    if not teacher:
        raise ConfigError(
            "TEACHER is empty: give a vitpod run directory (its final model), a weights file, "
            "or a timm model name with TEACHER_CKPT=<weights file>"
        )
    if checkpoint:
        path = Path(checkpoint).expanduser().absolute()
        if not path.is_file():
            raise ConfigError(f"TEACHER_CKPT={checkpoint!r} is not a file; give the weights file")
        return ["--teacher", teacher, "--teacher-checkpoint", str(path)]
    path = Path(teacher).expanduser().absolute()
    if not path.exists():
        raise ConfigError(
            f"TEACHER={teacher!r} is not a run directory or file; for a timm model name also "
            f"give TEACHER_CKPT=<weights file>"
        )
    if path.is_dir() and not runfiles.final_model(path).is_file():
        raise ConfigError(
            f"TEACHER={teacher!r} has no final model ({runfiles.FINAL}/{runfiles.FINAL_MODEL}); "
            "give a finished run directory"
        )
    return ["--teacher", str(path)]


def prepare(
    cluster: str, model: str = "", stage: str = "pretrain", *, teacher: str,
    teacher_checkpoint: str = "", nodes: int | str | None = None, shards: str | int = "",
    args: str = "", run_root: str = "", dependency: str = "", run_dir: Path | None = None,
    slurm: SbatchOptions | None = None, time: str = "",
) -> LabelJob:  # fmt: skip
    """Plan the labeling array (ConfigError on bad input); nothing is written."""
    profile = load_profile(cluster)
    model = recipe_name(profile.model_for(model))
    stage_recipe = load_recipe(model).stage(stage)
    node_count = whole_number(nodes, "NODES", 1)
    per_task = node_count * profile.node_type(stage).ranks_per_node
    wanted = whole_number(shards, "SHARDS", profile.partition(stage).nodes * per_task)
    if profile.scheduler != "slurm" and wanted != per_task:
        raise ConfigError(
            f"SHARDS={wanted}: profile {profile.name} has no scheduler and runs one task of "
            f"{per_task} rank(s) here; use SHARDS={per_task} (or leave it empty)"
        )
    if wanted % per_task:
        raise ConfigError(
            f"SHARDS={wanted}: every array task runs {per_task} rank(s) (NODES={node_count}), "
            f"one shard each; use a multiple of {per_task}"
        )
    flags = teacher_flags(teacher, teacher_checkpoint)
    digest = labelset.weights_digest(teacher_weights(teacher, teacher_checkpoint))
    defaults = [
        "--img-size", str(stage_recipe.img_size),
        "--label-dir", str(default_label_dir(profile, model, stage, digest)),
        *flags, "--teacher-sha256", digest,
    ]  # fmt: skip
    run_dir = run_dir or new_run_path(runs_root(profile, run_root), model, "labels")
    plan = plan_job(
        Request(
            cluster=cluster, model=model, stage=stage, nodes=node_count, entry="labels",
            args=shlex.join(defaults) + (" " + args if args else ""), run_dir=run_dir,
            dependency=dependency, slurm=slurm or SbatchOptions(), time=time,
        )
    )  # fmt: skip
    labeler = _parse_labeler(plan)
    problem = teachercheck.teacher_problem(teacher, teacher_checkpoint, labeler.layout,
                                           labeler.img_size)  # fmt: skip
    if problem:
        raise ConfigError(problem)
    tasks = wanted // per_task
    return LabelJob(
        plan=plan, tasks=tasks, shards=wanted, label_dir=Path(labeler.label_dir).absolute(),
        img_size=labeler.img_size, teacher=teacher, script=array_script(plan, tasks),
        data_dir=labeler.data_dir, teacher_sha256=digest,
    )  # fmt: skip


def _parse_labeler(plan: JobPlan) -> argparse.Namespace:
    """The labeler's own parser on the exact argv every rank will run."""
    from vitpod.trainer.tokenlabels.label import build_parser

    parser = build_parser()
    argv = list(plan.spec.args)
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        raise ConfigError(f"ARGS: the labeler refuses {shlex.join(argv)} (see above)") from None
    if ns.img_size % labelset.STRIDE:
        raise ConfigError(f"ARGS: --img-size {ns.img_size} must be a multiple of 16")
    return ns


def array_script(plan: JobPlan, tasks: int) -> str:
    """The stage's sbatch script with `--array` (a local profile's script runs one task)."""
    if plan.profile.scheduler != "slurm":
        return plan.script
    lines = plan.script.splitlines()
    lines.insert(1, f"#SBATCH --array=0-{tasks - 1}")
    lines = [
        line.replace("/sbatch-%j.", "/sbatch-%A_%a.") if line.startswith("#SBATCH --") else line
        for line in lines
    ]
    return "\n".join(lines) + "\n"


def existing_problems(job: LabelJob) -> list[str] | None:
    """None when the label dir has no manifest; else what keeps it from serving this stage."""
    manifest = labelset.read_manifest(job.label_dir)
    if manifest is None:
        return None
    names = labelset.folder_names(job.data_dir) if Path(job.data_dir, "train").is_dir() else None
    return labelset.problems(
        manifest, where=str(job.label_dir), names=names, data_dir=job.data_dir,
        img_size=job.img_size, teacher_sha256=job.teacher_sha256,
    )  # fmt: skip


def submit(job: LabelJob, force: bool = False) -> str | None:
    """Preflight, write the run dir and sbatch the array (Slurm) or run it here (local).

    Returns the array's job id (None when run here or when matching labels already exist)."""
    found = existing_problems(job)
    if found == [] and not force:
        print(f"labels: {job.label_dir} already holds labels of teacher sha256 "
              f"{job.teacher_sha256[:12]} for this data set at grid "
              f"{labelset.grid_of(job.img_size)}; nothing to do (ARGS='--label-dir ...' or "
              "--force to make others)")  # fmt: skip
        return None
    if found and not force:
        raise ConfigError(
            "; ".join(found) + f'; choose another directory (ARGS="--label-dir DIR") or '
            f"remove {job.label_dir}"
        )
    # One teacher per directory, --force or not (its ranks would refuse it anyway).
    claimed = labelset.claim_problem(job.label_dir, job.teacher_sha256)
    if claimed is not None:
        raise ConfigError(claimed)
    preflight.check(
        job.plan, render_hint="python -m vitpod.workflows token-labels ... --render-only"
    )
    return launch(job)


def launch(job: LabelJob) -> str | None:
    """Write the run dir, then sbatch the array (its job id) or, without Slurm, run it here."""
    plan = dataclasses.replace(job.plan, script=job.script)
    script = materialize(plan, job.manifest())
    print(f"labels: {job.tasks} array task(s) x {job.shards // job.tasks} rank(s) = "
          f"{job.shards} shard(s) -> {job.label_dir}; run directory {script.parent}",
          flush=True)  # fmt: skip
    return start(script.parent, written_now=True)


def start(run_dir: Path, written_now: bool = False) -> str | None:
    """The labeling run's kept script: sbatched as it is (its job id) or, without Slurm, run
    here (None). `written_now`: a refused array removes the run directory it was written in."""
    manifest = runfiles.read_manifest(run_dir)
    script = run_dir / manifest["script"]
    if manifest["profile"]["values"]["scheduler"] != "slurm":
        rc = subprocess.run(["bash", str(script)], check=False).returncode
        if rc:
            raise ConfigError(f"labeling failed (status {rc}); see {run_dir / runfiles.LOGS}")
        return None
    job = submission.submit(script, manifest, remove_on_refusal=written_now)
    print(f"submitted array job {job.job_id}", flush=True)
    return job.job_id


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vitpod.workflows token-labels", description=__doc__,
        parents=[request_flags("cluster", "model", "stage", "nodes", "args", "run-root",
                               "timeout", stage="whose resolution and data set (grid = "
                               "img_size/16)", nodes="nodes per array task (default 1)",
                               args="labeler flags (--label-dir, --topk, -b, ...)")],
    )  # fmt: skip
    p.add_argument("--teacher", default="", help="run dir, weights file, or timm model name")
    p.add_argument("--teacher-checkpoint", default="", help="weights of a timm-name teacher")
    p.add_argument("--shards", default="", help="array tasks x ranks per task")
    p.add_argument("--force", action="store_true", help="label even if matching labels exist")
    p.add_argument("--wait", action="store_true", help="wait for the array to end")
    sbatchopts.add_flags(p)
    p.add_argument(
        "--dry-run", action="store_true",
        help="print the array script it would submit; write and submit nothing",
    )  # fmt: skip
    return p


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    job = prepare(
        ns.cluster, ns.model, ns.stage, teacher=ns.teacher,
        teacher_checkpoint=ns.teacher_checkpoint, nodes=ns.nodes or None, shards=ns.shards,
        args=ns.args, run_root=ns.run_root, slurm=sbatchopts.from_namespace(ns), time=ns.time,
    )  # fmt: skip
    if ns.dry_run:
        print(f"# dry run: would write {job.plan.run_dir} and submit this array; nothing written")
        print(job.script, end="" if job.script.endswith("\n") else "\n")
        return 0
    job_id = submit(job, force=ns.force)
    if job_id is not None and ns.wait:
        states = jobstate.wait_array(job_id, job.tasks, ns.timeout)
        bad = {i: s for i, s in states.items() if s != "COMPLETED"}
        if bad:
            print(f"error: array tasks did not complete: {bad}; see "
                  f"{job.plan.run_dir / runfiles.LOGS}", file=sys.stderr)  # fmt: skip
            return 1
    manifest = labelset.read_manifest(job.label_dir)
    if manifest is not None:
        rates = [t["images_per_s"] for t in manifest["throughput"] if t.get("images_per_s")]
        if rates:
            print(f"labels: {manifest['samples']} images, grid {manifest['grid']}, "
                  f"{min(rates):.1f}-{max(rates):.1f} images/s per rank")  # fmt: skip
    print(job.label_dir)
    return 0
