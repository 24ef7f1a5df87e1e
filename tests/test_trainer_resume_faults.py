"""Faults around checkpoints: a full disk mid-write, and a resume onto another world size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import logs, run_ranks
from vitpod.trainer.checkpointing.checkpoint import Checkpointer, ResumeError
from vitpod.trainer.checkpointing.elastic import Resize
from vitpod.trainer.exitcodes import OK, USAGE


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs: a real ENOSPC from the kernel, not a mocked write."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(small_disk: Path) -> None:
    ck = Checkpointer(small_disk / "checkpoints", rank=0, world_size=1, keep_last=1)
    ck.save(1, 0, {"w": torch.ones(1000)})  # 4 kB: fits
    ck.wait()
    ck.save(2, 0, {"w": torch.ones(400_000)})  # 1.6 MB: the disk fills up mid-write
    with pytest.raises(RuntimeError, match="No space left on device") as info:
        ck.wait()
    assert "previous checkpoints are untouched" in str(info.value)
    assert ck.latest_valid() == ck.step_dir(1)  # the newest complete one, verified
    assert torch.equal(ck.load(ck.step_dir(1))[0]["w"], torch.ones(1000))
    assert not [p for p in small_disk.rglob("*") if ".tmp-" in p.name]  # space given back


def _checkpoint(root: Path, world_size: int, **kwargs) -> None:
    """One step saved as `world_size` ranks of one start would (rank 0 commits last)."""
    for rank in reversed(range(world_size)):
        ck = Checkpointer(root, rank=rank, world_size=world_size, launch="start1", **kwargs)
        ck.save(4, 0, {"step": 4})
        ck.close()


def test_resume_onto_another_world_size_is_refused_clearly(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "four", 4)
    assert Checkpointer(tmp_path / "four", 0, 4).agree_on_latest() == tmp_path / "four" / (
        "step_000000004"
    )
    with pytest.raises(ResumeError, match="written by 4 ranks, this job has 2"):
        Checkpointer(tmp_path / "four", 0, 2).agree_on_latest()
    _checkpoint(tmp_path / "two", 2)  # and the reverse: not mistaken for a torn checkpoint
    with pytest.raises(ResumeError, match="written by 2 ranks, this job has 4"):
        Checkpointer(tmp_path / "two", 0, 4).agree_on_latest()


def test_another_world_size_resumes_with_the_same_global_batch(
    tmp_path: Path,
) -> None:
    _checkpoint(tmp_path, 4, elastic=Resize(64, "ring"))
    step = tmp_path / "step_000000004"
    assert Checkpointer(tmp_path, 0, 2, elastic=Resize(64, "ps")).agree_on_latest() == step
    with pytest.raises(ResumeError, match="global batch 64, this job has 2 ranks and global batch"):
        Checkpointer(tmp_path, 0, 2, elastic=Resize(32, "ring")).agree_on_latest()
    with pytest.raises(ResumeError, match="holds no deepspeed/ folder"):  # resharded if it had
        Checkpointer(tmp_path, 0, 2, elastic=Resize(64, "deepspeed")).agree_on_latest()


ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "16",
    "--workers", "0", "--loader", "torch", "--epochs", "1", "--warmup-epochs", "0",
    "--max-steps", "2", "--checkpoint-every", "2", "--no-eval", "--log-interval", "1000",
]  # fmt: skip


@pytest.mark.slow
def test_trainer_exits_usage_when_requeued_onto_another_world_size(
    digits_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    args = [str(digits_dir), *ARGS, "--output", str(run)]
    assert run_ranks(1, args, tmp_path / "l1") == [OK], logs(tmp_path / "l1")
    assert (
        json.loads((run / "checkpoints" / "step_000000002" / "rank0.json").read_text())[
            "world_size"
        ]
        == 1
    )
    codes = run_ranks(2, [*args, "--max-steps", "4"], tmp_path / "l2")
    assert codes == [USAGE, USAGE], logs(tmp_path / "l2")
    # -b 16 on 2 ranks is another global batch (32, not 16): the samples of a step would change
    assert "written by 1 ranks with global batch 16, this job has 2 ranks and global batch 32" in (
        logs(tmp_path / "l2")
    )
    assert os.listdir(run / "checkpoints") == ["step_000000002"]  # nothing new written


@pytest.mark.parametrize(
    "srun_says", ["task 1: Killed", "task 1: Exited with exit code 137"]
)  # the second when a wrapper shell (bind.sh) reports its child's SIGKILL
def test_status_names_a_killed_rank_not_an_earlier_restarts_noise(
    tmp_path: Path, srun_says: str
) -> None:
    """The logs of a job requeued once, then failed because rank 1 got SIGKILL (as srun and
    torch write them): the cause is srun's line, not the peers' gloo errors nor a traceback
    an earlier restart printed at exit."""
    from vitpod.workflows.watching.rootcause import root_cause

    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    (logs_dir / "train-9-restart0-rank0.log").write_text(
        "Traceback (most recent call last):\n"
        '  File "multiprocessing/resource_tracker.py", line 239, in main\n'
        "KeyError: '/mp-x'\n"
    )
    (logs_dir / "train-9-restart1-rank0.log").write_text(
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "trainer/train.py", line 1, in run\n'
        "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error: Connection reset "
        "by peer\n"
    )
    (logs_dir / "sbatch-9-restart1.log").write_text(
        f"srun: error: node2: task 2: Exited with exit code 1\nsrun: error: node1: {srun_says}\n"
    )
    cause = root_cause(logs_dir)
    assert cause is not None and "rank 1 on node1 was killed by SIGKILL" in cause.exception


_FAILS_WHILE_COMMIT_WAITS = """
import sys, time
from pathlib import Path
import torch
import vitpod.trainer.__main__ as entry
from vitpod.trainer.checkpointing.checkpoint import Checkpointer

def main():
    ck = Checkpointer(Path(sys.argv[1]), rank=0, world_size=2, launch="start1")
    ck.save(1, 0, {"w": torch.ones(3)})  # the writer thread now waits for rank 1's files
    while not (Path(sys.argv[1]) / "step_000000001" / "rank0.json").is_file():
        time.sleep(0.01)
    raise RuntimeError("peer rank 1 is gone")  # what gloo raises when a peer was SIGKILLed

entry.main = main
entry.cli()
"""


def test_a_rank_whose_peer_died_exits_at_once_while_its_commit_waits(tmp_path: Path) -> None:
    """Rank 0's writer waits (up to commit_timeout_s) for a dead peer's files; the rank's error
    must end the process now, not when srun's --wait or the commit timeout would."""
    done = subprocess.run(
        [sys.executable, "-c", _FAILS_WHILE_COMMIT_WAITS, str(tmp_path / "checkpoints")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: peer rank 1 is gone" in done.stderr
    step = tmp_path / "checkpoints" / "step_000000001"
    assert (step / "rank0.json").is_file() and not (step / "COMMIT.json").exists()
