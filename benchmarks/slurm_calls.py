"""Slurm calls per poll while watching a scaling study of N point jobs (N = 5, 50, 500).

Every Slurm command goes through workflows/slurm/__init__.py's `runner`; here it is replaced by
FakeSlurm, which counts the calls and answers squeue and sacct as Slurm does for a study's point
jobs (one job per point, each after the one before: afterany): the first `finished` completed and
left squeue's memory (only sacct knows them), the next ones run, the rest pend on their
dependency. Each way of watching is measured batched (what vitpod does) and per job (one call per
job, as a watcher asking job by job does; for the goodput ledger that is what `vitpod status` and
`follow` did before, one sacct per run). No Slurm is needed. Results:
benchmarks/results/slurm_calls.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vitpod.workflows import slurm  # noqa: E402
from vitpod.workflows.jobs import jobstate  # noqa: E402
from vitpod.workflows.watching import follow, goodput, jobctl  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "slurm_calls.json"
FIRST, REPORT = 4200, "9999"  # point i's job is FIRST + i; the report job (afterany on them all)
SIZES = (5, 50, 500)
STAMP = "2026-11-23T22:57:16"


def point_ids(points: int) -> list[str]:
    return [str(FIRST + i) for i in range(points)]


class FakeSlurm:
    """A runner answering squeue and sacct for `points` point jobs and the REPORT job."""

    def __init__(self, points: int, finished: int, running: int = 8) -> None:
        self.points, self.finished, self.running = points, finished, running
        self.calls: Counter[str] = Counter()

    def __call__(self, argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        self.calls[argv[0]] += 1
        ids = argv[argv.index("-j") + 1].split(",")
        fields = argv[argv.index("-O" if argv[0] == "squeue" else "-o") + 1]
        out = self._squeue(ids) if argv[0] == "squeue" else self._sacct(ids, fields)
        if argv[0] == "squeue" and not out:
            err = "slurm_load_jobs error: Invalid job id specified\n"
            return subprocess.CompletedProcess(argv, 1, "", err)
        return subprocess.CompletedProcess(argv, 0, out, "")

    def _point(self, job_id: str) -> int | None:
        index = int(job_id) - FIRST if job_id.isdigit() else -1
        return index if 0 <= index < self.points else None

    def _squeue(self, ids: list[str]) -> str:
        lines: list[str] = []
        for job_id in ids:
            index = self._point(job_id)
            if job_id == REPORT or (index is not None and index >= self.finished + self.running):
                lines.append(f"{job_id}|PENDING|Dependency|0|0:0|")
            elif index is not None and index >= self.finished:
                lines.append(f"{job_id}|RUNNING|None|0|0:0|")
        return "".join(f"{line}\n" for line in lines)

    def _sacct(self, ids: list[str], fields: str) -> str:
        done = [j for j in ids if (i := self._point(j)) is not None and i < self.finished]
        if fields.startswith("JobID,State"):  # jobstate.SACCT_FIELDS
            return "".join(f"{j}|COMPLETED|0:0|None\n" for j in done)
        tres = "billing=8,cpu=8,gres/gpu=1,mem=16G,node=1"  # goodput's -D attempts
        return "".join(f"{j}|{STAMP}|{STAMP}|{STAMP}|{tres}\n" for j in done)


def study_dir(root: Path, points: int) -> Path:
    """A study directory as `make scaling` leaves it: study.json naming each point's job and the
    report job."""
    record = {"report_job_id": REPORT, "points": [
        {"index": i, "gpus": i + 1, "run_dir": f"point{i}", "job_id": job}
        for i, job in enumerate(point_ids(points))
    ]}  # fmt: skip
    (root / "study.json").write_text(json.dumps(record))
    return root


def count(fake: FakeSlurm, what: Callable[[], object]) -> int:
    fake.calls.clear()
    what()
    return sum(fake.calls.values())


def measure(points: int) -> dict[str, dict[str, int]]:
    """Calls of one poll for each way of watching `points` point jobs (half of them finished)."""
    fake = FakeSlurm(points, finished=points // 2)
    real, slurm.runner = slurm.runner, fake
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = study_dir(Path(tmp), points)
            ids = point_ids(points)
            target = follow.Target(root)
            runs = [(root / f"point{i}", [j]) for i, j in enumerate(ids)]
            return {
                "follow poll (make status FOLLOW=1)": {
                    "batched": count(fake, target.poll),
                    "per_job": count(fake, lambda: _one_by_one([*ids, REPORT])),
                },
                "list/cancel poll (vitpod list)": {
                    "batched": count(fake, lambda: jobctl.poll([*ids, REPORT])),
                    "per_job": count(fake, lambda: _one_by_one([*ids, REPORT])),
                },
                "point wait poll (make scaling WAIT=1)": {
                    "batched": count(fake, jobstate.JobStatePoller(ids).poll),
                    "per_job": count(fake, lambda: _one_by_one(ids)),
                },
                "goodput ledgers (status, follow's end)": {
                    "batched": count(fake, lambda: goodput.ledgers(runs)),
                    "per_job": count(fake, lambda: [goodput.ledger(d, j) for d, j in runs]),
                },
            }
    finally:
        slurm.runner = real


def _one_by_one(ids: list[str]) -> None:
    """A watcher asking job by job: squeue for each, sacct for each squeue forgot."""
    for job_id in ids:
        if not jobstate.squeue([job_id]):
            jobstate.sacct([job_id])


def main() -> int:
    by_size = {n: measure(n) for n in SIZES}
    ways = ("batched", "per_job")
    scenarios = {
        name: {way: {str(n): by_size[n][name][way] for n in SIZES} for way in ways}
        for name in by_size[SIZES[0]]
    }
    result = {
        "what": "Slurm calls (squeue + sacct) of one poll watching a study of N point jobs, "
        "half finished (gone from squeue), 8 running, the rest pending on their dependency",
        "sizes": list(SIZES),
        "scenarios": scenarios,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, ways in scenarios.items():
        print(f"{name:42s} batched {ways['batched']}  per job {ways['per_job']}")
    print(RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
