"""The loop syncs losses to the host once per log interval, yet logs every step's exact loss."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from vitpod.registry import runfiles
from vitpod.trainer.__main__ import main
from vitpod.trainer.telemetry.metrics import topk_correct, topk_counts

TINY = ["--model", "volo_tiny", "--num-classes", "10", "-b", "16", "--workers", "0",
        "--loader", "torch", "--aa", "", "--reprob", "0", "--img-size", "32", "--epochs", "1",
        "--warmup-epochs", "0", "--lr", "2e-3", "--resume", "none", "--seed", "7",
        "--checkpoint-every", "4", "--max-steps", "7"]  # fmt: skip


def _steps(run: Path) -> list[dict]:
    return [r for r in runfiles.read_metrics(run, 0) if r["kind"] == "step"]


def test_every_step_keeps_its_exact_loss_whatever_the_log_interval(digits_dir: Path, tmp_path):
    every, batched = tmp_path / "every", tmp_path / "batched"
    assert main([str(digits_dir), *TINY, "--log-interval", "1", "--output", str(every)]) == 0
    assert main([str(digits_dir), *TINY, "--log-interval", "5", "--output", str(batched)]) == 0
    a, b = _steps(every), _steps(batched)
    # Steps 1-4 are flushed by the checkpoint at step 4, 5 by the interval, 6-7 by max-steps.
    assert [r["step"] for r in b] == list(range(1, 8))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert {"kind", "step", "epoch", "loss", "lr", "images_per_s", "time"} <= set(b[0])
    assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in b)
    summary = json.loads((batched / "summary.json").read_text())
    assert 0 <= summary["top1"] <= 100 and summary["steps"] == 7
    # main() pauses and freezes the collector for the start-up; an in-process caller gets it back.
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_topk_counts_on_the_device_match_the_host_counts():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.7, 0.1, 0.2], [0.2, 0.3, 0.5]])
    targets = torch.tensor([1, 2, 0])
    assert topk_counts(logits, targets, (1, 2)).tolist() == [1, 2]
    assert topk_correct(logits, targets, (1, 5)) == [1, 3]
