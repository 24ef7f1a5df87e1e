"""Failure triage of causes provoked for real on the local Slurm: `make status` names each.

- a bad container mount: pyxis refuses a --container-mounts source that does not exist;
- exit 2: a class count that only the data, read by the ranks, contradicts;
- host memory: one rank's address space capped (RLIMIT_AS) after its imports;
- a hung rank: SIGSTOP to one rank's process, detected as stuck, then SIGCONT;
- preemption without requeue: USR2, the trainer checkpoints and exits 75;
- a time limit: a job with --time=1 that sleeps longer (Slurm ends it within about two minutes:
  its time limit is in whole minutes, checked every 30 s; it sleeps on no CPU, in parallel).
A killed rank is triaged in tests/test_progress_slurm.py; GPU-only causes in tests/test_triage.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_slurm import submit, trainer_pid
from tests.helpers import last_step, make, profile_copy, wait_until
from vitpod.workflows.watching import follow, status

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
TINY = "--loader torch --workers 0 --epochs 3"


def _sbatch(run: Path, *args: str) -> str:
    (run / "logs").mkdir(parents=True, exist_ok=True)
    job = subprocess.run(
        ["sbatch", "--parsable", "--partition=pretrain", "--ntasks=1",
         f"--output={run}/logs/sbatch-%j-restart0.log", *args],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (run / "manifest.json").write_text(json.dumps({"stage": "pretrain", "job_ids": [job]}))
    return job


def _status(tmp_path: Path, run: Path) -> str:
    out = make("status", f"RUN={run}", runs=tmp_path / "runs", timeout=120)
    return out.stdout + out.stderr


def _status_when_ended(tmp_path: Path, run: Path, timeout: float = 120) -> str:
    """`make status` once squeue no longer shows the job COMPLETING (sacct may say FAILED first);
    after `timeout` s, what it shows then (the caller's asserts say what is wrong)."""
    shown = [""]

    def ended() -> bool:
        shown[0] = _status(tmp_path, run)
        return "COMPLETING" not in shown[0]

    try:
        wait_until("the job to leave COMPLETING", ended, timeout, interval=2)
    except AssertionError:
        pass
    return shown[0]


def _tiny_image(tmp_path: Path) -> Path:
    """A busybox root file system as a squashfs image (enroot starts it)."""
    root = tmp_path / "rootfs"
    for sub in ("bin", "etc", "tmp", "proc", "sys", "dev"):
        (root / sub).mkdir(parents=True)
    busybox = root / "bin" / "busybox"
    busybox.write_bytes(Path("/bin/busybox").read_bytes())
    busybox.chmod(0o755)
    for name in ("sh", "true"):
        (root / "bin" / name).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    image = tmp_path / "tiny.sqsh"
    subprocess.run(["mksquashfs", str(root), str(image), "-quiet", "-noappend"], check=True)
    return image


def _memory_capped_python(path: Path) -> Path:
    """A stand-in `python`: rank 1 of the trainer runs with its address space capped at what its
    imports took plus 16 MiB, so an allocation of its first steps fails (ENOMEM: torch's
    "can't allocate memory", or MemoryError). Thread stacks are made small (ulimit -s, which
    glibc reads at start) so that the gloo and OpenMP threads still start under the cap, and
    oneDNN is off: under the cap it fails with its own "could not create a primitive", which
    names no cause; torch's own kernels allocate through its CPU allocator, which says ENOMEM."""
    cap = (
        "import resource, runpy, sys, torch, timm, vitpod.trainer.train; "
        "torch.backends.mkldnn.enabled = False; "
        "vm = int(open('/proc/self/statm').read().split()[0]) * 4096; "
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20),) * 2); "
        "sys.argv = ['vitpod.trainer', *sys.argv[1:]]; "
        "runpy.run_module('vitpod.trainer', run_name='__main__', alter_sys=True)"
    )
    path.write_text(
        "#!/bin/bash\n"
        'if [ "$SLURM_PROCID" = 1 ] && [ "$2" = vitpod.trainer ]; then\n'
        "  ulimit -s 256\n"
        f'  shift 2; exec {shlex.quote(sys.executable)} -c {shlex.quote(cap)} "$@"\nfi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    path.chmod(0o755)
    return path


def _variant(tmp_path: Path, data: Path, name: str, **changes) -> Path:
    return profile_copy(tmp_path, name=name, data=data, **changes)


def test_failures_provoked_on_slurm_are_named_with_their_fix(local_slurm, digits_dir, tmp_path):
    data = digits_dir.parent
    # Submitted first: the time limit ends it while the others run.
    slow = tmp_path / "slow"
    slow_job = _sbatch(slow, "--time=1", "--wrap", "sleep 600")

    mount = tmp_path / "mount"
    help_text = subprocess.run(["srun", "--help"], capture_output=True, text=True).stdout
    mount_job = None
    if "--container-image" in help_text:
        image = _tiny_image(tmp_path)
        mount_job = _sbatch(mount, "--wrap", shlex.join([
            "srun", f"--container-image={image}", "--container-mounts=/nonexistent-vitpod:/data",
            "true"]))  # fmt: skip

    no_requeue = _variant(
        tmp_path, data, "norequeue", preemption={"signal": "USR2", "grace_s": 30, "requeue": False}
    )
    hang_job, hang_run = submit(tmp_path, no_requeue, "--loader torch --workers 0 --epochs 20 "
                                 "--log-interval 1")  # fmt: skip
    # The causes found at startup need no second node: 2 ranks start, not 4 (each rank's
    # imports cost ~10 s of CPU on the 2 shared cores).
    one_node = _variant(tmp_path, data, "onenode", nodes=1)
    config_job, config_run = submit(tmp_path, one_node, f"{TINY} --num-classes 3")
    memory = _variant(
        tmp_path, data, "memory", nodes=1, python=str(_memory_capped_python(tmp_path / "py"))
    )
    # 256 images a rank: the first forward needs far more than the 16 MiB the rank has left.
    memory_job, memory_run = submit(tmp_path, memory, f"{TINY} --batch-size 256")

    # The hung rank: stopped, the stage shows as stuck; continued, it trains on.
    wait_until("step 5", lambda: last_step(hang_run) >= 5, timeout=600)
    pid = trainer_pid(hang_job, 1)
    os.kill(pid, signal.SIGSTOP)
    try:

        def stuck() -> bool:
            found = status.run_status(hang_run)[0].diagnosis
            return found is not None and found.cause.startswith("stuck")

        wait_until("a stopped rank to be called stuck", stuck, 300, interval=2)
        assert "stuck: no step for" in _status(tmp_path, hang_run)
        view = follow.Target(hang_run)  # the follow view's row says so too
        view.poll()
        assert view.rows[0].reason.startswith("stuck: no step for"), view.rows[0]
    finally:
        os.kill(pid, signal.SIGCONT)
    step = last_step(hang_run)
    wait_until("a step after SIGCONT", lambda: last_step(hang_run) > step + 2, timeout=300)
    assert status.run_status(hang_run)[0].diagnosis is None

    # Preempted without requeue: the trainer checkpoints and exits 75.
    subprocess.run(["scancel", "--signal=USR2", hang_job], check=True)
    assert local_slurm.wait(hang_job, timeout=600) != "COMPLETED"
    shown = _status_when_ended(tmp_path, hang_run)
    assert "cause: preempted (exit 75)" in shown and "preempted (SIGUSR2)" in shown, shown

    assert local_slurm.wait(config_job, timeout=600) == "FAILED"
    shown = _status_when_ended(tmp_path, config_run)
    assert "cause: bad configuration (exit 2)" in shown and "10 classes" in shown, shown
    assert "fix: fix the flag or path named in the error line" in shown

    assert local_slurm.wait(memory_job, timeout=600) == "FAILED"
    shown = _status_when_ended(tmp_path, memory_run)
    assert "cause: out of host memory" in shown, shown
    assert "rank1" in shown.split("cause: out of host memory")[1].split("fix:")[0], shown

    if mount_job is not None:
        assert local_slurm.wait(mount_job, timeout=300) == "FAILED"
        shown = _status_when_ended(tmp_path, mount)
        assert "cause: container import or mount failed (pyxis/enroot)" in shown, shown
        assert "source path does not exist: /nonexistent-vitpod" in shown, shown

    assert local_slurm.wait(slow_job, timeout=300) == "TIMEOUT"
    shown = _status_when_ended(tmp_path, slow)
    assert "cause: time limit reached" in shown and "DUE TO TIME LIMIT" in shown, shown
