"""`make profile NAME=...`: a name that is no profile name is refused before the cluster is asked
(issue 30: `NAME=../../x` ran sinfo and probe jobs first)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import REPO, make, recording_slurm, vitpod
from vitpod.workflows.site.profile import bundled_profiles


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


def test_completion_offers_profile_and_model_names(tmp_path):
    """`vitpod completion`: after --cluster (and the other profile options) the bundled profiles
    and the user's ($VITPOD_PROFILES, read when completing); after --model the recipes."""
    script = tmp_path / "vitpod.bash"
    done = vitpod("completion")
    assert done.returncode == 0, done.stderr
    script.write_text(done.stdout)
    mine = tmp_path / "profiles"
    mine.mkdir()
    (mine / "mysite.yaml").write_text("name: mysite\n")

    def offered(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        shell = (f"source {script}; COMP_WORDS=(vitpod {line}); COMP_CWORD={len(words)}; "
                 '_vitpod; printf "%s\\n" "${COMPREPLY[@]}"')  # fmt: skip
        out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True,
                             env={**os.environ, "VITPOD_PROFILES": str(mine)})  # fmt: skip
        return out.stdout.split()

    assert sorted(offered("render", "--cluster", "")) == sorted(["mysite", *bundled_profiles()])
    assert offered("pipeline", "--finetune-cluster", "dgx") == ["dgxpod"]
    assert offered("render", "--model", "volo_d") == ["volo_d1", "volo_d2", "volo_d3", "volo_d4",
                                                      "volo_d5"]  # fmt: skip
    assert "--cluster" in offered("render", "--clu")


def test_a_bundled_name_is_refused_before_asking_slurm(tmp_path):
    """Your profile folder comes first for CLUSTER=NAME: discovery never hides a bundled one."""
    env, calls = recording_slurm(tmp_path)
    out = make("profile", "NAME=dgxpod", env={**env, "VITPOD_PROFILES": str(tmp_path / "p")})
    assert out.returncode == 2 and "NAME=dgxpod: a bundled profile has that name" in out.stderr
    assert not calls.exists() and not (tmp_path / "p").exists()
