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

import math

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global sample order, identical on every rank."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


def repeated_order(
    num_samples: int, seed: int, epoch: int, repeats: float, world_size: int, batch_size: int,
    accum: int = 1,
) -> np.ndarray:  # fmt: skip
    """timm's RepeatAugSampler (--aug-repeats; Hoffer et al. 2020, DeiT) as a global order cut by
    rank_batches: the epoch's permutation with each sample `repeats` times in a row (a fraction
    as timm resamples it: ceil(repeats x N) entries, entry i the permutation's i // repeats), dealt
    round-robin to the ranks (rank r reads repeated[r::W], so a sample's copies go to different
    ranks and get different augmentations), each rank keeping timm's share, num_samples // 256 *
    256 / W (all samples, / W, for a set under 256), rounded down to whole optimizer steps here
    so the order has no partial step. A function of (seed, epoch, W, B, A): resuming at a
    consumed-sample count reads the same samples as the run that was not stopped."""
    entries = np.arange(math.ceil(repeats * num_samples)) // repeats  # whole: np.repeat's
    repeated = epoch_order(num_samples, seed, epoch, shuffle=True)[entries.astype(np.int64)]
    per_rank = -(-len(repeated) // world_size)
    streams = np.resize(repeated, per_rank * world_size).reshape(-1, world_size).T  # wrap-pad
    kept = num_samples // 256 * 256 // world_size or -(-num_samples // world_size)
    kept = min(kept, per_rank) // (batch_size * accum) * (batch_size * accum)
    # step-major, as rank_batches reads it: micro-step s, rank r -> streams[r, s*B:(s+1)*B]
    return streams[:, :kept].reshape(world_size, -1, batch_size).transpose(1, 0, 2).reshape(-1)


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
