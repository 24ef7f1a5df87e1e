"""Sharded, asynchronous checkpoints with torch.distributed.checkpoint (DCP), across meshes.

Each rank writes only its shards; the metadata records every tensor's global shape, so a
checkpoint written at one (dp, tp, pp) loads into another: DCP reads the pieces each rank now
owns (https://pytorch.org/docs/stable/distributed.checkpoint.html). Loads go through safeload's
reader and planner: nothing is unpickled beyond DCP's metadata and plain values. Model and
optimizer state go through torch's `get_state_dict`/`set_state_dict`, which key optimizer
state by parameter name rather than position, so pipeline stages and shards find their own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from vitpod.trainer.checkpointing import safeload

log = logging.getLogger(__name__)
SUBDIR = "dcp"
METADATA = ".metadata"  # written last by DCP's coordinator: its presence means complete
# Optimizer hyperparameters keyed per parameter name too (param_groups.<fqn>.lr ...): a nested
# `param_groups` list is one object that DCP keeps from one rank only, so pipeline stages (whose
# groups hold other parameters) would load another stage's groups. torchtitan flattens likewise.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class AsyncSaver:
    """At most one DCP save in flight; `wait()` makes it durable."""

    def __init__(self) -> None:
        self._pending: Any = None
        # The background write coordinates over collectives of its own: on the training
        # group they would interleave with the next step's and deadlock; a separate gloo
        # group keeps them apart (as torchtitan does for its async checkpoints).
        group = dist.new_group(backend="gloo")
        self._group = group if isinstance(group, dist.ProcessGroup) else None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """Stage to host memory now (the optimizer may then step), write in the background."""
        self.wait()
        model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
        state = {"model": model_state, "optim": optim_state}
        result = dcp.async_save(
            state, checkpoint_id=str(directory / SUBDIR), process_group=self._group
        )
        # Newer DCP may return the staging and the upload as two futures: the host copy must be
        # finished before the parameters change, the upload only before the next save.
        staging = getattr(result, "staging_completion", None)
        if staging is not None:
            staging.result()
        self._pending = getattr(result, "upload_completion", result)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


def is_sharded_checkpoint(path: Path) -> bool:
    return (path / SUBDIR / METADATA).is_file()


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load a checkpoint written by `AsyncSaver` into this rank's (possibly other) layout."""
    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(
            f"--resume {directory}: no {SUBDIR}/{METADATA}; the checkpoint was written by another"
            " engine (DDP/DeepSpeed) or is incomplete: resume with the same flags"
            " or use a new run directory"
        )
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    safeload.load_dcp(state, directory / SUBDIR)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=FLAT,
    )


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's model state gathered to full tensors on the CPU (collective over the mesh)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    # cpu_offload=True would keep the result on global rank 0 only; each pipeline stage's
    # first rank needs its own stage's tensors.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}


def read_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a sharded checkpoint as full CPU tensors, read by this process alone
    (no collective: a fine-tune reads its pretrain checkpoint before any mesh exists)."""
    metadata = safeload.Reader(str(directory / SUBDIR)).read_metadata()
    state: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    safeload.load_dcp(state, directory / SUBDIR, no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}
