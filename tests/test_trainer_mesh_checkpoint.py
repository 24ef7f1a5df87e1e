"""Sharded (DCP) checkpoints: exact resume, loading into another mesh, fine-tuning from one."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_logs, logs, train

COMMON = [
    "--dataset", "digits", "--model", "vit_micro", "--img-size", "32", "--num-classes", "10",
    "-b", "16", "--workers", "0", "--loader", "torch", "--aa", "", "--reprob", "0",
    "--drop-path", "0", "--lr", "2e-3", "--warmup-epochs", "0", "--log-interval", "1000",
    "--seed", "7", "--no-eval", "--checkpoint-every", "5",
]  # fmt: skip
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a shared 2-core machine is slow


def train_steps(nproc: int, run: Path, digits: Path, steps: int, *flags: str) -> None:
    train(nproc, run, [str(digits), *COMMON, "--max-steps", str(steps), *flags], timeout=1500)


def final(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final" / "model.pt", weights_only=True)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def from_checkpoint(source: Path, step: int, run: Path) -> Path:
    """A run directory whose only checkpoint is `source`'s step `step` (resume picks it)."""
    name = f"step_{step:09d}"
    shutil.copytree(source / "checkpoints" / name, run / "checkpoints" / name)
    return run


@pytest.fixture(scope="module")
def tp_run(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dp 2 x tp 2, 10 steps, sharded checkpoints at steps 5 and 10."""
    run = tmp_path_factory.mktemp("dcp") / "tp"
    train_steps(4, run, digits_dir, 10, "--tp", "2")
    assert (run / "checkpoints" / "step_000000005" / "dcp" / ".metadata").is_file()
    return run


def test_resume_mid_epoch_is_exact(tp_run: Path, digits_dir: Path) -> None:
    run = from_checkpoint(tp_run, 5, tp_run.parent / "resumed")
    train_steps(4, run, digits_dir, 10, "--tp", "2")
    assert "resumed from" in logs(launch_logs(run))
    assert_same(final(run), final(tp_run))


@pytest.mark.parametrize("damage", ["metadata_missing", "shard_cut"])
def test_a_damaged_newest_sharded_checkpoint_resumes_from_the_one_before(
    tp_run: Path, digits_dir: Path, damage: str
) -> None:
    """Step 10's DCP files damaged on disk (its .metadata gone, or its largest shard cut in
    half): the resume skips it, goes on from step 5 and ends where the uninterrupted run did."""
    run = from_checkpoint(tp_run, 5, tp_run.parent / f"damaged_{damage}")
    from_checkpoint(tp_run, 10, run)
    dcp_dir = run / "checkpoints" / "step_000000010" / "dcp"
    if damage == "metadata_missing":
        (dcp_dir / ".metadata").unlink()
    else:
        shard = max(dcp_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    train_steps(4, run, digits_dir, 10, "--tp", "2")
    log = logs(launch_logs(run))
    assert "skipping checkpoint" in log and "step_000000005" in log.split("resumed from")[1]
    assert_same(final(run), final(tp_run))


def trained_after_load(
    source: Path, work: Path, digits: Path, *flags: str, loader_restarts: bool
) -> None:
    """Load `source`'s step-5 checkpoint into the mesh of `flags` and train steps 6-10 there;
    the reference is the same load stopped at step 8 and resumed (same mesh: exact), which
    must end bit for bit where the uninterrupted one does. The loader keeps its position when
    the samples done are a whole number of the new mesh's global batches (elastic.py)."""
    every = ("--checkpoint-every", "2")
    straight = from_checkpoint(source, 5, work / "straight")
    train_steps(4, straight, digits, 10, *flags, *every)
    restarted = "epoch 0 restarts from its first batch" in logs(launch_logs(straight))
    assert restarted == loader_restarts
    steps = [r for r in records(straight) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [6, 7, 8, 9, 10]
    assert all(math.isfinite(r["loss"]) for r in steps)
    reference = from_checkpoint(source, 5, work / "reference")
    train_steps(4, reference, digits, 8, *flags, *every)
    train_steps(4, reference, digits, 10, *flags, *every)
    assert_same(final(straight), final(reference))
    assert [r["loss"] for r in records(reference) if r["kind"] == "step"][-2:] == [
        r["loss"] for r in steps[-2:]
    ]


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]


def test_tp2_dp2_checkpoint_loads_into_fsdp_dp4(tp_run: Path, digits_dir: Path) -> None:
    run = from_checkpoint(tp_run, 10, tp_run.parent / "as_dp4")
    train_steps(
        4, run, digits_dir, 10, "--fsdp"
    )  # at step 10: the loaded weights are the final ones
    assert_same(final(run), final(tp_run))
    # 5 steps x 32 samples is no whole number of dp4's 64-sample steps: epoch 0 starts over.
    trained_after_load(
        tp_run, tp_run.parent / "dp4_after", digits_dir, "--fsdp", loader_restarts=True
    )


def test_fsdp_dp4_checkpoint_loads_into_tp2_dp2(tp_run: Path, digits_dir: Path) -> None:
    source = tp_run.parent / "dp4"
    train_steps(4, source, digits_dir, 10, "--fsdp")
    run = from_checkpoint(source, 10, tp_run.parent / "as_tp2")
    train_steps(4, run, digits_dir, 10, "--tp", "2")
    assert_same(final(run), final(source))
    # 5 steps x 64 samples are 10 of tp2 dp2's 32-sample steps: the loader goes on from there.
    trained_after_load(
        source, tp_run.parent / "tp2_after", digits_dir, "--tp", "2", loader_restarts=False
    )


def test_finetune_starts_from_a_sharded_checkpoint(tp_run: Path, digits_dir: Path) -> None:
    """Plain DDP reads the dp 2 x tp 2 shards and timm's qkv order comes back."""
    run = tp_run.parent / "finetune"
    step_dir = tp_run / "checkpoints" / "step_000000010"
    train_steps(2, run, digits_dir, 0, "--finetune", str(step_dir), "--checkpoint-every", "0")
    assert_same(final(run), final(tp_run))
