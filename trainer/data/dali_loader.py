"""The DALI loader: one pipeline per rank over its planned files; GPU decode when CUDA is there.

Sharding is the shared plan of sharding.py (the same batches, in the same order, as the torch
loader). Each rank's pipeline is built once and fed the file paths of one planned batch per
iteration (external_source -> io.file.read), so it can start mid-epoch, end with a partial
batch and keep every rank at the same number of steps, which DALI's own
`readers.file(shard_id, num_shards)` split cannot do. Up to `prefetch_queue_depth` batches
are in flight while the trainer computes.
Training augmentation is exact across restarts: the crop window, flip, RandAugment operators and
signs and the CutOut box of every sample are drawn on the host from (seed, epoch, index)
(draws.py) and fed in beside the paths; the graph holds no random operator.
With token labels the pipeline also returns, per sample, the decoder's image shape
(peek_image_shape), the crop window it decoded and its flip; the label maps are cut with those
boxes after the pipeline, on the images' device (label_maps.targets, the torch loader's cut),
from maps read by a thread while DALI decodes.
"""

from __future__ import annotations

import io
import logging
import math
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from nvidia.dali import Pipeline, pipeline_def
from nvidia.dali import fn as _fn
from nvidia.dali import types as _types
from nvidia.dali.plugin.pytorch import feed_ndarray
from nvidia.dali.tensors import TensorListCPU, TensorListGPU
from PIL import Image

from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.dali_augment import (
    cutout,
    rand_augment,
    rand_augment_params,
    rand_augment_suite,
)
from vitpod.trainer.data.draws import SampleDraws, draw
from vitpod.trainer.data.label_maps import targets
from vitpod.trainer.data.loader import Batch, CorruptImageError, Loader
from vitpod.trainer.data.sources import Split

fn: Any = _fn  # DALI generates its operators at import time; typed loosely for mypy
types: Any = _types
log = logging.getLogger(__name__)
PREFETCH = 2
INTERP = {"bicubic": types.INTERP_CUBIC, "bilinear": types.INTERP_LINEAR}
TORCH_DTYPES = {types.FLOAT: torch.float32, types.INT64: torch.int64, types.INT32: torch.int32}


# external_source outputs: paths and sample ids, then (training) the host-drawn decisions
# of draws.SampleDraws that this configuration uses: field -> (DALI dtype, ndim).
_INPUTS = {"path": (types.UINT8, 1), "id": (types.INT64, 0)}
_DRAWS = {"crop_anchor": (types.FLOAT, 1), "crop_shape": (types.FLOAT, 1),
          "mirror": (types.INT32, 0), "ops": (types.INT32, 1), "signs": (types.INT32, 1),
          "erase_anchor": (types.FLOAT, 1), "erase_shape": (types.FLOAT, 1)}  # fmt: skip


def source_fields(cfg: DataConfig, train: bool) -> list[str]:
    """The external_source outputs, in order (DALI warns about outputs a graph leaves unused)."""
    if not train:
        return list(_INPUTS)
    fields = [*_INPUTS, "crop_anchor", "crop_shape", "mirror"]
    fields += (
        ["ops", "signs"] if cfg.auto_augment and rand_augment_params(cfg.auto_augment)[0] else []
    )
    return fields + (["erase_anchor", "erase_shape"] if cfg.reprob > 0 else [])


@pipeline_def(enable_conditionals=True)  # RandAugment picks its operators with conditionals
def image_pipeline(source: Callable, cfg: DataConfig, train: bool, gpu: bool, shards: bool = False,
                   boxes: bool = False):  # fmt: skip
    """Read, decode the crop window + resize + flip (train) or resize + center-crop (val),
    normalize. Training takes every random decision from the host (see draws.py); with `boxes`
    it also returns each sample's image shape (HWC), crop anchor and shape (pixels, x/y) and
    flip, for the token-label cut."""
    names = source_fields(cfg, train)
    layout = [{**_INPUTS, **_DRAWS}[name] for name in names]
    outputs = fn.external_source(
        source=source,
        num_outputs=len(layout),
        dtype=[d for d, _ in layout],
        ndim=[n for _, n in layout],
    )
    # A plain loop: DALI's conditionals (autograph) rewrite zip() without its strict= flag.
    inputs = {name: outputs[i] for i, name in enumerate(names)}
    paths, sample_ids = inputs["path"], inputs["id"]
    # Shards hand over the encoded bytes themselves (read from an open tar); files their path.
    encoded = paths if shards else fn.io.file.read(paths)
    decoder = "mixed" if gpu else "cpu"
    size = cfg.img_size
    interp = INTERP[cfg.interpolation]
    if train:
        # Decodes only the window (ROI decode), like decoders.image_random_crop did.
        images = fn.decoders.image_slice(
            encoded,
            inputs["crop_anchor"],
            inputs["crop_shape"],
            device=decoder,
            output_type=types.RGB,
            normalized_anchor=False,
            normalized_shape=False,
            axis_names="WH",
        )
        images = fn.resize(images, resize_x=size, resize_y=size, interp_type=interp)
        if "ops" in inputs:
            images = rand_augment(images, str(cfg.auto_augment), inputs["ops"], inputs["signs"])
        mirror, crop = inputs["mirror"], None
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
    if "erase_anchor" in inputs:
        images = cutout(images, inputs["erase_anchor"], inputs["erase_shape"])
    if train and boxes:
        shape = fn.peek_image_shape(encoded)
        return images, sample_ids, shape, inputs["crop_anchor"], inputs["crop_shape"], mirror
    return images, sample_ids


class DaliLoader(Loader):
    """DALI pipeline per rank over the planned batches (CPU decode here, 'mixed' on a GPU)."""

    name = "dali"

    def __init__(self, split: Split, cfg: DataConfig, rank: int, world_size: int, train: bool,
                 token_labels: Any = None):  # fmt: skip
        super().__init__(split, cfg, rank, world_size, train)
        assert split.files is not None or split.shards is not None
        self.token_labels = token_labels if train else None
        self._maps: deque[Future] = deque()  # label maps of the in-flight batches, being read
        self._reader: ThreadPoolExecutor | None = None
        self.device_id = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._files = split.files
        self._paths = [np.frombuffer(p.encode(), dtype=np.uint8) for p in split.files or []]
        self._labels = torch.from_numpy(split.labels)
        self._pipe: Pipeline | None = None
        self._used = False  # the pipeline ran a pass and needs reset() before the next
        self._queue: deque[np.ndarray] = deque()  # planned batches not yet given to DALI
        self._in_flight: deque[np.ndarray] = deque()  # given to DALI, outputs not yet taken
        self._builds = 0
        self._sizes: dict[int, tuple[int, int]] = {}  # (width, height) from the JPEG header
        self._draw_epoch = 0  # the epoch whose augmentation the queued batches get
        layers = rand_augment_params(cfg.auto_augment)[0] if train and cfg.auto_augment else 0
        num_ops = len(rand_augment_suite()) if layers else 1
        self._fields = source_fields(cfg, train)
        self._draw_args: dict[str, Any] = dict(scale=cfg.scale, ratio=cfg.ratio, hflip=cfg.hflip,
                                               layers=layers, num_ops=num_ops,
                                               reprob=cfg.reprob)  # fmt: skip

    def _iter_batches(self, batches: list[np.ndarray]) -> Iterator[Batch]:
        self._prepare(batches)
        while True:
            try:
                outputs = self._pipe.run()  # type: ignore[union-attr]
            except StopIteration:
                return
            except RuntimeError as err:
                self._pipe = None  # a failed pipeline is not reused
                self._prepare(self._drop_corrupt(list(self._in_flight) + list(self._queue), err))
                continue
            images, indices = _to_torch(outputs[0]), _to_torch(outputs[1]).reshape(-1)
            if not torch.equal(indices, torch.from_numpy(self._in_flight.popleft())):
                raise RuntimeError("DALI returned a batch out of order")  # a bug, not bad data
            labels = self._labels[indices]
            if self.token_labels is not None:
                shape, anchor, size, mirror = (_to_torch(out) for out in outputs[2:])
                labels = self._token_targets(indices, labels, shape, anchor, size, mirror, images)
            yield images, labels, indices

    def _token_targets(self, indices: torch.Tensor, labels: torch.Tensor, shape: torch.Tensor,
                       anchor: torch.Tensor, size: torch.Tensor, mirror: torch.Tensor,
                       images: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Cut each sample's label map with the window and flip the pipeline applied."""
        whole = shape[:, [1, 0]].double()  # (width, height) of each image as decoded
        corner = anchor.double()
        boxes = torch.cat([corner / whole, (corner + size.double()) / whole], 1)
        relpaths = [self.split.relpath(int(i)) for i in indices]
        maps = self._maps.popleft().result()
        return targets(self.token_labels, relpaths, labels, boxes, mirror.reshape(-1).bool(),
                       images.device, maps)  # fmt: skip

    def _source(self) -> tuple[list[Any], ...]:
        """Called by DALI (running ahead of the trainer) for the next batch's inputs."""
        if not self._queue:
            raise StopIteration
        batch = self._queue.popleft()
        self._in_flight.append(batch)
        if self.token_labels is not None:  # read the batch's label maps while DALI decodes it
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max(1, self.cfg.workers), "token-labels")
            relpaths = [self.split.relpath(int(i)) for i in batch]
            self._maps.append(self._reader.submit(_read_maps, self.token_labels, relpaths))
        if self.split.shards is not None:
            read = self.split.shards.read
            paths = [np.frombuffer(read(int(i)), dtype=np.uint8) for i in batch]
        else:
            paths = [self._paths[i] for i in batch]
        ids = [np.int64(i) for i in batch]
        if not self.train:
            return paths, ids
        draws = [self._draws(int(i)) for i in batch]
        out: list[list[Any]] = [paths, ids]
        for name in self._fields[2:]:
            dtype = np.int32 if _DRAWS[name][0] == types.INT32 else np.float32
            out.append([np.array(getattr(d, name), dtype) for d in draws])
        return tuple(out)

    def _draws(self, index: int) -> SampleDraws:
        size = self._sizes.get(index)
        if size is None:
            if self.split.shards is not None:
                source: Any = io.BytesIO(self.split.shards.read(index))
            else:
                assert self._files is not None
                source = self._files[index]
            size = self._sizes[index] = _image_size(source)
        return draw(self.cfg.seed, self._draw_epoch, index, size, **self._draw_args)

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
        self._queue, self._in_flight, self._maps = deque(batches), deque(), deque()
        self._draw_epoch = self.epoch
        if self._pipe is None:
            self._builds += 1
            # No random operator is left in the pipeline; the seed only keeps DALI's own
            # default from depending on anything.
            seed = np.random.default_rng([self.cfg.seed, self.rank, self._builds]).integers(2**31)
            self._pipe = image_pipeline(
                source=_WeakSource(self),
                cfg=self.cfg,
                train=self.train,
                gpu=self.device_id is not None,
                shards=self.split.shards is not None,
                boxes=self.token_labels is not None,
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
                f"cannot decode {', '.join(paths)}; fix or remove them, or pass --corrupt skip "
                "(DataConfig.corrupt='skip') to leave them out"
            ) from err
        self._skip_corrupt(paths)
        cleaned = [np.array([i for i in b if int(i) not in bad], dtype=np.int64) for b in pending]
        return [b for b in cleaned if len(b)]


class _WeakSource:
    """The loader's `_source` without a reference cycle, so a dropped loader frees its pipeline."""

    def __init__(self, loader: DaliLoader):
        self._loader = weakref.ref(loader)

    def __call__(self) -> tuple[list[Any], ...]:
        loader = self._loader()
        if loader is None:
            raise StopIteration
        return loader._source()


def _read_maps(store: Any, relpaths: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [store.maps(p) for p in relpaths]


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


def _image_size(path: Any) -> tuple[int, int]:
    """(width, height) from the file header (no decode); 1x1 for a file PIL cannot read (the
    decoder then fails on it and the corrupt-file handling takes over)."""
    try:
        with Image.open(path) as img:
            return img.size
    except (OSError, ValueError, SyntaxError):
        return (1, 1)


def _decodes(path: str) -> bool:
    try:
        with Image.open(path) as img:
            img.convert("RGB")
    except (OSError, ValueError, SyntaxError):
        return False
    return True
