"""`make profile NAME=...`: a name that is no profile name is refused before the cluster is asked
(issue 30: `NAME=../../x` ran sinfo and probe jobs first)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, make, recording_slurm


@pytest.mark.parametrize("name", ["../../x", "x;touch y"])
def test_a_bad_profile_name_fails_fast_without_asking_slurm(tmp_path, name):
    env, calls = recording_slurm(tmp_path)  # any call to Slurm is recorded (and fails the test)
    out = make("profile", f"NAME={name}", env=env, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert not calls.exists(), calls.read_text()
    errors = [line for line in out.stderr.splitlines() if not line.startswith("make")]
    assert len(errors) == 1 and f"NAME={name!r}" in errors[0], out.stderr
    assert "pick one such as NAME=mysite" in errors[0]
    assert not list((REPO / "workflows" / "profiles").glob("*x.yaml"))
