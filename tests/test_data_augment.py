"""Training augmentations of both loaders: the recipe's RandAugment and CutOut, interpolation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment

from tests.fixtures_data import data_config
from tests.helpers import logs, run_ranks
from vitpod.trainer.__main__ import GENERATED_SOURCE
from vitpod.trainer.data import DataConfig, create_loader
from vitpod.trainer.data.dali_augment import rand_augment_params
from vitpod.trainer.data.transforms import posterize, train_transform


@pytest.mark.parametrize("reprob,erased", [(0.0, False), (1.0, True)])
def test_dali_cutout_erases_one_rectangle_per_image(digits_dir, reprob, erased):
    loader = create_loader(data_config(digits_dir, loader="dali", reprob=reprob), "train", 0, 1)
    images, _ = next(iter(loader))
    zero = (images == 0).all(dim=1)  # erased pixels are 0 in every channel
    fraction = zero.float().mean(dim=(1, 2))
    if not erased:
        assert fraction.max() == 0
        return
    assert (fraction >= 0.015).all() and (fraction <= 0.34).all()
    for mask in zero:  # the zeros form one axis-aligned rectangle
        rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
        box = mask[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
        assert box.all()


@pytest.mark.slow
def test_a_dali_rank_leaves_no_generated_sources_in_its_temp_dir(digits_dir, tmp_path, monkeypatch):
    """DALI converts RandAugment's conditionals into temporary .py files that only an atexit hook
    deletes; a rank leaves by os._exit, so it deletes them itself (they piled up in /tmp)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    argv = [str(digits_dir), "--model", "vit_micro", "--img-size", "32", "-b", "8",
            "--workers", "0", "--loader", "dali", "--aa", "rand-m9-n3", "--checkpoint-every", "0",
            "--no-eval", "--max-steps", "1", "--output", str(tmp_path / "run")]  # fmt: skip
    assert run_ranks(1, argv, tmp_path / "logs") == [0], logs(tmp_path / "logs")
    assert not [p.name for p in temp.iterdir() if p.name.startswith(GENERATED_SOURCE)]


def test_dali_rand_augment_runs_and_reads_timm_policy_strings(digits_dir):
    plain = create_loader(data_config(digits_dir, loader="dali", hflip=0.0), "train", 0, 1)
    strong = create_loader(
        data_config(digits_dir, loader="dali", hflip=0.0, auto_augment="rand-m9-n3"), "train", 0, 1
    )
    a, b = next(iter(plain))[0], next(iter(strong))[0]
    assert a.shape == b.shape == (64, 3, 32, 32)
    assert (a - b).abs().mean() > 0.05
    assert rand_augment_params("rand-m9-mstd0.5-inc1") == (2, 9)
    assert rand_augment_params("rand-m12-n4") == (4, 10)


def test_timm_posterize_at_zero_bits_gives_black_not_an_error():
    img = Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8))
    assert np.asarray(posterize(img, 0)).max() == 0
    assert np.asarray(posterize(img, 1)).max() == 128
    transform = train_transform(
        DataConfig(data_dir="x", img_size=32, auto_augment="rand-m10-n4-inc1")
    )
    ops = [op for step in transform.transforms for op in getattr(step, "ops", [])]
    assert ops and all(op.aug_fn is not auto_augment.posterize for op in ops)
    assert any(op.aug_fn is posterize for op in ops)


def test_torch_recipe_runs_over_the_data_with_randaugment_and_cutout(digits_dir):
    cfg = data_config(digits_dir, loader="torch", auto_augment="rand-m9-mstd0.5-inc1", reprob=0.25)
    images, targets = next(iter(create_loader(cfg, "train", 0, 1)))
    assert images.shape == (64, 3, 32, 32) and torch.isfinite(images).all()


@pytest.mark.parametrize("kind", ["torch", "dali"])
def test_bilinear_and_bicubic_differ_only_slightly(digits_dir, kind):
    batches = {
        interp: next(
            iter(
                create_loader(
                    data_config(digits_dir, loader=kind, interpolation=interp), "val", 0, 1
                )
            )
        )[0]  # fmt: skip
        for interp in ("bicubic", "bilinear")
    }
    diff = (batches["bicubic"] - batches["bilinear"]).abs().mean().item()
    assert 0 < diff < 0.2
