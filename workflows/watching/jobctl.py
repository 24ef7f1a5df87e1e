"""Everyday job control: the runs, pipelines and studies under a run root with their state,
and cancelling every job of one (`vitpod list`, `vitpod cancel`, `Study.from_dir`).

The state of everything listed comes from ONE squeue call for all job ids (sacct once, only for
jobs squeue no longer knows and only when accounting answers); without Slurm it comes from the
directories themselves (summary.json: completed; pipeline.json's recorded states).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate, multicluster
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.jobs.runjobs import run_job_ids, study_jobs
from vitpod.workflows.watching import status
from vitpod.workflows.watching.metricstail import MetricsTail

STUDIES = "studies"
"""Scaling studies live in <run root>/studies (workflows/studies/scaling.py)."""
MARKERS = (runfiles.PIPELINE, runfiles.STUDY, runfiles.MANIFEST)
UNKNOWN = "UNKNOWN"  # Slurm did not answer and the directory does not tell
_STAMP = "%Y%m%dT%H%M%SZ"
_QUIET = ("RENDERED", "NOT_SUBMITTED")  # written, never queued
LIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
        "SUSPENDED", "PREEMPTED", "CONFIGURING", "COMPLETING", "STOPPED", "SIGNALING",
        "STAGE_OUT", "RESV_DEL_HOLD", "SUBMITTED")  # fmt: skip
STATES = frozenset({*jobstate.TERMINAL, *LIVE, *_QUIET, jobstate.GONE, jobstate.NOT_STARTED,
                    UNKNOWN, "EMPTY", "UNREADABLE"})  # fmt: skip
"""Every state `vitpod list` can show (Slurm's job states, and what a directory says)."""


@dataclass
class Entry:
    """One run, pipeline or study directory under the run root."""

    kind: str  # run, pipeline or study
    path: Path
    model: str
    cluster: str
    created: float
    parts: list[JobState]
    jobs: list[str]
    """What cancel names: each job once (an array by its id, not its tasks)."""
    executor: str = "slurm"
    state: str = ""
    note: str = ""

    def progress(self) -> str:
        if self.kind == "study":
            points = [p for p in self.parts if p.run_dir is not None]
            done = sum(p.state == "COMPLETED" for p in points)
            return f"{done}/{len(points)} points"
        stepped = [p for p in self.parts if p.step is not None]
        if not stepped:
            return "-"
        part = stepped[-1]
        where = f"{part.name} " if self.kind == "pipeline" else ""
        return f"{where}{part.step}/{part.total or '?'}"

    def age(self, now: float | None = None) -> str:
        seconds = max(0, int((time.time() if now is None else now) - self.created))
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
            if seconds >= size:
                return f"{seconds // size}{unit}"
        return f"{seconds}s"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "path": str(self.path), "state": self.state, "model": self.model,
            "cluster": self.cluster, "job_ids": self.jobs, "progress": self.progress(),
            "age": self.age(), "created": self.created, "note": self.note,
            "parts": [{"name": p.name, "state": p.state, "job_ids": p.job_ids, "step": p.step,
                       "total": p.total} for p in self.parts],
        }  # fmt: skip


def _created(path: Path, iso: str | None) -> float:
    """From the directory's name (<UTC stamp>-model-...), else the record's, else its mtime."""
    try:
        stamp = dt.datetime.strptime(path.name.split("-", 1)[0], _STAMP)
        return stamp.replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        pass
    try:
        return dt.datetime.fromisoformat(str(iso)).timestamp()
    except ValueError:
        return path.stat().st_mtime


def _manifest_facts(run_dir: Path) -> tuple[str, str, str, str | None]:
    """(model, cluster, scheduler, created) from a run directory's manifest.json."""
    try:
        manifest = runfiles.read_manifest(run_dir)
    except (OSError, ValueError):
        return "", "", "slurm", None
    profile = manifest.get("profile", {})
    scheduler = profile.get("values", {}).get("scheduler", "slurm")
    return manifest.get("model", ""), profile.get("name", ""), scheduler, manifest.get("created")


def load(path: Path) -> Entry | None:
    """The entry of a run, pipeline or study directory; None when it is none of them."""
    path = path.absolute()
    if (path / runfiles.PIPELINE).is_file():
        record = runfiles.read_record(path / runfiles.PIPELINE)
        parts = [
            JobState(
                f"labels-{stage}", Path(lab["run_dir"]), [str(j) for j in lab.get("job_ids", [])]
            )  # fmt: skip
            for stage, lab in record.get("labels", {}).items()
        ]
        parts += status.stages_of(path)
        first = _manifest_facts(parts[0].run_dir) if parts and parts[0].run_dir else None
        model = record.get("model") or (first[0] if first else "")
        jobs = list(dict.fromkeys(j for p in parts for j in p.job_ids))
        return Entry("pipeline", path, model, record.get("cluster", ""),
                     _created(path, first[3] if first else None), parts, jobs,
                     record.get("executor", "slurm"))  # fmt: skip
    if (path / runfiles.STUDY).is_file():
        study = runfiles.read_record(path / runfiles.STUDY)
        parts = study_jobs(path, study)
        jobs = [j for p in parts for j in p.job_ids]
        return Entry("study", path, study.get("model", ""), study.get("cluster", ""),
                     _created(path, study.get("created")), parts, jobs)  # fmt: skip
    if (path / runfiles.MANIFEST).is_file():
        model, cluster, scheduler, created = _manifest_facts(path)
        (part,) = status.stages_of(path)
        part.job_ids = ids = run_job_ids(path)  # the restarts' jobs too, oldest first
        return Entry("run", path, model, cluster, _created(path, created), [part], ids, scheduler)
    return None


def discover(root: Path) -> list[Entry]:
    """Every run, pipeline and study directly under `root` (and under root/studies), oldest
    first; a directory whose record cannot be read is listed as UNREADABLE."""
    found = []
    for parent in (root, root / STUDIES):
        children = sorted(parent.iterdir()) if parent.is_dir() else []
        for child in children:
            if not child.is_dir() or not any((child / m).is_file() for m in MARKERS):
                continue
            try:
                entry = load(child)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                entry = Entry("?", child.absolute(), "", "", child.stat().st_mtime, [], [],
                              state="UNREADABLE", note=str(exc))  # fmt: skip
            if entry is not None:
                found.append(entry)
    return sorted(found, key=lambda e: e.created)


def _owned(job_id: str, infos: dict[str, jobstate.JobInfo]) -> list[jobstate.JobInfo]:
    """What squeue/sacct said about a job: itself, or an array's tasks (123 -> 123_0, ...)."""
    if job_id in infos:
        return [infos[job_id]]
    return [i for key, i in infos.items() if key.startswith(f"{job_id}_")]


def poll(job_ids: list[str]) -> dict[str, list[jobstate.JobInfo]] | None:
    """One squeue call for every job (sacct once for those it forgot, when accounting
    answers); None when squeue does not answer (no Slurm here)."""
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return {}
    try:
        infos = jobstate.squeue(ids)
    except slurm.SlurmError:
        return None
    missing = [j for j in ids if not _owned(j, infos)]
    if missing:
        with contextlib.suppress(slurm.SlurmError):  # no accounting: the directories say
            infos.update(jobstate.sacct(missing))
    return {j: _owned(j, infos) for j in ids}


def _combined(states: list[str]) -> str:
    """One state for several: running wins, then any other live state, then a failure."""
    if not states:
        return "EMPTY"
    live = [s for s in states if s not in jobstate.TERMINAL and s not in (jobstate.GONE, UNKNOWN)]
    live = [s for s in live if s not in _QUIET]
    if live:
        return "RUNNING" if "RUNNING" in live else live[0]
    bad = [s for s in states if s in jobstate.TERMINAL and s != "COMPLETED"]
    if bad:
        return bad[0]
    rest = [s for s in states if s != "COMPLETED"]
    return rest[0] if rest else "COMPLETED"


def _part_state(part: JobState, known: dict[str, list[jobstate.JobInfo]] | None) -> str:
    for job_id in reversed(part.job_ids):  # the newest job squeue or sacct knows
        if known and known.get(job_id):
            return _combined([i.state for i in known[job_id]])
    if part.run_dir is not None and (part.run_dir / runfiles.SUMMARY).is_file():
        return "COMPLETED"
    if part.recorded and part.recorded != "SUBMITTED":
        return part.recorded
    if not part.job_ids:
        return "NOT_SUBMITTED"
    return jobstate.GONE if known is not None else UNKNOWN


def settle(entries: list[Entry]) -> str:
    """Fill in each entry's state and progress (one batched poll per Slurm cluster); a note when
    Slurm did not answer."""
    parts = [p for e in entries if e.executor == "slurm" for p in e.parts]
    answers = multicluster.per_cluster([(p.run_dir, p.job_ids) for p in parts], poll)
    known = {id(p): k for p, k in zip(parts, answers, strict=True)}
    for entry in entries:
        if entry.state == "UNREADABLE":
            continue
        for part in entry.parts:
            part.state = _part_state(part, known.get(id(part), {}))
            if part.run_dir is not None and entry.kind != "study":
                tail = MetricsTail(part.run_dir)
                try:
                    tail.update()
                except runfiles.RunFileError as exc:  # one damaged file: that row says so
                    entry.note = str(exc)
                part.step, part.total = tail.step, tail.total
        entry.state = _combined([p.state for p in entry.parts])
    if any(k is None for k in answers):
        return "squeue did not answer: states from the directories"
    return ""


def list_entries(
    root: Path, state: str = "", model: str = "", cluster: str = ""
) -> tuple[list[Entry], str]:
    """The entries under `root` with their state, filtered (state: comma-separated, any case);
    and a note when Slurm did not answer."""
    wanted = parse_states(state)
    entries = [e for e in discover(root) if (not model or e.model == model)
               and (not cluster or e.cluster == cluster)]  # fmt: skip
    note = settle(entries)
    return [e for e in entries if not wanted or e.state in wanted], note


def parse_states(text: str) -> set[str]:
    """STATE=running,PENDING -> {"RUNNING", "PENDING"}; a name that is no state (a typo such as
    RUNING) is refused, listing the valid ones."""
    wanted = {s.strip().upper() for s in text.split(",") if s.strip()}
    bad = sorted(wanted - STATES)
    if bad:
        raise ConfigError(f"STATE={text}: {','.join(bad)} is not a state; choose from "
                          f"{','.join(sorted(STATES))}")  # fmt: skip
    return wanted


def format_entries(entries: list[Entry]) -> str:
    rows = [("STATE", "KIND", "AGE", "MODEL", "CLUSTER", "JOBS", "PROGRESS", "PATH")]
    rows += [(e.state, e.kind, e.age(), e.model or "-", e.cluster or "-", ",".join(e.jobs) or "-",
              e.progress(), str(e.path)) for e in entries]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    )


def cancel_jobs(job_ids: list[str]) -> dict[str, str]:
    """Cancel those of the jobs Slurm still holds (pending, running, requeued...) with one
    scancel; returns each cancelled id with the state it had. ConfigError when squeue or scancel
    fails."""
    ids = list(dict.fromkeys(job_ids))
    if not ids:
        return {}
    try:
        infos = jobstate.squeue(ids)
    except slurm.SlurmError as exc:
        raise ConfigError(f"cannot tell which of job(s) {','.join(ids)} still run ({exc}); "
                          "nothing cancelled; retry when squeue answers") from None  # fmt: skip
    live = {}
    for job_id in ids:
        states = [i.state for i in _owned(job_id, infos) if not i.terminal]
        if states:
            live[job_id] = _combined(states)
    # an array's id cancels its tasks: naming a task as well would fail as already cancelled
    live = {
        j: s for j, s in live.items() if j.partition("_")[0] == j or j.partition("_")[0] not in live
    }
    slurm.scancel(list(live))  # SlurmError (a ConfigError) names the command when it fails
    return live


def cancel(path: Path) -> tuple[Entry, dict[str, str]]:
    """Cancel every job of a run, pipeline (stages and labeling arrays) or study (point jobs and
    report job) still queued or running; the directory stays for `vitpod resume`."""
    entry = load(Path(path))
    if entry is None:
        raise ConfigError(f"{path}: not a run, pipeline or study directory (no "
                          f"{', '.join(MARKERS)}); `vitpod list` shows them")  # fmt: skip
    if entry.executor != "slurm":
        raise ConfigError(f"{path}: ran without Slurm (profile scheduler {entry.executor!r}); "
                          "nothing to scancel: stop its process (Ctrl-C)")  # fmt: skip
    runs = [(p.run_dir, p.job_ids) for p in entry.parts]
    clusters = {multicluster.cluster_of(run_dir) for run_dir, _ in runs} or {""}
    if len(clusters) == 1:
        with slurm.on_cluster(clusters.pop() or slurm.current_cluster()):
            return entry, cancel_jobs(entry.jobs)
    cancelled: dict[str, str] = {}  # a pipeline across clusters: one scancel -M per cluster
    for done in multicluster.per_cluster(runs, cancel_jobs):
        cancelled.update(done)
    return entry, cancelled


@dataclass
class Study:
    """A scaling study reattached from its directory (study.json): status, wait, follow,
    cancel from a fresh interpreter."""

    directory: Path
    entry: Entry = field(repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> Study:
        directory = Path(path).expanduser().absolute()
        entry = load(directory) if (directory / runfiles.STUDY).is_file() else None
        if entry is None:
            raise ConfigError(f"{directory}: no {runfiles.STUDY}; pass the study directory "
                              "`make scaling` printed")  # fmt: skip
        return cls(directory, entry)

    @property
    def job_ids(self) -> list[str]:
        return list(self.entry.jobs)

    def status(self) -> list[JobState]:
        """Each point's and the report job's state (one batched squeue)."""
        settle([self.entry])
        return self.entry.parts

    def wait(self, timeout: float | None = None, poll_s: float = 5.0) -> dict[str, str]:
        """Until every point and the report job ended, however; their final states."""
        ids = [j for p in self.entry.parts for j in p.job_ids]
        infos = jobstate.wait_finished(jobstate.JobStatePoller(ids), timeout, poll_s)
        return {j: i.state for j, i in infos.items()}

    def follow(self, interval: float | None = None) -> int:
        from vitpod.workflows.watching import follow

        return follow.follow(self.directory, interval)

    def cancel(self) -> list[str]:
        """scancel the points' jobs and the report job (one call); returns the ids cancelled."""
        return list(cancel_jobs(self.job_ids))
