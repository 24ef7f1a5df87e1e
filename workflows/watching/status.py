"""Run status: per stage state, job ids, restarts, progress and root cause; the run's report."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitpod.registry import labelset, runfiles
from vitpod.registry.decision import (
    Decision,
    RecordError,
    engine_fields,
    find_decision,
)
from vitpod.workflows.submit import jobstate, multicluster
from vitpod.workflows.watching import goodput, hangs, triage
from vitpod.workflows.watching.metricstail import MetricsTail, duration, newest_checkpoint_age
from vitpod.workflows.watching.rootcause import Traceback, restarts_from_logs, root_cause
from vitpod.workflows.watching.runsizes import world_sizes


@dataclass
class StageStatus:
    """What `make status` shows for one stage of a run."""

    stage: str
    run_dir: str
    state: str
    job_ids: list[str]
    restarts: int
    last_step: int | None
    images_per_s: float | None
    top1: float | None
    traceback: Traceback | None
    diagnosis: triage.Diagnosis | None = None
    ledger: goodput.Ledger | None = None
    sizes: tuple[int, ...] = ()  # ranks of each stretch, when a restart changed the size
    total_steps: int | None = None
    loss: float | None = None  # rank 0's newest step
    eta_s: float | None = None  # None: not known (no steps yet, or the stage failed)
    ckpt_age_s: float | None = None  # since the newest committed checkpoint
    engine: str | None = None  # from plan.json: "ring", or "mesh(dp=2,tp=2,pp=1)"
    cluster: str = ""  # the Slurm cluster its profile names (multicluster.py); '' the default
    pending: str = ""  # Slurm's reason a PENDING job waits (BadConstraints: it never starts)

    def line(self) -> str:
        jobs = ",".join(self.job_ids) or "-"
        step = "-" if self.last_step is None else f"{self.last_step}/{self.total_steps or '?'}"
        ips = "-" if self.images_per_s is None else f"{self.images_per_s:.1f}"
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        top1 = "" if self.top1 is None else f" top1={self.top1:.2f}%"
        ranks = f" ranks={'>'.join(map(str, self.sizes))}" if len(self.sizes) > 1 else ""
        where = f" cluster={self.cluster}" if self.cluster else ""
        return (
            f"{self.stage:9s} {self.state:11s} jobs={jobs}{where} restarts={self.restarts}{ranks} "
            f"step={step} loss={loss} images/s={ips} ETA={duration(self.eta_s)} "
            f"ckpt_age={duration(self.ckpt_age_s)} engine={self.engine or '-'}{top1}  "
            f"{self.run_dir}"
        )


def engine_of(run_dir: Path) -> str | None:
    """The engine plan.json records, with its layout when it is not plain data parallel."""
    try:
        decision = find_decision(run_dir)
    except RecordError as exc:
        return f"? ({exc})"
    if decision is None:
        return None
    layout = decision.layout
    if layout.tp == 1 and layout.pp == 1:
        return decision.engine.name
    return f"{decision.engine.name}(dp={layout.dp},tp={layout.tp},pp={layout.pp})"


def progress(run_dir: Path) -> tuple[int | None, float | None, float | None]:
    """(last step, images/s, top-1) from the trainer's metrics JSONL (contract 3)."""
    last_step, rank_ips, summary = None, {}, None
    for path in runfiles.metrics_files(run_dir):
        for rec in runfiles.read_jsonl(path):
            if rec.get("kind") == "step":
                last_step = max(last_step or 0, int(rec["step"]))
                rank_ips[path.name] = float(rec.get("images_per_s", 0.0))
            elif rec.get("kind") == "summary":
                summary = rec
    if summary is not None:
        return (
            int(summary.get("steps", last_step or 0)),
            summary.get("images_per_s"),
            summary.get("top1"),
        )
    images_per_s = sum(rank_ips.values()) if rank_ips else None
    return last_step, images_per_s, None


def stage_status(
    stage: str,
    run_dir: Path,
    job_ids: list[str],
    info: list[jobstate.JobInfo],
    recorded_state: str = "",
    hang_factor: float = triage.HANG_FACTOR,
    accounting: bool = True,
    with_ledger: bool = True,
) -> StageStatus:
    """Combine the scheduler's view of a stage's jobs with what its run directory holds
    (`accounting`: the job ids are Slurm's, so sacct has their starts; `with_ledger=False`:
    the caller fills in the ledgers of all its stages at once, `add_ledgers`)."""
    if info:
        state = info[-1].state
        restarts = max(i.restarts for i in info)
    else:
        state = recorded_state or ("NOT_SUBMITTED" if not job_ids else jobstate.GONE)
        restarts = 0
    if state == jobstate.GONE and (run_dir / runfiles.SUMMARY).is_file():
        state = "COMPLETED"
    restarts = max(restarts, restarts_from_logs(run_dir / runfiles.LOGS))
    last_step, ips, top1 = progress(run_dir)
    failed = state in jobstate.TERMINAL and state != "COMPLETED"
    tb = root_cause(run_dir / runfiles.LOGS) if failed else None
    exit_code = info[-1].exit_code if info else ""
    found = triage.diagnose(run_dir / runfiles.LOGS, state, exit_code) if failed else None
    if state == "RUNNING":
        found = triage.stuck(run_dir, hang_factor)
    ids = job_ids if accounting else []
    ledger = goodput.ledger(run_dir, ids) if last_step and with_ledger else None
    sizes = tuple(world_sizes(run_dir))
    tail = MetricsTail(run_dir)
    tail.update()
    now = time.time()
    eta = None if failed else tail.eta_s(now)
    return StageStatus(stage, str(run_dir), state, job_ids, restarts, last_step, ips, top1, tb,
                       found, ledger, sizes, tail.total, tail.loss, eta,
                       newest_checkpoint_age(run_dir, now), engine_of(run_dir),
                       multicluster.cluster_of(run_dir),
                       info[-1].reason if info and state == "PENDING" else "")  # fmt: skip


def add_ledgers(statuses: list[StageStatus], accounting: bool = True) -> list[StageStatus]:
    """The goodput ledger of every stage that has trained, from ONE sacct for all of them."""
    stepped = [s for s in statuses if s.last_step]
    runs = [(Path(s.run_dir), s.job_ids if accounting else []) for s in stepped]
    for stage, ledger in zip(stepped, goodput.ledgers(runs), strict=True):
        stage.ledger = ledger
    return statuses


def stages_of(run: Path) -> list[tuple[str, Path, list[str], str]]:
    """(stage, run_dir, job ids, recorded state) for a pipeline directory or a single run dir."""
    if (run / runfiles.PIPELINE).is_file():
        record = runfiles.read_record(run / runfiles.PIPELINE)
        return [
            (name, Path(s["run_dir"]), [str(j) for j in s.get("job_ids", [])], s.get("state", ""))
            for name, s in record["stages"].items()
        ]
    manifest = runfiles.read_manifest(run)
    ids = manifest.get("job_ids") or ([manifest["job_id"]] if manifest.get("job_id") else [])
    stage = manifest.get("stage") or manifest.get("recipe", {}).get("stage") or run.name
    return [(str(stage), run, [str(j) for j in ids], "")]


def run_status(
    run: Path, executor: str | None = None, hang_factor: float = triage.HANG_FACTOR
) -> list[StageStatus]:
    """Status of every stage of a run; one batched scheduler poll for all of its jobs."""
    stages = stages_of(run)
    record_path = run / runfiles.PIPELINE
    record = runfiles.read_record(record_path) if record_path.is_file() else {}
    uses_slurm = (executor or record.get("executor", "slurm")) == "slurm"
    polls = (multicluster.poll([(rd, ids) for _, rd, ids, _ in stages]) if uses_slurm
             else [{} for _ in stages])  # fmt: skip
    statuses = [
        stage_status(
            name,
            rd,
            ids,
            [polled[j] for j in ids if j in polled],
            recorded,
            hang_factor,
            uses_slurm,
            with_ledger=False,
        )  # fmt: skip
        for (name, rd, ids, recorded), polled in zip(stages, polls, strict=True)
    ]
    return add_ledgers(statuses, uses_slurm)


def format_status(statuses: list[StageStatus]) -> str:
    out = []
    for s in statuses:
        out.append(s.line())
        if s.traceback is not None:
            out.append(f"  root cause ({s.traceback.path}:{s.traceback.line}):")
            out.extend("    " + line for line in s.traceback.text.splitlines())
        if s.diagnosis is not None:
            out.extend("  " + line for line in s.diagnosis.text())
        if s.pending:
            out.append(f"  pending: Slurm's reason: {s.pending}")
        out.extend("  " + line for line in hangs.lines(Path(s.run_dir)))
        out.extend("  " + line for line in checkpoint_notes(Path(s.run_dir)))
        if s.ledger is not None:
            out.append("  " + s.ledger.line())
            decision = decision_of(Path(s.run_dir))
            if decision is not None and decision.placement is not None:
                out.append("  " + decision.placement.against(s.ledger.start, s.ledger.end))
            if decision is not None and decision.checkpoint is not None:
                restarts = max(0, s.ledger.attempts - 1)
                out.append("  " + decision.checkpoint.against(s.ledger.parts["lost"], restarts))
    return "\n".join(out)


def checkpoint_notes(run_dir: Path) -> list[str]:
    """One line each: checkpoints set aside as damaged (kept until removed by hand), and what
    under checkpoints/ is no checkpoint (resume and rotation leave it alone)."""
    root = run_dir / runfiles.CHECKPOINTS
    aside_dir = root / runfiles.CHECKPOINT_DISCARDED
    aside = sorted(p.name for p in aside_dir.iterdir()) if aside_dir.is_dir() else []
    other = sorted(
        p.name for p in (root.iterdir() if root.is_dir() else [])
        if p.name != runfiles.CHECKPOINT_DISCARDED and not runfiles.is_checkpoint_name(p.name)
    )  # fmt: skip
    lines = [f"checkpoints set aside as damaged (kept): {', '.join(aside)} in {aside_dir}"]
    lines = lines if aside else []
    if other:
        lines.append(f"not checkpoints, left alone in {root}: {', '.join(other)}")
    return lines


def decision_of(run_dir: Path) -> Decision | None:
    """The run's plan.json (None: none, or no readable record)."""
    try:
        return find_decision(run_dir)
    except RecordError:
        return None  # engine_of shows why on the stage's line


def stage_report(stage: Mapping[str, Any], state: str, ledger: goodput.Ledger) -> dict[str, Any]:
    """One stage of report.json: its result (summary.json), goodput and where its files are.
    `stage`: the stage's entry in pipeline.json."""
    run_dir = Path(stage["run_dir"])
    summary = runfiles.read_summary(run_dir) or {}
    out = {
        "state": state,
        "job_ids": list(stage.get("job_ids", [])),
        **({"cluster": c} if (c := multicluster.cluster_of(run_dir)) else {}),
        **{key: summary.get(key) for key in ("top1", "top5", "steps", "images_per_s")},
        **engine_fields(find_decision(run_dir)),
        "run_dir": str(run_dir),
        "checkpoints": str(run_dir / runfiles.CHECKPOINTS),
        "final_model": str(runfiles.final_model(run_dir)),
        "logs": str(run_dir / runfiles.LOGS),
        "goodput": ledger.as_dict(),
    }
    decision = decision_of(run_dir)
    if decision is not None and decision.checkpoint is not None:
        restarts = max(0, ledger.attempts - 1)
        out["checkpoint_interval"] = {
            "steps": decision.checkpoint.steps, "restarts": restarts,
            "expected_lost_s": decision.checkpoint.expected_lost_s(restarts),
            "lost_s": ledger.parts["lost"],
        }  # fmt: skip
    placed = decision.placement if decision else None
    return {**out, "placement": placed.compared(ledger.start, ledger.end)} if placed else out


def pipeline_report(
    directory: Path, record: Mapping[str, Any], states: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """report.json of a pipeline directory from its record (pipeline.json's content): each
    stage's result, and the token labels its labeling jobs made. `states` overrides the
    recorded state of a stage."""
    states = states or {}
    slurm = record.get("executor", "slurm") == "slurm"
    runs = [(Path(s["run_dir"]), [str(j) for j in s.get("job_ids", [])] if slurm else [])
            for s in record["stages"].values()]  # fmt: skip
    stages = {
        name: stage_report(stage, states.get(name, stage.get("state", "")), ledger)
        for (name, stage), ledger in zip(
            record["stages"].items(), goodput.ledgers(runs), strict=True
        )  # fmt: skip
    }
    made = {
        stage: {"label_dir": job["label_dir"], "run_dir": job["run_dir"],
                "manifest": labelset.read_manifest(job["label_dir"])}
        for stage, job in record.get("labels", {}).items()
    }  # fmt: skip
    total = goodput.Ledger()
    for stage in stages.values():
        total.add(goodput.Ledger(**{k: v for k, v in stage["goodput"].items() if k != "other"}))
    report = {"pipeline": str(directory), "cluster": record.get("cluster"), "stages": stages,
              "goodput": total.as_dict()}  # fmt: skip
    return {**report, "labels": made} if made else report
