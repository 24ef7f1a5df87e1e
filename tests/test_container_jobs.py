"""Every rank inside a real enroot container through pyxis (profile localpyxis), and the pyxis
pitfalls proven inside real containers: image variables, home, requeue, unprivileged users."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.fixtures_container import unprivileged_user
from tests.fixtures_slurm import preempted_once_python, rank_logs, wait_job
from tests.helpers import container_profile_copy, submitted, vitpod
from vitpod.node.rankinfo import PREFIX
from vitpod.workflows import cli
from vitpod.workflows.planning.plan import plan_job

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slurm
IMAGE_OMP = "1"  # containers/Dockerfile: ENV OMP_NUM_THREADS=1
PROFILE_ENV = {"OMP_NUM_THREADS": "3"}  # the image says 1: the profile must win


def submit(tmp_path: Path, profile: Path, entry: str = "rankinfo") -> tuple[str, Path]:
    out = vitpod("submit", "--cluster", str(profile), "--model", "volo_tiny", "--entry", entry,
                 runs=tmp_path / "runs", timeout=120)  # fmt: skip
    return submitted(out)


def srun_in_container(srun_args: list[str], command: str, **env: str) -> str:
    """One task on one node with `srun_args`, running `command` in bash; its stdout."""
    out = subprocess.run(
        ["srun", "-N1", "-n1", "--time=3", *srun_args, "bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_srun_and_sbatch_list_the_pyxis_options(pyxis_slurm):
    for tool in ("srun", "sbatch"):
        text = subprocess.run([tool, "--help"], capture_output=True, text=True).stdout
        assert "--container-image" in text and "--container-env" in text, tool


def test_every_rank_runs_in_the_image_and_logs_its_digest(pyxis_image, tmp_path):
    profile = container_profile_copy(tmp_path, env=PROFILE_ENV)
    job, run_dir = submit(tmp_path, profile)
    assert pyxis_image.path.is_file() and not Path("/etc/vitpod-image.json").exists()
    assert pyxis_image  # the image exists; the host has no provenance file: only the image does
    assert wait_job(job, timeout=400) == "COMPLETED"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["image"]["digest"] == pyxis_image.digest
    assert manifest["image"]["path"] == str(pyxis_image.path)
    flags = manifest["resolved"]["srun_args"]
    assert f"--container-image={pyxis_image.path}" in flags
    assert "--no-container-mount-home" in flags and "--mpi=pmi2" in flags
    mounts = next(f for f in flags if f.startswith("--container-mounts="))
    assert f"{run_dir.parent}:{run_dir.parent}" in mounts  # the run root, at the same path
    for rank, log in enumerate(rank_logs(run_dir, job)):
        assert re.findall(r"^container: (\S+)$", log, re.M) == [pyxis_image.digest], log
        facts = json.loads(next(x for x in log.splitlines() if x.startswith(PREFIX))[len(PREFIX) :])
        assert facts["RANK"] == str(rank) and facts["WORLD_SIZE"] == "4"
        # pyxis pitfall: the image's ENV OMP_NUM_THREADS=1 would win over the job's export; the
        # profile's value reaches the rank because vitpod names it in --container-env.
        assert facts["OMP_NUM_THREADS"] == "3"


def test_image_variables_win_without_container_env(pyxis_image):
    """The pitfall is real: without --container-env the image's value replaces the job's."""
    image = f"--container-image={pyxis_image.path}"
    show = "echo OMP=$OMP_NUM_THREADS"
    assert srun_in_container([image], show, OMP_NUM_THREADS="3").split() == [f"OMP={IMAGE_OMP}"]
    named = [image, "--container-env=OMP_NUM_THREADS"]
    assert srun_in_container(named, show, OMP_NUM_THREADS="3").split() == ["OMP=3"]


@pytest.mark.parametrize("mount_home", [False, True])
def test_home_is_mounted_only_when_asked(pyxis_image, tmp_path, mount_home):
    profile = container_profile_copy(
        tmp_path, container={"mount_home": mount_home}, env=PROFILE_ENV
    )
    (tmp_path / "runs").mkdir()
    ns = cli.stage_parser("render").parse_args(
        ["--cluster", str(profile), "--model", "volo_tiny", "--entry", "rankinfo"]
        + ["--run-root", str(tmp_path / "runs")]
    )
    flags = list(plan_job(cli.request(ns)).launch.srun_args)
    flags = [f for f in flags if not f.startswith(("--mpi", "--wait"))]
    marker = Path.home() / f".vitpod-home-marker-{os.getpid()}"
    marker.write_text("host home\n")
    try:
        seen = srun_in_container(flags, f"test -e {marker} && echo seen || echo absent")
    finally:
        marker.unlink()
    assert seen.split() == (["seen"] if mount_home else ["absent"])


@pytest.mark.slow
def test_requeue_after_preemption_starts_a_fresh_container(pyxis_image, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    # The stand-in python lives in the run root (mounted in the container at the same path). The
    # first start leaves a file inside the container's own file system, rank 0 is preempted
    # (exit 75) and the job requeues; the restart must not see that file.
    then = (
        'test -e /var/tmp/vitpod-first-start && echo "container: stale" || true\n'
        'echo "restart=${SLURM_RESTART_COUNT:-0}"'
    )
    python = preempted_once_python(runs / "python-preempted-once", then=then)
    first_start = "= 0 ]; then\n"
    text = python.read_text()
    assert first_start in text
    python.write_text(
        text.replace(first_start, first_start + "  touch /var/tmp/vitpod-first-start\n", 1)
    )
    profile = container_profile_copy(tmp_path, container={"python": str(python)}, env=PROFILE_ENV)
    job, run_dir = submit(tmp_path, profile, entry="rankinfo")
    assert wait_job(job, timeout=600) == "COMPLETED"
    first = (run_dir / "logs" / f"sbatch-{job}-restart0.log").read_text()
    assert f"requeueing job {job}" in first
    for log in rank_logs(run_dir, job, restart=1):
        assert re.findall(r"^container: (\S+)$", log, re.M) == [pyxis_image.digest], log
        assert "restart=1" in log


def test_an_unprivileged_user_runs_a_container(pyxis_image):
    user = unprivileged_user()
    shared = Path(tempfile.mkdtemp(prefix="vitpod-unprivileged-", dir="/tmp"))
    shared.chmod(0o777)  # pytest's tmp_path is private to root
    out_file = shared / "out.txt"
    step = (
        f"srun --container-image={pyxis_image.path} --no-container-mount-home "
        "bash -c 'id -un; cat /etc/vitpod-image.json'"
    )
    job = subprocess.run(
        ["sbatch", "--parsable", f"--uid={user}", f"--gid={user}", "-N1", "-n1", "--time=3"]
        + [f"--output={out_file}", "--wrap", step],
        capture_output=True,
        text=True,
        cwd=shared,
        check=True,
    ).stdout.strip()
    state = wait_job(job, timeout=300)
    lines = out_file.read_text() if out_file.exists() else ""
    shutil.rmtree(shared, ignore_errors=True)
    assert state == "COMPLETED", lines
    assert lines.splitlines()[0] == user
    assert json.loads(lines.split("\n", 1)[1])["digest"] == pyxis_image.digest


def test_the_python_api_runs_every_rank_in_the_container(pyxis_image, tmp_path):
    from vitpod.workflows.pipeline.chain import Chain

    profile = container_profile_copy(tmp_path, env=PROFILE_ENV)
    run = Chain(
        str(profile),
        "volo_tiny",
        stages=("pretrain",),
        entry="rankinfo",
        run_root=str(tmp_path / "runs"),
    ).submit()
    record = run.stages["pretrain"]
    job = record.job_ids[0]
    assert wait_job(job, timeout=400) == "COMPLETED"
    logs = rank_logs(record.run_dir, job)  # the stage's job.sbatch, as make pretrain's
    assert len(logs) == 4
    for log in logs:
        assert re.findall(r"^container: (\S+)$", log, re.M) == [pyxis_image.digest]
    manifest = json.loads((record.run_dir / "manifest.json").read_text())
    assert manifest["image"]["digest"] == pyxis_image.digest


def test_the_python_api_starts_the_container_once_per_node(pyxis_image, tmp_path):
    """container.start_once on the Python API's path: one named container per node, measured cold
    and warm, and every rank's step runs inside it (its root is pyxis_<name> on its node)."""
    from vitpod.workflows.pipeline.chain import Chain

    profile = container_profile_copy(tmp_path, container={"start_once": True}, env=PROFILE_ENV)
    run = Chain(str(profile), "volo_tiny", stages=("pretrain",), entry="rankinfo",
                run_root=str(tmp_path / "runs")).submit()  # fmt: skip
    record = run.stages["pretrain"]
    job = record.job_ids[0]
    assert wait_job(job, timeout=600) == "COMPLETED", list((record.run_dir / "logs").iterdir())
    start = json.loads((record.run_dir / "container_start.json").read_text())
    assert sorted(start["nodes"]) == ["node1", "node2"]
    assert all(0 < n["warm_s"] < n["cold_s"] for n in start["nodes"].values())
    for log in rank_logs(record.run_dir, job):
        line = next(x for x in log.splitlines() if x.startswith(PREFIX))
        info = json.loads(line[len(PREFIX) :])
        root = info["container_root"] or ""  # .runtime/var/data/<node>/user-<uid>/pyxis_<name>
        assert root.endswith(f"/pyxis_vitpod-{job}-0"), root
        assert f"/{info['SLURMD_NODENAME']}/" in root, root
    for node in ("node1", "node2"):  # the teardown removed them
        listed = subprocess.run(["enroot", "list"], env={**os.environ, "SLURMD_NODENAME": node},
                                capture_output=True, text=True).stdout  # fmt: skip
        assert f"pyxis_vitpod-{job}-" not in listed
