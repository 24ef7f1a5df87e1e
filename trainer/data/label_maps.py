"""Token-label maps shared by both readers (vitpod's store and TokenLabeling's published files)
and by every loader: the error they raise, and the cut of each image's crop box out of its
score map into the sample's target. The torch loader cuts one sample in its worker; the DALI and
gpu loaders cut a whole batch after decoding, on the images' device, with the same code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from vitpod.trainer.data.sources import DataSourceError

Box = tuple[float, float, float, float]


class TokenLabelError(DataSourceError):
    """Token-label data is missing, incomplete or does not fit the run; the message says how."""


class LabelMaps(Protocol):
    """What a label store gives the cut: per image its top-k scores and class indices."""

    num_classes: int
    size: int  # the model's token grid side, img_size / 16
    softmax: bool  # scores are logits (published) rather than probabilities (vitpod's)

    def maps(self, relpath: str) -> tuple[torch.Tensor, torch.Tensor]: ...


def cut_tokens(
    dense: torch.Tensor,
    boxes: torch.Tensor,
    size: int,
    flipped: torch.Tensor,
    softmax: bool = False,
) -> torch.Tensor:
    """Cut each boxes[b] = (x0, y0, x1, y1 in fractions) out of dense[b] ([B, C, H, W], any
    H x W) onto a size x size grid with RoIAlign, flip where flipped[b]: [B, size*size, C],
    rows sum 1: normalized probabilities, or with `softmax` (scores that are logits, as
    TokenLabeling publishes them) their softmax over the classes."""
    count, _, height, width = dense.shape
    scale = torch.tensor([width, height, width, height], dtype=torch.float64)
    rois = torch.cat(
        [torch.arange(count, dtype=torch.float64)[:, None], boxes.double().cpu() * scale], 1
    ).to(dense.dtype)
    crop = roi_align(dense, rois.to(dense.device), output_size=size, spatial_scale=1.0,
                     aligned=True)  # fmt: skip
    crop = torch.where(flipped.to(crop.device).view(-1, 1, 1, 1), crop.flip(-1), crop)
    tokens = crop.flatten(2).transpose(1, 2)
    if softmax:
        return tokens.softmax(-1)
    return tokens / tokens.sum(-1, keepdim=True).clamp_min(1e-8)


def crop_scores(
    dense: torch.Tensor, box: Box, size: int, flipped: bool, softmax: bool = False
) -> torch.Tensor:
    """One image's cut (`cut_tokens` of a batch of one): dense [C, H, W] -> [size*size, C]."""
    return cut_tokens(
        dense[None], torch.tensor([box], dtype=torch.float64), size, torch.tensor([flipped]),
        softmax,
    )[0]  # fmt: skip


def scatter(values: torch.Tensor, indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Top-k scores [..., k, H, W] into a zero map of every class [..., C, H, W]."""
    dense = values.new_zeros(*values.shape[:-3], num_classes, *values.shape[-2:])
    return dense.scatter_(-3, indices, values)


def with_class_rows(tokens: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, 2 + N, C]: the one-hot label, the class-token target (the tokens' mean), the tokens."""
    one_hot = F.one_hot(labels.to(tokens.device), num_classes).to(tokens.dtype)
    return torch.cat([one_hot[:, None], tokens.mean(1, keepdim=True), tokens], 1)


def targets(
    store: LabelMaps,
    relpaths: Sequence[str],
    labels: torch.Tensor,
    boxes: torch.Tensor,
    flipped: torch.Tensor,
    device: torch.device | str = "cpu",
    maps: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """The batch's targets [B, 2 + S*S, C] on `device`: each image's map (`maps`, read
    beforehand, or from the store now) cut with its own crop box and flip."""
    maps = maps if maps is not None else [store.maps(p) for p in relpaths]
    shapes = {tuple(values.shape) for values, _ in maps}
    if len(shapes) > 1:  # published files of several grids: cut each on its own
        return torch.cat([
            targets(store, [p], labels[i : i + 1], boxes[i : i + 1], flipped[i : i + 1], device,
                    [maps[i]])
            for i, p in enumerate(relpaths)
        ])  # fmt: skip
    values = torch.stack([v for v, _ in maps]).to(device, torch.float32)
    indices = torch.stack([i for _, i in maps]).to(device)
    dense = scatter(values, indices, store.num_classes)
    tokens = cut_tokens(dense, boxes, store.size, flipped, store.softmax)
    return with_class_rows(tokens, labels, store.num_classes)
