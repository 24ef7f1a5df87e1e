"""Images from an authenticated registry, as clusters run them: the local docker-registry (TLS,
htpasswd), `make container PUSH=1`, pyxis pulling by digest with credentials passed by name,
one container start per node per job (cold/warm measured), and bad input refused in one line."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fixtures_container import BUILD
from tests.fixtures_slurm import rank_logs, wait_job
from tests.helpers import container_profile_copy, submitted, user_env, vitpod
from vitpod.workflows.containers import containerpreflight, registryref
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile import PROFILE_DIR, load_profile

REPO = Path(__file__).resolve().parents[1]
REGISTRY_SH = REPO / "workflows" / "localslurm" / "registry.sh"
DIGEST = "sha256:" + "ab" * 32
JOB = ("--model", "volo_tiny", "--entry", "rankinfo")


# --------------------------------------------------------------------------- no cluster needed


@pytest.mark.parametrize(
    "image, want",
    [
        (f"u@127.0.0.1:5000#vitpod/local@{DIGEST}", ("127.0.0.1:5000", "vitpod/local", DIGEST)),
        (f"u@127.0.0.1:5000/vitpod/local@{DIGEST}", ("127.0.0.1:5000", "vitpod/local", DIGEST)),
        ("nvcr.io#nvidia/pytorch:25.01-py3", ("nvcr.io", "nvidia/pytorch", "25.01-py3")),
        ("ubuntu", ("registry-1.docker.io", "library/ubuntu", "latest")),
    ],
)
def test_image_references_are_read_as_enroot_reads_them(image, want):
    ref = registryref.parse(image)
    assert ref is not None and (ref.registry, ref.repository, ref.reference) == want
    assert registryref.parse("./images/x.sqsh") is None


def test_a_malformed_digest_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^container.image: .*sha256:<64 hex digits>"):
        registryref.parse("u@127.0.0.1:5000#vitpod/local@sha256:1234")


def test_credentials_line_names_the_variable_never_the_value():
    ref = registryref.parse(f"vitpod@127.0.0.1:15000#vitpod/local@{DIGEST}")
    assert ref is not None
    # enroot matches the host without its port and the URI's user (src/docker.sh).
    assert registryref.credentials_line(ref, "PW") == "machine 127.0.0.1 login vitpod password $PW"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"secrets": []}, "VITPOD_REGISTRY_PASSWORD is not listed under `secrets`"),
        ({"container": {"image": "./x.sqsh"}}, "must be a registry reference naming its user"),
        ({"container": {"name": "mine"}}, "start_once names the container itself"),
    ],
)
def test_profile_mistakes_are_one_line_naming_the_field(tmp_path, change, message):
    data = yaml.safe_load((PROFILE_DIR / "localregistry.yaml").read_text())
    data["container"].update(change.pop("container", {}))
    data.update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as exc:
        load_profile(str(path))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_job_script_writes_credentials_by_name_and_starts_the_container_once(tmp_path):
    out = vitpod("render", "--cluster", "localregistry", *JOB, runs=tmp_path / "runs")
    assert out.returncode == 0, out.stderr
    script = Path(out.stdout.strip().splitlines()[-1]).read_text()
    assert "password $VITPOD_REGISTRY_PASSWORD'" in script  # expanded by enroot, on the node
    assert "export ENROOT_CONFIG_PATH=$VITPOD_ENROOT_CONFIG" in script
    assert script.count('--container-name="$VITPOD_CONTAINER"') == 1  # the start step's
    assert 'export PYXIS_CONTAINER_NAME="$VITPOD_CONTAINER"' in script  # the ranks' step
    assert 'enroot remove -f "pyxis_$VITPOD_CONTAINER"' in script
    assert "container_start.json" in script


def test_enroot_paths_on_a_network_file_system_are_refused(monkeypatch):
    monkeypatch.setattr(
        containerpreflight,
        "enroot_paths_fs",
        lambda: [("ENROOT_DATA_PATH", "/lustre/enroot/data", "lustre")],
    )
    problems, _ = containerpreflight.check(load_profile("localpyxis"))
    assert any("ENROOT_DATA_PATH (/lustre/enroot/data) is on lustre" in p for p in problems)


def test_a_corrupt_sqsh_is_refused_before_submitting(tmp_path):
    bad = tmp_path / "corrupt.sqsh"
    bad.write_bytes(os.urandom(8192))
    problem = containerpreflight.squashfs_problem(str(bad))
    assert problem and "is not a readable squashfs" in problem


def test_a_missing_digest_is_explicit_with_the_reason(tmp_path, capsys):
    from vitpod.workflows.jobs.rundir import image_info

    data = yaml.safe_load((PROFILE_DIR / "localpyxis.yaml").read_text())
    data["container"]["image"] = str(tmp_path / "never-built.sqsh")
    path = tmp_path / "nodigest.yaml"
    path.write_text(yaml.safe_dump(data))
    info = image_info(load_profile(str(path)))
    assert info is not None and info["digest"] is None
    assert "make container" in info["digest_missing"]
    assert "warning: container image digest unknown" in capsys.readouterr().err


# --------------------------------------------------------------------------- the live registry


@pytest.fixture(scope="session")
def registry_env(pyxis_slurm) -> dict[str, str]:
    """The local registry up (registry.sh start is idempotent) and its registry.env read."""
    out = subprocess.run(["bash", str(REGISTRY_SH), "start"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    env_file = pyxis_slurm.state / "registry.env"
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    values = dict(re.findall(r"^export (\w+)=(\S+)$", env_file.read_text(), re.M))
    assert {"VITPOD_REGISTRY_USER", "VITPOD_REGISTRY_PASSWORD"} <= set(values)
    return user_env(env=values)


@pytest.fixture(scope="session")
def pushed(registry_env) -> str:
    """`make container CLUSTER=localregistry PUSH=1`: the pinned reference it prints."""
    env = {**registry_env, "IMAGE": None, "CLUSTER": "localregistry", "PUSH": "1"}
    out = subprocess.run(
        ["bash", str(BUILD)],
        cwd=REPO,
        env=user_env(env=env),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.slurm
def test_push_records_the_manifest_digest_the_registry_serves(pushed, registry_env):
    assert re.fullmatch(r"vitpod@127\.0\.0\.1:15000#vitpod/local@sha256:[0-9a-f]{64}", pushed)
    record = json.loads((REPO / ".cache" / "images" / "localregistry.pushed.json").read_text())
    assert record["registry"]["ref"] == pushed
    ref = registryref.parse(pushed)
    assert ref is not None
    os.environ["VITPOD_REGISTRY_PASSWORD"] = registry_env["VITPOD_REGISTRY_PASSWORD"]
    try:
        assert registryref.check_manifest(ref, "VITPOD_REGISTRY_PASSWORD") == ref.digest
    finally:
        del os.environ["VITPOD_REGISTRY_PASSWORD"]


@pytest.mark.slurm
@pytest.mark.parametrize("bad", ["password", "digest", "registry"])
def test_bad_registry_input_is_refused_before_anything_queues(pushed, registry_env, tmp_path, bad):
    env = dict(registry_env)
    image = pushed
    if bad == "password":
        env["VITPOD_REGISTRY_PASSWORD"] = "not-the-password"
    elif bad == "digest":
        image = pushed.rsplit("@", 1)[0] + "@" + DIGEST
    else:
        image = pushed.replace(":15000", ":1")
    profile = container_profile_copy(tmp_path, "localregistry", container={"image": image})
    out = vitpod("submit", "--cluster", str(profile), *JOB, runs=tmp_path / "runs", env=env)
    want = {"password": "(HTTP 401)", "digest": "(HTTP 404)", "registry": "is unreachable"}[bad]
    assert out.returncode == 2 and want in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert registry_env["VITPOD_REGISTRY_PASSWORD"] not in out.stderr + out.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def password_anywhere(root: Path, env: dict[str, str]) -> list[Path]:
    """Files under root holding the password, plain or as enroot's Basic token."""
    secret = env["VITPOD_REGISTRY_PASSWORD"]
    token = base64.b64encode(f"{env['VITPOD_REGISTRY_USER']}:{secret}".encode()).decode()
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and any(s.encode() in p.read_bytes() for s in (secret, token))
    ]


@pytest.mark.slurm
@pytest.mark.slow
def test_every_rank_runs_in_the_image_pulled_by_digest_started_once_per_node(
    pushed, registry_env, tmp_path
):
    profile = container_profile_copy(tmp_path, "localregistry", container={"image": pushed})
    out = vitpod(
        "submit", "--cluster", str(profile), *JOB, runs=tmp_path / "runs", env=registry_env
    )
    job, run_dir = submitted(out)
    assert wait_job(job, timeout=900) == "COMPLETED", (run_dir / "logs").iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    provenance = manifest["image"]["digest"]
    assert manifest["image"]["manifest_digest"] == pushed.rsplit("@", 1)[1]
    assert any("registry image" in c and "answers" in c for c in manifest["preflight"])
    for log in rank_logs(run_dir, job):
        assert re.findall(r"^container: (\S+)$", log, re.M) == [provenance], log
    start = json.loads((run_dir / "container_start.json").read_text())
    assert sorted(start["nodes"]) == ["node1", "node2"]
    for node in start["nodes"].values():
        assert 0 < node["warm_s"] < node["cold_s"]
    assert not (run_dir / "enroot").exists()  # the credentials file is gone with the job
    for node in ("node1", "node2"):  # so are the job's named containers
        listed = subprocess.run(
            ["enroot", "list"], env={**os.environ, "SLURMD_NODENAME": node}, capture_output=True,
            text=True,
        ).stdout  # fmt: skip
        assert f"pyxis_vitpod-{job}-" not in listed
    assert password_anywhere(tmp_path, registry_env) == []


@pytest.mark.slurm
@pytest.mark.slow
def test_a_node_that_cannot_pull_stops_the_job_before_any_rank(pushed, registry_env, tmp_path):
    """Only the node can tell (preflight skipped: `render`, then sbatch): one line, no rank."""
    profile = container_profile_copy(
        tmp_path, "localregistry", container={"image": pushed.rsplit("@", 1)[0] + "@" + DIGEST}
    )
    out = vitpod(
        "render", "--cluster", str(profile), *JOB, runs=tmp_path / "runs", env=registry_env
    )
    script = Path(out.stdout.strip().splitlines()[-1])
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        env=registry_env, capture_output=True, text=True, check=True, cwd=script.parent,
    ).stdout.strip()  # fmt: skip
    assert wait_job(job, timeout=600) == "FAILED"
    log = (script.parent / "logs" / f"sbatch-{job}-restart0.log").read_text()
    assert "vitpod: error: the container did not start on every node" in log
    assert not list((script.parent / "logs").glob("train-*"))
    assert not (script.parent / "enroot").exists()
    assert password_anywhere(tmp_path, registry_env) == []


def test_the_registry_scripts_are_shellcheck_clean():
    push = REPO / "containers" / "push.sh"
    subprocess.run(["shellcheck", str(REGISTRY_SH), str(push)], check=True)


@pytest.mark.slurm
def test_the_registry_stops_and_starts_on_its_own_idempotently(registry_env, pyxis_slurm):
    def run(action: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REGISTRY_SH), action], capture_output=True, text=True)

    pidfile = pyxis_slurm.state / "registry" / "registry.pid"
    assert run("stop").returncode == 0 and run("stop").returncode == 0
    assert run("status").returncode != 0 and not pidfile.exists()
    assert run("start").returncode == 0
    pid = pidfile.read_text()
    again = run("start")
    assert again.returncode == 0 and pidfile.read_text() == pid  # the same daemon, not a second
    assert run("status").returncode == 0
    # The password is unchanged: registry.env still opens the registry.
    values = dict(
        re.findall(r"^export (\w+)=(\S+)$", (pyxis_slurm.state / "registry.env").read_text(), re.M)
    )
    assert values["VITPOD_REGISTRY_PASSWORD"] == registry_env["VITPOD_REGISTRY_PASSWORD"]
