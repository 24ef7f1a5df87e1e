"""Run status: per stage state, job ids, restarts, progress and root cause; the run's report."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitpod.registry import labelset, runfiles
from vitpod.registry.decision import (
    Decision,
    RecordError,
    engine_fields,
    find_decision,
)
from vitpod.workflows.jobs import jobstate, multicluster
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.watching import goodput, hangs, triage
from vitpod.workflows.watching.metricstail import MetricsTail, duration, newest_checkpoint_age
from vitpod.workflows.watching.rootcause import restarts_from_logs, root_cause
from vitpod.workflows.watching.runsizes import world_sizes


def status_line(s: JobState) -> str:
    """The stage's line of `make status`."""
    jobs = ",".join(s.job_ids) or "-"
    step = "-" if s.step is None else f"{s.step}/{s.total or '?'}"
    ips = "-" if s.images_per_s is None else f"{s.images_per_s:.1f}"
    loss = "-" if s.loss is None else f"{s.loss:.4f}"
    top1 = "" if s.top1 is None else f" top1={s.top1:.2f}%"
    ranks = f" ranks={'>'.join(map(str, s.sizes))}" if len(s.sizes) > 1 else ""
    where = f" cluster={s.cluster}" if s.cluster else ""
    return (
        f"{s.name:9s} {s.state:11s} jobs={jobs}{where} restarts={s.restarts}{ranks} "
        f"step={step} loss={loss} images/s={ips} ETA={duration(s.eta_s)} "
        f"ckpt_age={duration(s.ckpt_age_s)} engine={s.engine or '-'}{top1}  "
        f"{s.run_dir}"
    )


def as_dict(s: JobState) -> dict[str, Any]:
    """`vitpod status --json`: a stage's facts (its keys as they were before JobState)."""
    return {
        "stage": s.name, "run_dir": str(s.run_dir), "state": s.state, "job_ids": s.job_ids,
        "restarts": s.restarts, "last_step": s.step, "images_per_s": s.images_per_s,
        "top1": s.top1, "traceback": _plain(s.traceback), "diagnosis": _plain(s.diagnosis),
        "ledger": _plain(s.ledger), "sizes": list(s.sizes), "total_steps": s.total,
        "loss": s.loss, "eta_s": s.eta_s, "ckpt_age_s": s.ckpt_age_s, "engine": s.engine,
        "cluster": s.cluster, "pending": s.reason if s.state == "PENDING" else "",
    }  # fmt: skip


def _plain(value: Any) -> Any:
    is_record = dataclasses.is_dataclass(value) and not isinstance(value, type)
    return dataclasses.asdict(value) if is_record else value


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
    stage: JobState,
    info: list[jobstate.JobInfo],
    hang_factor: float = triage.HANG_FACTOR,
    accounting: bool = True,
    with_ledger: bool = True,
) -> JobState:
    """Fill in `stage` (in place; returned) from the scheduler's view of its jobs (`info`, oldest
    first) and what its run directory holds (`accounting`: the job ids are Slurm's, so sacct has
    their starts; `with_ledger=False`: the caller fills in the ledgers of all its stages at once,
    `add_ledgers`)."""
    run_dir = stage.run_dir
    assert run_dir is not None, "a stage has a run directory"
    if not stage.observe(info):
        stage.state = stage.recorded or ("NOT_SUBMITTED" if not stage.job_ids else jobstate.GONE)
        stage.restarts, stage.reason, stage.exit_code = 0, "", ""
    if stage.state == jobstate.GONE and (run_dir / runfiles.SUMMARY).is_file():
        stage.state = "COMPLETED"
    stage.restarts = max(stage.restarts, restarts_from_logs(run_dir / runfiles.LOGS))
    stage.step, stage.images_per_s, stage.top1 = progress(run_dir)
    failed = stage.state in jobstate.TERMINAL and stage.state != "COMPLETED"
    stage.traceback = root_cause(run_dir / runfiles.LOGS) if failed else None
    logs = run_dir / runfiles.LOGS
    stage.diagnosis = triage.diagnose(logs, stage.state, stage.exit_code) if failed else None
    if stage.state == "RUNNING":
        stage.diagnosis = triage.stuck(run_dir, hang_factor)
    ids = stage.job_ids if accounting else []
    stage.ledger = goodput.ledger(run_dir, ids) if stage.step and with_ledger else None
    stage.sizes = tuple(world_sizes(run_dir))
    tail = MetricsTail(run_dir)
    tail.update()
    now = time.time()
    stage.total, stage.loss = tail.total, tail.loss
    stage.eta_s = None if failed else tail.eta_s(now)
    stage.ckpt_age_s = newest_checkpoint_age(run_dir, now)
    stage.engine = engine_of(run_dir)
    stage.cluster = multicluster.cluster_of(run_dir) or stage.cluster
    stage.reason = stage.reason if stage.state == "PENDING" else ""
    return stage


def add_ledgers(statuses: list[JobState], accounting: bool = True) -> list[JobState]:
    """The goodput ledger of every stage that has trained, from ONE sacct for all of them."""
    stepped = [s for s in statuses if s.step and s.run_dir is not None]
    runs = [(Path(s.run_dir or ""), s.job_ids if accounting else []) for s in stepped]
    for stage, ledger in zip(stepped, goodput.ledgers(runs), strict=True):
        stage.ledger = ledger
    return statuses


def stages_of(run: Path) -> list[JobState]:
    """The stages of a pipeline directory (with pipeline.json's recorded states) or the one of
    a single run directory, before anything is asked of Slurm."""
    if (run / runfiles.PIPELINE).is_file():
        record = runfiles.read_record(run / runfiles.PIPELINE)
        return [
            JobState(
                name,
                Path(s["run_dir"]),
                [str(j) for j in s.get("job_ids", [])],
                recorded=s.get("state", ""),
            )  # fmt: skip
            for name, s in record["stages"].items()
        ]
    manifest = runfiles.read_manifest(run)
    ids = manifest.get("job_ids") or ([manifest["job_id"]] if manifest.get("job_id") else [])
    stage = manifest.get("stage") or manifest.get("recipe", {}).get("stage") or run.name
    return [JobState(str(stage), run, [str(j) for j in ids])]


def run_status(
    run: Path, executor: str | None = None, hang_factor: float = triage.HANG_FACTOR
) -> list[JobState]:
    """Status of every stage of a run; one batched scheduler poll for all of its jobs."""
    stages = stages_of(run)
    record_path = run / runfiles.PIPELINE
    record = runfiles.read_record(record_path) if record_path.is_file() else {}
    uses_slurm = (executor or record.get("executor", "slurm")) == "slurm"
    polls = (multicluster.poll([(s.run_dir, s.job_ids) for s in stages]) if uses_slurm
             else [{} for _ in stages])  # fmt: skip
    for stage, polled in zip(stages, polls, strict=True):
        infos = [polled[j] for j in stage.job_ids if j in polled]
        stage_status(stage, infos, hang_factor, uses_slurm, with_ledger=False)
    return add_ledgers(stages, uses_slurm)


def format_status(statuses: list[JobState]) -> str:
    out = []
    for s in statuses:
        out.append(status_line(s))
        if s.traceback is not None:
            out.append(f"  root cause ({s.traceback.path}:{s.traceback.line}):")
            out.extend("    " + line for line in s.traceback.text.splitlines())
        if s.diagnosis is not None:
            out.extend("  " + line for line in s.diagnosis.text())
        if s.state == "PENDING" and s.reason:
            out.append(f"  pending: Slurm's reason: {s.reason}")
        out.extend("  " + line for line in hangs.lines(Path(s.run_dir or "")))
        out.extend("  " + line for line in checkpoint_notes(Path(s.run_dir or "")))
        if s.ledger is not None:
            out.append("  " + s.ledger.line())
            decision = decision_of(Path(s.run_dir or ""))
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
