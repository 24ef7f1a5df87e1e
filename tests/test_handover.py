"""A pipeline across two clusters, without Slurm (issue 33): the final model carried to the
fine-tune's storage (only it, verified by sha256, a bad copy retried then reported and never left
where the fine-tune reads), the space check, the image check, and the plan of such a chain.
The live two-cluster run is tests/test_twoclusters_slurm.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vitpod.registry import runfiles
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import multicluster
from vitpod.workflows.pipeline import handover
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.site.profile import PROFILE_DIR, Profile, load_profile

OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def _pretrain(tmp_path: Path, size: int = 300_000) -> Path:
    """A finished pretrain run as the trainer leaves it: final/model.pt and its manifest (with
    the sha256), and what must not cross (checkpoints, logs)."""
    run = tmp_path / "pod" / "20260101T000000Z-volo_tiny-pipeline-abc123" / "pretrain"
    (run / runfiles.FINAL).mkdir(parents=True)
    (run / runfiles.CHECKPOINTS / "step_6").mkdir(parents=True)
    (run / runfiles.CHECKPOINTS / "step_6" / "rank0.pt").write_bytes(b"c" * 1000)
    (run / runfiles.LOGS).mkdir()
    data = bytes(range(256)) * (size // 256)
    (run / runfiles.FINAL / runfiles.FINAL_MODEL).write_bytes(data)
    manifest = {"model": "volo_tiny", "file": runfiles.FINAL_MODEL, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    (run / runfiles.FINAL / runfiles.FINAL_RECORD).write_text(json.dumps(manifest))
    return run


def _destination(tmp_path: Path) -> Path:
    return tmp_path / "superpod" / "20260101T000000Z-volo_tiny-pipeline-abc123" / "pretrain-final"


def test_the_final_model_alone_crosses_verified_by_the_pretrains_sha256(tmp_path):
    run, dest = _pretrain(tmp_path), _destination(tmp_path)
    assert handover.needs_transfer(run, dest.parent / "finetune")
    record = handover.transfer(run, dest)
    want = json.loads((run / runfiles.FINAL / runfiles.FINAL_RECORD).read_text())["sha256"]
    assert record["sha256"] == record["pretrain_manifest_sha256"] == want
    assert handover.sha256_file(dest / runfiles.FINAL / runfiles.FINAL_MODEL) == want
    assert record["attempts"] == 1 and record["bytes"] == 300_000 - 300_000 % 256
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == ["final/model.json", "final/model.pt"]  # no checkpoints, logs


def test_a_damaged_model_is_caught_and_nothing_is_left_for_the_fine_tune(tmp_path):
    run, dest = _pretrain(tmp_path), _destination(tmp_path)
    model = run / runfiles.FINAL / runfiles.FINAL_MODEL
    data = bytearray(model.read_bytes())
    data[1234] ^= 0xFF  # one flipped byte after the trainer recorded the digest
    model.write_bytes(bytes(data))
    with pytest.raises(handover.TransferError, match=f"{handover.ATTEMPTS} copies failed.*sha256"):
        handover.transfer(run, dest)
    assert not any((dest / runfiles.FINAL).iterdir())  # no model, no manifest, no .partial


def test_a_partial_copy_is_retried_and_the_whole_one_kept(tmp_path):
    run, dest = _pretrain(tmp_path), _destination(tmp_path)
    calls = []

    def flaky(source: Path, target: Path) -> None:  # the link drops half way, once
        calls.append(target)
        data = source.read_bytes()
        target.write_bytes(data[: len(data) // 2] if len(calls) == 1 else data)

    record = handover.transfer(run, dest, copy=flaky)
    assert record["attempts"] == 2 and record["sha256"] == record["pretrain_manifest_sha256"]
    assert calls[0].name.endswith(".partial")  # never written under the name the trainer reads


def test_a_copy_that_keeps_failing_is_reported_with_the_fix(tmp_path):
    run, dest = _pretrain(tmp_path), _destination(tmp_path)

    def broken(source: Path, target: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(handover.TransferError, match="No space left.*FINETUNE_FROM="):
        handover.transfer(run, dest, copy=broken)
    assert not (dest / runfiles.FINAL / runfiles.FINAL_MODEL).exists()


def test_a_pretrain_without_a_final_model_has_nothing_to_carry(tmp_path):
    run = _pretrain(tmp_path)
    (run / runfiles.FINAL / runfiles.FINAL_RECORD).unlink()
    with pytest.raises(handover.TransferError, match="no final model"):
        handover.transfer(run, _destination(tmp_path))


def test_space_and_path_on_the_fine_tune_storage(tmp_path):
    dest = _destination(tmp_path)
    assert handover.space_problem(dest, 1000) is None
    assert "MiB free" in (handover.space_problem(dest, 1 << 60) or "")
    (tmp_path / "afile").write_text("")
    assert "not a writable directory" in (handover.space_problem(tmp_path / "afile" / "x", 1) or "")
    assert handover.estimate_bytes("volo_tiny", {"img_size": 32, "num_classes": 10}) > 10_000


def _image(path: Path, digest: str) -> str:
    """A squashfs holding only /etc/vitpod-image.json (what `make container` bakes)."""
    root = path.parent / f"root-{digest[-4:]}"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "vitpod-image.json").write_text(json.dumps({"digest": digest}))
    subprocess.run(["mksquashfs", str(root), str(path), "-quiet", "-no-progress", "-noappend"],
                   check=True)  # fmt: skip
    return str(path)


@pytest.mark.skipif(shutil.which("mksquashfs") is None, reason="squashfs-tools not installed")
def test_both_stages_must_run_the_same_image_digest(tmp_path):
    profile = yaml.safe_load((PROFILE_DIR / "localpyxis.yaml").read_text())
    profile["container"]["image"] = _image(tmp_path / "ft.sqsh", NEW)
    finetune = Profile.model_validate(profile)
    assert handover.image_problem({"image": "/pod/a.sqsh", "digest": NEW}, finetune) is None
    problem = handover.image_problem({"image": "/pod/a.sqsh", "digest": OLD}, finetune) or ""
    assert OLD in problem and NEW in problem and "same image" in problem
    assert "no container" in (handover.image_problem(None, finetune) or "")
    plain = load_profile("localslurm2")
    assert handover.image_problem(None, plain) is None  # neither stage runs a container
    assert handover.image_problem({"image": "/pod/a.sqsh", "digest": OLD}, plain) is not None


def test_a_chain_across_clusters_plans_each_stage_on_its_own_profile_and_storage(tmp_path):
    """Offline render: the fine-tune's run lives under cluster 2's run root, reads the model the
    transfer puts there, and its manifest names cluster 2 (what status asks with -M)."""
    chain = Chain(
        "localslurm", "volo_tiny", offline=True, run_root=str(tmp_path / "one"),
        finetune_cluster="localslurm2", finetune_run_root=str(tmp_path / "two"),
    )  # fmt: skip
    chain.render()
    pre, fin = chain.stages["pretrain"].run_dir, chain.stages["finetune"].run_dir
    assert chain.crossing and pre.parent.parent == tmp_path / "one"
    assert fin == tmp_path / "two" / pre.parent.name / "finetune"
    source = fin.parent / "pretrain-final"
    assert fin.parent.name == pre.parent.name
    assert runfiles.read_manifest(fin)["overrides"]["finetune_from"] == str(source)
    assert [multicluster.cluster_of(pre), multicluster.cluster_of(fin)] == ["", "vitpod2"]
    record = json.loads((pre.parent / runfiles.PIPELINE).read_text())
    assert record["finetune_cluster"] == "localslurm2" and record["crossing"] is True
    with pytest.raises(ConfigError, match="same scheduler"):
        Chain("localslurm", "volo_tiny", offline=True, finetune_cluster="local").plan()


def test_the_hand_over_waits_for_the_pretrains_real_end_then_submits_on_cluster_2(
    tmp_path, monkeypatch
):
    """A chain across clusters, reattached from its directory (as `make status` does): while
    Slurm reports the pretrain running, preempted or requeued nothing is handed over; at
    COMPLETED the model is carried (digest in both manifests) and the fine-tune's script is
    submitted to cluster 2 (-M). Slurm's answers are faked; files and the chain are real."""
    from vitpod.workflows import slurm
    from vitpod.workflows.pipeline import chain_cross

    rendered = Chain(
        "localslurm", "volo_tiny", offline=True, run_root=str(tmp_path / "one"),
        finetune_cluster="localslurm2", finetune_run_root=str(tmp_path / "two"),
    )  # fmt: skip
    rendered.render()
    directory = rendered.directory
    record = json.loads((directory / runfiles.PIPELINE).read_text())
    record["stages"]["pretrain"].update(job_ids=["5"], state="SUBMITTED")
    record["stages"]["finetune"]["state"] = chain_cross.WAITING
    (directory / runfiles.PIPELINE).write_text(json.dumps(record))
    pre = rendered.stages["pretrain"].run_dir
    finished = _pretrain(tmp_path / "made")  # the trainer's final/ as the pretrain leaves it
    shutil.copytree(finished / runfiles.FINAL, pre / runfiles.FINAL)
    states = iter(["RUNNING", "PREEMPTED", "PENDING", "RUNNING", "COMPLETED"])
    asked: list[list[str]] = []

    def fake(argv, **_):
        asked.append(argv)
        if argv[0] == "squeue":
            return subprocess.CompletedProcess(argv, 0, f"5|{next(states)}|None|1|0:0|\n", "")
        if argv[0] == "sbatch":
            return subprocess.CompletedProcess(argv, 0, "1000001;vitpod2\n", "")
        if argv[:3] == ["scontrol", "show", "config"]:  # the default cluster's name
            return subprocess.CompletedProcess(argv, 0, "ClusterName             = vitpod\n", "")
        raise AssertionError(argv)

    monkeypatch.setattr(slurm, "runner", fake)
    chain = Chain.from_dir(directory)
    for _ in range(4):
        chain_cross.advance(chain)
        assert not any(a[0] == "sbatch" for a in asked)
    chain_cross.advance(chain)  # COMPLETED
    (sbatch,) = [a for a in asked if a[0] == "sbatch"]
    fin = rendered.stages["finetune"].run_dir
    assert sbatch[:2] == ["sbatch", "--clusters=vitpod2"] and sbatch[-1] == str(fin / "job.sbatch")
    assert all("--clusters" not in a[1] for a in asked if a[0] == "squeue")  # cluster 1: default
    digest = json.loads((pre / runfiles.FINAL / runfiles.FINAL_RECORD).read_text())["sha256"]
    moved = runfiles.read_manifest(fin)["transfer"]
    assert moved["sha256"] == digest and (moved["from_cluster"], moved["to_cluster"]) == (
        "vitpod",
        "vitpod2",
    )
    assert runfiles.read_manifest(fin)["job_ids"] == ["1000001"]
    assert runfiles.read_manifest(pre)["transfers"][0]["sha256"] == digest
    saved = json.loads((directory / runfiles.PIPELINE).read_text())["stages"]["finetune"]
    assert saved["job_ids"] == ["1000001"] and saved["cluster"] == "vitpod2"
    chain_cross.advance(Chain.from_dir(directory))  # another look: already handed over
    assert len([a for a in asked if a[0] == "sbatch"]) == 1
