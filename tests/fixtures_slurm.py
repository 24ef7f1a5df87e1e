"""Fixtures for the real local Slurm cluster (owned by the cluster area)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, make, submitted, wait_until

UP = REPO / "workflows" / "localslurm" / "up.sh"
STATE = Path(os.environ.get("VITPOD_SLURM_STATE", REPO / ".slurm"))
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@dataclass(frozen=True)
class LocalSlurm:
    """The running two-node test cluster (nodes node1, node2; partitions pretrain, finetune)."""

    conf: Path
    state: Path

    def wait(self, job_id: str, timeout: float = 120) -> str:
        return wait_job(job_id, timeout)


def sacct_state(job_id: str) -> str | None:
    """The job's state in accounting ('COMPLETED', ...), or None if not recorded yet (or if
    sacct did not answer within a minute: a loaded machine)."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    lines = out.stdout.split()
    return lines[0].split()[0] if out.returncode == 0 and lines else None


def wait_job(job_id: str, timeout: float) -> str:
    """The job's final state per sacct, polled; cancelled, and the test failed, after `timeout`."""

    def finished() -> str | None:
        state = sacct_state(job_id)
        return state if state in FINISHED else None

    try:
        return wait_until(f"job {job_id} to finish", finished, timeout, interval=1)
    except AssertionError:
        subprocess.run(["scancel", job_id], check=False)
        raise


SLURM_FIXTURES = frozenset({"local_slurm", "two_clusters", "pyxis_slurm", "pyxis_image"})
"""A test needing one of these (or marked `slurm`) uses the one local cluster, which its tests
expect idle and some restart or drain."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """`make test` runs two pytest-xdist workers (--dist loadgroup): the tests that use the local
    Slurm form one group, run one after another on one worker, while the other worker runs the
    rest. Their jobs mostly wait (on Slurm, a requeue, a rank's imports on the shared cores);
    the other tests use the CPU meanwhile. Marked as each test is collected: xdist reads the
    marks in its own pytest_collection_modifyitems."""
    uses = set(getattr(item, "fixturenames", ())) & SLURM_FIXTURES
    if uses or item.get_closest_marker("slurm"):
        item.add_marker(pytest.mark.xdist_group("slurm"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under --dist loadgroup xdist marks a grouped test by suffixing its id with @group; a test
    on the local Slurm without it would run beside another on the same cluster."""
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker(
        "xdist_group"
    )
    if grouped and not item.nodeid.endswith("@slurm"):
        pytest.fail(
            "pytest-xdist did not group this local-Slurm test (its id lacks @slurm): check the "
            "pytest pin in pyproject.toml (pytest-xdist issue 1386)"
        )


@pytest.fixture(scope="session")
def local_slurm() -> LocalSlurm:
    """Start (or confirm) the local Slurm with localslurm/up.sh; skips only if not root."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm needs root (it starts munged, mariadbd, slurmdbd, slurmctld)")
    if shutil.which("slurmctld") is None and not Path("/usr/sbin/slurmctld").exists():
        pytest.fail("Slurm is not installed: run `make setup` (installs Debian's slurm packages)")
    out = subprocess.run(["bash", str(UP)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        pytest.fail(f"workflows/localslurm/up.sh failed:\n{out.stderr[-3000:]}")
    conf = STATE / "etc" / "slurm.conf"
    os.environ["SLURM_CONF"] = str(conf)
    return LocalSlurm(conf=conf, state=STATE)


def preempted_once_python(path: Path, then: str) -> Path:
    """A stand-in `python` for a profile: on its first start rank 0 is "preempted" (exit 75) and
    the other ranks die of SIGTERM, as when srun ends them, so srun reports 143 and only rank 0's
    requeue marker asks for the requeue. After the requeue it runs the shell line `then`."""
    path.write_text(
        "#!/bin/bash\n"
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        '  [ "$SLURM_PROCID" = 0 ] && exit 75\n'
        "  sleep 3; kill -TERM $$\n"
        "fi\n"
        f"{then}\n"
    )
    path.chmod(0o755)
    return path


def trainer_pid(job: str, rank: int) -> int:
    """The pid of `rank`'s trainer process in `job` (every local node is this host)."""
    want = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if cmd[1:3] == [b"-m", b"vitpod.trainer"] and want <= env:
            return int(pid)
    raise AssertionError(f"no trainer process of job {job} rank {rank}")


def queue_state(job: str) -> str:
    """The job's state in the queue ('PENDING', 'RUNNING', ...); '' once it has left it (sacct
    may keep saying REQUEUED for a requeued job cancelled while pending)."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def job_restarts(job: str) -> int | None:
    """Slurm's restart count of the job (`scontrol show job`); None once slurmctld purged it."""
    from vitpod.workflows import slurm

    records = slurm.scontrol_show("job", job)
    return int(records[0]["Restarts"]) if records else None


def wait_usable(node: str, timeout: float = 60) -> None:
    """After a resume the node answers again within seconds ('idle*' until then)."""
    from vitpod.workflows.slurm.partitions import partition_info

    def usable() -> bool:
        info = partition_info("pretrain")
        return info is not None and all(n.usable for n in info.nodes if n.name == node)

    wait_until(f"{node} usable", usable, timeout, 0.5)


def submit(tmp_path: Path, profile: Path, args: str, *variables: str) -> tuple[str, Path]:
    """`make pretrain` of volo_tiny with trainer ARGS on `profile`, run directories under
    tmp_path/runs: (job id, run directory)."""
    out = make("pretrain", f"CLUSTER={profile}", "MODEL=volo_tiny", f"ARGS={args}", *variables,
               runs=tmp_path / "runs", timeout=180)  # fmt: skip
    return submitted(out)


def kill_rank(job: str, rank: int) -> int:
    """SIGKILL the trainer process of `rank` of `job` (all nodes are this host)."""
    pid = trainer_pid(job, rank)
    os.kill(pid, signal.SIGKILL)
    return pid


def stop_slurmdbd() -> None:
    """Accounting gone, as when a site's slurmdbd is down (restart_slurm brings it back)."""
    pid = int((STATE / "run" / "slurmdbd.pid").read_text())
    os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    try:
        wait_until(f"slurmdbd {pid} to exit", gone, 10)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)


def restart_slurm() -> None:
    subprocess.run(["bash", str(UP)], check=True)


def rank_logs(run_dir: Path, job: str, restart: int = 0) -> list[str]:
    """The 4 ranks' logs of `job`'s start `restart` in a run directory."""
    logs = run_dir / "logs"
    return [(logs / f"train-{job}-restart{restart}-rank{r}.log").read_text() for r in range(4)]


CLUSTER2 = REPO / "workflows" / "localslurm" / "cluster2.sh"


@dataclass(frozen=True)
class TwoClusters:
    """Cluster 1 (vitpod: node1/node2) and cluster 2 (vitpod2: node3/node4), one slurmdbd."""

    first: str
    second: str

    @staticmethod
    def sacct(cluster: str, job_ids: list[str], fields: str) -> list[list[str]]:
        """`sacct -M CLUSTER` rows (allocations) of the jobs: what accounting says ran there."""
        out = subprocess.run(
            ["sacct", "-M", cluster, "-n", "-P", "-X", "-j", ",".join(job_ids), "-o", fields],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return [line.split("|") for line in out.stdout.splitlines() if line]


@pytest.fixture(scope="session")
def two_clusters(request: pytest.FixtureRequest) -> TwoClusters:
    """Cluster 1 as local_slurm starts it (left as it is when it answers), then cluster 2
    (cluster2.sh: its own controller and nodes, registered in the same slurmdbd)."""
    conf = STATE / "etc" / "slurm.conf"
    ping = subprocess.run(["scontrol", "ping"], env={**os.environ, "SLURM_CONF": str(conf)},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    if ping.returncode != 0 or "UP" not in ping.stdout:
        request.getfixturevalue("local_slurm")
    os.environ["SLURM_CONF"] = str(conf)
    out = subprocess.run(["bash", str(CLUSTER2)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VITPOD_SLURM_STATE": str(STATE)})  # fmt: skip
    if out.returncode != 0:
        pytest.fail(f"workflows/localslurm/cluster2.sh failed:\n{out.stderr[-3000:]}")
    return TwoClusters("vitpod", "vitpod2")
