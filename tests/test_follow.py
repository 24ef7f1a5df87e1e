"""The follow view without Slurm: metrics tailing and ETA (Chain.follow() on the local profile,
drawn as rich's live table, is followed in tests/test_pipeline_local.py)."""

from __future__ import annotations

import json

import pytest

from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.watching import follow
from vitpod.workflows.watching.metricstail import MetricsTail


def step(rank: int, n: int, wall: float, total: int = 100, loss: float = 1.0) -> str:
    record = {"kind": "step", "rank": rank, "step": n, "loss": loss, "images_per_s": 10.0,
              "time": {"step": 0.5}, "total_steps": total, "wall_time": wall}  # fmt: skip
    return json.dumps(record) + "\n"


def test_tail_reads_only_new_lines_and_measures_eta(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    rank0, rank1 = metrics / "rank0.jsonl", metrics / "rank1.jsonl"
    # 10 steps at 2 s each (wall clock), and a line still being written.
    rank0.write_text("".join(step(0, n, 1000.0 + 2 * n) for n in range(1, 11)) + '{"kind": "st')
    rank1.write_text(step(1, 10, 1020.0))
    tail = MetricsTail(tmp_path)
    tail.update()
    assert (tail.step, tail.total, tail.images_per_s) == (10, 100, 20.0)
    assert tail.eta_s(now=1020.0) == pytest.approx(90 * 2.0)
    # Steps are written in batches: 30 s after step 10 ended, 30 s of the 180 have gone by.
    assert tail.eta_s(now=1050.0) == pytest.approx(150.0)
    with open(rank0, "a") as handle:  # the torn line is finished, then a resume from step 5
        handle.write('ep", "rank": 0, "step": 11, "wall_time": 1022.0}\n')
        handle.write(step(0, 6, 5000.0, loss=0.5) + step(0, 7, 5001.0, loss=0.25))
    tail.update()
    # Older steps after a restart reset the pace: 1 s a step now, 93 steps left.
    assert (tail.step, tail.loss) == (7, 0.25)
    assert tail.eta_s(now=5001.0) == pytest.approx(93.0)
    with open(rank0, "a") as handle:
        handle.write(json.dumps({"kind": "summary", "steps": 100, "images_per_s": 42.0}) + "\n")
    tail.update()
    assert tail.done and tail.eta_s() == 0.0 and tail.images_per_s == 42.0


def test_eta_falls_back_to_step_time_without_wall_clock(tmp_path):
    (tmp_path / "metrics").mkdir()
    line = {"kind": "step", "rank": 0, "step": 4, "time": {"step": 0.25}, "total_steps": 8}
    (tmp_path / "metrics" / "rank0.jsonl").write_text(json.dumps(line) + "\n")
    tail = MetricsTail(tmp_path)
    tail.update()
    assert tail.eta_s() == pytest.approx(1.0)


def test_status_refuses_a_directory_that_is_no_run(tmp_path, capsys):
    from vitpod.workflows.commands.status_cli import main

    assert main(["--run", str(tmp_path), "--follow"]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "pretrain", "job_ids": []}))
    with pytest.raises(ConfigError, match="--interval 0.0: must be a positive number"):
        main(["--run", str(tmp_path), "--follow", "--interval", "0"])


def test_a_poll_without_an_answering_squeue_keeps_following(tmp_path, monkeypatch):
    """squeue failing (here: no slurm.conf to read; on a cluster, a controller restarting) is
    shown under the rows and the view goes on with the last states instead of crashing."""
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "pretrain", "job_ids": ["7"]}))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-such-slurm.conf"))
    # squeue retries a missing slurm.conf for 60 s ("retrying in 1sec up to 60sec"): it is
    # cut off at its timeout, and 2 s show that as well as the 30 of TIMEOUT_S do.
    monkeypatch.setitem(slurm.TIMEOUT_S, "squeue", 2)
    target = follow.Target(tmp_path)
    target.poll()
    assert "squeue did not answer" in target.note and not target.ended()
    assert target.rows[0].state == "PENDING"
    assert any("squeue did not answer" in line for line in follow.plain_lines(target))
