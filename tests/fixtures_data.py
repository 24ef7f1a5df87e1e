"""Fixtures for real image data (owned by the data area)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vitpod.trainer.data.digits import write_digits_jpeg


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sklearn digits as ImageNet-layout JPEGs (32 px; 1433 train, 364 val), once a session."""
    return write_digits_jpeg(tmp_path_factory.mktemp("data") / "digits", size=32)


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
