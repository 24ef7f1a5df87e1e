"""`make doctor` on the local Slurm: full enroot path, drained node, --auto-exclude, doctor."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.fixtures_slurm import wait_usable
from tests.helpers import make, submitted, vitpod
from vitpod.analysis import calibrate as fitting
from vitpod.node.doctor import (
    image_check,
    read_records,
    record_lines,
    volatile_uncorrectable,
)
from vitpod.workflows.commands.doctor_allreduce import verdict
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR

# Each "node" reads its own enroot cache path: the doctor expands ${SLURMD_NODENAME} as enroot
# expands variables in its configuration.
CACHE = "ENROOT_CACHE_PATH"


def scontrol(*argv: str) -> None:
    subprocess.run(["scontrol", *argv], check=True, timeout=30)


@pytest.fixture
def full_node1(tmp_path) -> dict[str, str]:
    """node1's enroot cache on a tiny tmpfs filled to the last byte; node2's on the disk."""
    root = tmp_path / "enroot"
    (root / "node2").mkdir(parents=True)
    full = root / "node1"
    full.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 65536):
                pass
        except OSError:
            pass  # ENOSPC: full
        finally:
            os.close(fd)
        yield {CACHE: f"{root}/${{SLURMD_NODENAME}}/cache"}
    finally:
        subprocess.run(["umount", str(full)], check=False)


def test_ecc_counts_only_volatile_uncorrectable_errors():
    text = """
    ECC Errors
        Volatile
            SRAM Correctable              : 3
            SRAM Uncorrectable            : 2
            DRAM Uncorrectable            : 1
        Aggregate
            SRAM Uncorrectable            : 40
    """  # the layout of `nvidia-smi -q -d ECC` (NVIDIA nvidia-smi documentation, -q output)
    assert volatile_uncorrectable(text) == 3


@pytest.mark.skipif(shutil.which("mksquashfs") is None, reason="needs squashfs-tools")
def test_the_image_must_exist_and_read_as_squashfs(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "hello").write_text("hi")
    good = tmp_path / "good.sqsh"
    subprocess.run(["mksquashfs", str(tmp_path / "root"), str(good), "-quiet"], check=True)
    broken = tmp_path / "broken.sqsh"
    broken.write_bytes(b"not a squashfs image" * 100)
    assert image_check(str(good))["status"] == "ok"
    assert image_check(str(broken))["status"] == "bad"
    assert image_check(str(tmp_path / "missing.sqsh"))["detail"].endswith("no such file")
    assert image_check("nvcr.io#nvidia/pytorch:24.05-py3")["status"] == "skipped"


def calibration(bw: float, latency: float = 1e-5, overhead: float = 1e-4):
    """A stored fit of a 4-rank, 2-node world all-reduce (the local Slurm's layout)."""
    return fitting.Calibration(
        cluster="t", job_id="0", date="2026-11-23T00:00:00+00:00", backend="gloo", world_size=4,
        nodes=2, ranks_per_node=2, call_overhead=overhead, partition="pretrain",
        levels={"world": fitting.LevelFit(4, 2, latency, bw, 0.0)},
    )  # fmt: skip


def test_records_survive_srun_interleaving_the_nodes_lines():
    # srun forwards a line over 1 KiB in pieces: every record line stays short, and the lines
    # of two nodes read back in any interleaving (here alternating) give each node its checks.
    checks = {n: [{"check": f"disk {i}", "detail": "x" * 300, "status": "ok"} for i in range(9)]
              for n in ("node1", "node2")}  # fmt: skip
    lines = {n: record_lines(n, c) for n, c in checks.items()}
    assert all(len(line) < 1000 for ls in lines.values() for line in ls)
    mixed = [x for pair in zip(lines["node1"], lines["node2"], strict=True) for x in pair]
    assert read_records(["doctor: node1: ok: noise", *mixed]) == checks
    assert read_records(lines["node1"][:-1]) == {}  # a node whose record was cut is no answer


def test_allreduce_is_flagged_only_past_the_factor():
    cal = calibration(bw=1e9)  # 1 MiB: 0.1 ms + 6 x 10 us + 1.5 MiB / 1 GB/s = 1.73 ms
    bench = {"sizes": [2**20], "world_size": 4, "levels": {"world": {"median_s": {}}}}
    bench["levels"]["world"]["median_s"]["all_reduce"] = [3e-3]
    assert verdict(cal, bench) == (False, verdict(cal, bench)[1])
    assert "1.73 ms" in verdict(cal, bench)[1]
    bench["levels"]["world"]["median_s"]["all_reduce"] = [6e-3]
    slow, line = verdict(cal, bench)
    assert slow and line.endswith("3.5x > 3x")


def test_doctor_true_runs_the_checks_on_every_node_before_the_ranks(tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    path = tmp_path / "doctored.yaml"
    for doctor in (True, False):
        path.write_text(yaml.safe_dump({**data, "doctor": doctor}))
        plan = plan_job(Request(cluster=str(path), model="volo_tiny", run_root=str(tmp_path)))
        script = plan.script
        if doctor:
            assert script.index("vitpod/node/doctor.py") < script.index("-m vitpod.trainer")
            assert "--ntasks-per-node=1" in script and "exit 3" in script
            (tmp_path / "job.sbatch").write_text(script)
            lint = subprocess.run(["shellcheck", "-s", "bash", str(tmp_path / "job.sbatch")],
                                  capture_output=True, text=True)  # fmt: skip
            assert lint.returncode == 0, lint.stdout
        else:
            assert "doctor.py" not in script


@pytest.mark.slurm
def test_doctor_names_the_node_whose_enroot_path_is_full(local_slurm, full_node1):
    done = make("doctor", "CLUSTER=localslurm", "ARGS=--min-free-gb 0.1", env=full_node1)
    assert done.returncode != 0, done.stdout
    out = done.stdout
    assert re.search(r"doctor: node1: BAD: disk ENROOT_CACHE_PATH: .*node1/cache .*0\.00 GiB free",
                     out), out  # fmt: skip
    assert "doctor: node2: ok: all checks passed" in out
    assert "doctor: node1: skipped: gpu: no GPU tools" in out  # this machine has no GPU
    assert "bad node(s): node1\n" in out and "--exclude=node1" in out


@pytest.mark.slurm
def test_doctor_reports_a_drained_node_without_running_on_it(local_slurm):
    try:
        scontrol("update", "nodename=node2", "state=drain", "reason=vitpod-test")
        done = make("doctor", "CLUSTER=localslurm", "ARGS=--min-free-gb 0.1")
    finally:
        scontrol("update", "nodename=node2", "state=resume")
        wait_usable("node2")
    out = done.stdout
    drained = r"doctor: node2: BAD: slurm state \S*DRAIN\S* \(reason: vitpod-test[^)]*\); not run"
    assert re.search(drained, out), out
    assert "doctor: node2: ok: disk" not in out and "doctor: node1: ok: all checks passed" in out


@pytest.mark.slurm
def test_auto_exclude_submits_without_the_bad_node(local_slurm, full_node1, tmp_path):
    args = ("ARGS=--min-free-gb 0.1 --auto-exclude --nodes 1 --model volo_tiny "
            "--train-args '--max-steps 1 --workers 0 --loader torch'")  # fmt: skip
    env = {**full_node1, "VITPOD_RUN_ROOT": str(tmp_path / "runs")}
    done = make("doctor", "CLUSTER=localslurm", args, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"submitted batch job (\d+) \(--exclude=node1\)", done.stdout)[1]
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
        assert "ExcNodeList=node1" in shown.stdout
    finally:
        subprocess.run(["scancel", job], check=False)


@pytest.mark.slurm
def test_a_doctor_true_job_fails_early_naming_the_bad_node(local_slurm, full_node1, tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data.update(doctor=True, env={**data["env"], **full_node1})
    profile = tmp_path / "doctored.yaml"
    profile.write_text(yaml.safe_dump(data))
    argv = ["submit", "--cluster", str(profile), "--model", "volo_tiny", "--entry", "rankinfo"]
    job, run = submitted(vitpod(*argv, runs=tmp_path / "runs", timeout=120))
    assert local_slurm.wait(job, timeout=120) == "FAILED"
    logs = run / "logs"
    text = (logs / f"sbatch-{job}-restart0.log").read_text()
    assert re.search(r"doctor: node1: bad: disk ENROOT_CACHE_PATH", text), text
    assert "doctor: node2: bad" not in text and "a node failed its checks" in text
    assert not list(logs.glob("train-*")), "no rank may start after a failed check"


@pytest.mark.slurm
@pytest.mark.slow
def test_an_allreduce_slower_than_the_calibration_is_flagged(local_slurm, tmp_path):
    profile = tmp_path / "fast.yaml"
    profile.write_text((PROFILE_DIR / "localslurm.yaml").read_text())
    # A fit no network reaches (100 TB/s, 1 ns hops): the measured all-reduce must be flagged.
    fitting.save(calibration(bw=1e14, latency=1e-9, overhead=1e-7),
                 fitting.calibration_path(profile))  # fmt: skip
    env = {"VITPOD_RUN_ROOT": str(tmp_path / "runs")}
    done = make("doctor", f"CLUSTER={profile}", "ARGS=--min-free-gb 0.1", env=env)
    assert done.returncode != 0, done.stdout
    assert re.search(r"doctor: all-reduce: SLOW: 1 MiB over 4 ranks took [\d.]+ ms, calibrated",
                     done.stdout), done.stdout + done.stderr  # fmt: skip
    assert "doctor: 2 node(s) fine; the all-reduce is slow" in done.stdout
