"""MASTER_PORT: from the job id, below the node's ephemeral ports; rank 0 refuses a taken one."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from vitpod.workflows.planning.masterport import master_port, master_port_span
from vitpod.workflows.planning.plan import Request, plan_job


def _launch(tmp_path):
    plan = plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "runs")))
    plan.run_dir.mkdir(parents=True)
    plan.launch.write_bind_script()
    return plan.launch


def _first_ephemeral() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


@pytest.mark.parametrize("job_id", [1, 12345, 19999, 22767, 10**6 + 7])
def test_port_is_below_the_ephemeral_range_and_shell_agrees(tmp_path, job_id):
    setup = "\n".join(_launch(tmp_path).setup_lines)
    script = f"{setup}\necho $MASTER_PORT"
    env = {**os.environ, "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": "node1"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    port = int(out.stdout.split()[-1])
    assert port == master_port(job_id)
    assert 10000 <= port < _first_ephemeral()


def test_span_follows_the_ephemeral_start():
    assert master_port_span(32768) == 20000
    assert master_port_span(20000) == 10000  # a lower ephemeral start narrows the range
    assert master_port_span(5000) == 1000


def _bind(tmp_path, port: int) -> subprocess.CompletedProcess[str]:
    launch = _launch(tmp_path)
    env = {**os.environ, "SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_JOB_ID": "7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    return subprocess.run(
        ["bash", launch.bind_path, "true"], capture_output=True, text=True, env=env, timeout=30
    )


def test_rank_zero_refuses_a_taken_port(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = _bind(tmp_path / "a", port)
    assert taken.returncode == 1
    assert f"MASTER_PORT {port} is taken" in taken.stderr
    free = _bind(tmp_path / "b", port)
    assert free.returncode == 0, free.stderr
