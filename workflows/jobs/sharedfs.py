"""Is a multi-node job's run root on a shared file system? The type of its mount, seen from here.

A run directory holds everything a run writes (logs, checkpoints, reports) and every node reads
and writes it at the same path, so for more than one node it must be on a file system every node
mounts. A path at or below one that `make profile` tested (a file written on one node, read on
the others: the profile's `storage.shared_paths`) passes; else the login node's mount of the
path's nearest existing ancestor is what is checked (the same mount on the compute nodes is the
point). `storage.shared: true` declares every path shared (a site whose file system this list
does not know; the local test profiles, whose nodes are one host).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from vitpod.workflows.errors import ConfigError

MOUNTINFO = Path("/proc/self/mountinfo")
SHARED_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "wekafs", "fuse.wekafs", "ceph", "fuse.ceph-fuse",
    "cifs", "smb3", "smb2", "glusterfs", "fuse.glusterfs", "panfs", "orangefs", "pvfs2",
    "fuse.juicefs", "fuse.lizardfs", "fuse.moosefs", "quobyte", "fuse.quobyte", "afs",
})  # fmt: skip
"""File system types (as /proc/self/mountinfo names them) that every node can mount as one."""
_STAT_NAMES = {"gpfs": "gpfs", "lustre": "lustre", "nfs": "nfs", "ceph": "ceph", "smb2": "smb2"}
_OCTAL = re.compile(r"\\([0-7]{3})")


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest parent that exists (a run root is made on first use)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.resolve()


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: Path, mountinfo: str | None = None) -> tuple[str, str] | None:
    """(mount point, file system type) of the mount holding `path` (an existing, resolved
    path), from /proc/self/mountinfo; None when it cannot be read."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return None
    best: tuple[str, str] | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 5 or not after:
            continue
        point = _unescape(fields[4])
        inside = point == "/" or str(path) == point or str(path).startswith(point + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, after[0])  # the later of two mounts at one point covers the earlier
    return best


def _stat_type(path: Path) -> str | None:
    """`stat -f -c %T PATH` (coreutils' name of the type), when mountinfo is not readable."""
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    name = out.stdout.strip()
    return _STAT_NAMES.get(name, name) or None


def fs_type(path: Path) -> tuple[str, str]:
    """(type, where it was read) of the file system holding `path` or its nearest parent."""
    base = existing_ancestor(path)
    found = mount_of(base)
    if found is not None:
        return found[1], f"mount {found[0]}"
    name = _stat_type(base)
    return (name or "unknown"), f"stat -f {base}"


def tested_path(path: Path, shared_paths: Sequence[str]) -> str | None:
    """The tested path (storage.shared_paths) that `path` is at or below, or None."""
    mine = Path(path).absolute().resolve()
    for tested in shared_paths:
        base = Path(tested).resolve()
        if mine == base or base in mine.parents:
            return tested
    return None


def check_run_root(
    root: Path, nodes: int, *, shared: bool, profile: str, offline: bool = False,
    shared_paths: Sequence[str] = (),
) -> str:  # fmt: skip
    """One line for the preflight; ConfigError when a multi-node job's run root is not on a
    shared file system type (naming the type found and the override)."""
    return check_shared(
        root, nodes, shared=shared, profile=profile, offline=offline, what="run root",
        shared_paths=shared_paths,
        why="the ranks of a {nodes}-node job on other nodes would not see its logs and "
        "checkpoints", fix="Point storage.runs (or --run-root, VITPOD_RUN_ROOT) at the shared "
        "file system",
    )  # fmt: skip


def check_code_dir(
    code: Path, nodes: int, *, shared: bool, profile: str, offline: bool = False,
    shared_paths: Sequence[str] = (),
) -> str:  # fmt: skip
    """The same check for the code checkout every rank runs from (srun --chdir) and a container
    mounts: on another node a local copy would be missing or another version."""
    return check_shared(
        code, nodes, shared=shared, profile=profile, offline=offline, what="code dir",
        shared_paths=shared_paths,
        why="the ranks of a {nodes}-node job on other nodes run from it (srun --chdir, the "
        "container's mount) and would find no code or another version", fix="Put the checkout "
        "on the shared file system and point storage.code at it",
    )  # fmt: skip


def check_shared(
    path: Path, nodes: int, *, shared: bool, profile: str, offline: bool, what: str, why: str,
    fix: str, shared_paths: Sequence[str] = (),
) -> str:  # fmt: skip
    if nodes <= 1:
        return f"{what} {path}: 1 node, need not be shared"
    if shared:
        return (f"{what} {path}: shared (storage.shared: true in profile {profile}: declared "
                "for every path; not detected)")  # fmt: skip
    tested = tested_path(path, shared_paths)
    if tested is not None:
        return (f"{what} {path}: shared (at or below {tested}, which `make profile` tested: a "
                f"file written on one node was read on the others; storage.shared_paths in "
                f"profile {profile})")  # fmt: skip
    if offline:
        return (
            f"{what} {path}: shared file system NOT CHECKED (offline; a {nodes}-node job needs "
            "one: preflight on the login node checks it)"
        )
    kind, where = fs_type(path)
    if kind in SHARED_TYPES or kind.startswith("nfs"):
        return f"{what} {path}: on {kind} ({where}), a shared file system"
    untested = (f" (profile {profile}'s storage.shared_paths, {', '.join(shared_paths)}, "
                "which `make profile` tested, do not hold it)" if shared_paths else "")  # fmt: skip
    raise ConfigError(
        f"{what} {path}: on {kind} ({where}), not a shared file system type (nfs, lustre, "
        f"gpfs, beegfs, wekafs, ceph, ...){untested}: {why.format(nodes=nodes)}. {fix}, or, if "
        f"every node mounts this path as one file system, run `make profile` with this path "
        f"(--run-root; it writes a file on one node, reads it on the others and records the "
        f"path in storage.shared_paths) or set `storage: {{shared: true}}` in profile {profile} "
        "(declares every path shared)"
    )
