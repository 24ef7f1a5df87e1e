"""One pass over the validation split: loss, top-1 and top-5, summed on the device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vitpod.trainer.engines.engine import Engine
from vitpod.trainer.telemetry.metrics import topk_counts


@torch.no_grad()
def evaluate(engine: Engine, loader: Iterable[Any], precision: Any, device: torch.device) -> dict:
    """Every rank's share of the val split, reduced over ranks: {top1, top5, loss}."""
    model = engine.model
    model.eval()
    dtype = next(model.parameters()).dtype
    # Summed on the device: one host sync for the whole pass, not one per batch.
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, n
    for images, targets in loader:
        with precision.autocast():
            out = engine.eval_forward(precision.prepare_input(images).to(dtype))
        if out is None or not engine.counts_eval:
            continue
        logits = out.float()
        targets = targets.to(device)
        loss = nn.functional.cross_entropy(logits, targets, reduction="sum")
        counts = topk_counts(logits, targets)
        totals += torch.stack([loss.double(), *counts.double(), totals.new_tensor(len(targets))])
    dist.all_reduce(totals)
    loss_sum, top1, top5, count = totals.tolist()
    count = max(count, 1.0)
    model.train()
    return {"top1": 100 * top1 / count, "top5": 100 * top5 / count, "loss": loss_sum / count}
