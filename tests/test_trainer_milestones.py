"""--milestone-every N keeps the checkpoints at the end of epochs N, 2N, ... (counted from 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers import logs, run_ranks
from tests.test_trainer_checkpoint import state
from vitpod.trainer.checkpointing.checkpoint import Checkpointer


def test_checkpointer_marks_completed_epoch_multiples(tmp_path: Path) -> None:
    # At an epoch-end save `epoch` is the number of epochs completed (the trainer's next epoch).
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1, milestone_every=2)
    for epoch in range(1, 6):
        ck.save(step=10 * epoch, epoch=epoch, state=state(epoch), epoch_end=True)
    ck.save(step=55, epoch=5, state=state(55))  # a mid-epoch save is never a milestone
    ck.close()
    kept = {int(p.name.split("_")[1]): json.loads((p / "rank0.json").read_text())
            for p in ck.step_dirs()}  # fmt: skip
    assert sorted(kept) == [20, 40, 55]
    assert [m["epoch"] for s, m in sorted(kept.items()) if m["milestone"]] == [2, 4]


def test_trainer_keeps_the_ends_of_epochs_2_and_4(digits_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    for split in ("train", "val"):
        for cls in ("0", "1"):
            (data / split / cls).mkdir(parents=True)
            for src in sorted((digits_dir / split / cls).glob("*.jpg"))[:2]:
                shutil.copy(src, data / split / cls / src.name)
    run = tmp_path / "run"
    argv = [str(data), "--model", "volo_tiny", "--img-size", "32", "-b", "2", "--workers", "0",
            "--loader", "torch", "--aa", "", "--reprob", "0", "--epochs", "4",
            "--warmup-epochs", "0", "--no-eval", "--checkpoint-every", "0", "--keep-last", "1",
            "--milestone-every", "2", "--output", str(run)]  # fmt: skip
    assert run_ranks(1, argv, tmp_path / "logs") == [0], logs(tmp_path / "logs")
    # 4 images, batch 2: 2 steps an epoch, so epoch e ends at step 2e.
    kept = {p.name: json.loads((p / "rank0.json").read_text())
            for p in sorted((run / "checkpoints").iterdir())}  # fmt: skip
    assert {name: (m["epoch"], m["milestone"]) for name, m in kept.items()} == {
        "step_000000004": (2, True),
        "step_000000008": (4, True),
    }
