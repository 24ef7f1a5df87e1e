"""scikit-learn's digits written once as an ImageNet-layout JPEG folder (the demo data set)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from vitpod.registry.io import fsync_dir

MARKER = ".complete"
DIGITS_CLASSES = 10  # sklearn's digits are the ten classes 0-9
VAL_EVERY = 5  # every 5th image of a class goes to val: a deterministic ~80/20 split


def write_digits_jpeg(root: str | os.PathLike[str], size: int = 32) -> Path:
    """Write sklearn digits as `root/{train,val}/<class>/NNNN.jpg` (RGB, size x size); idempotent.

    The folder is built under a temporary name beside `root` and renamed into place with a
    marker file, so a reader never sees a half-written data set, and concurrent writers
    (several ranks) end with one complete copy.
    """
    root = Path(root)
    if _is_complete(root, size):
        return root
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(
            f"{root} exists but is not a complete digits set of size {size} "
            f"(no matching {MARKER}): remove it or choose another folder"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the data set is shared
    try:
        count = _write_images(tmp, size)
        (tmp / MARKER).write_text(json.dumps({"size": size, "images": count}))
        _publish(tmp, root)
        fsync_dir(root.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(root, size):
        raise FileExistsError(f"{root} was written concurrently with another size than {size}")
    return root


def _write_images(dest: Path, size: int) -> int:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    seen = {c: 0 for c in range(DIGITS_CLASSES)}
    for image, label in zip(pixels, digits.target, strict=True):
        label = int(label)
        split = "val" if seen[label] % VAL_EVERY == 0 else "train"
        folder = dest / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        big = Image.fromarray(image, mode="L").resize((size, size), Image.Resampling.BICUBIC)
        big.convert("RGB").save(folder / f"{seen[label]:04d}.jpg", quality=95)
        seen[label] += 1
    return sum(seen.values())


def _publish(tmp: Path, root: Path) -> None:
    try:
        if root.exists():
            root.rmdir()  # only an empty folder; a full one means another writer won
        os.replace(tmp, root)
    except OSError:
        if not root.exists():
            raise


def _is_complete(root: Path, size: int) -> bool:
    try:
        meta = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("size") == size
