"""Fixtures for real image data (owned by the data area)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO
from vitpod.trainer.data import DataConfig
from vitpod.trainer.data.digits import write_digits_jpeg

PLAIN = {"img_size": 32, "batch_size": 64, "workers": 0, "auto_augment": None, "reprob": 0.0}
"""The data tests' DataConfig fields: 32 px, no loader workers, no random augmentation."""


def data_config(root: Path, base: Mapping[str, Any] | None = None, **fields: Any) -> DataConfig:
    """A DataConfig of the image folder (or shards) at `root`: PLAIN, then a test file's `base`,
    then this call's `fields`."""
    return DataConfig(**{**PLAIN, "data_dir": str(root), **(base or {}), **fields})


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sklearn digits as ImageNet-layout JPEGs (32 px; 1433 train, 364 val), once a session."""
    return write_digits_jpeg(tmp_path_factory.mktemp("data") / "digits", size=32)


@pytest.fixture(scope="session")
def localslurm_data() -> Path:
    """The digits folder the bundled localslurm profile's storage.data names (data/digits in
    the checkout): a job or sweep on that profile as shipped reads it."""
    return write_digits_jpeg(REPO / "data" / "digits", size=32)


@pytest.fixture(scope="session")
def digits_half_dir(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every other training image of `digits_dir` (717; val whole), hard-linked, its marker kept
    so the trainer reads it as the digits set: half the steps per epoch for the live tests that
    need epochs, not images."""
    half = tmp_path_factory.mktemp("data-half") / "digits"
    for image in sorted(digits_dir.rglob("*.jpg")):
        rel = image.relative_to(digits_dir)
        if rel.parts[0] == "train" and int(image.stem) % 2:
            continue
        (half / rel).parent.mkdir(parents=True, exist_ok=True)
        (half / rel).hardlink_to(image)
    for marker in digits_dir.glob(".*"):
        if marker.is_file():
            (half / marker.name).hardlink_to(marker)
    return half
