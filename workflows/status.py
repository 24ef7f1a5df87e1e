"""Run status: per stage state, job ids, restarts, progress, and the root-cause traceback."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from vitpod.registry import runfiles
from vitpod.trainer.exitcodes import USAGE
from vitpod.workflows import jobstate

PIPELINE_FILE = runfiles.PIPELINE
_TRACEBACK_START = "Traceback (most recent call last):"
_CHAIN_LINES = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# A failing rank makes its peers' collectives fail; those tracebacks are symptoms, not causes.
_COMM_PATTERNS = re.compile(
    r"NCCL|ProcessGroupNCCL|DistBackendError|ProcessGroupGloo|gloo|Connection (reset|closed) "
    r"by peer|collective operation timeout|Watchdog caught|ChildFailedError|DistNetworkError|"
    r"SignalException|Broken pipe",
    re.IGNORECASE,
)
# srun --label and similar prefixes ("3: ", torch's "[rank3]: ") in front of every line.
_LABEL = re.compile(r"^\s*(\d+:\s?|\[rank\d+\]:\s?)")
# srun's report of a task that died of a signal: it left no traceback (kill -9, OOM killer).
# srun says "task 1: Killed" for a signalled task, or "Exited with exit code 137" (128 + 9) when
# a wrapper shell (bind.sh) reports its child's death by signal.
_KILLED_TASK = re.compile(r"srun: error: (\S+): tasks? (\d+)[\d,-]*: (.+)")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
_SIGNAL_NAMES = {"Killed": "SIGKILL", "Terminated": "SIGTERM"}
_SIGNUMS = {int(s) for s in signal.Signals}
_RESTART = re.compile(r"restart[_-]?(\d+)", re.IGNORECASE)
_RANK = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class Traceback:
    """One Python traceback found in a log file, with the exception line that ends it."""

    path: str
    line: int
    text: str
    exception: str
    communication: bool


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

    def line(self) -> str:
        jobs = ",".join(self.job_ids) or "-"
        step = "-" if self.last_step is None else str(self.last_step)
        ips = "-" if self.images_per_s is None else f"{self.images_per_s:.1f}"
        top1 = "" if self.top1 is None else f" top1={self.top1:.2f}%"
        return (
            f"{self.stage:9s} {self.state:11s} jobs={jobs} restarts={self.restarts} "
            f"step={step} images/s={ips}{top1}  {self.run_dir}"
        )


def _strip(line: str) -> str:
    return _LABEL.sub("", line.rstrip("\n"), count=1)


def find_tracebacks(path: Path) -> list[Traceback]:
    """Every traceback in a log file; chained exceptions stay one block ending in the last one."""
    lines = [_strip(x) for x in path.read_text(errors="replace").splitlines()]
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() != _TRACEBACK_START:
            i += 1
            continue
        start, i = i, i + 1
        while i < len(lines):
            line = lines[i]
            if not line.strip() or line.startswith((" ", "\t")) or line.strip() == _TRACEBACK_START:
                i += 1
                continue
            # The exception line; a chained exception continues the same block.
            exc_end = i
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and lines[j].strip() in _CHAIN_LINES:
                i = j + 1
                continue
            i = exc_end + 1
            break
        text = "\n".join(lines[start:i])
        exception = lines[i - 1].strip() if i - 1 > start else ""
        found.append(
            Traceback(str(path), start + 1, text, exception, bool(_COMM_PATTERNS.search(text)))
        )
    return found


def _log_order(path: Path) -> tuple[int, int, str]:
    restart = _RESTART.search(path.name)
    rank = _RANK.search(path.name)
    # The newest restart is the one that failed; within it, lower ranks first.
    return (
        -int(restart.group(1)) if restart else 0,
        int(rank.group(1)) if rank else 0,
        path.name,
    )


def root_cause(log_dir: Path) -> Traceback | None:
    """The first non-communication traceback across the rank logs (else the first one at all)."""
    if not log_dir.is_dir():
        return None
    # Only the (re)start that failed: an earlier one ended by a requeue may have left harmless
    # tracebacks at exit (multiprocessing's resource tracker) that would mask the cause.
    files = [p for p in sorted(log_dir.iterdir(), key=_log_order) if p.is_file()]
    newest = min((_log_order(p)[0] for p in files), default=0)
    files = [p for p in files if _log_order(p)[0] == newest or not _RESTART.search(p.name)]
    tracebacks = [tb for p in files for tb in find_tracebacks(p)]
    real = [tb for tb in tracebacks if not tb.communication]
    if real:
        return real[0]
    return _killed_task(files) or next(iter(tracebacks), None)


def _killed_task(files: list[Path]) -> Traceback | None:
    """A rank that srun saw die of a signal (its peers then fail in collectives)."""
    for path in (p for p in files if p.name.startswith("sbatch-")):
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = _KILLED_TASK.search(line)
            name = _signal_of(match.group(3).strip()) if match else None
            if match and name:
                node, task = match.group(1), match.group(2)
                exception = (
                    f"rank {task} on {node} was killed by {name}: no Python traceback, it was "
                    "stopped from outside (kill -9, the OOM killer, a node failure)"
                )
                return Traceback(
                    str(path), lineno, f"{line.strip()}\n{exception}", exception, False
                )
    return None


def _signal_of(how: str) -> str | None:
    """The signal in srun's words for a task's end ('Killed', 'Exited with exit code 137')."""
    code = _EXIT_CODE.match(how)
    if code is None:
        return _SIGNAL_NAMES.get(how, how)
    signum = int(code.group(1)) - 128
    if signum not in _SIGNUMS:
        return None  # an ordinary exit status: that rank's log has the traceback
    return signal.Signals(signum).name


def first_error_line(log_dir: Path) -> str | None:
    """The first line saying 'error' in the rank logs (for failures without a traceback)."""
    if not log_dir.is_dir():
        return None
    for path in sorted((p for p in log_dir.iterdir() if p.is_file()), key=_log_order):
        for line in path.read_text(errors="replace").splitlines():
            if "error" in line.lower():
                return f"{path.name}: {_strip(line).strip()}"
    return None


def restarts_from_logs(log_dir: Path) -> int:
    """Highest restart count found in the log names (they carry SLURM_RESTART_COUNT)."""
    if not log_dir.is_dir():
        return 0
    counts = [int(m.group(1)) for p in log_dir.iterdir() if (m := _RESTART.search(p.name))]
    return max(counts, default=0)


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return records


def progress(run_dir: Path) -> tuple[int | None, float | None, float | None]:
    """(last step, images/s, top-1) from the trainer's metrics JSONL (contract 3)."""
    last_step, rank_ips, summary = None, {}, None
    for path in sorted((run_dir / runfiles.METRICS).glob("rank*.jsonl")):
        for rec in _read_jsonl(path):
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
) -> StageStatus:
    """Combine the scheduler's view of a stage's jobs with what its run directory holds."""
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
    return StageStatus(stage, str(run_dir), state, job_ids, restarts, last_step, ips, top1, tb)


def stages_of(run: Path) -> list[tuple[str, Path, list[str], str]]:
    """(stage, run_dir, job ids, recorded state) for a pipeline directory or a single run dir."""
    if (run / PIPELINE_FILE).is_file():
        record = json.loads((run / PIPELINE_FILE).read_text())
        return [
            (name, Path(s["run_dir"]), [str(j) for j in s.get("job_ids", [])], s.get("state", ""))
            for name, s in record["stages"].items()
        ]
    manifest = json.loads((run / runfiles.MANIFEST).read_text())
    ids = manifest.get("job_ids") or ([manifest["job_id"]] if manifest.get("job_id") else [])
    stage = manifest.get("stage") or manifest.get("recipe", {}).get("stage") or run.name
    return [(str(stage), run, [str(j) for j in ids], "")]


def run_status(run: Path, executor: str | None = None) -> list[StageStatus]:
    """Status of every stage of a run; one batched scheduler poll for all of its jobs."""
    stages = stages_of(run)
    all_ids = [j for _, _, ids, _ in stages for j in ids]
    record_path = run / PIPELINE_FILE
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    uses_slurm = (executor or record.get("executor", "slurm")) == "slurm"
    polled = jobstate.poll_once(all_ids) if all_ids and uses_slurm else {}
    return [
        stage_status(name, rd, ids, [polled[j] for j in ids if j in polled], recorded)
        for name, rd, ids, recorded in stages
    ]


def format_status(statuses: list[StageStatus]) -> str:
    out = []
    for s in statuses:
        out.append(s.line())
        if s.traceback is not None:
            out.append(f"  root cause ({s.traceback.path}:{s.traceback.line}):")
            out.extend("    " + line for line in s.traceback.text.splitlines())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitpod.workflows status", description=__doc__)
    parser.add_argument("--run", required=True, help="pipeline directory or stage run directory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--follow", action="store_true", help="live view until the run ends (make ... FOLLOW=1)"
    )
    parser.add_argument(
        "--interval", type=float, default=None, help="seconds between polls with --follow"
    )
    args = parser.parse_args(argv)
    run = Path(args.run) if args.run else None
    markers = (PIPELINE_FILE, runfiles.MANIFEST, runfiles.STUDY)
    if run is None or not any((run / name).is_file() for name in markers):
        print(
            f"error: RUN={args.run!r} is not a run directory (no {', '.join(markers)}); pass the "
            "directory printed by `make pipeline`/`make pretrain`/`make scaling`",
            file=sys.stderr,
        )
        return USAGE
    if args.follow or (run / "study.json").is_file():
        from vitpod.workflows import follow

        if not args.follow:  # a study's snapshot: one poll, plain lines
            target = follow.Target(run)
            target.poll()
            print("\n".join(follow.plain_lines(target)))
            return 0
        return follow.follow(run, interval=args.interval)
    statuses = run_status(run)
    if args.json:
        print(json.dumps([asdict(s) for s in statuses], indent=2))
    else:
        print(format_status(statuses))
    return 0
