"""Token-label directories: real teacher inference per shard, the manifest, and the login-node
checks (data set names and count, grid) that refuse wrong labels before anything queues."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vitpod.registry import labelset
from vitpod.trainer.checkpointing.checkpoint import save_final
from vitpod.trainer.data import DataConfig, create_loader
from vitpod.trainer.data.sources import folder_split
from vitpod.trainer.data.token_label import TokenLabelError
from vitpod.trainer.model.models import create_model, model_manifest
from vitpod.trainer.tokenlabels import label
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.planning.preflight import token_label_problems


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vitpod run directory with a final volo_tiny model (untrained weights: the format and
    the inference are real, the scores need not be good for these checks)."""
    run = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    model = create_model("volo_tiny", 32, 10, 0.0)
    save_final(run, model.state_dict(), model_manifest("volo_tiny", 32, 10))
    return run


@pytest.fixture(scope="module")
def labels(digits_dir: Path, teacher_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Labels over digits at 32 px (grid 2) in 3 shards, made the way each rank makes them."""
    out = tmp_path_factory.mktemp("labels") / "tl"
    for shard in range(3):
        argv = [
            str(digits_dir), "--teacher", str(teacher_run), "--label-dir", str(out),
            "--img-size", "32", "--topk", "3", "--shard", str(shard), "--num-shards", "3",
        ]  # fmt: skip
        assert label.main(argv) == 0
    return out


def test_folder_names_are_the_trainers_keys_in_the_trainers_order(digits_dir: Path):
    split = folder_split(digits_dir, "train")
    assert labelset.folder_names(digits_dir) == [split.relpath(i) for i in range(len(split))]


def test_shards_cover_every_sample_once():
    bounds = [labelset.shard_bounds(10, i, 4) for i in range(4)]
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]
    with pytest.raises(ValueError, match=r"shard 4 of 4"):
        labelset.shard_bounds(10, 4, 4)


def test_manifest_records_teacher_grid_and_data_set(labels: Path, digits_dir: Path, teacher_run):
    manifest = labelset.read_manifest(labels)
    assert manifest is not None
    names = labelset.folder_names(digits_dir)
    assert manifest["samples"] == len(names) == 1433
    assert manifest["names_sha256"] == labelset.names_digest(names)
    assert (manifest["grid"], manifest["img_size"], manifest["topk"]) == (2, 32, 3)
    assert manifest["teacher"]["model"] == "volo_tiny"
    assert Path(manifest["teacher"]["weights"]) == teacher_run / "final" / "model.pt"
    assert [t["images"] for t in manifest["throughput"]] == [477, 478, 478]
    assert all(t["images_per_s"] > 0 for t in manifest["throughput"])
    assert not list(labels.rglob(".*")), "no temporary files left behind"


def test_a_label_set_keeps_its_record_as_labels_json_and_an_older_set_still_reads(
    labels: Path, digits_dir: Path, tmp_path: Path
):
    """labels.json, not the run's manifest.json; a set made by the previous release (its record
    as manifest.json) still serves a stage, and the trainer still opens it."""
    assert (labels / "labels.json").is_file() and not (labels / "manifest.json").exists()
    old = tmp_path / "old"
    shutil.copytree(labels, old)
    (old / "labels.json").rename(old / "manifest.json")
    assert labelset.read_manifest(old) == labelset.read_manifest(labels)
    names = labelset.folder_names(digits_dir)
    assert labelset.problems(labelset.read_manifest(old), where=str(old), names=names,
                             data_dir=str(digits_dir), img_size=32) == []  # fmt: skip
    cfg = DataConfig(data_dir=str(digits_dir), img_size=32, batch_size=8, workers=0,
                     loader="torch", auto_augment=None, reprob=0.0, token_label=True,
                     token_label_data=str(old), token_label_size=2, hflip=0.0)  # fmt: skip
    store = create_loader(cfg, "train", 0, 1)._token_labels
    assert "train/7/0003.jpg" in store.data["index"]
    (old / "manifest.json").write_text(json.dumps({"format": labelset.FORMAT, "grid": "two"}))
    with pytest.raises(ValueError, match=rf"{old / 'manifest.json'}: grid: "):
        labelset.read_manifest(old)


def test_a_finished_shard_is_skipped_and_a_changed_one_redone(
    labels, digits_dir, teacher_run, capsys
):
    shard = labelset.shard_path(labels, 1, 3)
    before = shard.stat().st_mtime_ns
    argv = [str(digits_dir), "--teacher", str(teacher_run), "--label-dir", str(labels),
            "--img-size", "32", "--topk", "3", "--shard", "1", "--num-shards", "3"]  # fmt: skip
    assert label.main(argv) == 0
    assert "already done" in capsys.readouterr().out
    assert shard.stat().st_mtime_ns == before


def test_the_trainer_reads_the_shards_with_the_teachers_scores(labels, digits_dir, teacher_run):
    cfg = DataConfig(data_dir=str(digits_dir), img_size=32, batch_size=8, workers=0,
                     loader="torch", auto_augment=None, reprob=0.0, token_label=True,
                     token_label_data=str(labels), token_label_size=2, hflip=0.0,
                     scale=(1.0, 1.0), ratio=(1.0, 1.0))  # fmt: skip
    loader = create_loader(cfg, "train", 0, 1)
    store = loader._token_labels
    name = "train/7/0003.jpg"
    row = store.data["index"][name]
    dense = store.dense(row)
    teacher = create_model("volo_tiny", 32, 10, 0.0)
    teacher.load_state_dict(torch.load(teacher_run / "final" / "model.pt", weights_only=True))
    from PIL import Image

    from vitpod.trainer.data.transforms import eval_transform
    from vitpod.trainer.tokenlabels.token_forward import dense_logits

    with Image.open(digits_dir / name) as img:
        cfg32 = DataConfig(data_dir=str(digits_dir), img_size=32, crop_pct=1.0)
        image = eval_transform(cfg32)(img.convert("RGB"))
    with torch.no_grad():
        probs = dense_logits(teacher.eval(), image[None]).softmax(1)[0]
    top = probs.topk(3, dim=0)
    assert torch.equal(dense.topk(3, dim=0).indices, top.indices)
    assert torch.allclose(dense.topk(3, dim=0).values, top.values, atol=2e-3)  # float16


def test_wrong_grid_and_other_data_set_are_refused(labels: Path, digits_dir: Path, tmp_path):
    manifest = labelset.read_manifest(labels)
    names = labelset.folder_names(digits_dir)
    ok = labelset.problems(manifest, where="L", names=names, data_dir="d", img_size=32)
    assert ok == []
    (grid,) = labelset.problems(manifest, where="L", names=names, data_dir="d", img_size=64)
    assert "grid 2 (labeled at 32 px)" in grid and "grid 4" in grid
    (count,) = labelset.problems(manifest, where="L", names=names[:-1], data_dir="d", img_size=32)
    assert "1433 samples" in count and "has 1432" in count
    renamed = [*names[:-1], "train/9/other.jpg"]
    (other,) = labelset.problems(manifest, where="L", names=renamed, data_dir="d", img_size=32)
    assert "names checksum differs" in other
    assert (
        "no labels.json"
        in labelset.problems(None, where="L", names=names, data_dir="d", img_size=32)[0]
    )
    # The trainer makes the same check when it opens the directory.
    cfg = DataConfig(data_dir=str(digits_dir), img_size=64, batch_size=8, workers=0,
                     loader="torch", token_label=True, token_label_data=str(labels),
                     token_label_size=4)  # fmt: skip
    with pytest.raises(TokenLabelError, match="grid 2"):
        create_loader(cfg, "train", 0, 1)


def test_preflight_refuses_wrong_labels_with_the_command_that_makes_them(labels, tmp_path):
    def plan(extra: str):
        return plan_job(Request(cluster="local", model="volo_tiny", args=extra,
                                run_dir=tmp_path / "run"))  # fmt: skip

    good = plan(f"--token-label --token-label-size 2 --token-label-data {labels}")
    assert good.trainer and good.trainer["data_dir"]
    data = Path(good.trainer["data_dir"])
    if not (data / "train").is_dir():  # the local profile's digits (the trainer writes them)
        from vitpod.trainer.data.digits import write_digits_jpeg

        write_digits_jpeg(data, size=32)
    assert token_label_problems(good) == []
    (wrong,) = token_label_problems(
        plan(f"--img-size 64 --token-label --token-label-size 4 --token-label-data {labels}")
    )
    assert "grid 2" in wrong and "grid 4" in wrong
    assert "make token-labels CLUSTER=local MODEL=volo_tiny STAGE=pretrain" in wrong
    assert 'ARGS="--label-dir <new dir>"' in wrong, "existing labels are never overwritten"
    (missing,) = token_label_problems(
        plan(f"--token-label --token-label-size 2 --token-label-data {tmp_path / 'no'}")
    )
    assert "does not exist" in missing and "make token-labels" in missing
    partial = tmp_path / "partial"
    shutil.copytree(labels, partial)
    (partial / labelset.RECORD).unlink()
    (unfinished,) = token_label_problems(
        plan(f"--token-label --token-label-size 2 --token-label-data {partial}")
    )
    assert "has no labels.json" in unfinished
    with pytest.raises(ConfigError, match="grid 2"):
        from vitpod.workflows.planning import preflight

        preflight.check(
            plan(f"--img-size 64 --token-label --token-label-size 4 --token-label-data {labels}")
        )
    json.dumps(good.manifest())  # the plan still records cleanly


def test_pipeline_labels_what_is_missing_and_reuses_what_checks_out(labels, teacher_run, tmp_path):
    from vitpod.trainer.data.digits import write_digits_jpeg
    from vitpod.workflows.pipeline.chain import Chain
    from vitpod.workflows.site.profile import load_profile, resolve_path

    write_digits_jpeg(resolve_path(load_profile("local").storage.data) / "digits", size=32)
    new = tmp_path / "grid4"
    stages = {
        "pretrain_args": f"--token-label --token-label-size 2 --token-label-data {labels}",
        "finetune_args": f"--token-label --token-label-size 4 --token-label-data {new}",
        "run_root": str(tmp_path / "runs"),
    }
    run = Chain("local", "volo_tiny", teacher=str(teacher_run), **stages)
    run.plan()
    assert list(run.label_jobs) == ["finetune"], "the pretrain's labels pass the checks: reused"
    job = run.label_jobs["finetune"]
    assert (job.img_size, job.label_dir) == (64, new)
    assert job.plan.spec.command[1:3] == ("-m", "vitpod.trainer.tokenlabels.label")
    with pytest.raises(ConfigError, match=r"does not exist; make it with `make token-labels") as e:
        Chain("local", "volo_tiny", **stages).plan()
    # the other way to get labels: TokenLabeling's published maps, as downloaded
    assert "zihangJiang/TokenLabeling" in str(e.value) and '--token-label-data DIR"' in str(e.value)
    shared = {**stages, "finetune_args": stages["finetune_args"].replace(str(new), str(labels))}
    with pytest.raises(ConfigError, match="grid 2 .* grid 4"):  # existing labels never replaced
        Chain("local", "volo_tiny", teacher=str(teacher_run), **shared).plan()


def test_an_empty_shard_is_written_and_a_bad_teacher_is_a_usage_error(
    digits_dir, teacher_run, tmp_path
):
    out = tmp_path / "tl"
    argv = [str(digits_dir), "--teacher", str(teacher_run), "--label-dir", str(out),
            "--img-size", "32", "--shard", "0", "--num-shards", "2000"]  # fmt: skip
    assert label.main(argv) == 0  # 1433 images over 2000 shards: shard 0 has none
    sidecar = json.loads(labelset.shard_path(out, 0, 2000).with_suffix(".json").read_text())
    assert sidecar["images"] == 0
    part = torch.load(labelset.shard_path(out, 0, 2000), weights_only=True)
    assert part["values"].shape == (0, 5, 2, 2)
    assert label.main([*argv[:2], str(tmp_path / "no-such-run"), *argv[3:]]) == 2


def test_labels_belong_to_their_teacher(labels, digits_dir, teacher_run, tmp_path):
    from vitpod.workflows.pipeline import labels as wlabels
    from vitpod.workflows.pipeline.chain import Chain

    weights = teacher_run / "final" / "model.pt"
    made = labelset.weights_digest(weights)
    assert labelset.read_manifest(labels)["teacher"]["weights_sha256"] == made
    other = tmp_path / "other-teacher"
    torch.manual_seed(1)
    model = create_model("volo_tiny", 32, 10, 0.0)
    save_final(other, model.state_dict(), model_manifest("volo_tiny", 32, 10))
    theirs = labelset.weights_digest(other / "final" / "model.pt")
    assert theirs != made
    args = f"--token-label --token-label-data {labels}"  # no --token-label-size: img_size/16
    stages = {"pretrain_args": args, "run_root": str(tmp_path / "runs")}
    Chain("local", "volo_tiny", teacher=str(teacher_run), **stages).plan()  # same teacher: reused
    with pytest.raises(ConfigError, match=rf"teacher sha256 {made[:12]} .* sha256 {theirs[:12]}"):
        Chain("local", "volo_tiny", teacher=str(other), **stages).plan()
    job = wlabels.prepare("local", "volo_tiny", teacher=str(other), run_dir=tmp_path / "lab")
    assert job.label_dir.name == f"volo_tiny-pretrain-t{theirs[:12]}"
    assert job.teacher_sha256 == theirs and "--teacher-sha256" in job.plan.spec.command
    mine = wlabels.prepare(
        "local", "volo_tiny", teacher=str(teacher_run), run_dir=tmp_path / "lab2",
        args=f"--label-dir {labels} --img-size 32",
    )  # fmt: skip
    assert wlabels.existing_problems(mine) == []
    theirs_job = wlabels.prepare(
        "local", "volo_tiny", teacher=str(other), run_dir=tmp_path / "lab3",
        args=f"--label-dir {labels} --img-size 32",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="not by the requested teacher"):
        wlabels.submit(theirs_job)
