"""`make token-labels` on the real local Slurm: a job array labels digits with a run directory's
final model, a resubmission redoes only the missing shard, a token-labeled pretrain trains on
the labels with the DALI loader, and labels of the wrong grid are refused before sbatch."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import make, wait_until
from vitpod.registry import labelset
from vitpod.trainer.checkpointing.checkpoint import save_final
from vitpod.trainer.model.models import create_model, model_manifest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(
    local_slurm, localslurm_data, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """localslurm's digits folder, a teacher run directory and a private run root."""
    base = tmp_path_factory.mktemp("labels")
    teacher = base / "teacher-run"
    torch.manual_seed(0)
    save_final(
        teacher, create_model("volo_tiny", 32, 10, 0.0).state_dict(),
        model_manifest("volo_tiny", 32, 10),
    )  # fmt: skip
    return {"teacher": teacher, "labels": base / "tl", "runs": base / "runs"}


def make_localslurm(target: str, setup: dict[str, Path], **variables: str):
    """`make TARGET CLUSTER=localslurm VARIABLES` with the run directories under setup's."""
    pairs = [f"{k}={v}" for k, v in variables.items()]
    return make(target, "CLUSTER=localslurm", *pairs, runs=setup["runs"], timeout=120)


def label(setup: dict[str, Path]) -> tuple[str, str]:
    out = make_localslurm("token-labels", setup, TEACHER=str(setup["teacher"]), SHARDS="4",
                          ARGS=f"--label-dir {setup['labels']}")  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = re.search(r"submitted array job (\d+)", out.stdout)
    assert job, out.stdout
    states = wait_done(job.group(1))
    assert states == ["COMPLETED", "COMPLETED"], states
    run_dir = re.search(r"run directory (\S+)", out.stdout)
    assert run_dir
    return job.group(1), run_dir.group(1)


def test_label_array_resume_use_and_refusal(setup):
    _, run_dir = label(setup)
    script = (Path(run_dir) / "job.sbatch").read_text()
    assert (
        "#SBATCH --array=0-1" in script
        and "bind.sh" in script
        and "vitpod.trainer.tokenlabels.label" in script
    )
    manifest = labelset.read_manifest(setup["labels"])
    assert manifest is not None
    names = labelset.folder_names(REPO / "data" / "digits")
    assert manifest["samples"] == len(names) == 1433
    assert manifest["names_sha256"] == labelset.names_digest(names)
    assert (manifest["grid"], manifest["num_shards"]) == (2, 4)
    assert [t["shard"] for t in manifest["throughput"]] == [0, 1, 2, 3]
    assert sum(t["images"] for t in manifest["throughput"]) == 1433

    # Matching labels: nothing is submitted again.
    again = make_localslurm("token-labels", setup, TEACHER=str(setup["teacher"]), SHARDS="4",
                            ARGS=f"--label-dir {setup['labels']}")  # fmt: skip
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout

    # A lost shard (and so no manifest): the resubmitted array redoes only that one.
    lost = labelset.shard_path(setup["labels"], 2, 4)
    kept = labelset.shard_path(setup["labels"], 0, 4).stat().st_mtime_ns
    lost.unlink()
    lost.with_suffix(".json").unlink()
    (setup["labels"] / labelset.RECORD).unlink()
    _, rerun = label(setup)
    logs = "".join(p.read_text() for p in (Path(rerun) / "logs").glob("train-*.log"))
    assert logs.count("already done") == 3 and "shard 2/4: 358 images" in logs, logs
    assert labelset.shard_path(setup["labels"], 0, 4).stat().st_mtime_ns == kept
    assert labelset.read_manifest(setup["labels"]) is not None

    # A token-labeled pretrain on Slurm reads them, on DALI (cut with its pipeline's boxes).
    flags = f"--token-label --token-label-size 2 --token-label-data {setup['labels']}"
    args = f"{flags} --max-steps 2 --workers 0 --loader dali --epochs 1"
    train = make_localslurm("pretrain", setup, NODES="1", ARGS=args)
    assert train.returncode == 0, train.stderr
    job = re.search(r"submitted batch job (\d+)", train.stdout)
    assert job and wait_done(job.group(1)) == ["COMPLETED"]
    run = Path(train.stdout.strip().splitlines()[-1]).parent
    config = json.loads((run / "config.json").read_text())
    assert config["token_label"] and config["token_label_data"] == str(setup["labels"])
    assert config["loader"] == "dali"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["token_labels"]["layout"] == labelset.FORMAT

    # Labels of the wrong grid: refused before sbatch, with the command that makes them.
    before = sorted(setup["runs"].rglob("job.sbatch"))
    wrong = make_localslurm("pretrain", setup,
                            ARGS=f"--img-size 64 --token-label --token-label-size 4 "
                                 f"--token-label-data {setup['labels']}")  # fmt: skip
    assert wrong.returncode == 2
    assert "grid 2 (labeled at 32 px)" in wrong.stderr and "grid 4" in wrong.stderr
    assert "make token-labels CLUSTER=localslurm" in wrong.stderr
    assert "submitted" not in wrong.stdout
    assert sorted(setup["runs"].rglob("job.sbatch")) == before


def wait_done(job_id: str, timeout: float = 1200) -> list[str]:
    """Final accounting state of each task of a job (array), once squeue no longer lists it.
    Tolerant of a slow controller (the local Slurm is shared): a query that times out is retried.
    """

    def done() -> list[str] | None:
        try:
            queue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i"], timeout=60,
                                   capture_output=True, text=True)  # fmt: skip
            if queue.returncode != 0 or not queue.stdout.strip():
                acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                                      timeout=60, capture_output=True, text=True)  # fmt: skip
                states = [line.split()[0] for line in acct.stdout.split("\n") if line.strip()]
                if states and all(s not in ("PENDING", "RUNNING") for s in states):
                    return states
        except subprocess.TimeoutExpired:
            pass
        return None

    try:
        return wait_until(f"job {job_id} to finish", done, timeout, interval=1)
    except AssertionError:
        subprocess.run(["scancel", job_id], check=False)
        raise
