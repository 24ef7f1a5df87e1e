"""--log-sample-ids: a hash of each optimizer step's global sample ids, the same on every rank."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


class StepSamples:
    """Collects the sample ids of one optimizer step on this rank; `digest()` is collective."""

    def __init__(self, data_rank: int) -> None:
        self.data_rank = data_rank
        self.ids: list[int] = []
        self.sizes: list[int] = []
        self.loss_sum = 0.0

    def add(self, indices: torch.Tensor, loss: torch.Tensor | None) -> None:
        """A loader batch's ids and mean loss (None: the loss comes later, see `add_losses`)."""
        self.ids.extend(int(i) for i in indices.tolist())
        self.sizes.append(len(indices))
        if loss is not None:  # a micro-batch's mean loss, weighted by its samples
            self.loss_sum += float(loss.detach()) * len(indices)

    def add_losses(self, losses: torch.Tensor) -> None:
        """The mean losses of the last len(losses) batches, known only once all ran (--pp)."""
        sizes = self.sizes[-len(losses) :]
        self.loss_sum += sum(float(v) * n for v, n in zip(losses.tolist(), sizes, strict=True))

    def clear(self) -> None:
        self.ids, self.sizes, self.loss_sum = [], [], 0.0

    def digest(self) -> dict[str, Any]:
        """{"sample_digest", "global_loss"}, the same on every rank: the hash of the step's ids of
        every data-parallel rank, sorted, and the mean loss over all of them (comparable across
        world sizes, unlike a rank's own loss).

        Ranks of one model replica (tp x pp) read the same samples: they count once, while two
        data-parallel ranks reading one sample would show as a repeated id.
        """
        mine: Any = (self.data_rank, (self.ids, self.loss_sum))
        every: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(every, mine)
        self.clear()
        by_rank = dict(every)
        ids = [i for ids, _ in by_rank.values() for i in ids]
        loss = sum(part for _, part in by_rank.values()) / max(1, len(ids))
        return {"sample_digest": sample_digest(ids), "global_loss": loss}


def sample_digest(ids: list[int]) -> str:
    """sha256 (first 16 hex digits) of the sorted ids, repeats kept."""
    text = ",".join(map(str, sorted(ids)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
