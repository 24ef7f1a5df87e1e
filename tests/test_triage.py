"""Failure triage on log fixtures in the formats of their public sources (GPU-only causes) and
on Slurm's state strings; the live causes are provoked in tests/test_triage_slurm.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vitpod.workflows.watching import triage

FIXTURES = Path(__file__).parent / "fixtures" / "triage"


def _logs(tmp_path: Path, fixture: str) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    shutil.copy(FIXTURES / fixture, logs / "sbatch-7-restart0.log")
    return logs


@pytest.mark.parametrize(
    ("fixture", "cause", "line"),
    [
        ("cuda_oom.log", "out of GPU memory", "Tried to allocate 2.00 GiB"),
        ("nccl_watchdog.log", "NCCL timeout", "Watchdog caught collective operation timeout"),
        ("xid.log", "GPU fault (Xid)", "Xid (PCI:0000:3b:00): 79"),
        ("ecc.log", "GPU memory error (ECC)", "Xid (PCI:0000:86:00): 48"),
        ("enroot_401.log", "registry credentials refused", "401 Unauthorized"),
        ("pyxis_mount.log", "container import or mount failed", "enroot-mount: failed to mount"),
    ],
)
def test_gpu_and_container_causes_are_named_from_their_log_lines(tmp_path, fixture, cause, line):
    found = triage.diagnose(_logs(tmp_path, fixture), "FAILED", "1:0")
    assert found is not None and found.cause.startswith(cause)
    assert any(line in x and x.startswith("sbatch-7-restart0.log:") for x in found.lines)
    assert found.fix and "fix: " in "\n".join(found.text())


@pytest.mark.parametrize(
    ("state", "exit_code", "cause"),
    [
        ("OUT_OF_MEMORY", "0:125", "out of host memory"),
        ("TIMEOUT", "0:0", "time limit reached"),
        ("NODE_FAIL", "0:0", "node failure"),
        ("FAILED", "75:0", "preempted (exit 75)"),
        ("FAILED", "2:0", "bad configuration (exit 2)"),
    ],
)
def test_slurm_states_and_exit_codes_name_a_cause_without_log_lines(
    tmp_path, state, exit_code, cause
):
    (tmp_path / "logs").mkdir()
    found = triage.diagnose(tmp_path / "logs", state, exit_code)
    assert found is not None and found.cause == cause
    assert found.lines == (f"slurm: state {state} exit code {exit_code}",)


def test_no_known_cause_gives_none(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train-1-restart0-rank0.log").write_text("all is well\n")
    assert triage.diagnose(tmp_path / "logs", "FAILED", "1:0") is None


def _steps(path: Path, stamps: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(
        json.dumps({"kind": "step", "step": i + 1, "wall_time": t}) + "\n"
        for i, t in enumerate(stamps)
    ))  # fmt: skip


def test_a_rank_without_steps_for_n_median_step_times_is_stuck(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"log_interval": 5}))
    _steps(tmp_path / "metrics" / "rank0.jsonl", [100.0 + i for i in range(30)])  # 1 s a step
    _steps(tmp_path / "metrics" / "rank1.jsonl", [100.0 + i for i in range(25)])
    # rank1's newest step ended at 124: stuck once (10 + 5 held back by the log interval) x 1 s
    # has gone by.
    assert triage.stuck(tmp_path, factor=10, now=138.0) is None
    found = triage.stuck(tmp_path, factor=10, now=140.5)
    assert found is not None and found.cause.startswith("stuck: no step for 16 s")
    assert found.lines == ("rank1: newest step written 16 s ago",)
    assert triage.stuck(tmp_path, factor=20, now=140.5) is None


def test_every_make_target_a_fix_names_exists():
    """A fix that says `make X` names a target of the Makefile (one said `make check`)."""
    import re

    makefile = (Path(__file__).parent.parent / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    named = {t for rule in triage.RULES for t in re.findall(r"`make ([a-z][\w-]*)", rule.fix)}
    assert named and named <= targets, named - targets
