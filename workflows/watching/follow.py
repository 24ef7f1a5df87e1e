"""Follow a run until it ends: `make status RUN=... FOLLOW=1`, `make scaling FOLLOW=1`,
`Chain.follow()`.

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

import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate, multicluster
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.jobs.rundir import write_json
from vitpod.workflows.jobs.runjobs import study_jobs
from vitpod.workflows.watching import goodput, hangs, status, triage
from vitpod.workflows.watching.metricstail import MetricsTail, duration, newest_checkpoint_age
from vitpod.workflows.watching.rootcause import first_error_line, restarts_from_logs, root_cause

REPORT_HTML = Path(runfiles.STUDY_REPORT) / runfiles.STUDY_REPORT_HTML
# A job waiting on a dependency that can no longer be met never starts (without Slurm's
# kill_invalid_depend it pends forever): for the view it has ended.
_NEVER_STARTS = "DependencyNeverSatisfied"


def take_tail(row: JobState, tail: MetricsTail, now: float | None = None) -> None:
    """The row's progress from its metrics as last read: step/total, loss, images/s, MFU, ETA."""
    row.step, row.total, row.loss = tail.step, tail.total, tail.loss
    row.images_per_s, row.mfu, row.eta_s = tail.images_per_s, tail.mfu, tail.eta_s(now)


def cells(row: JobState) -> dict[str, str]:
    """The row's columns as text (shared by the live table and the plain lines)."""
    reason = row.reason if len(row.reason) <= 40 else row.reason[:39] + "…"
    state = row.state + (f" ({reason})" if reason and not row.ended else "")
    return {
        "stage": row.name,
        "state": state,
        "jobs": (",".join(row.job_ids) or "-") + (f"@{row.cluster}" if row.cluster else ""),
        "restarts": str(row.restarts),
        "step": "-" if row.step is None else f"{row.step}/{row.total or '?'}",
        "loss": "-" if row.loss is None else f"{row.loss:.4f}",
        "images/s": "-" if row.images_per_s is None else f"{row.images_per_s:.1f}",
        "MFU": "-" if row.mfu is None else f"{100 * row.mfu:.1f}%",
        "ETA": duration(row.eta_s),
        "ckpt age": duration(row.ckpt_age_s),
    }


class Target:
    """What is followed: a run or pipeline directory, or a scaling study directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.study = (path / runfiles.STUDY).is_file()
        self.rows: list[JobState] = []
        self.uses_slurm = True
        self.note = ""  # shown under the rows (a failed poll)
        self.hang_factor: float = triage.HANG_FACTOR
        if self.study:
            self.rows = study_jobs(path, runfiles.read_record(path / runfiles.STUDY))
        else:
            self._run_rows()
        self.tails = {id(r): MetricsTail(r.run_dir) for r in self.rows if r.run_dir is not None}
        self._gone_polls = dict.fromkeys(map(id, self.rows), 0)
        for row in self.rows:
            row.cluster = multicluster.cluster_of(row.run_dir)
            row.state = row.state or "PENDING"
        self.pollers = self._pollers()

    def tail_of(self, row: JobState) -> MetricsTail | None:
        """The row's metrics as read so far (None: a job without a run directory)."""
        return self.tails.get(id(row))

    def _pollers(self) -> dict[str, jobstate.JobStatePoller]:
        """One poller per Slurm cluster, for the jobs of its rows."""
        ids: dict[str, list[str]] = {}
        for row in self.rows:
            ids.setdefault(row.cluster, []).extend(row.job_ids)
        return {c: jobstate.JobStatePoller(j, cluster=c) for c, j in ids.items()}

    def _recorded(self) -> None:
        """pipeline.json's job ids and states: a pipeline across clusters submits its fine-tune
        only once the pretrain has ended (chain_cross.py), and the local executor's states are
        only there."""
        if self.study or not (self.path / runfiles.PIPELINE).is_file():
            return
        now = {s.name: s for s in status.stages_of(self.path)}
        changed = False
        for row in self.rows:
            if row.name in now:
                changed |= now[row.name].job_ids != row.job_ids
                row.job_ids, row.recorded = now[row.name].job_ids, now[row.name].recorded
        if changed:
            self.pollers = self._pollers()

    def _run_rows(self) -> None:
        record_path, manifest_path = self.path / runfiles.PIPELINE, self.path / runfiles.MANIFEST
        if record_path.is_file():
            self.uses_slurm = runfiles.read_record(record_path).get("executor") != "local"
        elif manifest_path.is_file():
            profile = runfiles.read_manifest(self.path).get("profile", {})
            self.uses_slurm = profile.get("values", {}).get("scheduler", "slurm") == "slurm"
        self.rows = status.stages_of(self.path)

    def poll(self) -> None:
        infos: dict[str, jobstate.JobInfo] = {}
        self.note = ""
        self._recorded()
        if self.uses_slurm:
            try:
                for cluster, poller in self.pollers.items():
                    infos.update({f"{j}@{cluster}": i for j, i in poller.poll().items()})
            except slurm.SlurmError as exc:
                # A controller restarting for a moment: keep the last states, try again.
                self.note = f"squeue did not answer ({exc}); showing the last known states"
        now = time.time()
        for row in self.rows:
            tail = self.tail_of(row)
            if tail is not None:
                tail.update()
                take_tail(row, tail, now)
                row.ckpt_age_s = newest_checkpoint_age(tail.run_dir, now)
            known = [infos[k] for j in row.job_ids if (k := f"{j}@{row.cluster}") in infos]
            self._set_state(row, known)

    def _set_state(self, row: JobState, infos: list[jobstate.JobInfo]) -> None:
        # Slurm's states win; pipeline.json's only for a stage not (yet) submitted.
        recorded = row.recorded if not (self.uses_slurm and row.job_ids) else ""
        done_here = row.run_dir is not None and (row.run_dir / runfiles.SUMMARY).is_file()
        if row.run_dir is None and self.study:
            done_here = (self.path / REPORT_HTML).is_file()
        if not row.observe(infos):
            row.state = recorded or ("NOT_SUBMITTED" if not row.job_ids else row.state)
            if not self.uses_slurm and not recorded and done_here:  # a run without a scheduler
                row.state = "COMPLETED"
        if row.run_dir is not None:
            row.restarts = max(row.restarts, restarts_from_logs(row.run_dir / runfiles.LOGS))
        # A job missing from squeue on one poll may be between queue states: GONE counts only
        # on the second poll in a row (as in jobstate.wait_jobs).
        gone_polls = self._gone_polls[id(row)] + 1 if row.state == jobstate.GONE else 0
        self._gone_polls[id(row)] = gone_polls
        if row.state == jobstate.GONE and done_here:
            row.state = "COMPLETED"
        gone = row.state == jobstate.GONE and gone_polls >= 2
        never = (row.state == "PENDING" and _NEVER_STARTS in row.reason) or (
            row.state == jobstate.NOT_STARTED
        )
        row.ended = row.state in jobstate.TERMINAL or gone or never
        tail = self.tail_of(row)
        if row.state == "RUNNING" and tail is not None:
            stamps = [t for _, t in tail.recent][-21:]
            every = triage.log_interval(tail.run_dir)
            hung = triage.stuck_since(tail.rank_wall, stamps, every, self.hang_factor)
            slow = [] if hung else hangs.stragglers(tail.run_dir)
            straggling = ", ".join(f"straggler rank {s.rank} on {s.node} x{s.ratio:.2f}"
                                   for s in slow)  # fmt: skip
            row.reason = hung.cause if hung else straggling or row.reason

    def ok(self, row: JobState) -> bool:
        """Completed; a study's report job only with the report written."""
        if self.study and row.run_dir is None:
            return row.ok and (self.path / REPORT_HTML).is_file()
        return row.ok

    def ended(self) -> bool:
        if self.study:  # the report job runs after every point, whatever their end
            report = self.rows[-1]
            return report.ended or (not report.job_ids and all(r.ended for r in self.rows[:-1]))
        return all(r.ended for r in self.rows)

    def failed(self) -> list[JobState]:
        return [r for r in self.rows if r.ended and not self.ok(r)]


# --------------------------------------------------------------------------- rendering


def _live_table(target: Target) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    table = Table(title=f"vitpod: {target.path}", title_justify="left", expand=False)
    columns = ["stage", "state", "jobs", "restarts", "progress", "step", "loss", "images/s", "MFU"]
    for name in [*columns, "ETA", "ckpt age"]:
        table.add_column(name, justify="left" if name in ("stage", "state", "jobs") else "right")
    styles = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow"}
    for row in target.rows:
        text = cells(row)
        total, done = row.total or 0, row.step or 0
        if target.ok(row):
            total, done = max(total, 1), max(total, 1)
        bar = ProgressBar(total=total or None, completed=done, width=20)
        style = styles.get(row.state, "red" if row.ended and not target.ok(row) else "")
        table.add_row(
            text["stage"], f"[{style}]{text['state']}[/]" if style else text["state"],
            text["jobs"], text["restarts"], bar, text["step"], text["loss"], text["images/s"],
            text["MFU"], text["ETA"], text["ckpt age"],
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
            f"step={c['step']} loss={c['loss']} images/s={c['images/s']} MFU={c['MFU']} "
            f"ETA={c['ETA']} ckpt_age={c['ckpt age']}"
        )
    return lines + ([f"{stamp} {target.note}"] if target.note else [])


def _pipeline_report(path: Path) -> Path | None:
    """report.json of a pipeline directory (written from pipeline.json when the run that made it
    did not wait for the end)."""
    record_path = path / runfiles.PIPELINE
    if not record_path.is_file():
        return None
    report = path / runfiles.REPORT
    if not report.is_file():
        record = runfiles.read_record(record_path)
        completed = dict.fromkeys(record["stages"], "COMPLETED")
        write_json(report, status.pipeline_report(path, record, completed))
    return report


def outcome(target: Target) -> tuple[int, list[str]]:
    """Exit status and the closing lines: root causes of failures, or the report's path."""
    failed = target.failed()
    trained = [r for r in target.rows if r.run_dir is not None and r.step]
    runs = [(r.run_dir, r.job_ids if target.uses_slurm else [])
            for r in trained if r.run_dir is not None]  # fmt: skip
    lines = [f"{r.name}: {ledger.line()}"
             for r, ledger in zip(trained, goodput.ledgers(runs), strict=True)]  # fmt: skip
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
                         f"{target.path / runfiles.LOGS}")  # fmt: skip
        return 1, lines
    if failed:
        for row in failed:
            lines.append(f"{row.name}: ended {row.state}")
        lines += _root_causes(failed)
        return 1, lines
    report = _pipeline_report(target.path)
    if report is None:
        rd = target.rows[0].run_dir
        report = rd / runfiles.SUMMARY if rd else None
    lines.append(f"report: {report}")
    return 0, lines


def _root_causes(rows: list[JobState]) -> list[str]:
    lines = []
    for row in rows:
        if row.run_dir is None:
            continue
        logs = row.run_dir / runfiles.LOGS
        found = triage.diagnose(logs, row.state, row.exit_code)
        lines += [f"{row.name}: {x}" for x in found.text()] if found else []
        tb = root_cause(logs)
        if tb is not None:
            lines.append(f"{row.name}: root cause ({tb.path}:{tb.line}):")
            lines += ["    " + line for line in tb.text.splitlines()]
        elif (line := first_error_line(logs)) is not None:
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
    hang_factor: float = triage.HANG_FACTOR,
) -> int:
    """Show the run at `path` until it ends; returns 0 when it completed, 1 when it failed.

    `interval`: seconds between polls (default 2 on a terminal, 30 without one).
    `before_poll`: called first on every poll (the local executor's pipeline advances itself).
    `timeout`: give up (TimeoutError) after this many seconds.
    `hang_factor`: a running stage is stuck after this many median step times without a step.
    """
    from rich.console import Console

    if interval is not None and not interval > 0:
        raise ConfigError(f"--interval {interval}: must be a positive number of seconds")
    console = console or Console()
    live = console.is_terminal
    interval = interval if interval is not None else (2.0 if live else 30.0)
    target = Target(Path(path))
    target.hang_factor = hang_factor
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
