"""What makes a checkpoint complete: every file listed with its checksum in a commit marker
that one rank writes last, after every rank's files (and the engine's shards) are on disk.

A step directory without a readable marker, or with a listed file missing, cut short or
changed, is incomplete: resume skips it and rotation never counts it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

from vitpod.registry import io, runfiles
from vitpod.trainer.checkpointing import reads

COMMIT = runfiles.CHECKPOINT_COMMIT


class CommitTimeout(RuntimeError):
    """Another rank's files did not appear in time: the step stays uncommitted."""


def attempt_record(launch: str) -> dict[str, Any]:
    """Which job and which start of it wrote a file (SLURM_RESTART_COUNT counts requeues);
    `launch` tells apart two starts outside Slurm."""
    return {
        "job_id": os.environ.get("SLURM_JOB_ID", ""),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "launch": launch,
    }


def new_launch_id() -> str:
    return uuid.uuid4().hex[:16]


def _is_temporary(name: str) -> bool:
    # atomic_torch_save's ".rank0.pt.tmp-PID" and write_json_atomic's ".rank0.json.XXXX.tmp"
    return name.startswith(".") and ".tmp" in name


def listed_files(directory: Path) -> list[str]:
    """Every file under `directory` but the marker and temporaries, as sorted relative paths."""
    found = []
    for path in directory.rglob("*"):
        if path.is_file() and path.name != COMMIT and not _is_temporary(path.name):
            found.append(path.relative_to(directory).as_posix())
    return sorted(found)


def wait_for_ranks(
    directory: Path, world_size: int, save: dict[str, Any], await_files: Collection[str],
    timeout_s: float,
) -> dict[int, dict[str, Any]]:  # fmt: skip
    """Rank manifests of this save for every rank, once they and `await_files` exist. `save`
    holds the launch and the save's sequence number in it: a record of an earlier start, or of
    an earlier save of the same step by this start, is not this save's."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        manifests: dict[int, dict[str, Any]] = {}
        for rank in range(world_size):
            try:
                manifest = json.loads((directory / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                break
            if any(manifest.get(k) != v for k, v in save.items()):  # not ours (yet)
                break
            manifests[rank] = manifest
        waiting = [f for f in await_files if not (directory / f).is_file()]
        if len(manifests) == world_size and not waiting:
            return manifests
        if time.monotonic() > deadline:
            missing = [f"rank{r}.json" for r in range(world_size) if r not in manifests]
            raise CommitTimeout(
                f"{directory}: after {timeout_s:.0f} s still waiting for "
                f"{', '.join(missing + waiting)}; the step stays uncommitted"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def rank_files(world_size: int) -> list[str]:
    """The files every complete checkpoint lists: each rank's state and record."""
    return [f"rank{r}.{ext}" for r in range(world_size) for ext in ("pt", "json")]


def commit(
    directory: Path,
    meta: dict[str, Any],
    world_size: int,
    launch: str,
    await_files: Collection[str] = (),
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Wait for every rank, checksum every file, then write the marker (atomically, last)."""
    save = {"launch": launch, "save": meta.get("save")}
    manifests = wait_for_ranks(directory, world_size, save, await_files, timeout_s)
    known = {m["file"]: m for m in manifests.values()}  # hashed while they streamed
    files: dict[str, dict[str, Any]] = {}
    for rel in listed_files(directory):
        path = directory / rel
        size = path.stat().st_size
        if rel in known and known[rel]["bytes"] == size:
            files[rel] = {"sha256": known[rel]["sha256"], "bytes": size}
        else:
            files[rel] = {"sha256": reads.sha256_of(path), "bytes": size}
    record = {**meta, "world_size": world_size, "files": files, "committed": time.time()}
    io.write_json_atomic(directory / COMMIT, record)
    io.fsync_dir(directory.parent)  # the step directory's own entry
    return record


def read_commit(directory: Path) -> dict[str, Any]:
    """The marker; FileNotFoundError when absent, ValueError when its bytes are no marker, any
    other OSError when the storage failed (nothing proven about the checkpoint then)."""
    try:
        record = json.loads(reads.read_text(directory / COMMIT))
    except UnicodeDecodeError as exc:
        raise ValueError(str(exc)) from exc
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise ValueError(f"{COMMIT} has no file list")
    return record


def check(directory: Path, checksums: bool = True) -> str | None:
    """None if the checkpoint is complete, else the damage its bytes prove: no or a malformed
    marker, a listed file missing, of another size or checksum, a rank's files not listed.
    A storage error (EIO, ESTALE, EACCES...) is raised as OSError: it proves nothing. Without
    `checksums` only presence and sizes are checked (rotation's cheap test)."""
    try:
        record = read_commit(directory)
    except FileNotFoundError:
        return f"no {COMMIT} (an interrupted or unfinished save)"
    except ValueError as exc:
        return f"{COMMIT} unreadable: {exc}"
    files = record["files"]
    try:
        unlisted = [f for f in rank_files(int(record["world_size"])) if f not in files]
    except (KeyError, TypeError, ValueError):
        return f"{COMMIT}: no world size recorded"
    if unlisted:
        return f"{COMMIT} does not list {', '.join(unlisted)} (not a complete commit)"
    for rel, expected in files.items():
        path = directory / rel
        try:
            size = path.stat().st_size
            if size != expected["bytes"]:
                return f"{rel}: {size} bytes, {expected['bytes']} recorded (cut short or grown)"
            if checksums and reads.sha256_of(path) != expected["sha256"]:
                return f"{rel}: checksum mismatch (changed on disk)"
        except FileNotFoundError:
            return f"{rel}: missing"
        except (KeyError, TypeError):
            return f"{COMMIT}: malformed entry for {rel}"
    return None
