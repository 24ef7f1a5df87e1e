"""The pipeline on the real local Slurm: rendered offline, reviewed and submitted as rendered
(Slurm runs those bytes), two preemptions of the pretrain, exact resume, afterok."""

import json
import subprocess
import time

import pytest

from tests import measured_comm
from tests.helpers import last_step, profile_copy, wait_until
from vitpod.workflows.pipeline.chain import Chain, ChainError
from vitpod.workflows.watching.status import status_line

# Augmentation that draws no random numbers (kept simple; both loaders now resume exactly with
# random crops on too: tests/test_resume_slurm.py).
COMMON = "--workers 0 --loader torch -b 16 --seed 3 --log-interval 10"
COMMON += " --aa rand-n0-m0 --reprob 0 --hflip 0 --scale 1 1"
PRETRAIN = "--epochs 2 --warmup-epochs 0 --checkpoint-every 0"
FINETUNE = "--max-steps 4 --epochs 1"


def _preempt(job_id: str) -> None:
    # USR2 to every process of the job's steps (not the batch shell), as --signal=USR2@grace does.
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)


def _batch_script(job_id: str) -> bytes:
    """The batch script Slurm keeps for a job that is still pending or running."""
    return subprocess.run(["scontrol", "write", "batch_script", job_id, "-"],
                          capture_output=True, check=True).stdout  # fmt: skip


def _sacct_times(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", ",".join(job_ids), "-o", "JobIDRaw,Start,End"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {row[0]: (row[1], row[2]) for row in (line.split("|") for line in out.splitlines())}


@pytest.mark.slurm
@pytest.mark.slow
def test_pipeline_survives_two_preemptions_exactly(local_slurm, digits_dir, tmp_path):
    torch = pytest.importorskip("torch")
    cluster = str(profile_copy(tmp_path, data=digits_dir.parent))
    common = dict(nodes=1, args=COMMON, pretrain_args=PRETRAIN, run_root=str(tmp_path / "runs"))
    # Rendered OFFLINE, reviewed (read here), then submitted from its directory, as a user does
    # with make pipeline OFFLINE=1 and make submit RUN=<pipeline dir>.
    rendered = Chain(cluster, "volo_tiny", finetune_args=FINETUNE, offline=True, **common)
    reviewed = {stage: path.read_bytes() for stage, path in rendered.render().items()}
    assert rendered.directory is not None
    run = Chain.from_dir(rendered.directory).submit()
    # Slurm holds, byte for byte, the scripts reviewed: traps included, no dependency in them.
    ran = {s: _batch_script(rec.job_ids[0]) for s, rec in run.stages.items()}
    assert ran == reviewed
    assert b"trap 'vitpod_signal USR2' USR2" in ran["pretrain"]
    # The same pretrain, never interrupted, side by side: the reference for exactness.
    reference = Chain(cluster, "volo_tiny", stages=("pretrain",), **common).submit()

    pre = run.stages["pretrain"]
    job = pre.job_ids[0]
    wait_until("pretrain step 8", lambda: last_step(pre.run_dir) >= 8, 150, interval=0.5)
    _preempt(job)
    first = last_step(pre.run_dir)
    restart1 = pre.run_dir / "logs" / f"train-{job}-restart1-rank0.log"
    wait_until("the first restart", restart1.is_file, 150, interval=0.5)
    wait_until("progress after", lambda: last_step(pre.run_dir) >= first + 12, 150, interval=0.5)
    _preempt(job)

    report = run.wait(timeout=240, poll_s=1)
    reference.wait(timeout=120, poll_s=1)

    # Each (re)start kept its own logs: restart count and rank in the names.
    logs = sorted(p.name for p in (pre.run_dir / "logs").glob("train-*.log"))
    assert logs == [f"train-{job}-restart{r}-rank{k}.log" for r in range(3) for k in range(2)]
    shown = {s.name: s for s in run.status()}
    assert shown["pretrain"].restarts == 2 and shown["pretrain"].state == "COMPLETED"
    # As the README prints a stage (JobState has no line(): its views format it).
    assert status_line(shown["pretrain"]).startswith("pretrain  COMPLETED   jobs=")
    assert "preempted" in (pre.run_dir / "logs" / logs[0]).read_text()

    # Final parameters equal the uninterrupted run's, bit for bit.
    ref_dir = reference.stages["pretrain"].run_dir
    got = torch.load(pre.run_dir / "final" / "model.pt", weights_only=True)
    want = torch.load(ref_dir / "final" / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)

    # The finetune waited for the pretrain's real end (afterok survives requeues).
    fin_job = run.stages["finetune"].job_ids[0]
    times = _sacct_times([job, fin_job])
    assert times[fin_job][0] >= times[job][1]
    # The afterok was sbatch's command line, recorded in the manifest; the script is unchanged.
    fin = run.stages["finetune"]
    assert (fin.run_dir / "job.sbatch").read_bytes() == reviewed["finetune"]
    manifest = json.loads((fin.run_dir / "manifest.json").read_text())
    assert manifest["resolved"]["dependency"] == f"afterok:{job}"
    assert manifest["stage"] == "finetune" and manifest["job_ids"] == [fin_job]
    assert report["stages"]["finetune"]["state"] == "COMPLETED"
    assert json.loads((run.stages["finetune"].run_dir / "config.json").read_text())[
        "finetune"
    ] == str(pre.run_dir)

    # The cost model against what the trainer measured (reported, not asserted tightly).
    decision = pre.plan.decision
    ratio = measured_comm.compare(decision.costs.predicted_comm_s, ref_dir)
    print(f"\nengine {decision.engine.name}: predicted vs measured comm per step {ratio}")
    assert ratio["measured_s"] is not None and ratio["measured_s"] > 0


@pytest.mark.slurm
def test_cancelled_pipeline_fails_wait_without_accounting(local_slurm, digits_dir, tmp_path):
    from tests.fixtures_slurm import restart_slurm, stop_slurmdbd

    cluster = str(profile_copy(tmp_path, data=digits_dir.parent))
    run = Chain(
        cluster, "volo_tiny", nodes=1, args="--epochs 50", run_root=str(tmp_path / "runs")
    ).submit()
    stop_slurmdbd()
    try:
        subprocess.run(["scancel", run.stages["pretrain"].job_ids[0]], check=True)
        start = time.monotonic()
        with pytest.raises(ChainError, match="pretrain: job .* ended CANCELLED"):
            run.wait(timeout=120, poll_s=1)
        assert time.monotonic() - start < 60
        # slurmctld cancels the dependent finetune (kill_invalid_depend) at its next dependency
        # check, which may come a few seconds after wait() has seen the pretrain end.
        expected = {"pretrain": "CANCELLED", "finetune": "CANCELLED"}
        states = lambda: {s.name: s.state for s in run.status()}  # noqa: E731
        wait_until(f"both stages {expected}", lambda: states() == expected, 30, interval=1)
    finally:
        restart_slurm()
