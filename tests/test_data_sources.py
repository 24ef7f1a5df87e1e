"""Data sources and bad input: folder layout, CIFAR pickles, digits, synthetic, corrupt JPEGs."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.fixtures_data import data_config
from vitpod.trainer.data import (
    CorruptImageError,
    DataConfig,
    DataConfigError,
    DataSourceError,
    choose_loader,
    create_loader,
)
from vitpod.trainer.data.digits import write_digits_jpeg
from vitpod.trainer.data.sources import load_split


def _small_folder(digits_dir: Path, root: Path, per_class: int = 6) -> Path:
    """Three digit classes, a few images each, in the ImageNet layout."""
    for split in ("train", "val"):
        for cls in ("0", "1", "2"):
            dest = root / split / cls
            dest.mkdir(parents=True)
            for src in sorted((digits_dir / split / cls).glob("*.jpg"))[:per_class]:
                shutil.copy(src, dest / src.name)
    return root


INDEXED = {"batch_size": 4, "return_index": True}


def test_config_errors_name_the_field_and_the_fix():
    with pytest.raises(DataConfigError, match=r"DataConfig.loader='nvjpeg': choose one of dali"):
        DataConfig(loader="nvjpeg", data_dir="x")
    with pytest.raises(DataConfigError, match=r"DataConfig.scale=\(0.5, 0.2\)"):
        DataConfig(scale=(0.5, 0.2), data_dir="x")
    with pytest.raises(DataConfigError, match="data_dir is empty"):
        DataConfig(dataset="folder")
    with pytest.raises(
        DataConfigError,
        match=r"unknown key\(s\) 'batch' \(did you mean 'batch_size'\?\); valid keys: .*batch_size",
    ):
        DataConfig.from_dict({"batch": 3})
    with pytest.raises(DataConfigError, match="use --token-label-size 14"):
        DataConfig(data_dir="x", token_label=True, token_label_data="t", token_label_size=16)
    with pytest.raises(DataConfigError, match="--token-label needs --token-label-data"):
        DataConfig(data_dir="x", token_label=True)
    ok = DataConfig(data_dir="x", img_size=32, token_stride=8, token_label_size=4,
                    token_label=True, token_label_data="t")  # fmt: skip
    assert ok.token_label_size == 4


def test_missing_empty_and_mismatched_class_folders_are_named(digits_dir, tmp_path):
    root = _small_folder(digits_dir, tmp_path / "d")
    with pytest.raises(DataSourceError, match=r"nowhere/train is not a folder"):
        load_split(data_config(tmp_path / "nowhere", INDEXED), "train")
    (root / "val" / "3").mkdir()
    with pytest.raises(DataSourceError, match=r"only in train: \[\], only in val: \['3'\]"):
        load_split(data_config(root, INDEXED), "train")
    (root / "train" / "3").mkdir()
    with pytest.raises(DataSourceError, match=r"class folder .*train/3 has no images"):
        load_split(data_config(root, INDEXED), "train")
    shutil.rmtree(root / "train" / "3")
    shutil.rmtree(root / "val" / "3")
    with pytest.raises(DataSourceError, match="num_classes=10 but .* has 3 classes"):
        load_split(data_config(root, INDEXED, num_classes=10), "val")
    split = load_split(data_config(root, INDEXED), "val")
    assert split.classes == ["0", "1", "2"] and split.labels.tolist() == [0] * 6 + [1] * 6 + [2] * 6


def test_digits_are_written_once_completely_and_reused(digits_dir, tmp_path):
    train = sorted(digits_dir.glob("train/*/*.jpg"))
    assert len(train) == 1433 and len(list(digits_dir.glob("val/*/*.jpg"))) == 364
    with Image.open(train[0]) as img:
        assert img.mode == "RGB" and img.size == (32, 32)
    assert json.loads((digits_dir / ".complete").read_text()) == {"size": 32, "images": 1797}
    before = train[0].stat().st_mtime_ns
    assert write_digits_jpeg(digits_dir, size=32) == digits_dir
    assert train[0].stat().st_mtime_ns == before, "an existing complete set is not rewritten"
    half = tmp_path / "half"
    (half / "train").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="not a complete digits set"):
        write_digits_jpeg(half)
    assert not list(tmp_path.glob(".half.tmp-*"))


def test_concurrent_digits_writers_leave_one_complete_set(tmp_path):
    root = tmp_path / "shared" / "digits"
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(2) as pool:
        results = pool.starmap(write_digits_jpeg, [(root, 16), (root, 16)])
    assert results == [root, root]
    assert len(list(root.glob("*/*/*.jpg"))) == 1797
    assert [p.name for p in root.parent.iterdir()] == ["digits"], "temporary folders removed"


def _corrupt_folder(digits_dir: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    root = _small_folder(digits_dir, tmp_path / "c")
    truncated = root / "val" / "1" / "0005.jpg"
    truncated.write_bytes(truncated.read_bytes()[:200])
    garbage = root / "val" / "2" / "zzzz.jpg"
    garbage.write_text("not a jpeg")
    return root, sorted([str(truncated), str(garbage)])


@pytest.mark.parametrize("kind", ["torch", "dali"])
def test_corrupt_images_fail_naming_the_file_or_are_skipped_and_counted(digits_dir, tmp_path, kind):
    root, bad = _corrupt_folder(digits_dir, tmp_path)
    failing = create_loader(data_config(root, INDEXED, loader=kind, corrupt="fail"), "val", 0, 1)
    with pytest.raises(CorruptImageError, match=r"cannot decode .*(0005|zzzz)\.jpg"):
        list(failing)
    skipping = create_loader(data_config(root, INDEXED, loader=kind, corrupt="skip"), "val", 0, 1)
    batches = list(skipping)
    assert sorted(skipping.skipped) == bad
    seen = torch.cat([b[2] for b in batches]).tolist()
    files = skipping.split.files
    assert sorted(files[i] for i in seen) == sorted(set(files) - set(bad))
    for _, targets, indices in batches:
        assert targets.tolist() == [int(Path(files[i]).parent.name) for i in indices.tolist()]
    assert len(batches) == len(skipping), "skipping keeps the planned number of batches"


def _write_cifar(root: Path, dataset: str, per_batch: int = 10) -> Path:
    rng = np.random.default_rng(0)
    if dataset == "cifar10":
        folder = root / "cifar-10-batches-py"
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        meta = ("batches.meta", b"label_names", b"labels", 10)
    else:
        folder, names = root / "cifar-100-python", ["train", "test"]
        meta = ("meta", b"fine_label_names", b"fine_labels", 100)
    meta_file, names_key, label_key, classes = meta
    folder.mkdir(parents=True)
    for name in names:
        labels = rng.integers(0, classes, per_batch).tolist()
        data = np.repeat(np.asarray(labels, dtype=np.uint8)[:, None] * 2, 3072, axis=1)
        with (folder / name).open("wb") as f:
            pickle.dump({b"data": data, label_key: labels, b"batch_label": name.encode()}, f)
    with (folder / meta_file).open("wb") as f:
        pickle.dump({names_key: [f"class{i}".encode() for i in range(classes)]}, f)
    return root


@pytest.mark.parametrize("dataset,classes,train_size", [("cifar10", 10, 50), ("cifar100", 100, 10)])
def test_cifar_pickles_load_with_their_labels(tmp_path, dataset, classes, train_size):
    root = _write_cifar(tmp_path, dataset)
    cfg = data_config(root, INDEXED, dataset=dataset, crop_pct=1.0)
    train = create_loader(cfg, "train", 0, 1)
    assert train.num_classes == classes and len(train.split) == train_size
    val = create_loader(cfg, "val", 0, 1)
    for images, targets, indices in val:
        pixel = images[:, 0, 0, 0] * 0.229 + 0.485  # undo normalization: the pixel is 2*label
        assert torch.allclose(pixel * 255, targets.float() * 2, atol=1.0)
        assert targets.tolist() == val.split.labels[indices.numpy()].tolist()
    assert (
        choose_loader(DataConfig(**{**_asdict(cfg), "loader": "auto"}), val.split, False) == "torch"
    )
    with pytest.raises(DataConfigError, match="loader='dali' cannot be used: dataset 'cifar"):
        create_loader(DataConfig(**{**_asdict(cfg), "loader": "dali"}), "val", 0, 1)


def test_synthetic_source_needs_no_files_and_is_sharded_exactly():
    cfg = DataConfig(dataset="synthetic", img_size=16, batch_size=8, synthetic_size=50,
                     num_classes=7, return_index=True)  # fmt: skip
    loaders = [create_loader(cfg, "train", r, 2) for r in range(2)]
    seen = [i for loader in loaders for b in loader for i in b[2].tolist()]
    assert sorted(seen) == list(range(50))
    images, targets, indices = next(iter(loaders[0]))
    assert images.shape == (8, 3, 16, 16) and (targets == indices % 7).all()


def test_auto_takes_dali_for_jpeg_folders_and_explains_otherwise(digits_dir):
    split = load_split(data_config(digits_dir, INDEXED), "train")
    assert choose_loader(data_config(digits_dir, INDEXED, loader="auto"), split, True) == "dali"
    policy = data_config(digits_dir, INDEXED, loader="auto", auto_augment="original")
    assert choose_loader(policy, split, True) == "torch"
    with pytest.raises(DataConfigError, match="implements RandAugment .* only"):
        choose_loader(
            data_config(digits_dir, INDEXED, loader="dali", auto_augment="original"), split, True
        )


def _asdict(cfg: DataConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def test_auto_takes_torch_for_randaugment_without_a_gpu_and_workers_fork_when_safe(
    digits_dir, monkeypatch
):
    import threading

    from vitpod.trainer.data.torch_loader import worker_context

    split = load_split(data_config(digits_dir, INDEXED), "train")
    recipe = data_config(digits_dir, INDEXED, loader="auto", auto_augment="rand-m9-mstd0.5-inc1")
    expected = "dali" if torch.cuda.is_available() else "torch"
    assert choose_loader(recipe, split, True) == expected
    assert (
        choose_loader(recipe, load_split(data_config(digits_dir, INDEXED), "val"), False)
        == expected
    )
    monkeypatch.setitem(sys.modules, "nvidia.dali", object())  # DALI loaded: its threads may run
    assert worker_context() == "forkserver"
    monkeypatch.delitem(sys.modules, "nvidia.dali")
    assert worker_context() == "fork"
    release = threading.Event()
    writer = threading.Thread(target=release.wait)  # non-daemon, like a checkpoint writer
    writer.start()
    try:
        assert worker_context() == "forkserver"
    finally:
        release.set()
        writer.join()
