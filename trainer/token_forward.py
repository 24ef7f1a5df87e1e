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
    """Per-token class logits [B, C, H, W] of a VOLO (aux head) or ViT-style teacher."""
    if getattr(model, "aux_head", None) is not None:
        x = model.patch_embed(images).permute(0, 2, 3, 1)
        logits = model.aux_head(_final_tokens(model, x)[:, 1:])
    elif hasattr(model, "num_prefix_tokens") and hasattr(model, "head"):
        tokens = model.forward_features(images)[:, model.num_prefix_tokens :]
        logits = model.head(model.fc_norm(tokens))
    else:
        raise TokenLabelError(
            f"teacher {type(model).__name__} has no per-token classifier: use a VOLO (aux head) "
            "or a timm ViT-style model"
        )
    side = int(round(logits.shape[1] ** 0.5))
    if side * side != logits.shape[1]:
        raise TokenLabelError(f"teacher gives {logits.shape[1]} tokens, not a square grid")
    return logits.transpose(1, 2).reshape(len(images), -1, side, side)


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
