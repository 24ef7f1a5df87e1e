"""The interface every gradient engine (ring, ps, deepspeed, mesh) gives the train loop."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class Engine(Protocol):
    """Forward, backward, step and checkpoint state of one wrapped model."""

    model: nn.Module
    optimizer: Any  # a torch optimizer, or DeepSpeed's wrapper around one
    accum_steps: int
    batch_losses: torch.Tensor  # --pp: the last step's loss per loader batch
    # Files of a step directory that the engine's own writer finishes after this rank's save
    # returns (an async sharded save): a checkpoint is committed only once they exist.
    sharded_files: tuple[str, ...]

    @property
    def name(self) -> str:
        """The engine as plan.json and the summary name it: ring | ps | deepspeed | fsdp | mesh."""
        ...

    @property
    def pipelined(self) -> bool:
        """True when the step runs through `pipeline_micro` instead of forward/backward."""
        ...

    @property
    def counts_eval(self) -> bool:
        """Whether this rank adds its evaluation samples to the totals."""
        ...

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager: ...
    def forward(self, images: torch.Tensor) -> Any: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def pipeline_micro(self, images: torch.Tensor, targets: Any, last: bool) -> torch.Tensor: ...
    def discard_partial(self) -> None: ...
    def step(self) -> None: ...
    def comm_seconds(self) -> float: ...
    def eval_forward(self, images: torch.Tensor) -> torch.Tensor | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def save_sharded(self, directory: Path) -> None: ...
    def wait_sharded(self) -> None: ...
    def load_sharded(self, directory: Path) -> None: ...
    def full_state_dict(self) -> dict[str, torch.Tensor] | None: ...


def token_label_forward(model: nn.Module, images: torch.Tensor) -> Any:
    """VOLO with MixToken: (class logits, token logits, bbox) for TokenLabelCriterion."""
    from vitpod.trainer.tokenlabels.token_forward import forward_train

    return forward_train(model, images)


class NotPipelined:
    """The pipeline calls of an engine that runs whole models (ring, ps, deepspeed)."""

    sharded_files: tuple[str, ...] = ()  # their saves are written when save_sharded returns

    pipelined = False
    batch_losses = torch.zeros(0)

    def pipeline_micro(self, images: torch.Tensor, targets: Any, last: bool) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no pipeline schedule")

    def discard_partial(self) -> None:
        pass
