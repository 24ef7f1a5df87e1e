"""Rank discovery from Slurm/torchrun variables, plus the local launcher the trainer tests share."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.zygote import LOAD_TIME_ENV, ForkedRank, zygote
from vitpod.trainer import dist as tdist

ROOT = Path(__file__).resolve().parents[1]
Rank = subprocess.Popen | ForkedRank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(nproc: int, args: list[str], log_dir: Path, fresh: bool = False) -> list[Rank]:
    """`python -m vitpod.trainer ARGS` once per rank with torchrun-style variables (gloo on CPU),
    forked from the session's zygote (tests/zygote.py says why); `fresh`: new interpreters."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    fresh = fresh or os.environ.get("VITPOD_TEST_FRESH_RANKS") == "1"
    procs: list[Rank] = []
    for rank in range(nproc):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **LOAD_TIME_ENV,
        }  # fmt: skip
        if not fresh:
            procs.append(zygote().start(args, env, ROOT, log_dir / f"rank{rank}.log"))
            continue
        log = open(log_dir / f"rank{rank}.log", "a")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "vitpod.trainer", *args],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
    return procs


def wait_ranks(procs: list[Rank], log_dir: Path, timeout: float = 240) -> list[int]:
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return codes


def run_ranks(nproc: int, args: list[str], log_dir: Path, timeout: float = 240) -> list[int]:
    return wait_ranks(start_ranks(nproc, args, log_dir), log_dir, timeout)


def last_step(run: Path) -> int:
    """The newest step rank 0 has logged (0 before the first)."""
    path = run / "metrics" / "rank0.jsonl"
    if not path.is_file():
        return 0
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((x["step"] for x in lines if x["kind"] == "step"), default=0)


def preempt_at(
    run: Path,
    step: int,
    procs: list[Rank],
    rank: int,
    signum: int = signal.SIGUSR2,
    timeout: float = 600,
) -> None:
    """`signum` to `rank` alone once rank 0 logged `step`: the others must learn it from it."""
    deadline = time.monotonic() + timeout
    while last_step(run) < step:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.02)
    procs[rank].send_signal(signum)


def logs(log_dir: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("rank*.log")))


@pytest.mark.parametrize(
    "nodelist,host",
    [("gpu[07-09,12],login1", "gpu07"), ("node1", "node1"), ("dgx[001-040]", "dgx001"),
     ("a-b[3,5]", "a-b3")],
)  # fmt: skip
def test_first_host_of_slurm_nodelist(nodelist: str, host: str) -> None:
    assert tdist.first_host(nodelist) == host


def test_slurm_variables_give_ranks_and_a_job_derived_port() -> None:
    env = tdist.detect(
        {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16",
         "SLURM_JOB_NODELIST": "dgx[03-04]", "SLURM_JOB_ID": "12345"}
    )  # fmt: skip
    assert (env.rank, env.local_rank, env.world_size, env.master_addr) == (9, 1, 16, "dgx03")
    assert env.master_port == 10000 + 12345 % 20000 and env.source == "slurm"


def test_torchrun_variables_win_over_slurm() -> None:
    env = tdist.detect(
        {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "7",
         "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 8, "h", 7)


def test_no_variables_is_a_single_process() -> None:
    env = tdist.detect({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
