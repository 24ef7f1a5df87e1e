"""Container checks and flags for pyxis (NVIDIA/pyxis `--container-*` srun/sbatch options).

Two kinds of checks, so a bad profile fails before anything is submitted:
- `check_container_static`: the rules pyxis applies in srun/sbatch (its option callbacks in
  args.c: mount entries `SRC[:DST[:FLAGS]]` split on ',' and ':', source and target starting
  with '/' or '.', `--container-name=NAME[:auto|create|exec|no_exec]`, no empty names in
  `--container-env`), plus the image form pyxis decides only on the node: a value starting with
  '/' or '.' is a squashfs file, anything else a registry reference that enroot pulls.
- `check_container_paths`: what pyxis and enroot check only on the compute node, in slurmstepd
  (mount sources exist, the .sqsh exists and is readable). Needs the shared file system.
Every error is a ConfigError naming the profile field and the fix. No torch, no subprocess
except `unsquashfs -cat` in `image_provenance`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from vitpod.workflows.containers import registryref
from vitpod.workflows.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
PROVENANCE = "/etc/vitpod-image.json"
"""Where `make container` bakes the image's provenance (digest, inputs, git commit, time)."""
NAME_FLAGS = ("auto", "create", "exec", "no_exec")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SQUASHFS_SUFFIXES = (".sqsh", ".squashfs", ".sqfs")


# What these checks read of a profile (workflows/site/profile.py's models have it): the profile
# imports this module to check itself, so this module names no profile type.
class Mount(Protocol):
    @property
    def src(self) -> str: ...
    @property
    def dst(self) -> str: ...
    @property
    def readonly(self) -> bool: ...


class Container(Protocol):
    @property
    def image(self) -> str: ...
    @property
    def mounts(self) -> Sequence[Mount]: ...
    @property
    def workdir(self) -> str: ...
    @property
    def mount_home(self) -> bool: ...
    @property
    def name(self) -> str | None: ...
    @property
    def credentials(self) -> Any: ...
    @property
    def start_once(self) -> bool: ...


class Profile(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def container(self) -> Container | None: ...
    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def secrets(self) -> Sequence[str]: ...
    @property
    def storage(self) -> Any: ...


def is_file_image(image: str) -> bool:
    """pyxis reads an image as a squashfs file when it starts with '/' or '.'."""
    return image.startswith(("/", "."))


def sqsh_path(image: str) -> str | None:
    """The absolute path of a squashfs image (relative ones are relative to the repository), or
    None for a registry reference."""
    if not is_file_image(image):
        return None
    return os.path.normpath(image if image.startswith("/") else REPO_ROOT / image)


def host_path(value: str, resolve: bool = True) -> str:
    """A profile path on this machine: absolute (relative ones are relative to the repository),
    symlinks resolved unless `resolve=False` (a venv's python must stay the venv's symlink)."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    return str((REPO_ROOT / path).resolve()) if resolve else os.path.normpath(REPO_ROOT / path)


def check_container_static(profile: Profile) -> None:
    """Refuse what pyxis would refuse (or misread) in the profile's container block."""
    container = profile.container
    if container is None:
        return
    _check_image(container.image)
    _check_credentials(profile)
    for i, mount in enumerate(container.mounts):
        for side in ("src", "dst"):
            _check_mount_side(f"container.mounts[{i}].{side}", getattr(mount, side))
    if not container.workdir.strip():
        raise ConfigError("container.workdir is empty; write a path, e.g. '.' (the repository)")
    if container.name is not None:
        _check_name(container.name)
    check_env_names([*profile.env, *profile.secrets], "env/secrets")
    _check_storage_mounted(profile)


def _check_storage_mounted(profile: Profile) -> None:
    """Every shared-storage path must be inside the container, at the same path."""
    assert profile.container is not None
    dsts = [Path(host_path(m.dst)) for m in profile.container.mounts]
    for field in ("data", "code", "runs"):
        value = getattr(profile.storage, field)
        if value is None:
            continue
        path = Path(host_path(value))
        if not any(path == d or d in path.parents for d in dsts):
            raise ConfigError(
                f"storage.{field}={value!r} is not under any container.mounts dst; mount it "
                f"(e.g. {{src: {path}, dst: {path}}})"
            )


def _check_image(image: str) -> None:
    if not image or any(c.isspace() for c in image) or "," in image:
        raise ConfigError(
            f"container.image: {image!r}: an image cannot be empty or contain blanks or ','"
        )
    if not image.endswith(_SQUASHFS_SUFFIXES):
        registryref.parse(image)
    if not is_file_image(image) and image.endswith(_SQUASHFS_SUFFIXES):
        raise ConfigError(
            f"container.image: {image!r} is not a file to pyxis: it reads an image as a squashfs "
            f"file only when starting with '/' or './' and would try to pull {image!r} from a "
            f"registry; write './{image}' (relative to the repository) or an absolute path"
        )


def _check_credentials(profile: Profile) -> None:
    container = profile.container
    assert container is not None
    if container.start_once and container.name:
        raise ConfigError(
            "container.start_once names the container itself (one per job); remove container.name"
        )
    if container.credentials is None:
        return
    ref = registryref.parse(container.image)
    name = container.credentials.password
    if ref is None or not ref.user:
        raise ConfigError(
            f"container.credentials: the image {container.image!r} must be a registry reference "
            "naming its user (USER@REGISTRY#REPO@sha256:...): enroot logs in only as that user"
        )
    if name not in profile.secrets:
        raise ConfigError(
            f"container.credentials.password: {name} is not listed under `secrets`; add it there "
            "(its value is passed by name, never written)"
        )


def _check_mount_side(field: str, value: str) -> None:
    if not value:
        raise ConfigError(f"{field} is empty; pyxis needs SRC:DST with both set")
    if ":" in value or "," in value:
        raise ConfigError(
            f"{field}: {value!r}: pyxis splits mounts on ',' and ':'; a path cannot contain them"
        )
    if not value.startswith(("/", ".")):
        raise ConfigError(
            f"{field}: {value!r}: pyxis accepts a mount path only when it starts with '/' or '.'; "
            f"write './{value}' (relative to the repository) or an absolute path"
        )


def _check_name(name: str) -> None:
    base, sep, flag = name.partition(":")
    if not base or (sep and flag not in NAME_FLAGS) or "," in name or ":" in flag:
        raise ConfigError(
            f"container.name: {name!r}: pyxis wants NAME or NAME:FLAG with FLAG one of "
            f"{', '.join(NAME_FLAGS)}; e.g. 'vitpod:auto'"
        )


def check_env_names(names: Iterable[str], field: str) -> None:
    """The names given to --container-env: no empty item, each a variable name."""
    for name in names:
        if not _ENV_NAME.match(name):
            raise ConfigError(
                f"{field}: {name!r} is not an environment variable name; --container-env takes "
                "NAME[,NAME...]"
            )


def check_container_paths(profile: Profile) -> None:
    """What pyxis checks only on the node: mount sources exist and the .sqsh is readable."""
    container = profile.container
    if container is None:
        return
    for i, mount in enumerate(container.mounts):
        src = host_path(mount.src)
        if not os.path.exists(src):
            raise ConfigError(
                f"container.mounts[{i}].src: {mount.src!r} ({src}) does not exist; create it on "
                "the shared file system or fix the profile (enroot would fail on the node)"
            )
    path = sqsh_path(container.image)
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError(
            f"container.image: {container.image!r} ({path}) does not exist; build it with "
            f"`make container CLUSTER={profile.name}` or fix the profile"
        )
    if not os.access(path, os.R_OK):
        raise ConfigError(f"container.image: {container.image!r} ({path}) is not readable")


def mount_specs(container: Container, extra_paths: Sequence[tuple[str, str]] = ()) -> list[str]:
    """`--container-mounts` entries: the profile's mounts, then each of `extra_paths` ((what the
    user set it with, path): the run root, a fine-tune source) at the same path unless a profile
    mount already covers it. Every path is checked as a profile mount is: a ',' or ':' in one
    would make pyxis read another mount (`--run-root "/x,y:/etc"` would mount /etc)."""
    specs, dsts = [], []
    for i, m in enumerate(container.mounts):
        src, dst = host_path(m.src), host_path(m.dst)
        for side, value in (("src", src), ("dst", dst)):
            _check_mount_side(f"container.mounts[{i}].{side}", value)
        specs.append(f"{src}:{dst}" + (":ro" if m.readonly else ""))
        dsts.append(Path(dst))
    for what, extra in extra_paths:
        path = Path(host_path(extra))
        _check_mount_side(what, str(path))
        if not any(path == d or d in path.parents for d in dsts):
            specs.append(f"{path}:{path}")
            dsts.append(path)
    return specs


def srun_args(
    container: Container, env_names: Sequence[str], extra_paths: Sequence[tuple[str, str]] = ()
) -> list[str]:
    """The pyxis flags of every rank (one function for the sbatch and submitit paths)."""
    image = sqsh_path(container.image) or container.image
    args = [f"--container-image={image}"]
    mounts = ",".join(mount_specs(container, extra_paths))
    args += [f"--container-mounts={mounts}"] if mounts else []
    args += [f"--container-workdir={host_path(container.workdir)}"]
    args += ["--container-mount-home" if container.mount_home else "--no-container-mount-home"]
    if container.name:
        args += [f"--container-name={container.name}"]
    # pyxis: image variables win over the job's unless named here.
    args += [f"--container-env={','.join(env_names)}"]
    return args


def image_digest(profile: Profile) -> str | None:
    """The digest baked into the profile's image (/etc/vitpod-image.json); None, with the reason
    from `digest_missing`, when it cannot be told."""
    return image_provenance(profile)[0]


def image_provenance(profile: Profile) -> tuple[str | None, str | None]:
    """(digest, None), or (None, why it is missing). The digest comes from the record
    `make container` wrote beside the .sqsh (or, for a registry image, from its push) when it
    still describes the image, else from the .sqsh itself with `unsquashfs -cat`."""
    container = profile.container
    if container is None:
        return None, "the profile runs no container"
    record = image_record(profile)
    if record is not None and record.get("digest"):
        return str(record["digest"]), None
    path = sqsh_path(container.image)
    if path is None:
        return None, (
            f"no record of a push of {container.image} by `make container PUSH=1` "
            f"({pushed_record_path(profile)}); the ranks log the image's own digest"
        )
    return _digest_in_sqsh(path)


def _digest_in_sqsh(path: str) -> tuple[str | None, str | None]:
    fix = f"{path}.json is missing or describes another file; run `make container`"
    if not os.path.isfile(path):
        return None, f"{path} does not exist; run `make container`"
    if shutil.which("unsquashfs") is None:
        return None, f"{fix} (unsquashfs, which could read it from the image, is not installed)"
    try:
        out = subprocess.run(
            ["unsquashfs", "-cat", path, PROVENANCE.lstrip("/")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode == 0:
            return str(json.loads(out.stdout)["digest"]), None
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        pass
    return None, f"{fix} (the image has no readable {PROVENANCE})"


def pushed_record_path(profile: Profile) -> str:
    """Where `make container PUSH=1` records a registry image's push (containers/push.sh)."""
    return str(REPO_ROOT / ".cache" / "images" / f"{profile.name}.pushed.json")


def image_record(profile: Profile) -> dict[str, Any] | None:
    """`<image>.json` written by `make container`, if it still describes the .sqsh beside it."""
    if profile.container is None:
        return None
    path = sqsh_path(profile.container.image)
    if path is None:
        return _push_record(profile)
    try:
        record = json.loads(Path(path + ".json").read_text())
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    sqsh = record.get("sqsh", {}) if isinstance(record, dict) else {}
    if sqsh.get("bytes") != st.st_size or sqsh.get("mtime_ns") != st.st_mtime_ns:
        return None
    return record


def _push_record(profile: Profile) -> dict[str, Any] | None:
    """The push record when the profile's image is what was pushed (its digest, or its tag)."""
    assert profile.container is not None
    record = registryref.push_record(pushed_record_path(profile))
    ref = registryref.parse(profile.container.image)
    pushed = record.get("registry") if record else None
    if ref is None or not isinstance(pushed, dict):
        return None
    if ref.digest:
        return record if pushed.get("manifest_digest") == ref.digest else None
    tag = f"{ref.registry}/{ref.repository}:{ref.reference}"
    return record if pushed.get("tag") == tag else None
