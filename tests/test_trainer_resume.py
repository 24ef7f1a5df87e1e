"""A real SIGUSR2 on one rank, then resume: the same parameters as a run never stopped."""

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.test_trainer_launch import logs, run_ranks, start_ranks, wait_ranks
from trainer.exitcodes import OK, REQUEUE

ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "16",
    "--workers", "0", "--loader", "torch", "--epochs", "3", "--warmup-epochs", "1",
    "--lr", "2e-3", "--drop-path", "0.1", "--checkpoint-every", "8", "--keep-last", "2",
    "--log-interval", "1000", "--seed", "5",
    # Augmentation that draws no random numbers (RandAugment with 0 ops replaces timm's color
    # jitter; full-image crops): a resumed torch DataLoader takes one extra draw from the global
    # RNG when it starts, so random augmentations of the first batch after a resume differ.
    # Model randomness (drop path 0.1 here) is reseeded per step and stays exact regardless.
    "--aa", "rand-n0-m0", "--reprob", "0", "--hflip", "0", "--scale", "1", "1",
]  # fmt: skip
SIGNAL_AT_STEP = 52  # in the middle of epoch 1 (45 steps per epoch)


def last_step(run: Path) -> int:
    path = run / "metrics" / "rank0.jsonl"
    if not path.is_file():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((x["step"] for x in lines if x["kind"] == "step"), default=0)


def preempt_at(run: Path, step: int, procs, signum: int) -> None:
    deadline = time.monotonic() + 120
    while last_step(run) < step:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.02)
    procs[1].send_signal(signum)  # only rank 1 hears it; rank 0 must learn it from rank 1


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final" / "model.pt", weights_only=True)


@pytest.mark.slow
def test_preempted_and_resumed_run_equals_uninterrupted_run(digits_dir: Path, tmp_path: Path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    codes = run_ranks(2, [str(digits_dir), *ARGS, "--output", str(straight)], tmp_path / "l1")
    assert codes == [OK, OK], logs(tmp_path / "l1")

    procs = start_ranks(2, [str(digits_dir), *ARGS, "--output", str(stopped)], tmp_path / "l2")
    preempt_at(stopped, SIGNAL_AT_STEP, procs, signal.SIGUSR2)
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
