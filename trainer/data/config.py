"""DataConfig: the typed settings of the data sources and loaders (contract 5)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vitpod.registry.io import unknown_key_message

DATASETS = ("folder", "cifar10", "cifar100", "digits", "synthetic", "shards")
LOADERS = ("dali", "gpu", "torch", "auto")
CORRUPT_POLICIES = ("skip", "fail")
INTERPOLATIONS = ("bicubic", "bilinear")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DataConfigError(ValueError):
    """A DataConfig field has a bad value; the message names the field and the fix."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the images come from and how each rank loads and augments them."""

    data_dir: str = ""
    """Root of the data: ImageNet layout (train/, val/ of class folders), the CIFAR pickle
    folder, where the digits JPEGs are written, or packed shards (shards.py). Unused for
    'synthetic'."""
    dataset: str = "folder"
    img_size: int = 224
    batch_size: int = 32
    """Per rank."""
    accum_steps: int = 1
    """Training: micro-batches per optimizer step; the sharding cuts the epoch per global batch."""
    workers: int = 4
    """torch: DataLoader worker processes; DALI: CPU threads of the pipeline."""
    loader: str = "auto"
    """'dali', 'gpu' (torchvision nvJPEG decode), 'torch' or 'auto' (DALI when it imports and can
    read the source, else gpu on a CUDA node, else torch)."""
    crop_pct: float = 0.875
    """Validation: resize the short side to img_size / crop_pct, then center-crop img_size."""
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    interpolation: str = "bicubic"
    """Resize filter of both loaders: 'bicubic' (VOLO's) or 'bilinear' (faster, see benchmarks)."""
    train_interpolation: str = ""
    """Training resize filter of the torch loader ('': interpolation; 'random': bilinear or
    bicubic per image, timm's default); DALI and gpu resize with `interpolation`."""
    color_jitter: float = 0.4
    """timm's color jitter strength (torch loader; off while auto_augment is set, as in timm)."""
    aug_repeats: float = 0
    """Training: timm's repeated augmentation (RepeatAugSampler), each image this many times an
    epoch on different ranks (sharding.repeated_order; a fraction as timm's); 0 = off."""
    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    """timm RandAugment string (both loaders; DALI: rand-* policies); None or '' turns it off."""
    reprob: float = 0.25
    """Random-erasing probability, the recipe's CutOut (both loaders)."""
    num_classes: int | None = None
    """None: taken from the data; given: must match the data."""
    token_label: bool = False
    token_label_data: str = ""
    token_label_size: int = 14
    token_stride: int = 16
    """Image pixels per output token of the model: token_label_size must be img_size / this
    (16 for timm's VOLO: patch stem 8, then a 2x downsample)."""
    ground_truth: bool = False
    """Token labeling: the class-token target is the ground-truth label, not the teacher's."""
    corrupt: str = "fail"
    """An undecodable image: 'fail' raises naming the file; 'skip' drops it and counts it."""
    drop_last: bool = False
    """Training only: drop the final partial global batch (see sharding.py for the default)."""
    synthetic_size: int = 1024
    """Number of samples per epoch of the 'synthetic' source."""
    seed: int = 42
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    return_index: bool = False
    """Debug: also yield each sample's index into the split (exactly-once tests)."""

    def __post_init__(self) -> None:
        _check_choice("dataset", self.dataset, DATASETS)
        _check_choice("loader", self.loader, LOADERS)
        _check_choice("corrupt", self.corrupt, CORRUPT_POLICIES)
        _check_choice("interpolation", self.interpolation, INTERPOLATIONS)
        _check_choice("train_interpolation", self.train_interpolation,
                      ("", "random", *INTERPOLATIONS))  # fmt: skip
        for name in (
            "img_size",
            "batch_size",
            "accum_steps",
            "token_label_size",
            "token_stride",
            "synthetic_size",
        ):
            if getattr(self, name) < 1:
                raise DataConfigError(f"DataConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.workers < 0:
            raise DataConfigError(f"DataConfig.workers={self.workers}: must be >= 0")
        if not 0 < self.crop_pct <= 2:
            raise DataConfigError(f"DataConfig.crop_pct={self.crop_pct}: must be in (0, 2]")
        self.scale = _check_range("scale", self.scale, upper=1.0)
        self.ratio = _check_range("ratio", self.ratio, upper=None)
        for name in ("hflip", "reprob"):
            if not 0 <= getattr(self, name) <= 1:
                raise DataConfigError(f"DataConfig.{name}={getattr(self, name)}: must be in [0, 1]")
        if self.num_classes is not None and self.num_classes < 1:
            raise DataConfigError(f"DataConfig.num_classes={self.num_classes}: must be >= 1")
        if self.dataset not in ("synthetic", "digits") and not self.data_dir:
            raise DataConfigError(
                f"DataConfig.data_dir is empty: dataset '{self.dataset}' needs the data folder"
            )
        if self.token_label:
            self._check_token_label()

    def _check_token_label(self) -> None:
        if not self.token_label_data:
            raise DataConfigError(
                "DataConfig.token_label_data is empty: --token-label needs --token-label-data PATH"
            )
        if self.img_size % self.token_stride or self.img_size // self.token_stride != (
            self.token_label_size
        ):
            raise DataConfigError(
                f"DataConfig.token_label_size={self.token_label_size} does not match "
                f"img_size/{self.token_stride}={self.img_size / self.token_stride:g}: "
                f"use --token-label-size {self.img_size // self.token_stride}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataConfig:
        """Build from a mapping; an unknown key raises with the list of valid keys."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - valid)
        if unknown:
            raise DataConfigError(f"DataConfig: {unknown_key_message(unknown, sorted(valid))}")
        return cls(**values)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DataConfigError(f"DataConfig.{name}={value!r}: choose one of {', '.join(choices)}")


def _check_range(name: str, value: Any, upper: float | None) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise DataConfigError(
            f"DataConfig.{name}={value!r}: give two numbers (low, high)"
        ) from None
    if not 0 < low <= high or (upper is not None and high > upper):
        limit = f" <= {upper}" if upper is not None else ""
        raise DataConfigError(f"DataConfig.{name}=({low}, {high}): need 0 < low <= high{limit}")
    return (low, high)
