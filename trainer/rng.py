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
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
