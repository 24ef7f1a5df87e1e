"""Token labeling end to end in one process: teacher scores, MixToken steps, contract metrics."""

import json
from pathlib import Path

import torch

from vitpod.trainer.__main__ import main
from vitpod.trainer.model.models import create_model
from vitpod.trainer.tokenlabels.token_teacher import generate_token_labels

CONTRACT_STEP_KEYS = {
    "kind", "step", "epoch", "rank", "world_size", "batch_size", "loss", "lr", "images_per_s",
    "time", "peak_mem_bytes", "warmup", "total_steps", "wall_time",
}  # fmt: skip


def test_token_label_run_trains_and_writes_the_metrics_contract(digits_dir: Path, tmp_path: Path):
    torch.manual_seed(0)
    labels = generate_token_labels(
        create_model("volo_tiny", 32, 10, 0.0), digits_dir, tmp_path / "tl.pt", img_size=32
    )
    run = tmp_path / "run"
    code = main(
        [str(digits_dir), "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32",
         "-b", "16", "--workers", "0", "--loader", "torch", "--max-steps", "4",
         "--warmup-steps-excluded", "1", "--token-label", "--token-label-data", str(labels),
         "--ground-truth", "--apex-amp", "--output", str(run), "--resume", "none"]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert set(s) == CONTRACT_STEP_KEYS
        assert set(s["time"]) == {"data", "compute", "comm", "optimizer", "step", "sync",
                                  "checkpoint_wait"}  # fmt: skip
        assert s["loss"] > 0 and s["peak_mem_bytes"] > 0 and s["time"]["comm"] > 0
    assert [s["warmup"] for s in steps] == [True, False, False, False]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and 0 <= summary["top1"] <= 100 and summary["images_per_s"] > 0
    config = json.loads((run / "config.json").read_text())
    assert config["token_label"] and config["token_label_size"] == 2 and config["amp"]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert json.loads((run / "final" / "model.json").read_text())["model"] == "volo_tiny"
