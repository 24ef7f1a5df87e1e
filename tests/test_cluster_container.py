"""containers/: the build recipe's commands, pins agreeing with pyproject, import-verify-rename."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "containers" / "Dockerfile"
BUILD = REPO / "containers" / "build.sh"


def test_make_n_container_runs_the_build_script():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "container"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "bash containers/build.sh"
    subprocess.run(["shellcheck", str(BUILD)], check=True)


def test_dry_run_lists_build_lock_import_verify_rename(tmp_path):
    image = tmp_path / "images" / "vitpod.sqsh"
    env = {**os.environ, "DRY_RUN": "1", "IMAGE": str(image)}
    out = subprocess.run(["bash", str(BUILD)], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    steps = [line[2:].split()[0] for line in out.stderr.splitlines() if line.startswith("+ ")]
    assert steps == ["docker", "mkdir", "flock", "rm", "enroot", "unsquashfs", "mv", "sha256sum"]
    assert f"enroot import --output {image}.importing." in out.stderr
    assert not image.parent.exists()  # a dry run changes nothing


def test_dockerfile_pins_agree_with_pyproject():
    text = DOCKERFILE.read_text()
    tag = re.search(r"^ARG NGC_TAG=(\S+)$", text, re.M)
    assert tag and re.fullmatch(r"\d{2}\.\d{2}-py3", tag[1]), (
        "pin an exact NGC release, never latest"
    )
    assert "FROM nvcr.io/nvidia/pytorch:${NGC_TAG}" in text
    pyproject = (REPO / "pyproject.toml").read_text()
    optional = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras_defined = set(re.findall(r"^([a-z]+) = \[", optional, re.M))
    extras = re.search(r'pip install -c image-constraints\.txt "\.\[([a-z,]+)\]"', text)
    assert extras, "the image installs the project's own extras, not a second dependency list"
    assert {"train", "analysis"} <= extras_defined
    assert set(extras[1].split(",")) <= extras_defined
    # torch comes from the image: never installed by name, and frozen for every pip call.
    pip_lines = [line for line in text.splitlines() if "pip install" in line]
    assert all("-c image-constraints.txt" in line for line in pip_lines)
    assert not re.search(r"pip install[^\n]*\btorch(vision)?\b", text)
    frozen = re.search(r"grep -iE '\^\(([^)]*)\)=='", text)
    assert frozen and {"torch", "torchvision"} <= set(frozen[1].split("|"))
    # Whatever constraints.txt pins outside torch must be pinned identically in the image.
    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    for name, version in pins.items():
        if name not in ("torch", "torchvision"):
            assert f"{name}=={version}" in text, f"{name} is pinned in constraints.txt only"


def shim(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text(f"#!/bin/bash\nset -e\n{body}\n")
    (bin_dir / name).chmod(0o755)


def build(tmp_path: Path, enroot_body: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """Run build.sh with docker and enroot stand-ins (neither exists here); flock, unsquashfs,
    sha256sum and the rename are the real ones."""
    bin_dir, rootfs = tmp_path / "bin", tmp_path / "rootfs"
    bin_dir.mkdir(exist_ok=True)
    (rootfs / "opt" / "vitpod").mkdir(parents=True, exist_ok=True)
    (rootfs / "opt" / "vitpod" / "marker").write_text("vitpod image\n")
    shim(bin_dir, "docker", 'if [ "$1" = image ]; then echo sha256:feedbeef; fi')
    shim(bin_dir, "enroot", enroot_body.replace("ROOTFS", shlex.quote(str(rootfs))))
    image, record = tmp_path / "shared" / "vitpod.sqsh", tmp_path / "image.json"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "IMAGE": str(image),
        "IMAGE_RECORD": str(record),
    }
    out = subprocess.run(["bash", str(BUILD)], cwd=REPO, env=env, capture_output=True, text=True)
    return out, image, record


def test_import_is_verified_renamed_and_recorded(tmp_path):
    good = 'mksquashfs ROOTFS "$3" -noappend -quiet >/dev/null'
    out, image, record = build(tmp_path, good)
    assert out.returncode == 0, out.stderr
    listing = subprocess.run(["unsquashfs", "-l", str(image)], capture_output=True, text=True)
    assert "opt/vitpod/marker" in listing.stdout
    data = json.loads(record.read_text())
    assert data["path"] == str(image) and data["docker_id"] == "sha256:feedbeef"
    assert data["sha256"] == hashlib.sha256(image.read_bytes()).hexdigest()
    assert sorted(p.name for p in image.parent.iterdir()) == [
        "vitpod.sqsh",
        "vitpod.sqsh.lock",
        "vitpod.sqsh.source",
    ]
    again, _, _ = build(tmp_path, "exit 99")  # same docker image: no second import
    assert again.returncode == 0 and "already holds" in again.stderr


def test_broken_import_leaves_no_image_behind(tmp_path):
    out, image, record = build(tmp_path, 'echo "not a squashfs" > "$3"')
    assert out.returncode != 0 and "unreadable squashfs" in out.stderr
    assert not image.exists() and not record.exists()
    assert [p.name for p in image.parent.iterdir()] == ["vitpod.sqsh.lock"]
