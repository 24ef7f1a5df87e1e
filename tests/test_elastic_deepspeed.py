"""Elastic resume under DeepSpeed ZeRO: a run preempted on N ranks continues on M (2 -> 4,
2 -> 1, 1 -> 2, 4 -> 2) through DeepSpeed's universal checkpoint, with the samples, LR and step
count of the run never stopped and its losses within the tolerance of another summation order."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_logs, logs, preempted, step_records, train
from vitpod.trainer.checkpointing import ds_universal
from vitpod.trainer.checkpointing.checkpoint import Checkpointer, ResumeError
from vitpod.trainer.checkpointing.elastic import Resize

pytest.importorskip("deepspeed")

# volo_tiny on digits at 32 px, global batch 32 = ranks x 8 x accumulation (4 x 8 x 1, 2 x 8 x 2,
# 1 x 8 x 4); the LR warms up over epoch 0 (45 steps), so it changes every step of the 14 run
# here.
ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "8",
    "--global-batch", "32", "--elastic", "--workers", "0", "--loader", "torch",
    "--epochs", "2", "--warmup-epochs", "1", "--lr", "2e-3", "--drop-path", "0.0",
    "--checkpoint-every", "0", "--log-interval", "1", "--seed", "7", "--log-sample-ids",
    "--hflip", "0.5", "--deepspeed", "--max-steps", "14", "--no-eval",
]  # fmt: skip
STEPS = 14
# Reference: the run never stopped on the ranks that wrote the checkpoint, so the steps before
# the resume are equal to the bit and the first one after it is the loaded state's forward.
# "global_loss" is the step's mean loss over its 32 samples; float32 on CPU, 2 x (8 x 2) and
# 1 x (8 x 4) sum the same gradients in another order. Measured (14 steps, signal at step
# 4-8): ZeRO-1 2->1 and 2->4, ZeRO-2 2->1 and 4->2, ZeRO-3 2->1 at most 6.0e-08 on any step
# (one float32 rounding of a loss near 2.3), ZeRO-2 1->2 and ZeRO-3 4->2 at most 1.2e-07;
# final weights within 1.2e-07.
LOSS_TOLERANCE = 1e-6
RESUME_TOLERANCE = 1e-6
PARAM_TOLERANCE = 1e-6  # max |difference| of any final weight


def max_param_diff(a: Path, b: Path) -> float:
    want = torch.load(a / "final" / "model.pt", weights_only=True)
    got = torch.load(b / "final" / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    # BatchNorm statistics are rank 0's own micro-batches': another split, other values.
    weights = [k for k in want if not k.endswith(("running_mean", "running_var", "_tracked"))]
    return max((want[k] - got[k]).abs().max().item() for k in weights)


@pytest.mark.slow
@pytest.mark.parametrize("stage,before,after", [(1, 2, 4), (2, 2, 1), (2, 1, 2), (3, 4, 2)])
def test_preempted_zero_run_continues_on_another_world_size(
    digits_dir: Path, tmp_path: Path, stage: int, before: int, after: int
) -> None:
    args = [str(digits_dir), *ARGS, "--zero-stage", str(stage)]
    straight = train(before, tmp_path / "straight", args, timeout=600)
    stopped = tmp_path / "stopped"
    at = random.Random(stage * 10 + before).randrange(3, 8)
    stopped_at = preempted(before, stopped, args, at, rank=-1, timeout=600)  # the last rank
    resumed = train(after, stopped, args, timeout=600)
    assert f"step {stopped_at}, epoch 0" in logs(launch_logs(resumed))
    step_dir = Checkpointer(stopped / "checkpoints", 0, after).step_dir(stopped_at)
    assert (step_dir / ds_universal.UNIVERSAL / "zero").is_dir()  # converted once, kept

    a, b = step_records(straight), step_records(resumed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [a[s]["sample_digest"] for s in a] == [b[s]["sample_digest"] for s in a]
    assert [a[s]["lr"] for s in a] == pytest.approx([b[s]["lr"] for s in a], rel=1e-12)
    assert {b[s]["world_size"] for s in b if s > stopped_at} == {after}
    diff = {s: abs(a[s]["global_loss"] - b[s]["global_loss"]) for s in a}
    params = max_param_diff(straight, resumed)
    print(f"ZeRO-{stage} {before}->{after} ranks at step {stopped_at}: |loss diff| per step "
          f"{[f'{d:.1e}' for d in diff.values()]}, max |param diff| {params:.2e}")  # fmt: skip
    assert all(diff[s] == 0 for s in diff if s <= stopped_at)  # the same ranks, the same run
    # The first step after the resume: the loaded state's forward (only the split differs).
    assert diff[stopped_at + 1] < RESUME_TOLERANCE
    assert max(diff.values()) < LOSS_TOLERANCE
    assert params < PARAM_TOLERANCE


def test_a_checkpoint_without_deepspeed_partitions_is_refused_clearly(tmp_path: Path) -> None:
    for rank in (1, 0):  # rank 0 commits once rank 1's files are down
        ck = Checkpointer(tmp_path, rank=rank, world_size=2, elastic=Resize(32, "deepspeed"),
                          launch="start1")  # fmt: skip
        ck.save(4, 0, {"step": 4})
        ck.close()
    with pytest.raises(ResumeError, match="holds no deepspeed/ folder"):
        Checkpointer(tmp_path, 0, 1, elastic=Resize(32, "deepspeed")).agree_on_latest()


@pytest.mark.parametrize(
    "files,stage",
    [([], "0"), (["zero_pp_rank_0_mp_rank_00_optim_states.pt"], "1/2"),
     (["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"],
      "3"), (["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"], "1/2")],
)  # fmt: skip
def test_the_saved_zero_stage_is_read_from_the_file_names(
    tmp_path: Path, files: list[str], stage: str
) -> None:
    for name in ["mp_rank_00_model_states.pt", *files]:
        (tmp_path / name).touch()
    assert ds_universal.saved_stage(tmp_path) == stage


def test_a_checkpoint_deepspeed_cannot_convert_is_refused_naming_its_stage(tmp_path: Path) -> None:
    ds_dir = tmp_path / ds_universal.TAG
    ds_dir.mkdir()
    for rank in range(2):  # ZeRO-1/2 file names, unreadable contents
        (ds_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text("torn")
    with pytest.raises(ds_universal.NotConvertible, match="ZeRO-1/2 checkpoint .* on 2 ranks"):
        ds_universal.ensure_universal(tmp_path, rank=0)
    assert not (tmp_path / ds_universal.UNIVERSAL).exists()
