"""Shared pytest setup; fixtures live in per-area plugin modules listed below."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(os.path.dirname(__file__), "..", ".cache", "torch_extensions"),
)

pytest_plugins = [
    "tests.fixtures_data",
    "tests.fixtures_slurm",
    "tests.fixtures_container",
    "tests.ci_skips",
]
