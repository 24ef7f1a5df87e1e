"""The final model as a timm local model folder: model.safetensors and config.json beside
model.pt, so plain timm loads it (`timm.create_model("local-dir:RUN/final", pretrained=True)`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitpod.registry import models, runfiles
from vitpod.registry.io import fsync_dir
from vitpod.trainer.checkpointing.torchsave import sha256_of

log = logging.getLogger(__name__)


def write(
    directory: Path, state: dict[str, torch.Tensor], model_name: str, img_size: int,
    num_classes: int, data: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Write the timm files of `state` into `directory`; returns what the manifest records:
    the timm architecture and each file's sha256 and size, or why there are none.

    `data` is the preprocessing the model was trained with (crop_pct, interpolation, mean, std),
    written into config.json's pretrained_cfg for timm's resolve_data_config."""
    found = models.timm_architecture(model_name)
    if found is None:
        return {"architecture": None, "why_not": models.NOT_IN_TIMM}
    architecture, shape = found
    model_args = {"img_size": img_size, "num_classes": num_classes, **shape}
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    cfg = {"pretrained_cfg": {"tag": "vitpod", **data}}
    try:  # timm cannot build or describe it: model.pt stays the final model, the manifest says why
        meta = _meta_model(architecture, model_args)
        if _shapes(meta.state_dict()) != _shapes(state):
            raise ValueError(f"its keys or shapes are not the trained {model_name}'s")

        def write_config(tmp: Path) -> None:
            save_config_for_hf(meta, tmp, cfg, model_args)  # type: ignore[arg-type]  # timm < 1.0.31 wants a Path

        config = _atomic(directory / runfiles.TIMM_CONFIG, write_config)
    except (TypeError, ValueError, RuntimeError) as err:
        log.warning("final model: no timm folder (%s): %s", architecture, err)
        return {"architecture": None, "why_not": f"timm {architecture} {model_args}: {err}"}
    weights = {k: v.detach().cpu().contiguous() for k, v in state.items()}  # no channels_last

    def write_weights(tmp: Path) -> None:
        save_file(weights, str(tmp), {"format": "pt"})

    return {
        "architecture": architecture,
        "files": {
            runfiles.TIMM_WEIGHTS: _atomic(directory / runfiles.TIMM_WEIGHTS, write_weights),
            runfiles.TIMM_CONFIG: config,
        },
    }


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def preprocessing(data_cfg: Any) -> dict[str, Any]:
    """A DataConfig's evaluation transform, as timm's pretrained_cfg names it."""
    return {"crop_pct": data_cfg.crop_pct, "interpolation": data_cfg.interpolation,
            "mean": list(data_cfg.mean), "std": list(data_cfg.std)}  # fmt: skip


def _meta_model(architecture: str, model_args: dict[str, Any]) -> torch.nn.Module:
    """The model timm builds from the config (no memory: save_config_for_hf reads only its
    pretrained_cfg, arguments and classifier)."""
    import timm

    with torch.device("meta"):
        return timm.create_model(architecture, pretrained=False, **model_args)


def _atomic(path: Path, write_to: Callable[[Path], Any]) -> dict[str, Any]:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_to(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return {"sha256": sha256_of(path), "bytes": path.stat().st_size}
