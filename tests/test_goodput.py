"""The goodput ledger's assembly from trainer records and Slurm attempts (hand-made timelines
whose parts are known), and its table in the scaling report. Measured live in
tests/test_progress_slurm.py."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from vitpod.analysis.goodput import Attempt, assemble, from_trainer


def _start(job, restart, step, t):
    return {"kind": "timing", "event": "start", "step": step, "wall_time": t,
            "process_start": t - 1, "job_id": job, "restart": restart}  # fmt: skip


def _step(n, end, seconds=1.0, wait=0.0):
    return {"kind": "step", "step": n, "wall_time": end,
            "time": {"step": seconds, "checkpoint_wait": wait}}  # fmt: skip


def _span(event, step, seconds, t):
    return {"kind": "timing", "event": event, "step": step, "seconds": seconds, "wall_time": t}


def timeline():
    """Job 7 starts at 110 (queued 10 s), steps 1-6 (1 s each, 2 s for the first), checkpoint at
    step 4 (0.5 s), killed after step 6; job 8 resumes from step 4 (steps 5, 6 redone)."""
    first = [_start("7", 0, 0, 112), _step(1, 115, 2.0), _step(2, 116), _step(3, 117),
             _step(4, 118), _span("checkpoint", 4, 0.5, 118.5), _step(5, 119.5, wait=0.2),
             _step(6, 120.5)]  # fmt: skip
    second = [_start("8", 0, 4, 205), _step(5, 208), _step(6, 209), _span("eval", 6, 1.5, 210.5),
              {"kind": "timing", "event": "end", "step": 6, "wall_time": 211}]  # fmt: skip
    attempts = [Attempt("7", 0, 100, 110, 122), Attempt("8", 0, 200, 203, 212)]
    return first + second, attempts


def test_parts_of_a_killed_and_resubmitted_run():
    records, attempts = timeline()
    ledger = assemble(records, attempts, container_s=None)
    parts = ledger.parts
    assert ledger.wall == 22 + 12 and ledger.attempts == 2
    assert parts["queue"] == 10 + 3
    assert parts["startup"] == (115 - 110) + (208 - 203)
    # Kept: steps 2-4 of job 7, step 6 of job 8 (the first step of each start is start-up).
    assert parts["training"] == pytest.approx(3 + 1)
    assert parts["lost"] == pytest.approx((1.0 - 0.2) + 1.0)  # steps 5 and 6 of job 7
    assert parts["checkpoint"] == pytest.approx(0.5 + 0.2)
    assert parts["eval"] == 1.5
    assert parts["shutdown"] == (122 - 120.5) + (212 - 211)
    assert ledger.other == pytest.approx(ledger.wall - sum(parts.values()))
    assert "no container_start.json" in ledger.notes[0]


def test_an_end_within_slurms_last_second_is_no_negative_shutdown():
    """sacct's End is cut to the second: job 8 read End=211 while its trainer wrote at 211.4.
    A later record by more than a second is kept as it is (a clock that disagrees shows)."""
    records, attempts = timeline()
    records[-1]["wall_time"] = 211.4
    attempts[-1] = Attempt("8", 0, 200, 203, 211)
    ledger = assemble(records, attempts, container_s=None)
    assert ledger.parts["shutdown"] == pytest.approx(122 - 120.5)
    assert ledger.wall == pytest.approx(22 + 11.4)
    records[-1]["wall_time"] = 212.5
    late = assemble(records, attempts, container_s=None)
    assert late.parts["shutdown"] == pytest.approx((122 - 120.5) + (211 - 212.5))


def test_the_ledger_shows_the_size_of_each_restart():
    records, attempts = timeline()
    for rec in records:  # job 7 ran on 4 ranks, job 8 resumed on 2 (elastic resume)
        if rec["kind"] == "step":
            rec["world_size"] = 4 if rec["wall_time"] < 200 else 2
    ledger = assemble(records, attempts, container_s=None)
    assert ledger.ranks == [4, 2] and ledger.as_dict()["ranks"] == [4, 2]
    assert " ranks=4>2 " in ledger.line()


def test_a_span_after_the_last_step_is_not_counted_twice():
    """A final evaluation cut short by a failing peer: its span ends after the last step and
    no end record follows; shut-down starts where the span ended."""
    records, attempts = timeline()
    records = [r for r in records if r.get("event") != "end"]
    ledger = assemble(records, attempts, container_s=None)
    assert ledger.parts["eval"] == 1.5 and ledger.parts["shutdown"] == 1.5 + (212 - 210.5)


def test_container_start_is_taken_out_of_start_up():
    records, attempts = timeline()
    ledger = assemble(records, attempts, container_s=4.0)
    assert ledger.parts["container"] == 4.0 and ledger.parts["startup"] == 10 - 4.0
    assert not ledger.notes


def test_without_accounting_the_processes_bound_the_run(tmp_path):
    records, _ = timeline()
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    ledger = from_trainer(tmp_path)
    assert ledger.parts["queue"] == 0 and ledger.attempts == 2
    assert ledger.parts["startup"] == (115 - 111) + (208 - 204)
    assert "queue wait unknown" in ledger.notes[0]
    assert ledger.line().startswith("goodput: wall=")


def test_container_start_reads_the_job_scripts_per_node_record(tmp_path):
    """container_start.json as the sbatch script writes it: cold then warm step, per node."""
    from vitpod.analysis.goodput import container_seconds

    record = {"job_id": "7", "restart": 0, "image": "x", "method": "m",
              "nodes": {"node1": {"cold_s": 3.0, "warm_s": 0.5},
                        "node2": {"cold_s": 4.0, "warm_s": 0.25}}}  # fmt: skip
    (tmp_path / "container_start.json").write_text(json.dumps(record))
    assert container_seconds(tmp_path) == 4.0 + 0.5


def test_device_hours_are_allocated_devices_times_run_time_and_useful_the_kept_steps():
    records, attempts = timeline()
    with_gpus = [Attempt(a.job_id, a.restart, a.submit, a.start, a.end, 8, "GPU")
                 for a in attempts]  # fmt: skip
    ledger = assemble(records, with_gpus, container_s=None)
    assert ledger.device_kind == "GPU"
    assert ledger.device_hours == pytest.approx(8 * ((122 - 110) + (212 - 203)) / 3600)
    assert ledger.useful_device_hours == pytest.approx(8 * (3 + 1) / 3600)  # kept training
    assert "gpu_hours=" in ledger.line() and "useful_gpu_hours=" in ledger.line()
    assert assemble(records, attempts, container_s=None).device_kind == ""  # not accounted


@pytest.mark.parametrize(
    ("tres", "expected"),
    [("billing=4,cpu=4,gres/gpu=8,mem=8G,node=2", (8, "GPU")), ("cpu=2,mem=1G,node=1", (2, "CPU")),
     ("", (0, "")), ("cpu=0", (0, ""))],
)  # fmt: skip
def test_allocated_devices_read_from_sacct_alloctres(tres, expected):
    from vitpod.workflows.watching.goodput import allocated_devices

    assert allocated_devices(tres) == expected


def test_ledger_keeps_first_start_and_last_end_for_placement():
    records, attempts = timeline()
    ledger = assemble(records, attempts, container_s=None)
    assert (ledger.start, ledger.end) == (110, 212)


def test_a_study_records_each_points_gpu_hours_from_one_sacct(tmp_path, monkeypatch):
    """study.record_ledgers: one sacct for every point's job; a job's GPUs x its run time."""
    import subprocess

    from vitpod.workflows import slurm
    from vitpod.workflows.studies import study

    calls = []

    def runner(argv, **_):
        calls.append(argv)
        day = "2026-01-01T"
        rows = (f"50|{day}00:00:00|{day}00:00:10|{day}01:00:10|gres/gpu=2\n"
                f"51|{day}00:00:00|{day}00:00:20|{day}00:30:20|gres/gpu=4\n")  # fmt: skip
        return subprocess.CompletedProcess(argv, 0, rows, "")

    monkeypatch.setattr(slurm, "runner", runner)
    points = [{"index": i, "gpus": g, "run_dir": f"p{i}", "job_id": str(50 + i)}
              for i, g in ((0, 2), (1, 4))]  # fmt: skip
    (tmp_path / "study.json").write_text(json.dumps({"points": points}))
    recorded = study.record_ledgers(tmp_path)["points"]
    assert len(calls) == 1 and "50,51" in calls[0]
    assert [p["device_hours"] for p in recorded] == pytest.approx([2.0, 2.0])
    assert [p["device_kind"] for p in recorded] == ["GPU", "GPU"]
    saved = json.loads((tmp_path / "study.json").read_text())["points"]
    assert saved == recorded

    def fails(argv, **_):
        return subprocess.CompletedProcess(argv, 1, "", "sacct: error: slurmdbd down")

    monkeypatch.setattr(slurm, "runner", fails)
    assert [p["device_hours"] for p in study.record_ledgers(tmp_path)["points"]] == [None, None]


def test_a_reused_job_id_counts_only_the_attempts_since_the_run_was_created(tmp_path, monkeypatch):
    """A controller whose state was reset hands out id 1000004 again: sacct -D lists both jobs;
    the ledger keeps the one submitted after the run's manifest was written."""
    import subprocess

    from vitpod.workflows import slurm
    from vitpod.workflows.watching import goodput

    day = "2026-01-01T"
    rows = (f"1000004|{day}00:47:45|{day}00:47:46|{day}00:47:56|cpu=4\n"
            f"1000004|{day}02:49:14|{day}02:49:14|{day}02:50:03|cpu=4\n")  # fmt: skip
    monkeypatch.setattr(
        slurm, "runner", lambda argv, **_: subprocess.CompletedProcess(argv, 0, rows, "")
    )
    created = goodput._epoch("2026-01-01T02:48:13")
    assert created is not None
    stamp = dt.datetime.fromtimestamp(created).astimezone().isoformat()
    (tmp_path / "manifest.json").write_text(json.dumps({"created": stamp}))
    led = goodput.ledger(tmp_path, ["1000004"])
    assert led.attempts == 1 and led.wall == pytest.approx(49.0)
