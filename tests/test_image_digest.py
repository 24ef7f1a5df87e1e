"""A job refuses to start in another image than its plan.json recorded (rebuilt while it waited).

A small real squashfs image carries /etc/vitpod-image.json as `make container` bakes it; the
planner reads its digest into plan.json (unsquashfs -cat); the image is then rebuilt with other
inputs, and the rank's bind.sh, run as Slurm runs it inside the container (the container's
/etc/vitpod-image.json is the rebuilt image's, read from the .sqsh), exits 2 before the rank's
command with one line naming both digests and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vitpod.node import imagecheck
from vitpod.registry import runfiles
from vitpod.workflows import cli
from vitpod.workflows.site.profile import PROFILE_DIR

pytestmark = pytest.mark.skipif(
    shutil.which("mksquashfs") is None or shutil.which("unsquashfs") is None,
    reason="squashfs-tools (mksquashfs, unsquashfs) not installed",
)
OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def _image(path: Path, digest: str) -> Path:
    """A squashfs with only /etc/vitpod-image.json (what `make container` bakes)."""
    root = path.parent / f"root-{digest[-4:]}"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "vitpod-image.json").write_text(json.dumps({"digest": digest}, indent=2))
    path.unlink(missing_ok=True)
    subprocess.run(
        ["mksquashfs", str(root), str(path), "-quiet", "-no-progress", "-noappend"], check=True
    )
    return path


def _inside(image: Path, tmp_path: Path) -> Path:
    """The image's /etc/vitpod-image.json as a rank in that container reads it."""
    out = subprocess.run(["unsquashfs", "-cat", str(image), "etc/vitpod-image.json"],
                         capture_output=True, check=True)  # fmt: skip
    path = tmp_path / f"inside-{image.stat().st_mtime_ns}.json"
    path.write_bytes(out.stdout)
    return path


def _render(tmp_path: Path, image: Path) -> Path:
    profile = yaml.safe_load((PROFILE_DIR / "localpyxis.yaml").read_text())
    profile["container"]["image"] = str(image)
    path = tmp_path / "pyxis.yaml"
    path.write_text(yaml.safe_dump(profile))
    argv = ["render", "--cluster", str(path), "--model", "volo_tiny",
            "--run-root", str(tmp_path / "runs")]  # fmt: skip
    assert cli.main(argv) == 0
    return next((tmp_path / "runs").iterdir())


def _rank(run: Path, provenance: Path, marker: Path) -> subprocess.CompletedProcess[str]:
    """bind.sh as srun starts it for rank 0; the rank's command leaves `marker`."""
    env = {**os.environ, "SLURM_JOB_ID": "1", "SLURM_LOCALID": "0", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "1", "SLURM_RESTART_COUNT": "0",
           imagecheck.PROVENANCE_ENV: str(provenance)}  # fmt: skip
    env.pop("MASTER_PORT", None)
    return subprocess.run(["bash", str(run / "bind.sh"), "touch", str(marker)], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_a_rank_in_a_rebuilt_image_exits_2_before_its_command(tmp_path: Path) -> None:
    image = _image(tmp_path / "img.sqsh", OLD)
    run = _render(tmp_path, image)
    assert json.loads((run / runfiles.PLAN).read_text())["image"]["digest"] == OLD
    marker = tmp_path / "trained"
    same = _rank(run, _inside(image, tmp_path), marker)
    assert same.returncode == 0 and marker.exists(), same.stderr
    marker.unlink()
    _image(image, NEW)  # `make container` again with other inputs, under the queued job
    out = _rank(run, _inside(image, tmp_path), marker)
    assert out.returncode == 2, out.stderr
    assert not marker.exists(), "the rank's command ran in the rebuilt image"
    (line,) = [x for x in out.stderr.splitlines() if "error" in x]
    assert f"now has digest {NEW}" in line and f"recorded image.digest {OLD}" in line
    assert f"make resume RUN={run}" in line


def test_an_image_without_its_record_is_refused_and_a_plan_without_a_digest_is_not(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    plan = {"image": {"image": "/x.sqsh", "digest": OLD}}
    (run / runfiles.PLAN).write_text(json.dumps(plan))
    problem = imagecheck.problem(run, str(tmp_path / "absent.json"))
    assert problem is not None and "no digest" in problem and OLD in problem
    (run / runfiles.PLAN).write_text(json.dumps({"image": {"image": "/x.sqsh", "digest": None}}))
    assert imagecheck.problem(run, str(tmp_path / "absent.json")) is None  # nothing to compare
    assert imagecheck.main([str(tmp_path / "no-plan")]) == 0  # runs planned by hand: no record
