"""Fixtures for real containers: pyxis + enroot in the local Slurm, and the image `make container`
builds (owned by the containers area). Without the vendored pyxis/enroot sources they skip and
say why; everything else still runs."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures_slurm import LocalSlurm

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "workflows" / "localslurm" / "runtime.sh"
BUILD = REPO / "containers" / "build.sh"
UNPRIVILEGED_USER = "vitpodtest"


@pytest.fixture(scope="session")
def pyxis_slurm(local_slurm: LocalSlurm) -> LocalSlurm:
    """The local Slurm with pyxis loaded (srun --help lists --container-image)."""
    out = subprocess.run(["bash", str(RUNTIME)], capture_output=True, text=True, timeout=900)
    if out.returncode == 3:
        pytest.skip(f"no container runtime: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr[-3000:]
    help_text = subprocess.run(["srun", "--help"], capture_output=True, text=True).stdout
    assert "--container-image" in help_text, "pyxis is built but srun does not load it"
    return local_slurm


@dataclass(frozen=True)
class Image:
    path: Path
    digest: str


@pytest.fixture(scope="session")
def pyxis_image(pyxis_slurm: LocalSlurm) -> Image:
    """The localpyxis image from `make container` (built once; unchanged inputs are reused)."""
    env = {**os.environ, "CLUSTER": "localpyxis"}
    env.pop("IMAGE", None)
    out = subprocess.run(
        ["bash", str(BUILD)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path = Path(out.stdout.strip().splitlines()[-1])
    digest = json.loads(Path(f"{path}.json").read_text())["digest"]
    return Image(path=path, digest=digest)


def unprivileged_user() -> str:
    """A system user with a login shell (enroot starts the container through it)."""
    if subprocess.run(["id", UNPRIVILEGED_USER], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/bin/bash", UNPRIVILEGED_USER],
            check=True,
        )
    return UNPRIVILEGED_USER
