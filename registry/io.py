"""Small I/O every package shares: atomic writes with fsync, and the unknown-key message."""

from __future__ import annotations

import difflib
import errno
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Keys people write by habit, and where the value belongs instead.
COMMON_MISTAKES = {
    "gpus": "gpus_per_node",
    "gpu_count": "gpus_per_node",
    "cpus": "cpus_per_node",
    "partition": "partitions",
    "image": "container.image",
    "mounts": "container.mounts",
    "ntasks_per_node": "tasks_per_node",
    "time_limit": "time (inside partitions.<stage>)",
    "mpi_type": "mpi",
    "numa_map": "binding",
    "hca_map": "binding",
    "nics": "binding[].hca (and fabric.nics_per_node)",
    "batch": "batch_size",
    "lr_base_batch": "lr_base_size",
    "token_label_dir": "token_label_data",
}


FILE_MODE = 0o640
PRIVATE_UMASK = 0o027
"""Directories 0750 and files 0640 whatever the user's umask (002 made checkpoints, step folders
and rank0.pt group-writable): the group may read a run, nobody else; nobody but its owner
writes. Both processes that write runs set it first: the vitpod command (so the job Slurm starts
inherits it: sbatch passes its umask on) and every trainer rank."""


def private_umask() -> int:
    """Tighten this process's umask to at least PRIVATE_UMASK (a stricter one stays); returns
    the one before."""
    before = os.umask(PRIVATE_UMASK)
    os.umask(before | PRIVATE_UMASK)
    return before


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable. A failure is raised (a rename that may not survive a
    crash must not be reported as saved), except where the file system cannot fsync a
    directory at all (EINVAL, ENOTSUP: there is nothing more to do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Write a temp file in the same directory, fsync, (chmod,) rename over `path`, fsync the
    directory: a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, FILE_MODE if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str, mode: int | None = None) -> None:
    write_bytes_atomic(path, text.encode(), mode)


def write_json_atomic(path: str | Path, data: Any, mode: int | None = None) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", mode)


def unknown_key_message(unknown: Iterable[str], valid: Iterable[str]) -> str:
    """'unknown key(s) 'x' (did you mean 'y'?); valid keys: [...]' for one mapping."""
    valid = list(valid)
    hints = []
    for key in unknown:
        guess = COMMON_MISTAKES.get(key) or next(
            iter(difflib.get_close_matches(key, valid, 1)), None
        )
        hints.append(f"{key!r} (did you mean {guess!r}?)" if guess else repr(key))
    return f"unknown key(s) {', '.join(hints)}; valid keys: {valid}"


def check_keys(data: Mapping[str, Any], valid: Iterable[str], where: str) -> None:
    """Raise ValueError('<where>: unknown key(s) ...; valid keys: ...') for unknown keys."""
    valid = list(valid)
    unknown = [str(k) for k in data if k not in valid]
    if unknown:
        raise ValueError(f"{where}: {unknown_key_message(unknown, valid)}")
