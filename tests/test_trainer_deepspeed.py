"""DeepSpeed ZeRO-2 as the third gradient engine: 2 gloo ranks train, checkpoint and resume
exactly (the same final parameters as an uninterrupted run, bit for bit)."""

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import logs, run_ranks
from vitpod.trainer.engines.deepspeed_engine import SHM_COMM_OP

pytest.importorskip("deepspeed")

ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "16",
    "--workers", "0", "--loader", "torch", "--epochs", "1", "--warmup-epochs", "0",
    "--lr", "2e-3", "--deepspeed", "--zero-stage", "2", "--checkpoint-every", "3",
    "--warmup-steps-excluded", "1",
]  # fmt: skip


def steps(run: Path, rank: int) -> list[dict]:
    lines = (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


@pytest.mark.slow
def test_zero2_trains_checkpoints_and_resumes_exactly(digits_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    codes = run_ranks(2, [str(digits_dir), *ARGS, "--max-steps", "6", "--output", str(run)],
                      tmp_path / "l1", timeout=420)  # fmt: skip
    assert codes == [0, 0], logs(tmp_path / "l1")
    # No JIT-compiled op: DeepSpeed's CPU backend would build (or load) its inference-only shm
    # all-reduce and print that it did.
    assert SHM_COMM_OP not in logs(tmp_path / "l1")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine"] == "deepspeed" and summary["steps"] == 6
    losses = [r["loss"] for r in steps(run, 0)]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)  # one per step
    # Each rank wrote its own ZeRO partition beside the per-rank state files.
    step_dir = run / "checkpoints" / "step_000000006"
    assert sorted(p.name for p in step_dir.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert len(list((step_dir / "deepspeed").glob("*optim_states.pt"))) == 2

    codes = run_ranks(2, [str(digits_dir), *ARGS, "--max-steps", "9", "--output", str(run)],
                      tmp_path / "l2", timeout=420)  # fmt: skip
    assert codes == [0, 0], logs(tmp_path / "l2")
    assert "resumed from" in logs(tmp_path / "l2") and "step 6" in logs(tmp_path / "l2")
    assert [r["step"] for r in steps(run, 1)] == list(range(1, 10))

    reference = tmp_path / "reference"  # the same 9 steps, never stopped
    codes = run_ranks(2, [str(digits_dir), *ARGS, "--max-steps", "9", "--output",
                          str(reference)], tmp_path / "l3", timeout=420)  # fmt: skip
    assert codes == [0, 0], logs(tmp_path / "l3")
    want = torch.load(reference / "final" / "model.pt", weights_only=True)
    got = torch.load(run / "final" / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert [r["loss"] for r in steps(reference, 1)] == [r["loss"] for r in steps(run, 1)]
