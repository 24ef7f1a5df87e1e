"""The recipe's RandAugment and CutOut (random erasing) as DALI operators, as timm sets them;
every random choice comes from the host (vitpod.trainer.data.draws), not from DALI's RNG."""

from __future__ import annotations

from typing import Any

from nvidia.dali import fn as _fn
from nvidia.dali.auto_aug import rand_augment as dali_rand_augment
from nvidia.dali.auto_aug.core import select, signed_bin

fn: Any = _fn  # DALI generates its operators at import time; typed loosely for mypy
TIMM_MAX_LEVEL = 10  # timm's RandAugment magnitudes run 0..10


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


def rand_augment_suite() -> list:
    """DALI's RandAugment operators (its default suite, as `rand_augment.rand_augment` uses)."""
    return dali_rand_augment.get_rand_augment_suite()


def rand_augment(images: Any, policy: str, ops: Any, signs: Any) -> Any:
    """RandAugment on HWC uint8 images with operators and signs chosen on the host.

    `ops` and `signs` are per-sample int32 vectors of length n (vitpod.trainer.data.draws): the same
    composition as DALI's `apply_rand_augment`, with its `fn.random` draws replaced by inputs.
    DALI's 11 magnitude bins are timm's levels 0..10.
    """
    layers, magnitude = rand_augment_params(policy)
    if layers == 0:
        return images
    suite = rand_augment_suite()
    magnitudes = signed_bin(magnitude, random_sign=signs)
    for level in range(layers):
        images = select(
            suite, ops[level], data=images, magnitude_bin=magnitudes[level],
            num_magnitude_bins=TIMM_MAX_LEVEL + 1, fill_value=128, interp_type=None,
        )  # fmt: skip
    return images


def cutout(images: Any, anchor: Any, shape: Any) -> Any:
    """Erase the host-drawn rectangle ((top, left), (height, width) as fractions; (0, 0) for
    none) of the normalized CHW float images, filled with 0 = the mean colour."""
    return fn.erase(
        images,
        anchor=anchor,
        shape=shape,
        normalized_anchor=True,
        normalized_shape=True,
        axis_names="HW",
        fill_value=0.0,
    )
