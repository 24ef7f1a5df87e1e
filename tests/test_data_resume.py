"""Exact loader resume: every random augmentation decision is a pure function of
(seed, epoch, sample index), so a loader rebuilt mid-epoch (a requeued job) gives the same
batches, bit for bit, as one that never stopped; on DALI as on torch."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures_data import data_config
from vitpod.trainer.data import create_loader
from vitpod.trainer.data.draws import crop_window, draw, sample_rng

DRAW_ARGS = dict(scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5, layers=2, num_ops=14,
                 reprob=0.25)  # fmt: skip


def test_draws_are_a_pure_function_of_seed_epoch_and_index() -> None:
    first = draw(5, 1, 77, (40, 30), **DRAW_ARGS)
    np.random.seed(0)  # global RNG state plays no part
    torch.manual_seed(1)
    assert draw(5, 1, 77, (40, 30), **DRAW_ARGS) == first
    others = [draw(5, 2, 77, (40, 30), **DRAW_ARGS), draw(5, 1, 78, (40, 30), **DRAW_ARGS),
              draw(6, 1, 77, (40, 30), **DRAW_ARGS)]  # fmt: skip
    assert all(o != first for o in others)


@pytest.mark.parametrize("size", [(32, 32), (500, 60), (7, 300)])
def test_crop_windows_stay_inside_the_image(size: tuple[int, int]) -> None:
    width, height = size
    for index in range(300):
        x, y, w, h = crop_window(sample_rng(0, 0, index), width, height, (0.08, 1.0), (0.75, 4 / 3))
        assert 0 <= x and 0 <= y and 0 < w and 0 < h and x + w <= width and y + h <= height


RANDOM = {"batch_size": 16, "workers": 1, "seed": 5, "auto_augment": "rand-m9-mstd0.5-inc1",
          "reprob": 0.5, "hflip": 0.5, "scale": (0.08, 1.0)}  # fmt: skip
"""Every random augmentation of the recipe on: what a resumed loader must draw again."""


def _batches(loader, epoch: int, count: int, state=None) -> list[torch.Tensor]:
    loader.set_epoch(epoch)
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for images, _ in loader:
        out.append(images.clone())
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("loader", ["dali", "torch"])
def test_a_loader_rebuilt_mid_epoch_continues_bit_for_bit(digits_dir: Path, loader: str) -> None:
    """Rank 1 of 4 in epoch 1; the resumed loader is a new object, as after a requeue (a new
    DALI pipeline whose own RNG would restart; DALI had prefetched batches the first one never
    gave out)."""
    cfg = data_config(digits_dir, RANDOM, loader=loader)
    straight = _batches(create_loader(cfg, "train", 1, 4), epoch=1, count=9)
    first = create_loader(cfg, "train", 1, 4)
    assert len(_batches(first, epoch=1, count=4)) == 4
    state = first.state_dict()
    resumed = _batches(create_loader(cfg, "train", 1, 4), epoch=1, count=5, state=state)
    assert all(torch.equal(a, b) for a, b in zip(straight[4:], resumed, strict=True))
    # The augmentation really is random: another epoch crops the same samples differently.
    again = _batches(create_loader(cfg, "train", 1, 4), epoch=2, count=1)
    assert not torch.equal(again[0], straight[0])


def test_dali_applies_the_host_drawn_flip(digits_dir: Path) -> None:
    """The flip decision is drawn after the crop window from the same per-sample stream, so
    hflip=1 and hflip=0 crop alike and differ only by the mirror: the draws reach DALI."""
    flips = [data_config(digits_dir, RANDOM, loader="dali", auto_augment=None, reprob=0.0,
                         hflip=p) for p in (0.0, 1.0)]  # fmt: skip
    never, always = (_batches(create_loader(c, "train", 0, 2), epoch=0, count=2) for c in flips)
    for a, b in zip(never, always, strict=True):
        assert torch.equal(a.flip(-1), b)
