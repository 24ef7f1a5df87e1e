"""Seeds of the global generators (per run, per step) and their state for checkpoints."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reseed_for_step(seed: int, rank: int, step: int, micro: int) -> None:
    """Model randomness (drop path, MixToken) as a pure function of (seed, rank, step).

    A resumed loader may draw from the global RNG when it starts (torch's DataLoader takes
    a base seed from it), which an uninterrupted run does not; reseeding after each fetch keeps
    that one draw from shifting every later drop-path mask.
    """
    mixed = ((seed * 1_000_003 + rank) * 1_000_003 + step) * 101 + micro
    mixed %= 2**32
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy_state() -> tuple[Any, ...]:
    """numpy's generator state with its key array as a tensor, so a checkpoint loads with
    torch.load(weights_only=True): no numpy object is unpickled."""
    name, keys, *rest = np.random.get_state(legacy=True)
    return (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), *rest)
