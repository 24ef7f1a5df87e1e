"""What the ranks' watchdog found (RUN/hangs.jsonl, templates/partials/watchdog.sh.j2) and which
ranks straggle (their metrics), for `make status`, the follow view and a study's report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vitpod.analysis.stragglers import stragglers

HANGS = "hangs.jsonl"  # the watchdog's record of each hang (watchdog.sh.j2 writes it)
EXCLUDE_NODES = "exclude-nodes"  # nodes that hung twice; the requeued job excludes them


@dataclass(frozen=True)
class Hang:
    job: str
    restart: int
    attempt: int
    rank: str
    node: str
    step: int
    section: str
    quiet_s: int
    timeout_s: int
    stalled: str
    stacks: str
    blamed: str | None = None  # the node it counts against; "": the job's; None: not recorded

    def line(self) -> str:
        stopped = f"; no heartbeat from rank(s) {self.stalled}" if self.stalled else ""
        if self.blamed == "":
            stopped += "; no rank behind the others: the job's hang, no node blamed"
        return (f"hang: rank {self.rank} on {self.node} in {self.section} at step {self.step}: "
                f"no progress for {self.quiet_s} s (timeout {self.timeout_s} s){stopped}; job "
                f"{self.job} restart {self.restart} attempt {self.attempt}; stacks "
                f"{self.stacks}")  # fmt: skip


def hangs(run_dir: Path) -> list[Hang]:
    """Every hang the watchdog recorded for the run, oldest first (a torn line is left out)."""
    path = Path(run_dir) / HANGS
    if not path.is_file():
        return []
    out = []
    for text in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(text)
            out.append(Hang(str(rec["job"]), int(rec["restart"]), int(rec["attempt"]),
                            str(rec["rank"]), str(rec["node"]), int(rec["step"]),
                            str(rec["section"]), int(rec["quiet_s"]), int(rec["timeout_s"]),
                            str(rec.get("stalled", "")), str(rec.get("stacks", "")),
                            rec.get("blamed")))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            continue
    return out


def excluded_nodes(run_dir: Path) -> list[str]:
    path = Path(run_dir) / EXCLUDE_NODES
    return sorted(set(path.read_text().split())) if path.is_file() else []


def lines(run_dir: Path) -> list[str]:
    """What status prints under a stage: its hangs, excluded nodes and stragglers."""
    out = [h.line() for h in hangs(run_dir)]
    if excluded := excluded_nodes(run_dir):
        out.append(f"excluded nodes (hung twice): {','.join(excluded)}")
    return out + [s.line() for s in stragglers(run_dir)]
