"""The one reader of each run file (registry/runfiles.py) and its policy for a torn line: a last
line without its newline is skipped (being written), a bad complete line is an error naming
the file and line; every reader of metrics files follows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitpod.analysis import goodput
from vitpod.analysis.runlogs import read_run
from vitpod.registry import runfiles
from vitpod.registry.runfiles import JsonlTail, RunFileError, read_jsonl
from vitpod.workflows.planning import grace
from vitpod.workflows.watching import runsizes, status, triage
from vitpod.workflows.watching.metricstail import MetricsTail

TIMES = {"data": 0.0, "compute": 0.1, "comm": 0.0, "optimizer": 0.0, "step": 0.1}
STEP = {"kind": "step", "rank": 0, "step": 1, "world_size": 1, "batch_size": 8, "loss": 2.0,
        "images_per_s": 80.0, "total_steps": 4, "wall_time": 100.0, "time": TIMES}  # fmt: skip
CKPT = {"kind": "timing", "event": "checkpoint", "seconds": 3.0}
SUMMARY = {"kind": "summary", "steps": 2, "images_per_s": 80.0, "top1": 50.0}


def line(record: dict) -> str:
    return json.dumps(record) + "\n"


def run_with(tmp_path: Path, text: str) -> Path:
    run = tmp_path / "20260101T000000Z-volo_tiny-pretrain-abc"
    path = runfiles.metrics_file(run, 0)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return run


def test_torn_last_line_is_skipped_and_a_bad_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text(line(STEP) + '{"kind": "st')
    assert read_jsonl(path) == [STEP]
    path.write_text(line(STEP) + line(STEP)[:-1])  # whole JSON, newline not written yet
    assert read_jsonl(path) == [STEP]
    path.write_text(line(STEP) + "\n" + "not json\n" + line(STEP))
    with pytest.raises(RunFileError, match=r"rank0\.jsonl:3: not a JSON line"):
        read_jsonl(path)
    path.write_text(line(STEP) + "[1, 2]\n")
    with pytest.raises(RunFileError, match=r"rank0\.jsonl:2: expected a JSON object"):
        read_jsonl(path)


def test_tail_reads_a_line_once_its_newline_arrives_and_counts_lines_across_reads(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text(line(STEP) + '{"kind": "ev')
    tail = JsonlTail(path)
    assert tail.read() == [STEP]
    assert tail.read() == []  # the half line stays unread
    with open(path, "a") as f:
        f.write('al", "top1": 1.0}\n' + "garbage\n")
    with pytest.raises(RunFileError, match=r"rank0\.jsonl:3:"):
        tail.read()
    tail = JsonlTail(path)
    with pytest.raises(RunFileError, match=r":3:"):
        tail.read()


def test_writer_cuts_a_killed_starts_torn_tail_before_appending(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text(line(STEP) + '{"kind": "step", "st')
    runfiles.drop_torn_tail(path)
    assert path.read_text() == line(STEP)
    runfiles.drop_torn_tail(path)  # a whole file is left as it is
    assert path.read_text() == line(STEP)
    path.write_text('{"no newline at all')
    runfiles.drop_torn_tail(path)
    assert path.read_text() == ""
    runfiles.drop_torn_tail(tmp_path / "absent.jsonl")


def test_trainer_logger_appends_after_a_torn_tail_as_a_line_of_its_own(tmp_path):
    torch = pytest.importorskip("torch")
    from vitpod.trainer.telemetry.metrics import MetricsLogger

    run = run_with(tmp_path, line(STEP) + '{"kind": "step", "st')  # the killed start's
    logger = MetricsLogger(run, rank=0, world_size=1, total_steps=4, log_interval=1,
                           device=torch.device("cpu"))  # fmt: skip
    logger.write(CKPT)
    logger.close()
    logger.file.close()
    assert runfiles.read_metrics(run, rank=0) == [STEP, CKPT]


def test_every_metrics_reader_skips_the_torn_line(tmp_path):
    run = run_with(tmp_path, line(STEP) + line(CKPT) + '{"kind": "summ')
    assert status.progress(run) == (1, 80.0, None)
    assert runsizes.world_sizes(run) == [1]
    assert grace.last_checkpoint_save(run, "volo_tiny", "pretrain") == (3.0, str(run))
    assert goodput.read_rank0(run) == [STEP, CKPT]
    tail = MetricsTail(run)
    tail.update()
    assert (tail.step, tail.total) == (1, 4)
    assert triage.stuck(run, now=100.0) is None
    assert [s.step for s in read_run(run).steps] == [1]


@pytest.mark.parametrize(
    "read",
    [
        status.progress,
        runsizes.world_sizes,
        lambda run: grace.last_checkpoint_save(run, "volo_tiny", "pretrain"),
        goodput.read_rank0,
        lambda run: MetricsTail(run).update(),
        lambda run: triage.stuck(run, now=100.0),
        read_run,
    ],
    ids=["status", "runsizes", "grace", "goodput", "metricstail", "triage", "runlogs"],
)
def test_every_metrics_reader_refuses_a_bad_middle_line_naming_it(tmp_path, read):
    run = run_with(tmp_path, line(STEP) + '{"kind": "step", "st{"kind": "step"}\n' + line(SUMMARY))
    with pytest.raises(RunFileError, match=r"metrics/rank0\.jsonl:2: not a JSON line"):
        read(run)


def test_metrics_files_in_rank_order(tmp_path):
    for rank in (10, 2, 0, 1):
        path = runfiles.metrics_file(tmp_path, rank)
        path.parent.mkdir(exist_ok=True)
        path.write_text(line({**STEP, "rank": rank}))
    assert [p.name for p in runfiles.metrics_files(tmp_path)] == [
        "rank0.jsonl", "rank1.jsonl", "rank2.jsonl", "rank10.jsonl",
    ]  # fmt: skip
    assert [r["rank"] for r in runfiles.read_metrics(tmp_path)] == [0, 1, 2, 10]
    assert runfiles.read_metrics(tmp_path, rank=7) == []


def test_json_run_files_name_the_file_when_damaged(tmp_path):
    assert runfiles.read_summary(tmp_path) is None
    (tmp_path / runfiles.SUMMARY).write_text('{"top1": 5')
    with pytest.raises(RunFileError, match=r"summary\.json: not JSON"):
        runfiles.read_summary(tmp_path)
    (tmp_path / runfiles.MANIFEST).write_text("[1]")
    with pytest.raises(RunFileError, match=r"manifest\.json: expected a JSON object, found list"):
        runfiles.read_manifest(tmp_path)
    with pytest.raises(FileNotFoundError):
        runfiles.read_manifest(tmp_path / "nowhere")
    (tmp_path / runfiles.MANIFEST).write_text('{"job_ids": ["7"]}\n')
    assert runfiles.read_manifest(tmp_path) == {"job_ids": ["7"]}


def test_each_record_file_name_has_one_schema_and_a_submission_writes_a_run_manifest(tmp_path):
    """manifest.json is a run's only (RunManifest); the final model and a label set have their
    own names and schemas; a submission's manifest fits its schema, a wrong one is refused
    naming the file and the field before it is written."""
    from vitpod.registry import records
    from vitpod.workflows.planning.plan import Request, plan_job
    from vitpod.workflows.submit.submission import materialize

    assert records.SCHEMAS == {runfiles.MANIFEST: records.RunManifest,
                               runfiles.FINAL_RECORD: records.FinalModel,
                               runfiles.LABELS: records.LabelSet}  # fmt: skip
    plan = plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "runs")))
    materialize(plan)
    written = records.read(plan.run_dir, runfiles.MANIFEST)
    assert written is not None and (written["stage"], written["job_ids"]) == ("pretrain", [])
    other = plan_job(Request(cluster="localslurm", run_root=str(tmp_path / "other")))
    with pytest.raises(RunFileError, match=r"manifest\.json: job_ids: "):
        materialize(other, {**other.manifest(), "job_ids": "4242"})
    assert not other.run_dir.exists()
