"""Fixtures for real image data (owned by the data area)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vitpod.trainer.data.digits import write_digits_jpeg


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sklearn digits as ImageNet-layout JPEGs (32 px; 1433 train, 364 val), once a session."""
    return write_digits_jpeg(tmp_path_factory.mktemp("data") / "digits", size=32)
