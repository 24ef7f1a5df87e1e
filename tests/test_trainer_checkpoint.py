"""Async checkpoints: staged copy, atomic checksummed files, keep-last-K, corrupt skip; finetune."""

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from vitpod.trainer.checkpointing.checkpoint import Checkpointer, save_final
from vitpod.trainer.model.models import ModelLoadError, create_model, load_finetune, model_manifest


def state(value: float) -> dict:
    return {
        "model": {"w": torch.full((256, 256), value)},
        "step": int(value),
        "rng": torch.get_rng_state(),
    }


def test_save_returns_after_the_copy_and_writes_the_old_values(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=1)
    live = state(1.0)
    ck.save(step=1, epoch=0, state=live)
    live["model"]["w"].fill_(99.0)  # training goes on while the write runs in the background
    ck.wait()
    saved = torch.load(tmp_path / "step_000000001" / "rank0.pt", weights_only=False)
    assert torch.equal(saved["model"]["w"], torch.full((256, 256), 1.0))
    manifest = json.loads((tmp_path / "step_000000001" / "rank0.json").read_text())
    assert manifest["step"] == 1 and manifest["bytes"] > 256 * 256 * 4
    assert ck.verify(tmp_path / "step_000000001") is None
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]  # no temp files left


def test_overlapped_copy_saves_the_state_of_the_checkpoint_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = create_model("volo_tiny", 32, 10, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    images, targets = torch.randn(4, 3, 32, 32), torch.arange(4)

    def train_step() -> None:
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        ck.fence()  # what the trainer does right before the optimizer step
        opt.step()
        opt.zero_grad()

    ck = Checkpointer(tmp_path, rank=0, world_size=1)
    train_step()
    live = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    snapshot = copy.deepcopy(live)
    buffers = {b.data_ptr() for b in model.buffers()}  # BatchNorm stats: the forward moves them
    ck.save(step=1, epoch=0, state=live, overlap=True, copy_now=buffers)  # copy not done yet
    for _ in range(3):  # training continues: forward/backward overlap the copy, then steps
        train_step()
    ck.wait()
    saved = torch.load(tmp_path / "step_000000001" / "rank0.pt", weights_only=False)
    for name, tensor in snapshot["model"].items():
        assert torch.equal(saved["model"][name], tensor), name
        assert not torch.equal(model.state_dict()[name], tensor) or "tracked" in name
    for index, moments in snapshot["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(saved["optimizer"]["state"][index][key], tensor), (index, key)
    assert ck.verify(tmp_path / "step_000000001") is None


def test_keeps_last_k_plus_milestones(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=2, milestone_every=2)
    for step in range(1, 7):
        ck.save(
            step, epoch=step, state=state(step), epoch_end=True
        )  # ends of epochs 2, 4, 6 are milestones
    ck.close()
    kept = sorted(int(p.name.split("_")[1]) for p in ck.step_dirs())
    assert kept == [2, 4, 5, 6]


def test_a_checkpoint_pruning_cannot_remove_is_named_in_a_warning(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    import os

    real_rmdir = os.rmdir

    def refuse_step_1(path, *args, **kwargs):
        if str(path).endswith("step_000000001"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", refuse_step_1)
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1, use_async=False)
    with caplog.at_level(logging.WARNING, logger="vitpod.trainer.checkpointing.checkpoint"):
        for step in (1, 2):
            ck.save(step, epoch=0, state=state(step))
    ck.close()
    assert "could not remove" in caplog.text and "step_000000001" in caplog.text
    assert "Permission denied" in caplog.text


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a torn write


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, the size unchanged
    path.write_bytes(bytes(data))


DAMAGE = {
    "cut": (lambda d: _cut(d / "rank0.pt"), "cut short"),
    "flipped": (lambda d: _flip(d / "rank0.pt"), "checksum mismatch"),
    "missing_file": (lambda d: (d / "rank0.pt").unlink(), "rank0.pt: missing"),
    "no_commit": (lambda d: (d / "COMMIT.json").unlink(), "no COMMIT.json"),
    "malformed_commit": (lambda d: (d / "COMMIT.json").write_text("{"), "COMMIT.json unreadable"),
    "sidecar_without_sha": (
        lambda d: (d / "rank0.json").write_text(json.dumps({"step": 20})),
        "rank0.json: 12 bytes",
    ),
    "commit_entry_without_sha": (lambda d: _drop_sha(d / "COMMIT.json"), "malformed entry"),
}


def _drop_sha(path: Path) -> None:
    record = json.loads(path.read_text())
    del record["files"]["rank0.pt"]["sha256"]
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_auto_skips_a_damaged_checkpoint_with_a_warning(
    tmp_path: Path, caplog, damage: str
) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=5)
    for step in (10, 20):
        ck.save(step, epoch=0, state=state(step))
    ck.close()
    harm, reason = DAMAGE[damage]
    harm(tmp_path / "step_000000020")
    with caplog.at_level(logging.WARNING):
        assert ck.latest_valid() == tmp_path / "step_000000010"
    assert "skipping checkpoint" in caplog.text and reason in caplog.text
    shared, own = ck.load(tmp_path / "step_000000010")
    assert shared["step"] == 10 and own is shared


def test_rotation_never_deletes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    """A newer-named step whose checksum is bad (left by an earlier start) does not count:
    saving 50 and then 60 with keep_last=1 keeps 60, the newest complete one."""
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1)
    ck.save(100, epoch=0, state=state(100))
    ck.wait()
    _flip(tmp_path / "step_000000100" / "rank0.pt")
    for step in (50, 60):
        ck.save(step, epoch=0, state=state(step))
        ck.wait()
        assert ck.step_dir(step).is_dir(), f"step {step} was deleted by its own save"
    ck.close()
    assert not ck.step_dir(50).exists()
    assert ck.latest_valid() == ck.step_dir(60)


def test_an_unreadable_milestone_record_is_kept(tmp_path: Path, caplog) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1, milestone_every=1)
    ck.save(1, epoch=1, state=state(1), epoch_end=True)
    ck.wait()
    (ck.step_dir(1) / "COMMIT.json").chmod(0)  # unreadable, not absent
    (ck.step_dir(1) / "COMMIT.json").write_text("{")  # ... and, for root, malformed
    with caplog.at_level(logging.WARNING):
        for step in (2, 3):
            ck.save(step, epoch=1, state=state(step))
            ck.wait()
    assert ck.step_dir(1).is_dir() and "keeping" in caplog.text
    assert not ck.step_dir(2).exists()


def test_every_file_records_its_job_and_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    ck = Checkpointer(tmp_path, rank=0, world_size=1, launch="abc")
    ck.save(7, epoch=0, state=state(7))
    ck.close()
    for name in ("rank0.json", "COMMIT.json"):
        record = json.loads((ck.step_dir(7) / name).read_text())
        assert (record["job_id"], record["restart"], record["launch"]) == ("4242", 3, "abc")
    assert set(json.loads((ck.step_dir(7) / "COMMIT.json").read_text())["files"]) == {
        "rank0.pt",
        "rank0.json",
    }


def test_unusable_checkpoints_newer_than_the_resume_point_are_moved_aside(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=1, keep_last=2)
    for step in (10, 20):
        ck.save(step, epoch=0, state=state(step))
    ck.close()
    (ck.step_dir(20) / "COMMIT.json").unlink()  # as if the job died before its commit
    assert ck.agree_on_latest() == ck.step_dir(10)
    assert ck.step_dir(20).exists()  # the verdict moves nothing; the resume, once loaded, does
    loaded = []
    ck.resume("auto", loaded.append, torch.device("cpu"))
    assert loaded == [ck.step_dir(10)] and not ck.step_dir(20).exists()
    moved = list((tmp_path / "discarded").iterdir())
    assert [p.name.split(".")[0] for p in moved] == ["step_000000020"]
    for step in (30, 40):  # newer commits and their rotation never delete what was set aside
        ck.save(step, epoch=0, state=state(step))
    ck.close()
    assert list((tmp_path / "discarded").iterdir()) == moved


def test_a_checkpoint_missing_a_rank_is_not_valid(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, rank=0, world_size=2, commit_timeout_s=0.5)
    ck.save(5, 0, state(5))
    with pytest.raises(RuntimeError, match=r"still waiting for rank1\.json"):
        ck.close()
    assert not (tmp_path / "step_000000005" / "COMMIT.json").exists()
    assert ck.latest_valid() is None  # rank 1 never wrote its part: not a resume point


def test_a_failed_write_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ck = Checkpointer(blocker, rank=0, world_size=1)
    ck.save(1, 0, state(1))
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        ck.wait()


def test_finetune_resamples_pos_embed_resets_head_and_refuses_other_models(tmp_path: Path) -> None:
    torch.manual_seed(0)
    small = create_model("volo_tiny", 32, 10, 0.0)
    save_final(tmp_path / "run", small.state_dict(), model_manifest("volo_tiny", 32, 10))
    big = create_model("volo_tiny", 64, 5, 0.0)
    reset = load_finetune(big, str(tmp_path / "run"), "volo_tiny")
    assert set(reset) == {"head.weight", "head.bias", "aux_head.weight", "aux_head.bias"}
    assert big.pos_embed.shape == (1, 4, 4, 64)
    assert torch.equal(big.patch_embed.conv[0].weight, small.patch_embed.conv[0].weight)
    with pytest.raises(ModelLoadError, match="checkpoint is a volo_tiny, not --model vit_tiny"):
        load_finetune(create_model("vit_tiny_patch16_224", 32, 10, 0.0), str(tmp_path / "run"),
                      "vit_tiny_patch16_224")  # fmt: skip
    (tmp_path / "run" / "final" / "model.json").unlink()  # no manifest: the keys decide
    with pytest.raises(ModelLoadError, match="weights are not a vit_tiny_patch16_224"):
        load_finetune(create_model("vit_tiny_patch16_224", 32, 10, 0.0), str(tmp_path / "run"),
                      "vit_tiny_patch16_224")  # fmt: skip


def test_vit_finetune_resamples_its_token_grid(tmp_path: Path) -> None:
    vit32 = create_model("vit_tiny_patch16_224", 32, 10, 0.0)
    torch.save(vit32.state_dict(), tmp_path / "vit.pt")
    vit64 = create_model("vit_tiny_patch16_224", 64, 10, 0.0)
    assert load_finetune(vit64, str(tmp_path / "vit.pt"), "vit_tiny_patch16_224") == []
    assert vit64.pos_embed.shape == (1, 1 + 16, 192)
    assert torch.equal(vit64.pos_embed[:, 0], vit32.pos_embed[:, 0])  # class token kept


def _adamw_two_steps(relayout) -> torch.Tensor:
    """Two fused AdamW steps on a channels_last weight; `relayout` edits its state each step."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(
        torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    )
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    grad = torch.randn(4, 3, 2, 2)
    for scale in (1.0, 2.0):
        weight.grad = (scale * grad).contiguous(memory_format=torch.channels_last)
        optimizer.step()
        relayout(optimizer)
    return weight.detach().clone()


def test_checkpointed_moments_keep_the_weights_layout_and_fused_adamw_stays_exact():
    from vitpod.trainer.checkpointing.host_stage import HostStager
    from vitpod.trainer.model.optim import match_state_layout

    weight = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    staged = HostStager().stage({"m": weight})["m"]
    assert staged.stride() == weight.stride() and torch.equal(staged, weight)

    def contiguous_moments(optimizer):  # what a stride-dropping checkpoint round trip did
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].contiguous()

    straight = _adamw_two_steps(lambda _: None)
    assert not torch.equal(_adamw_two_steps(contiguous_moments), straight)  # the bug, shown
    mended = _adamw_two_steps(lambda o: (contiguous_moments(o), match_state_layout(o)))
    assert torch.equal(mended, straight)


def test_a_finetune_source_changed_on_disk_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    small = create_model("volo_tiny", 32, 10, 0.0)
    model_file = save_final(
        tmp_path / "run", small.state_dict(), model_manifest("volo_tiny", 32, 10)
    )
    _flip(model_file)
    with pytest.raises(ModelLoadError, match="does not match the sha256"):
        load_finetune(create_model("volo_tiny", 64, 5, 0.0), str(tmp_path / "run"), "volo_tiny")


def test_a_failed_directory_fsync_is_raised(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    from vitpod.registry import io

    real_fsync = os.fsync

    def eio_on_directories(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", eio_on_directories)
    with pytest.raises(OSError, match="Input/output error"):
        io.fsync_dir(tmp_path)
    ck = Checkpointer(tmp_path / "ck", rank=0, world_size=1)
    ck.save(1, 0, state(1))
    with pytest.raises(RuntimeError, match="Input/output error"):
        ck.wait()
    assert ck.latest_valid() is None  # never reported as saved


@pytest.mark.parametrize("wrapper", ["state_dict", "state_dict_ema", "model", "bare"])
def test_finetune_reads_checkpoints_other_scripts_write(tmp_path: Path, wrapper: str) -> None:
    """timm's train.py `model_best.pth.tar` (weights under `state_dict`, DDP's `module.` prefix,
    its argparse Namespace beside them), its EMA copy, a DeiT-style `model`, a bare state dict."""
    import argparse

    torch.manual_seed(0)
    small = create_model("volo_tiny", 32, 10, 0.0)
    weights = {f"module.{k}": v for k, v in small.state_dict().items()}
    saved = weights if wrapper == "bare" else {
        "epoch": 3, "arch": "volo_tiny", wrapper: weights, "optimizer": {"state": {}},
        "args": argparse.Namespace(model="volo_tiny", lr=1e-3),
    }  # fmt: skip
    torch.save(saved, tmp_path / "model_best.pth.tar")
    big = create_model("volo_tiny", 64, 10, 0.0)
    assert load_finetune(big, str(tmp_path / "model_best.pth.tar"), "volo_tiny") == []
    assert torch.equal(big.patch_embed.conv[0].weight, small.patch_embed.conv[0].weight)


def test_a_checkpoint_without_weights_gets_its_own_message(tmp_path: Path) -> None:
    torch.save({"epoch": 3, "optimizer": {"state": {}}}, tmp_path / "opt_only.pth")
    with pytest.raises(ModelLoadError, match="none of the keys weights are kept under"):
        load_finetune(create_model("volo_tiny", 32, 10, 0.0), str(tmp_path / "opt_only.pth"),
                      "volo_tiny")  # fmt: skip
