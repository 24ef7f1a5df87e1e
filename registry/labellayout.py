"""TokenLabeling's published label layout on disk, read without torch (login-node checks).

One torch file per training image, `<root>/<class dir>/<image stem>.pt`, as zihangJiang/
TokenLabeling's generate_label.py writes it; `tensor_file_shape` reads a file's shape from its
pickle header without running any of it (vitpod.registry.safepickle: nothing but a tensor's
rebuild, its storage types and OrderedDict resolve, each to a stand-in here). vitpod's own
store is vitpod.registry.labelset.
"""

from __future__ import annotations

import collections
import io as io_module
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

from vitpod.registry import safepickle
from vitpod.registry.labelset import (
    FORMAT,
    IMAGE_SUFFIXES,
    OWNER,
    PUBLISHED,
    SHARDS,
    read_manifest,
)

PUBLISHED_MAX_CLASSES = 2048
"""Class indices are stored in float16, exact only up to 2048."""


def label_file(root: str | os.PathLike[str], image_name: str) -> Path:
    """The published label file of image `<split>/<class>/<file>` (or `<class>/<file>`): the
    image's class folder and its name up to the first dot, as generate_label.py names it."""
    parts = Path(image_name).parts
    return Path(root) / parts[-2] / (parts[-1].split(".")[0] + ".pt")


def layout_of(path: str | os.PathLike[str]) -> str | None:
    """FORMAT (vitpod's store: a manifest, shards or a teacher claim), PUBLISHED (class folders
    holding .pt files and no vitpod bookkeeping, or a manifest saying so) or None."""
    root = Path(path)
    if not root.is_dir():
        return None
    manifest = read_manifest(root)
    if manifest is not None:
        return PUBLISHED if manifest.get("layout") == PUBLISHED else FORMAT
    if (root / SHARDS).is_dir() or (root / OWNER).is_file():
        return FORMAT  # vitpod's labeling job, not finished
    return PUBLISHED if _class_dirs_with_labels(root, limit=1) else None


def _class_dirs_with_labels(root: Path, limit: int | None = None) -> list[str]:
    """Class folders of `root` that hold at least one .pt file (stops after `limit`)."""
    found: list[str] = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.is_dir() or entry.name.startswith(".") or entry.name == SHARDS:
            continue
        with os.scandir(entry.path) as files:
            if any(f.name.endswith(".pt") for f in files):
                found.append(entry.name)
        if limit is not None and len(found) >= limit:
            break
    return found


class _Storage:
    def __init__(self, dtype: str):
        self.dtype = dtype


class _TensorHeader:
    def __init__(self, size: tuple[int, ...], dtype: str):
        self.size, self.dtype = size, dtype


def _rebuild_tensor(storage: Any, _offset: int, size: Any, *_rest: Any) -> _TensorHeader:
    return _TensorHeader(tuple(int(s) for s in size), getattr(storage, "dtype", "?"))


def _header_names(module: str, name: str) -> Any:
    """torch's tensor rebuild, its storage types and OrderedDict, each to a stand-in."""
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_tensor
    if module == "torch" and name.endswith("Storage"):
        return name.removesuffix("Storage") or "untyped"
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    return None


class _HeaderUnpickler(safepickle.RestrictedUnpickler):
    """Reads a torch.save'd tensor's shape without torch and without running any code."""

    def __init__(self, fh: Any, path: str) -> None:
        super().__init__(fh, _header_names, path, "a plain tensor file")

    def persistent_load(self, pid: Any) -> _Storage:
        # ('storage', storage type, key, location, numel[, view metadata])
        kind = pid[1] if isinstance(pid, tuple) and len(pid) > 1 else "?"
        return _Storage(kind if isinstance(kind, str) else "?")


def tensor_file_shape(path: str | os.PathLike[str]) -> tuple[tuple[int, ...], str]:
    """(shape, storage dtype name) of a file written by torch.save(tensor), zip or legacy
    format, read without torch; ValueError naming the file when it holds no plain tensor."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
                if pkl is None:
                    raise ValueError("no data.pkl in the archive")
                obj = _HeaderUnpickler(io_module.BytesIO(archive.read(pkl)), str(path)).load()
        else:  # torch < 1.6: magic number, protocol, sys info, then the tensor: all restricted
            with open(path, "rb") as fh:
                for _ in range(3):
                    _HeaderUnpickler(fh, str(path)).load()
                obj = _HeaderUnpickler(fh, str(path)).load()
    except safepickle.UnsafePickle as exc:
        raise ValueError(str(exc)) from None
    except (OSError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a torch tensor file ({exc})") from None
    if not isinstance(obj, _TensorHeader):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not one tensor")
    return obj.size, obj.dtype


def published_shape_problem(where: str, shape: tuple[int, ...]) -> str | None:
    if len(shape) == 4 and shape[0] == 2 and min(shape) >= 1:
        return None
    return (
        f"{where}: shape {list(shape)}, not [2, k, H, W] (top-k scores, then top-k class indices "
        "per location, as TokenLabeling's generate_label.py writes them); regenerate it"
    )


def published_problems(
    path: str | os.PathLike[str], *, where: str, data_dir: str | None, sample: int = 8
) -> list[str]:
    """A light check of published-layout labels ([] = fine): the class folders of the data
    set's train split are there, and the label files of a sample of images (one per class,
    spread over the classes) exist with shape [2, k, H, W]. The trainer checks every image's
    file when it opens the directory."""
    root = Path(path)
    if data_dir and Path(data_dir, "train").is_dir():
        base = Path(data_dir, "train")
        classes = sorted(
            p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        missing = [c for c in classes if not (root / c).is_dir()]
        if missing:
            return [
                f"{where}: no class folder for {len(missing)} of the {len(classes)} classes of "
                f"{base} (first: {missing[:3]}); published token labels are "
                "<dir>/<class>/<image stem>.pt: label this data set (make token-labels ... "
                'ARGS="--layout published") or point --token-label-data at its labels'
            ]
        step = max(1, len(classes) // sample)
        images = []
        for name in classes[::step][:sample]:
            first = next(
                (f for f in sorted(os.listdir(base / name)) if f.lower().endswith(IMAGE_SUFFIXES)),
                None,
            )
            if first is not None:
                images.append(f"{name}/{first}")
        files = [label_file(root, image) for image in images]
    else:
        files = [
            next(p for p in sorted((root / c).iterdir()) if p.suffix == ".pt")
            for c in _class_dirs_with_labels(root, limit=sample)
        ]
        if not files:
            return [f"{where}: no class folders holding .pt label files"]
    out = []
    for file in files:
        if not file.is_file():
            out.append(
                f"{where}: {file} is missing (its image has no label); label this data set "
                'again (make token-labels ... ARGS="--layout published")'
            )
            continue
        try:
            shape, _ = tensor_file_shape(file)
        except ValueError as exc:
            out.append(f"{where}: {exc}; regenerate it")
            continue
        problem = published_shape_problem(f"{where}: {file}", shape)
        if problem:
            out.append(problem)
    return out


def describe(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """Which label data a stage reads, for plan.json: layout, grid (H, W) and k, taken from
    vitpod's manifest or from one published label file (None: no such directory)."""
    if not path:
        return None
    layout = layout_of(path)
    if layout == FORMAT:
        manifest = read_manifest(path) or {}
        grid = manifest.get("grid")
        return {"layout": FORMAT, "grid": [grid, grid] if grid else None,
                "k": manifest.get("topk")}  # fmt: skip
    if layout != PUBLISHED:
        return None
    manifest = read_manifest(path) or {}
    for name in _class_dirs_with_labels(Path(path), limit=1):
        file = next(p for p in sorted((Path(path) / name).iterdir()) if p.suffix == ".pt")
        try:
            shape, _ = tensor_file_shape(file)
        except ValueError:
            return {"layout": PUBLISHED, "grid": None, "k": None}
        if len(shape) == 4:
            return {"layout": PUBLISHED, "grid": [shape[2], shape[3]], "k": shape[1],
                    "teacher": (manifest.get("teacher") or {}).get("model")}  # fmt: skip
    return {"layout": PUBLISHED, "grid": None, "k": None}
