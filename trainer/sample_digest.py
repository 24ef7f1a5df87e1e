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

    def add(self, indices: torch.Tensor) -> None:
        self.ids.extend(int(i) for i in indices.tolist())

    def digest(self) -> str:
        """The same hash on every rank: the step's ids of every data-parallel rank, sorted.

        Ranks of one model replica (tp x pp) read the same samples: they count once, while two
        data-parallel ranks reading one sample would show as a repeated id.
        """
        mine: Any = (self.data_rank, self.ids)
        every: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(every, mine)
        self.ids = []
        by_rank = dict(every)
        return sample_digest([i for ids in by_rank.values() for i in ids])


def sample_digest(ids: list[int]) -> str:
    """sha256 (first 16 hex digits) of the sorted ids, repeats kept."""
    text = ",".join(map(str, sorted(ids)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
