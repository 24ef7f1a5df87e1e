"""The defaults a TrainConfig resolves at startup: model defaults, batch, accumulation, LR."""

from __future__ import annotations

import dataclasses

from vitpod.registry import models
from vitpod.registry.trainconfig import OUTLOOK_KERNELS, SCHEDULES, ConfigError, TrainConfig
from vitpod.trainer.checkpointing import elastic

__all__ = [
    "OUTLOOK_KERNELS",
    "SCHEDULES",
    "ConfigError",
    "TrainConfig",
    "fit_world",
    "model_defaults",
    "resolve",
    "resolved",
]


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill recipe defaults, the per-rank batch from --global-batch, and the LR."""
    defaults = model_defaults(cfg.model)
    for name in ("drop_path", "crop_pct", "lr_base"):
        if getattr(cfg, name) is None:
            setattr(cfg, name, defaults[name])
    if cfg.token_label and cfg.token_label_size is None:
        cfg.token_label_size = cfg.img_size // 16
    fit_world(cfg, cfg.world_size)
    if cfg.lr is None:
        cfg.lr = (cfg.lr_base or defaults["lr_base"]) * cfg.global_batch_size / cfg.lr_base_size
    if cfg.apex_amp:
        cfg.amp = True
    if cfg.channels_last is None:
        # FSDP2 shards contiguous parameters only: fully_shard refuses channels_last conv weights
        # (found on an H100), and DeepSpeed broadcasts each parameter viewed as bytes, which a
        # channels_last weight cannot be ("stride(-1) must be 1"): both keep NCHW.
        cfg.channels_last = not (cfg.fsdp or cfg.engine == "deepspeed")
    # Pipeline stages and Mixup (it pairs the batch with its flip) need full micro-batches.
    cfg.drop_last = cfg.drop_last or cfg.pp > 1 or cfg.mixup_active
    return cfg


def resolved(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """A resolved copy of a parsed configuration on `world_size` (the planner resolves its one
    parse at the range's top and at the job's node count; cfg is left as it is)."""
    out = resolve(dataclasses.replace(cfg, world_size=world_size, requested=dict(cfg.requested)))
    # timm's train.py computes an unset lr from lr_base (None: a TypeError) and scales it by
    # sqrt(batch) for adam/lamb unless told linear, as vitpod does: args.yaml says both.
    if out.requested.get("lr_base") is None:
        out.requested["lr_base"] = out.lr_base
    out.requested.setdefault("lr_base_scale", "linear")
    return out


def fit_world(cfg: TrainConfig, world_size: int) -> None:
    """The rules that depend on the world size, for the one this job got (a rank of a node
    range): --elastic's accumulation, --global-batch's per-rank batch; nothing else."""
    cfg.world_size = world_size
    if cfg.elastic:
        _elastic_accumulation(cfg)
    elif cfg.global_batch is not None:
        ranks = cfg.dp_size * cfg.accum_steps
        if cfg.global_batch % ranks:
            raise ConfigError(
                f"--global-batch {cfg.global_batch} does not divide over {cfg.dp_size} dp rank(s)"
                f" x --accum-steps {cfg.accum_steps}; pick a multiple of {ranks}"
            )
        cfg.batch_size = cfg.global_batch // ranks


def _elastic_accumulation(cfg: TrainConfig) -> None:
    """The accumulation that keeps --global-batch on this job's data-parallel size."""
    if cfg.global_batch is None:
        raise ConfigError("--elastic needs --global-batch (the batch kept on any world size)")
    try:
        cfg.accum_steps = elastic.accumulation_for(cfg.global_batch, cfg.dp_size, cfg.batch_size)
    except elastic.ElasticError as err:
        raise ConfigError(f"--elastic: {err}") from err


def model_defaults(model: str) -> dict[str, float]:
    """drop_path, crop_pct and lr_base of a registered model; timm's train.py defaults else."""
    if models.known(model):
        info = models.get(model)
        return {"drop_path": info.drop_path, "crop_pct": info.crop_pct, "lr_base": info.lr_base}
    return {"drop_path": 0.1, "crop_pct": 0.875, "lr_base": 1e-3}
