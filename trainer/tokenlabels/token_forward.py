"""VOLO's MixToken training forward and a teacher's per-token class logits."""

from __future__ import annotations

from typing import Any

import torch

from vitpod.trainer.data.token_label import TokenLabelError


def forward_train(
    model: Any, images: torch.Tensor, mix_token: bool = True, beta: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """VOLO's training forward with MixToken: (class logits [B,C], token logits [B,N,C], bbox).

    timm's `VOLO.forward_train` returns the pooled features instead of class logits (its head
    is not applied), so the trainer calls this. The bbox is on the final token grid; the token
    logits inside it are already swapped back, so only the class target needs mixing.
    """
    from timm.models.volo import rand_bbox

    x = model.patch_embed(images).permute(0, 2, 3, 1)  # B,H,W,C
    bbox = (0, 0, 0, 0)
    scale = model.pooling_scale
    grid_h, grid_w = x.shape[1] // scale, x.shape[2] // scale
    if mix_token and model.training:
        lam: Any = torch.distributions.Beta(beta, beta).sample()  # rand_bbox takes a tensor
        bbox = rand_bbox(x.size(), lam, scale=scale)
        x = _swap_box(x, [c * scale for c in bbox])
    tokens = _final_tokens(model, x)
    cls_logits = model.head(model.head_drop(tokens[:, 0]))
    aux = model.aux_head(tokens[:, 1:]).reshape(len(images), grid_h, grid_w, -1)
    if bbox != (0, 0, 0, 0):
        aux = _swap_box(aux, list(bbox))
    return cls_logits, aux.reshape(len(images), grid_h * grid_w, -1), bbox


def dense_logits(model: Any, images: torch.Tensor) -> torch.Tensor:
    """Per-location class logits [B, C, H, W] of any timm classifier: the classifier applied at
    every location of the final feature map, as TokenLabeling's generate_label.py does.

    VOLO: its aux head on the final tokens. ViT-like models (tokens [B, N, D]): the prefix
    (class/register) tokens dropped, then fc_norm and the head on every token. CNNs (NFNet,
    ResNet, ...: `forward_features` gives [B, D, H, W]): the model's own head on each location
    as a 1x1 map, which is its classifier as a 1x1 convolution (global pooling of one location
    is that location; a head's norm, if any, is applied per location too).
    """
    if getattr(model, "aux_head", None) is not None:
        x = model.patch_embed(images).permute(0, 2, 3, 1)
        logits = model.aux_head(_final_tokens(model, x)[:, 1:])
        return _square(logits, len(images))
    if not hasattr(model, "forward_features"):
        raise TokenLabelError(
            f"teacher {type(model).__name__} has no forward_features: use a timm classifier "
            "(VOLO, ViT-like, or a CNN such as NFNet or ResNet)"
        )
    features = model.forward_features(images)
    if features.ndim == 3:  # tokens
        prefix = int(getattr(model, "num_prefix_tokens", 0))
        side = int(round((features.shape[1] - prefix) ** 0.5))
        if prefix == 0 and side * side != features.shape[1]:
            prefix = 1 if int((features.shape[1] - 1) ** 0.5) ** 2 == features.shape[1] - 1 else 0
        tokens = features[:, prefix:]
        norm = getattr(model, "fc_norm", None) or (lambda t: t)
        return _square(model.get_classifier()(norm(tokens)), len(images))
    if features.ndim != 4:
        raise TokenLabelError(
            f"teacher {type(model).__name__}: forward_features gives shape "
            f"{list(features.shape)}, not tokens [B, N, D] or a feature map [B, D, H, W]"
        )
    if getattr(model, "output_fmt", "NCHW") == "NHWC":
        features = features.permute(0, 3, 1, 2)
    batch, dim, height, width = features.shape
    cells = features.permute(0, 2, 3, 1).reshape(batch * height * width, dim, 1, 1)
    logits = model.forward_head(cells) if hasattr(model, "forward_head") else None
    if logits is None or logits.ndim != 2:
        raise TokenLabelError(
            f"teacher {type(model).__name__}: its head does not give class logits per "
            "location; use a timm classifier with forward_head"
        )
    return logits.reshape(batch, height, width, -1).permute(0, 3, 1, 2)


def _square(logits: torch.Tensor, batch: int) -> torch.Tensor:
    """Token logits [B, N, C] -> [B, C, side, side]."""
    side = int(round(logits.shape[1] ** 0.5))
    if side * side != logits.shape[1]:
        raise TokenLabelError(f"teacher gives {logits.shape[1]} tokens, not a square grid")
    return logits.transpose(1, 2).reshape(batch, -1, side, side)


def _final_tokens(model: Any, x: torch.Tensor) -> torch.Tensor:
    x = model.forward_tokens(x)
    if model.post_network is not None:
        x = model.forward_cls(x)
    return model.norm(x)


def _swap_box(x: torch.Tensor, box: list[int]) -> torch.Tensor:
    """Replace box [h0, w0, h1, w1] of each sample by that of the batch reversed (MixToken)."""
    h0, w0, h1, w1 = box
    mixed = x.clone()
    mixed[:, h0:h1, w0:w1, :] = x.flip(0)[:, h0:h1, w0:w1, :]
    return mixed
