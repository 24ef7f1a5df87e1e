"""VOLO's token-labeling loss: class, class-token and per-token soft targets."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitpod.trainer.data.token_label import TokenLabelError


class TokenLabelCriterion(nn.Module):
    """VOLO's token-labeling loss: soft CE on the class token + 0.5 x soft CE on every token.

    `output` is `forward_train`'s (class logits, token logits, bbox) or plain logits;
    `target` is the loader's [B, 2 + N, C] tensor or plain class indices.
    """

    def __init__(
        self, ground_truth: bool = False, dense_weight: float = 0.5, cls_weight: float = 1.0
    ):
        super().__init__()
        self.ground_truth, self.dense_weight, self.cls_weight = (
            ground_truth,
            dense_weight,
            cls_weight,
        )

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        cls_logits, token_logits, bbox = _unpack(output)
        classes = cls_logits.shape[-1]
        if target.dim() == 1:  # plain labels: every token gets the image label
            target = F.one_hot(target, classes).float()[:, None].expand(-1, 2, -1)
        cls_target = target[:, 0] if self.ground_truth else target[:, 1]
        if token_logits is not None:
            h0, w0, h1, w1 = bbox
            lam = 1.0 - (h1 - h0) * (w1 - w0) / token_logits.shape[1]
            if lam < 1.0:
                cls_target = lam * cls_target + (1.0 - lam) * cls_target.flip(0)
        loss = self.cls_weight * _soft_ce(cls_logits, cls_target)
        if token_logits is None:
            return loss
        token_target = target[:, 2:]
        if token_target.shape[1] == 0:
            token_target = target[:, :1].expand(-1, token_logits.shape[1], -1)
        if token_target.shape[1] != token_logits.shape[1]:
            raise TokenLabelError(
                f"token labels have {token_target.shape[1]} tokens, the model gives "
                f"{token_logits.shape[1]}: set --token-label-size "
                f"{int(token_logits.shape[1] ** 0.5)}"
            )
        return loss + self.dense_weight * _soft_ce(
            token_logits.reshape(-1, classes), token_target.reshape(-1, classes)
        )


def _unpack(output: Any) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    if isinstance(output, torch.Tensor):
        return output, None, (0, 0, 0, 0)
    cls_logits, token_logits, *rest = output
    if cls_logits.shape[-1] != token_logits.shape[-1]:
        raise TokenLabelError(
            f"class output has {cls_logits.shape[-1]} features but token logits have "
            f"{token_logits.shape[-1]} classes: timm's VOLO.forward_train skips the head; "
            "use vitpod.trainer.tokenlabels.token_forward.forward_train(model, images)"
        )
    return cls_logits, token_logits, tuple(rest[0]) if rest else (0, 0, 0, 0)


def _soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
