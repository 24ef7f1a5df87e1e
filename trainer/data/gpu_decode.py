"""The gpu loader: nvJPEG decode through torchvision.io.decode_jpeg(device='cuda'), no DALI."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.draws import SampleDraws, draw
from vitpod.trainer.data.label_maps import targets
from vitpod.trainer.data.loader import Batch, CorruptImageError, Loader
from vitpod.trainer.data.sources import Split

RGB = ImageReadMode.RGB


def resize(image: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """uint8 CHW -> uint8 CHW, antialiased like PIL's resize (and rounded to uint8 as PIL is)."""
    out = F.interpolate(image[None].float(), size=(height, width), mode=mode, antialias=True)
    return out[0].round().clamp(0, 255).to(torch.uint8)


def train_image(image: torch.Tensor, d: SampleDraws, cfg: DataConfig) -> torch.Tensor:
    """Crop the drawn window, resize to img_size, flip; float CHW in [0, 255]."""
    (x, y), (w, h) = (int(v) for v in d.crop_anchor), (int(v) for v in d.crop_shape)
    out = resize(image[:, y : y + h, x : x + w], cfg.img_size, cfg.img_size, cfg.interpolation)
    return (out.flip(-1) if d.mirror else out).float()


def eval_image(image: torch.Tensor, cfg: DataConfig) -> torch.Tensor:
    """Resize the short side to floor(img_size / crop_pct) and centre-crop img_size (timm's)."""
    _, height, width = image.shape
    short = math.floor(cfg.img_size / cfg.crop_pct)
    scale = short / min(height, width)
    size = (short, round(width * scale)) if height <= width else (round(height * scale), short)
    out = resize(image, size[0], size[1], cfg.interpolation)
    top = int(round((size[0] - cfg.img_size) / 2.0))
    left = int(round((size[1] - cfg.img_size) / 2.0))
    return out[:, top : top + cfg.img_size, left : left + cfg.img_size].float()


def erase(image: torch.Tensor, d: SampleDraws) -> torch.Tensor:
    """Zero (the mean colour after normalizing) the drawn CutOut box, as the DALI loader does;
    both box edges truncated to pixels like DALI's fn.erase (matched against it on digits)."""
    if d.erase_shape == (0.0, 0.0):
        return image
    _, height, width = image.shape
    (top, left), (eh, ew) = d.erase_anchor, d.erase_shape
    rows = slice(math.floor(top * height), math.floor((top + eh) * height))
    cols = slice(math.floor(left * width), math.floor((left + ew) * width))
    image = image.clone()
    image[:, rows, cols] = 0.0
    return image


class GpuDecodeLoader(Loader):
    """Batched decode_jpeg on `device` (default: this rank's CUDA device) + host-drawn crops.

    Batched: one decode_jpeg call takes the list of a batch's encoded files (torchvision's
    "decode_jpeg ... input can be a list of tensors" batched GPU decode). The crop window, flip and
    CutOut box of each sample are the host-drawn decisions of draws.py, as in the DALI loader, so
    which process or restart decodes a sample does not change its pixels (exact resume). The
    same code runs with device='cpu' (torchvision's libjpeg-turbo path), which the tests use.
    RandAugment is not implemented here: `--loader gpu` refuses a RandAugment policy.
    With token labels, each sample's label map is cut with its drawn window and flip after the
    batch is decoded, on `device` (label_maps.targets, the torch loader's cut).
    """

    name = "gpu"

    def __init__(self, split: Split, cfg: DataConfig, rank: int, world_size: int, train: bool,
                 device: torch.device | None = None, token_labels: Any = None):  # fmt: skip
        super().__init__(split, cfg, rank, world_size, train)
        self.token_labels = token_labels if train else None
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self._mode = "bicubic" if cfg.interpolation == "bicubic" else "bilinear"
        mean, std = torch.tensor(cfg.mean) * 255, torch.tensor(cfg.std) * 255
        self._mean = mean.view(3, 1, 1).to(self.device)
        self._std = std.view(3, 1, 1).to(self.device)

    def _read(self, index: int) -> tuple[str, torch.Tensor]:
        if self.split.shards is not None:
            path, payload = self.split.shards.path(index), self.split.shards.read(index)
        else:
            assert self.split.files is not None
            path = self.split.files[index]
            with open(path, "rb") as fh:
                payload = fh.read()
        return path, torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def _decode(self, data: list[torch.Tensor], paths: list[str]) -> list[torch.Tensor | None]:
        """The batch in one call; if it fails, one by one (PNG on the CPU, corrupt -> None)."""
        try:
            return list(decode_jpeg(data, mode=RGB, device=self.device))
        except RuntimeError:
            return [self._decode_one(raw, path) for raw, path in zip(data, paths, strict=True)]

    def _decode_one(self, raw: torch.Tensor, path: str) -> torch.Tensor | None:
        try:
            return decode_image(raw, mode=RGB).to(self.device)
        except RuntimeError as err:
            if self.cfg.corrupt == "fail":
                raise CorruptImageError(
                    f"cannot decode {path}: {err}; fix or remove the file, or pass "
                    "--corrupt skip (DataConfig.corrupt='skip') to leave it out"
                ) from err
            return None

    def _transform(
        self, image: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, SampleDraws | None]:
        cfg = self.cfg
        if not self.train:
            return (eval_image(image, cfg) - self._mean) / self._std, None
        size = (int(image.shape[2]), int(image.shape[1]))
        d = draw(cfg.seed, self.epoch, index, size, scale=cfg.scale, ratio=cfg.ratio,
                 hflip=cfg.hflip, layers=0, num_ops=1, reprob=cfg.reprob)  # fmt: skip
        return erase((train_image(image, d, cfg) - self._mean) / self._std, d), d

    def _token_targets(self, pairs: list[tuple[int, torch.Tensor]], draws: list[Any],
                       labels: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Cut each sample's label map with the window and flip its image got."""
        boxes = []
        for (_, image), d in zip(pairs, draws, strict=True):
            (x, y), (w, h) = d.crop_anchor, d.crop_shape
            width, height = int(image.shape[2]), int(image.shape[1])
            boxes.append((x / width, y / height, (x + w) / width, (y + h) / height))
        flips = torch.tensor([bool(d.mirror) for d in draws])
        relpaths = [self.split.relpath(i) for i, _ in pairs]
        boxes_ = torch.tensor(boxes, dtype=torch.float64)
        return targets(self.token_labels, relpaths, labels, boxes_, flips, self.device)

    def _iter_batches(self, batches: list[np.ndarray]) -> Iterator[Batch]:
        labels = torch.as_tensor(self.split.labels, dtype=torch.long)
        for batch in batches:
            paths, data = zip(*(self._read(int(i)) for i in batch), strict=True)
            decoded = self._decode(list(data), list(paths))
            self._skip_corrupt([p for p, img in zip(paths, decoded, strict=True) if img is None])
            pairs = [
                (i, im) for i, im in zip(batch.tolist(), decoded, strict=True) if im is not None
            ]
            done = [self._transform(img, i) for i, img in pairs]
            indices = torch.tensor([i for i, _ in pairs], dtype=torch.long)
            images = torch.stack([img for img, _ in done]) if done else torch.empty(0)
            targets_ = labels[indices]
            if self.token_labels is not None and done:
                targets_ = self._token_targets(pairs, [d for _, d in done], targets_)
            yield images, targets_, indices
