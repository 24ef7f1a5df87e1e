"""The one Slurm client (workflows/slurm/__init__.py): its parsers, its errors, and watching N jobs
costing the same number of Slurm calls for 5 jobs as for 500 (issue 31 item 3). No Slurm is run: the
client's runner is replaced by fakes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from vitpod.workflows import slurm
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.slurm import partitions

# A drained node as `scontrol show node --oneliner` prints it: blanks inside OS= and Reason=.
NODE = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=4 CPUTot=8 Gres=gpu:a100:8(S:0-1) "
    "OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01) RealMemory=64000 "
    "State=DRAINED Reason=ECC error on GPU 3 [root@2024-02-01T10:00:00] Comment=(null) Extra=\n"
)


def test_oneliner_keeps_values_with_spaces_and_empty_values():
    (node,) = slurm.oneliner(NODE)
    assert node["OS"] == "Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01)"
    assert node["Reason"] == "ECC error on GPU 3 [root@2024-02-01T10:00:00]"
    assert node["RealMemory"] == "64000" and node["Extra"] == "" and node["Comment"] == "(null)"


def test_partition_info_reads_scontrol_and_sinfo_through_the_client(monkeypatch):
    """The preflight's partition reader uses the one oneliner parser (it split on blanks)."""
    text = ("PartitionName=gpu AllowGroups=ALL Alternate=my part TotalNodes=4 MaxNodes=2 "
            "MaxTime=1-00:00:00\n")  # fmt: skip
    sinfo = "n1|IDLE|64000|8|gpu:8\n"

    def fake(argv, **_):
        return subprocess.CompletedProcess(argv, 0, text if argv[0] == "scontrol" else sinfo, "")

    monkeypatch.setattr(slurm, "runner", fake)
    info = partitions.partition_info("gpu")
    assert info is not None and (info.total_nodes, info.max_nodes) == (4, 2)
    assert info.max_minutes == 24 * 60 and info.gpus_per_node == 8
    assert slurm.oneliner(text)[0]["Alternate"] == "my part"


def test_nodes_the_backfill_scheduler_planned_count_as_usable(monkeypatch):
    """sinfo -N %T as Slurm 22.05 prints it while a pending job holds nodes (node2 'planned', or
    'mixed-'): Slurm still takes a job for them, so NODES=3 passes; down/drained ones do not."""
    text = "PartitionName=gpu TotalNodes=5 MaxNodes=UNLIMITED MaxTime=UNLIMITED\n"
    sinfo = (
        "node1|allocated|64000|8|gpu:8\nnode2|planned|64000|8|gpu:8\n"
        "node3|mixed-|64000|8|gpu:8\nnode4|drained|64000|8|gpu:8\nnode5|idle*|64000|8|gpu:8\n"
    )

    def fake(argv, **_):
        return subprocess.CompletedProcess(argv, 0, text if argv[0] == "scontrol" else sinfo, "")

    monkeypatch.setattr(slurm, "runner", fake)
    info = partitions.partition_info("gpu")
    assert info is not None
    assert [n.name for n in info.usable] == ["node1", "node2", "node3"]


def test_parsable_pads_empty_fields_and_strips_squeue_columns():
    rows = slurm.parsable("1|COMPLETED||\n\n2|FAILED\n", ("JobID", "State", "ExitCode", "Reason"))
    assert rows == [
        {"JobID": "1", "State": "COMPLETED", "ExitCode": "", "Reason": ""},
        {"JobID": "2", "State": "FAILED", "ExitCode": "", "Reason": ""},
    ]
    (row,) = slurm.parsable("  7_3 |RUNNING  |", ("JobArrayID", "State"), strip=True)
    assert row == {"JobArrayID": "7_3", "State": "RUNNING"}


def test_array_job_ids_in_squeue_and_sacct():
    squeue = "123_[1-5]|PENDING|JobArrayTaskLimit|0|0:0|\n123_0|RUNNING|None|1|0:0|\n"
    infos = jobstate.squeue_infos(slurm.parsable(squeue, jobstate.SQUEUE_FIELDS, strip=True))
    assert sorted(infos) == [f"123_{i}" for i in range(6)]
    assert infos["123_4"].reason == "JobArrayTaskLimit" and infos["123_0"].restarts == 1
    sacct = "123_4|CANCELLED by 0|0:15|None\n123_4.batch|CANCELLED||\n"
    found = jobstate.sacct_infos(slurm.parsable(sacct, jobstate.SACCT_FIELDS))
    assert list(found) == ["123_4"] and found["123_4"].state == "CANCELLED"


def _runner(returncode=0, stdout="", stderr="", raises=None):
    def run(argv, **_):
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)

    return run


def test_a_failed_command_names_its_command_line_exit_status_and_stderr(monkeypatch):
    err = "sacct: error: Problem talking to the database: Connection refused\n"
    monkeypatch.setattr(slurm, "runner", _runner(1, stderr=err))
    with pytest.raises(slurm.SlurmError) as caught:
        slurm.sacct(["7", "8"], jobstate.SACCT_FIELDS)
    assert str(caught.value) == (
        "`sacct -n -P -X -j 7,8 -o JobID,State,ExitCode,Reason` failed (exit 1: sacct: error: "
        "Problem talking to the database: Connection refused)"
    )
    assert (caught.value.returncode, caught.value.stderr) == (1, err)
    assert caught.value.argv[:2] == ["sacct", "-n"]


def test_a_timeout_and_a_missing_command_say_so(monkeypatch):
    timeout = subprocess.TimeoutExpired(["squeue"], 30)
    monkeypatch.setattr(slurm, "runner", _runner(raises=timeout))
    with pytest.raises(slurm.SlurmUnanswered, match=r"^`squeue .*` did not answer within 30 s$"):
        jobstate.squeue(["1"])
    monkeypatch.setattr(slurm, "runner", _runner(raises=FileNotFoundError("scancel")))
    with pytest.raises(slurm.SlurmError, match=r"^`scancel 1 2` could not run \(scancel is not on"):
        slurm.scancel(["1", "2"])


def test_squeue_knowing_none_of_the_jobs_is_no_error_and_long_id_lists_are_cut(monkeypatch):
    err = "slurm_load_jobs error: Invalid job id specified\n"
    monkeypatch.setattr(slurm, "runner", _runner(1, stderr=err))
    assert jobstate.squeue(["1"]) == {}
    ids = jobstate.task_ids("123", 500)
    shown = slurm.shown(["squeue", "-j", ",".join(ids)])
    assert len(shown) < 120 and "chars)" in shown


def _benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "slurm_calls.py"
    spec = importlib.util.spec_from_file_location("slurm_calls", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_watching_5_or_500_jobs_costs_the_same_slurm_calls_per_poll():
    bench = _benchmark()
    small, large = bench.measure(5), bench.measure(500)
    for name, ways in large.items():
        assert ways["batched"] == small[name]["batched"] <= 2, name
        assert ways["per_job"] >= 500, name  # the fake really counts calls per job


def test_on_cluster_names_the_cluster_on_every_command_that_takes_it(monkeypatch):
    """Multi-cluster operation: inside on_cluster, queries, sbatch and scancel carry -M; sacctmgr
    and srun do not take it; outside, nothing is added (SLURM_CONF's cluster answers)."""
    seen: list[list[str]] = []

    def fake(argv, **_):
        seen.append(argv)
        out = "CLUSTER: pod2\n7|COMPLETED\n" if argv[0] == "sacct" else ""
        return subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(slurm, "runner", fake)
    with slurm.on_cluster("pod2"):
        rows = slurm.sacct(["7"], ("JobID", "State"))
        slurm.scancel(["7"])
        slurm.run(["sacctmgr", "-nP", "list", "cluster"])
        assert slurm.current_cluster() == "pod2"
    slurm.scancel(["8"])
    assert rows == [{"JobID": "7", "State": "COMPLETED"}]  # -M's header line is not a row
    assert [a[:2] for a in seen] == [["sacct", "--clusters=pod2"], ["scancel", "--clusters=pod2"],
                                     ["sacctmgr", "-nP"], ["scancel", "8"]]  # fmt: skip
    assert slurm.current_cluster() == ""


def test_runs_on_two_clusters_are_asked_on_their_own_cluster_even_with_the_same_job_id(
    monkeypatch, tmp_path
):
    """Two clusters number their jobs independently: job 7 on pod and job 7 on superpod are
    two jobs. Each run's states come from its own cluster's answer (multicluster.poll)."""
    from vitpod.registry import runfiles
    from vitpod.workflows.jobs import multicluster

    runs = []
    for name, cluster in (("pre", None), ("fin", "superpod")):
        run = tmp_path / name
        run.mkdir()
        (run / runfiles.MANIFEST).write_text(
            json.dumps({"profile": {"values": {"cluster": cluster}}})
        )
        runs.append((run, ["7"]))
    asked: list[list[str]] = []

    def fake(argv, **_):
        asked.append(argv)
        state = "COMPLETED" if "--clusters=superpod" in argv else "RUNNING"
        return subprocess.CompletedProcess(argv, 0, f"7|{state}|None|0|0:0|\n", "")

    monkeypatch.setattr(slurm, "runner", fake)
    pre, fin = multicluster.poll(runs)
    assert (pre["7"].state, fin["7"].state) == ("RUNNING", "COMPLETED")
    assert [a[1] for a in asked] == ["-h", "--clusters=superpod"]  # one squeue per cluster
    assert multicluster.cluster_of(tmp_path / "fin") == "superpod"
    assert multicluster.cluster_of(tmp_path / "nowhere") == ""
