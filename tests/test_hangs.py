"""The hang watchdog's parts without Slurm: the ranks' heartbeat and its timeouts, the planner's
timeouts from an earlier run, the status lines of hangs and stragglers, and the goodput of an
in-job restart. Live: tests/test_hang_slurm.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import vitpod
from vitpod.analysis.goodput import Attempt, assemble
from vitpod.analysis.stragglers import stragglers
from vitpod.trainer.telemetry.heartbeat import Heartbeat
from vitpod.workflows.jobs.jobstate import JobInfo, JobState
from vitpod.workflows.planning.hangplan import decide, longest_sections
from vitpod.workflows.site.profile_hang import Hang
from vitpod.workflows.watching import follow, hangs, status

LIMITS = {"floor_s": 10.0, "measured_s": {"checkpoint": 4.0},
          "ceilings_s": {"startup": 600, "step": 50, "checkpoint": 100, "eval": 100}}  # fmt: skip


def _fields(path: Path) -> list[str]:
    return path.read_text().split()


def test_heartbeat_deadlines_follow_the_running_estimates(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path / "hb", 3, LIMITS)
    try:
        assert beat.section == "startup" and beat.timeout("startup") == 600  # nothing measured
        assert beat.timeout("checkpoint") == 2 * 4.0 + 10  # the last run's save
        beat.stepped(1)  # the first boundary: no step time yet, the ceiling
        assert beat.timeout("step") == 50
        beat.last_boundary -= 2.0  # step 2 took 2 s
        beat.stepped(2)
        assert beat.measured["step"] == pytest.approx(2.0, abs=0.5)  # this host may be busy
        assert beat.deadline - beat.since == pytest.approx(2 * beat.measured["step"] + 10)
        with beat.during("checkpoint", 2):
            assert beat.section == "checkpoint" and beat.deadline - beat.since == 18
        assert beat.section == "step"
        beat._beat()
        rank, node, pid, step, section, since, deadline, _ = _fields(tmp_path / "hb" / "rank3")
        assert (rank, step, section, int(pid) > 0) == ("3", "2", "step", True)
        assert 12 <= int(deadline) - int(since) // 1000 <= 16 and node
    finally:
        beat.close()
    assert _fields(tmp_path / "hb" / "rank3")[4:7:2] == ["done", "0"]  # no deadline once done


def test_off_without_the_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VITPOD_HEARTBEATS", raising=False)
    beat = Heartbeat.from_env(tmp_path, 0)
    beat.stepped(1)
    with beat.during("eval", 1):
        pass
    beat.close()
    assert list(tmp_path.iterdir()) == []


def _records(run: Path, rank: int, records: list[dict]) -> None:
    (run / "metrics").mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics" / f"rank{rank}.jsonl").write_text(text)


def test_the_plan_takes_the_last_runs_times(tmp_path: Path) -> None:
    earlier = tmp_path / "runs" / "20260101T000000Z-earlier"
    (earlier / "metrics").mkdir(parents=True)
    (earlier / "config.json").write_text(json.dumps({"model": "m", "img_size": 32,
                                                     "batch_size": 8}))  # fmt: skip
    _records(earlier, 0, [
        {"kind": "timing", "event": "start", "process_start": 100.0, "wall_time": 105.0},
        *({"kind": "step", "step": n, "wall_time": 110.0 + n, "time": {"step": 0.5}}
          for n in range(1, 6)),
        {"kind": "timing", "event": "checkpoint", "step": 5, "seconds": 3.0},
        {"kind": "timing", "event": "eval", "step": 5, "seconds": 40.0},
    ])  # fmt: skip
    assert longest_sections([]) == {}
    cfg = type("Cfg", (), {"model": "m", "img_size": 32, "batch_size": 8})()
    hang = Hang(floor_s=60, eval_s=100)
    record = decide(hang, cfg, tmp_path / "runs" / "20260102T000000Z-new")  # type: ignore[arg-type]
    assert record is not None
    assert record.measured_s == {"startup": 11.0, "step": 0.5, "checkpoint": 3.0, "eval": 40.0}
    assert record.timeouts_s == {"startup": 82.0, "step": 61.0, "checkpoint": 66.0, "eval": 100}
    assert "earlier" in record.sources["eval"]
    assert decide(Hang(enabled=False), cfg, earlier) is None  # type: ignore[arg-type]
    # A run of another plan is not measured from: a --compile on run after an uncompiled one
    # (its cold compile took 101 s of the uncompiled start-up's 2 x 19 s + 60 s and was killed)
    compiled = type("Cfg", (), {"model": "m", "img_size": 32, "batch_size": 8, "compile": "on"})()
    record = decide(hang, compiled, tmp_path / "runs" / "new")  # type: ignore[arg-type]
    assert record is not None and record.timeouts_s["startup"] == hang.startup_s
    assert set(record.measured_s.values()) == {None}


def _steps(own: float, comm: float, n: int = 8) -> list[dict]:
    return [{"kind": "step", "step": i, "time": {"step": own + comm, "comm": comm}}
            for i in range(1, n + 1)]  # fmt: skip


def test_status_names_hangs_and_stragglers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "heartbeats").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"hang": {"straggler_ratio": 1.5,
                                                        "straggler_steps": 5}}))  # fmt: skip
    # Rank 2 computes 0.3 s a step; the others wait for it in the exchange.
    for rank, (own, comm) in enumerate([(0.1, 0.2), (0.12, 0.18), (0.3, 0.0)]):
        _records(run, rank, _steps(own, comm))
        (run / "heartbeats" / f"rank{rank}").write_text(f"{rank} node{rank + 1} 1 8 done 0 0 0\n")
    (run / "hangs.jsonl").write_text(
        json.dumps(
            {
                "kind": "hang",
                "job": "5",
                "restart": 0,
                "attempt": 0,
                "rank": "1",
                "node": "node2",
                "step": 23,
                "section": "step",
                "quiet_s": 41,
                "timeout_s": 40,
                "stalled": "1",
                "detected_at": 0,
                "stacks": "logs/stacks-5-restart0-attempt0-rank<R>.txt",
            }
        )
        + "\n{torn"
    )
    (run / "exclude-nodes").write_text("node2\nnode2\n")
    lines = hangs.lines(run)
    assert lines[0].startswith("hang: rank 1 on node2 in step at step 23: no progress for 41 s")
    assert lines[1] == "excluded nodes (hung twice): node2"
    assert lines[2].startswith("straggler: rank 2 on node3: own step time 2.50 x the ranks' median")
    assert len(lines) == 3
    # A run shorter than the window (20 steps) is judged on its 8.
    assert [(s.rank, s.steps) for s in stragglers(run, steps=20)] == [(2, 8)]


def test_an_in_job_restart_counts_the_hang_as_lost() -> None:
    """Job 7 starts at 110; steps 1-4, checkpoint at 2; hangs after step 4 (its last record at
    118); the ranks restart in place at 150 (process start) from step 2 and finish."""

    def start(step: float, t: float, attempt: int) -> dict:
        return {"kind": "timing", "event": "start", "step": step, "wall_time": t,
                "process_start": t - 1, "job_id": "7", "restart": 0,
                "attempt": attempt}  # fmt: skip

    def step(n: int, end: float) -> dict:
        return {"kind": "step", "step": n, "wall_time": end, "time": {"step": 1.0}}

    records = [start(0, 112, 0), step(1, 115), step(2, 116), step(3, 117), step(4, 118),
               start(2, 151, 1), step(3, 153), step(4, 154),
               {"kind": "timing", "event": "end", "step": 4, "wall_time": 155}]  # fmt: skip
    ledger = assemble(records, [Attempt("7", 0, 100, 110, 156)], container_s=0.0)
    assert ledger.attempts == 1 and ledger.wall == 56
    assert ledger.parts["lost"] == pytest.approx(2 * 1.0 + (150 - 118))  # steps 3, 4 + the hang
    assert ledger.parts["startup"] == pytest.approx((115 - 110) + (153 - 150))
    assert ledger.parts["training"] == pytest.approx(1.0 + 1.0)  # step 2, then step 4


def test_only_a_trainer_job_is_watched(tmp_path: Path) -> None:
    """The trainer's job runs the watchdog with the profile's floor and records its timeouts in
    plan.json; a rankinfo job (no heartbeats) has none."""
    scripts = {}
    for entry in ("trainer", "rankinfo"):
        out = vitpod("render", "--cluster", "localslurm", "--model", "volo_tiny", "--offline",
                     "--entry", entry, runs=tmp_path / entry)  # fmt: skip
        assert out.returncode == 0, out.stderr
        scripts[entry] = Path(out.stdout.strip().splitlines()[-1])
    trainer = scripts["trainer"].read_text()
    assert "vitpod_watch &" in trainer and "hang.floor_s=60" in trainer
    plan = json.loads((scripts["trainer"].parent / "plan.json").read_text())["hang"]
    assert plan["floor_s"] == 60 and plan["timeouts_s"]["step"] == 1800  # nothing measured yet
    assert "vitpod_watch" not in scripts["rankinfo"].read_text()


def test_the_follow_view_names_a_straggler_of_a_running_stage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "heartbeats").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"stage": "pretrain", "job_ids": ["7"]}))
    (run / "plan.json").write_text(json.dumps({"hang": {"straggler_ratio": 1.3,
                                                        "straggler_steps": 5}}))  # fmt: skip
    now = time.time()
    for rank, (own, comm) in enumerate([(0.1, 0.2), (0.3, 0.0)]):
        steps = [{**s, "rank": rank, "wall_time": now - 9 + s["step"], "total_steps": 100}
                 for s in _steps(own, comm, 8)]  # fmt: skip
        _records(run, rank, steps)
        (run / "heartbeats" / f"rank{rank}").write_text(f"{rank} node{rank + 1} 1 8 step 0 0 0\n")
    target = follow.Target(run)
    row = target.rows[0]
    tail = target.tail_of(row)
    assert tail is not None
    tail.update()
    target._set_state(row, [JobInfo("7", "RUNNING")])
    assert row.reason == "straggler rank 1 on node2 x3.00", row.reason


@pytest.fixture(scope="module")
def watchdog(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The watchdog's bash functions as the trainer's job.sbatch renders them."""
    runs = tmp_path_factory.mktemp("render")
    out = vitpod("render", "--cluster", "localslurm", "--model", "volo_tiny", "--offline",
                 runs=runs)  # fmt: skip
    assert out.returncode == 0, out.stderr
    script = Path(out.stdout.strip().splitlines()[-1]).read_text()
    return "\n".join(re.findall(r"^vitpod_\w+\(\) \{.*?^\}$", script, re.S | re.M))


def _bash(functions: str, body: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(["bash", "-c", f"{functions}\n{body}"], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


# rank node pid step section since_ms deadline beat, as trainer/telemetry/heartbeat.py writes
R0, R1 = "0 node1 11 {step} {section} 1000 5 9", "1 node2 12 {step} {section} 1003 5 9"


@pytest.mark.parametrize(
    ("sections", "stalled", "blamed"),
    [
        # every rank in a cold compile longer than the start-up's timeout: nobody's
        ((("startup", 0), ("startup", 0)), "", "- rank(s) 0 1 on node1 node2 together"),
        ((("step", 6), ("step", 6)), "", "- rank(s) 0 1 on node1 node2 together"),
        ((("step", 6), ("step", 6)), " 1", "node2"),  # rank 1 stopped: its node
        ((("checkpoint", 16), ("step", 16)), "", "node1"),  # rank 1 moved on; rank 0's save
    ],
)
def test_a_hang_counts_against_a_node_only_when_its_rank_is_behind(
    watchdog: str, sections: tuple, stalled: str, blamed: str
) -> None:
    lines = [r.format(section=s, step=n) for r, (s, n) in zip((R0, R1), sections, strict=True)]
    named = lines[1] if stalled else lines[0]  # the watchdog's pick: stopped, else longest in
    out = _bash(watchdog, "vitpod_blame " + " ".join(map(shlex.quote, (named, stalled, *lines))))
    assert out.strip() == blamed


def _after_hang(watchdog: str, run: Path, blamed: list[str], nodes: int) -> tuple[str, Path]:
    run.mkdir(parents=True, exist_ok=True)
    records = [{"kind": "hang", "rank": "0", "node": "node1", "blamed": b} for b in blamed]
    (run / "hangs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {"SLURM_JOB_PARTITION": "pretrain", "SLURM_JOB_NUM_NODES": str(nodes)}
    body = (f"vitpod_hangs={shlex.quote(str(run / 'hangs.jsonl'))} "
            f"vitpod_exclude={shlex.quote(str(run / 'exclude-nodes'))} vitpod_attempt=2\n"
            "vitpod_after_hang; echo rc=$? $rc")  # fmt: skip
    return _bash(watchdog, body, env), run / "exclude-nodes"


@pytest.mark.slurm
def test_a_node_is_excluded_only_while_the_partition_keeps_enough(
    local_slurm, watchdog: str, tmp_path: Path
) -> None:
    """The requeue of a 2-node job on the 2-node partition would wait for node1 forever
    (Reason=BadConstraints): it keeps node1; a 1-node job excludes it; a job's hang (no node
    blamed) never counts."""
    out, exclude = _after_hang(watchdog, tmp_path / "two", ["node1", "node1"], nodes=2)
    assert (
        "node1 hung 2 times, but without it partition pretrain has 1 node(s) up for the "
        "job's 2: not excluding it" in out
    ), out
    assert not exclude.exists() and "rc=1 75" in out, out  # max_restarts used: requeued
    out, exclude = _after_hang(watchdog, tmp_path / "one", ["node1", "node1"], nodes=1)
    assert exclude.read_text() == "node1\n" and "the requeued job excludes it" in out, out
    out, exclude = _after_hang(watchdog, tmp_path / "job", ["", ""], nodes=1)
    assert not exclude.exists() and "rc=1 75" in out, out


def test_a_few_ms_on_a_tiny_step_are_no_straggler(tmp_path: Path) -> None:
    """Measured here on 20-40 ms steps: rank 0 (extra host work) 0.036 s vs 0.022 s, 1.64 x,
    below hang.straggler_min_s (0.05 s above the median); the pulsed rank (0.549 s vs 0.164 s)
    is still named."""
    run = tmp_path / "run"
    (run / "plan.json").parent.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"hang": {"straggler_ratio": 1.3,
                                                        "straggler_steps": 20}}))  # fmt: skip
    _records(run, 0, _steps(0.036, 0.0))
    _records(run, 1, _steps(0.022, 0.014))
    assert stragglers(run) == []
    _records(run, 1, _steps(0.549, 0.0))
    _records(run, 0, _steps(0.164, 0.385))
    assert [(s.rank, round(s.ratio, 2)) for s in stragglers(run)] == [(1, 3.35)]
    plan = json.loads((run / "plan.json").read_text())
    plan["hang"]["straggler_min_s"] = 0.5  # the profile's setting, through plan.json
    (run / "plan.json").write_text(json.dumps(plan))
    assert stragglers(run) == []


def test_a_new_shape_under_compile_gets_the_startup_timeout(tmp_path: Path) -> None:
    """--compile on: an epoch's last, partial batch recompiles; its step runs under the
    start-up's timeout (600 s here), not 2 x the step median + floor, and stays out of the
    median."""
    beat = Heartbeat(tmp_path / "hb", 0, LIMITS)
    beat.compiled = True  # the trainer's decision
    epoch = [(torch.zeros(n, 3, 8, 8), None) for n in (4, 4, 4, 1)]  # a partial batch last
    batches = beat.batches(epoch, lambda: beat.step)
    try:
        next(batches)  # the first batch: compiled in the start-up, nothing changes
        assert beat.section == "startup"
        beat.stepped(1)
        for step in (2, 3):
            next(batches)
            beat.last_boundary -= 0.1
            beat.stepped(step)
        step_s = beat.measured["step"]
        assert beat.section == "step" and beat.deadline - beat.since < 2 * step_s + 10 + 1
        next(batches)  # the partial batch
        assert beat.section == "compile" and beat.deadline - beat.since == 600
        assert _fields(tmp_path / "hb" / "rank0")[4] == "compile"  # recorded as such
        beat.last_boundary -= 300  # the recompiling step took minutes
        beat.stepped(4)
        assert (beat.section, beat.measured["step"]) == ("step", step_s)
        beat.compiled = False  # --compile off: a new shape is an ordinary step
        next(beat.batches([(torch.zeros(2, 3, 8, 8), None)], lambda: beat.step))
        assert beat.section == "step"
    finally:
        beat.close()


def test_status_says_a_jobs_hang_blames_no_node_and_why_a_job_pends(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    record = {"job": "5", "restart": 0, "attempt": 0, "rank": "0", "node": "node1", "step": 0,
              "section": "startup", "quiet_s": 130, "timeout_s": 121, "blamed": ""}  # fmt: skip
    (run / "hangs.jsonl").write_text(json.dumps(record) + "\n")
    assert hangs.lines(run) == [
        "hang: rank 0 on node1 in startup at step 0: no progress for 130 s (timeout 121 s); no "
        "rank behind the others: the job's hang, no node blamed; job 5 restart 0 attempt 0; "
        "stacks "
    ]
    pending = status.stage_status(JobState("pretrain", run, ["5"]),
                                  [JobInfo("5", "PENDING", "BadConstraints")])  # fmt: skip
    assert "  pending: Slurm's reason: BadConstraints" in status.format_status([pending])
