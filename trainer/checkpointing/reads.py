"""Reading checkpoint files: a storage error is retried with backoff, then stops the job.

On Lustre, GPFS or NFS a read may fail for a while without anything being wrong with the
checkpoint (EIO, ESTALE, ETIMEDOUT, a server that refuses a moment, a short read). Such an
error proves nothing about the checkpoint: it is retried, and if it persists every rank stops
with one StorageError (the checkpoints are left as they are). Only what the bytes prove
(checkpoint_commit.check) sets a checkpoint aside.

Test-only hook: VITPOD_TEST_IO_FAULT="ERRNO:COUNT:NAME" (e.g. "EIO:2:COMMIT.json") makes the
first COUNT opens of files named NAME through this module raise OSError(ERRNO) in this process.
It exists for the fault tests; it is read nowhere else and never set by vitpod itself.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
FAULT_ENV = "VITPOD_TEST_IO_FAULT"
# The storage failed or refused, the bytes may be fine: retried, never taken as damage.
STORAGE_ERRNOS = frozenset(
    {errno.EIO, errno.ESTALE, errno.EACCES, errno.EPERM, errno.ETIMEDOUT, errno.EAGAIN,
     errno.EREMOTEIO, errno.ENOTCONN, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENOLINK,
     errno.EINTR}
)  # fmt: skip
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)  # 5 tries over 15 s


class StorageError(RuntimeError):
    """A checkpoint read kept failing with a storage error: the same on every rank."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.errno = code


def is_storage_error(exc: BaseException) -> bool:
    """An OSError (or one it was raised from) whose errno says the storage failed."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def storage_errno(exc: BaseException) -> int | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def storage_error(
    what: str, exc: BaseException | str, tries: int, code: int | None = None
) -> StorageError:
    code = storage_errno(exc) if isinstance(exc, BaseException) else code
    name = errno.errorcode.get(code, "I/O error") if code is not None else "I/O error"
    return StorageError(
        f"checkpoint storage error ({name}) {what}: {exc}; still failing after {tries} "
        "tries: no checkpoint was moved or deleted. Check the filesystem (mount, quota, "
        "permissions, the file server), then resubmit the run: it resumes from its newest "
        "complete checkpoint",
        code,
    )


def retried(what: str, read: Callable[[], T]) -> T:
    """`read()`, retried after RETRY_DELAYS_S on a storage error; then StorageError."""
    for attempt, delay in enumerate((*RETRY_DELAYS_S, None), 1):
        try:
            return read()
        except OSError as exc:
            if not is_storage_error(exc):
                raise
            if delay is None:
                raise storage_error(what, exc, attempt) from exc
            log.warning("%s: %s; retrying in %.0f s (try %d)", what, exc, delay, attempt)
            time.sleep(delay)
    raise AssertionError("unreachable")


def open_read(path: Path) -> IO[bytes]:
    """open(path, "rb"), through the test-only fault hook."""
    _inject_fault(Path(path))
    return open(path, "rb")


def read_text(path: Path) -> str:
    with open_read(path) as fh:
        return fh.read().decode()


def sha256_of(path: Path) -> str:
    """The file's sha256; a read that ends before the size the file had when opened is a
    short read (OSError EIO), not a checksum mismatch."""
    sha = hashlib.sha256()
    with open_read(path) as fh:
        expected, got = os.fstat(fh.fileno()).st_size, 0
        for block in iter(lambda: fh.read(1 << 24), b""):
            sha.update(block)
            got += len(block)
    if got < expected:
        raise OSError(errno.EIO, f"short read: {got} of {expected} bytes", str(path))
    return sha.hexdigest()


_faults_left: dict[str, int] = {}


def _inject_fault(path: Path) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, count, target = spec.split(":", 2)
    if path.name != target:
        return
    left = _faults_left.setdefault(spec, int(count))
    if left > 0:
        _faults_left[spec] = left - 1
        code = getattr(errno, name)
        raise OSError(code, f"{os.strerror(code)} ({FAULT_ENV})", str(path))
