"""A Chain across two Slurm clusters: pretrain on one, fine-tune on another.

With one slurmdbd and no federation, `afterok` cannot name a job of another cluster, so the
fine-tune is not queued with the pretrain. The chain's own watcher (Chain.wait, follow, status)
polls the pretrain on its cluster; once Slurm reports it COMPLETED (a preempted and requeued job
goes back to PENDING, never COMPLETED, so only its real end counts), the final model is carried to
the fine-tune cluster's storage (handover.py: copied, sha256-verified, recorded in both
manifests), the image digests are compared, and only then is the fine-tune submitted there (-M).
A failed transfer or another image stops the chain before the fine-tune: it is never submitted.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.workflows import slurm
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import jobstate
from vitpod.workflows.jobs.rundir import image_info, write_json
from vitpod.workflows.pipeline import handover
from vitpod.workflows.site.profile import Profile, load_profile

WAITING = "WAITING"
"""The fine-tune's recorded state while the pretrain runs on the other cluster."""
REFUSED = jobstate.NOT_STARTED
"""The fine-tune's recorded state when the handover failed (transfer or image): not submitted."""
SOURCE = "pretrain-final"
"""Under the fine-tune cluster's pipeline directory: the carried final model (`final/`)."""


class HandoverError(RuntimeError):
    """The pretrain ended but its model or image could not be carried across: no fine-tune."""


def planned_image(plan: Any) -> dict[str, Any] | None:
    """The image block of the stage's plan.json (manifest.json's `image`)."""
    return plan.decision.image if plan.decision else image_info(plan.profile)


def crosses(pretrain: Profile, finetune: Profile) -> bool:
    """Whether the two stages run on different Slurm clusters (profiles naming them)."""
    return pretrain.scheduler == finetune.scheduler == "slurm" and (
        (pretrain.cluster or "") != (finetune.cluster or "")
    )


def refuse_mixed(pretrain: Profile, finetune: Profile) -> None:
    if pretrain.scheduler != finetune.scheduler:
        raise ConfigError(
            f"FT_CLUSTER={finetune.name} (scheduler {finetune.scheduler}) with CLUSTER="
            f"{pretrain.name} (scheduler {pretrain.scheduler}): both stages of a pipeline need "
            "the same scheduler; pick two Slurm profiles (or drop FT_CLUSTER)"
        )


def finetune_directory(pipeline: Path, pretrain_root: Path, finetune_root: Path) -> Path:
    """The pipeline's directory on the fine-tune cluster's storage root (the same name)."""
    return pipeline if finetune_root == pretrain_root else finetune_root / pipeline.name


def check_before(pretrain_plan: Any, finetune_plan: Any, source: Path) -> list[str]:
    """At submission, before the pretrain runs: the fine-tune storage's path and space for the
    final model, and the image both stages run. ConfigError names what fails."""
    done = []
    if handover.needs_transfer(pretrain_plan.run_dir, finetune_plan.run_dir):
        need = handover.estimate_bytes(pretrain_plan.spec.model, pretrain_plan.trainer)
        problem = handover.space_problem(source, need)
        if problem:
            raise ConfigError(f"fine-tune cluster storage: {problem}")
        done.append(f"transfer: {source} writable, space for ~{need / 2**20:.1f} MiB")
    problem = handover.image_problem(planned_image(pretrain_plan), finetune_plan.profile)
    if problem:
        raise ConfigError(problem)
    done.append("image: the same on both clusters")
    return done


def announce(fin: Any, cluster: str) -> None:
    """The fine-tune is planned and written, not submitted: it waits for the pretrain's end."""
    fin.recorded = WAITING
    print(f"finetune: submitted to {cluster} by this process once the pretrain completed and "
          "its model was carried across (Chain.wait/follow/status; make pipeline waits)",
          flush=True)  # fmt: skip


def advance(chain: Any) -> None:
    """One look at the pretrain; at its real end, carry the model and submit the fine-tune.
    HandoverError when the pretrain ended otherwise or the handover failed."""
    pre, fin = chain.stages["pretrain"], chain.stages["finetune"]
    if fin.job_ids or not pre.job_ids:
        return
    if fin.recorded == REFUSED:
        raise HandoverError(chain.handover.get("error") or "the fine-tune was not submitted")
    with slurm.on_cluster(pre.cluster):
        info = jobstate.poll_once(pre.job_ids)[pre.job_ids[0]]
    pre.recorded = info.state
    if info.state == "COMPLETED":
        with _handover_lock(chain.directory):
            record = runfiles.read_record(chain.directory / runfiles.PIPELINE)
            done = record["stages"]["finetune"]
            if done.get("job_ids") or done.get("state") == REFUSED:  # another process did
                fin.job_ids, fin.recorded = [str(j) for j in done.get("job_ids", [])], done["state"]
                chain.handover = record.get("handover", {})
                if fin.recorded == REFUSED:
                    raise HandoverError(chain.handover.get("error") or "not submitted")
                return
            hand_over(chain, pre, fin)
    elif (why := jobstate.failure(info)) is not None:
        fin.recorded = REFUSED
        chain.handover = {"error": f"pretrain: {why}; the fine-tune is not submitted"}
        chain._save()
        raise HandoverError(chain.handover["error"])


@contextmanager
def _handover_lock(directory: Path) -> Iterator[None]:
    """One hand-over per pipeline: the submitting process and a `make status` may both see the
    pretrain's end."""
    with open(directory / ".handover.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def hand_over(chain: Any, pre: Any, fin: Any) -> None:
    """Transfer (when the storage roots differ), image check, then submit the fine-tune. From
    the run directories' manifests, so a chain reattached with Chain.from_dir hands over too."""
    manifest = runfiles.read_manifest(fin.run_dir)
    image = runfiles.read_manifest(pre.run_dir).get("image")  # what the pretrain was planned with
    try:
        moved = None
        source = Path(manifest["overrides"]["finetune_from"])
        if handover.needs_transfer(pre.run_dir, fin.run_dir):
            moved = handover.transfer(pre.run_dir, source)
        profile = fin.plan.profile if fin.plan else load_profile(manifest["profile"]["path"])
        problem = handover.image_problem(image, profile)
        if problem:
            raise handover.TransferError(f"{problem}; the fine-tune is not submitted")
    except handover.TransferError as exc:
        fin.recorded = REFUSED
        chain.handover = {"error": str(exc)}
        chain._save()
        raise HandoverError(str(exc)) from None
    if moved is not None:
        moved["to_cluster"] = _name(fin.cluster)
        _record(pre.run_dir, "transfers", moved, append=True)
        fin.manifest_extra["transfer"] = {**moved, "from_cluster": _name(pre.cluster)}
    chain.handover = {"transfer": moved, "image": image}
    with slurm.on_cluster(fin.cluster):  # its kept job.sbatch, planned or reattached
        chain._submit_stage(fin, dependency=None)
    chain._save()


def _record(run_dir: Path, key: str, value: dict[str, Any], append: bool = False) -> None:
    path = run_dir / runfiles.MANIFEST
    manifest = runfiles.read_record(path)
    manifest[key] = [*manifest.get(key, []), value] if append else value
    write_json(path, manifest)


def wait(chain: Any, timeout: float | None, poll_s: float) -> None:
    """Until the fine-tune completed; ChainError-worthy failures raise HandoverError or
    jobstate.JobFailedError (the caller names the stage)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    fin = chain.stages["finetune"]
    while not fin.job_ids:
        advance(chain)
        if fin.job_ids:
            break
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"pretrain not finished after {timeout:.0f} s (it goes on; "
                               "the next wait/follow/status submits the fine-tune)")  # fmt: skip
        time.sleep(poll_s)
    left = None if deadline is None else max(1.0, deadline - time.monotonic())
    poller = jobstate.JobStatePoller(fin.job_ids, cluster=fin.cluster)
    jobstate.wait_jobs(poller, timeout=left, poll_s=poll_s)


def _name(cluster: str) -> str:
    """A stage's cluster by name, the default one's asked of Slurm ('default' when unsaid)."""
    try:
        with slurm.on_cluster(cluster):
            return slurm.cluster_name() or "default"
    except slurm.SlurmError:
        return cluster or "default"
