"""timm train.py's `args.yaml` (every argparse key of timm's train.py) as TrainConfig values.

One table, TIMM: each timm key, the TrainConfig field it sets (None: vitpod has no such option)
and timm's default. A key vitpod lacks is accepted, and ignored, only at timm's default (it asks
for nothing); any other value is refused, all such keys in one message. Defaults are those of
huggingface/pytorch-image-models train.py at aa4b5850 (2026-08); a key of another timm version
that is in neither this table nor TrainConfig is refused as unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vitpod.trainer.config import ConfigError

SKIP = object()
"""A converter's answer for "this value sets nothing" (timm's None: the model's default)."""


def _given(value: Any, _: dict[str, Any]) -> Any:
    return SKIP if value is None else value


def _data(value: Any, data: dict[str, Any]) -> Any:
    return SKIP if value is None or data.get("data_dir") else value  # timm: data_dir wins


_DATASETS = {"": "folder", "imagefolder": "folder", "torch/cifar10": "cifar10",
             "torch/cifar100": "cifar100"}  # fmt: skip


def _dataset(value: Any, _: dict[str, Any]) -> Any:
    return _DATASETS.get(str(value).lower(), value)  # else: argparse names the valid choices


def _channels_last(value: Any, _: dict[str, Any]) -> Any:
    return True if value else SKIP  # a memory layout, not a result: off -> vitpod's choice


def _compile(value: Any, _: dict[str, Any]) -> Any:
    if value is None:
        return SKIP
    if value != "inductor":
        raise ConfigError(f"torchcompile: {value!r}: vitpod compiles with inductor only")
    return "on"


def _amp_dtype(value: Any, data: dict[str, Any]) -> Any:
    if not data.get("amp"):
        return SKIP  # timm ignores it without --amp
    return {"float16": "fp16", "bfloat16": "bf16"}.get(value, value)


def _opt(value: Any, _: dict[str, Any]) -> Any:
    return {"fusedadamw": "adamw", "fusedlamb": "lamb"}.get(str(value).lower(), value)


def _aa(value: Any, _: dict[str, Any]) -> Any:
    return "" if value is None else value  # timm's None is no RandAugment: vitpod's ''


def _path(value: Any, _: dict[str, Any]) -> Any:
    return value or SKIP  # timm's '' is none


def _pretrained(value: Any, data: dict[str, Any]) -> Any:
    if value and not data.get("pretrained_path"):
        raise ConfigError("pretrained: true without pretrained_path: nothing is downloaded inside "
                          "a job; set pretrained_path to a local weights file")  # fmt: skip
    return SKIP  # the file is pretrained_path's


def _pretrained_path(value: Any, data: dict[str, Any]) -> Any:
    return value if value and data.get("pretrained") else SKIP  # timm reads it with pretrained


# timm keys vitpod has no option for, with timm's default (lr_base_scale: see _lr_scaling).
NOT_IMPLEMENTED: dict[str, Any] = {
    "train_split": "train", "val_split": "validation", "train_num_samples": None,
    "val_num_samples": None, "dataset_download": False, "class_map": "",
    "input_img_mode": None, "input_key": None, "target_key": None,
    "dataset_trust_remote_code": False, "resume": "", "no_resume_opt": False, "gp": None,
    "in_chans": None, "input_size": None, "mean": None, "std": None, "interpolation": "",
    "validation_batch_size": None, "fuser": "",
    "fast_norm": False, "model_kwargs": {}, "head_init_scale": None, "head_init_bias": None,
    "torchcompile_mode": None, "torchscript": False, "device": "cuda", "model_dtype": None,
    "no_ddp_bb": False, "synchronize_step": False, "device_modules": None,
    "clip_mode": "norm", "layer_decay_min_scale": 0, "layer_decay_no_opt_scale": None,
    "opt_kwargs": {}, "sched_on_updates": False, "lr_base_scale": "",
    "lr_noise": None, "lr_noise_pct": 0.67, "lr_noise_std": 1.0, "lr_cycle_mul": 1.0,
    "lr_cycle_decay": 0.5, "lr_cycle_limit": 1, "lr_k_decay": 1.0, "epoch_repeats": 0.0,
    "start_epoch": None, "warmup_prefix": False, "cooldown_epochs": 0,
    "patience_epochs": 10, "no_aug": False, "train_crop_mode": None,
    "ratio": [0.75, 1.3333333333333333], "vflip": 0.0, "color_jitter": 0.4,
    "color_jitter_prob": None, "grayscale_prob": None, "gaussian_blur_prob": None,
    "aug_repeats": 0, "aug_splits": 0, "jsd_loss": False, "bce_loss": False,
    "bce_sum": False, "bce_target_thresh": None, "bce_pos_weight": None,
    "remode": "pixel", "recount": 1, "resplit": False, "cutmix_minmax": None,
    "mixup_off_epoch": 0, "train_interpolation": "random",
    "drop": 0.0, "drop_connect": None, "drop_block": None, "bn_momentum": None,
    "bn_eps": None, "sync_bn": False, "dist_bn": "reduce", "split_bn": False,
    "model_ema_force_cpu": False, "model_ema_warmup": False, "worker_seeding": "all",
    "val_interval": 1,
    "recovery_interval": 0, "checkpoint_hist": 10, "save_images": False,
    "pin_mem": False, "no_prefetcher": False, "eval_metric": "top1", "tta": 0,
    "use_multi_epochs_loader": False, "wandb_tags": [], "wandb_resume_id": "",
    "train_img_sizes": None, "train_batch_sizes": None, "train_size_probs": None,
    "train_size_schedule": "constant", "train_size_schedule_spread": 0.65,
    "train_size_random_mix": 0.1, "train_batches_per_epoch": None,
    "variable_batch_loss_scale": "none", "naflex_loader": False,
    "naflex_train_seq_lens": [128, 256, 576, 784, 1024], "naflex_max_seq_len": 576,
    "naflex_patch_sizes": None, "naflex_patch_size_probs": None,
    "naflex_loss_scale": "linear", "naflex_patchify_channels_first": False,
    "kd_model_name": None, "kd_distill_type": "logit", "kd_loss_type": "kl",
    "distill_loss_weight": None, "task_loss_weight": None, "kd_temperature": 4.0,
    "kd_student_feature_dim": None, "kd_teacher_feature_dim": None,
    "kd_token_distill_type": "soft",
}  # fmt: skip
Convert = Callable[[Any, dict[str, Any]], Any]
# timm key -> (TrainConfig field or None, timm's default, converter of a mapped value).
TIMM: dict[str, tuple[str | None, Any, Convert]] = {
    "data": ("data_dir", None, _data),
    "data_dir": ("data_dir", None, _given),
    "dataset": ("dataset", "", _dataset),
    "model": ("model", "resnet50", _given),
    "num_classes": ("num_classes", None, _given),
    "img_size": ("img_size", None, _given),
    "crop_pct": ("crop_pct", None, _given),
    "batch_size": ("batch_size", 128, _given),
    "channels_last": ("channels_last", False, _channels_last),
    "grad_accum_steps": ("accum_steps", 1, _given),
    "torchcompile": ("compile", None, _compile),
    "amp": ("amp", False, _given),
    "amp_dtype": ("amp_dtype", "float16", _amp_dtype),
    "opt": ("opt", "sgd", _opt),
    "opt_eps": ("opt_eps", None, _given),
    "opt_betas": ("opt_betas", None, _given),
    "momentum": ("momentum", 0.9, _given),
    "layer_decay": ("layer_decay", None, _given),
    "weight_decay": ("weight_decay", 2e-05, _given),
    "clip_grad": ("clip_grad", None, _given),
    "lr": ("lr", None, _given),
    "lr_base": ("lr_base", 0.1, _given),
    "lr_base_size": ("lr_base_size", 256, _given),
    "warmup_lr": ("warmup_lr", 1e-05, _given),
    "min_lr": ("min_lr", 0, _given),
    "epochs": ("epochs", 300, _given),
    "sched": ("sched", "cosine", _given),
    "decay_epochs": ("decay_epochs", 90, _given),
    "decay_milestones": ("decay_milestones", [90, 180, 270], _given),
    "decay_rate": ("decay_rate", 0.1, _given),
    "warmup_epochs": ("warmup_epochs", 5, _given),
    "scale": ("scale", [0.08, 1.0], _given),
    "hflip": ("hflip", 0.5, _given),
    "aa": ("aa", None, _aa),
    "reprob": ("reprob", 0.0, _given),
    "smoothing": ("smoothing", 0.1, _given),
    "mixup": ("mixup", 0.0, _given),
    "cutmix": ("cutmix", 0.0, _given),
    "mixup_prob": ("mixup_prob", 1.0, _given),
    "mixup_switch_prob": ("mixup_switch_prob", 0.5, _given),
    "mixup_mode": ("mixup_mode", "batch", _given),
    "model_ema": ("model_ema", False, _given),
    "model_ema_decay": ("model_ema_decay", 0.9998, _given),
    "grad_checkpointing": ("grad_checkpointing", False, _given),
    "initial_checkpoint": ("initial_checkpoint", "", _path),
    "pretrained": ("finetune", False, _pretrained),
    "pretrained_path": ("finetune", None, _pretrained_path),
    "drop_path": ("drop_path", None, _given),
    "seed": ("seed", 42, _given),
    "log_interval": ("log_interval", 50, _given),
    "workers": ("workers", 4, _given),
    "log_wandb": ("log_wandb", False, _given),
    "wandb_project": ("wandb_project", None, _given),
    # Not implemented by vitpod: accepted at timm's default only.
    **{key: (None, default, _given) for key, default in NOT_IMPLEMENTED.items()},
}  # fmt: skip
# Where timm wrote its run and the launcher's rank: not configuration, ignored at any value.
PLACE_KEYS = ("output", "experiment", "local_rank")


def is_timm(data: dict[str, Any], fields: set[str]) -> bool:
    """A file holding a key only timm has (timm's args.yaml holds all of them)."""
    return any(key in TIMM and key not in fields for key in data)


def from_timm(data: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """TrainConfig values of a timm args.yaml; keys that are TrainConfig fields and not timm's
    (VOLO's token_label, ...) pass through. ConfigError lists every key vitpod cannot honour."""
    values: dict[str, Any] = {}
    refused, unknown = [], []
    for key, value in data.items():
        if key in PLACE_KEYS:
            continue
        if key not in TIMM:
            if key in fields:
                values[key] = value
            else:
                unknown.append(key)
            continue
        field, default, convert = TIMM[key]
        if field is None:
            if value != default and key != "lr_base_scale":  # that one: _lr_scaling
                refused.append(f"{key}: {value!r} (timm's default: {default!r})")
            continue
        mapped = convert(value, data)
        if mapped is not SKIP:
            values[field] = mapped
    refused += _lr_scaling(data)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown}: neither timm train.py's nor vitpod's")
    if refused:
        raise ConfigError(
            "vitpod does not implement " + "; ".join(refused) + ". Set these keys to timm's "
            "default or drop them (docs/trainer.md#config-files)"
        )
    return values


def _lr_scaling(data: dict[str, Any]) -> list[str]:
    """timm scales lr_base by sqrt(batch) for adam/lamb when lr is unset; vitpod linearly."""
    if data.get("lr") is not None:
        return []
    scale = data.get("lr_base_scale") or (
        "sqrt" if any(o in str(data.get("opt", "sgd")).lower() for o in ("ada", "lamb"))
        else "linear"
    )  # fmt: skip
    if scale == "linear":
        return []
    return [f"lr: None with lr_base_scale {scale!r} (vitpod scales lr_base linearly; give lr)"]
