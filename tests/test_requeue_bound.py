"""Bounded requeue and signals at any moment, without Slurm (issue 30, items 6 and 7).

The rendered teardown (the one requeue rule) run by bash with a stubbed `scontrol`: it requeues
while starts make progress, stops after preemption.max_requeues_without_progress starts in a row
without a new complete checkpoint (exit 1, saying why), and never requeues a job that is being
cancelled. The rendered job.sbatch run by bash with stubbed srun/scontrol: a SIGUSR2 while a step
before the ranks runs (here a slow `scontrol show hostnames`) starts no ranks and requeues. The
rendered bind.sh: a rank whose command dies of the signal before the trainer could handle it
leaves the requeue marker and exits 75. A profile whose grace_s is not below its time limit is
refused by `render` as typed, before anything is written. The live cases are in
tests/test_signals_slurm.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import vitpod, wait_until
from vitpod.registry import runfiles
from vitpod.workflows.planning import grace
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.watching import triage

JOB = "77"


def _profile(tmp_path: Path, **preemption: object) -> Path:
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["preemption"] = {**data["preemption"], **preemption}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan(tmp_path: Path, **preemption: object):
    return plan_job(Request(cluster=str(_profile(tmp_path, **preemption)), model="volo_tiny",
                            stage="pretrain", run_root=str(tmp_path / "runs")))  # fmt: skip


def _stubs(tmp_path: Path, state: str = "RUNNING", slow_hostnames: float = 0.0) -> Path:
    """scontrol and srun stand-ins that log their argv (one call a line) to CALLS."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f'echo "scontrol $*" >>{log}\n'
        'if [ "$1 $2" = "show hostnames" ]; then\n'
        f"  sleep {slow_hostnames}; echo node1; exit 0\n"
        "fi\n"
        f'if [ "$1 $2" = "show job" ]; then echo "JobId=$3 JobState={state} Reason=None"; fi\n'
    )
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >>{log}\nexit 0\n')
    for name in ("scontrol", "srun"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls"
    return log.read_text().splitlines() if log.exists() else []


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": JOB,
            "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1", **extra}  # fmt: skip


def _teardown(tmp_path: Path, env: dict[str, str], teardown: str, rc: int) -> tuple[int, str]:
    """Run the teardown lines as job.sbatch does right after srun exited `rc`."""
    script = tmp_path / "teardown.sh"
    script.write_text(f"#!/bin/bash\n(exit {rc})\n{teardown}\n")
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    return out.returncode, out.stdout + out.stderr


def _checkpoint(run: Path, step: int, committed: bool = True) -> None:
    directory = run / runfiles.CHECKPOINTS / f"step_{step:09d}"
    directory.mkdir(parents=True)
    (directory / runfiles.CHECKPOINT_RANK0).write_text("{}")
    if committed:
        (directory / runfiles.CHECKPOINT_COMMIT).write_text("{}")


def _requeues(tmp_path: Path) -> int:
    return sum(1 for c in _calls(tmp_path) if c == f"scontrol requeue {JOB}")


def test_requeue_stops_after_n_starts_without_a_new_checkpoint(tmp_path):
    plan = _plan(tmp_path, max_requeues_without_progress=2)
    run = Path(plan.spec.run_dir)
    (run / runfiles.LOGS).mkdir(parents=True)
    teardown = "\n".join(plan.launch.teardown_lines)
    env = _env(_stubs(tmp_path))
    progress = run / runfiles.REQUEUE_PROGRESS

    # Preempted before any checkpoint: requeued twice (2 allowed), the third start is not.
    for n in (1, 2):
        rc, out = _teardown(tmp_path, env, teardown, 75)
        assert rc == 0 and f"requeueing job {JOB}" in out, out
        assert _requeues(tmp_path) == n and progress.read_text() == f"{JOB} -1 {n}\n"
    rc, out = _teardown(tmp_path, env, teardown, 75)
    assert rc == 1 and _requeues(tmp_path) == 2, out
    assert "vitpod: error: not requeueing job 77: 3 starts in a row" in out
    assert "preemption.max_requeues_without_progress=2" in out and "make resume RUN=" in out
    # `make status` names the cause (triage reads the failed start's batch log).
    (run / runfiles.LOGS / f"sbatch-{JOB}-restart2.log").write_text(out)
    found = triage.diagnose(run / runfiles.LOGS, "FAILED", "1:0")
    assert found is not None and found.cause.startswith("requeue stopped"), found

    # A start that left a newer complete checkpoint resets the count; one that left only an
    # unfinished step directory (no COMMIT.json) is no progress.
    _checkpoint(run, 10)
    rc, out = _teardown(tmp_path, env, teardown, 75)
    assert rc == 0 and _requeues(tmp_path) == 3 and progress.read_text() == f"{JOB} 10 0\n"
    _checkpoint(run, 20, committed=False)
    for n in (1, 2):
        assert _teardown(tmp_path, env, teardown, 75)[0] == 0
        assert progress.read_text() == f"{JOB} 10 {n}\n"
    assert _teardown(tmp_path, env, teardown, 75)[0] == 1 and _requeues(tmp_path) == 5

    # Another job of the run (make resume) starts counting afresh.
    rc, out = _teardown(tmp_path, {**env, "SLURM_JOB_ID": "78"}, teardown, 75)
    assert rc == 0 and "requeueing job 78" in out and progress.read_text() == "78 10 1\n"

    # Checkpoints written before commit markers existed: any step_N counts.
    (run / runfiles.CHECKPOINTS / "step_000000020").rename(run / "aside")
    for directory in (run / runfiles.CHECKPOINTS).iterdir():
        (directory / runfiles.CHECKPOINT_COMMIT).unlink()
    _checkpoint(run, 30, committed=False)
    assert _teardown(tmp_path, env, teardown, 75)[0] == 0
    assert progress.read_text() == f"{JOB} 30 0\n"


def test_no_requeue_of_a_job_being_cancelled_nor_on_an_ordinary_exit(tmp_path):
    plan = _plan(tmp_path)
    run = Path(plan.spec.run_dir)
    (run / runfiles.LOGS).mkdir(parents=True)
    teardown = "\n".join(plan.launch.teardown_lines)
    env = _env(_stubs(tmp_path, state="COMPLETING"))
    rc, out = _teardown(tmp_path, env, teardown, 75)
    assert rc == 75 and _requeues(tmp_path) == 0, out
    assert "job 77 is COMPLETING (cancelled or at its time limit): not requeueing" in out
    rc, out = _teardown(tmp_path, env, teardown, 1)
    assert rc == 1 and "srun exited with status 1" in out and _requeues(tmp_path) == 0


def _script(tmp_path: Path) -> Path:
    from vitpod.workflows.submit.submission import materialize

    return materialize(_plan(tmp_path))


def test_usr2_before_the_ranks_start_requeues_without_starting_them(tmp_path):
    """The signal lands while the batch script waits on `scontrol show hostnames` (the
    rendezvous line): no srun of the ranks, a requeue, exit 0; sent to the process group, as
    `scancel --full` does, the slow step dies of it too."""
    script = _script(tmp_path)
    for group in (False, True):
        tmp = tmp_path / f"group{int(group)}"
        tmp.mkdir()
        env = _env(_stubs(tmp, slow_hostnames=3))
        proc = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True)

        def started(tmp: Path = tmp, proc: subprocess.Popen = proc) -> bool:
            if "scontrol show hostnames node1" in _calls(tmp):
                return True
            assert proc.poll() is None, _calls(tmp)
            return False

        wait_until("the script to ask for the hostnames", started, 20, interval=0.05)
        if group:
            os.killpg(proc.pid, signal.SIGUSR2)
        else:
            os.kill(proc.pid, signal.SIGUSR2)
        assert proc.wait(timeout=30) == 0
        log = (script.parent / "logs" / f"sbatch-{JOB}-restart0.log").read_text()
        assert "vitpod: SIGUSR2 before the ranks started: the ranks do not start" in log, log
        assert f"preempted (SIGUSR2 before the ranks started); requeueing job {JOB}" in log
        assert not any(c.startswith("srun") for c in _calls(tmp)), _calls(tmp)
        assert _requeues(tmp) == 1
        (script.parent / runfiles.REQUEUE_PROGRESS).unlink()
        (script.parent / "logs" / f"sbatch-{JOB}-restart0.log").unlink()


@pytest.mark.parametrize(
    ("sig", "who"),
    [("SIGUSR2", "step"), ("SIGUSR2", "command only"), ("SIGTERM", "command, then bind.sh")],
)
def test_a_rank_killed_by_the_signal_before_its_handler_leaves_the_marker(tmp_path, sig, who):
    """bind.sh traps from its first line: a command that dies of the preemption signal (the
    trainer before it installed its handler) counts as preempted: the marker, and exit 0 (the
    teardown counts the marker as 75). Whether the signal reaches every process of the step at
    once or the command first: Slurm's linuxproc process tracking signals children first, so
    bind.sh can see its command die before its own copy arrives. SIGUSR2 alone
    suffices; SIGTERM (srun also ends a failed step's ranks with it, test_cluster_safety) counts
    once bind.sh's own copy arrives."""
    script = _script(tmp_path)
    run = script.parent
    env = _env(tmp_path, SLURM_LOCALID="0", SLURM_PROCID="0", SLURM_NTASKS="1",
               SLURM_RESTART_COUNT="0")  # fmt: skip
    started = tmp_path / "started"
    command = ["bash", "-c", f"touch {started}; exec sleep 20"]
    proc = subprocess.Popen(["bash", str(run / "bind.sh"), *command], env=env,
                            start_new_session=True, stdout=subprocess.PIPE, text=True)  # fmt: skip

    def touched() -> bool:
        if started.exists():
            return True
        assert proc.poll() is None
        return False

    wait_until("the command to start", touched, 20, interval=0.05)
    signum = getattr(signal, sig)
    if who == "step":
        os.killpg(proc.pid, signum)
    else:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signum)
        if who == "command, then bind.sh":
            time.sleep(0.3)
            os.kill(proc.pid, signum)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "preempted (exit 75): requeue marker left" in out, out
    assert (run / "logs" / f"requeue-{JOB}-restart0").exists()


def test_a_command_failing_on_its_own_leaves_no_marker(tmp_path):
    script = _script(tmp_path)
    run = script.parent
    env = _env(tmp_path, SLURM_LOCALID="0", SLURM_PROCID="0", SLURM_NTASKS="1",
               SLURM_RESTART_COUNT="0")  # fmt: skip
    proc = subprocess.run(["bash", str(run / "bind.sh"), "bash", "-c", "exit 3"], env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert not (run / "logs" / f"requeue-{JOB}-restart0").exists()


def test_grace_at_or_above_the_time_limit_is_refused_before_anything_is_written(tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["partitions"]["pretrain"]["time"] = "1"
    data["preemption"]["grace_s"] = 600
    profile = tmp_path / "short.yaml"
    profile.write_text(yaml.safe_dump(data))
    runs = tmp_path / "runs"
    out = vitpod("render", "--cluster", str(profile), "--run-root", str(runs), timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "preemption.grace_s=600 is not below partitions.pretrain.time='1' (60 s)" in lines[0]
    assert "set preemption.grace_s below 60" in lines[0]
    assert not runs.exists()
    data["preemption"]["grace_s"] = 59  # below the limit: accepted
    profile.write_text(yaml.safe_dump(data))
    out = vitpod("render", "--cluster", str(profile), "--run-root", str(runs), timeout=120)
    assert out.returncode == 0, out.stderr


def test_grace_under_the_last_runs_checkpoint_save_warns(tmp_path, capsys):
    """The newest run of the same model and stage measured a 45.5 s checkpoint save (its
    `timing` records): a grace under twice that is warned about with the value to use (91):
    grace_s=30 and 60 are, grace_s=91 is not."""
    old = tmp_path / "runs" / "20200101T000000Z-volo_tiny-pretrain-0a0a0a" / runfiles.METRICS
    old.mkdir(parents=True)
    (old / "rank0.jsonl").write_text(
        '{"kind": "timing", "event": "checkpoint", "step": 5, "seconds": 12.0}\n'
        '{"kind": "timing", "event": "checkpoint", "step": 10, "seconds": 45.5}\n'
    )
    line = grace.check_grace(_plan(tmp_path, grace_s=30))
    assert "preemption.grace_s=30 vs 45.5 s" in line and "WARNING" in line, line
    err = capsys.readouterr().err
    assert "warning: preemption.grace_s=30 vs 45.5 s" in err and "at least 91" in err, err
    line = grace.check_grace(_plan(tmp_path, grace_s=60))
    assert "WARNING: grace too short, use 91" in line, line
    capsys.readouterr()
    line = grace.check_grace(_plan(tmp_path, grace_s=91))
    assert "WARNING" not in line and capsys.readouterr().err == ""
