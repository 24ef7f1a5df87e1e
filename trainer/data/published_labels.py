"""TokenLabeling's published token labels, read as published: one file per training image.

`<root>/<class dir>/<image stem>.pt` holds `[2, k, H, W]` float16: the teacher's top-k scores
(logits) and their class indices at every location of its final feature map (zihangJiang/
TokenLabeling `generate_label.py`; NFNet-F6 at 576 px gives 18 x 18). The loader that draws an
image loads its file (weights_only: a DataLoader worker, or the DALI loader's reading thread),
scatters the scores into a zero map of every class, cuts the image's own random-resized-crop
box out of it with RoIAlign onto the model's token grid (any H x W is resampled to img_size/16),
flips it with the image, and takes the softmax over the classes, as sail-sg/volo's training
code (`tlt` `get_label`) does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from vitpod.registry import labellayout, labelset
from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.label_maps import TokenLabelError, scatter, targets
from vitpod.trainer.data.sources import Split

log = logging.getLogger(__name__)


class PublishedLabelStore:
    """Per-image label files; pickles as its settings only (workers read files lazily)."""

    layout = labelset.PUBLISHED

    def __init__(self, path: Path, num_classes: int, size: int, grid: tuple[int, int], k: int):
        self.path, self.num_classes, self.size = path, num_classes, size
        self.grid, self.k = grid, k

    @classmethod
    def open(cls, cfg: DataConfig, num_classes: int, split: Split | None = None) -> Any:
        """Check the directory against the split (a class folder per class, a file per image)
        and read one file for its grid and k; every other file is read by the worker."""
        path = Path(cfg.token_label_data)
        where = f"--token-label-data {path}"
        if split is None or split.files is None or split.root is None:
            raise TokenLabelError(
                f"{where}: published token labels are per image file; the data must be an "
                "image folder (<data>/train/<class>/<image>), not packed shards or arrays"
            )
        names = [split.relpath(i) for i in range(len(split))]
        missing_classes = [c for c in split.classes if not (path / c).is_dir()]
        if missing_classes:
            raise TokenLabelError(
                f"{where}: no class folder for {len(missing_classes)} of {len(split.classes)} "
                f"classes (first: {missing_classes[:3]}); published labels are "
                "<dir>/<class>/<image stem>.pt: label this data set (python -m "
                "vitpod.trainer.tokenlabels.label ... --layout published) or pass its labels' "
                "directory"
            )
        present = {c: set(os.listdir(path / c)) for c in split.classes}
        missing = [
            n
            for n in names
            if labellayout.label_file(path, n).name not in present[Path(n).parts[-2]]
        ]
        if missing:
            raise TokenLabelError(
                f"{where}: no label file for {len(missing)} of {len(names)} images (first: "
                f"{[str(labellayout.label_file(path, n)) for n in missing[:3]]}); label them "
                f"(--layout published) over {split.root}"
            )
        if num_classes > labellayout.PUBLISHED_MAX_CLASSES:
            raise TokenLabelError(
                f"{where}: {num_classes} classes; the published layout stores class indices in "
                f"float16, exact up to {labellayout.PUBLISHED_MAX_CLASSES}: use vitpod's store"
            )
        first = labellayout.label_file(path, names[0])
        maps = _load(first, num_classes)
        grid = (int(maps.shape[2]), int(maps.shape[3]))
        store = cls(path, num_classes, cfg.token_label_size, grid, int(maps.shape[1]))
        log.info(
            "token labels: %s layout (TokenLabeling's [2, k, H, W] per image) at %s: grid %dx%d, "
            "k=%d, cut with each crop box onto the %dx%d token grid (RoIAlign)",
            store.layout, path, *store.grid, store.k, store.size, store.size,
        )  # fmt: skip
        return store

    @property
    def info(self) -> dict[str, Any]:
        """What was read, for the run's summary (and plan.json's describe())."""
        return {"layout": self.layout, "path": str(self.path), "grid": list(self.grid),
                "k": self.k, "token_grid": [self.size, self.size]}  # fmt: skip

    softmax = True  # TokenLabeling's scores are logits: softmax after the cut, as VOLO's get_label

    def target(
        self, relpath: str, label: int, box: tuple[float, float, float, float], flipped: bool
    ) -> torch.Tensor:
        """[2 + S*S, C]: one-hot label, class-token target, token targets of the crop `box`."""
        return targets(
            self, [relpath], torch.tensor([label]), torch.tensor([box], dtype=torch.float64),
            torch.tensor([flipped]),
        )[0]  # fmt: skip

    def maps(self, relpath: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The image's file: top-k logits [k, H, W] (float) and their class indices."""
        maps = _load(labellayout.label_file(self.path, relpath), self.num_classes)
        return maps[0].float(), maps[1].float().round().long()

    def dense(self, relpath: str) -> torch.Tensor:
        """The image's top-k scores scattered into a zero [C, H, W] map (VOLO's get_featuremaps)."""
        return scatter(*self.maps(relpath), self.num_classes)


def _load(file: Path, num_classes: int) -> torch.Tensor:
    """One label file, checked: [2, k, H, W] with class indices below num_classes."""
    try:
        maps = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TokenLabelError(
            f"--token-label-data: {file} is missing (its image has no label); label the data "
            "set again (--layout published)"
        ) from None
    except Exception as exc:  # a damaged or foreign file: name it
        raise TokenLabelError(f"--token-label-data: {file}: unreadable ({exc})") from None
    shape = tuple(maps.shape) if isinstance(maps, torch.Tensor) else ()
    problem = labellayout.published_shape_problem(f"--token-label-data: {file}", shape)
    if problem:
        raise TokenLabelError(problem)
    top = int(maps[1].float().max())
    if top >= num_classes or float(maps[1].float().min()) < 0:
        raise TokenLabelError(
            f"--token-label-data: {file}: class index {top} but the data set has {num_classes} "
            "classes: these labels are for another data set (or another class order)"
        )
    return maps
