"""What a Trainer builds from its TrainConfig besides the model: data settings, classes, loss."""

from __future__ import annotations

from torch import nn

from vitpod.trainer.config import TrainConfig


def data_config(cfg: TrainConfig):
    from vitpod.trainer.data import DataConfig

    return DataConfig(
        data_dir=cfg.data_dir or "", dataset=cfg.dataset, img_size=cfg.img_size,
        batch_size=cfg.batch_size, accum_steps=cfg.accum_steps, workers=cfg.workers,
        loader=cfg.loader,
        crop_pct=cfg.crop_pct or 0.875, scale=(cfg.scale[0], cfg.scale[1]), hflip=cfg.hflip,
        auto_augment=cfg.aa or None,
        reprob=cfg.reprob, num_classes=cfg.num_classes, token_label=cfg.token_label,
        token_label_data=cfg.token_label_data or "",
        token_label_size=cfg.token_label_size or cfg.img_size // 16,
        ground_truth=cfg.ground_truth, corrupt=cfg.corrupt, seed=cfg.seed,
        drop_last=cfg.drop_last, ratio=(cfg.ratio[0], cfg.ratio[1]),
        interpolation=cfg.interpolation or "bicubic", train_interpolation=cfg.train_interpolation,
        color_jitter=cfg.color_jitter, aug_repeats=cfg.aug_repeats,
        **_normalisation(cfg),
    )  # fmt: skip


def _normalisation(cfg: TrainConfig) -> dict:
    """--mean/--std as timm reads them: one value for every channel, or three."""
    out = {}
    for name in ("mean", "std"):
        value = getattr(cfg, name)
        if value is not None:
            out[name] = tuple(value) * 3 if len(value) == 1 else tuple(value)
    return out


def resolve_num_classes(cfg: TrainConfig) -> None:
    """--num-classes not given: count the data set's classes (the model is built before the data).

    An explicit --num-classes is kept as given: load_split checks it against the data and
    refuses a mismatch naming the flag. cfg is updated, so config.json records the count.
    """
    if cfg.num_classes is None:
        from vitpod.trainer.data.sources import count_classes

        cfg.num_classes = count_classes(data_config(cfg))


def make_criterion(cfg: TrainConfig) -> nn.Module:
    if cfg.token_label:
        from vitpod.trainer.model.token_loss import TokenLabelCriterion

        return TokenLabelCriterion(ground_truth=cfg.ground_truth)
    if cfg.bce_loss:  # timm's train.py: smoothing is Mixup's when it is on, else the loss's
        from timm.loss import BinaryCrossEntropy

        return BinaryCrossEntropy(
            smoothing=0.0 if cfg.mixup_active else cfg.smoothing,
            target_threshold=cfg.bce_target_thresh, sum_classes=cfg.bce_sum,
            pos_weight=cfg.bce_pos_weight,
        )  # fmt: skip
    if cfg.mixup_active:  # Mixup's targets are soft, --smoothing already in them
        from timm.loss import SoftTargetCrossEntropy

        return SoftTargetCrossEntropy()
    return nn.CrossEntropyLoss(label_smoothing=cfg.smoothing)


def make_mixup(cfg: TrainConfig):
    """timm's Mixup/CutMix for --mixup/--cutmix (None when both are 0). It draws from numpy's
    and torch's global generators, which reseed_for_step seeds from (seed, rank, step): the
    same mix in a resumed run as in an uninterrupted one."""
    if not cfg.mixup_active:
        return None
    from timm.data import Mixup

    return Mixup(
        mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, prob=cfg.mixup_prob,
        switch_prob=cfg.mixup_switch_prob, mode=cfg.mixup_mode, label_smoothing=cfg.smoothing,
        num_classes=num_classes(cfg),
    )  # fmt: skip


def num_classes(cfg: TrainConfig) -> int:
    if cfg.num_classes is None:
        raise RuntimeError("num_classes unresolved: call resolve_num_classes(cfg) first")
    return cfg.num_classes


def startup_errors() -> tuple[type[Exception], ...]:
    """Errors that mean bad input (exit USAGE), raised while the Trainer is built."""
    from vitpod.registry.safepickle import UnsafePickle  # a planted --finetune or label file
    from vitpod.trainer.config import ConfigError
    from vitpod.trainer.data import DataConfigError, DataSourceError
    from vitpod.trainer.model.models import ModelLoadError

    return (ConfigError, DataConfigError, DataSourceError, ModelLoadError, UnsafePickle)
