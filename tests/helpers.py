"""What the tests share: one deadline loop, a run's metrics read back, the local launcher that
starts trainer ranks the way torchrun does, and make and vitpod run as a user runs them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.zygote import LOAD_TIME_ENV, ForkedRank, zygote
from vitpod.registry import runfiles
from vitpod.trainer.exitcodes import REQUEUE
from vitpod.workflows.site.profile import PROFILE_DIR

REPO = Path(__file__).resolve().parents[1]
Rank = subprocess.Popen | ForkedRank
T = TypeVar("T")
HOSTILE = "x$(touch $P)`touch $P`;touch $P;'q'&&touch $P|touch $P y"
"""A path part or value that runs `touch $P` if any shell evaluates it (the injection tests)."""
QUICK = [
    "--model", "volo_tiny", "--img-size", "32", "-b", "16", "--workers", "0", "--loader", "torch",
    "--epochs", "1", "--warmup-epochs", "0", "--max-steps", "1", "--checkpoint-every", "0",
    "--no-eval", "--aa", "", "--reprob", "0",
]  # fmt: skip
"""Trainer flags for one step of volo_tiny at 32 px, nothing else (no eval, no checkpoint)."""
SLURM_COMMANDS = ("sbatch", "salloc", "srun", "sinfo", "squeue", "scontrol", "sacct", "sacctmgr",
                  "scancel")  # fmt: skip


def wait_until(what: str, check: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """Poll `check` until it returns something true, and return that; after `timeout` seconds
    the test fails naming `what`. `check` may raise (an assert) to stop waiting at once."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)
    return found


def free_port() -> int:
    """A port the OS calls free; under pytest-xdist, one of this worker's share (port // 2 mod
    workers: Linux hands bind() odd ports), so two workers never pick the same one at once."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    mine = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port // 2 % workers == mine:
            return port


def step_records(run: Path, rank: int = 0) -> dict[int, dict]:
    """step -> `rank`'s record of it (a step logged twice, as after a resume: the later one),
    read as every consumer reads metrics (registry.runfiles: a torn last line is not there yet)."""
    return {r["step"]: r for r in runfiles.read_metrics(run, rank) if r["kind"] == "step"}


def last_step(run: Path) -> int:
    """The newest step rank 0 has logged (0 before the first)."""
    return max(step_records(run), default=0)


def logs(log_dir: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("rank*.log")))


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
            procs.append(zygote().start(args, env, REPO, log_dir / f"rank{rank}.log"))
            continue
        log = open(log_dir / f"rank{rank}.log", "a")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "vitpod.trainer", *args],
                cwd=REPO,
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


def preempt_at(
    run: Path,
    step: int,
    procs: list[Rank],
    rank: int,
    signum: int = signal.SIGUSR2,
    timeout: float = 600,
) -> None:
    """`signum` to `rank` alone once rank 0 logged `step`: the others must learn it from it."""

    def reached() -> bool:
        if last_step(run) >= step:
            return True
        assert all(p.poll() is None for p in procs), f"a rank ended before step {step}"
        return False

    wait_until(f"step {step} of {run}", reached, timeout, interval=0.02)
    procs[rank].send_signal(signum)


def launch_logs(run: Path) -> Path:
    """Where `train` puts the ranks' logs of `run`: beside it, one folder a run."""
    return run.parent / f"logs-{run.name}"


def train(nproc: int, run: Path, args: list[str], timeout: float = 900) -> Path:
    """The trainer with `args` on `nproc` local ranks, writing `run` (a run trained again
    resumes); fails with the ranks' logs unless every rank exits 0."""
    log_dir = launch_logs(run)
    codes = run_ranks(nproc, [*args, "--output", str(run)], log_dir, timeout)
    assert codes == [0] * nproc, logs(log_dir)
    return run


def preempted(
    nproc: int, run: Path, args: list[str], step: int, rank: int, timeout: float = 900
) -> int:
    """The trainer with `args` on `nproc` local ranks, `rank` alone sent SIGUSR2 once step
    `step` is logged: every rank must exit REQUEUE. Returns the newest step logged then."""
    log_dir = run.parent / f"logs-{run.name}-preempted"
    procs = start_ranks(nproc, [*args, "--output", str(run)], log_dir)
    preempt_at(run, step, procs, rank, timeout=timeout)
    assert wait_ranks(procs, log_dir, timeout) == [REQUEUE] * nproc, logs(log_dir)
    return last_step(run)


def user_env(runs: Path | None = None, env: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment as a user's shell has it: a calling make's flags (`make test`)
    left out, VITPOD_RUN_ROOT set to `runs` when given, `env` on top (None removes a name)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    if runs is not None:
        base["VITPOD_RUN_ROOT"] = str(runs)
    for name, value in (env or {}).items():
        if value is None:
            base.pop(name, None)
        else:
            base[name] = value
    return base


def make(
    *argv: str,
    runs: Path | None = None,
    env: dict[str, str | None] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`make -s ARGV` in the checkout as a user types it (user_env says with what)."""
    return _as_user(["make", "-s", "--no-print-directory", *argv], user_env(runs, env), timeout)


def vitpod(
    *argv: str,
    runs: Path | None = None,
    env: dict[str, str | None] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`vitpod ARGV` (`python -m vitpod.workflows`) from the checkout as a user runs it."""
    return _as_user([sys.executable, "-m", "vitpod.workflows", *argv], user_env(runs, env), timeout)


def _as_user(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def submitted(out: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    """(job id, run directory) of a successful submission: its `submitted batch job N` line and
    the script path its output ends with."""
    assert out.returncode == 0, out.stdout + out.stderr
    found = re.search(r"submitted batch job (\d+)", out.stdout)
    assert found, out.stdout
    return found[1], Path(out.stdout.strip().splitlines()[-1]).parent


def recording_slurm(tmp_path: Path) -> tuple[dict[str, str | None], Path]:
    """Slurm commands that only record their call (a line each in the returned file) and fail:
    the environment change (PATH) under which any call to Slurm is seen, and that file."""
    bin_dir, calls = tmp_path / "slurm-stubs", tmp_path / "slurm-calls"
    bin_dir.mkdir()
    for name in SLURM_COMMANDS:
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >>"{calls}"\nexit 1\n')
        stub.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, calls


def make_pipeline_offline(
    tmp_path: Path, *variables: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`make pipeline VARIABLES` with run directories under tmp_path/runs under recording_slurm:
    its result and the file of Slurm calls."""
    env, calls = recording_slurm(tmp_path)
    return make("pipeline", *variables, runs=tmp_path / "runs", env=env, timeout=120), calls


def one_rank_per_node(base: str = "localslurm") -> dict[str, Any]:
    """profile_copy changes for live jobs that need two nodes but not two ranks on each: one rank
    a node, free on both cores (both local nodes are this 2-core host). Half the start-up of
    2 x 2: every rank imports torch and timm (about 8 s of CPU here)."""
    fabric = yaml.safe_load((PROFILE_DIR / f"{base}.yaml").read_text())["fabric"]
    return {"tasks_per_node": 1, "binding": [{"local_rank": 0, "numa": 0, "cpus": "0-1"}],
            "fabric": {**fabric, "gpus_per_node": 1}}  # fmt: skip


def profile_copy(
    tmp_path: Path,
    base: str = "localslurm",
    name: str = "",
    data: Path | None = None,
    runs: Path | None = None,
    **changes: Any,
) -> Path:
    """The bundled profile `base` with `changes` (each replaces a field) and storage.data and
    storage.runs set to `data` and `runs` when given, written under tmp_path (as `name`.yaml,
    default `base`) for CLUSTER=FILE."""
    profile = yaml.safe_load((PROFILE_DIR / f"{base}.yaml").read_text())
    profile.update(changes)
    storage = {"data": data, "runs": runs}
    profile["storage"] = {**profile["storage"],
                          **{k: str(v) for k, v in storage.items() if v is not None}}  # fmt: skip
    path = tmp_path / f"{name or base}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def container_profile_copy(
    tmp_path: Path, base: str = "localpyxis", container: dict[str, Any] | None = None, **changes
) -> Path:
    """profile_copy of a container profile whose `container` section is updated (its other
    fields kept), other fields replaced by `changes`."""
    bundled = yaml.safe_load((PROFILE_DIR / f"{base}.yaml").read_text())["container"]
    return profile_copy(tmp_path, base, container={**bundled, **(container or {})}, **changes)


def hostile_profile(tmp_path: Path, base: str, **changes: Any) -> tuple[Path, Path]:
    """A copy of a bundled profile whose every path lies under a HOSTILE directory: (the
    profile, that directory)."""
    root = tmp_path / f"root{HOSTILE}"
    (root / "code").mkdir(parents=True)
    storage = {"data": f"{root}/data", "runs": f"{root}/runs", "code": f"{root}/code"}
    env = {"OMP_NUM_THREADS": "1", "VITPOD_HOSTILE": HOSTILE}
    changes = {"storage": storage, "env": env, **changes}
    return profile_copy(tmp_path, base, f"{base}-hostile", **changes), root
