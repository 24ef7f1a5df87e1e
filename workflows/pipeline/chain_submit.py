"""Submitting a Chain: every stage's kept job.sbatch through the one submission function
(workflows/submit/submission.py), labeling arrays first, the fine-tune after the pretrain
(afterok on sbatch's command line, so the scripts stay the ones rendered); a rendered pipeline
(Chain.render(), or Chain.from_dir of one) only when its files are unchanged and the preflight
passed again against the live cluster.

Functions of the chain (workflows/pipeline/chain.py keeps the public methods that call them).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from vitpod.registry import labelset, runfiles
from vitpod.workflows import slurm
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.jobs.rundir import remove_run_dir, write_record
from vitpod.workflows.pipeline import chain_cross, labels
from vitpod.workflows.pipeline.chain_labels import cancel_labels
from vitpod.workflows.pipeline.chain_stage import job_plan, stage_dir
from vitpod.workflows.planning import preflight
from vitpod.workflows.submit import rendered, submission
from vitpod.workflows.submit.executor import local_job


def label_dirs(chain: Any) -> dict[str, Path]:
    """Each labeling array's run directory (planned here, or as pipeline.json names it)."""
    if chain.label_jobs:
        return {stage: job.plan.run_dir for stage, job in chain.label_jobs.items()}
    return {s: Path(e["run_dir"]) for s, e in chain.recorded.get("labels", {}).items()}


def submit_rendered(chain: Any) -> None:
    """The rendered stages (and labeling arrays) as written: files unchanged since rendering,
    every stage planned again and preflighted online, then submitted."""
    found = label_dirs(chain)
    directories = [*found.values(), *(r.run_dir for r in chain.stages.values())]
    submission.refuse_changed(directories)
    for run_dir in directories:  # one already submitted (by a copy of this pipeline directory)
        rendered.refuse_submitted(run_dir, rendered.manifest_of(run_dir))
    for run_dir in found.values():
        tasks = runfiles.read_manifest(run_dir)["labels"]["array_tasks"]
        preflight.check(rendered.replan(run_dir, partial(labels.array_script, tasks=tasks)))
    for name, rec in chain.stages.items():
        rec.plan = rendered.replan(rec.run_dir)
        chained = name == "finetune" and "pretrain" in chain.stages
        preflight.check(rec.plan, chained=chained, labels_pending=name in found)
    chain.offline = False  # rendered offline, submitted online: pipeline.json says so
    if chain.crossing:
        pre, fin = job_plan(chain.stages["pretrain"]), job_plan(chain.stages["finetune"])
        for line in chain_cross.check_before(pre, fin, Path(fin.request.finetune_from)):
            print(f"ok: {line}", flush=True)
    launch(chain, owned=False)


def launch(chain: Any, owned: bool) -> None:
    """Submit the written stages: labeling arrays first, the first stage after them (afterok),
    the fine-tune after the pretrain. A failure cancels what was queued; `owned` (written by
    this call): the pipeline directory is removed too."""
    try:
        first = next(iter(chain.stages.values()))
        submit_labels(chain, first.cluster)
        ids = ":".join(chain.label_job_ids)
        submit_stage(chain, first, dependency=f"afterok:{ids}" if ids else None)
        if chain.crossing:
            chain_cross.announce(chain.stages["finetune"], chain.finetune_cluster)
        elif chain.uses_slurm and "finetune" in chain.stages and first.name == "pretrain":
            after = f"afterok:{first.job_ids[0]}"
            submit_stage(chain, chain.stages["finetune"], dependency=after)
    except BaseException:
        roll_back(chain, owned)
        raise
    chain._save()


def submit_labels(chain: Any, cluster: str) -> None:
    """Queue each labeling array (Slurm: the first stage waits for them, afterok); without
    Slurm, label here before the first stage starts."""
    grids = {s: job.img_size for s, job in chain.label_jobs.items()}
    for stage, run_dir in label_dirs(chain).items():
        with slurm.on_cluster(cluster):
            job_id = labels.start(run_dir)
        if job_id is not None:
            chain.label_job_ids.append(job_id)
        grid = f" (grid {labelset.grid_of(grids[stage])})" if stage in grids else ""
        print(f"labels for {stage}: {run_dir}{grid}", flush=True)


def submit_stage(chain: Any, rec: JobState, dependency: str | None) -> None:
    """sbatch the stage's kept job.sbatch (Slurm: `dependency` on sbatch's command line); the
    local profile: submitit's LocalExecutor runs its kept job.sh."""
    directory = stage_dir(rec)
    if chain.uses_slurm:
        manifest = {**runfiles.read_manifest(directory), **rec.manifest_extra}
        rec.job = submission.submit(
            directory / manifest["script"], manifest, dependency=dependency or "",
            cluster=rec.cluster or slurm.current_cluster(),
        )  # fmt: skip
    else:
        rec.job = local_job(job_plan(rec))
        manifest = runfiles.read_manifest(directory)
        write_record(directory, runfiles.MANIFEST, {**manifest, "job_ids": [str(rec.job.job_id)]})
    rec.job_ids = [str(rec.job.job_id)]
    rec.recorded = "SUBMITTED"
    print(f"{rec.name}: submitted job {rec.job_ids[0]} ({rec.run_dir})", flush=True)


def roll_back(chain: Any, owned: bool) -> None:
    """A submission that failed half way: cancel what was queued; remove the pipeline directory
    when this call wrote it (a rendered one stays, for another try). When a cancel fails, its
    jobs may still run and write there, so the directory stays (pipeline.json names the jobs)
    and stderr says what to do."""
    outcome = chain._cancel_submitted()
    labels_problem = cancel_labels(chain.label_job_ids)
    if not outcome.startswith("jobs not cancelled") and labels_problem is None:
        if owned:
            remove_run_dir(chain.directory)
            chain.stages = {}
        else:
            for rec in chain.stages.values():
                rec.job, rec.job_ids, rec.recorded = None, [], "RENDERED"
            chain.label_job_ids = []
        return
    ids = [i for rec in chain.stages.values() for i in rec.job_ids] + chain.label_job_ids
    try:
        chain._save()
    except Exception as exc:  # the warning below still names the jobs
        print(f"warning: could not record {runfiles.PIPELINE}: {exc}", file=sys.stderr)
    print(
        f"error: the submission failed and its jobs {' '.join(ids)} could not all be "
        f"cancelled, so the pipeline directory {chain.directory} is kept (they may run and "
        f"write there): cancel them with `scancel {' '.join(ids)}`, then remove it",
        file=sys.stderr,
    )
