"""The torch loader: timm transforms in DataLoader workers over this rank's planned batches."""

from __future__ import annotations

import io
import multiprocessing
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.loader import Batch, CorruptImageError, Loader
from vitpod.trainer.data.sources import Split
from vitpod.trainer.data.transforms import BoxedTrainTransform, eval_transform, train_transform

Item = tuple[int, Any, Any]  # (index, image tensor or None if skipped, target or skipped path)
Key = tuple[int, int]  # (sample index, augmentation seed)


def augment_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation: a pure function of (seed, epoch, index)."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


def seed_augmentation(aug_seed: int) -> None:
    """timm transforms draw from python `random` and torch; numpy seeded too for custom ones."""
    random.seed(aug_seed)
    np.random.seed(aug_seed)
    torch.manual_seed(aug_seed)


class SplitDataset(Dataset):
    """Decodes and transforms one sample; a corrupt file raises or is reported as skipped."""

    def __init__(self, split: Split, transform: Callable, corrupt: str, token_labels: Any = None):
        self.split, self.transform, self.corrupt, self.token_labels = (
            split, transform, corrupt, token_labels,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: int | Key) -> Item:
        """`key` is an index, or (index, seed) to make the random augmentation reproducible:
        the same crop, flip, RandAugment and erasing whichever worker or resumed run draws it."""
        if isinstance(key, int):
            return self._load(key)
        index, aug_seed = key
        if torch.utils.data.get_worker_info() is not None:
            seed_augmentation(aug_seed)
            return self._load(index)
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        seed_augmentation(aug_seed)  # in the main process (workers=0): leave its RNGs as found
        try:
            return self._load(index)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])

    def _load(self, index: int) -> Item:
        label = int(self.split.labels[index])
        if self.split.arrays is not None:
            return index, self.transform(Image.fromarray(self.split.arrays[index])), label
        source: Any
        if self.split.shards is not None:  # a seek in an open tar file, not an open per image
            path = self.split.shards.path(index)
            source = io.BytesIO(self.split.shards.read(index))
        else:
            assert self.split.files is not None
            path = source = self.split.files[index]
        try:
            with Image.open(source) as raw:
                img = raw.convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:
            if self.corrupt == "fail":
                raise CorruptImageError(
                    f"cannot decode {path}: {err}; fix or remove the file, or pass "
                    "--corrupt skip (DataConfig.corrupt='skip') to leave it out"
                ) from err
            return index, None, path
        if self.token_labels is None:
            return index, self.transform(img), label
        image, box, flipped = self.transform(img)
        return (
            index,
            image,
            self.token_labels.target(self.split.relpath(index), label, box, flipped),
        )


def collate(items: list[Item]) -> tuple[torch.Tensor, Any, torch.Tensor, list[str]]:
    """Stack the decoded samples; skipped ones only report their path."""
    kept = [item for item in items if item[1] is not None]
    skipped = [item[2] for item in items if item[1] is None]
    if not kept:
        return (
            torch.empty(0),
            torch.empty(0, dtype=torch.long),
            torch.empty(0, dtype=torch.long),
            skipped,
        )
    indices = torch.tensor([item[0] for item in kept], dtype=torch.long)
    images = torch.stack([item[1] for item in kept])
    first = kept[0][2]
    if isinstance(first, torch.Tensor):
        targets = torch.stack([item[2] for item in kept])
    else:
        targets = torch.tensor([item[2] for item in kept], dtype=torch.long)
    return images, targets, indices, skipped


class _PlanSampler:
    """A batch sampler whose batches the Loader sets before each pass (keeps workers persistent).

    Training batches carry each sample's augmentation seed from (seed, epoch, index): torch's
    DataLoader seeds workers from the global RNG when an iterator starts, which a resumed run
    does at another point than an uninterrupted one.
    """

    def __init__(self, seed: int, train: bool) -> None:
        self.batches: list[np.ndarray] = []
        self.seed, self.train, self.epoch = seed, train, 0

    def __iter__(self) -> Iterator[list[int] | list[Key]]:
        for batch in self.batches:
            if self.train:
                yield [(i, augment_seed(self.seed, self.epoch, i)) for i in batch.tolist()]
            else:
                yield batch.tolist()

    def __len__(self) -> int:
        return len(self.batches)


def worker_context() -> str:
    """fork, as timm's and torchvision's loaders do (the worker imports nothing), unless a
    thread whose locks a worker could need runs here: a checkpoint writer (non-daemon) or
    DALI's threads. The daemon writers of TensorBoard and W&B hold only their own queues'
    locks, which a worker never takes. Otherwise forkserver: a clean process, torch and timm
    preloaded, seconds slower to start."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if all(t.daemon for t in others) and "nvidia.dali" not in sys.modules:
        return "fork"
    multiprocessing.set_forkserver_preload(["torch", "timm", __name__])
    return "forkserver"


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)


class TorchLoader(Loader):
    """torch DataLoader over the planned batches; timm RandAugment + random erasing for training."""

    name = "torch"

    def __init__(self, split: Split, cfg: DataConfig, rank: int, world_size: int, train: bool,
                 token_labels: Any = None):  # fmt: skip
        super().__init__(split, cfg, rank, world_size, train)
        self._sampler = _PlanSampler(cfg.seed, train)
        self._loader: DataLoader | None = None
        self._token_labels = token_labels if train else None

    @property
    def token_label_info(self) -> dict[str, Any] | None:
        """The token-label data this loader reads (layout, grid, k), or None."""
        return getattr(self._token_labels, "info", None)

    def _build(self) -> DataLoader:
        cfg = self.cfg
        if self._token_labels is not None:
            transform: Callable = BoxedTrainTransform(cfg)
        else:
            transform = train_transform(cfg) if self.train else eval_transform(cfg)
        dataset = SplitDataset(self.split, transform, cfg.corrupt, self._token_labels)
        return DataLoader(
            dataset,
            batch_sampler=self._sampler,
            num_workers=cfg.workers,
            collate_fn=collate,
            pin_memory=torch.cuda.is_available(),
            worker_init_fn=_worker_init if cfg.workers else None,
            persistent_workers=cfg.workers > 0,
            multiprocessing_context=worker_context() if cfg.workers else None,
            prefetch_factor=2 if cfg.workers else None,
        )

    def _iter_batches(self, batches: list[np.ndarray]) -> Iterator[Batch]:
        if self.split.kind == "synthetic":
            yield from self._synthetic(batches)
            return
        if self._loader is None:
            self._loader = self._build()
        self._sampler.batches, self._sampler.epoch = batches, self.epoch
        for images, targets, indices, skipped in self._loader:
            self._skip_corrupt(skipped)
            yield images, targets, indices

    def _synthetic(self, batches: list[np.ndarray]) -> Iterator[Batch]:
        size = self.cfg.img_size
        generator = torch.Generator().manual_seed(self.cfg.seed)
        images = torch.randn(self.cfg.batch_size, 3, size, size, generator=generator)
        labels = torch.from_numpy(self.split.labels)
        for batch in batches:
            indices = torch.from_numpy(batch)
            yield images[: len(batch)], labels[indices], indices
