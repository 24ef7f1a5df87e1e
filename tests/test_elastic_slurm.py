"""Elastic resume on the real local Slurm: a 2-node job (one rank a node) preempted with
`scancel --signal=USR2` continues on 1 node (`make resume RUN=... NODES=1`), and a 1-node job
continues on 2; every optimizer step reads the samples of the uninterrupted job."""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_slurm import job_restarts, queue_state, submit
from tests.helpers import last_step, make, one_rank_per_node, profile_copy, wait_until
from tests.test_elastic_resume import LOSS_TOLERANCE, TOP1_TOLERANCE
from vitpod.registry import runfiles

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# Global batch 32 = 2 ranks x 16 x 1 = 1 rank x 16 x 2; one epoch of 45 steps on digits.
ARGS = (
    "--workers 0 --loader torch -b 16 --global-batch 32 --elastic --epochs 1 --warmup-epochs 0"
    " --drop-path 0.0 --checkpoint-every 0 --log-interval 1 --log-sample-ids"
)
STEPS = 45


def _steps(run: Path) -> dict[int, dict]:
    """step -> rank 0's record (the resumed job's where a step was logged twice); every rank
    must log the same sample digest for a step."""
    out: dict[int, dict] = {}
    digests: dict[int, set[str]] = {}
    for record in runfiles.read_metrics(run):
        if record["kind"] == "step":
            digests.setdefault(record["step"], set()).add(record["sample_digest"])
            if record["rank"] == 0:
                out[record["step"]] = record
    assert all(len(d) == 1 for d in digests.values()), "ranks disagree on a step's samples"
    return out


def _stop(job: str, run: Path, step: int) -> int:
    """USR2 at `step`; the job checkpoints, exits 75 and is requeued: cancel the requeued job.
    Returns the newest checkpoint's step."""
    wait_until(f"job {job} step {step}", lambda: last_step(run) >= step, 900)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_until("the preemption checkpoint", lambda: list(run.glob("checkpoints/step_*")), 900)
    wait_until("the requeue", lambda: "requeueing" in _batch_logs(run), 900)
    # Cancel once Slurm requeued it: a cancel between the script's "requeueing" line and its
    # `scontrol requeue` is undone by that requeue (seen once: the job restarted and ran to its end)
    wait_until(f"job {job} requeued", lambda: (job_restarts(job) or 0) >= 1, 120)
    subprocess.run(["scancel", job], check=True)
    wait_until(f"job {job} to leave the queue", lambda: not queue_state(job), 900)
    return int(sorted(run.glob("checkpoints/step_*"))[-1].name.split("_")[1])


def _batch_logs(run: Path) -> str:
    return "".join(p.read_text() for p in (run / "logs").glob("sbatch-*"))


def test_preempted_jobs_continue_on_another_node_count(
    local_slurm, digits_dir: Path, tmp_path: Path
) -> None:
    profile = profile_copy(tmp_path, data=digits_dir.parent, **one_rank_per_node())
    # The local nodes are shared: the reference and the stopped jobs run side by side.
    ref_job, reference = submit(tmp_path, profile, ARGS, "NODES=2")
    resumed = []
    for nodes in (2, 1):  # 2 -> 1 node, then 1 -> 2
        job, run = submit(tmp_path, profile, ARGS, f"NODES={nodes}")
        stopped_at = _stop(job, run, random.Random(nodes).randrange(5, 25))
        done = make("resume", f"RUN={run}", f"NODES={3 - nodes}", runs=tmp_path / "runs")
        assert done.returncode == 0, done.stdout + done.stderr
        out = done.stdout
        assert "accumulation" in out and (run / "plan.restart1.json").is_file(), out
        assert json.loads((run / "plan.json").read_text())["resources"]["nodes"] == 3 - nodes
        new_job = re.search(r"submitted batch job (\d+)", out)
        assert new_job, out
        resumed.append((nodes, stopped_at, new_job[1], run))
    assert local_slurm.wait(ref_job, timeout=1800) == "COMPLETED"
    want = _steps(reference)
    assert sorted(want) == list(range(1, STEPS + 1))
    for nodes, stopped_at, job, run in resumed:
        assert local_slurm.wait(job, timeout=1800) == "COMPLETED", run
        got = _steps(run)
        assert sorted(got) == sorted(want)
        assert [got[s]["sample_digest"] for s in want] == [want[s]["sample_digest"] for s in want]
        assert {got[s]["world_size"] for s in got if s > stopped_at} == {3 - nodes}
        deviation = max(abs(got[s]["global_loss"] - want[s]["global_loss"]) for s in want)
        print(f"{nodes} -> {3 - nodes} node(s) at step {stopped_at}: max |dloss| {deviation:.2e}")
        assert deviation < LOSS_TOLERANCE
        tops = [json.loads((r / "summary.json").read_text())["top1"] for r in (reference, run)]
        assert abs(tops[0] - tops[1]) <= TOP1_TOLERANCE, tops
