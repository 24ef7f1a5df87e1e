"""torch.save written atomically (temp name, fsync, rename) and hashed while it streams."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO, Any, cast

import torch

from vitpod.registry.io import fsync_dir
from vitpod.trainer.checkpointing.reads import sha256_of as sha256_of  # one reader (reads.py)


class _HashingWriter:
    """File-like sink that hashes what torch.save writes, so the checksum costs no re-read."""

    def __init__(self, fh) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self.fh.write(data)
        except OSError as exc:
            # torch.save's zip writer reports a failed write as "unexpected pos": keep the
            # real cause (ENOSPC, EIO, a quota) to raise instead.
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def atomic_torch_save(obj: Any, path: Path) -> dict[str, Any]:
    """torch.save under a temp name, fsync, rename; returns sha256 and size of what was written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            writer = _HashingWriter(fh)
            try:
                torch.save(obj, cast(IO[bytes], writer))
            except RuntimeError as exc:
                if writer.error is not None:
                    raise writer.error from exc
                raise
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return {"file": path.name, "sha256": writer.sha.hexdigest(), "bytes": writer.size}
