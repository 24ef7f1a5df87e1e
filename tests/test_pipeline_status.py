"""Status from hand-written run directories: root-cause traceback, progress, restarts."""

import json
from pathlib import Path

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.commands import status_cli
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.jobstate import JobState
from vitpod.workflows.watching import rootcause, status

REAL = """\
Traceback (most recent call last):
  File "/w/trainer/train.py", line 88, in step
    loss = self.criterion(out, target)
  File "/w/trainer/loss.py", line 12, in __call__
    raise ValueError("target 17 out of range for 10 classes")
ValueError: target 17 out of range for 10 classes
"""

NCCL = """\
Traceback (most recent call last):
  File "/w/trainer/train.py", line 90, in step
    self.model.backward(loss)
torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited
"""

CHAINED = """\
Traceback (most recent call last):
  File "/w/a.py", line 1, in <module>
    open("/missing")
FileNotFoundError: [Errno 2] No such file or directory: '/missing'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/w/a.py", line 3, in <module>
    raise RuntimeError("could not open the data set")
RuntimeError: could not open the data set
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_find_tracebacks_reads_labels_and_chains(tmp_path):
    labelled = "".join(f"1: {line}\n" for line in REAL.splitlines())
    log = _write(tmp_path / "x.log", "starting\n" + labelled + "more output\n" + CHAINED)
    tbs = rootcause.find_tracebacks(log)
    assert [tb.exception for tb in tbs] == [
        "ValueError: target 17 out of range for 10 classes",
        "RuntimeError: could not open the data set",
    ]
    assert tbs[0].line == 2 and not tbs[0].communication
    assert "FileNotFoundError" in tbs[1].text  # the chain stays one block


def test_root_cause_skips_nccl_symptoms_and_old_restarts(tmp_path):
    logs = tmp_path / "logs"
    # rank 0 only saw the collective fail; rank 1 has the real error.
    _write(logs / "123-restart1-rank0.log", "step 5\n" + NCCL)
    _write(logs / "123-restart1-rank1.log", "step 5\n" + REAL)
    # An older restart's traceback is not the cause of the current failure.
    _write(logs / "123-restart0-rank0.log", CHAINED)
    tb = rootcause.root_cause(logs)
    assert tb is not None
    assert tb.exception.startswith("ValueError: target 17")
    assert tb.path.endswith("123-restart1-rank1.log")


def test_root_cause_falls_back_to_comm_error_and_none(tmp_path):
    logs = tmp_path / "logs"
    assert rootcause.root_cause(logs) is None
    _write(logs / "9-restart0-rank0.log", "clean exit\n")
    assert rootcause.root_cause(logs) is None
    _write(logs / "9-restart0-rank1.log", NCCL)
    tb = rootcause.root_cause(logs)
    assert tb is not None and tb.communication


def _metrics(run_dir: Path, rank: int, steps: int, ips: float, summary: dict | None = None) -> None:
    lines = [
        {"kind": "step", "step": s, "epoch": 0, "rank": rank, "images_per_s": ips}
        for s in range(1, steps + 1)
    ]
    if summary:
        lines.append({"kind": "summary", **summary})
    _write(run_dir / "metrics" / f"rank{rank}.jsonl", "".join(json.dumps(x) + "\n" for x in lines))


def test_progress_sums_ranks_until_summary(tmp_path):
    _metrics(tmp_path, 0, 7, 100.0)
    _metrics(tmp_path, 1, 7, 50.0)
    with open(tmp_path / "metrics" / "rank1.jsonl", "a") as f:
        f.write('{"kind": "step", "st')  # a line being written right now
    assert status.progress(tmp_path) == (7, 150.0, None)
    _metrics(tmp_path, 0, 9, 100.0, {"top1": 93.5, "steps": 9, "images_per_s": 140.0})
    assert status.progress(tmp_path) == (9, 140.0, 93.5)


def test_stage_status_of_failed_job(tmp_path):
    run_dir = tmp_path / "pre"
    _metrics(run_dir, 0, 3, 10.0)
    _write(run_dir / "logs" / "77-restart2-rank1.log", REAL)
    info = [jobstate.JobInfo("77", "FAILED", restarts=1, exit_code="1:0")]
    st = status.stage_status(JobState("pretrain", run_dir, ["77"]), info)
    assert (st.state, st.restarts, st.step) == ("FAILED", 2, 3)
    assert st.traceback is not None and "out of range" in st.traceback.exception
    text = status.format_status([st])
    assert "FAILED" in text and "root cause" in text and "ValueError" in text


def test_status_main_reads_recorded_local_pipeline(tmp_path, capsys):
    pre, fin = tmp_path / "pre", tmp_path / "fin"
    _metrics(pre, 0, 4, 20.0, {"top1": 80.0, "steps": 4, "images_per_s": 30.0})
    (pre / "summary.json").write_text("{}")
    record = {
        "executor": "local",
        "stages": {
            "pretrain": {"run_dir": str(pre), "job_ids": ["4242"], "state": "COMPLETED"},
            "finetune": {"run_dir": str(fin), "job_ids": [], "state": ""},
        },
    }
    _write(tmp_path / runfiles.PIPELINE, json.dumps(record))
    assert status_cli.main(["--run", str(tmp_path), "--json"]) == 0
    got = {s["stage"]: s for s in json.loads(capsys.readouterr().out)}
    assert got["pretrain"]["state"] == "COMPLETED" and got["pretrain"]["top1"] == 80.0
    assert got["finetune"]["state"] == "NOT_SUBMITTED"


def test_status_main_rejects_non_run_dir(tmp_path, capsys):
    assert status_cli.main(["--run", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_parse_squeue_and_sacct():
    text = "12|RUNNING|None|0|0:0\n13|PENDING|Dependency|0|0:0\n14|PENDING|BeginTime|2|0:0\n"
    sq = jobstate.squeue_infos(slurm.parsable(text, jobstate.SQUEUE_FIELDS, strip=True))
    assert sq["12"].state == "RUNNING" and sq["13"].reason == "Dependency"
    assert sq["14"].restarts == 2 and not sq["14"].terminal
    text = "15|CANCELLED by 0|0:15|None\n15.batch|CANCELLED|0:15|\n"
    sa = jobstate.sacct_infos(slurm.parsable(text, jobstate.SACCT_FIELDS))
    assert list(sa) == ["15"] and sa["15"].state == "CANCELLED" and sa["15"].terminal
