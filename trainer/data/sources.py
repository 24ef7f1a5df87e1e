"""Data sources: ImageNet-layout folders, CIFAR pickles, digits JPEGs, synthetic tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitpod.registry import safepickle
from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.digits import DIGITS_CLASSES, write_digits_jpeg
from vitpod.trainer.data.shard_reader import INDEX, ShardReader

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
SPLITS = ("train", "val")
SPLIT_FOLDERS = {"train": ("train", "training"),
                 "val": ("val", "valid", "validation", "eval", "evaluation")}  # fmt: skip
"""The folder names of each split, in the order timm's dataset factory looks for them."""
SYNTHETIC_CLASSES = 1000  # ImageNet-sized head: the synthetic source stands in for ImageNet
CIFAR_LAYOUT = {
    "cifar10": ("cifar-10-batches-py", ["data_batch_1", "data_batch_2", "data_batch_3",
                "data_batch_4", "data_batch_5"], ["test_batch"], "batches.meta",
                b"labels", b"label_names"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "meta", b"fine_labels",
                 b"fine_label_names"),
}  # fmt: skip


class DataSourceError(ValueError):
    """The data on disk does not have the expected layout; the message names the path."""


@dataclass(frozen=True)
class Split:
    """One split: labels plus either file paths, uint8 arrays, or nothing (synthetic)."""

    name: str
    classes: list[str]
    labels: np.ndarray
    files: list[str] | None = None
    arrays: np.ndarray | None = None
    root: Path | None = None
    shards: Any = None  # a shards.ShardReader: encoded images packed in tar files

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def kind(self) -> str:
        if self.shards is not None:
            return "shards"
        return (
            "files"
            if self.files is not None
            else "arrays"
            if self.arrays is not None
            else "synthetic"
        )

    def relpath(self, index: int) -> str:
        """The sample's path relative to the data root (the key of token-label data)."""
        assert self.files is not None and self.root is not None
        return Path(self.files[index]).relative_to(self.root).as_posix()


def load_split(cfg: DataConfig, split: str) -> Split:
    """Find the samples of `split` ('train' or 'val') for cfg.dataset, checking the layout."""
    if split not in SPLITS:
        raise DataSourceError(f"split={split!r}: choose one of {', '.join(SPLITS)}")
    if cfg.dataset == "synthetic":
        result = _synthetic_split(cfg, split)
    elif cfg.dataset == "shards":
        result = shard_split(Path(cfg.data_dir), split)
    elif cfg.dataset in CIFAR_LAYOUT:
        result = _cifar_split(Path(cfg.data_dir), cfg.dataset, split)
    else:
        root = Path(cfg.data_dir) if cfg.data_dir else Path("data") / "digits"
        if cfg.dataset == "digits":
            root = write_digits_jpeg(root, size=32)
        result = folder_split(root, split)
    _check_num_classes(cfg, result)
    return result


def count_classes(cfg: DataConfig) -> int:
    """The class count of cfg's data without listing its images (the model is built first).

    cfg.num_classes given is returned for 'synthetic' (it makes that many classes) and is
    otherwise left for load_split to check against the data, so a wrong one still fails there.
    """
    if cfg.dataset == "synthetic":
        return cfg.num_classes or SYNTHETIC_CLASSES
    if cfg.dataset == "digits":
        return DIGITS_CLASSES  # the digits are written by load_split; counting needs no files
    if cfg.dataset in CIFAR_LAYOUT:
        folder_name, _, _, meta_file, _, names_key = CIFAR_LAYOUT[cfg.dataset]
        data_dir = Path(cfg.data_dir)
        folder = data_dir / folder_name if (data_dir / folder_name).is_dir() else data_dir
        return len(_unpickle(folder / meta_file)[names_key])
    return len(_class_names(split_folder(Path(cfg.data_dir), "train")))


def split_folder(root: Path, split: str) -> Path:
    """root's folder of `split`: the first of its names (SPLIT_FOLDERS) that exists, as timm
    finds DATA/validation for its val split; root/split when none does (named as missing)."""
    return next((root / n for n in SPLIT_FOLDERS[split] if (root / n).is_dir()), root / split)


def folder_split(root: Path, split: str) -> Split:
    """`root/split/<class>/*.jpg`, classes sorted by name; train and val must have the same."""
    here = split_folder(root, split)
    there = split_folder(root, "val" if split == "train" else "train")
    classes, other = _class_names(here), there.name
    if there.is_dir():
        other_classes = _class_names(there)
        if other_classes != classes:
            only_here = sorted(set(classes) - set(other_classes))
            only_there = sorted(set(other_classes) - set(classes))
            raise DataSourceError(
                f"class folders differ between {here} and {there}: "
                f"only in {split}: {only_here}, only in {other}: {only_there}; "
                "both splits need the same class folders"
            )
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = here / name
        images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise DataSourceError(
                f"class folder {folder} has no images ({', '.join(IMAGE_SUFFIXES)}): "
                "remove it or add its images"
            )
        files.extend(str(p) for p in images)
        labels.extend([label] * len(images))
    return Split(split, classes, np.asarray(labels, dtype=np.int64), files=files, root=root)


def shard_split(root: Path, split: str) -> Split:
    """`root/split/` written by `make shards` (index.json, samples.npy, shard-*.tar)."""
    if not (root / split / INDEX).is_file():
        raise DataSourceError(
            f"{root / split / INDEX} is missing: write shards with `make shards DATA=... OUT=...`"
        )
    reader = ShardReader(root / split)
    return Split(split, reader.index["classes"], reader.labels, root=root, shards=reader)


def _class_names(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise DataSourceError(
            f"{folder} is not a folder: expected ImageNet layout <root>/train|val/<class>/ "
            f"(as in timm, training for train; valid, validation, eval or evaluation for val)"
        )
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataSourceError(f"{folder} has no class folders: expected {folder}/<class>/*.jpg")
    return classes


def _cifar_split(data_dir: Path, dataset: str, split: str) -> Split:
    folder_name, train_files, val_files, meta_file, label_key, names_key = CIFAR_LAYOUT[dataset]
    folder = data_dir / folder_name if (data_dir / folder_name).is_dir() else data_dir
    meta = _unpickle(folder / meta_file)
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[names_key]]
    arrays: list[np.ndarray] = []
    labels: list[int] = []
    for name in train_files if split == "train" else val_files:
        batch = _unpickle(folder / name)
        if b"data" not in batch or label_key not in batch:
            raise DataSourceError(f"{folder / name} lacks b'data' or {label_key!r}: not {dataset}")
        arrays.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(int(x) for x in batch[label_key])
    images = np.concatenate(arrays).transpose(0, 2, 3, 1)  # NCHW planes -> NHWC
    label_array = np.asarray(labels, dtype=np.int64)
    if (
        len(label_array) != len(images)
        or label_array.min() < 0
        or label_array.max() >= len(classes)
    ):
        raise DataSourceError(
            f"{folder}: labels do not match the images or the {len(classes)} classes"
        )
    return Split(split, classes, label_array, arrays=images, root=folder)


_CIFAR_NUMPY = {
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}  # fmt: skip


def _cifar_names(module: str, name: str) -> Any:
    """What a CIFAR batch holds besides dicts, lists and bytes: numpy arrays (numpy 1 and 2
    module names, old and new protocols) and bytes written by Python 3 at protocol 2."""
    if (module, name) == ("_codecs", "encode"):
        import codecs

        return codecs.encode
    if (module, name) not in _CIFAR_NUMPY:
        return None
    import importlib

    try:  # numpy 2 moved numpy.core to numpy._core (the old name warns)
        found = importlib.import_module(module.replace("numpy.core", "numpy._core"))
    except ImportError:
        found = importlib.import_module(module)
    return getattr(found, name)


def _unpickle(path: Path) -> dict:
    if not path.is_file():
        raise DataSourceError(f"{path} is missing: expected the CIFAR python-pickle layout")
    try:
        data = safepickle.load(path, _cifar_names, "a CIFAR batch", encoding="bytes")
    except safepickle.UnsafePickle as err:
        raise DataSourceError(str(err)) from None
    if not isinstance(data, dict):
        raise DataSourceError(f"{path} holds a {type(data).__name__}, not a CIFAR batch's dict")
    return data


def _synthetic_split(cfg: DataConfig, split: str) -> Split:
    num_classes = cfg.num_classes or SYNTHETIC_CLASSES
    size = cfg.synthetic_size if split == "train" else max(1, cfg.synthetic_size // 10)
    labels = np.arange(size, dtype=np.int64) % num_classes
    return Split(split, [str(c) for c in range(num_classes)], labels)


def _check_num_classes(cfg: DataConfig, split: Split) -> None:
    if cfg.num_classes is not None and cfg.num_classes != len(split.classes):
        raise DataSourceError(
            f"DataConfig.num_classes={cfg.num_classes} but {cfg.data_dir or cfg.dataset} has "
            f"{len(split.classes)} classes: drop --num-classes or set it to {len(split.classes)}"
        )
