"""Elastic resume: the rules for continuing a run on another world size (same global batch).

A run continues on W' ranks where it stopped on W when its global batch G = W x B x A stays
the same: the planner (or --elastic at run time) picks the accumulation A' = G / (W' x B).
Then the LR (scaled by G), the steps per epoch, the schedule's position and the samples of
every optimizer step (sharding.py: step k reads order[k*G:(k+1)*G]) are those of the run
never stopped. DDP's model and optimizer are replicated (rank 0's file holds them); the mesh
engine's are read through DCP, which reshards on load; DeepSpeed's ZeRO-1/2/3 partitions are
converted to its universal checkpoint and loaded from that (ds_universal.py; measured: losses
and final weights within 1.2e-7 of the run never stopped).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from vitpod.trainer.checkpointing import ds_universal

log = logging.getLogger(__name__)


class ElasticError(ValueError):
    """The global batch cannot be split over this world size."""


def accumulation_for(global_batch: int, dp: int, batch_size: int) -> int:
    """A = G / (dp x B), or ElasticError naming the data-parallel sizes that split G."""
    if global_batch % (dp * batch_size) == 0:
        return global_batch // (dp * batch_size)
    return _refuse_split(global_batch, dp, batch_size)


def _refuse_split(global_batch: int, dp: int, batch_size: int) -> int:
    fits = splits(global_batch, batch_size)
    raise ElasticError(
        f"global batch {global_batch} does not split over {dp} data-parallel rank(s) x -b "
        f"{batch_size} x an integer accumulation; data-parallel sizes that work: "
        f"{', '.join(map(str, fits)) or 'none (-b does not divide it)'}"
    )


def splits(global_batch: int, batch_size: int) -> list[int]:
    """Data-parallel sizes dp with G = dp x B x A for an integer A."""
    if global_batch % batch_size:
        return []
    per_rank = global_batch // batch_size
    return [d for d in range(1, per_rank + 1) if per_rank % d == 0]


@dataclasses.dataclass(frozen=True)
class Resize:
    """What this job brings to a checkpoint written by another world size."""

    global_batch: int
    engine: str

    def refusal(self, directory: Path, saved: int, now: int) -> str | None:
        """Why `directory` (written by `saved` ranks) may not continue on `now` ranks, or None."""
        if self.engine == "deepspeed" and (reason := ds_universal.refusal(directory, saved, now)):
            return reason
        written = saved_global_batch(directory)
        if written == self.global_batch:
            return None
        return (
            f"checkpoint {directory} was written by {saved} ranks with global batch "
            f"{written or 'unrecorded'}, this job has {now} ranks and global batch "
            f"{self.global_batch}: keep the global batch (--global-batch {written} --elastic, "
            "or `vitpod resume`, which re-plans the accumulation), or resume on "
            f"{saved} ranks"
        )


def saved_global_batch(directory: Path) -> int | None:
    try:
        value = json.loads((directory / "rank0.json").read_text()).get("global_batch")
    except (OSError, ValueError):
        return None
    return int(value) if value is not None else None


def position_fits(loader_state: dict[str, Any], global_batch: int) -> bool:
    """Whether a loader position (global samples consumed) falls on an optimizer step of G."""
    done, total = int(loader_state["samples_done"]), int(loader_state["num_samples"])
    return done % global_batch == 0 or done >= total


def restore_position(loader: Any, own: dict[str, Any], global_batch: int) -> None:
    """Give `loader` the checkpoint's position (global samples consumed): it carries over to
    another world size when it falls on an optimizer step of this job's global batch. At an
    epoch's end the next epoch starts from its first batch."""
    if own["epoch_end"]:
        return
    if position_fits(own["loader"], global_batch):
        loader.load_state_dict(own["loader"])
        return
    log.warning("loader position %s is no optimizer step of global batch %d: epoch %d restarts "
                "from its first batch", own["loader"]["samples_done"], global_batch,
                own["epoch"])  # fmt: skip
