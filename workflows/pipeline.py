"""The submitit pipeline: pretrain on one partition, then finetune from it on another."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, engine_fields
from vitpod.trainer import labelset
from vitpod.trainer.exitcodes import REQUEUE
from vitpod.workflows import jobstate, preflight, status
from vitpod.workflows.cli import materialize
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.plan import DEFAULT_MODEL, JobPlan, Request, plan_job
from vitpod.workflows.profile import load_profile
from vitpod.workflows.rundir import (
    DIR_MODE,
    new_run_path,
    remove_run_dir,
    runs_root,
    write_atomic,
    write_json,
)
from vitpod.workflows.spec import REQUEUE_MARKER_ENV, master_port

STAGES = ("pretrain", "finetune")
MAX_LOCAL_RESTARTS = 5  # without Slurm, an exit 75 restarts the trainer in place this often


class PipelineError(RuntimeError):
    """A stage failed or was cancelled; the message carries the root-cause traceback if found."""


# --------------------------------------------------------------------------- per task (rank)


@dataclass
class TrainerTask:
    """What submitit runs on every task: the trainer as a child process, logged per rank/restart.

    On Slurm the task already runs under the binding step (bind.sh is submitit's `python`), so
    ranks, binding, MASTER_ADDR/PORT and the requeue rule come from the same LaunchPlan as the
    sbatch path: exit 75 (trainer/exitcodes.py REQUEUE) ends the task with 75, bind.sh leaves the
    requeue marker and the batch script's teardown requeues the job. Without Slurm the trainer is
    restarted here (`--resume auto`).
    """

    command: list[str]
    log_dir: str
    cwd: str
    local: bool
    env: dict[str, str] = field(default_factory=dict)

    def __call__(self) -> dict[str, Any]:
        job = submitit.JobEnvironment()
        env = {**os.environ, **self.env}
        if self.local:
            env.update(_local_rank_env(job))
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        while True:
            log = (
                Path(self.log_dir)
                / f"train-{job.job_id}-restart{restart}-rank{job.global_rank}.log"
            )
            rc = _run_forwarding_signals(self.command, env, log, self.cwd)
            if rc == REQUEUE and self.local and restart < MAX_LOCAL_RESTARTS:
                restart += 1
                continue
            break
        # A trainer killed by a signal after another rank asked for a requeue is not a failure.
        if rc == REQUEUE or (rc < 0 and _requeue_marker_left()):
            sys.exit(REQUEUE)  # no result file: the job is not over, the batch script requeues it
        if rc != 0:
            raise RuntimeError(
                f"rank {job.global_rank}: trainer exited with status {rc}; see {log}"
            )
        return {"rank": job.global_rank, "log": str(log), "restarts": restart}


def _requeue_marker_left() -> bool:
    """Whether some rank of this job (re)start left bind.sh's requeue marker (Slurm only)."""
    marker = os.environ.get(REQUEUE_MARKER_ENV, "")
    return bool(marker) and Path(marker).exists()


def _local_rank_env(job: submitit.JobEnvironment) -> dict[str, str]:
    # The local executor starts one process per task but sets only SUBMITIT_LOCAL_* variables.
    return {
        "RANK": str(job.global_rank),
        "LOCAL_RANK": str(job.local_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port(int(job.job_id))),
    }


def _run_forwarding_signals(cmd: list[str], env: dict[str, str], log: Path, cwd: str) -> int:
    """Run cmd with output to log; preemption signals go to it instead of submitit's handler.

    submitit's own USR2 handler would requeue at once, before the trainer has checkpointed.
    """
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: Any) -> None:
        if child:
            child[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        with open(log, "ab") as out:
            child.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=out))
        return child[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --------------------------------------------------------------------------- submission


def make_executor(job: JobPlan, dependency: str | None) -> submitit.Executor:
    """A LocalExecutor (local profile) or a SlurmExecutor filled from the job's LaunchPlan."""
    spec, plan = job.spec, job.launch
    folder = Path(spec.run_dir) / "submitit"
    if spec.profile.scheduler == "local":
        local = submitit.LocalExecutor(folder)
        local.update_parameters(
            tasks_per_node=spec.tasks_per_node, timeout_min=preflight.slurm_minutes(spec.time)
        )
        return local
    executor = submitit.SlurmExecutor(folder, python=plan.python_command)
    extra: dict[str, Any] = {"time": spec.time, "signal": spec.signal}
    if spec.requeue:
        extra["requeue"] = True
    if dependency:
        extra["dependency"] = dependency
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
    params.update({k: v for k, v in (("account", spec.account), ("qos", spec.qos)) if v})
    executor.update_parameters(**params)
    return executor


def _task(job: JobPlan) -> TrainerTask:
    spec = job.spec
    return TrainerTask(
        command=list(spec.command),
        log_dir=spec.log_dir,
        cwd=spec.code_dir,
        local=spec.profile.scheduler == "local",
        env=dict(job.launch.env) if spec.profile.scheduler == "local" else {},
    )


@dataclass
class StageRecord:
    """One submitted stage: its run directory and job(s)."""

    stage: str
    plan: JobPlan
    job: Any = None
    job_ids: list[str] = field(default_factory=list)
    state: str = ""

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    @property
    def decision(self) -> Decision | None:
        return self.plan.decision


class Pipeline:
    """Pretrain on one partition, then finetune from its final model on another, via submitit.

    >>> run = Pipeline(cluster="dgxpod", model="volo_d5", nodes=5).submit()
    >>> run.status(); run.wait(timeout=3600)

    Slurm profiles: the finetune is submitted at once with `dependency=afterok:<pretrain>`, so
    it starts only after the pretrain really completed (requeues included). The local profile
    (submitit's LocalExecutor) starts the finetune from `status()`/`wait()` once the pretrain
    completed.
    """

    def __init__(
        self,
        cluster: str = "dgxpod",
        model: str = "",
        nodes: int | str | None = None,
        args: str = "",
        *,
        pretrain_args: str = "",
        finetune_args: str = "",
        finetune_from: str | None = None,
        stages: tuple[str, ...] = STAGES,
        run_root: str | None = None,
        entry: str = "trainer",
        teacher: str = "",
        teacher_checkpoint: str = "",
        label_shards: str | int = "",
    ) -> None:
        self.cluster, self.model = cluster, model
        self.nodes = "" if nodes is None else str(nodes)
        self.stage_args = {
            "pretrain": " ".join(a for a in (args, pretrain_args) if a),
            "finetune": " ".join(a for a in (args, finetune_args) if a),
        }
        self.finetune_from = finetune_from
        self.wanted = tuple(
            s for s in STAGES if s in stages and not (finetune_from and s == "pretrain")
        )
        if self.wanted == ("finetune",) and not finetune_from:
            raise ConfigError("stages=('finetune',) needs finetune_from=<pretrain run dir>")
        if not self.wanted or set(stages) - set(STAGES):
            raise ConfigError(
                f"stages={stages!r}: choose from {STAGES} (finetune_from skips pretrain)"
            )
        self.run_root = run_root
        self.entry = entry
        self.teacher, self.teacher_checkpoint = teacher, teacher_checkpoint
        self.label_shards = label_shards
        self.label_jobs: dict[str, Any] = {}
        """Stage -> labels.LabelJob making that stage's missing token labels (queued first)."""
        self.label_job_ids: list[str] = []
        self.directory: Path | None = None
        self.stages: dict[str, StageRecord] = {}

    # ---- planning: everything validated, nothing written
    def plan(self) -> dict[str, StageRecord]:
        """Plan every stage and run the whole preflight; raises ConfigError, writes nothing."""
        profile = load_profile(self.cluster)
        model = self.model or profile.default_model or DEFAULT_MODEL
        directory = new_run_path(runs_root(profile, self.run_root), model, "pipeline")
        records: dict[str, StageRecord] = {}
        self.label_jobs = {}
        for stage in self.wanted:
            chained = stage == "finetune" and not self.finetune_from
            source = self.finetune_from or str(directory / "pretrain")
            req = Request(
                cluster=self.cluster, model=model, stage=stage, nodes=self.nodes,
                args=self.stage_args[stage], run_dir=directory / stage, entry=self.entry,  # type: ignore[arg-type]
                finetune_from=source if stage == "finetune" else "",
            )  # fmt: skip
            plan = plan_job(req)
            pending = self._plan_labels(plan, directory)
            preflight.check(plan, chained=chained, labels_pending=pending)
            records[stage] = StageRecord(stage, plan)
        self.directory = directory
        return records

    def _plan_labels(self, plan: JobPlan, directory: Path) -> bool:
        """Token labels for a stage: reuse them when they pass the checks against the data set
        and the stage's grid; plan a labeling job when none exist and a teacher is given.
        Returns whether labels are pending (made by a job queued before the pretrain)."""
        from vitpod.workflows import labels

        found = preflight.token_label_problems(plan)
        label_dir = (plan.trainer or {}).get("token_label_data")
        if not found or not label_dir or not self.teacher:
            return False  # fine as is, or preflight.check refuses with the command to run
        if labelset.read_manifest(label_dir) is not None:
            return False  # labels exist but do not fit: never overwrite them; preflight refuses
        for other, job in self.label_jobs.items():
            if job.label_dir == Path(label_dir).absolute():
                raise ConfigError(
                    f"{other} and {plan.spec.stage} both read token labels from {label_dir}, "
                    f"but labels are made per grid (img_size/16); give the {plan.spec.stage} "
                    f"stage its own --token-label-data"
                )
        stage = plan.spec.stage
        self.label_jobs[stage] = labels.prepare(
            self.cluster, plan.spec.model, stage, teacher=self.teacher,
            teacher_checkpoint=self.teacher_checkpoint, shards=self.label_shards,
            nodes=None, run_dir=directory / f"labels-{stage}",
            args=shlex.join(["--label-dir", str(label_dir),
                             "--img-size", str((plan.trainer or {})["img_size"])]),
        )  # fmt: skip
        return True

    # ---- submission
    def submit(self) -> Pipeline:
        """Validate both stages, create their run directories, and submit."""
        if self.stages:
            raise RuntimeError("this pipeline was already submitted; create a new Pipeline")
        records = self.plan()
        assert self.directory is not None
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self.directory.mkdir(mode=DIR_MODE)
        try:
            for rec in records.values():
                materialize(rec.plan, self._manifest(rec))
                if rec.decision is not None:
                    print(rec.decision.log_line(), flush=True)
            self.stages = records
            first = next(iter(records.values()))
            self._submit_labels()
            ids = ":".join(self.label_job_ids)
            self._submit_stage(first, dependency=f"afterok:{ids}" if ids else None)
            if self._uses_slurm and "finetune" in records and first.stage == "pretrain":
                self._submit_stage(records["finetune"], dependency=f"afterok:{first.job_ids[0]}")
        except BaseException:
            self._cancel_submitted()
            self._cancel_labels()
            remove_run_dir(self.directory)
            self.stages = {}
            raise
        self._save()
        return self

    def _submit_labels(self) -> None:
        """Queue each labeling array (Slurm: the first stage waits for them, afterok); without
        Slurm, label here before the first stage starts."""
        from vitpod.workflows import labels

        for stage, job in self.label_jobs.items():
            job_id = labels.launch(job)
            if job_id is not None:
                self.label_job_ids.append(job_id)
            print(f"labels for {stage}: {job.label_dir} (grid {labelset.grid_of(job.img_size)})",
                  flush=True)  # fmt: skip

    def _cancel_labels(self) -> None:
        for job_id in self.label_job_ids:
            subprocess.run(["scancel", job_id], check=False, capture_output=True)

    @property
    def _uses_slurm(self) -> bool:
        first = next(iter(self.stages.values()))
        return first.plan.profile.scheduler == "slurm"

    def _manifest(self, rec: StageRecord, dependency: str | None = None) -> dict[str, Any]:
        manifest = rec.plan.manifest(
            rec.job_ids,
            pipeline={"directory": str(self.directory), "submitted_via": "submitit"},
            submitit_folder=str(rec.run_dir / runfiles.SUBMITIT),
        )
        manifest["resolved"]["dependency"] = dependency
        return manifest

    def _submit_stage(self, rec: StageRecord, dependency: str | None) -> None:
        executor = make_executor(rec.plan, dependency)
        rec.job = executor.submit(_task(rec.plan))
        rec.job_ids = [str(rec.job.job_id)]
        rec.state = "SUBMITTED"
        if self._uses_slurm:  # keep exactly what sbatch received: submitit's script
            kept = Path(rec.job.paths.submission_file).read_text()
            write_atomic(rec.run_dir / rec.plan.script_name, kept, mode=0o750)
        write_json(rec.run_dir / runfiles.MANIFEST, self._manifest(rec, dependency))
        print(f"{rec.stage}: submitted job {rec.job_ids[0]} ({rec.run_dir})", flush=True)

    def _cancel_submitted(self) -> None:
        for rec in self.stages.values():
            if rec.job is not None:
                rec.job.cancel(check=False)

    def _save(self) -> None:
        assert self.directory is not None
        record = {
            "cluster": self.cluster,
            "model": self.model,
            "executor": "slurm" if self._uses_slurm else "local",
            "updated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "labels": {
                stage: {
                    "run_dir": str(job.plan.run_dir),
                    "label_dir": str(job.label_dir),
                    "job_ids": self.label_job_ids,
                }
                for stage, job in self.label_jobs.items()
            },  # fmt: skip
            "stages": {
                name: {
                    "run_dir": str(rec.run_dir),
                    "job_ids": rec.job_ids,
                    "state": rec.state,
                    "engine": rec.decision.engine.name if rec.decision else None,
                }
                for name, rec in self.stages.items()
            },
        }
        write_json(self.directory / status.PIPELINE_FILE, record)

    # ---- watching
    def _local_state(self, rec: StageRecord) -> str:
        if rec.job is None:
            return rec.state or "NOT_SUBMITTED"
        if rec.job.state == "RUNNING":
            return "RUNNING"
        try:
            rec.job.results()
        except Exception:  # the task raised (its traceback is in the rank logs)
            return "FAILED"
        return "COMPLETED"

    def _advance_local(self) -> None:
        """Local profile: record states, and start the finetune once the pretrain completed."""
        for rec in self.stages.values():
            if rec.state not in jobstate.TERMINAL:
                rec.state = self._local_state(rec)
        pre, fin = self.stages.get("pretrain"), self.stages.get("finetune")
        if pre and fin and fin.job is None and fin.state != "CANCELLED":
            if pre.state == "COMPLETED":
                self._submit_stage(fin, dependency=None)
            elif pre.state in jobstate.TERMINAL:
                fin.state = "CANCELLED"  # as Slurm's kill_invalid_depend would
        self._save()

    def status(self) -> list[status.StageStatus]:
        """Per stage: state, job ids, restarts, last step, images/s, and a failure's root cause."""
        if not self.stages:
            raise RuntimeError("submit() first")
        if self._uses_slurm:
            ids = [j for rec in self.stages.values() for j in rec.job_ids]
            polled = jobstate.poll_once(ids)
            infos = {n: [polled[j] for j in r.job_ids] for n, r in self.stages.items()}
        else:
            self._advance_local()
            infos = {n: [] for n in self.stages}
        return [
            status.stage_status(name, rec.run_dir, rec.job_ids, infos[name], rec.state)
            for name, rec in self.stages.items()
        ]

    def wait(self, timeout: float | None = None, poll_s: float = 5.0) -> dict[str, Any]:
        """Block until every stage completed (returns the report) or one failed (raises)."""
        if not self.stages:
            raise RuntimeError("submit() first")
        if self._uses_slurm:
            self._wait_slurm(timeout, poll_s)
        else:
            self._wait_local(timeout, poll_s)
        return self.report()

    def _wait_slurm(self, timeout: float | None, poll_s: float) -> None:
        ids = [j for rec in self.stages.values() for j in rec.job_ids]
        try:
            jobstate.wait_jobs(jobstate.JobStatePoller(ids), timeout=timeout, poll_s=poll_s)
        except jobstate.JobFailedError as exc:
            stage = next(n for n, r in self.stages.items() if exc.info.job_id in r.job_ids)
            self.stages[stage].state = exc.info.state
            self._save()
            raise PipelineError(self._failure_message(stage, str(exc))) from None
        for rec in self.stages.values():
            rec.state = "COMPLETED"
        self._save()

    def _wait_local(self, timeout: float | None, poll_s: float) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._advance_local()
            for name, rec in self.stages.items():
                if rec.state in jobstate.TERMINAL and rec.state != "COMPLETED":
                    raise PipelineError(self._failure_message(name, f"{name} ended {rec.state}"))
            if all(r.state == "COMPLETED" for r in self.stages.values()):
                return
            if deadline is not None and time.monotonic() >= deadline:
                self._cancel_submitted()
                raise TimeoutError(f"pipeline not finished after {timeout:.0f} s; jobs cancelled")
            time.sleep(min(poll_s, 1.0))

    def follow(self, interval: float | None = None, console: Any = None) -> int:
        """Live view of every stage until the run ends (workflows/follow.py); 0 when all
        completed (report.json's path printed), 1 when one failed (root cause printed)."""
        if not self.stages or self.directory is None:
            raise RuntimeError("submit() first")
        from vitpod.workflows import follow

        advance = None if self._uses_slurm else self._advance_local
        return follow.follow(self.directory, interval, console, before_poll=advance)

    def _failure_message(self, stage: str, reason: str) -> str:
        rec = self.stages[stage]
        tb = status.root_cause(rec.run_dir / runfiles.LOGS)
        where = f"\nlogs: {rec.run_dir / 'logs'}"
        for job in self.label_jobs.values():  # a failed labeling array cancels the pretrain
            where += f"\nlabeling logs (the pretrain waits for them): {job.plan.run_dir / 'logs'}"
        if tb is None:
            line = status.first_error_line(rec.run_dir / runfiles.LOGS)
            return f"{stage}: {reason}" + (f"\nfirst error: {line}" if line else "") + where
        return f"{stage}: {reason}\nroot cause ({tb.path}:{tb.line}):\n{tb.text}{where}"

    def report(self) -> dict[str, Any]:
        """Each stage's final accuracy and where its checkpoints, logs and final model are."""
        stages = {}
        for name, rec in self.stages.items():
            summary_path = rec.run_dir / runfiles.SUMMARY
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
            stages[name] = {
                "state": rec.state,
                "job_ids": rec.job_ids,
                "top1": summary.get("top1"),
                "top5": summary.get("top5"),
                "steps": summary.get("steps"),
                "images_per_s": summary.get("images_per_s"),
                **engine_fields(rec.decision),
                "run_dir": str(rec.run_dir),
                "checkpoints": str(rec.run_dir / runfiles.CHECKPOINTS),
                "final_model": str(runfiles.final_model(rec.run_dir)),
                "logs": str(rec.run_dir / runfiles.LOGS),
            }
        made = {
            stage: {"label_dir": str(job.label_dir), "run_dir": str(job.plan.run_dir),
                    "manifest": labelset.read_manifest(job.label_dir)}
            for stage, job in self.label_jobs.items()
        }  # fmt: skip
        report = {"pipeline": str(self.directory), "cluster": self.cluster, "stages": stages}
        return {**report, "labels": made} if made else report


def main(argv: list[str] | None = None) -> int:
    """`make pipeline`: submit pretrain -> finetune; wait when asked (always without Slurm)."""
    parser = argparse.ArgumentParser(
        prog="python -m vitpod.workflows pipeline", description=__doc__
    )
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--model", default="", help="recipe (default: the profile's default_model)")
    parser.add_argument("--nodes", default="")
    parser.add_argument("--args", default="", help="extra trainer flags for both stages")
    parser.add_argument("--finetune-from", default="", help="skip pretrain; finetune this run")
    parser.add_argument("--teacher", default="", help="make missing token labels with this teacher")
    parser.add_argument("--teacher-checkpoint", default="", help="weights of a timm-name teacher")
    parser.add_argument("--wait", action="store_true", help="wait for the end (Slurm profiles)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait at most")
    ns = parser.parse_args(argv)
    run = Pipeline(
        ns.cluster,
        ns.model,
        ns.nodes or None,
        ns.args,
        finetune_from=ns.finetune_from or None,
        teacher=ns.teacher,
        teacher_checkpoint=ns.teacher_checkpoint,
    ).submit()
    assert run.directory is not None
    if ns.wait or not run._uses_slurm:
        try:
            report = run.wait(timeout=ns.timeout)
        except PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        write_json(run.directory / "report.json", report)
        print(json.dumps(report, indent=2))
        print(f"status: make status RUN={run.directory}")
        print(run.directory / "report.json")
        return 0
    print(f"status: make status RUN={run.directory}")
    print(run.directory)
    return 0
