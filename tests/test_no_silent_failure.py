"""Issue 30, finding 10: each failure that used to vanish is reported or handled.

- containerpreflight: an unsquashfs that cannot run is a problem, not "readable"; an enroot.conf
  value is expanded without a shell, and one that cannot be expanded is reported as not checked.
- goodput: a failed sacct marks the ledger INCOMPLETE instead of passing it off as complete.
- chain: a failed submission whose jobs cannot be cancelled keeps the pipeline directory.
- ds_universal: a storage error while converting is an OSError, not "cannot convert".
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vitpod.trainer.checkpointing import ds_universal
from vitpod.workflows import slurm
from vitpod.workflows.containers import containerpreflight
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.site.profile import load_profile
from vitpod.workflows.watching import goodput


def _tool(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(text)
    path.chmod(0o755)
    return path


# ---- containerpreflight


def test_an_unsquashfs_that_cannot_run_is_a_problem_not_a_readable_image(tmp_path, monkeypatch):
    image = tmp_path / "image.sqsh"
    image.write_bytes(b"\0" * 4096)
    # an unsquashfs that is not a program (a broken install): exec fails with ENOEXEC
    _tool(tmp_path / "bin", "unsquashfs", "\x7fELF garbage, not a program\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # alone: exec would try the next one
    problem = containerpreflight.squashfs_problem(str(image))
    assert problem and "could not be checked (unsquashfs -s:" in problem
    assert "Exec format error" in problem and "\n" not in problem


def _enroot_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: str, run: str) -> None:
    conf = tmp_path / "sysconf"
    conf.mkdir()
    (conf / "enroot.conf").write_text(
        f"ENROOT_RUNTIME_PATH {run}\nENROOT_DATA_PATH {data}\nENROOT_MOUNT_HOME no\n"
    )
    monkeypatch.setenv("ENROOT_SYSCONF_PATH", str(conf))


def test_enroot_conf_values_run_no_command_and_unexpandable_ones_are_reported(
    tmp_path, monkeypatch, capsys
):
    marker = tmp_path / "PWNED"
    monkeypatch.delenv("VITPOD_NOT_SET", raising=False)
    _enroot_conf(tmp_path, monkeypatch, data=f"/tmp/x$(touch {marker})", run="${VITPOD_NOT_SET}/e")
    _, done = containerpreflight.check(load_profile("localpyxis"))
    assert not marker.exists()  # the value was never given to a shell
    unchecked = [line for line in done if line.startswith("NOT CHECKED: enroot's")]
    assert len(unchecked) == 2, done
    assert "ENROOT_DATA_PATH" in unchecked[1] and f"$(touch {marker})" in unchecked[1]
    assert "$VITPOD_NOT_SET is not set" in unchecked[0]
    assert capsys.readouterr().err.count("warning: enroot's") == 2
    assert containerpreflight.enroot_paths_fs() == []


def test_enroot_conf_values_expand_as_enroot_does(tmp_path, monkeypatch):
    monkeypatch.setenv("VITPOD_ENROOT_BASE", str(tmp_path))
    monkeypatch.delenv("VITPOD_ENROOT_NODE", raising=False)
    run = "$VITPOD_ENROOT_BASE/run/${VITPOD_ENROOT_NODE:-host}/user-$(id -u)"
    _enroot_conf(tmp_path, monkeypatch, data="${VITPOD_ENROOT_BASE}/data/$(id -u)", run=run)
    found = {key: path for key, path, _ in containerpreflight.enroot_paths_fs()}
    assert found == {
        "ENROOT_RUNTIME_PATH": f"{tmp_path}/run/host/user-{os.getuid()}",
        "ENROOT_DATA_PATH": f"{tmp_path}/data/{os.getuid()}",
    }
    assert containerpreflight.enroot_paths_unchecked() == []


# ---- goodput

needs_sacct = pytest.mark.skipif(shutil.which("sacct") is None, reason="sacct is not installed")


@needs_sacct
def test_a_failed_sacct_marks_the_ledger_incomplete(tmp_path, monkeypatch):
    # the real sacct, its accounting daemon unreachable (port 1): it fails at once
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=x\nSlurmctldHost=localhost\nAccountingStorageType=accounting_storage/slurmdbd\n"
        "AccountingStorageHost=127.0.0.1\nAccountingStoragePort=1\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(slurm.SlurmError, match=r"^`sacct -n -P -X -D -j 123 .*` failed \(exit 1: "):
        goodput.attempts(["123"])
    ledger = goodput.ledger(tmp_path, ["123"])
    assert not goodput.is_complete(ledger)
    assert ledger.notes[0].startswith("INCOMPLETE: `sacct -n -P -X -D -j 123")
    assert "failed (exit 1" in ledger.notes[0] and "[INCOMPLETE: `sacct" in ledger.line()
    assert ledger.as_dict()["notes"][0].startswith("INCOMPLETE")


def test_a_missing_sacct_marks_the_ledger_incomplete_and_no_jobs_is_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    ledger = goodput.ledger(tmp_path, ["123"])
    assert not goodput.is_complete(ledger)
    assert ledger.notes[0].startswith("INCOMPLETE: `sacct ")
    assert "could not run (sacct is not on PATH" in ledger.notes[0]
    # no job ids (no scheduler): nothing was asked, so nothing is missing
    assert goodput.is_complete(goodput.ledger(tmp_path, []))


# ---- chain


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and "pretrain" in out.stdout


SBATCH = """#!/bin/bash
# sbatch stand-in: the pretrain is accepted, the finetune (afterok) refused.
echo "sbatch $*" >>"$STUB_LOG"
if [[ "$*" == *--dependency* ]] || grep -q -- "--dependency" "${@: -1}"; then
  echo "sbatch: error: Batch job submission failed: Invalid dependency" >&2; exit 1
fi
if [[ "$*" == *--parsable* ]]; then echo 990001; else echo "Submitted batch job 990001"; fi
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >>"$STUB_LOG"
[ -z "${SCANCEL_FAILS:-}" ] && exit 0
echo "scancel: error: Unable to contact slurm controller" >&2
exit 1
"""


@pytest.mark.skipif(not _slurm_answers(), reason="the local Slurm is not up (make slurm-up)")
@pytest.mark.parametrize("scancel_fails", [True, False], ids=["cancel-fails", "cancel-works"])
def test_a_failed_pipeline_submission_keeps_its_directory_when_cancelling_fails(
    tmp_path, monkeypatch, capsys, scancel_fails
):
    """The local Slurm answers the preflight's queries; sbatch and scancel are stand-ins (no job
    is queued): the finetune's submission fails after the pretrain was accepted."""
    stubs = tmp_path / "stubs"
    _tool(stubs, "sbatch", SBATCH)
    _tool(stubs, "scancel", SCANCEL)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "calls.log"))
    if scancel_fails:
        monkeypatch.setenv("SCANCEL_FAILS", "1")
    chain = Chain(cluster="localslurm", args="--epochs 1", run_root=str(tmp_path / "runs"))
    with pytest.raises(Exception, match="Invalid dependency|sbatch"):
        chain.submit()
    calls = (tmp_path / "calls.log").read_text()
    assert "scancel 990001" in calls  # the accepted pretrain was cancelled (or tried)
    directory = chain.directory
    assert directory is not None
    err = capsys.readouterr().err
    if scancel_fails:
        assert directory.is_dir() and (directory / "pipeline.json").is_file()
        assert "990001" in (directory / "pipeline.json").read_text()
        assert f"the pipeline directory {directory} is kept" in err
        assert "scancel 990001" in err
    else:
        assert not directory.exists() and "is kept" not in err


# ---- ds_universal


def _raising(exc: BaseException):
    def convert(ds_dir: Path, target: Path) -> None:  # fault injection: the storage fails here
        raise exc

    return convert


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EDQUOT])
def test_a_storage_error_while_converting_is_an_io_error_not_a_refusal(tmp_path, monkeypatch, code):
    (tmp_path / ds_universal.TAG).mkdir()
    monkeypatch.setattr(ds_universal, "convert", _raising(OSError(code, os.strerror(code))))
    with pytest.raises(OSError) as caught:
        ds_universal.ensure_universal(tmp_path, rank=0)
    assert caught.value.errno == code and not isinstance(caught.value, ds_universal.NotConvertible)
    assert str(tmp_path / ds_universal.TAG) in str(caught.value)


def test_a_checkpoint_problem_while_converting_is_still_not_convertible(tmp_path, monkeypatch):
    (tmp_path / ds_universal.TAG).mkdir()
    missing = FileNotFoundError(errno.ENOENT, "no such file", "mp_rank_00_model_states.pt")
    monkeypatch.setattr(ds_universal, "convert", _raising(missing))
    with pytest.raises(ds_universal.NotConvertible, match="cannot convert"):
        ds_universal.ensure_universal(tmp_path, rank=0)


def test_a_failed_conversion_leaves_no_partial_copy(tmp_path):
    """The real ds_to_universal on a folder it cannot read: its scratch folder is removed."""
    pytest.importorskip("deepspeed")
    ds_dir = tmp_path / ds_universal.TAG
    ds_dir.mkdir()
    (ds_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ds_universal.NotConvertible):
        ds_universal.ensure_universal(tmp_path, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ds_universal.TAG]
