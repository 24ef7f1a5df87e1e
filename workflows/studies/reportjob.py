"""The scaling report as a Slurm job that waits for the study's point jobs: report.html
appears by itself once every point has ended, failed ones included.

`sbatch --dependency=afterany:<id>:<id>...` starts the job after all of those jobs have
terminated, whatever their state (https://slurm.schedmd.com/sbatch.html#OPT_dependency). The job
records each point's final Slurm state in study.json (the ids it reads there), then writes the
report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from vitpod.registry import runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import write_atomic
from vitpod.workflows.planning.spec import JobSpec, launch_for
from vitpod.workflows.studies.study import point_states, record_states, report
from vitpod.workflows.submit import submission
from vitpod.workflows.templating import render

SCRIPT_NAME = "report.sbatch"
TIME_LIMIT = "00:15:00"  # matplotlib plots of a handful of points take seconds
# A small share of one node: the profile's `mem: "0"` would take a whole GPU node's memory
# (all of it, where memory is a consumable resource) for a job that needs well under 1 GB.
MEMORY = "2G"


def render_script(spec: JobSpec, study_dir: Path, job_ids: list[str]) -> str:
    """One task (1 CPU, 2 GB, no GPU) on the study's partition, not requeued, after the points."""
    spec = dataclasses.replace(
        spec, job_name=f"vitpod-report-{spec.model}", nodes=1, tasks_per_node=1,
        gpus_per_node=0, cpus_per_task=1, mem=MEMORY, time=TIME_LIMIT, requeue=False,
        exclusive=False, dependency="afterany:" + ":".join(job_ids),
    )  # fmt: skip
    header = render("partials/header.sh.j2", {"spec": spec}).rstrip("\n").splitlines()
    header = [
        line.replace("/sbatch-%j.", "/report-%j.") if line.startswith("#SBATCH --") else line
        for line in header
        if not line.startswith("#SBATCH --signal")  # nothing to checkpoint
    ]
    # Same srun flags as the points (container image, mounts, working directory), so the report
    # runs with the code and Python that trained them.
    srun_args = launch_for(spec).srun_args
    body = render(
        "report.sh.j2",
        {"study_dir": str(study_dir), "job_ids": ",".join(job_ids),
         "srun_args": srun_args, "python": spec.python},
    )  # fmt: skip
    return "\n".join(header) + "\n" + body


def submit(spec: JobSpec, study_dir: Path, job_ids: list[str]) -> str:
    """Write STUDY/report.sbatch and submit it after the points; returns the report job's id."""
    script = study_dir / SCRIPT_NAME
    write_atomic(script, render_script(spec, study_dir, job_ids), mode=0o750)
    study = runfiles.read_record(study_dir / runfiles.STUDY)
    job = submission.submit(script, study, record_name=runfiles.STUDY, id_key="report_job_id",
                            cluster=spec.profile.cluster or "")  # fmt: skip
    return job.job_id


def main(argv: list[str] | None = None) -> int:
    """Inside the report job: record the points' final states, then write the report."""
    parser = argparse.ArgumentParser(
        prog="python -m vitpod.workflows.studies.reportjob", description=__doc__
    )
    parser.add_argument("study_dir", type=Path)
    ns = parser.parse_args(argv)
    study = ns.study_dir / runfiles.STUDY
    if not study.is_file():
        raise ConfigError(f"{ns.study_dir} has no {runfiles.STUDY}; pass the study directory")
    job_ids = [str(p.get("job_id") or "") for p in json.loads(study.read_text())["points"]]
    # one squeue (sacct for those it forgot); a point without accounting is left out: its end
    # is unknown
    states = point_states(job_ids, jobstate.poll_once([j for j in job_ids if j]))
    record_states(ns.study_dir, states)
    print(f"vitpod: point states {dict(sorted(states.items()))}", flush=True)
    return report(ns.study_dir)


if __name__ == "__main__":
    sys.exit(main())
