"""Corrupt images: skipped with one warning per file (not per epoch), counted; or a failure."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.helpers import logs, run_ranks
from vitpod.trainer.data import CorruptImageError, DataConfig, create_loader


def _folder_with_corrupt_train_images(digits_dir: Path, root: Path) -> tuple[Path, list[str]]:
    for split in ("train", "val"):
        for cls in ("0", "1"):
            (root / split / cls).mkdir(parents=True)
            for src in sorted((digits_dir / split / cls).glob("*.jpg"))[:4]:
                shutil.copy(src, root / split / cls / src.name)
    truncated = root / "train" / "0" / sorted(p.name for p in (root / "train" / "0").iterdir())[0]
    truncated.write_bytes(truncated.read_bytes()[:200])
    garbage = root / "train" / "1" / "zzzz.jpg"
    garbage.write_text("not a jpeg")
    return root, sorted([str(truncated), str(garbage)])


@pytest.mark.parametrize("kind", ["torch", "dali"])
def test_each_corrupt_file_is_warned_about_once_over_epochs(digits_dir, tmp_path, caplog, kind):
    root, bad = _folder_with_corrupt_train_images(digits_dir, tmp_path / "d")
    cfg = DataConfig(data_dir=str(root), img_size=32, batch_size=4, workers=0, loader=kind,
                     auto_augment=None, reprob=0.0, corrupt="skip")  # fmt: skip
    loader = create_loader(cfg, "train", 0, 1)
    with caplog.at_level(logging.WARNING, logger="vitpod.trainer.data"):
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert sum(len(t) for _, t in loader) == 9 - len(bad)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for path in bad:
        assert sum(path in w for w in warnings) == 1, (path, warnings)
    assert len(warnings) == len(bad)
    assert sorted(loader.corrupt_files) == bad and len(loader.skipped) == 3 * len(bad)


def test_fail_names_the_file_and_the_flag(digits_dir, tmp_path):
    root, bad = _folder_with_corrupt_train_images(digits_dir, tmp_path / "d")
    cfg = DataConfig(data_dir=str(root), img_size=32, batch_size=4, workers=0, loader="torch",
                     auto_augment=None, reprob=0.0, corrupt="fail")  # fmt: skip
    with pytest.raises(CorruptImageError, match=r"cannot decode .*(zzzz|0\/\w+)\.jpg.*--corrupt"):
        list(create_loader(cfg, "train", 0, 1))


def test_trainer_counts_corrupt_images_in_summary_and_metrics(digits_dir, tmp_path):
    root, bad = _folder_with_corrupt_train_images(digits_dir, tmp_path / "d")
    run = tmp_path / "run"
    argv = [str(root), "--model", "volo_tiny", "--img-size", "32", "-b", "2", "--workers", "0",
            "--loader", "torch", "--aa", "", "--reprob", "0", "--epochs", "2",
            "--warmup-epochs", "0", "--checkpoint-every", "0", "--corrupt", "skip",
            "--output", str(run)]  # fmt: skip
    assert run_ranks(2, argv, tmp_path / "logs") == [0, 0], logs(tmp_path / "logs")
    assert json.loads((run / "summary.json").read_text())["corrupt_images"] == len(bad)
    lines = [line for r in (0, 1) for line in (run / "metrics" / f"rank{r}.jsonl").open()]
    records = [json.loads(line) for line in lines]
    found = [f for rec in records if rec["kind"] == "corrupt" for f in rec["files"]]
    assert sorted(set(found)) == bad
    text = logs(tmp_path / "logs")
    for path in bad:  # 2 epochs, 2 ranks: at most one warning per rank, never one per epoch
        assert 1 <= text.count(f"skipping corrupt image {path}") <= 2

    argv[argv.index("skip")] = "fail"
    argv[argv.index(str(run))] = str(tmp_path / "run-fail")
    codes = run_ranks(1, argv, tmp_path / "logs-fail")
    assert codes != [0] and "cannot decode" in logs(tmp_path / "logs-fail")
    assert any(path in logs(tmp_path / "logs-fail") for path in bad)
