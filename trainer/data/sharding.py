"""Which samples each rank reads, batch by batch: one deterministic plan for both loaders.

An epoch's order is a permutation of the split drawn from (seed, epoch) (identity for
validation), whatever the world size. It is cut step-major: micro-step s holds
order[s*W*B:(s+1)*W*B] and rank r takes the r-th block of B; A micro-steps (accumulation)
make an optimizer step, so optimizer step k reads order[k*G:(k+1)*G] with G = W*B*A, the
global batch: the same samples on any W x A split of G (elastic resume). The last, partial
optimizer step of R samples is spread evenly over its W*A micro-batches (slot m*W + r for
micro-batch m of rank r), so every sample is read exactly once per epoch.
Training needs the same number of micro-batches on every rank (DDP): when 0 < R < W*A some
micro-batch would be empty, so those R samples are dropped that epoch (a different few each
epoch); `drop_last` drops the partial step always. Validation keeps everything (A = 1); a
rank may then have one batch fewer.
Resuming: the state counts global samples consumed, a multiple of G at every optimizer step
before the tail, so a run can resume mid-epoch, even with another world size (same G).
"""

from __future__ import annotations

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global sample order, identical on every rank."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


def rank_batches(
    order: np.ndarray,
    rank: int,
    world_size: int,
    batch_size: int,
    *,
    train: bool,
    drop_last: bool = False,
    accum: int = 1,
) -> list[np.ndarray]:
    """This rank's batches (arrays of sample indices) over `order`, per the module's rules."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    step = world_size * batch_size
    full_steps = len(order) // (step * accum) * accum
    batches = [
        order[s * step + rank * batch_size : s * step + (rank + 1) * batch_size]
        for s in range(full_steps)
    ]
    tail = order[full_steps * step :]
    slots = world_size * accum
    if len(tail) and not (train and (drop_last or len(tail) < slots)):
        for slot in range(rank, slots, world_size):
            start = slot * (len(tail) // slots) + min(slot, len(tail) % slots)
            count = len(tail) // slots + (slot < len(tail) % slots)
            if count:
                batches.append(tail[start : start + count])
    return batches


def samples_after(batches_done: int, world_size: int, batch_size: int, total: int) -> int:
    """Global samples consumed once every rank has taken `batches_done` batches."""
    return min(batches_done * world_size * batch_size, total)
