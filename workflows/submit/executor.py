"""submitit executors for a planned job: LocalExecutor, or SlurmExecutor from its Launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit

from vitpod.registry import runfiles
from vitpod.workflows.pipeline.chain_task import TrainerTask
from vitpod.workflows.planning.plan import JobPlan
from vitpod.workflows.planning.quantities import slurm_minutes


def make_executor(job: JobPlan, dependency: str | None) -> submitit.Executor:
    """A LocalExecutor (local profile) or a SlurmExecutor filled from the job's Launch."""
    spec, plan = job.spec, job.launch
    folder = Path(spec.run_dir) / runfiles.SUBMITIT
    if spec.profile.scheduler == "local":
        local = submitit.LocalExecutor(folder)
        local.update_parameters(
            tasks_per_node=spec.tasks_per_node, timeout_min=slurm_minutes(spec.time)
        )
        return local
    executor = submitit.SlurmExecutor(folder, python=plan.python_command)
    extra: dict[str, Any] = {"time": spec.time, "signal": spec.signal}
    if spec.requeue:
        extra["requeue"] = True
    if dependency:
        extra["dependency"] = dependency
    if spec.profile.cluster:  # one slurmdbd, several clusters: sbatch -M routes it there
        extra["clusters"] = spec.profile.cluster
    params: dict[str, Any] = {
        "job_name": spec.job_name,
        "partition": spec.partition,
        "nodes": spec.nodes,
        "ntasks_per_node": spec.tasks_per_node,
        "cpus_per_task": spec.cpus_per_task,
        "mem": spec.mem,
        "srun_args": list(plan.srun_args),
        "setup": list(plan.setup_lines),
        "teardown": list(plan.teardown_lines),
        "additional_parameters": extra,
    }
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.exclusive:
        params["exclusive"] = True
    chosen = {"account": spec.account, "qos": spec.qos, "constraint": spec.constraint,
              "exclude": spec.exclude}  # fmt: skip
    params.update({k: v for k, v in chosen.items() if v})
    if spec.reservation:
        extra["reservation"] = spec.reservation
    for option in spec.sbatch_extra:  # --name[=value]; submitit writes #SBATCH --name=<quoted>
        name, eq, value = option[2:].partition("=")
        extra[name] = value if eq else True
    executor.update_parameters(**params)
    return executor


def trainer_task(job: JobPlan) -> TrainerTask:
    spec = job.spec
    return TrainerTask(
        command=list(spec.rank_command),
        log_dir=spec.log_dir,
        cwd=spec.code_dir,
        local=spec.profile.scheduler == "local",
        env=dict(job.launch.env) if spec.profile.scheduler == "local" else {},
    )
