"""--checkpoint-every auto on the local Slurm (issue 32, item 2): tiny jobs on the pretrain
partition requeued while they run make interruption history; `vitpod render` then reads it
(sacct -X -D) and the job's interval follows sqrt(2 x C x M). About 30 s; the jobs are cancelled."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.helpers import vitpod, wait_until
from vitpod.registry import runfiles
from vitpod.workflows.planning.interruptions import partition_history

pytestmark = [pytest.mark.slurm]
JOBS = 2


def _states(job: str) -> list[str]:
    out = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-j", job, "-o", "State"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    return out.stdout.split()


def _queue_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def test_auto_interval_from_the_partitions_requeue_history(local_slurm, tmp_path):
    before = partition_history("pretrain").interruptions
    jobs: list[str] = []
    try:
        for _ in range(JOBS):
            out = subprocess.run(
                ["sbatch", "--parsable", "--partition", "pretrain", "--requeue", "-n1",
                 "--time", "2", "-o", str(tmp_path / "job-%j.out"), "--wrap", "sleep 30"],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
            jobs.append(out.stdout.strip().split(";")[0])
        for job in jobs:
            wait_until(f"job {job} to run", lambda job=job: _queue_state(job) == "RUNNING", 40, 0.5)
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        # CI once counted 1 of the 2 requeues (not reproduced here): the jobs are cancelled only
        # once sacct lists each requeued start and the start after it, two separate records.
        for job in jobs:
            wait_until(f"sacct to list job {job}'s requeued start and the one after it",
                       lambda job=job: (s := _states(job))[:1] == ["REQUEUED"] and len(s) > 1,
                       40, 0.5)  # fmt: skip
    finally:
        if jobs:
            subprocess.run(["scancel", *jobs], check=False, timeout=30)

    # A finished run of the same model, image size and batch measured its save and steps.
    runs = tmp_path / "runs"
    old = runs / "20200101T000000Z-volo_tiny-pretrain-0a0a0a"
    runfiles.metrics_file(old, 0).parent.mkdir(parents=True)
    (old / runfiles.CONFIG).write_text(json.dumps({"model": "volo_tiny", "img_size": 32,
                                                   "batch_size": 16}))  # fmt: skip
    steps = [{"kind": "step", "step": s, "warmup": False, "time": {"step": 0.02}} for s in (1, 2)]
    records = [*steps, {"kind": "timing", "event": "checkpoint", "step": 2, "seconds": 0.5}]
    runfiles.metrics_file(old, 0).write_text("".join(json.dumps(r) + "\n" for r in records))

    out = vitpod("render", "--cluster", "localslurm", "--model", "volo_tiny", "--run-root",
                 str(runs), "--args", "--checkpoint-every auto", timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    run = next(r for r in runs.iterdir() if r != old)
    record = json.loads((run / runfiles.PLAN).read_text())["checkpoint"]
    assert record["interruptions"] >= before + JOBS, (before, record)
    assert record["mtbi_source"].startswith(f"sacct: {record['interruptions']} interruption(s)")
    mtbi_h = record["job_hours"] / record["interruptions"]
    assert record["mtbi_hours"] == pytest.approx(mtbi_h)
    assert record["save_cost_s"] == 0.5 and record["step_time_s"] == 0.02
    interval = math.sqrt(2 * 0.5 * mtbi_h * 3600)
    assert record["interval_s"] == pytest.approx(interval)
    assert record["steps"] == max(1, round(interval / 0.02))
    trainer = json.loads((run / runfiles.PLAN).read_text())["trainer"]
    assert trainer["run"]["checkpoint_every"] == record["steps"]  # what the ranks start from
