"""Token-label maps shared by both readers (vitpod's store and TokenLabeling's published files):
the error they raise, and the cut of an image's crop box out of a dense score map."""

from __future__ import annotations

import torch
from torchvision.ops import roi_align

from vitpod.trainer.data.sources import DataSourceError


class TokenLabelError(DataSourceError):
    """Token-label data is missing, incomplete or does not fit the run; the message says how."""


def crop_scores(
    dense: torch.Tensor,
    box: tuple[float, float, float, float],
    size: int,
    flipped: bool,
    softmax: bool = False,
) -> torch.Tensor:
    """Cut box (x0, y0, x1, y1 in fractions) out of dense [C, H, W] (any H x W) onto a
    size x size grid: [size*size, C], rows sum 1: normalized probabilities, or with `softmax`
    (scores that are logits, as TokenLabeling publishes them) their softmax over the classes."""
    _, height, width = dense.shape
    x0, y0, x1, y1 = box
    roi = torch.tensor([[0, x0 * width, y0 * height, x1 * width, y1 * height]], dtype=dense.dtype)
    crop = roi_align(dense[None], roi, output_size=size, spatial_scale=1.0, aligned=True)[0]
    if flipped:
        crop = crop.flip(-1)
    tokens = crop.flatten(1).T
    if softmax:
        return tokens.softmax(1)
    return tokens / tokens.sum(1, keepdim=True).clamp_min(1e-8)
