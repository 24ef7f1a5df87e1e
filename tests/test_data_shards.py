"""Packed shards (`make shards`): read by the torch and DALI loaders exactly once, resumable."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures_data import data_config
from tests.helpers import make
from vitpod.trainer.data import create_loader
from vitpod.trainer.data.shard_reader import INDEX, ShardReader
from vitpod.trainer.data.shards import write_shards, write_split
from vitpod.trainer.data.sources import Split, folder_split


@pytest.fixture(scope="module")
def shards_dir(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shards(str(digits_dir), str(tmp_path_factory.mktemp("shards") / "out"),
                        samples_per_shard=200)  # fmt: skip


INDEXED = {"return_index": True, "seed": 5}


def test_shards_hold_the_folder_byte_for_byte_with_labels_and_dali_indexes(digits_dir, shards_dir):
    folder = folder_split(digits_dir, "train")
    reader = ShardReader(shards_dir / "train")
    index = json.loads((shards_dir / "train" / INDEX).read_text())
    assert index["num_samples"] == len(folder) and index["classes"] == folder.classes
    assert len(index["shards"]) == -(-len(folder) // 200)
    assert (reader.labels == folder.labels).all()
    assert folder.files is not None
    for i in (0, 199, 200, len(folder) - 1):
        assert reader.read(i) == Path(folder.files[i]).read_bytes()
    assert reader.opens == 3  # shards 0, 1 and the last: one open each, not one per image
    with tarfile.open(shards_dir / "train" / "shard-000001.tar") as tar:
        names = tar.getnames()
    assert names[:2] == ["000000200.jpg", "000000200.cls"]
    first_idx = (shards_dir / "train" / "shard-000000.idx").read_text().splitlines()
    assert first_idx[0] == "v1.2 200" and first_idx[1].startswith("jpg ")


@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_two_ranks_read_every_training_sample_once_and_resume_mid_epoch(shards_dir, loader):
    n = len(ShardReader(shards_dir / "train"))
    seen: list[int] = []
    for rank in range(2):
        cfg = data_config(shards_dir, INDEXED, dataset="shards", loader=loader)
        first = create_loader(cfg, "train", rank, 2)
        first.set_epoch(1)
        batches = iter(first)
        images, targets, indices = next(batches)
        assert images.shape[1:] == (3, 32, 32) and images.dtype == torch.float32
        state = first.state_dict()
        resumed = create_loader(cfg, "train", rank, 2)
        resumed.load_state_dict(state)
        seen += indices.tolist() + [i for _, _, idx in resumed for i in idx.tolist()]
    assert len(seen) == len(set(seen))
    assert n - len(seen) < 2  # training may drop fewer than world_size samples of the tail


def test_torch_loader_gives_the_same_images_from_shards_as_from_the_folder(digits_dir, shards_dir):
    from_folder = create_loader(
        data_config(digits_dir, INDEXED, dataset="folder", loader="torch"), "val", 0, 1
    )
    from_shards = create_loader(
        data_config(shards_dir, INDEXED, dataset="shards", loader="torch"), "val", 0, 1
    )
    for (a, ta, ia), (b, tb, ib) in zip(from_folder, from_shards, strict=True):
        assert torch.equal(ia, ib) and torch.equal(ta, tb) and torch.equal(a, b)


def test_dali_webdataset_reader_reads_the_shards_with_their_indexes(shards_dir):
    from nvidia.dali import fn, pipeline_def

    folder = shards_dir / "val"
    index = json.loads((folder / INDEX).read_text())
    tars = [str(folder / s["name"]) for s in index["shards"]]
    idxs = [str(folder / s["index"]) for s in index["shards"]]

    @pipeline_def(batch_size=32, num_threads=1, device_id=None)
    def wds():
        jpeg, cls = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=["jpg", "cls"],
                                          name="r")  # fmt: skip
        return jpeg, cls

    pipe = wds()
    pipe.build()
    total = index["num_samples"]
    labels: list[int] = []
    while len(labels) < total:
        _, cls = pipe.run()
        labels += [int(bytes(np.asarray(cls[i])).decode()) for i in range(len(cls))]
    assert labels[:total] == ShardReader(folder).labels.tolist()


def test_arrays_are_packed_losslessly_as_png(tmp_path: Path):
    rng = np.random.default_rng(0)
    arrays = rng.integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)
    split = Split("train", ["a", "b"], np.array([0, 1, 0, 1, 1]), arrays=arrays)
    write_split(split, tmp_path / "train", samples_per_shard=2)
    reader = ShardReader(tmp_path / "train")
    from io import BytesIO

    from PIL import Image

    for i in range(5):
        assert (np.asarray(Image.open(BytesIO(reader.read(i)))) == arrays[i]).all()
    assert reader.labels.tolist() == [0, 1, 0, 1, 1]


def test_make_shards_resizes_and_rejects_missing_arguments(digits_dir: Path, tmp_path: Path):
    out = tmp_path / "small"
    done = make("shards", f"DATA={digits_dir}", f"OUT={out}",
                "ARGS=--resize 16 --samples-per-shard 500")  # fmt: skip
    assert done.returncode == 0, done.stderr
    from io import BytesIO

    from PIL import Image

    reader = ShardReader(out / "train")
    assert min(Image.open(BytesIO(reader.read(0))).size) == 16  # digits are 32 px
    missing = make("shards", f"DATA={digits_dir}")
    assert missing.returncode != 0 and "usage: make shards" in missing.stderr
