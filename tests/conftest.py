"""Shared pytest setup; fixtures live in per-area plugin modules listed below."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

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

SHM = Path("/dev/shm")
SHM_NEEDED = 8 * 2**30
"""A whole run writes about 1.2 GB (runs, checkpoints, a venv, images); the rest is headroom."""


def shm_basetemp() -> Path | None:
    """This checkout's temporary directory on tmpfs, when /dev/shm can be written and has room."""
    try:
        room = shutil.disk_usage(SHM).free >= SHM_NEEDED and os.access(SHM, os.W_OK)
    except OSError:
        return None
    repo = str(Path(__file__).resolve().parents[1])
    return SHM / f"vitpod-tests-{hashlib.sha256(repo.encode()).hexdigest()[:8]}" if room else None


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path factory reads the option
def pytest_configure(config: pytest.Config) -> None:
    """Tests write their runs, checkpoints and logs under tmpfs unless --basetemp says where:
    on this machine's disk the same tests took 3-4% more CPU (system time of the writes). xdist's
    workers are given their folders under it by the controller."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = shm_basetemp()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that passed gives its tmpfs memory back; a failed one keeps its files until the next
    run (pytest empties --basetemp when it starts)."""
    base = session.config.option.basetemp
    if exitstatus == 0 and base and base == shm_basetemp():
        shutil.rmtree(base, ignore_errors=True)
