"""A real SIGUSR2 on one rank, then resume: the same parameters as a run never stopped,
with random augmentation on; and a SIGUSR2 before the first step still ends in exit 75."""

import json
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    last_step,
    logs,
    preempt_at,
    run_ranks,
    start_ranks,
    wait_ranks,
    wait_until,
)
from vitpod.trainer.exitcodes import OK, REQUEUE

ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "16",
    "--workers", "0", "--loader", "torch", "--epochs", "3", "--warmup-epochs", "1",
    "--lr", "2e-3", "--drop-path", "0.1", "--checkpoint-every", "8", "--keep-last", "2",
    "--log-interval", "1000", "--seed", "5",
    # Every random augmentation on: random resized crop, flip, RandAugment, random erasing.
    # Each sample's augmentation is seeded from (seed, epoch, index), model randomness (drop
    # path) from (seed, rank, step), so the resumed run sees the same batches bit for bit.
    "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--hflip", "0.5", "--scale", "0.08", "1",
]  # fmt: skip
SIGNAL_AT_STEP = 52  # in the middle of epoch 1 (45 steps per epoch)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final" / "model.pt", weights_only=True)


@pytest.mark.slow
def test_preempted_and_resumed_run_equals_uninterrupted_run(digits_dir: Path, tmp_path: Path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    codes = run_ranks(2, [str(digits_dir), *ARGS, "--output", str(straight)], tmp_path / "l1")
    assert codes == [OK, OK], logs(tmp_path / "l1")

    procs = start_ranks(2, [str(digits_dir), *ARGS, "--output", str(stopped)], tmp_path / "l2")
    preempt_at(stopped, SIGNAL_AT_STEP, procs, rank=1, timeout=120)  # rank 0 learns it from 1
    assert wait_ranks(procs, tmp_path / "l2") == [REQUEUE, REQUEUE], logs(tmp_path / "l2")
    assert not (stopped / "final").exists()
    newest = sorted((stopped / "checkpoints").iterdir())[-1]
    manifest = json.loads((newest / "rank1.json").read_text())
    assert SIGNAL_AT_STEP <= manifest["step"] < 90 and manifest["epoch"] == 1  # mid-epoch

    # The newest checkpoint is damaged: resume must skip it, take the previous one, stay exact.
    (newest / "rank1.pt").write_bytes(b"torn write")
    codes = run_ranks(2, [str(digits_dir), *ARGS, "--output", str(stopped)], tmp_path / "l3")
    assert codes == [OK, OK], logs(tmp_path / "l3")
    assert f"skipping checkpoint {newest}" in logs(tmp_path / "l3")
    assert "resumed from" in logs(tmp_path / "l3")

    a, b = final_weights(straight), final_weights(stopped)
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, differing[:5]
    steps = [json.loads((run / "summary.json").read_text())["steps"] for run in (straight, stopped)]
    assert steps == [135, 135]


def handles(pid: int, signum: int) -> bool:
    """Whether the process has installed a handler for `signum` (SigCgt in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(x for x in status.splitlines() if x.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signum - 1) & 1)


def test_signal_during_startup_requeues_every_rank(digits_dir: Path, tmp_path: Path):
    run = tmp_path / "early"
    args = [str(digits_dir), *ARGS, "--output", str(run)]
    procs = start_ranks(2, args, tmp_path / "logs", fresh=True)  # the signal lands mid-imports

    def handler_set() -> bool:  # as soon as main() starts, mid-imports
        if handles(procs[1].pid, signal.SIGUSR2):
            return True
        assert procs[1].poll() is None, logs(tmp_path / "logs")
        return False

    wait_until("rank 1's SIGUSR2 handler", handler_set, 60, interval=0.005)
    procs[1].send_signal(signal.SIGUSR2)
    assert wait_ranks(procs, tmp_path / "logs") == [REQUEUE, REQUEUE], logs(tmp_path / "logs")
    assert last_step(run) == 0  # no step was taken, so nothing was worth a checkpoint
    assert not list((run / "checkpoints").glob("step_*")) and not (run / "final").exists()
    assert "before the first step" in logs(tmp_path / "logs")
