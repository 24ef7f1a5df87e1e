"""vitpod refuses, before submission, every container input pyxis refuses: checked against the
real srun with the real pyxis plugin (client-side rules) and a real job (node-side rules)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import container_profile_copy, vitpod
from vitpod.workflows.containers.container import check_container_paths, check_container_static
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile import load_profile

SQSH = "./.cache/images/vitpod-local.sqsh"

# (profile container changes, the raw pyxis flags for the same input, the field vitpod names,
#  where pyxis finds it wrong: "client" = srun/sbatch refuse it at once (exit 255),
#  "node" = the job fails in slurmstepd on the compute node)
CASES = {
    "mount source without / or .": (
        {"mounts": [".:.", "data:/data"]},
        ["--container-mounts=data:/data"],
        r"container\.mounts\[1\]\.src: 'data'",
        "client",
    ),
    "mount target without / or .": (
        {"mounts": [".:.", {"src": "/tmp", "dst": "data"}]},
        ["--container-mounts=/tmp:data"],
        r"container\.mounts\[1\]\.dst: 'data'",
        "client",
    ),
    "mount with empty target": (
        {"mounts": [".:.", "/tmp::ro"]},
        ["--container-mounts=/tmp::ro"],
        r"container\.mounts\[1\]\.dst is empty",
        "client",
    ),
    "container name flag": (
        {"name": "vitpod:bogus"},
        ["--container-name=vitpod:bogus"],
        r"container\.name: 'vitpod:bogus'",
        "client",
    ),
    "empty image": ({"image": ""}, ["--container-image="], r"container\.image: ''", "client"),
    "relative image": (
        {"image": "relative.sqsh"},
        ["--container-image=relative.sqsh"],
        r"container\.image: 'relative\.sqsh' is not a file",
        "node",
    ),
    "missing mount source": (
        {"mounts": [".:.", "/nonexistent/vitpod-data:/data"]},
        ["--container-mounts=/nonexistent/vitpod-data:/data"],
        r"container\.mounts\[1\]\.src: '/nonexistent/vitpod-data' .* does not exist",
        "node",
    ),
    "missing image": (
        {"image": "/nonexistent/vitpod.sqsh"},
        ["--container-image=/nonexistent/vitpod.sqsh"],
        r"container\.image: '/nonexistent/vitpod\.sqsh' .* does not exist",
        "node",
    ),
}


def vitpod_check(path: Path) -> None:
    """The checks submission runs: static ones when loading, node-side ones before sbatch."""
    profile = load_profile(str(path))
    check_container_paths(profile)


@pytest.mark.parametrize("case", CASES)
def test_vitpod_refuses_and_names_the_field(tmp_path, case):
    changes, _, field, _ = CASES[case]
    with pytest.raises(ConfigError, match=field):
        vitpod_check(container_profile_copy(tmp_path, container=changes))


def test_the_bundled_profiles_pass(tmp_path):
    for name in ("dgxpod", "superpod", "h100pod", "localpyxis"):
        check_container_static(load_profile(name))
    ok = container_profile_copy(
        tmp_path, container={"mounts": ["./:./", "/tmp:/scratch:ro"], "name": "v:exec"}
    )
    profile = load_profile(str(ok))
    assert profile.container is not None and profile.container.mounts[1].readonly


def test_env_names_reaching_container_env_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"field env: .*not a valid environment variable"):
        load_profile(
            str(container_profile_copy(tmp_path, env={"OMP_NUM_THREADS": "1", "A-B": "x"}))
        )


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] == "client"])
def test_pyxis_refuses_the_same_in_srun_and_sbatch(pyxis_slurm, tmp_path, case):
    _, flags, _, _ = CASES[case]
    given = any(f.startswith("--container-image") for f in flags)
    image = [] if given else [f"--container-image={SQSH}"]
    for command in (["srun", "-N1", "-n1", *image, *flags, "true"], ["sbatch", *image, *flags]):
        out = subprocess.run(
            [*command, "--wrap", "true"] if command[0] == "sbatch" else command,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
        assert out.returncode == 255, (command, out.returncode, out.stderr)
        assert "pyxis" in out.stderr or "Invalid --container" in out.stderr, out.stderr


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] == "node"])
def test_pyxis_fails_the_same_on_the_node(pyxis_image, tmp_path, case):
    _, flags, _, _ = CASES[case]
    given = any(f.startswith("--container-image") for f in flags)
    image = [] if given else [f"--container-image={pyxis_image.path}"]
    out = subprocess.run(
        ["srun", "-N1", "-n1", "--time=2", *image, *flags, "true"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode != 0 and "pyxis" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"mounts": [".:.", "data:/data"]}, r"container\.mounts\[1\]\.src"),
        ({"image": "relative.sqsh"}, r"container\.image"),
        ({"mounts": [".:.", "/nonexistent/vitpod-data:/data"]}, r"container\.mounts\[1\]\.src"),
    ],
)
def test_make_pretrain_exits_2_before_sbatch_and_leaves_no_run_dir(tmp_path, changes, field):
    """The three refusals of the issue, through the command users type (no Slurm needed: the
    refusal comes before sbatch)."""
    runs = tmp_path / "runs"
    profile = container_profile_copy(tmp_path, container=changes)
    out = vitpod(
        "submit", "--cluster", str(profile), "--model", "volo_tiny", "--run-root", str(runs)
    )
    assert out.returncode == 2, out.stderr
    assert "error:" in out.stderr and re.search(field, out.stderr), out.stderr
    assert "submitted" not in out.stdout
    assert not runs.exists() or not any(runs.iterdir())
