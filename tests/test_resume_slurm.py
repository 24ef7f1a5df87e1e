"""Exact resume on the real local Slurm (2 nodes x 1 rank), on both loaders (DALI's job with
token labels in TokenLabeling's published layout, MixToken on).

Live jobs are signalled as a cluster does it: `scancel --signal=USR2` (what `--signal=USR2@grace`
delivers to every process of the job step) and SIGTERM (what preemption and `scontrol requeue`
send), at the first steps of an epoch, at an epoch boundary and mid-epoch while an asynchronous
checkpoint is being written, twice in one run. Each ends with the final parameters, the
optimizer state and every rank's logged per-step losses of an uninterrupted job, bit for bit.
A rank killed with SIGKILL fails its job with the cause in `make status`; resubmitting the
same script resumes from the last complete checkpoint and still ends bit-identical.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.fixtures_slurm import kill_rank, submit
from tests.helpers import last_step, make, one_rank_per_node, profile_copy, wait_until
from tests.test_published_token_labels import write_published
from vitpod.registry import runfiles
from vitpod.trainer.checkpointing.preempt import HOLD_ENV

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# volo_tiny on half the digits at 32 px, 2 epochs of 12 steps (716 images, 2 ranks x 32): every
# random augmentation of the recipe on (random resized crop, flip, RandAugment, CutOut).
# --log-interval 1: every step's record reaches metrics/ when it ends, so the test sees the
# step it signals at (with 1000 the records wait for a checkpoint, and a "step 2" signal
# landed at step 5 or later).
COMMON = "--workers 1 --log-interval 1 --epochs 2 --warmup-epochs 1 --drop-path 0.1 --batch-size 32"
RANKS = 2
STEPS_PER_EPOCH = 12
# Ranks agree on a preemption at the first step boundary where any of them has the signal
# (trainer/checkpointing/preempt.py); each rank logs the boundary where it saw its own. The
# signal is sent once step s is recorded, but scancel takes a while to reach the ranks: on a
# 2-core Xeon (40 ms steps) the job was at step 6 when slurmctld got it for s = 2.
_PREEMPTED = re.compile(r"preempted \((\w+)\): checkpointed at step (\d+)")
_SEEN = re.compile(r"(SIG\w+) seen at the boundary after step (\d+)")
# loader -> (ARGS, events): (signal, at or after this step). "KILL" is SIGKILL to one rank.
JOBS = {
    # USR2 in the first steps of epoch 0, SIGTERM at the last step of epoch 0, on purpose: the
    # ranks are held 10 s at that step's boundary (VITPOD_TEST_HOLD_AT_STEP, test-only), so the
    # signal lands there and the requeued start must begin epoch 1, not epoch 0 again.
    # DALI's job also cuts token labels with the crop windows its pipeline returns.
    "dali": (
        "--loader dali --checkpoint-every 5 --token-label --token-label-data {labels}",
        [("USR2", 2), ("TERM", STEPS_PER_EPOCH)],
    ),
    # A checkpoint every step, written in the background while the next step runs: USR2 lands
    # with one in flight. Then rank 1 is SIGKILLed mid-step in epoch 1.
    "torch": ("--loader torch --workers 0 --checkpoint-every 1", [("USR2", 6), ("KILL", 16)]),
}


def _drive(slurm, tmp_path: Path, job: str, run: Path, events: list[tuple[str, int]]) -> str:
    """Deliver `events` to the live job; returns the final state of the job that finished it."""
    restart = 0
    for sig, step in events:
        wait_until(f"job {job} step {step}", lambda s=step: last_step(run) >= s, 900)  # type: ignore[misc]
        if sig == "KILL":
            kill_rank(job, 1)
            assert slurm.wait(job, timeout=900) == "FAILED"
            status = make("status", f"RUN={run}", runs=tmp_path / "runs", timeout=120)
            assert "FAILED" in status.stdout, status.stdout + status.stderr
            assert "rank 1" in status.stdout and "SIGKILL" in status.stdout, status.stdout
            # Resubmitting the kept script resumes from the last complete checkpoint.
            out = subprocess.run(["sbatch", "--parsable", str(run / "job.sbatch")],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            job, restart = out.stdout.strip().split(";")[0], -1
            continue
        subprocess.run(["scancel", f"--signal={sig}", job], check=True)
        restart += 1
        log = run / "logs" / f"train-{job}-restart{restart}-rank0.log"
        wait_until(f"restart {restart} of job {job}", log.is_file, 900)
        stopped = f"train-{job}-restart{restart - 1}"  # the logs of the restart signalled
        landed = _preempted_at(run / "logs" / f"{stopped}-rank0.log")
        seen = _seen_after(run / "logs", f"{stopped}-rank*.log")
        assert landed[0] == f"SIG{sig}" and step <= landed[1] == min(seen), (
            f"{sig} sent once step {step} was recorded; the ranks saw it after steps {seen}, "
            f"the preemption checkpoint is at step {landed[1]}"
        )
    return slurm.wait(job, timeout=900)


def _preempted_at(log: Path) -> tuple[str, int]:
    """(signal, step) of the preemption checkpoint a rank-0 log reports."""
    found = _PREEMPTED.findall(log.read_text())
    assert len(found) == 1, f"{log}: no single preemption line: {found}"
    return found[0][0], int(found[0][1])


def _seen_after(logs: Path, pattern: str) -> list[int]:
    """The step boundary at which each rank that got the signal saw it."""
    seen = [int(step) for log in logs.glob(pattern) for _, step in _SEEN.findall(log.read_text())]
    assert seen, f"{logs}/{pattern}: no rank logged seeing the signal"
    return seen


def _losses(run: Path) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss; a step redone after a resume from an older checkpoint keeps its
    last record (the one the finished run's parameters came from)."""
    records = runfiles.read_metrics(run)
    return {(r["rank"], r["step"]): r["loss"] for r in records if r["kind"] == "step"}


def _last_checkpoint(run: Path) -> dict:
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    return torch.load(newest / "rank0.pt", map_location="cpu", weights_only=False)


def _differences(reference: Path, resumed: Path) -> dict[str, list]:
    want = torch.load(reference / "final" / "model.pt", weights_only=True)
    got = torch.load(resumed / "final" / "model.pt", weights_only=True)
    assert want.keys() == got.keys()
    a, b = _last_checkpoint(reference), _last_checkpoint(resumed)
    assert a["step"] == b["step"] == 2 * STEPS_PER_EPOCH
    moments = [
        (i, k)
        for i, state in a["optimizer"]["state"].items()
        for k, value in state.items()
        if not torch.equal(value, b["optimizer"]["state"][i][k])
    ]
    la, lb = _losses(reference), _losses(resumed)
    assert len(la) == RANKS * 2 * STEPS_PER_EPOCH and la.keys() == lb.keys()
    return {
        "parameters": [k for k in want if not torch.equal(want[k], got[k])],
        "optimizer": moments,
        "losses": sorted(k for k in la if la[k] != lb[k]),
    }


def test_preempted_jobs_end_bit_identical_to_uninterrupted_ones(
    local_slurm, digits_half_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    profile = profile_copy(tmp_path, data=digits_half_dir.parent, **one_rank_per_node())
    labels = write_published(digits_half_dir, tmp_path / "token_label_data")
    jobs = {}
    for loader, (args, events) in JOBS.items():
        args = args.format(labels=labels)
        reference = submit(tmp_path, profile, f"{COMMON} {args}")  # never stopped
        with monkeypatch.context() as env:
            if loader == "dali":
                env.setenv(HOLD_ENV, f"{STEPS_PER_EPOCH}:10")
            jobs[loader] = (reference, submit(tmp_path, profile, f"{COMMON} {args}"), events)
    with ThreadPoolExecutor(len(jobs)) as pool:
        ends = {
            loader: pool.submit(_drive, local_slurm, tmp_path, *stopped, events)
            for loader, (_, stopped, events) in jobs.items()
        }
        states = {loader: future.result() for loader, future in ends.items()}
    for loader, ((ref_job, reference), (_, resumed), _) in jobs.items():
        assert states[loader] == "COMPLETED", loader
        assert local_slurm.wait(ref_job, timeout=900) == "COMPLETED", loader
        assert _differences(reference, resumed) == {
            "parameters": [],
            "optimizer": [],
            "losses": [],
        }, loader
    # Each requeue kept its own logs, and the resumed ranks said where they resumed from.
    dali_run = jobs["dali"][1][1]
    at_the_end = next((dali_run / "logs").glob("train-*-restart1-rank0.log")).read_text()
    assert f"checkpointed at step {STEPS_PER_EPOCH}" in at_the_end  # the epoch's last step
    assert len(list((dali_run / "logs").glob("train-*-restart2-rank*.log"))) == RANKS
    assert (
        "resumed from" in next((dali_run / "logs").glob("train-*-restart2-rank0.log")).read_text()
    )
