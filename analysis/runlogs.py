"""Read one run directory's metrics JSONL (contract 3) into step records and a summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles

TIME_PARTS = ("data", "compute", "comm", "optimizer")


@dataclass(frozen=True, slots=True)
class Step:
    """One optimizer step of one rank."""

    step: int
    rank: int
    world_size: int
    batch_size: int
    images_per_s: float
    time: dict[str, float]
    warmup: bool
    peak_mem_bytes: int = 0


@dataclass(slots=True)
class RunLog:
    """Everything the trainer logged for one run; `error` says why the run counts as failed."""

    run_dir: Path
    steps: list[Step] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def timed_steps(self) -> list[Step]:
        """Steps outside warmup (the ones throughput and breakdowns are computed from)."""
        return [s for s in self.steps if not s.warmup]


def _step(record: dict[str, Any], where: str) -> Step:
    try:
        time = {part: float(record["time"][part]) for part in (*TIME_PARTS, "step")}
        return Step(
            step=int(record["step"]),
            rank=int(record["rank"]),
            world_size=int(record["world_size"]),
            batch_size=int(record["batch_size"]),
            images_per_s=float(record["images_per_s"]),
            time=time,
            warmup=bool(record.get("warmup", False)),
            peak_mem_bytes=int(record.get("peak_mem_bytes", 0)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: step line lacks or mistypes {err}") from None


def read_run(run_dir: Path) -> RunLog:
    """All rank files of a run; a run without a summary line or summary.json is failed."""
    run = RunLog(run_dir=Path(run_dir))
    files = runfiles.metrics_files(run.run_dir)
    if not run.run_dir.is_dir():
        run.error = f"no run directory {run.run_dir}"
        return run
    if not files:
        run.error = f"no {runfiles.METRICS}/rank*.jsonl in {run.run_dir}"
    for path in files:
        for record in runfiles.read_jsonl(path):
            if record["kind"] == "step":
                run.steps.append(_step(record, str(path)))
            elif record["kind"] == "summary":
                run.summary = record
            elif record["kind"] == "eval":
                run.evals.append(record)
    if run.summary is None:
        run.summary = runfiles.read_summary(run.run_dir)
    if run.summary is None and run.error is None:
        run.error = "no summary (the run failed or has not finished)"
    elif run.summary is not None and not run.timed_steps and run.error is None:
        run.error = "no timed (non-warmup) steps"
    return run
