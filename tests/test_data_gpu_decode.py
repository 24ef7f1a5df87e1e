"""The gpu loader (torchvision decode_jpeg) on CPU: its choice, pixels, and exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitpod.trainer.data as data_pkg
from tests.fixtures_data import data_config
from vitpod.trainer.data import DataConfig, DataConfigError, choose_loader
from vitpod.trainer.data.draws import draw
from vitpod.trainer.data.gpu_decode import GpuDecodeLoader
from vitpod.trainer.data.sources import load_split

CPU = torch.device("cpu")


GPU = {"batch_size": 8, "loader": "gpu", "return_index": True, "interpolation": "bilinear",
       "scale": (0.3, 1.0)}  # fmt: skip


def _no_dali(monkeypatch) -> None:
    monkeypatch.setattr(data_pkg, "_dali_unsuitable", lambda *a: "nvidia.dali does not import")


def test_auto_never_picks_the_gpu_loader_without_cuda(digits_dir, monkeypatch):
    _no_dali(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = data_config(digits_dir, GPU, loader="auto")
    assert choose_loader(cfg, load_split(cfg, "train"), train=True) == "torch"


def test_an_explicit_gpu_loader_on_a_cpu_node_is_refused_in_one_line(digits_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = data_config(digits_dir, GPU)
    with pytest.raises(DataConfigError, match="no CUDA device") as err:
        choose_loader(cfg, load_split(cfg, "train"), train=True)
    assert "\n" not in str(err.value)


def test_auto_picks_the_gpu_loader_on_a_cuda_node_without_dali(digits_dir, monkeypatch):
    _no_dali(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = data_config(digits_dir, GPU, loader="auto")
    split = load_split(cfg, "train")
    assert choose_loader(cfg, split, train=True) == "gpu"
    with_aa = data_config(digits_dir, GPU, loader="auto", auto_augment="rand-m9-mstd0.5-inc1")
    assert choose_loader(with_aa, split, train=True) == "torch"  # RandAugment: PIL's


def _pil_reference(path: str, index: int, cfg: DataConfig, epoch: int) -> torch.Tensor:
    """The torch loader's PIL operations (BoxedTrainTransform's resize of a box, flip,
    ToTensor, Normalize) applied with the same host-drawn decisions."""
    with Image.open(path) as raw:
        img = raw.convert("RGB")
    d = draw(cfg.seed, epoch, index, img.size, scale=cfg.scale, ratio=cfg.ratio, hflip=cfg.hflip,
             layers=0, num_ops=1, reprob=cfg.reprob)  # fmt: skip
    (x, y), (w, h) = d.crop_anchor, d.crop_shape
    img = img.resize((cfg.img_size,) * 2, Image.Resampling.BILINEAR, box=(x, y, x + w, y + h))
    if d.mirror:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor(cfg.mean).view(3, 1, 1), torch.tensor(cfg.std).view(3, 1, 1)
    return (pixels - mean) / std


def test_decoded_crops_match_the_pil_path_with_the_same_decisions(digits_dir):
    cfg = data_config(digits_dir, GPU)
    loader = GpuDecodeLoader(load_split(cfg, "train"), cfg, 0, 1, train=True, device=CPU)
    loader.set_epoch(1)
    images, _, indices = next(iter(loader))
    files = loader.split.files
    assert files is not None
    reference = torch.stack([_pil_reference(files[i], i, cfg, 1) for i in indices.tolist()])
    same = (images - reference).abs().mean().item()
    shifted = (images - reference.roll(1, dims=0)).abs().mean().item()
    # Same decoder (libjpeg-turbo); PIL's and torch's antialiased resampling differ by rounding.
    assert same < 0.02 < 0.2 < shifted, f"same sample {same:.4f}, neighbouring {shifted:.4f}"


def test_a_resumed_gpu_loader_continues_with_identical_pixels(digits_dir):
    cfg = data_config(digits_dir, GPU, reprob=0.5)
    split = load_split(cfg, "train")
    full = GpuDecodeLoader(split, cfg, 0, 2, train=True, device=CPU)
    full.set_epoch(2)
    batches = iter(full)
    next(batches)
    state = full.state_dict()
    expected = next(batches)
    resumed = GpuDecodeLoader(split, cfg, 0, 2, train=True, device=CPU)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert torch.equal(got[2], expected[2])
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])


def test_validation_matches_the_torch_loader(digits_dir):
    from vitpod.trainer.data.torch_loader import TorchLoader

    cfg = data_config(digits_dir, GPU, crop_pct=0.875)
    split = load_split(cfg, "val")
    ours, _, idx = next(iter(GpuDecodeLoader(split, cfg, 0, 1, train=False, device=CPU)))
    theirs, _, idx_torch = next(iter(TorchLoader(split, cfg, 0, 1, train=False)))
    assert torch.equal(idx, idx_torch)
    assert (ours - theirs).abs().mean().item() < 0.02


def test_the_gpu_loader_applies_the_dali_loaders_decisions(digits_dir):
    """DALI (on CPU here) and the gpu loader draw the same crops, flips and CutOut boxes from
    draws.py: the same batch agrees up to resampling float error, erased pixels included."""
    from vitpod.trainer.data.dali_loader import DaliLoader

    cfg = data_config(digits_dir, GPU, loader="dali", reprob=1.0, workers=1)
    split = load_split(cfg, "train")
    ours_loader = GpuDecodeLoader(split, cfg, 0, 1, train=True, device=CPU)
    dali_loader = DaliLoader(split, cfg, 0, 1, train=True)
    ours_loader.set_epoch(1)
    dali_loader.set_epoch(1)
    ours, _, idx = next(iter(ours_loader))
    dali, _, idx_dali = next(iter(dali_loader))
    assert torch.equal(idx, idx_dali)
    assert (ours == 0).sum() > 0  # some CutOut boxes were drawn and applied
    assert (ours - dali).abs().mean().item() < 1e-3
    assert (ours - dali).abs().max().item() < 0.05  # a couple of uint8 levels at most
