"""What a pipeline carries from its pretrain cluster to its fine-tune cluster: the final model
(copied, verified by sha256) and the image (the same digest on both), with the checks before.

Only the fine-tune's input crosses: the pretrain's final/model.pt and final/model.json (its
architecture, read by the trainer's --finetune check). Checkpoints, logs and metrics stay on the
pretrain cluster's storage.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vitpod.registry import models, records, runfiles
from vitpod.workflows.containers import container
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.rundir import DIR_MODE
from vitpod.workflows.site.profile import Profile

ATTEMPTS = 3
"""Copies of a file tried before the transfer is reported failed (a flaky link, a full quota)."""
HEADROOM = 1.5
"""Free space asked for on the fine-tune's storage, as a multiple of what is copied: the copy is
written beside its final name first, and the fine-tune writes its own checkpoints there."""

Copy = Callable[[Path, Path], Any]


class TransferError(ConfigError):
    """The final model could not be carried across whole: the fine-tune is not submitted."""


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def needs_transfer(pretrain_run: Path, finetune_run: Path) -> bool:
    """Whether the fine-tune's run directory lies on another storage root than the pretrain's."""
    return pretrain_run.parent.parent.resolve() != finetune_run.parent.parent.resolve()


def final_record(pretrain_run: Path) -> dict[str, Any]:
    """The pretrain's final/model.json (manifest.json from the previous release; written last
    by the trainer: its presence means the final model is complete); TransferError when there
    is none to carry."""
    path = records.record_path(pretrain_run / runfiles.FINAL, runfiles.FINAL_RECORD)
    try:
        record = runfiles.read_record(path)
        records.check(record, runfiles.FINAL_RECORD, path)
    except (OSError, ValueError) as exc:
        raise TransferError(
            f"{path}: no final model to carry to the fine-tune's cluster ({exc}); the pretrain "
            f"did not finish: see {pretrain_run / runfiles.LOGS}"
        ) from None
    if record.get("file") != runfiles.FINAL_MODEL or not record.get("sha256"):
        raise TransferError(f"{path}: names no {runfiles.FINAL_MODEL} with its sha256")
    return record


def estimate_bytes(model: str, trainer: dict[str, Any] | None) -> int:
    """The final model's size before it exists: fp32 parameters (the state dict the trainer
    saves) for the stage's image size and classes."""
    cfg = trainer or {}
    return 4 * models.param_count(
        model, int(cfg.get("img_size") or 224), int(cfg.get("num_classes") or 1000)
    )


def space_problem(destination: Path, need: int) -> str | None:
    """Can `destination` (not yet existing) be created with `need` bytes (x HEADROOM) free?"""
    existing = destination
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"{destination}: {existing} is not a writable directory on the fine-tune's storage"
    free = shutil.disk_usage(existing).free
    if free < need * HEADROOM:
        return (
            f"{destination}: {free / 2**20:.0f} MiB free on {existing}, the final model needs "
            f"{need * HEADROOM / 2**20:.0f} MiB (x{HEADROOM} headroom); free space there or give "
            "the fine-tune profile another storage.runs"
        )
    return None


def _copy_verified(source: Path, target: Path, sha256: str, copy: Copy) -> tuple[int, str]:
    """Copy beside the target, check the sha256, then rename: a target that exists is whole.
    Returns the attempts made and the digest; TransferError after ATTEMPTS bad copies."""
    partial = target.with_name(target.name + ".partial")
    said = ""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            copy(source, partial)
            got = sha256_file(partial)
        except OSError as exc:
            said = f"copy failed: {exc}"
        else:
            if got == sha256:
                os.replace(partial, target)
                return attempt, got
            said = f"sha256 {got} of the copy, {sha256} in the pretrain's manifest"
        partial.unlink(missing_ok=True)
    raise TransferError(
        f"{source} -> {target}: {ATTEMPTS} copies failed, the last: {said}; the fine-tune is not "
        f"submitted. Check the file and the storage, then fine-tune from the pretrain with "
        f"`make finetune CLUSTER=<fine-tune profile> FINETUNE_FROM={source.parent.parent}`"
    )


def transfer(pretrain_run: Path, destination: Path, copy: Copy = shutil.copyfile) -> dict[str, Any]:
    """Copy the pretrain's final model into `destination`/final, verified by the sha256 in its
    final/model.json; returns the record both runs' manifests keep. TransferError (and
    nothing at `destination`/final/model.pt) when it cannot be done."""
    record = final_record(pretrain_run)
    source = pretrain_run / runfiles.FINAL / runfiles.FINAL_MODEL
    target_dir = destination / runfiles.FINAL
    problem = space_problem(target_dir, int(record.get("bytes") or source.stat().st_size))
    if problem:
        raise TransferError(f"transfer of the final model: {problem}")
    target_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    attempts, digest = _copy_verified(source, target_dir / runfiles.FINAL_MODEL,
                                      str(record["sha256"]), copy)  # fmt: skip
    # The record last, as the trainer writes it: its presence means the model beside is whole.
    # Under the name this vitpod writes, whichever name the pretrain's folder has it under.
    partial = target_dir / (runfiles.FINAL_RECORD + ".partial")
    shutil.copyfile(records.record_path(pretrain_run / runfiles.FINAL, runfiles.FINAL_RECORD),
                    partial)  # fmt: skip
    os.replace(partial, target_dir / runfiles.FINAL_RECORD)
    return {
        "from": str(source),
        "to": str(target_dir / runfiles.FINAL_MODEL),
        "sha256": digest,
        "pretrain_manifest_sha256": record["sha256"],
        "bytes": (target_dir / runfiles.FINAL_MODEL).stat().st_size,
        "attempts": attempts,
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def image_problem(pretrain_image: dict[str, Any] | None, finetune: Profile) -> str | None:
    """Both stages must run the same image: the digest the pretrain was planned with (plan.json's
    image block) against the one the fine-tune profile's image holds now. None when equal, or
    when neither stage runs a container."""
    before = (pretrain_image or {}).get("digest")
    now, why = container.image_provenance(finetune)
    if finetune.container is None and not (pretrain_image or {}).get("image"):
        return None
    if before and before == now:
        return None
    ran = (pretrain_image or {}).get("image") or "no container"
    holds = why or (finetune.container.image if finetune.container else "")
    return (
        f"image: the pretrain ran {before or 'no known digest'} ({ran}), profile "
        f"{finetune.name} holds {now or 'no known digest'} ({holds}); both stages must run the "
        "same image: import or pull the pretrain's image on the fine-tune cluster (`make "
        "container` there, or container.image: <registry>/<repo>@<digest>)"
    )
