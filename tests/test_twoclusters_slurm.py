"""Two real Slurm clusters under one slurmdbd (issue 33): pretrain on cluster 1, fine-tune on
cluster 2. One pipeline from `make pipeline` runs to the end, the model carried across; one from
Python is preempted in its pretrain, does not hand over before the pretrain's real end, then has
its final model damaged, which is caught and starts no fine-tune."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import last_step, make, profile_copy, vitpod, wait_until
from vitpod.registry import runfiles
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.pipeline import chain_cross
from vitpod.workflows.pipeline.chain import Chain, ChainError
from vitpod.workflows.pipeline.chain_stage import job_plan

# Short stages (tests/test_pipeline_slurm.py's settings).
ARGS = ("--workers 0 --loader torch -b 16 --seed 3 --log-interval 5 --aa rand-n0-m0 --reprob 0 "
        "--hflip 0 --scale 1 1 --epochs 1 --warmup-epochs 0 --checkpoint-every 0")  # fmt: skip

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _profiles(tmp_path: Path, data: Path) -> tuple[str, str]:
    """localslurm and localslurm2 with the test's data set and a storage root each."""
    one, two = (profile_copy(tmp_path, base, data=data, runs=tmp_path / root)
                for base, root in (("localslurm", "one"), ("localslurm2", "two")))  # fmt: skip
    return str(one), str(two)


def test_make_pipeline_pretrains_on_cluster_1_and_fine_tunes_on_cluster_2(
    two_clusters, digits_dir, tmp_path
):
    first, second = _profiles(tmp_path, digits_dir.parent)
    env: dict[str, str | None] = {"VITPOD_RUN_ROOT": None}  # each stage on its profile's storage
    done = make("pipeline", f"CLUSTER={first}", f"FT_CLUSTER={second}", "NODES=1",
                f"ARGS={ARGS} --max-steps 6", "TIME=00:10:00", env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    pre = Path(re.search(r"pretrain: submitted job \d+ \((.+)\)", done.stdout).group(1))
    record = json.loads((pre.parent / runfiles.PIPELINE).read_text())
    job = record["stages"]["pretrain"]["job_ids"][0]
    fin = Path(record["stages"]["finetune"]["run_dir"])
    fin_job = record["stages"]["finetune"]["job_ids"][0]
    assert pre.parent.parent == tmp_path / "one" and fin.parent.parent == tmp_path / "two"

    # sacct on each cluster shows its own stage, and only that one; the fine-tune was submitted
    # after the pretrain ended.
    ((pre_name, pre_state, pre_end),) = two_clusters.sacct(two_clusters.first, [job],
                                                            "JobName,State,End")  # fmt: skip
    ((fin_name, fin_state, fin_submit),) = two_clusters.sacct(
        two_clusters.second, [fin_job], "JobName,State,Submit"
    )
    assert pre_name.endswith("pretrain") and pre_state == "COMPLETED"
    assert fin_name.endswith("finetune") and fin_state == "COMPLETED" and fin_submit >= pre_end
    assert two_clusters.sacct(two_clusters.first, [fin_job], "JobName") == []
    # The transferred checkpoint's digest is the pretrain's, in both manifests; the fine-tune
    # read it there.
    digest = json.loads((pre / runfiles.FINAL / runfiles.FINAL_RECORD).read_text())["sha256"]
    moved = runfiles.read_manifest(fin)["transfer"]
    assert moved["sha256"] == digest and moved["to_cluster"] == two_clusters.second
    assert moved["from_cluster"] == two_clusters.first
    assert runfiles.read_manifest(pre)["transfers"][0]["sha256"] == digest
    assert Path(moved["to"]).parent.parent.parent == fin.parent  # <two>/<pipeline>/...
    config = json.loads((fin / runfiles.CONFIG).read_text())
    assert config["finetune"] == str(Path(moved["to"]).parent.parent)
    # status names the cluster that ran the fine-tune, asking it with -M.
    shown = vitpod("status", "--run", str(pre.parent), env=env)
    assert re.search(rf"finetune\s+COMPLETED\s+jobs={fin_job} cluster=vitpod2", shown.stdout), (
        shown.stdout + shown.stderr
    )
    # each stage's goodput from its own cluster's accounting: no part negative (cluster 2's job
    # ids restart with its state; an older job of the same id is not this run's)
    assert shown.stdout.count("goodput:") == 2 and not re.search(r"=-\d", shown.stdout), (
        shown.stdout
    )


def test_a_preempted_pretrain_hands_over_only_at_its_end_and_a_damaged_model_is_caught(
    two_clusters, digits_dir, tmp_path, monkeypatch
):
    monkeypatch.delenv("VITPOD_RUN_ROOT", raising=False)  # each stage on its profile's storage
    first, second = _profiles(tmp_path, digits_dir.parent)
    run = Chain(first, "volo_tiny", 1, ARGS, pretrain_args="--epochs 3",
                finetune_args="--max-steps 4", finetune_cluster=second,
                time="00:10:00").submit()  # fmt: skip
    pre, fin = run.stages["pretrain"], run.stages["finetune"]
    job = pre.job_ids[0]
    wait_until("pretrain step 8", lambda: last_step(pre.run_dir) >= 8, 180, 0.5)
    subprocess.run(["scancel", "-M", two_clusters.first, "--signal=USR2", job], check=True)
    restart = pre.run_dir / runfiles.LOGS / f"train-{job}-restart1-rank0.log"

    def requeued() -> bool:  # the chain looks on every poll: no hand-over before the real end
        states = {s.name: s.state for s in run.status()}
        assert fin.job_ids == [] and states["pretrain"] != "COMPLETED", states
        return restart.is_file()

    wait_until("the requeued start", requeued, 180, 0.5)
    # Its real end, watched here: the chain does not look, so nothing is handed over yet.
    jobstate.wait_jobs(jobstate.JobStatePoller([job]), timeout=300, poll_s=1)
    starts = two_clusters.sacct(two_clusters.first, [job], "State")
    assert starts == [["COMPLETED"]]
    model = pre.run_dir / runfiles.FINAL / runfiles.FINAL_MODEL
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the final model damaged after the trainer recorded its digest
    model.write_bytes(bytes(data))

    # `make status` from another process (the chain reattached from pipeline.json) hands over
    # as the submitting process would: the damage is caught, nothing is submitted.
    shown = vitpod("status", "--run", str(run.directory))
    assert re.search(r"copies failed.*sha256", shown.stdout), shown.stdout + shown.stderr
    record = json.loads((run.directory / runfiles.PIPELINE).read_text())
    assert "sha256" in record["handover"]["error"]
    assert record["stages"]["finetune"]["state"] == chain_cross.REFUSED
    assert record["stages"]["finetune"]["job_ids"] == []
    source = Path(job_plan(fin).request.finetune_from)
    assert not (source / runfiles.FINAL / runfiles.FINAL_MODEL).exists()
    # and the chain that submitted it, looking next, finds the hand-over refused
    with pytest.raises(ChainError, match="pretrain|finetune"):
        run.wait(timeout=60, poll_s=1)
    assert fin.job_ids == []
