"""Why a run failed, from its rank logs: the root-cause traceback, a killed task, restarts."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

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


def attempt_logs(log_dir: Path) -> list[Path]:
    """The log files of the newest (re)start, lower ranks first, and those of no restart."""
    if not log_dir.is_dir():
        return []
    # Only the (re)start that failed: an earlier one ended by a requeue may have left harmless
    # tracebacks at exit (multiprocessing's resource tracker) that would mask the cause.
    files = [p for p in sorted(log_dir.iterdir(), key=_log_order) if p.is_file()]
    newest = min((_log_order(p)[0] for p in files), default=0)
    return [p for p in files if _log_order(p)[0] == newest or not _RESTART.search(p.name)]


def root_cause(log_dir: Path) -> Traceback | None:
    """The first non-communication traceback across the rank logs (else the first one at all)."""
    files = attempt_logs(log_dir)
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
