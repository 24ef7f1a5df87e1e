"""Transforms of the torch loader: timm's train/eval ones, and a crop that reports its box."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from PIL import Image
from timm.data import auto_augment, create_transform
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as T

from vitpod.trainer.data.config import DataConfig


def train_transform(cfg: DataConfig) -> Callable[[Image.Image], Any]:
    """Random resized crop, flip, RandAugment and random erasing (the recipe's CutOut)."""
    return _fix_posterize(create_transform(**_train_args(cfg)))


def eval_transform(cfg: DataConfig) -> Callable[[Image.Image], Any]:
    """Resize the short side to img_size / crop_pct, center-crop img_size, normalize."""
    return create_transform(
        cfg.img_size,
        is_training=False,
        interpolation=cfg.interpolation,
        crop_pct=cfg.crop_pct,
        mean=cfg.mean,
        std=cfg.std,
    )


class BoxedTrainTransform:
    """The train transform, but the crop and flip are done here and returned with the image.

    Returns (tensor, box, flipped) where box = (x0, y0, x1, y1) is the crop window in
    fractions of the source image, so a token-label score map can be cropped the same way.
    """

    def __init__(self, cfg: DataConfig):
        _, secondary, self.final = create_transform(**_train_args(cfg), separate=True)
        self.secondary = _fix_posterize(secondary)
        self.size, self.scale, self.ratio, self.hflip = (
            cfg.img_size,
            cfg.scale,
            cfg.ratio,
            cfg.hflip,
        )
        filters = (
            ("bilinear", "bicubic")
            if cfg.train_interpolation == "random"
            else (cfg.train_interpolation or cfg.interpolation,)
        )  # timm's 'random': one of the two per image
        self.resamples = [Image.Resampling[f.upper()] for f in filters]

    def __call__(self, img: Image.Image) -> tuple[Any, tuple[float, float, float, float], bool]:
        src_w, src_h = img.size
        top, left, height, width = RandomResizedCropAndInterpolation.get_params(
            img, self.scale, self.ratio
        )
        box = (left / src_w, top / src_h, (left + width) / src_w, (top + height) / src_h)
        window = (left, top, left + width, top + height)
        resample = random.choice(self.resamples)
        img = img.resize((self.size, self.size), resample, box=window)
        flipped = random.random() < self.hflip
        if flipped:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return self.final(self.secondary(img)), box, flipped


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's posterize, keeping its 0-bit level (a black image) that Pillow >= 13 rejects."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return auto_augment.posterize(img, bits_to_keep)


def _fix_posterize(transform: T.Compose) -> T.Compose:
    """Point timm's posterize operators at `posterize` (timm's 'inc1' levels reach 0 bits)."""
    for step in transform.transforms:
        for op in getattr(step, "ops", []):
            if getattr(op, "aug_fn", None) is auto_augment.posterize:
                op.aug_fn = posterize
    return transform


def _train_args(cfg: DataConfig) -> dict[str, Any]:
    return dict(
        input_size=cfg.img_size,
        is_training=True,
        scale=cfg.scale,
        ratio=cfg.ratio,
        hflip=cfg.hflip,
        auto_augment=cfg.auto_augment or None,
        interpolation=cfg.train_interpolation or cfg.interpolation,
        color_jitter=cfg.color_jitter,
        re_prob=cfg.reprob,
        re_mode="pixel",
        mean=cfg.mean,
        std=cfg.std,
    )
