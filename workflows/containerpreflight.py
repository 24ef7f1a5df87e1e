"""Login-node container checks before submitting: the image is readable, enroot stays local.

- A registry image with `container.credentials`: an authenticated HEAD of its manifest
  (workflows/registryref.py) refuses a wrong password, a missing digest or tag and an
  unreachable registry with one line, before anything queues; the digest it answers is recorded.
- A .sqsh image must have a readable squashfs superblock (`unsquashfs -s`).
- enroot's runtime and data paths must be on node-local storage: unpacking a container onto
  NFS, Lustre, GPFS or CIFS is slow and breaks (pyxis #53, #87; enroot's enroot.conf documents
  the paths). They are read from enroot.conf as this host has it (login nodes usually share the
  nodes' configuration), expanded as enroot does, and their file system asked of `findmnt`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from vitpod.workflows import registryref
from vitpod.workflows.container import sqsh_path
from vitpod.workflows.errors import ConfigError

NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "fuse.sshfs")
LOCAL_PATH_KEYS = ("ENROOT_RUNTIME_PATH", "ENROOT_DATA_PATH")
_REPO = Path(__file__).resolve().parent.parent


def check(profile: Any) -> tuple[list[str], list[str]]:
    """(problems, checks done) for the profile's container; nothing for a profile without one."""
    container = profile.container
    if container is None:
        return [], []
    problems, done = [], []
    ref = registryref.parse(container.image)
    if ref is not None and container.credentials is not None:
        try:
            digest = registryref.check_manifest(ref, container.credentials.password)
            done.append(f"registry image {ref.registry}/{ref.repository}@{digest} answers")
        except ConfigError as exc:
            problems.append(str(exc))
    elif ref is not None:
        done.append(f"registry image {container.image}: no credentials, not checked from here")
    problem = squashfs_problem(container.image)
    if problem:
        problems.append(problem)
    for key, path, fstype in enroot_paths_fs():
        if fstype in NETWORK_FS:
            problems.append(
                f"enroot's {key} ({path}) is on {fstype}: containers must unpack on node-local "
                "storage; set it in enroot.conf to a local disk or tmpfs (e.g. /tmp/enroot-data)"
            )
        else:
            done.append(f"enroot {key} {path} on {fstype or 'an unknown file system'}")
    return problems, done


def squashfs_problem(image: str) -> str | None:
    """A .sqsh whose superblock `unsquashfs -s` cannot read (truncated, overwritten, not a
    squashfs): refused here rather than by enroot on every node. None when readable or absent
    (check_container_paths reports a missing file)."""
    path = sqsh_path(image)
    if path is None or not os.path.isfile(path) or shutil.which("unsquashfs") is None:
        return None
    try:
        done = subprocess.run(["unsquashfs", "-s", path], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode == 0:
        return None
    return (
        f"container.image: {path} is not a readable squashfs (unsquashfs -s failed); rebuild "
        "it with `make container` (it verifies the image before renaming it into place)"
    )


def enroot_conf() -> Path | None:
    """enroot.conf as this host's enroot reads it (ENROOT_SYSCONF_PATH, the install prefix,
    /etc/enroot, the local cluster's runtime), or None."""
    candidates = [os.environ.get("ENROOT_SYSCONF_PATH", "")]
    found = shutil.which("enroot")
    if found:
        candidates.append(str(Path(found).resolve().parent.parent / "etc" / "enroot"))
    prefix = os.environ.get("VITPOD_RUNTIME_PREFIX") or str(_REPO / ".runtime")
    candidates += ["/etc/enroot", f"{prefix}/etc/enroot"]
    for directory in filter(None, candidates):
        conf = Path(directory) / "enroot.conf"
        if conf.is_file():
            return conf
    return None


def enroot_paths_fs() -> list[tuple[str, str, str]]:
    """(key, expanded path, file system type) of enroot's runtime and data paths."""
    conf = enroot_conf()
    if conf is None:
        return []
    out = []
    for line in conf.read_text().splitlines():
        key, _, value = line.strip().partition(" ")
        if key in LOCAL_PATH_KEYS and value.strip():
            path = _expand(value.strip())
            if path:
                out.append((key, path, filesystem_type(path)))
    return out


def _expand(value: str) -> str:
    """The value as enroot expands it (`eval echo`), without the job's node or user variables."""
    try:
        done = subprocess.run(
            ["bash", "-c", f"echo {value}"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def filesystem_type(path: str) -> str:
    """`findmnt -n -o FSTYPE -T` of the path's nearest existing ancestor ('' if unknown)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        done = subprocess.run(
            ["findmnt", "-n", "-o", "FSTYPE", "-T", str(probe)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else ""
