"""Follow a run until it ends: `make status RUN=... FOLLOW=1`, `make scaling FOLLOW=1`,
`Pipeline.follow()`.

One row per stage (a run or pipeline directory) or per sweep point plus the report job (a study
directory): scheduler state, job ids and restarts, step/total, loss, images/s, ETA and the age of
the newest checkpoint. On a terminal the rows are a live table (rich's Live display,
https://rich.readthedocs.io/en/stable/live.html); without one (a log file, CI) the same facts
are printed as plain lines at an interval. The view ends by itself when the run ends and prints
the root-cause traceback of each failed stage, or the report's path.

Each poll costs one batched squeue (sacct only for jobs squeue forgot) and reads only the lines
appended to the metrics JSONL since the previous poll.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry.decision import engine_fields, find_decision
from vitpod.workflows import jobstate, status
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.rundir import write_json

STUDY_FILE = "study.json"
REPORT_HTML = Path("report") / "report.html"
ETA_WINDOW = 20  # steps of rank 0 the rate (and so the ETA) is measured over
# A job waiting on a dependency that can no longer be met never starts (without Slurm's
# kill_invalid_depend it pends forever): for the view it has ended.
_NEVER_STARTS = "DependencyNeverSatisfied"


class MetricsTail:
    """The newest step of a run from its metrics/rank*.jsonl, reading only appended lines."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.offsets: dict[Path, int] = {}
        self.step: int | None = None
        self.total: int | None = None
        self.loss: float | None = None
        self.rank_ips: dict[int, float] = {}
        self.top1: float | None = None
        self.summary_ips: float | None = None
        self.done = False
        # (step, wall time) of rank 0's recent steps; cleared when a restart goes back in steps.
        self.recent: deque[tuple[int, float]] = deque(maxlen=ETA_WINDOW)
        self.step_s: deque[float] = deque(maxlen=ETA_WINDOW)

    def update(self) -> None:
        for path in sorted((self.run_dir / "metrics").glob("rank*.jsonl")):
            for record in self._new_records(path):
                self._take(record)

    def _new_records(self, path: Path) -> list[dict[str, Any]]:
        offset = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written now is read on the next poll
        self.offsets[path] = offset + end
        records = []
        for line in data[:end].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def _take(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "summary":
            self.done = True
            self.top1 = rec.get("top1", self.top1)
            self.summary_ips = rec.get("images_per_s")
            self.step = rec.get("steps", self.step)
            return
        if kind == "eval":
            self.top1 = rec.get("top1")
            return
        if kind != "step":
            return
        rank, step = int(rec.get("rank", 0)), int(rec["step"])
        self.rank_ips[rank] = float(rec.get("images_per_s", 0.0))
        if rank != 0:
            return
        if self.step is not None and step < self.step:  # resumed from an older checkpoint
            self.recent.clear()
            self.step_s.clear()
        self.step, self.loss = step, rec.get("loss")
        self.total = rec.get("total_steps", self.total)
        if "wall_time" in rec:
            self.recent.append((step, float(rec["wall_time"])))
        self.step_s.append(float(rec.get("time", {}).get("step", 0.0)))

    @property
    def images_per_s(self) -> float | None:
        if self.summary_ips is not None:
            return float(self.summary_ips)
        return sum(self.rank_ips.values()) if self.rank_ips else None

    def eta_s(self) -> float | None:
        """Seconds left at the recent pace (wall clock, so data loading and checkpoints count)."""
        if self.done or (self.step is not None and self.total and self.step >= self.total):
            return 0.0  # finished, or past its last step (final eval, saving)
        if self.step is None or not self.total:
            return None
        left = self.total - self.step
        if len(self.recent) >= 2 and self.recent[-1][0] > self.recent[0][0]:
            (s0, t0), (s1, t1) = self.recent[0], self.recent[-1]
            return left * (t1 - t0) / (s1 - s0)
        if self.step_s:  # an older trainer without wall_time: the measured step time
            return left * sum(self.step_s) / len(self.step_s)
        return None


def newest_checkpoint_age(run_dir: Path, now: float) -> float | None:
    """Seconds since the newest checkpoint's rank-0 manifest was written (None: none yet)."""
    times = [p.stat().st_mtime for p in (run_dir / "checkpoints").glob("*/rank0.json")]
    return now - max(times) if times else None


@dataclass
class Row:
    """One line of the view."""

    name: str
    run_dir: Path | None
    job_ids: list[str]
    state: str = "PENDING"
    reason: str = ""
    restarts: int = 0
    ended: bool = False
    ok: bool = False
    tail: MetricsTail | None = None
    ckpt_age_s: float | None = None
    gone_polls: int = field(default=0, repr=False)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def cells(row: Row) -> dict[str, str]:
    """The row's columns as text (shared by the live table and the plain lines)."""
    tail = row.tail
    step, total = (tail.step, tail.total) if tail else (None, None)
    ips = tail.images_per_s if tail else None
    reason = row.reason if len(row.reason) <= 40 else row.reason[:39] + "…"
    state = row.state + (f" ({reason})" if reason and not row.ended else "")
    return {
        "stage": row.name,
        "state": state,
        "jobs": ",".join(row.job_ids) or "-",
        "restarts": str(row.restarts),
        "step": "-" if step is None else f"{step}/{total or '?'}",
        "loss": "-" if tail is None or tail.loss is None else f"{tail.loss:.4f}",
        "images/s": "-" if ips is None else f"{ips:.1f}",
        "ETA": _duration(tail.eta_s()) if tail else "-",
        "ckpt age": _duration(row.ckpt_age_s),
    }


class Target:
    """What is followed: a run or pipeline directory, or a scaling study directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.study = (path / STUDY_FILE).is_file()
        self.rows: list[Row] = []
        self.uses_slurm = True
        self.note = ""  # shown under the rows (a failed poll)
        if self.study:
            self._study_rows()
        else:
            self._run_rows()
        ids = [j for row in self.rows for j in row.job_ids]
        self.poller = jobstate.JobStatePoller(ids)

    def _run_rows(self) -> None:
        record_path, manifest_path = self.path / status.PIPELINE_FILE, self.path / "manifest.json"
        if record_path.is_file():
            self.uses_slurm = json.loads(record_path.read_text()).get("executor") != "local"
        elif manifest_path.is_file():
            profile = json.loads(manifest_path.read_text()).get("profile", {})
            self.uses_slurm = profile.get("values", {}).get("scheduler", "slurm") == "slurm"
        for name, run_dir, ids, _recorded in status.stages_of(self.path):
            self.rows.append(Row(name, run_dir, ids, tail=MetricsTail(run_dir)))

    def _study_rows(self) -> None:
        study = json.loads((self.path / STUDY_FILE).read_text())
        array = study.get("job_id")
        for point in study["points"]:
            run_dir = self.path / point["run_dir"]
            ids = [f"{array}_{point['index']}"] if array else []
            tail = MetricsTail(run_dir)
            self.rows.append(Row(f"{point['gpus']} GPU(s)", run_dir, ids, tail=tail))
        report_ids = [str(study["report_job_id"])] if study.get("report_job_id") else []
        self.rows.append(Row("report", None, report_ids))

    def poll(self) -> None:
        infos: dict[str, jobstate.JobInfo] = {}
        self.note = ""
        if self.uses_slurm:
            try:
                infos = self.poller.poll()
            except (jobstate.SlurmCommandError, OSError, subprocess.TimeoutExpired) as exc:
                # A controller restarting for a moment: keep the last states, try again.
                self.note = f"squeue did not answer ({exc}); showing the last known states"
        recorded = {name: state for name, _, _, state in self._recorded()}
        now = time.time()
        for row in self.rows:
            if row.tail is not None:
                row.tail.update()
                row.ckpt_age_s = newest_checkpoint_age(row.tail.run_dir, now)
            known = [infos[j] for j in row.job_ids if j in infos]
            self._set_state(row, known, recorded.get(row.name, ""))

    def _recorded(self) -> list[tuple[str, Path, list[str], str]]:
        """States kept in pipeline.json (the local executor's only source of truth)."""
        if self.study or self.uses_slurm:
            return []
        return status.stages_of(self.path)

    def _set_state(self, row: Row, infos: list[jobstate.JobInfo], recorded: str) -> None:
        done_here = row.run_dir is not None and (row.run_dir / "summary.json").is_file()
        if row.run_dir is None and self.study:
            done_here = (self.path / REPORT_HTML).is_file()
        if infos:
            info = infos[-1]
            row.state, row.reason = info.state, info.reason
            row.restarts = max(i.restarts for i in infos)
        else:
            row.state = recorded or ("NOT_SUBMITTED" if not row.job_ids else row.state)
            if not self.uses_slurm and not recorded and done_here:  # a run without a scheduler
                row.state = "COMPLETED"
        if row.run_dir is not None:
            row.restarts = max(row.restarts, status.restarts_from_logs(row.run_dir / "logs"))
        # A job missing from squeue on one poll may be between queue states: GONE counts only
        # on the second poll in a row (as in jobstate.wait_jobs).
        row.gone_polls = row.gone_polls + 1 if row.state == jobstate.GONE else 0
        if row.state == jobstate.GONE and done_here:
            row.state = "COMPLETED"
        gone = row.state == jobstate.GONE and row.gone_polls >= 2
        never = row.state == "PENDING" and _NEVER_STARTS in row.reason
        row.ended = row.state in jobstate.TERMINAL or gone or never
        row.ok = row.state == "COMPLETED"
        if self.study and row.run_dir is None and row.ended:
            row.ok = row.ok and done_here

    def ended(self) -> bool:
        if self.study:  # the report job runs after every point, whatever their end
            report = self.rows[-1]
            return report.ended or (not report.job_ids and all(r.ended for r in self.rows[:-1]))
        return all(r.ended for r in self.rows)

    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.ended and not r.ok]


# --------------------------------------------------------------------------- rendering


def _live_table(target: Target) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    table = Table(title=f"vitpod: {target.path}", title_justify="left", expand=False)
    columns = ["stage", "state", "jobs", "restarts", "progress", "step", "loss", "images/s"]
    for name in [*columns, "ETA", "ckpt age"]:
        table.add_column(name, justify="left" if name in ("stage", "state", "jobs") else "right")
    styles = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow"}
    for row in target.rows:
        text = cells(row)
        tail = row.tail
        total = (tail.total or 0) if tail else 0
        done = (tail.step or 0) if tail else 0
        if row.ok:
            total, done = max(total, 1), max(total, 1)
        bar = ProgressBar(total=total or None, completed=done, width=20)
        style = styles.get(row.state, "red" if row.ended and not row.ok else "")
        table.add_row(
            text["stage"], f"[{style}]{text['state']}[/]" if style else text["state"],
            text["jobs"], text["restarts"], bar, text["step"], text["loss"], text["images/s"],
            text["ETA"], text["ckpt age"],
        )  # fmt: skip
    captions = [target.note] if target.note else []
    if target.study:
        points = target.rows[:-1]
        captions.append(f"points ended: {sum(r.ended for r in points)}/{len(points)}")
    if captions:
        table.caption = "\n".join(captions)
        table.caption_justify = "left"
    return table


def plain_lines(target: Target) -> list[str]:
    stamp = time.strftime("%H:%M:%S")
    lines = []
    for row in target.rows:
        c = cells(row)
        lines.append(
            f"{stamp} {c['stage']:10s} {c['state']:11s} jobs={c['jobs']} restarts={c['restarts']} "
            f"step={c['step']} loss={c['loss']} images/s={c['images/s']} ETA={c['ETA']} "
            f"ckpt_age={c['ckpt age']}"
        )
    return lines + ([f"{stamp} {target.note}"] if target.note else [])


def _pipeline_report(path: Path) -> Path | None:
    """report.json of a pipeline directory (each stage's result and where its files are)."""
    record_path = path / status.PIPELINE_FILE
    if not record_path.is_file():
        return None
    report = path / "report.json"
    if report.is_file():
        return report
    record = json.loads(record_path.read_text())
    stages = {}
    for name, stage in record["stages"].items():
        run_dir = Path(stage["run_dir"])
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        stages[name] = {
            "state": "COMPLETED",
            "job_ids": stage.get("job_ids", []),
            **{k: summary.get(k) for k in ("top1", "top5", "steps", "images_per_s")},
            **engine_fields(find_decision(run_dir)),
            "run_dir": str(run_dir),
            "checkpoints": str(run_dir / "checkpoints"),
            "final_model": str(run_dir / "final" / "model.pt"),
            "logs": str(run_dir / "logs"),
        }
    write_json(report, {"pipeline": str(path), "cluster": record.get("cluster"), "stages": stages})
    return report


def outcome(target: Target) -> tuple[int, list[str]]:
    """Exit status and the closing lines: root causes of failures, or the report's path."""
    failed = target.failed()
    lines: list[str] = []
    if target.study:
        html = target.path / REPORT_HTML
        points = [r for r in failed if r.run_dir is not None]
        if points:
            names = ", ".join(r.name for r in points)
            lines.append(f"failed points (shown as failed in the report): {names}")
            lines += _root_causes(points)
        if html.is_file():
            lines.append(f"report: {html}")
            return (1 if points else 0), lines
        if not target.rows[-1].job_ids:  # a study submitted before report jobs existed
            lines.append(f"no report job: make report STUDY={shlex.quote(str(target.path))}")
        else:
            lines.append(f"error: the report job ended without writing {html}; see its log in "
                         f"{target.path / 'logs'}")  # fmt: skip
        return 1, lines
    if failed:
        for row in failed:
            lines.append(f"{row.name}: ended {row.state}")
        lines += _root_causes(failed)
        return 1, lines
    report = _pipeline_report(target.path)
    if report is None:
        rd = target.rows[0].run_dir
        report = rd / "summary.json" if rd else None
    lines.append(f"report: {report}")
    return 0, lines


def _root_causes(rows: list[Row]) -> list[str]:
    lines = []
    for row in rows:
        if row.run_dir is None:
            continue
        logs = row.run_dir / "logs"
        tb = status.root_cause(logs)
        if tb is not None:
            lines.append(f"{row.name}: root cause ({tb.path}:{tb.line}):")
            lines += ["    " + line for line in tb.text.splitlines()]
        elif (line := status.first_error_line(logs)) is not None:
            lines.append(f"{row.name}: first error: {line}")
        else:
            lines.append(f"{row.name}: no traceback in {logs}")
    return lines


def follow(
    path: Path,
    interval: float | None = None,
    console: Any = None,
    before_poll: Callable[[], None] | None = None,
    timeout: float | None = None,
) -> int:
    """Show the run at `path` until it ends; returns 0 when it completed, 1 when it failed.

    `interval`: seconds between polls (default 2 on a terminal, 30 without one).
    `before_poll`: called first on every poll (the local executor's pipeline advances itself).
    `timeout`: give up (TimeoutError) after this many seconds.
    """
    from rich.console import Console

    if interval is not None and not interval > 0:
        raise ConfigError(f"--interval {interval}: must be a positive number of seconds")
    console = console or Console()
    live = console.is_terminal
    interval = interval if interval is not None else (2.0 if live else 30.0)
    target = Target(Path(path))
    deadline = None if timeout is None else time.monotonic() + timeout

    def step() -> bool:
        if before_poll is not None:
            before_poll()
        target.poll()
        return target.ended()

    def wait_or_timeout() -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{path}: still running after {timeout:.0f} s")
        time.sleep(interval)

    try:
        if live:
            from rich.live import Live

            with Live(console=console, auto_refresh=False, transient=False) as view:
                while True:
                    ended = step()
                    view.update(_live_table(target), refresh=True)
                    if ended:
                        break
                    wait_or_timeout()
        else:
            while True:
                ended = step()
                for line in plain_lines(target):
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
                if ended:
                    break
                wait_or_timeout()
    except KeyboardInterrupt:  # Ctrl-C stops watching, not the jobs
        again = f"make status RUN={shlex.quote(str(path))} FOLLOW=1"
        console.print(f"stopped following; the jobs go on. Again: {again}", markup=False)
        return 130
    code, lines = outcome(target)
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    return code
