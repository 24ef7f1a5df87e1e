"""Every random augmentation decision of a training sample, drawn on the host from
(seed, epoch, sample index) alone.

DALI's random operators (`random.uniform`, `coin_flip`, `image_random_crop`) are seeded once per
pipeline and advance with every batch it runs, so a pipeline rebuilt after a requeue, or one that
prefetched batches a preempted run never used, draws other crops than an uninterrupted run. Here
each sample gets its own generator, keyed by (seed, epoch, index); the DALI pipeline receives
the decisions through `external_source` ("Parallel External Source" / "Operator arguments as
inputs" in the DALI documentation) and applies them, so which process, rank or restart decodes
a sample does not matter. Pure numpy: no DALI needed to test it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CROP_ATTEMPTS = 10  # timm / torchvision RandomResizedCrop
ERASE_AREA = (0.02, 1 / 3)  # timm RandomErasing defaults
ERASE_LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))
_STREAM = 0x44414C49  # "DALI": keeps these streams apart from the epoch permutation's


@dataclass(frozen=True)
class SampleDraws:
    """One sample's decisions; pixel boxes are (x, y) / (width, height), erase is fractional."""

    crop_anchor: tuple[float, float]
    crop_shape: tuple[float, float]
    mirror: int
    ops: tuple[int, ...]  # RandAugment operator per layer (index into DALI's suite)
    signs: tuple[int, ...]  # 1: that layer's magnitude is negated
    erase_anchor: tuple[float, float]  # (top, left) as fractions of the image
    erase_shape: tuple[float, float]  # (height, width) fractions; (0, 0) erases nothing


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index, _STREAM])


def crop_window(
    rng: np.random.Generator,
    width: int,
    height: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> tuple[int, int, int, int]:
    """(x, y, w, h) in pixels, by the algorithm of torchvision's RandomResizedCrop.get_params."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(CROP_ATTEMPTS):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    in_ratio = width / height  # fallback: the central crop of the allowed aspect ratios
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def draw(
    seed: int,
    epoch: int,
    index: int,
    size: tuple[int, int],
    *,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    hflip: float,
    layers: int,
    num_ops: int,
    reprob: float,
) -> SampleDraws:
    """All decisions for sample `index` (source image `size` = (width, height)) in `epoch`."""
    rng = sample_rng(seed, epoch, index)
    x, y, w, h = crop_window(rng, size[0], size[1], scale, ratio)
    mirror = int(rng.random() < hflip)
    ops = tuple(int(v) for v in rng.integers(0, max(num_ops, 1), size=layers))
    signs = tuple(int(v) for v in rng.integers(0, 2, size=layers))
    # timm's RandomErasing shape law (area 2%..33%, log-uniform aspect 0.3..3.3), one box.
    area = rng.uniform(*ERASE_AREA)
    aspect = math.exp(rng.uniform(*ERASE_LOG_ASPECT))
    eh, ew = min(math.sqrt(area * aspect), 1.0), min(math.sqrt(area / aspect), 1.0)
    top, left = rng.random() * (1.0 - eh), rng.random() * (1.0 - ew)
    keep = rng.random() < reprob
    return SampleDraws(
        crop_anchor=(float(x), float(y)),
        crop_shape=(float(w), float(h)),
        mirror=mirror,
        ops=ops,
        signs=signs,
        erase_anchor=(top, left),
        erase_shape=(eh, ew) if keep else (0.0, 0.0),
    )
