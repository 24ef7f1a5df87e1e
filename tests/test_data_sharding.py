"""The per-rank batch plan: exactly once per epoch, equal training steps, resumable offsets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vitpod.trainer.data.sharding import epoch_order, rank_batches, samples_after

CASES = list(itertools.product([1, 2, 3, 4, 7, 8, 50, 97, 100, 101], [1, 2, 3, 4], [1, 3, 8]))


def _plan(n: int, world: int, batch: int, train: bool, **kw) -> list[list[np.ndarray]]:
    order = epoch_order(n, seed=3, epoch=1, shuffle=train)
    return [rank_batches(order, r, world, batch, train=train, **kw) for r in range(world)]


@pytest.mark.parametrize("n,world,batch", CASES)
def test_validation_plan_reads_every_sample_exactly_once(n, world, batch):
    plans = _plan(n, world, batch, train=False)
    seen = np.concatenate([b for plan in plans for b in plan]) if n else np.empty(0)
    assert sorted(seen.tolist()) == list(range(n))
    assert all(0 < len(b) <= batch for plan in plans for b in plan)


@pytest.mark.parametrize("n,world,batch", [c for c in CASES if c[0] >= c[1]])
def test_training_plan_has_equal_steps_and_drops_only_a_tiny_tail(n, world, batch):
    plans = _plan(n, world, batch, train=True)
    assert len({len(plan) for plan in plans}) == 1, "ranks must take the same number of steps"
    seen = np.concatenate([b for plan in plans for b in plan])
    assert len(set(seen.tolist())) == len(seen), "a sample was read twice"
    tail = n % (world * batch)
    dropped = tail if 0 < tail < world else 0
    assert len(seen) == n - dropped
    assert all(0 < len(b) <= batch for plan in plans for b in plan)


def test_drop_last_keeps_only_full_global_batches():
    plans = _plan(101, 2, 8, train=True, drop_last=True)
    assert all(len(b) == 8 for plan in plans for b in plan)
    assert sum(len(b) for plan in plans for b in plan) == 96


def test_epoch_order_is_deterministic_and_differs_between_epochs():
    a, b = epoch_order(50, 7, 0, True), epoch_order(50, 7, 0, True)
    assert (a == b).all() and sorted(a.tolist()) == list(range(50))
    assert not (a == epoch_order(50, 7, 1, True)).all()
    assert (epoch_order(5, 7, 3, False) == np.arange(5)).all()


@pytest.mark.parametrize("world,new_world,new_batch", [(2, 2, 4), (2, 3, 4), (3, 1, 5)])
def test_resuming_from_the_consumed_count_continues_exactly(world, new_world, new_batch):
    n, batch, steps_done = 101, 4, 5
    order = epoch_order(n, seed=1, epoch=2, shuffle=False)
    first = [rank_batches(order, r, world, batch, train=False)[:steps_done] for r in range(world)]
    done = samples_after(steps_done, world, batch, n)
    rest = [
        rank_batches(order[done:], r, new_world, new_batch, train=False) for r in range(new_world)
    ]
    seen = [int(i) for plan in first + rest for b in plan for i in b]
    assert sorted(seen) == list(range(n))


def test_a_rank_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match="rank=2 is outside world_size=2"):
        rank_batches(np.arange(4), 2, 2, 1, train=False)
