"""Everyday job control on the real local Slurm, as a user meets it: a pipeline submitted, listed,
reattached from a fresh interpreter, cancelled (its jobs leave the queue), then its pretrain
resumed to the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_slurm import queue_state
from tests.helpers import last_step, profile_copy, vitpod, wait_until
from tests.test_pipeline_slurm import COMMON
from vitpod.registry import runfiles
from vitpod.workflows.pipeline.chain import Chain

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slurm
@pytest.mark.slow
def test_pipeline_listed_reattached_cancelled_and_resumed(local_slurm, digits_dir, tmp_path):
    pytest.importorskip("torch")
    cluster = str(profile_copy(tmp_path, data=digits_dir.parent))
    root = tmp_path / "runs"
    chain = Chain(cluster, "volo_tiny", nodes=1, args=COMMON, run_root=str(root),
                  pretrain_args="--epochs 3 --warmup-epochs 0 --checkpoint-every 4",
                  finetune_args="--max-steps 2 --epochs 1").submit()  # fmt: skip
    pre = chain.stages["pretrain"]
    jobs = [j for s in chain.stages.values() for j in s.job_ids]
    wait_until("pretrain step 6 (a checkpoint kept)", lambda: last_step(pre.run_dir) >= 6, 150, 0.5)

    listed = vitpod("list", "--run-root", str(root), "--state", "RUNNING,PENDING", "--json")
    assert listed.returncode == 0, listed.stderr
    (entry,) = [e for e in json.loads(listed.stdout) if e["kind"] == "pipeline"]
    assert Path(entry["path"]) == chain.directory and sorted(entry["job_ids"]) == sorted(jobs)
    assert {p["name"]: p["state"] for p in entry["parts"]} == {
        "pretrain": "RUNNING", "finetune": "PENDING"
    }  # fmt: skip

    code = (
        "from vitpod.workflows.pipeline.chain import Chain\n"
        f"c = Chain.from_dir({str(chain.directory)!r})\n"
        "print(*[f'{s.name} {s.state} {s.job_ids}' for s in c.status()], sep='\\n')\n"
        "print('cancelled', sorted(c.cancel()))\n"
    )
    fresh = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    lines = fresh.stdout.splitlines()
    assert lines[0].startswith("pretrain RUNNING") and lines[1].startswith("finetune PENDING")
    assert lines[-1] == f"cancelled {sorted(jobs)}"
    wait_until("every job of the pipeline out of the queue",
               lambda: all(queue_state(j) == "" for j in jobs), 60, 0.5)  # fmt: skip
    assert (chain.directory / runfiles.PIPELINE).is_file() and pre.run_dir.is_dir()  # kept

    stopped_at = last_step(pre.run_dir)
    resumed = vitpod("resume", "--run", str(pre.run_dir))
    assert resumed.returncode == 0, resumed.stderr
    job = resumed.stdout.split("submitted batch job ")[1].split()[0]
    assert local_slurm.wait(job, timeout=240) == "COMPLETED"
    summary = json.loads((pre.run_dir / runfiles.SUMMARY).read_text())
    assert summary["steps"] > stopped_at and last_step(pre.run_dir) == summary["steps"]
    logs = "".join(p.read_text() for p in (pre.run_dir / runfiles.LOGS).glob(f"*{job}*rank0*.log"))
    assert "resumed from" in logs, logs[-2000:]  # from its checkpoint, not from step 0
