"""The DALI loader: one pipeline per rank over its planned files; GPU decode when CUDA is there.

Sharding is the shared plan of sharding.py (the same batches, in the same order, as the torch
loader). Each rank's pipeline is built once and fed the file paths of one planned batch per
iteration (external_source -> io.file.read), so it can start mid-epoch, end with a partial
batch and keep every rank at the same number of steps, which DALI's own
`readers.file(shard_id, num_shards)` split cannot do. Up to `prefetch_queue_depth` batches
are in flight while the trainer computes.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from nvidia.dali import Pipeline, pipeline_def
from nvidia.dali import fn as _fn
from nvidia.dali import types as _types
from nvidia.dali.plugin.pytorch import feed_ndarray
from nvidia.dali.tensors import TensorListCPU, TensorListGPU
from PIL import Image

from trainer.data.config import DataConfig
from trainer.data.dali_augment import cutout, rand_augment
from trainer.data.loader import Batch, CorruptImageError, Loader
from trainer.data.sources import Split

fn: Any = _fn  # DALI generates its operators at import time; typed loosely for mypy
types: Any = _types
log = logging.getLogger(__name__)
PREFETCH = 2
INTERP = {"bicubic": types.INTERP_CUBIC, "bilinear": types.INTERP_LINEAR}
TORCH_DTYPES = {types.FLOAT: torch.float32, types.INT64: torch.int64}


@pipeline_def(enable_conditionals=True)  # RandAugment picks its operators with conditionals
def image_pipeline(source: Callable, cfg: DataConfig, train: bool, gpu: bool, shards: bool = False):
    """Read, decode, random-resized-crop + flip (train) or resize + center-crop (val), normalize."""
    paths, sample_ids = fn.external_source(
        source=source, num_outputs=2, dtype=[types.UINT8, types.INT64], ndim=[1, 0]
    )
    # Shards hand over the encoded bytes themselves (read from an open tar); files their path.
    encoded = paths if shards else fn.io.file.read(paths)
    decoder = "mixed" if gpu else "cpu"
    size = cfg.img_size
    interp = INTERP[cfg.interpolation]
    if train:
        images = fn.decoders.image_random_crop(
            encoded,
            device=decoder,
            output_type=types.RGB,
            random_area=list(cfg.scale),
            random_aspect_ratio=list(cfg.ratio),
            num_attempts=10,
        )
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=interp)
        if cfg.auto_augment:
            images = rand_augment(images, cfg.auto_augment)
        mirror = fn.random.coin_flip(probability=cfg.hflip)
        crop = None
    else:
        images = fn.decoders.image(encoded, device=decoder, output_type=types.RGB)
        shorter = math.floor(size / cfg.crop_pct)  # as timm's eval transform
        images = fn.resize(images, resize_shorter=shorter, interp_type=interp)
        mirror, crop = 0, (size, size)
    images = fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="CHW",
        crop=crop,
        mean=[255 * m for m in cfg.mean],
        std=[255 * s for s in cfg.std],
        mirror=mirror,
    )
    if train and cfg.reprob > 0:
        images = cutout(images, cfg.reprob)
    return images, sample_ids


class DaliLoader(Loader):
    """DALI pipeline per rank over the planned batches (CPU decode here, 'mixed' on a GPU)."""

    name = "dali"

    def __init__(self, split: Split, cfg: DataConfig, rank: int, world_size: int, train: bool):
        super().__init__(split, cfg, rank, world_size, train)
        assert split.files is not None or split.shards is not None
        self.device_id = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._paths = [np.frombuffer(p.encode(), dtype=np.uint8) for p in split.files or []]
        self._labels = torch.from_numpy(split.labels)
        self._pipe: Pipeline | None = None
        self._used = False  # the pipeline ran a pass and needs reset() before the next
        self._queue: deque[np.ndarray] = deque()  # planned batches not yet given to DALI
        self._in_flight: deque[np.ndarray] = deque()  # given to DALI, outputs not yet taken
        self._builds = 0

    def _iter_batches(self, batches: list[np.ndarray]) -> Iterator[Batch]:
        self._prepare(batches)
        while True:
            try:
                images, ids = self._pipe.run()  # type: ignore[union-attr]
            except StopIteration:
                return
            except RuntimeError as err:
                self._pipe = None  # a failed pipeline is not reused
                self._prepare(self._drop_corrupt(list(self._in_flight) + list(self._queue), err))
                continue
            indices = _to_torch(ids).reshape(-1)
            if not torch.equal(indices, torch.from_numpy(self._in_flight.popleft())):
                raise RuntimeError("DALI returned a batch out of order")  # a bug, not bad data
            yield _to_torch(images), self._labels[indices], indices

    def _source(self) -> tuple[list[np.ndarray], list[np.int64]]:
        """Called by DALI (running ahead of the trainer) for the next batch's inputs."""
        if not self._queue:
            raise StopIteration
        batch = self._queue.popleft()
        self._in_flight.append(batch)
        if self.split.shards is not None:
            read = self.split.shards.read
            return [np.frombuffer(read(int(i)), dtype=np.uint8) for i in batch], [
                np.int64(i) for i in batch
            ]
        return [self._paths[i] for i in batch], [np.int64(i) for i in batch]

    def _prepare(self, batches: list[np.ndarray]) -> None:
        """Have a pipeline ready to read `batches`: built once, reset between passes."""
        if self._pipe is not None and self._used:
            self._queue.clear()
            while True:  # a pass left early: take what DALI had prefetched, then reset
                try:
                    self._pipe.run()
                except StopIteration:
                    break
            self._pipe.reset()
        self._queue, self._in_flight = deque(batches), deque()
        if self._pipe is None:
            self._builds += 1
            seed = np.random.default_rng([self.cfg.seed, self.rank, self._builds]).integers(2**31)
            self._pipe = image_pipeline(
                source=_WeakSource(self),
                cfg=self.cfg,
                train=self.train,
                gpu=self.device_id is not None,
                shards=self.split.shards is not None,
                batch_size=self.cfg.batch_size,
                num_threads=max(1, self.cfg.workers),
                device_id=self.device_id,
                seed=int(seed),
                prefetch_queue_depth=PREFETCH,
            )
            self._pipe.build()
        self._used = True

    def _drop_corrupt(self, pending: list[np.ndarray], err: RuntimeError) -> list[np.ndarray]:
        """Find the undecodable files of the failed batches; fail naming them, or drop them."""
        if self.split.files is None:  # shards: the failing sample is named by DALI's error
            raise err
        suspects = np.concatenate(pending[: PREFETCH + 1])
        bad = {int(i) for i in suspects if not _decodes(self.split.files[int(i)])}
        if not bad:
            raise err
        paths = [self.split.files[i] for i in sorted(bad)]
        if self.cfg.corrupt == "fail":
            raise CorruptImageError(
                f"cannot decode {', '.join(paths)}; fix or remove them, or pass corrupt='skip'"
            ) from err
        log.warning("skipping %d corrupt image(s): %s", len(paths), ", ".join(paths))
        self.skipped.extend(paths)
        cleaned = [np.array([i for i in b if int(i) not in bad], dtype=np.int64) for b in pending]
        return [b for b in cleaned if len(b)]


class _WeakSource:
    """The loader's `_source` without a reference cycle, so a dropped loader frees its pipeline."""

    def __init__(self, loader: DaliLoader):
        self._loader = weakref.ref(loader)

    def __call__(self) -> tuple[list[np.ndarray], list[np.int64]]:
        loader = self._loader()
        if loader is None:
            raise StopIteration
        return loader._source()


def _to_torch(batch: TensorListCPU | TensorListGPU) -> torch.Tensor:
    """Copy a dense DALI batch (CPU, or GPU after 'mixed' decode) into a new torch tensor."""
    tensor = batch.as_tensor()
    out = torch.empty(
        tensor.shape(),
        dtype=TORCH_DTYPES[tensor.dtype],
        device="cuda" if isinstance(batch, TensorListGPU) else "cpu",
    )
    stream = torch.cuda.current_stream() if out.is_cuda else None
    return feed_ndarray(tensor, out, cuda_stream=stream)


def _decodes(path: str) -> bool:
    try:
        with Image.open(path) as img:
            img.convert("RGB")
    except (OSError, ValueError, SyntaxError):
        return False
    return True
