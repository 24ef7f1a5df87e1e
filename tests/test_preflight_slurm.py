"""The preflight's Slurm-side checks held against Slurm's own verdict (`sbatch --test-only`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures_slurm import wait_usable
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning import preflight
from vitpod.workflows.planning.plan import JobPlan, Request, plan_job
from vitpod.workflows.planning.sbatchopts import SbatchOptions
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.slurm.partitions import SlurmSilent, partition_info

Change = Callable[[dict[str, Any]], None]


def _plan(tmp_path: Path, change: Change, name: str = "variant") -> JobPlan:
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    data["name"] = name
    change(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return plan_job(Request(cluster=str(path), run_root=str(tmp_path / "runs")))


def _ours(plan: JobPlan) -> str | None:
    """Our refusal (None: the preflight passes)."""
    try:
        preflight.check(plan)
    except ConfigError as exc:
        return str(exc)
    return None


def _slurms(plan: JobPlan, tmp_path: Path) -> str | None:
    """Slurm's refusal of the same script (None: it would start the job)."""
    script = tmp_path / "job.sbatch"
    script.write_text(plan.script)
    out = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
    )
    said = (out.stderr + out.stdout).strip()
    return None if out.returncode == 0 and "to start at" in said else said


def _set(**fields: Any) -> Change:
    return lambda data: data.update(fields)


def _partition(name: str) -> Change:
    return lambda data: data["partitions"]["pretrain"].update(name=name)


VARIANTS: dict[str, tuple[Change, str]] = {
    "too_many_nodes": (_set(nodes=3), "can give a job at most 2 node"),
    "bad_partition": (_partition("nosuch"), "partitions.pretrain.name='nosuch' does not exist"),
    "too_much_memory": (_set(mem="8000M"), "RealMemory MB"),
    "too_many_cpus": (_set(cpus_per_node=16), "CPUTot"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_refusal_agrees_with_sbatch_test_only(local_slurm, tmp_path, variant):
    change, expected = VARIANTS[variant]
    plan = _plan(tmp_path, change)
    ours, slurms = _ours(plan), _slurms(plan, tmp_path)
    assert slurms is not None, f"Slurm would start the {variant} job; the variant proves nothing"
    assert ours is not None and expected in ours, ours
    assert "\n" not in ours


def test_good_variant_passes_both(local_slurm, tmp_path):
    plan = _plan(tmp_path, lambda data: None)
    assert _slurms(plan, tmp_path) is None
    assert _ours(plan) is None


def test_drained_node_refused_like_slurm(local_slurm, tmp_path):
    plan = _plan(tmp_path, lambda data: None)
    node = "node2"
    drain = ["scontrol", "update", f"nodename={node}", "state=drain", "reason=vitpod-test"]
    try:
        subprocess.run(drain, check=True, timeout=30)
        ours, slurms = _ours(plan), _slurms(plan, tmp_path)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=30)
        wait_usable(node)
    assert slurms is not None and ours is not None
    assert "1 usable node(s)" in ours and f"{node}:drained" in ours, ours


def test_more_ranks_than_gpus_refused(local_slurm, tmp_path):
    plan = _plan(tmp_path, _set(gpus_per_node=1))
    ours = _ours(plan)
    assert ours is not None and "tasks_per_node=2 exceeds gpus_per_node=1" in ours


def test_account_and_qos_checked_against_associations(local_slurm, tmp_path):
    good = _ours(_plan(tmp_path, _set(account="root", qos="normal"), "good"))
    assert good is None
    ours = _ours(_plan(tmp_path, _set(account="nosuchaccount"), "badaccount"))
    assert ours is not None and "account='nosuchaccount' is not one of your" in ours
    ours = _ours(_plan(tmp_path, _set(account="root", qos="nosuchqos"), "badqos"))
    assert ours is not None and "qos='nosuchqos' is not allowed" in ours


def test_sbatch_test_only_takes_good_options_and_refuses_a_reservation_slurm_lacks(
    local_slurm, tmp_path
):
    def plan(options: SbatchOptions) -> JobPlan:
        return plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "runs"),
                                slurm=options))  # fmt: skip

    assert _ours(plan(SbatchOptions(extra="--comment='vitpod test' --mail-type=NONE"))) is None
    ours = _ours(plan(SbatchOptions(reservation="nosuchresv")))
    assert ours is not None and ours.startswith("sbatch --test-only refuses the job script"), ours
    assert "RESERVATION=nosuchresv given here" in ours and "\n" not in ours


def test_slurm_not_answering_is_an_error(local_slurm, tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    text = local_slurm.conf.read_text()
    conf.write_text(text.replace("SlurmctldPort=16817", "SlurmctldPort=1"))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(SlurmSilent, match=r"^Slurm did not answer: `scontrol show partition"):
        partition_info("pretrain")


def test_failed_gres_query_is_not_zero_gpus(local_slurm, tmp_path, monkeypatch):
    """Only sinfo fails (a broken sinfo first on PATH): the refusal names Slurm, not '0 GPUs'."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sinfo").write_text("#!/bin/sh\necho 'sinfo: error: slurm_load_node' >&2\nexit 1\n")
    (fake / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    ours = _ours(_plan(tmp_path, lambda data: None))
    assert ours is not None and ours.startswith("Slurm did not answer: `sinfo -h -N")
    assert "offers 0" not in ours


def test_offline_preflight_skips_slurm_and_says_so(local_slurm, tmp_path):
    plan = _plan(tmp_path, _partition("nosuch"))
    done = preflight.check(plan, offline=True)
    assert any(line.startswith("OFFLINE: Slurm not asked") for line in done)
    assert _ours(plan) is not None


def test_run_root_floor(tmp_path):
    with pytest.raises(ConfigError, match="below"):
        preflight.check_run_root(tmp_path / "runs", need=1 << 60)
    assert "writable" in preflight.check_run_root(tmp_path / "runs")


@pytest.mark.parametrize(
    "argv",
    [["scaling", "--model", "volo_tiny", "--gpus", "1 2"], ["calibrate"]],
    ids=["scaling", "calibrate"],
)
def test_dry_run_of_a_sweep_or_calibration_preflights_prints_and_writes_nothing(
    local_slurm, tmp_path, capsys, argv
):
    from vitpod.workflows import cli

    root = tmp_path / "runs"
    root.mkdir()
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    assert cli.main([*argv, "--cluster", "localslurm", "--run-root", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert list(root.iterdir()) == []
    assert "#SBATCH --partition=" in out and "nothing written or submitted" in out
    after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    assert set(after.split()) <= set(queued.split())  # no job submitted
