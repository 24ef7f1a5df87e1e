"""The recipe's RandAugment and CutOut (random erasing) as DALI operators, as timm sets them."""

from __future__ import annotations

import math
from typing import Any

from nvidia.dali import fn as _fn
from nvidia.dali import math as _dmath
from nvidia.dali.auto_aug import rand_augment as dali_rand_augment

fn: Any = _fn  # DALI generates its operators at import time; typed loosely for mypy
dmath: Any = _dmath
TIMM_MAX_LEVEL = 10  # timm's RandAugment magnitudes run 0..10
ERASE_AREA = (0.02, 1 / 3)  # timm RandomErasing defaults
ERASE_LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))


def rand_augment_params(policy: str) -> tuple[int, int]:
    """(ops per image, magnitude 0..10) of a timm 'rand-m9-n2-...' string; other policies raise."""
    parts = policy.split("-")
    if parts[0] != "rand":
        raise ValueError(
            f"DataConfig.auto_augment={policy!r}: the DALI loader implements RandAugment "
            "('rand-m<M>-n<N>...') only; use loader='torch' for other policies"
        )
    layers, magnitude = 2, 10
    for part in parts[1:]:
        if part.startswith("m") and part[1:].isdigit():
            magnitude = int(part[1:])
        elif part.startswith("n") and part[1:].isdigit():
            layers = int(part[1:])
    return layers, min(magnitude, TIMM_MAX_LEVEL)


def rand_augment(images: Any, policy: str) -> Any:
    """RandAugment on HWC uint8 images; DALI's 11 magnitude bins are timm's levels 0..10."""
    layers, magnitude = rand_augment_params(policy)
    return dali_rand_augment.rand_augment(
        images, n=layers, m=magnitude, num_magnitude_bins=TIMM_MAX_LEVEL + 1
    )


def cutout(images: Any, probability: float) -> Any:
    """Erase one random rectangle (2%..33% of the area, aspect 0.3..3.3) per image with
    `probability`, filled with 0 = the mean colour of the normalized CHW float images."""
    area = fn.random.uniform(range=ERASE_AREA)
    aspect = dmath.exp(fn.random.uniform(range=ERASE_LOG_ASPECT))
    height = dmath.min(dmath.sqrt(area * aspect), 1.0)
    width = dmath.min(dmath.sqrt(area / aspect), 1.0)
    top = fn.random.uniform(range=(0.0, 1.0)) * (1.0 - height)
    left = fn.random.uniform(range=(0.0, 1.0)) * (1.0 - width)
    keep = fn.random.coin_flip(probability=probability)  # 0: an empty rectangle, nothing erased
    return fn.erase(
        images,
        anchor=fn.stack(top, left),
        shape=fn.stack(height * keep, width * keep),
        normalized_anchor=True,
        normalized_shape=True,
        axis_names="HW",
        fill_value=0.0,
    )
