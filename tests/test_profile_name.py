"""`make profile NAME=...`: a name that is no profile name is refused before the cluster is asked
(issue 30: `NAME=../../x` ran sinfo and probe jobs first)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = ("sinfo", "scontrol", "srun", "sbatch", "squeue", "sacctmgr", "salloc")


@pytest.mark.parametrize("name", ["../../x", "x;touch y"])
def test_a_bad_profile_name_fails_fast_without_asking_slurm(tmp_path, name):
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for tool in SLURM:  # any call to Slurm is recorded (and would fail the test)
        path = stubs / tool
        path.write_text(f'#!/bin/sh\necho "{tool} $*" >>"{tmp_path}/slurm-calls"\nexit 1\n')
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "MAKEFLAGS": ""}
    out = subprocess.run(
        ["make", "-s", "profile", f"NAME={name}"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert not (tmp_path / "slurm-calls").exists(), (tmp_path / "slurm-calls").read_text()
    errors = [line for line in out.stderr.splitlines() if not line.startswith("make")]
    assert len(errors) == 1 and f"NAME={name!r}" in errors[0], out.stderr
    assert "pick one such as NAME=mysite" in errors[0]
    assert not list((REPO / "workflows" / "profiles").glob("*x.yaml"))
