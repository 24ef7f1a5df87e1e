"""What a job script, plan and manifest may hold: a secret's name, never its value (issue 44
item 6); and nothing reaches pyxis's --container-mounts that it would split into another
mount (item 8). Typed as a user types them; refused before anything is written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import container_profile_copy, profile_copy, vitpod
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile import load_profile

SECRET_NAMES = ["AWS_ACCESS_KEY_ID", "WANDB_KEY", "GITHUB_PAT", "NGC_KEY", "DB_PASS", "HF_TOKEN",
                "my_password", "PAT_TOKEN", "GCP_CREDENTIALS", "CLIENT_SECRET"]  # fmt: skip
NOT_SECRETS = ["PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"]
VALUE = "s3cr3t-v4lue-0123"


def _one_error(out: subprocess.CompletedProcess[str], runs: Path) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert not runs.exists(), list(runs.rglob("*"))
    return errors[0]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_a_secret_looking_name_in_env_is_refused(tmp_path: Path, name: str) -> None:
    profile = profile_copy(tmp_path, env={name: VALUE, "PATH_EXTRA": "/opt/x"})
    with pytest.raises(ConfigError, match=rf"field env: '{name}' looks like a secret.*secrets:"):
        load_profile(str(profile))


def test_path_like_names_are_not_secrets(tmp_path: Path) -> None:
    """PAT is a word part only: PATH, LD_LIBRARY_PATH and PYTHONPATH are plain settings."""
    profile = profile_copy(tmp_path, env={n: "/opt/x" for n in NOT_SECRETS})
    assert set(NOT_SECRETS) <= set(load_profile(str(profile)).env)


def test_a_secret_in_env_is_refused_at_render_and_its_value_is_printed_nowhere(
    tmp_path: Path,
) -> None:
    """As a user meets it; passing by name (`secrets:`) is tests/test_cluster_safety.py's."""
    runs = tmp_path / "runs"
    leaky = profile_copy(tmp_path, name="leaky", env={"GITHUB_PAT": VALUE})
    out = vitpod("render", "--cluster", str(leaky), "--model", "volo_tiny", "--offline",
                 runs=runs, env={"GITHUB_PAT": VALUE})  # fmt: skip
    line = _one_error(out, runs)
    assert "'GITHUB_PAT' looks like a secret" in line and VALUE not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "flag,what",
    [
        ("--run-root", "run root (--run-root, VITPOD_RUN_ROOT or storage.runs)"),
        ("--finetune-from", "--finetune (FINETUNE_FROM)"),
    ],
)
def test_a_path_pyxis_would_split_into_another_mount_is_refused(
    tmp_path: Path, flag: str, what: str
) -> None:
    """`--run-root "/x,y:/etc"` rendered `--container-mounts=...,/x,y:/etc` (a mount of /etc)."""
    runs, hostile = tmp_path / "runs", str(tmp_path / "x,y:/etc")
    profile = container_profile_copy(tmp_path)
    stage = ["--stage", "finetune"] if flag == "--finetune-from" else []
    if flag == "--finetune-from":
        (Path(hostile) / "final").mkdir(parents=True)
        (Path(hostile) / "final" / "model.pt").write_bytes(b"x")
    out = vitpod("render", "--cluster", str(profile), "--model", "volo_tiny", *stage, "--offline",
                 flag, hostile if flag == "--finetune-from" else str(runs / "x,y:/etc"),
                 runs=runs)  # fmt: skip
    line = _one_error(out, runs)
    assert f"error: {what}: " in line and "pyxis splits mounts on ',' and ':'" in line, line
