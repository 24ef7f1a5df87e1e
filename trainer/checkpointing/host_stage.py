"""Host copies of (possibly GPU) training state in reused buffers, for background saving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class HostStager:
    """Copies (possibly GPU) state into reused host buffers (no page faults on fresh memory)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, obj: Any, only: Callable[[torch.Tensor], bool] | None = None,
              path: tuple = ()) -> Any:  # fmt: skip
        """A copy of `obj` whose tensors live in the host buffers (with `only`: just those)."""
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, path) if only is None or only(obj) else obj
        if isinstance(obj, dict):
            return {k: self.stage(v, only, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.stage(v, only, (*path, i)) for i, v in enumerate(obj))
        return obj

    def _copy(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is tensor:  # staged already (by an earlier `only` pass)
            return buf
        if (
            buf is None
            or buf.shape != tensor.shape
            or buf.dtype != tensor.dtype
            or (buf.stride() != tensor.stride())
        ):
            # The tensor's own layout (channels_last weights and their Adam moments): a resumed
            # run must see the state exactly as it was, strides included.
            buf = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            self.buffers[path] = buf
        return buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
