"""The submitit chain: pretrain on one partition, then finetune from it on another.

Named a chain so that "pipeline" keeps one meaning in the code: pipeline parallelism
(trainer/engines/pipeline_parallel.py). Users still say `make pipeline`; the record is
pipeline.json.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.jobs.rundir import new_run_path, runs_root, write_json
from vitpod.workflows.pipeline import chain_cross, chain_submit, chain_watch
from vitpod.workflows.pipeline.chain_labels import plan_labels
from vitpod.workflows.pipeline.chain_stage import (
    decision_of,
    entry_of,
    job_plan,
    planned,
    reattached,
)
from vitpod.workflows.pipeline.chain_watch import ChainError
from vitpod.workflows.planning import placement, preflight, sbatchopts
from vitpod.workflows.planning.plan import Request
from vitpod.workflows.planning.recipe import recipe_name
from vitpod.workflows.site.profile import load_profile
from vitpod.workflows.submit.stageres import StageResources, write_rendered
from vitpod.workflows.watching import jobctl, status

__all__ = ["STAGES", "Chain", "ChainError", "JobState"]
STAGES = ("pretrain", "finetune")


class Chain:
    """Pretrain on one partition, then finetune from its final model on another, via submitit.

    >>> run = Chain(cluster="dgxpod", model="volo_d5", nodes=5, finetune_nodes=2).submit()
    >>> run.status(); run.wait(timeout=3600)

    Render, review, submit: Chain(..., offline=True).render() writes every stage's run
    directory and asks Slurm nothing; submit() (on it, or on Chain.from_dir(<that directory>))
    then sbatches exactly those files, after the preflight again against the live cluster, and
    refuses a file changed since rendering (workflows/pipeline/chain_submit.py).

    Per-stage nodes/time: workflows/submit/stageres.py. slurm=, finetune_slurm= (the
    fine-tune's, winning): sbatch options (workflows/planning/sbatchopts.py),
    e.g. slurm={"account": "proj", "extra": "--mail-type=END"}.
    place=True: the first stage's node count by predicted finish (workflows/planning/placement.py).

    Slurm profiles: each stage's job.sbatch is submitted as rendered; the finetune at once
    with `sbatch --dependency=afterok:<pretrain>`, so
    it starts only after the pretrain really completed (requeues included). finetune_cluster=
    another profile (another Slurm cluster or storage root): the fine-tune is submitted there by
    wait()/follow()/status() once the pretrain completed and its model was carried across
    (workflows/pipeline/chain_cross.py); finetune_run_root= its run root (default: that profile's).
    The local profile (submitit's LocalExecutor running each stage's job.sh) starts it from
    status()/wait() after the pretrain.
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
        time: str = "",
        finetune_nodes: int | str | None = None,
        finetune_time: str = "",
        offline: bool = False,
        slurm: sbatchopts.SbatchOptions | Mapping[str, Any] | None = None,
        finetune_slurm: sbatchopts.SbatchOptions | Mapping[str, Any] | None = None,
        finetune_cluster: str = "",
        finetune_run_root: str | None = None,
        place: bool = False,
        deadline: str = "",
    ) -> None:
        self.cluster, self.model = cluster, model
        self.finetune_cluster = finetune_cluster or cluster
        self.finetune_run_root = finetune_run_root
        self.crossing = False  # the fine-tune goes to another cluster/storage after the pretrain
        self.handover: dict[str, Any] = {}
        self.resources = StageResources(
            "" if nodes is None else str(nodes), time,
            "" if finetune_nodes is None else str(finetune_nodes), finetune_time,
            sbatchopts.options(slurm), sbatchopts.options(finetune_slurm, "FT_"),
        )  # fmt: skip
        placement.check_request(place, deadline)
        self.offline, self.place, self.deadline = offline, place, deadline
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
        self.stages: dict[str, JobState] = {}
        self.recorded: dict[str, Any] = {}
        """pipeline.json as read back by from_dir (empty for a chain planned here)."""

    @classmethod
    def from_dir(cls, path: str | Path) -> Chain:
        """Reattach to a pipeline directory from a fresh interpreter: its pipeline.json names
        each stage's run directory and job ids; status(), wait(), follow(), report() and
        cancel() then work as on the Chain that submitted it (nothing is planned again)."""
        directory = Path(path).expanduser().absolute()
        if not (directory / runfiles.PIPELINE).is_file():
            raise ConfigError(f"{directory}: no {runfiles.PIPELINE}; pass the pipeline "
                              "directory `make pipeline` printed")  # fmt: skip
        record = json.loads((directory / runfiles.PIPELINE).read_text())
        chain = cls(record.get("cluster", ""), record.get("model", ""),
                    offline=bool(record.get("offline")),
                    finetune_cluster=record.get("finetune_cluster", ""))  # fmt: skip
        chain.directory, chain.recorded = directory, record
        chain.crossing, chain.handover = bool(record.get("crossing")), record.get("handover", {})
        chain.stages = {n: reattached(n, s) for n, s in record["stages"].items()}
        chain.label_job_ids = list(
            dict.fromkeys(str(j) for lab in record.get("labels", {}).values()
                          for j in lab.get("job_ids", []))
        )  # fmt: skip
        return chain

    # ---- planning: everything validated, nothing written
    def plan(self) -> dict[str, JobState]:
        """Plan every stage and run the whole preflight; raises ConfigError, writes nothing.
        Offline: only the checks that need no cluster (as `make render`)."""
        profile, ft_profile = load_profile(self.cluster), load_profile(self.finetune_cluster)
        chain_cross.refuse_mixed(profile, ft_profile)
        model = recipe_name(profile.model_for(self.model))
        root = runs_root(profile, self.run_root)
        directory = new_run_path(root, model, "pipeline")
        same = self.finetune_cluster == self.cluster and not self.finetune_run_root
        ft_root = root if same else runs_root(ft_profile, self.finetune_run_root)
        ft_dir = chain_cross.finetune_directory(directory, root, ft_root)
        self.crossing = self.wanted == STAGES and (
            chain_cross.crosses(profile, ft_profile) or ft_dir != directory
        )
        records: dict[str, JobState] = {}
        self.label_jobs = {}
        for stage in self.wanted:
            chained = stage == "finetune" and not self.finetune_from
            ours = directory / "pretrain" if ft_dir == directory else ft_dir / chain_cross.SOURCE
            source = self.finetune_from or str(ours)
            req = Request(
                cluster=self.cluster if stage == "pretrain" else self.finetune_cluster,
                model=model, stage=stage,
                **self.resources.request(stage, profile if stage == "pretrain" else ft_profile,
                                         "pretrain" in self.wanted),
                args=self.stage_args[stage], entry=self.entry,  # type: ignore[arg-type]
                run_dir=(directory if stage == "pretrain" else ft_dir) / stage,
                finetune_from=source if stage == "finetune" else "",
                finetune_pending=chained, offline=self.offline,
            )  # fmt: skip
            plan = placement.plan_stage(req, self.place and stage == self.wanted[0], self.deadline)
            pending = plan_labels(self, plan, directory)
            if not self.offline:
                preflight.check(plan, chained=chained, labels_pending=pending)
            records[stage] = planned(stage, plan)
        labeled = [r.plan and (r.plan.trainer or {}).get("token_label") for r in records.values()]
        if self.teacher and not any(labeled):
            raise ConfigError(
                f"TEACHER={self.teacher!r}: no stage of recipe {model} ({', '.join(records)}) "
                "trains with token labels, so the teacher would be ignored; drop TEACHER, or "
                'turn them on with ARGS="--token-label ..."'
            )
        if self.crossing and "finetune" in self.label_jobs:
            raise ConfigError(
                f"TEACHER with FT_CLUSTER={self.finetune_cluster}: make the "
                "fine-tune's token labels on its cluster first (make token-labels)"
            )
        if self.crossing and not self.offline:
            for line in chain_cross.check_before(
                job_plan(records["pretrain"]), job_plan(records["finetune"]), Path(source)
            ):
                print(f"ok: {line}", flush=True)  # fmt: skip
        self.directory = directory
        return records

    def render(self) -> dict[str, Path]:
        """Plan, then write every stage's run directory; nothing submitted (OFFLINE=1)."""
        records = self.plan()
        assert self.directory is not None
        written = write_rendered(self.directory, self.label_jobs, records, self._manifest)
        self.stages = records
        self._save()
        return written

    # ---- submission
    def submit(self) -> Chain:
        """Submit the chain: planned, preflighted and written here, or, after render() (or
        Chain.from_dir of a rendered pipeline), the rendered files as they are, once their
        sha256 still match and the preflight passed again against the live cluster."""
        submitted = [j for rec in self.stages.values() for j in rec.job_ids]
        if submitted or self.label_job_ids:
            ids = " ".join(submitted + self.label_job_ids)
            raise RuntimeError(f"this chain was already submitted (jobs {ids}); create a new "
                               "Chain (or Chain.from_dir(...) to watch it)")  # fmt: skip
        if self.stages:
            chain_submit.submit_rendered(self)
            return self
        if self.offline:
            raise ConfigError("offline=True (OFFLINE=1) renders only: call render(), review the "
                              "files, then submit() (Slurm is asked then)")  # fmt: skip
        records = self.plan()
        assert self.directory is not None
        write_rendered(self.directory, self.label_jobs, records, self._manifest)
        self.stages = records
        for rec in records.values():
            if (decision := decision_of(rec)) is not None:
                print(decision.log_line(), flush=True)
        chain_submit.launch(self, owned=True)
        return self

    @property
    def uses_slurm(self) -> bool:
        if self.recorded:
            return self.recorded.get("executor", "slurm") == "slurm"
        first = next(iter(self.stages.values()))
        return job_plan(first).profile.scheduler == "slurm"

    def _manifest(self, rec: JobState) -> dict[str, Any]:
        """A stage's manifest.json as rendered (submission adds its job id and dependency)."""
        manifest = job_plan(rec).manifest(
            pipeline={"directory": str(self.directory), "submitted_via": "sbatch"}
        )
        return {**manifest, **rec.manifest_extra}

    def _submit_stage(self, rec: JobState, dependency: str | None) -> None:
        chain_submit.submit_stage(self, rec, dependency)

    def _cancel_submitted(self) -> str:
        """Cancel every submitted stage; 'jobs cancelled' or what scancel said when it failed."""
        jobs = [rec.job for rec in self.stages.values() if rec.job is not None]
        if not jobs:
            return "no jobs to cancel"
        if self.uses_slurm:
            try:
                slurm.scancel([str(job.job_id) for job in jobs])
            except slurm.SlurmError as exc:
                print(f"warning: {exc}", file=sys.stderr)
                return f"jobs not cancelled ({exc})"
        else:
            for job in jobs:
                job.cancel(check=False)  # the local executor: SIGINT to each task's process
        return "jobs cancelled"

    def _save(self) -> None:
        assert self.directory is not None
        write_json(self.directory / runfiles.PIPELINE, self._record())

    def _record(self) -> dict[str, Any]:
        """pipeline.json: the stages' run directories, job ids, states and topology."""
        return {
            "cluster": self.cluster,
            **(
                {
                    "finetune_cluster": self.finetune_cluster,
                    "crossing": True,
                    "handover": self.handover,
                }
                if self.crossing
                else {}
            ),
            "model": self.model,
            "executor": "slurm" if self.uses_slurm else "local",
            "offline": self.offline,
            "updated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "labels": {
                stage: {
                    "run_dir": str(job.plan.run_dir),
                    "label_dir": str(job.label_dir),
                    "job_ids": self.label_job_ids,
                }
                for stage, job in self.label_jobs.items()
            }
            or {
                s: {**e, "job_ids": self.label_job_ids}
                for s, e in self.recorded.get("labels", {}).items()
            },  # fmt: skip
            "stages": {name: entry_of(rec) for name, rec in self.stages.items()},
        }

    # ---- watching (workflows/pipeline/chain_watch.py)
    def status(self) -> list[JobState]:
        """Per stage (its JobState, filled in): state, job ids, restarts, last step, images/s,
        and a failure's root cause."""
        return chain_watch.status_of(self)

    def wait(self, timeout: float | None = None, poll_s: float = 5.0) -> dict[str, Any]:
        """Block until every stage completed (returns the report) or one failed (raises)."""
        return chain_watch.wait(self, timeout, poll_s)

    def follow(self, interval: float | None = None, console: Any = None) -> int:
        """Live view of every stage until the run ends (workflows/watching/follow.py); 0 when all
        completed (report.json's path printed), 1 when one failed (root cause printed)."""
        return chain_watch.follow_chain(self, interval, console)

    def report(self) -> dict[str, Any]:
        """Each stage's final accuracy and where its checkpoints, logs and final model are."""
        assert self.directory is not None
        return status.pipeline_report(self.directory, self._record())

    def cancel(self) -> list[str]:
        """Cancel every job of the chain still queued or running (its stages and labeling
        arrays) with one scancel; returns their ids. The directories stay (`vitpod resume`)."""
        if not self.stages:
            raise RuntimeError("submit() first")
        if not self.uses_slurm:
            self._cancel_submitted()
            return [j for rec in self.stages.values() if rec.job is not None for j in rec.job_ids]
        first = next(iter(self.stages.values())).cluster
        ids = {first: list(self.label_job_ids)}  # one scancel per Slurm cluster
        for rec in self.stages.values():
            ids.setdefault(rec.cluster, []).extend(rec.job_ids)
        done: list[str] = []
        for cluster, jobs in ids.items():
            with slurm.on_cluster(cluster):
                done += jobctl.cancel_jobs(jobs)
        return done
