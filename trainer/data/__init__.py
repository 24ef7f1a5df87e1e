"""Data sources and per-rank loaders (DALI or torch) with exactly-once sharding."""

from __future__ import annotations

import logging

from vitpod.trainer.data.config import DataConfig, DataConfigError
from vitpod.trainer.data.loader import CorruptImageError, Loader
from vitpod.trainer.data.sources import DataSourceError, Split, load_split

__all__ = [
    "CorruptImageError",
    "DataConfig",
    "DataConfigError",
    "DataSourceError",
    "Loader",
    "create_loader",
    "choose_loader",
]

log = logging.getLogger(__name__)


def create_loader(cfg: DataConfig, split: str, rank: int, world_size: int) -> Loader:
    """This rank's loader for `split` ('train' or 'val'), DALI or torch per cfg.loader."""
    data = load_split(cfg, split)
    train = split == "train"
    kind = choose_loader(cfg, data, train)
    token_labels = None
    if train and cfg.token_label:  # every loader cuts the maps with its own crop boxes
        from vitpod.trainer.data.token_label import TokenLabelStore

        token_labels = TokenLabelStore.open(cfg, num_classes=len(data.classes), split=data)
    if kind == "dali":
        from vitpod.trainer.data.dali_loader import DaliLoader

        return DaliLoader(data, cfg, rank, world_size, train, token_labels=token_labels)
    if kind == "gpu":
        from vitpod.trainer.data.gpu_decode import GpuDecodeLoader

        return GpuDecodeLoader(data, cfg, rank, world_size, train, token_labels=token_labels)
    from vitpod.trainer.data.torch_loader import TorchLoader

    return TorchLoader(data, cfg, rank, world_size, train, token_labels=token_labels)


def choose_loader(cfg: DataConfig, data: Split, train: bool) -> str:
    """'dali', 'gpu' or 'torch': an explicit choice is checked; 'auto' takes DALI when it can,
    else nvJPEG through torchvision on a GPU node, else torch."""
    if cfg.loader == "auto":  # _torch_faster first: it decides without importing DALI
        reason = _torch_faster(cfg) or _dali_unsuitable(cfg, data, train)
        kind = "torch" if reason else "dali"
        if reason and not _gpu_decode_unsuitable(cfg, data, train):
            kind = "gpu"
        log.info("loader auto -> %s%s", kind, f" ({reason})" if reason else "")
        return kind
    check = {"dali": _dali_unsuitable, "gpu": _gpu_decode_unsuitable}.get(cfg.loader)
    if check and (reason := check(cfg, data, train)):
        raise DataConfigError(
            f"DataConfig.loader='{cfg.loader}' cannot be used: {reason}; use 'torch' or 'auto'"
        )
    return cfg.loader


def _gpu_decode_unsuitable(cfg: DataConfig, data: Split, train: bool) -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device on this node (nvJPEG decodes on a GPU)"
    if data.kind not in ("files", "shards"):
        return f"dataset '{cfg.dataset}' is not encoded images"
    if train and cfg.auto_augment:
        return f"RandAugment ({cfg.auto_augment}) is not on the gpu loader; pass --aa ''"
    return _train_filter(cfg, train)


def _train_filter(cfg: DataConfig, train: bool) -> str:
    """timm's --train-interpolation (random: a filter per image) is the torch loader's; DALI
    and the gpu loader resize training images with --interpolation."""
    if train and cfg.train_interpolation not in ("", cfg.interpolation):
        return f"--train-interpolation {cfg.train_interpolation} is the torch loader's"
    return ""


def _torch_faster(cfg: DataConfig) -> str:
    """Without a GPU, RandAugment runs faster in PIL than in DALI's CPU operators (232 vs 196
    images/s per core on the 2-core EPYC, benchmarks/results/loader.json); DALI spends ~2 s building
    its RandAugment graph; both splits then use torch, so DALI is not even imported. With a
    GPU, DALI decodes on it."""
    import torch

    if cfg.auto_augment and not torch.cuda.is_available():
        return "no GPU: PIL runs RandAugment faster than DALI's CPU operators"
    return ""


def _dali_unsuitable(cfg: DataConfig, data: Split, train: bool) -> str:
    if data.kind not in ("files", "shards"):
        return f"dataset '{cfg.dataset}' is not encoded images (DALI decodes JPEG/PNG)"
    try:
        from vitpod.trainer.data.dali_augment import rand_augment_params
    except ImportError as err:
        return f"nvidia.dali does not import ({err})"
    if train and cfg.auto_augment:
        try:
            rand_augment_params(cfg.auto_augment)
        except ValueError as err:
            return str(err)
    return _train_filter(cfg, train)
