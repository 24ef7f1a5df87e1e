"""A damaged newest checkpoint, met as a user meets it on the real local Slurm.

An FSDP volo_tiny job (2 nodes x 1 rank, BatchNorm in its stem) is killed, one byte of a DCP
shard of its newest checkpoint is flipped on disk, and `make resume` continues the run: the job
skips the damaged checkpoint (its checksum no longer matches COMMIT.json), resumes from the one
before, completes, and ends bit-identical to a job never stopped (weights and BatchNorm
statistics: FSDP keeps them equal across ranks as DDP does).

The finished run then meets two mistakes (tests/test_checkpoint_faults.py has the rest in
process): its script resubmitted while the storage fails twice on COMMIT.json reads
(VITPOD_TEST_IO_FAULT, the checkpoint reader's test-only hook) retries and completes; the
trainer run over it by hand with srun from its plan.json edited by hand (img_size 48: a planned
rank reads its settings from plan.json alone) exits 2 on both ranks, naming the setting. Neither
changes a byte under checkpoints/.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.fixtures_slurm import queue_state, submit
from tests.helpers import REPO, last_step, make, one_rank_per_node, profile_copy, wait_until
from vitpod.trainer.checkpointing.reads import FAULT_ENV

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ARGS = (
    "--fsdp --loader torch --workers 0 --log-interval 1 --epochs 1 --warmup-epochs 0 "
    "--max-steps 12 --checkpoint-every 3 --no-eval --batch-size 32"
)


def _committed(run: Path) -> list[Path]:
    return sorted(p.parent for p in (run / "checkpoints").glob("step_*/COMMIT.json"))


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_newest_shard_resumes_from_the_one_before_exactly(
    local_slurm, digits_dir: Path, tmp_path: Path
) -> None:
    profile = profile_copy(tmp_path, data=digits_dir.parent, **one_rank_per_node())
    ref_job, reference = submit(tmp_path, profile, ARGS)
    job, run = submit(tmp_path, profile, ARGS)
    wait_until("two committed checkpoints", lambda: len(_committed(run)) >= 2, timeout=600)
    wait_until("a step past them", lambda: last_step(run) >= 7, timeout=600)
    subprocess.run(["scancel", "--signal=KILL", "--full", job], check=True)
    assert local_slurm.wait(job, timeout=300) in ("FAILED", "CANCELLED")
    wait_until("the killed job to leave the queue", lambda: queue_state(job) == "", timeout=120)
    newest = _committed(run)[-1]
    shard = max((newest / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip_one_byte(shard)

    out = make("resume", f"RUN={run}", runs=tmp_path / "runs", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    resumed_job = out.stdout.split("submitted batch job ")[-1].split()[0]
    assert local_slurm.wait(resumed_job, timeout=900) == "COMPLETED"
    assert local_slurm.wait(ref_job, timeout=900) == "COMPLETED"

    log = next((run / "logs").glob(f"train-{resumed_job}-*rank0.log")).read_text()
    assert f"skipping checkpoint {newest}" in log and "checksum mismatch" in log, log
    assert "resumed from" in log and newest.name not in log.split("resumed from")[1][:200]
    want = torch.load(reference / "final" / "model.pt", weights_only=True)
    got = torch.load(run / "final" / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert any("running_mean" in k for k in want)  # the BatchNorm statistics are compared too

    before = _tree(run / "checkpoints")
    storage_fails_twice = {**os.environ, FAULT_ENV: "EIO:2:COMMIT.json"}
    out = subprocess.run(["sbatch", "--parsable", str(run / "job.sbatch")], capture_output=True,
                         text=True, check=True, env=storage_fails_twice)  # fmt: skip
    again = out.stdout.strip().split(";")[0]
    assert local_slurm.wait(again, timeout=600) == "COMPLETED"
    log = next((run / "logs").glob(f"train-{again}-*rank0.log")).read_text()
    assert "retrying in" in log and "resumed from" in log, log
    assert _tree(run / "checkpoints") == before

    plan = run / "plan.json"
    planned = plan.read_text()
    edited = json.loads(planned)
    edited["trainer"]["data"]["img_size"] = 48
    plan.write_text(json.dumps(edited))
    try:
        typo = subprocess.run(
            ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--time=5",
             str(REPO / ".venv" / "bin" / "vitpod-train"), "--plan", str(plan)],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "MASTER_ADDR": "127.0.0.1"},
        )  # fmt: skip
    finally:
        plan.write_text(planned)
    assert typo.returncode == 2, typo.stdout[-3000:] + typo.stderr[-3000:]
    said = typo.stdout + typo.stderr
    assert said.count("--img-size: 32 in the checkpoint, 48 in this run") == 2, said[-3000:]
    assert _tree(run / "checkpoints") == before
