"""`make container` for real: private dockerd, Debian base, provenance baked in, enroot import
under a lock, `unsquashfs -l` verified, digest recorded beside the .sqsh, inputs cached."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import make, user_env

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "containers" / "Dockerfile"
BUILD = REPO / "containers" / "build.sh"


def clean_env(**extra: str) -> dict[str, str]:
    """A user's environment without an IMAGE of the caller's (the build would take it)."""
    return user_env(env={"IMAGE": None, **extra})


def build(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(BUILD)], cwd=REPO, env=clean_env(**env), capture_output=True, text=True
    )


def test_make_n_container_runs_the_build_script():
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "container"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert out.returncode == 0 and out.stdout.strip() == "bash containers/build.sh"
    scripts = [BUILD, *(REPO / "workflows" / "localslurm").glob("*.sh")]
    subprocess.run(["shellcheck", "-x", *map(str, scripts)], check=True)


def test_dockerfile_pins_the_base_by_digest_and_agrees_with_pyproject():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(
        r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3@sha256:[0-9a-f]{64}", base[1]
    )
    assert "FROM ${BASE_IMAGE} AS base" in text
    assert re.findall(r"^FROM base AS (\w+)$", text, re.M) == ["venv", "image"]
    assert text.count("COPY vitpod-image.json /etc/vitpod-image.json") == 2
    pyproject = (REPO / "pyproject.toml").read_text()
    optional = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras_defined = set(re.findall(r"^([a-z]+) = \[", optional, re.M))
    install = r'pip install -c image-constraints\.txt "/tmp/vitpod-src\[([a-z,]+)\]"'
    extras = re.search(install, text)
    assert extras, "the image installs the project's own extras, not a second dependency list"
    assert set(extras[1].split(",")) <= extras_defined
    # torch comes from the image: never installed by name, and frozen for every pip call.
    pip_lines = [line for line in text.splitlines() if "pip install" in line]
    assert all("-c image-constraints.txt" in line for line in pip_lines)
    assert not re.search(r"pip install[^\n]*\btorch(vision)?\b", text)
    frozen = re.search(r"grep -iE '\^\(([^)]*)\)=='", text)
    assert frozen and {"torch", "torchvision"} <= set(frozen[1].split("|"))


def test_a_relative_image_is_refused_before_any_build(tmp_path):
    out = build(IMAGE="images/vitpod.sqsh", VITPOD_CACHE=str(tmp_path))
    assert out.returncode == 1 and "must be a .sqsh path starting with / or ./" in out.stderr
    assert not any(tmp_path.iterdir())


def test_make_container_prints_a_verified_sqsh_with_its_digest(pyxis_image):
    out = make("container", "CLUSTER=localpyxis", env={"IMAGE": None}, timeout=1800)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(pyxis_image.path)
    assert "inputs unchanged): not rebuilt" in out.stderr  # the fixture built it already
    listing = subprocess.run(
        ["unsquashfs", "-l", str(pyxis_image.path)], capture_output=True, text=True, check=True
    ).stdout
    assert "squashfs-root/etc/vitpod-image.json" in listing.splitlines()
    baked = json.loads(
        subprocess.run(
            ["unsquashfs", "-cat", str(pyxis_image.path), "etc/vitpod-image.json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    record = json.loads(Path(f"{pyxis_image.path}.json").read_text())
    assert baked["digest"] == record["digest"] == pyxis_image.digest
    assert baked["inputs"]["target"] == "venv" and baked["git"]["commit"]
    digest = hashlib.sha256(pyxis_image.path.read_bytes()).hexdigest()
    assert record["sqsh"]["sha256"] == digest
    assert not Path("/etc/vitpod-image.json").exists()
    # The private dockerd was stopped after the build; the host's docker socket was never used.
    daemons = subprocess.run(["pgrep", "-a", "dockerd"], capture_output=True, text=True).stdout
    assert str(REPO / ".cache" / "container" / "docker") not in daemons


@pytest.mark.slow
def test_two_concurrent_builds_import_once(pyxis_image, tmp_path):
    image = tmp_path / "shared" / "vitpod.sqsh"
    image.parent.mkdir()
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: build(IMAGE=str(image), CLUSTER="localpyxis"), range(2)))
    for out in runs:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == str(image)
    imports = [out for out in runs if "enroot import dockerd://" in out.stderr]
    reused = [out for out in runs if "not rebuilt" in out.stderr]
    assert len(imports) == 1 and len(reused) == 1, [o.stderr for o in runs]
    assert sorted(p.name for p in image.parent.iterdir()) == [
        "vitpod.sqsh",
        "vitpod.sqsh.json",
        "vitpod.sqsh.lock",
    ]
    assert json.loads(Path(f"{image}.json").read_text())["digest"] == pyxis_image.digest
