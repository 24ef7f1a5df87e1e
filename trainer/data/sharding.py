"""Which samples each rank reads, batch by batch: one deterministic plan for both loaders.

An epoch's order is a permutation of the split drawn from (seed, epoch) (identity for
validation). It is cut step-major: global step s holds order[s*W*B:(s+1)*W*B] and rank r
takes the r-th block of B. The last, partial global step of R samples is spread evenly over
the ranks (R//W, plus one for the first R%W ranks), so every sample is read exactly once per
epoch.
Training needs the same number of steps on every rank (DDP): when 0 < R < W some rank would
get an empty batch, so those R samples are dropped that epoch (a different few each epoch);
`drop_last` drops the partial step always. Validation keeps everything; a rank may then
have one batch fewer.
Resuming: the state counts global samples consumed, always a multiple of W*B before the tail,
so a run can resume mid-epoch, even with another world size or batch size.
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
) -> list[np.ndarray]:
    """This rank's batches (arrays of sample indices) over `order`, per the module's rules."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    step = world_size * batch_size
    full_steps = len(order) // step
    batches = [
        order[s * step + rank * batch_size : s * step + (rank + 1) * batch_size]
        for s in range(full_steps)
    ]
    tail = order[full_steps * step :]
    if len(tail) and not (train and (drop_last or len(tail) < world_size)):
        start = rank * (len(tail) // world_size) + min(rank, len(tail) % world_size)
        count = len(tail) // world_size + (rank < len(tail) % world_size)
        if count:
            batches.append(tail[start : start + count])
    return batches


def samples_after(batches_done: int, world_size: int, batch_size: int, total: int) -> int:
    """Global samples consumed once every rank has taken `batches_done` batches."""
    return min(batches_done * world_size * batch_size, total)
