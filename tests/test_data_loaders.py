"""Both loaders on the real digits JPEGs: exactly once per epoch across ranks, labels, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures_data import data_config
from vitpod.trainer.data import DataConfig, create_loader

LOADERS = ["torch", "dali"]


INDEXED = {"workers": 1, "return_index": True}


def _epoch(loader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return list(loader)


def _check_labels(loader, batches) -> None:
    """Targets must be the class folder of the file each index names, not just any label."""
    files = loader.split.files
    for _, targets, indices in batches:
        assert targets.dtype == torch.long
        folders = [int(Path(files[i]).parent.name) for i in indices.tolist()]
        assert targets.tolist() == folders


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("split,world", [("train", 2), ("train", 3), ("val", 3)])
def test_every_sample_is_seen_exactly_once_per_epoch_across_ranks(digits_dir, kind, split, world):
    cfg = data_config(digits_dir, INDEXED, loader=kind, batch_size=48)
    loaders = [create_loader(cfg, split, r, world) for r in range(world)]
    assert type(loaders[0]).name == kind
    for epoch in (0, 1):
        per_rank = [_epoch(loader, epoch) for loader in loaders]
        assert [len(batches) for batches in per_rank] == [len(loader) for loader in loaders]
        seen = torch.cat([b[2] for batches in per_rank for b in batches]).tolist()
        total = len(loaders[0].split)
        tail = total % (world * cfg.batch_size)
        dropped = tail if split == "train" and tail < world else 0
        assert len(seen) == len(set(seen)) == total - dropped
        assert all(len(b[2]) < cfg.batch_size for batches in per_rank for b in batches[-1:])
        for loader, batches in zip(loaders, per_rank, strict=True):
            _check_labels(loader, batches)
            assert batches[0][0].shape == (cfg.batch_size, 3, 32, 32)
            assert batches[0][0].dtype == torch.float32
    if split == "train":
        assert len({len(loader) for loader in loaders}) == 1, "ranks must take equal steps"


def test_both_loaders_read_the_same_samples_in_the_same_order(digits_dir):
    orders = {}
    for kind in LOADERS:
        loader = create_loader(data_config(digits_dir, INDEXED, loader=kind), "train", 1, 2)
        orders[kind] = [b[2].tolist() for b in _epoch(loader, 3)]
    assert orders["torch"] == orders["dali"]


def test_validation_images_agree_between_loaders(digits_dir):
    """Same file, same resize + center crop: DALI and PIL pixels agree closely."""
    images = {}
    for kind in LOADERS:
        loader = create_loader(
            data_config(digits_dir, INDEXED, loader=kind, crop_pct=0.875), "val", 0, 1
        )
        images[kind], _, _ = next(iter(loader))
    same = (images["torch"] - images["dali"]).abs().mean().item()
    shifted = (images["torch"] - images["dali"].roll(1, dims=0)).abs().mean().item()
    assert same < 0.05 < 0.3 < shifted, f"same sample {same:.3f}, neighbouring sample {shifted:.3f}"


@pytest.mark.parametrize("kind", LOADERS)
def test_resume_mid_epoch_continues_where_the_checkpoint_left_off(digits_dir, kind):
    cfg = data_config(digits_dir, INDEXED, loader=kind, batch_size=32)
    full = [b[2].tolist() for b in _epoch(create_loader(cfg, "train", 0, 2), 4)]
    first = create_loader(cfg, "train", 0, 2)
    first.set_epoch(4)
    taken = []
    for _, _, indices in first:
        taken.append(indices.tolist())
        if len(taken) == 7:
            break
    state = first.state_dict()
    assert state == {"epoch": 4, "samples_done": 7 * 2 * 32, "num_samples": 1433, "seed": 42}
    resumed = create_loader(cfg, "train", 0, 2)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the trainer calls this again for the resumed epoch
    rest = [b[2].tolist() for b in resumed]
    assert taken + rest == full
    assert resumed.state_dict()["samples_done"] == 1433
    resumed.set_epoch(5)
    assert len(list(resumed)) == len(resumed)


def test_resume_with_another_world_size_still_reads_each_sample_once(digits_dir):
    cfg = data_config(digits_dir, INDEXED, loader="torch", batch_size=32)
    before = [create_loader(cfg, "train", r, 2) for r in range(2)]
    seen = []
    for loader in before:
        loader.set_epoch(1)
        for step, (_, _, indices) in enumerate(loader):
            seen += indices.tolist()
            if step == 9:
                break
    after = [create_loader(cfg, "train", r, 3) for r in range(3)]
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
        seen += [i for b in loader for i in b[2].tolist()]
    assert sorted(seen) == list(range(1433))


def test_validation_is_deterministic_and_plain_batches_are_pairs(digits_dir):
    cfg = data_config(digits_dir, INDEXED, loader="dali", batch_size=16)
    loader = create_loader(cfg, "val", 0, 1)
    a, b = _epoch(loader, 0)[0][0], _epoch(loader, 1)[0][0]
    assert torch.equal(a, b), "validation must be deterministic"
    train = create_loader(DataConfig(**{**_asdict(cfg), "return_index": False}), "train", 0, 1)
    train.set_epoch(0)
    images, targets = next(iter(train))
    assert images.shape == (16, 3, 32, 32) and targets.shape == (16,)


def _asdict(cfg: DataConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def test_random_augmentation_is_reproduced_after_a_mid_epoch_resume(digits_dir):
    """Crop, flip, RandAugment and erasing are seeded per (seed, epoch, sample): a resumed
    loader (a new worker, seeded by torch from a different global RNG draw) gives the same
    pixels; another epoch gives different ones."""
    cfg = data_config(digits_dir, INDEXED, loader="torch", batch_size=32,
                      auto_augment="rand-m9-mstd0.5-inc1", reprob=0.25, hflip=0.5,
                      scale=(0.08, 1.0))  # fmt: skip
    full = _epoch(create_loader(cfg, "train", 1, 2), 2)[:6]
    first = create_loader(cfg, "train", 1, 2)
    first.set_epoch(2)
    for count, _ in enumerate(first, 1):
        if count == 3:
            break
    torch.rand(7)  # the resumed process's global RNG is elsewhere: it must not matter
    resumed = create_loader(cfg, "train", 1, 2)
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(2)
    rest = [batch for batch, _ in zip(resumed, range(3), strict=False)]
    for (images, _, indices), (again, _, again_indices) in zip(full[3:], rest, strict=True):
        assert torch.equal(indices, again_indices) and torch.equal(images, again)
    # A sample seen again in another epoch gets another augmentation.
    seen = {i: img for images, _, idx in full for i, img in zip(idx.tolist(), images, strict=True)}
    later = _epoch(create_loader(cfg, "train", 1, 2), 3)[:6]
    again = [(seen[i], img) for b, _, idx in later for i, img in zip(idx.tolist(), b, strict=True)
             if i in seen]  # fmt: skip
    assert again and not any(torch.equal(a, b) for a, b in again)
