"""--model-ema: timm's ModelEmaV3 of the weights, updated after each optimizer step and
checkpointed beside them (so a resumed run's EMA is the uninterrupted run's); the DDP engine's
whole, unsharded model only (trainer/settings/checks.py refuses the others)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitpod.registry import runfiles
from vitpod.trainer.checkpointing.torchsave import atomic_torch_save
from vitpod.trainer.config import TrainConfig

log = logging.getLogger(__name__)
FINAL_EMA = "model_ema.pt"
"""RUN_DIR/final/model_ema.pt: the EMA weights (timm's train.py keeps them as state_dict_ema)."""


def make_ema(cfg: TrainConfig, model: nn.Module) -> Any:
    if not cfg.model_ema:
        return None
    from timm.utils import ModelEmaV3

    return ModelEmaV3(model, decay=cfg.model_ema_decay)


def load_ema(ema: Any, shared: dict[str, Any], model: nn.Module) -> None:
    """The checkpoint's EMA; one written without --model-ema starts it from the loaded weights."""
    if "ema" in shared:
        ema.module.load_state_dict(shared["ema"])
    else:
        log.warning("--model-ema: the checkpoint holds no EMA; it starts from its weights")
        ema.set(model)


def save_final_ema(run_dir: Path, ema: Any) -> dict[str, Any]:
    """RUN_DIR/final/model_ema.pt; the manifest's `ema` entry (file, sha256, size)."""
    state = {k: v.detach().cpu() for k, v in ema.module.state_dict().items()}
    path = runfiles.final_model(run_dir).with_name(FINAL_EMA)
    return {"file": FINAL_EMA, **atomic_torch_save(state, path)}


def ema_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(  # type: ignore[no-any-return]
        runfiles.final_model(run_dir).with_name(FINAL_EMA), weights_only=True
    )
