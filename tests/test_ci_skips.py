"""The CI hook: under CI=true a skip fails unless it names GPU/CUDA/NCCL."""

from __future__ import annotations

import os
import subprocess
import sys

SAMPLE = """
import pytest

def test_needs_a_gpu():
    pytest.skip("no CUDA GPU here")

def test_needs_slurm():
    pytest.skip("sbatch not found")

@pytest.mark.xfail(reason="known")
def test_known_failure():
    assert False
"""


def _run(tmp_path, ci: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "CI": ci}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "tests.ci_skips", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, env=env, timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip


def test_ci_turns_skips_into_failures_except_the_allow_list(tmp_path):
    out = _run(tmp_path, "true")
    assert "1 failed, 1 skipped, 1 xfailed" in out.stdout, out.stdout
    assert "FAILED" in out.stdout and "sbatch not found" in out.stdout


def test_outside_ci_skips_stay_skips(tmp_path):
    out = _run(tmp_path, "")
    assert "2 skipped, 1 xfailed" in out.stdout, out.stdout
