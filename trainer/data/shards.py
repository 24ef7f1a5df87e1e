"""Packed shards: an image split as webdataset tar files plus an index, for shared file systems.

Millions of small JPEGs on Lustre/GPFS/DDN cost one metadata operation (open, stat) each per
epoch; the metadata servers, not the disks, become the bottleneck. WebDataset's answer is to
pack samples into POSIX tar files read with large sequential I/O (webdataset docs, "WebDataset
format"; DALI docs, `fn.readers.webdataset`). Layout written here:

    OUT/<split>/shard-000000.tar   members <key>.jpg (or .png) and <key>.cls (class index, text)
    OUT/<split>/shard-000000.idx   DALI's wds2idx index (v1.2) of that tar
    OUT/<split>/samples.npy        int64 [N, 4]: shard, data offset, data size, label
    OUT/<split>/index.json         classes, shards and their sample counts, source, resize

Keys are the sample's index in the source split, so sample i of the shards is sample i of the
folder: the trainer's sharding plan (sharding.py) applies unchanged and gives exactly-once
epochs and mid-epoch resume. Readers seek to a sample's offset in an already open shard, so an
epoch opens each shard at most once per reading process instead of every image.
Run: `python -m vitpod.trainer.data.shards DATA OUT [--dataset folder|cifar10|cifar100|digits]`.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vitpod.registry import io as atomic
from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.shard_reader import FORMAT, INDEX, SAMPLES
from vitpod.trainer.data.sources import load_split

JPEG_SUFFIXES = (".jpg", ".jpeg")


def encode(split: Any, index: int, resize: int | None, quality: int) -> tuple[bytes, str]:
    """The sample's encoded image and its extension; JPEG files pass through byte for byte
    unless `resize` asks for a smaller copy (shorter side, bicubic as the recipe's resize)."""
    if split.arrays is not None:
        image = Image.fromarray(split.arrays[index])
        raw = None
    else:
        path = split.files[index]
        with open(path, "rb") as fh:
            raw = fh.read()
        image = Image.open(io.BytesIO(raw))
        if resize is None and path.lower().endswith(JPEG_SUFFIXES):
            return raw, "jpg"
    image = image.convert("RGB")
    if resize is not None and min(image.size) > resize:
        scale = resize / min(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    out = io.BytesIO()
    if raw is None:  # arrays (CIFAR): lossless, the pixels stay the source's
        image.save(out, format="PNG")
        return out.getvalue(), "png"
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue(), "jpg"


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> int:
    """Append a member; returns where its data starts (after its header) in the tar file."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), 0, 0o644
    start = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
    tar.addfile(info, io.BytesIO(payload))
    return start


def write_split(split: Any, folder: Path, samples_per_shard: int = 1000,
                resize: int | None = None, quality: int = 95) -> dict[str, Any]:  # fmt: skip
    """Write one split's shards, their DALI indexes, samples.npy and index.json (last, so a
    folder with an index.json is complete); returns the index."""
    folder.mkdir(parents=True, exist_ok=True)
    table = np.zeros((len(split), 4), dtype=np.int64)
    shards = []
    for number, start in enumerate(range(0, len(split), samples_per_shard)):
        name = f"shard-{number:06d}.tar"
        stop = min(start + samples_per_shard, len(split))
        lines = []
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, stop):
                payload, ext = encode(split, i, resize, quality)
                label = int(split.labels[i])
                key = f"{i:09d}"
                offset = _add(tar, f"{key}.{ext}", payload)
                cls = str(label).encode()
                cls_offset = _add(tar, f"{key}.cls", cls)
                table[i] = (number, offset, len(payload), label)
                lines.append(f"{ext} {offset} {len(payload)} {key}.{ext} "
                             f"cls {cls_offset} {len(cls)} {key}.cls")  # fmt: skip
        atomic.write_bytes_atomic(folder / name, buffer.getvalue())
        idx = folder / name.replace(".tar", ".idx")
        # DALI's wds2idx format.
        atomic.write_text_atomic(idx, f"v1.2 {len(lines)}\n" + "\n".join(lines) + "\n")
        shards.append({"name": name, "index": idx.name, "samples": stop - start})
    np.save(folder / SAMPLES, table)
    index = {"format": FORMAT, "split": split.name, "classes": list(split.classes),
             "num_samples": len(split), "shards": shards, "resize": resize}  # fmt: skip
    atomic.write_text_atomic(folder / INDEX, json.dumps(index, indent=1) + "\n")
    return index


def write_shards(data_dir: str, out: str, dataset: str = "folder", samples_per_shard: int = 1000,
                 resize: int | None = None,
                 splits: tuple[str, ...] = ("train", "val")) -> Path:  # fmt: skip
    """Pack DATA (ImageNet layout, CIFAR pickles or digits) into OUT/<split>/ shards."""
    cfg = DataConfig(data_dir=data_dir, dataset=dataset, loader="torch")
    for name in splits:
        write_split(load_split(cfg, name), Path(out) / name, samples_per_shard, resize)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Pack an image split into webdataset shards.")
    parser.add_argument("data", help="dataset root (ImageNet layout, CIFAR folder, digits)")
    parser.add_argument("out", help="output folder (OUT/train, OUT/val)")
    parser.add_argument("--dataset", default="folder",
                        choices=("folder", "cifar10", "cifar100", "digits"))  # fmt: skip
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument("--resize", type=int, default=None,
                        help="shorter side in pixels (default: keep the source bytes)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.samples_per_shard < 1 or (args.resize is not None and args.resize < 1):
        parser.error("--samples-per-shard and --resize must be at least 1")
    out = write_shards(args.data, args.out, args.dataset, args.samples_per_shard, args.resize)
    for split in ("train", "val"):
        index = json.loads((out / split / INDEX).read_text())
        print(f"{split}: {index['num_samples']} samples in {len(index['shards'])} shards")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
