"""Run a teacher over a training split and store its top-k per-token class scores."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from vitpod.trainer.checkpointing.torchsave import atomic_torch_save
from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.sources import Split, folder_split
from vitpod.trainer.data.token_label import FORMAT, TokenLabelError
from vitpod.trainer.data.transforms import eval_transform
from vitpod.trainer.tokenlabels.token_forward import dense_logits


@torch.no_grad()
def generate_token_labels(
    model_or_checkpoint: nn.Module | str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    img_size: int,
    topk: int = 5,
    batch_size: int = 64,
) -> Path:
    """Run the teacher over `data_dir/train` and write its top-k token scores to `out_path`.

    The teacher is a module (a path is refused: see `_load_teacher`). The file is written
    under a temporary name, fsynced and renamed, so readers never see a partial one.
    """
    teacher = _load_teacher(model_or_checkpoint).eval()
    split = folder_split(Path(data_dir), "train")
    if len(split.classes) != _teacher_classes(teacher):
        raise TokenLabelError(
            f"teacher predicts {_teacher_classes(teacher)} classes, {data_dir} has "
            f"{len(split.classes)}: use a teacher trained on these classes"
        )
    transform = eval_transform(DataConfig(data_dir=str(data_dir), img_size=img_size, crop_pct=1.0))
    values, indices = [], []
    for images in image_batches(split, transform, batch_size):
        probs = dense_logits(teacher, images).float().softmax(dim=1)
        top = probs.topk(min(topk, probs.shape[1]), dim=1)
        values.append(top.values.half())
        indices.append(top.indices.to(torch.int16 if probs.shape[1] < 2**15 else torch.int32))
    data = {
        "format": FORMAT,
        "num_classes": len(split.classes),
        "classes": split.classes,
        "img_size": img_size,
        "index": {split.relpath(i): i for i in range(len(split))},
        "values": torch.cat(values),
        "indices": torch.cat(indices),
    }
    atomic_torch_save(data, Path(out_path))
    return Path(out_path)


def _load_teacher(model_or_checkpoint: nn.Module | str | os.PathLike[str]) -> nn.Module:
    """The teacher module. A file is never unpickled as code (weights_only): a whole pickled
    module cannot be loaded safely, so a path must come through `make token-labels TEACHER=`
    (a run directory or a state dict with its model name) instead."""
    if isinstance(model_or_checkpoint, nn.Module):
        return model_or_checkpoint
    try:
        loaded = torch.load(model_or_checkpoint, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise TokenLabelError(
            f"{model_or_checkpoint}: not loadable as weights only ({str(exc).splitlines()[0]}); a "
            "file written by torch.save(model) holds code and is not unpickled: pass the module "
            "itself, or the teacher's run directory to make token-labels TEACHER=..."
        ) from exc
    raise TokenLabelError(
        f"{model_or_checkpoint} holds a {type(loaded).__name__}, not a model: pass the teacher "
        "module, or its run directory to make token-labels TEACHER=..."
    )


def _teacher_classes(model: Any) -> int:
    if getattr(model, "num_classes", None):
        return int(model.num_classes)
    head = getattr(model, "aux_head", None) or model.head
    return int(head.out_features)


def build_teacher(name: str, img_size: int, num_classes: int) -> nn.Module:
    """Any timm classifier as a labeling teacher, built without weights (nothing is
    downloaded): vitpod's models (VOLO, ViT) at img_size, any other timm model (a CNN such as
    dm_nfnet_f6 or resnet50) as timm builds it, labeling through `dense_logits`."""
    import timm

    from vitpod.trainer.model.models import create_model
    from vitpod.trainer.settings.checks import known_model

    if known_model(name):
        return create_model(name, img_size, num_classes, 0.0)
    if not timm.is_model(name):
        raise TokenLabelError(
            f"teacher model {name!r}: not a timm model; name a timm classifier (volo_d5_224, "
            "vit_base_patch16_224, dm_nfnet_f6, resnet50, ...) or a vitpod run directory"
        )
    kwargs: dict[str, Any] = {"pretrained": False, "num_classes": num_classes}
    try:
        return timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError:  # CNNs take any input size and have no img_size argument
        return timm.create_model(name, **kwargs)


def image_batches(split: Split, transform: Any, batch_size: int) -> Iterator[torch.Tensor]:
    assert split.files is not None
    for start in range(0, len(split), batch_size):
        images = []
        for path in split.files[start : start + batch_size]:
            with Image.open(path) as img:
                images.append(transform(img.convert("RGB")))
        yield torch.stack(images)
