"""Login-node container checks before submitting: the image is readable, enroot stays local.

- A registry image with `container.credentials`: an authenticated HEAD of its manifest
  (workflows/containers/registryref.py) refuses a wrong password, a missing digest or tag and an
  unreachable registry with one line, before anything queues; the digest it answers is recorded.
- A .sqsh image must have a readable squashfs superblock (`unsquashfs -s`).
- enroot's runtime and data paths must be on node-local storage: unpacking a container onto
  NFS, Lustre, GPFS or CIFS is slow and breaks (pyxis #53, #87; enroot's enroot.conf documents
  the paths). They are read from enroot.conf as this host has it (login nodes usually share the
  nodes' configuration), expanded as enroot does (variables, `${VAR:-default}`, `~`, and the
  `$(id -u)`/`$(id -un)`/`$(whoami)`/`$(hostname)` substitutions; no shell runs the value), and
  their file system asked of `findmnt`. A value that cannot be expanded here is reported as not
  checked, never skipped silently.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from vitpod.workflows.containers import registryref
from vitpod.workflows.containers.container import sqsh_path
from vitpod.workflows.errors import ConfigError

NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "fuse.sshfs")
LOCAL_PATH_KEYS = ("ENROOT_RUNTIME_PATH", "ENROOT_DATA_PATH")
_REPO = Path(__file__).resolve().parents[2]


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
    path = sqsh_path(container.image)
    if path and os.path.isfile(path) and shutil.which("unsquashfs") is None:
        done.append(f"NOT CHECKED: {path}'s squashfs superblock (unsquashfs is not installed here)")
    for unchecked in enroot_paths_unchecked():
        print(f"warning: {unchecked}", file=sys.stderr)
        done.append(f"NOT CHECKED: {unchecked}")
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
    except (OSError, subprocess.TimeoutExpired) as exc:
        reason = "timed out after 60 s" if isinstance(exc, subprocess.TimeoutExpired) else exc
        return (
            f"container.image: {path} could not be checked (unsquashfs -s: {reason}); fix "
            "unsquashfs (squashfs-tools) or the file system holding the image, then retry"
        )
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


class ExpansionError(ValueError):
    """An enroot.conf value this host cannot expand without running it."""


def _enroot_values() -> list[tuple[str, str, Path]]:
    """(key, raw value, enroot.conf) of the runtime and data paths."""
    conf = enroot_conf()
    if conf is None:
        return []
    out = []
    for line in conf.read_text().splitlines():
        key, _, value = line.strip().partition(" ")
        if key in LOCAL_PATH_KEYS and value.strip():
            out.append((key, value.strip(), conf))
    return out


def enroot_paths_fs() -> list[tuple[str, str, str]]:
    """(key, expanded path, file system type) of enroot's runtime and data paths; those that
    cannot be expanded are in `enroot_paths_unchecked`."""
    out = []
    for key, value, _ in _enroot_values():
        try:
            path = _expand(value)
        except ExpansionError:
            continue
        out.append((key, path, filesystem_type(path)))
    return out


def enroot_paths_unchecked() -> list[str]:
    """One line per enroot path whose value cannot be expanded here (so its file system is not
    checked), naming the value and why."""
    out = []
    for key, value, conf in _enroot_values():
        try:
            _expand(value)
        except ExpansionError as exc:
            out.append(
                f"enroot's {key} ({value!r} in {conf}) is not checked for node-local storage: "
                f"{exc}; make sure it is on a local disk or tmpfs"
            )
    return out


_SUBSTITUTIONS = {
    "id -u": lambda: str(os.getuid()),
    "id -g": lambda: str(os.getgid()),
    "id -un": lambda: pwd.getpwuid(os.getuid()).pw_name,
    "whoami": lambda: pwd.getpwuid(os.getuid()).pw_name,
    "hostname": socket.gethostname,
}
_TOKEN = re.compile(
    r"\$\(\s*(?P<cmd>[^()]*?)\s*\)"  # $(command)
    r"|\$\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?-)(?P<default>[^{}$`]*))?\}"  # ${NAME}, ${NAME:-x}
    r"|\$(?P<bare>[A-Za-z_]\w*)"  # $NAME
)


def _expand(value: str) -> str:
    """The value as enroot expands it (`eval echo`), without running a shell: variables of this
    environment, `${VAR:-default}`, a leading `~` and a few read-only commands. ExpansionError
    for anything else (another command, backticks, an unset variable, nested expansions)."""

    def one(m: re.Match[str]) -> str:
        if m["cmd"] is not None:
            run = _SUBSTITUTIONS.get(" ".join(m["cmd"].split()))
            if run is None:
                raise ExpansionError(f"it runs a command, $({m['cmd']}), that vitpod does not run")
            return run()
        name = m["name"] or m["bare"]
        current = os.environ.get(name)
        if m["op"] is not None and (current is None or (m["op"] == ":-" and not current)):
            return m["default"]
        if current is None:
            raise ExpansionError(f"${name} is not set in this environment")
        return current

    expanded = _TOKEN.sub(one, value)
    if any(c in expanded for c in "$`") or any(c in _TOKEN.sub("", value) for c in "$`\"'"):
        raise ExpansionError("it has an expansion or quoting only a shell could evaluate")
    if expanded == "~" or expanded.startswith("~/"):
        expanded = str(Path(expanded).expanduser())
    if not expanded.startswith("/"):
        raise ExpansionError(f"it expands to {expanded!r}, not an absolute path")
    return expanded


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
