"""The per-rank Loader interface shared by the torch and DALI loaders: epochs, state, resume."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from vitpod.trainer.data.config import DataConfig
from vitpod.trainer.data.sharding import epoch_order, rank_batches, repeated_order, samples_after
from vitpod.trainer.data.sources import Split

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # images, targets, sample indices
log = logging.getLogger(__name__)


class CorruptImageError(RuntimeError):
    """An image file could not be decoded (DataConfig.corrupt='fail')."""


class Loader:
    """Iterable of (images [B,3,H,W] normalized, targets) for one rank; exactly once per epoch.

    Call `set_epoch(e)` before each epoch. `state_dict()` taken after consuming a batch and
    given to `load_state_dict()` of a new Loader makes it continue with the next batch.
    Subclasses implement `_iter_batches(batches)` yielding (images, targets, indices).
    """

    name = "base"
    token_labels: Any = None  # the training split's token-label store, or None

    def __init__(self, split: Split, cfg: DataConfig, rank: int, world_size: int, train: bool):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        if train and len(split) < world_size:
            raise ValueError(
                f"{split.name} split has {len(split)} samples, fewer than world_size={world_size}"
            )
        self.split, self.cfg, self.rank, self.world_size, self.train = (
            split, cfg, rank, world_size, train,
        )  # fmt: skip
        self.num_classes = len(split.classes)
        self.epoch = 0
        self._start = 0  # global samples of self.epoch consumed before this iteration
        self._done = 0  # global samples of self.epoch consumed so far
        self._passed = False  # this process iterated the whole epoch: a next pass starts over
        self._left: int | None = None  # this rank's batches of the pass not yet given out
        self.skipped: list[str] = []  # corrupt images dropped (corrupt='skip'), every time
        self.corrupt_files: set[str] = set()  # the distinct ones, each warned about once
        self.last_indices = torch.empty(0, dtype=torch.long)  # the latest batch's sample ids

    def __len__(self) -> int:
        return len(self._plan(0))

    @property
    def token_label_info(self) -> dict[str, Any] | None:
        """The token-label data this loader reads (layout, grid, k), or None."""
        return getattr(self.token_labels, "info", None)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._start, self._done = epoch, 0, 0
            self._passed, self._left = False, None

    def at_epoch_end(self) -> bool:
        """Whether the latest batch given out was this epoch's last (the same on every rank:
        training gives each as many batches)."""
        return self._left == 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "samples_done": self._done,
            "num_samples": len(self.split),
            "seed": self.cfg.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != len(self.split) or state["seed"] != self.cfg.seed:
            raise ValueError(
                f"loader state is for {state['num_samples']} samples and seed {state['seed']}, "
                f"this {self.split.name} split has {len(self.split)} and seed {self.cfg.seed}: "
                "resume with the same data and --seed"
            )
        self.epoch = int(state["epoch"])
        self._start = self._done = int(state["samples_done"])
        # A position at the epoch's end stays there: iterating it gives nothing (the trainer
        # then ends the epoch), not a second pass over the epoch.
        self._passed, self._left = False, None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self._passed:
            self._done = 0  # a new pass over the same epoch (validation, each evaluation)
        self._start = self._done
        batches = self._plan(self._start) if self._done < len(self.split) else []
        total = len(self.split)
        self._left = len(batches)
        for count, (images, targets, indices) in enumerate(
            self._iter_batches(batches) if batches else iter(()), 1
        ):
            self._done = self._start + samples_after(
                count, self.world_size, self.cfg.batch_size, total - self._start
            )
            self._left = max(0, len(batches) - count)
            self.last_indices = indices
            if self.cfg.return_index:
                yield images, targets, indices
            else:
                yield images, targets
        self._done, self._passed, self._left = total, True, 0

    def _skip_corrupt(self, paths: list[str]) -> None:
        """Drop undecodable files, warning once per file on this rank: a bad file comes back
        every epoch, and a warning each time would bury the rest of the log."""
        for path in paths:
            if path not in self.corrupt_files:
                self.corrupt_files.add(path)
                log.warning("skipping corrupt image %s (cannot decode; --corrupt skip)", path)
        self.skipped.extend(paths)

    def _plan(self, start: int) -> list[np.ndarray]:
        order = epoch_order(len(self.split), self.cfg.seed, self.epoch, shuffle=self.train)
        if self.train and self.cfg.aug_repeats:  # --aug-repeats: timm's RepeatAugSampler
            order = repeated_order(len(self.split), self.cfg.seed, self.epoch,
                                   self.cfg.aug_repeats, self.world_size, self.cfg.batch_size,
                                   self.cfg.accum_steps)  # fmt: skip
        return rank_batches(
            order[start:],
            self.rank,
            self.world_size,
            self.cfg.batch_size,
            train=self.train,
            drop_last=self.cfg.drop_last,
            accum=self.cfg.accum_steps if self.train else 1,
        )

    def _iter_batches(self, batches: list[np.ndarray]) -> Iterator[Batch]:
        raise NotImplementedError
