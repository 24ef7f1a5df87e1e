"""Stored token labels: teacher score maps on shared storage, cut into crop-aligned targets.

Stored data: one torch file (zip format, loaded with mmap so ranks and workers share pages)
holding, per training image, the teacher's per-token top-k class probabilities
`values [N, k, H, W]` (float16) and `indices [N, k, H, W]`, computed on the whole image
resized to the teacher's input size, plus `index`: relative image path -> row.
A training sample's target is a float tensor [2 + S*S, C]: row 0 the ground-truth one-hot,
row 1 the class-token target (the mean of the token targets), rows 2.. the per-token targets
for the crop: the dense map is cut with the same box (`roi_align`) and flipped like the image,
then resampled to S x S = token_label_size^2.

A directory in TokenLabeling's published layout (`<class>/<image stem>.pt`, [2, k, H, W] per
image, no vitpod manifest) is read by `published_labels.PublishedLabelStore` through the same
cut (`label_maps.targets`, which every loader uses); `open` picks the reader from the
directory's layout.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from vitpod.registry import labellayout, labelset, safepickle
from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.label_maps import TokenLabelError, crop_scores, scatter, targets
from vitpod.trainer.data.sources import Split

__all__ = ["TokenLabelError", "TokenLabelStore", "crop_scores"]
FORMAT = "vitpod-token-labels/1"
log = logging.getLogger(__name__)


class TokenLabelStore:
    """Reads stored score maps (memory-mapped) and turns them into crop-aligned targets.

    Pickles as its path (and the teacher digest it was opened with) only, so DataLoader
    workers map the file themselves and check every shard's teacher again on each (re)load.
    """

    def __init__(self, path: Path, num_classes: int, size: int, teacher_sha256: str | None = None):
        self.path, self.num_classes, self.size = path, num_classes, size
        self.teacher_sha256 = teacher_sha256
        self.grid, self.k = (0, 0), 0
        self._data: dict[str, Any] | None = None

    @classmethod
    def open(cls, cfg: DataConfig, num_classes: int, split: Split | None = None) -> TokenLabelStore:
        """Open and check cfg.token_label_data (one file, or a sharded directory with a manifest
        from `python -m vitpod.trainer.tokenlabels.label`); with `split`, every image must have an
        entry."""
        path = Path(cfg.token_label_data)
        if labellayout.layout_of(path) == labelset.PUBLISHED:  # TokenLabeling's files, as published
            from vitpod.trainer.data.published_labels import PublishedLabelStore

            return PublishedLabelStore.open(cfg, num_classes, split)  # type: ignore[no-any-return]
        store = cls(path, num_classes, cfg.token_label_size)
        if path.is_dir():
            store._check_manifest(split)
            manifest = labelset.read_manifest(path) or {}
            store.teacher_sha256 = (manifest.get("teacher") or {}).get("weights_sha256")
        data = store.data
        if data.get("format") != FORMAT:
            raise TokenLabelError(f"{path} is not token-label data ({FORMAT}): regenerate it")
        if data["num_classes"] != num_classes:
            raise TokenLabelError(
                f"{path} has scores for {data['num_classes']} classes, the data has {num_classes}"
            )
        if split is not None:
            missing = [p for p in map(split.relpath, range(len(split))) if p not in data["index"]]
            if missing:
                raise TokenLabelError(
                    f"{path} has no token labels for {len(missing)} of {len(split)} images "
                    f"(first: {missing[:3]}): regenerate it over {split.root}"
                )
        values = data["shards"][0]["values"] if "shards" in data else data["values"]
        store.grid, store.k = (int(values.shape[2]), int(values.shape[3])), int(values.shape[1])
        log.info(
            "token labels: %s at %s: grid %dx%d, k=%d, cut with each crop box onto the %dx%d "
            "token grid (RoIAlign)", FORMAT if path.is_file() else labelset.FORMAT, path,
            *store.grid, store.k, store.size, store.size,
        )  # fmt: skip
        return store

    @property
    def info(self) -> dict[str, Any]:
        """What was read, for the run's summary."""
        return {"layout": FORMAT if self.path.is_file() else labelset.FORMAT,
                "path": str(self.path), "grid": list(self.grid), "k": self.k,
                "token_grid": [self.size, self.size]}  # fmt: skip

    def _check_manifest(self, split: Split | None) -> None:
        """A sharded directory: the manifest must fit this data set and this grid."""
        manifest = labelset.read_manifest(self.path)
        names = None
        if split is not None and split.files is not None:
            names = [split.relpath(i) for i in range(len(split))]
        found = labelset.problems(
            manifest, where=f"--token-label-data {self.path}", names=names,
            data_dir=str(split.root) if split is not None else None,
            img_size=self.size * labelset.STRIDE,
        )  # fmt: skip
        if found:
            raise TokenLabelError("; ".join(found))

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            if self.path.is_dir():
                self._data = _load_shards(self.path, self.teacher_sha256)
            elif not self.path.is_file():
                raise TokenLabelError(
                    f"--token-label-data {self.path} does not exist: make it with "
                    "`make token-labels` (python -m vitpod.trainer.tokenlabels.label), or pass "
                    "TokenLabeling's published labels (github.com/zihangJiang/TokenLabeling) "
                    "with --token-label-data DIR"
                )
            else:
                with safepickle.naming(self.path):  # a refusal names the file
                    self._data = torch.load(
                        self.path, map_location="cpu", mmap=True, weights_only=True
                    )
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "num_classes": self.num_classes, "size": self.size,
                "teacher_sha256": self.teacher_sha256, "grid": self.grid, "k": self.k}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.num_classes, self.size = state["path"], state["num_classes"], state["size"]
        self.teacher_sha256 = state.get("teacher_sha256")
        self.grid, self.k = state.get("grid", (0, 0)), state.get("k", 0)
        self._data = None

    softmax = False  # stored scores are probabilities: normalized after the cut

    def target(
        self, relpath: str, label: int, box: tuple[float, float, float, float], flipped: bool
    ) -> torch.Tensor:
        """[2 + S*S, C]: one-hot label, class-token target, token targets of the crop `box`."""
        return targets(
            self, [relpath], torch.tensor([label]), torch.tensor([box], dtype=torch.float64),
            torch.tensor([flipped]),
        )[0]  # fmt: skip

    def maps(self, relpath: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Image `relpath`'s stored top-k: probabilities [k, H, W] (float) and class indices."""
        row = self.data["index"].get(relpath)
        if row is None:
            raise TokenLabelError(f"{self.path} has no token labels for {relpath}: regenerate it")
        return self._row(row)

    def _row(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.data
        if "shards" in data:  # row -> (shard, row in shard): shards stay memory-mapped
            shard = data["shard_of"][row]
            part, row = data["shards"][shard], row - data["starts"][shard]
            return part["values"][row].float(), part["indices"][row].long()
        return data["values"][row].float(), data["indices"][row].long()

    def dense(self, row: int) -> torch.Tensor:
        """The stored top-k of image `row` as a dense [C, H, W] distribution."""
        return scatter(*self._row(row), self.num_classes)


def _load_shards(path: Path, teacher_sha256: str | None = None) -> dict[str, Any]:
    """A sharded label directory as one index over memory-mapped shards (no copy); every shard
    must carry the manifest's teacher digest, and the manifest the one the run opened
    (`teacher_sha256`; None: whatever the manifest names)."""
    manifest = labelset.read_manifest(path)
    if manifest is None:
        raise TokenLabelError(
            f"--token-label-data {path} has no {labelset.RECORD}: its labeling job has not "
            "finished; rerun `make token-labels` (finished shards are kept)"
        )
    teacher = (manifest.get("teacher") or {}).get("weights_sha256")
    if teacher_sha256 is not None and teacher != teacher_sha256:
        raise TokenLabelError(
            f"--token-label-data {path}: relabeled while this run trains: its manifest now names "
            f"teacher sha256 {teacher}, the run opened it with {teacher_sha256}; train on a "
            'directory one teacher labels (make token-labels ARGS="--label-dir DIR")'
        )
    shards: list[dict[str, Any]] = []
    starts: list[int] = []
    shard_of: list[int] = []
    index: dict[str, int] = {}
    for number in range(manifest["num_shards"]):
        shard = labelset.shard_path(path, number, manifest["num_shards"])
        with safepickle.naming(shard):
            part = torch.load(shard, map_location="cpu", mmap=True, weights_only=True)
        problem = labelset.shard_teacher_problem(
            labelset.shard_path(path, number, manifest["num_shards"]),
            part.get("teacher_sha256"), teacher,
        )  # fmt: skip
        if problem is not None:
            raise TokenLabelError(f"--token-label-data {problem}")
        starts.append(len(shard_of))
        for name, row in part["index"].items():
            index[name] = starts[-1] + row
        shard_of.extend([number] * len(part["index"]))
        shards.append(part)
    return {
        "format": FORMAT, "num_classes": manifest["num_classes"], "index": index,
        "shards": shards, "starts": starts, "shard_of": shard_of,
    }  # fmt: skip
