"""Real training: tiny VOLO on digits JPEGs, 2 gloo ranks, 32 px pretrain then 64 px fine-tune."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import logs, run_ranks
from vitpod.registry import runfiles

COMMON = [
    "--model", "volo_tiny", "--num-classes", "10", "-b", "16", "--workers", "0",
    "--loader", "torch", "--aa", "", "--reprob", "0", "--hflip", "0", "--scale", "0.5", "1",
    "--checkpoint-every", "0", "--log-interval", "1000", "--seed", "3",
]  # fmt: skip


@pytest.mark.slow
def test_pretrain_32px_then_finetune_64px_reaches_90_percent(digits_dir: Path, tmp_path: Path):
    pre, fine = tmp_path / "pre", tmp_path / "fine"
    codes = run_ranks(2, [str(digits_dir), *COMMON, "--img-size", "32", "--epochs", "6",
                          "--warmup-epochs", "1", "--lr", "3e-3", "--output", str(pre)],
                      tmp_path / "logs-pre")  # fmt: skip
    assert codes == [0, 0], logs(tmp_path / "logs-pre")
    assert runfiles.read_summary(pre)["world_size"] == 2

    # The 64 px view starts the model near 60-75% again. With 4 epochs and no warmup it ended at
    # 89.3-92.0% over seeds 1-6 on an avx512 Xeon (89.8% with seed 3: failed there, passed on the
    # EPYC machines); 5 epochs after 1 of warmup ended at 93.4-94.2% on the same seeds.
    codes = run_ranks(2, [str(digits_dir), *COMMON, "--img-size", "64", "--epochs", "5",
                          "--warmup-epochs", "1", "--lr", "2e-3", "--output", str(fine),
                          "--finetune", str(pre)],
                      tmp_path / "logs-fine")  # fmt: skip
    assert codes == [0, 0], logs(tmp_path / "logs-fine")
    result = runfiles.read_summary(fine)
    assert result["top1"] >= 90.0, result
    # The 64 px model really is a resampled 32 px one: a 2x2 VOLO position grid became 4x4.
    weights = torch.load(fine / "final" / "model.pt", weights_only=True)
    assert weights["pos_embed"].shape == (1, 4, 4, 64)
    assert "fine-tuning from" in logs(tmp_path / "logs-fine")
    evals = [
        json.loads(line) for line in (fine / "metrics" / "rank0.jsonl").read_text().splitlines()
    ]
    assert [e["epoch"] for e in evals if e["kind"] == "eval"] == [0, 1, 2, 3, 4]
