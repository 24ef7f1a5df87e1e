"""The trainer settings that came with timm train.py's command line (trainer/settings/
timmoptions.py maps each timm option): a base of TrainConfig, its fields in the same flag groups."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _arg(group: str, help: str, *flags: str, **kwargs: Any) -> dict[str, Any]:
    return {"group": group, "help": help, "flags": flags, **kwargs}


@dataclass(kw_only=True)
class TimmSettings:
    """timm's data, model, loss, schedule and run settings vitpod had no flag for."""

    ratio: tuple[float, float] = field(
        default=(3 / 4, 4 / 3), metadata=_arg("data", "random-resized-crop aspect range", nargs=2)
    )
    color_jitter: float = field(
        default=0.4,
        metadata=_arg("data", "color jitter strength (timm's: off while --aa is on; torch loader)"),
    )
    input_size: tuple[int, ...] | None = field(
        default=None, metadata=_arg("data", "timm's C H W: 3 N N sets --img-size N", nargs=3)
    )
    mean: tuple[float, ...] | None = field(
        default=None, metadata=_arg("data", "normalisation mean (default ImageNet's)", nargs="+")
    )
    std: tuple[float, ...] | None = field(
        default=None, metadata=_arg("data", "normalisation std (default ImageNet's)", nargs="+")
    )
    interpolation: str = field(
        default="",
        metadata=_arg("data", "resize filter ('': the model's, bicubic)",
                      choices=("", "bicubic", "bilinear")),
    )  # fmt: skip
    train_interpolation: str = field(
        default="",
        metadata=_arg("data", "train resize filter ('': --interpolation; random: either, per "
                      "image; torch loader)", choices=("", "bicubic", "bilinear", "random")),
    )  # fmt: skip
    aug_repeats: float = field(
        default=0,
        metadata=_arg("data", "repeated augmentation: each image N times per epoch on different "
                      "ranks (timm's RepeatAugSampler, fractions too; 0 = off)"),
    )  # fmt: skip
    validation_batch_size: int | None = field(
        default=None,
        metadata=_arg("data", "validation batch per rank (default: -b)", "-vb",
                      "--validation-batch-size"),
    )  # fmt: skip
    drop: float = field(default=0.0, metadata=_arg("model", "dropout rate (timm's drop_rate)"))
    model_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=_arg("model", "more timm.create_model arguments, KEY=VALUE ...", nargs="*"),
    )
    pretrained: bool = field(
        default=False,
        metadata=_arg("model", "start from timm's pretrained weights: --pretrained-path, else the "
                      "local Hugging Face cache (never downloaded)"),
    )  # fmt: skip
    pretrained_path: str | None = field(
        default=None, metadata=_arg("model", "weights file read as the pretrained weights")
    )
    sync_bn: bool = field(
        default=False, metadata=_arg("model", "SyncBatchNorm across ranks (DDP on GPUs)")
    )
    bce_loss: bool = field(
        default=False, metadata=_arg("optim", "binary cross-entropy loss (timm's)")
    )
    bce_sum: bool = field(default=False, metadata=_arg("optim", "BCE: sum over classes"))
    bce_target_thresh: float | None = field(
        default=None, metadata=_arg("optim", "BCE: binarize soft targets at this threshold")
    )
    bce_pos_weight: float | None = field(
        default=None, metadata=_arg("optim", "BCE: weight of positive targets")
    )
    clip_mode: str = field(
        default="norm",
        metadata=_arg("optim", "what --clip-grad clips: the norm, each value, or adaptive (agc; "
                      "DDP)", choices=("norm", "value", "agc")),
    )  # fmt: skip
    cooldown_epochs: int = field(
        default=0, metadata=_arg("optim", "epochs at --min-lr after --epochs (trained too)")
    )
    sched_on_updates: bool = field(
        default=True,
        metadata=_arg("optim", "step the LR schedule per optimizer update (false: once per epoch, "
                      "timm's default)"),
    )  # fmt: skip
    opt_kwargs: dict[str, Any] = field(
        default_factory=dict,
        metadata=_arg("optim", "more optimizer arguments, KEY=VALUE ...", nargs="*"),
    )
    experiment: str = field(
        default="", metadata=_arg("run", "run in OUTPUT/NAME (timm's experiment name)")
    )
