"""True progress and the goodput ledger on the real local Slurm (2 nodes x 1 rank, volo_tiny).

- ETA: a run with the DEFAULT log interval (steps are written every 50 steps, each stamped when
  it ended); the ETA that the follow view shows at the middle of the run, read through its own
  code path (follow.Target), is compared with the time the run's last step really ended.
- Goodput: a run preempted with `scancel --signal=USR2`, requeued, then one rank SIGKILLed after
  a checkpoint and the job resubmitted: the ledger's parts add up to its wall time, lost work is
  counted for the steps redone after the kill, and the queue wait covers every start.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.fixtures_slurm import kill_rank, submit
from tests.helpers import last_step, one_rank_per_node, profile_copy, wait_until
from vitpod.analysis.goodput import SLURM_RESOLUTION_S, segments
from vitpod.registry import runfiles
from vitpod.workflows.watching import follow, goodput, status

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# 2 ranks x 32 images: 23 steps an epoch on digits; 200 steps cross 8 epoch ends (evaluation and
# a checkpoint each), as a real run's pace includes them: 4 in each half.
STEPS = 200
ETA_ARGS = f"--loader torch --workers 0 --epochs 9 --max-steps {STEPS} --batch-size 32"
# The ETA at the middle is a forecast from the pace of the first half; the second half meets the
# same work (4 epoch ends each), but the 2 CPU cores are shared with the suite's other worker,
# whose load changes from test to test: CI once ran the second half 33 % slower than the first
# (ETA 7.6 s, real 10.1 s). No forecast can know that, so the bound (25 %, the issue's) is widened
# by the pace change the run's own step stamps measured after the forecast was made.
ETA_TOLERANCE = 0.25


def test_eta_at_the_middle_of_a_run_matches_its_real_end(local_slurm, digits_dir, tmp_path):
    profile = profile_copy(tmp_path, data=digits_dir.parent, **one_rank_per_node())
    job, run = submit(tmp_path, profile, ETA_ARGS)
    target = follow.Target(run)

    def middle():
        target.poll()
        tail = target.tail_of(target.rows[0])
        assert tail is not None
        # Steps are written every 50 steps and at each epoch's end (.., 92, 115, ..): the middle.
        if tail.step is not None and tail.total and tail.total // 2 - 5 <= tail.step < tail.total:
            return tail, time.time()
        return None

    tail, read_at = wait_until("a step written at the middle", middle, 600, interval=0.5)
    eta = tail.eta_s(now=read_at)
    shown = follow.cells(target.rows[0])["ETA"]
    assert local_slurm.wait(job, timeout=600) == "COMPLETED"
    steps = [r for r in runfiles.read_metrics(run, 0) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    stamps = [r["wall_time"] for r in steps]
    assert len(set(stamps)) == STEPS, "every step carries its own end time"
    real = stamps[-1] - read_at
    print(f"ETA at step {tail.step}: {eta:.1f} s (shown {shown}); the run's last step ended "
          f"{real:.1f} s later")  # fmt: skip
    assert STEPS // 2 - 5 <= tail.step <= STEPS // 2 + 10  # the batch written at the middle
    assert real > 2  # a forecast over seconds, not a rounding of zero
    step = tail.step
    pace_before = (stamps[step - 1] - stamps[0]) / (step - 1)  # the pace the ETA was made from
    pace_after = (stamps[-1] - stamps[step - 1]) / (STEPS - step)
    drift = abs(pace_after / pace_before - 1)
    print(f"pace {pace_before * 1e3:.1f} ms/step before the forecast, {pace_after * 1e3:.1f} after")
    assert abs(eta - real) <= (ETA_TOLERANCE + drift) * real


def test_goodput_ledger_of_a_preempted_and_killed_run(local_slurm, digits_dir, tmp_path):
    profile = profile_copy(tmp_path, data=digits_dir.parent, **one_rank_per_node())
    args = "--loader torch --workers 0 --epochs 2 --log-interval 1 --checkpoint-every 10 -b 32"
    job, run = submit(tmp_path, profile, args)
    wait_until("step 5", lambda: last_step(run) >= 5, timeout=600)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_until(
        "the requeued start",
        lambda: (run / "logs" / f"train-{job}-restart1-rank0.log").is_file(),
        timeout=600,
    )
    wait_until("step 33", lambda: last_step(run) >= 33, timeout=600)
    kill_rank(job, 1)  # after the checkpoint of step 30: the steps after it are redone
    assert local_slurm.wait(job, timeout=600) == "FAILED"
    found = status.run_status(run)[0].diagnosis  # the triage of a killed rank, on the way
    assert found is not None and found.cause == "a rank was killed", found
    assert any("task 1" in line for line in found.lines), found
    again = subprocess.run(["sbatch", "--parsable", str(run / "job.sbatch")],
                           capture_output=True, text=True, check=True)  # fmt: skip
    job2 = again.stdout.strip().split(";")[0]
    assert local_slurm.wait(job2, timeout=600) == "COMPLETED"

    ledger = goodput.ledger(run, [job, job2])
    attempts = goodput.attempts([job, job2])
    print(ledger.line())
    assert [(a.job_id, a.restart) for a in attempts] == [(job, 0), (job, 1), (job2, 0)]
    assert ledger.attempts == 3
    # Every start waited in the queue (the requeue's hold included), and the queue part is
    # exactly the sum of sacct's Submit -> Start of the three starts.
    queue = [a.start - a.submit for a in attempts if a.start is not None]
    assert len(queue) == 3 and ledger.parts["queue"] == pytest.approx(sum(queue))
    assert queue[1] > 0  # a requeued job is held before it starts again
    wall = sum(a.end - a.submit for a in attempts if a.end is not None)
    # sacct's End is cut to the second: an attempt whose trainer wrote after it ends there.
    assert wall <= ledger.wall < wall + len(attempts) * SLURM_RESOLUTION_S
    # The parts are measured apart (sacct's whole seconds, the trainer's step, checkpoint and
    # evaluation timers); what none explains is the loop's overhead between steps (the
    # preemption vote, logging) plus sacct's rounding: at most 1 s per start plus 10 %.
    assert abs(ledger.other) <= 3 * 1.0 + 0.10 * wall, ledger.as_dict()
    assert all(v >= -1.0 for v in ledger.parts.values()), ledger.as_dict()
    segs = segments(
        [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    )
    assert [s["start"]["step"] for s in segs][0] == 0
    killed_at = segs[1]["steps"][-1]["step"]
    resumed_at = segs[2]["start"]["step"]
    # USR2 checkpoints where it lands: the requeued start lost nothing. The kill did.
    assert segs[1]["start"]["step"] == segs[0]["steps"][-1]["step"]
    # The newest complete checkpoint: step 30's, or the epoch end's (23) if 30's write was
    # still in flight when the rank died.
    assert resumed_at in (23, 30) and killed_at > resumed_at
    assert ledger.parts["lost"] > 0
    assert ledger.parts["checkpoint"] > 0 and ledger.parts["eval"] > 0
    assert ledger.parts["startup"] > 0 and ledger.parts["training"] > 0
    assert "container_start.json" in " ".join(ledger.notes)
    # CPU-hours (a CPU profile's device-hours) against sacct's own figure: CPUTimeRAW is each
    # start's allocated CPUs x its elapsed seconds; useful ones are the kept steps' share.
    cputime = subprocess.run(
        ["sacct", "-D", "-X", "-P", "-n", "-j", f"{job},{job2}", "-o", "CPUTimeRAW"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert ledger.device_kind == "CPU" and len(cputime) == 3
    assert ledger.device_hours == pytest.approx(sum(map(int, cputime)) / 3600)
    assert 0 < ledger.useful_device_hours < ledger.device_hours
    assert "cpu_hours=" in ledger.line()
