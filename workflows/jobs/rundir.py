"""Run directories: a unique private directory per job, atomic files, and the run manifest."""

from __future__ import annotations

import datetime as dt
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from vitpod.registry import io, records, runfiles
from vitpod.workflows.containers.container import image_provenance, image_record, sqsh_path
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile import REPO_ROOT, Profile, resolve_path
from vitpod.workflows.site.profile_container import UNSAFE_PATH

DIR_MODE = 0o750  # group may read a run; nobody else, and never world-writable
FILE_MODE = 0o640
RUN_ROOT_ENV = "VITPOD_RUN_ROOT"  # overrides every profile's storage.runs (tests, scratch runs)


def runs_root(profile: Profile, override: str | None = None) -> Path:
    """Where new runs go: `override` (--run-root), else $VITPOD_RUN_ROOT, else storage.runs."""
    chosen = override or os.environ.get(RUN_ROOT_ENV, "")
    return Path(chosen).expanduser().absolute() if chosen else resolve_path(profile.storage.runs)


def check_path_safe(path: Path, what: str, fix: str) -> None:
    """Refuse a run/study path that would break an #SBATCH line or a Slurm filename pattern."""
    if UNSAFE_PATH.search(str(path)):
        raise ConfigError(
            f"{what} {str(path)!r}: a run path cannot contain double quotes, '%', '\\' or "
            f"newlines (they break #SBATCH lines); {fix}"
        )


def new_run_path(root: Path, model: str, stage: str) -> Path:
    """A fresh, not yet existing path `<root>/<UTC time>-<model>-<stage>-<random>`."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return root / f"{stamp}-{model}-{stage}-{secrets.token_hex(3)}"


def create_run_dir(path: Path) -> None:
    """Create the run dir and its logs/ with mode 0750 (not world-writable, whatever the umask)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. the profile's shared file system is not mounted here
        raise ConfigError(
            f"run root {path.parent}: cannot create it here ({exc.strerror or exc}); on a machine "
            f"without the profile's storage set {RUN_ROOT_ENV}=DIR (or --run-root DIR)"
        ) from None
    path.mkdir(mode=DIR_MODE)
    os.chmod(path, DIR_MODE)
    (path / runfiles.LOGS).mkdir(mode=DIR_MODE)
    os.chmod(path / runfiles.LOGS, DIR_MODE)


def write_atomic(path: Path, text: str, mode: int = FILE_MODE) -> None:
    """registry.io's atomic write, private to the group by default (as the run directory)."""
    io.write_text_atomic(path, text, mode=mode)


def write_json(path: Path, data: dict[str, Any]) -> None:
    io.write_json_atomic(path, data, mode=FILE_MODE)


def write_record(directory: Path, name: str, data: dict[str, Any]) -> None:
    """A run's record file `name` (manifest.json, study.json, ...) in `directory`, checked first
    against its schema when it has one (registry/records.py), so no writer skips the check."""
    if name in records.SCHEMAS:
        records.check(data, name, directory / name)
    write_json(directory / name, data)


def remove_run_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def git_info() -> dict[str, Any]:
    """Commit and dirtiness of the code that rendered the job (None outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }


def image_info(profile: Profile) -> dict[str, Any] | None:
    """The profile's image, the digest baked into it (/etc/vitpod-image.json; each rank logs the
    same as `container: <digest>`), the .sqsh's sha256 recorded by `make container` or the
    registry's manifest digest of a push. A digest that cannot be told is null with the reason
    in `digest_missing`, and a warning line names the fix."""
    if profile.container is None:
        return None
    record = image_record(profile) or {}
    digest, missing = image_provenance(profile)
    if missing:
        print(f"warning: container image digest unknown: {missing}", file=sys.stderr)
    pushed = record.get("registry") or {}
    return {
        "image": profile.container.image,
        "path": sqsh_path(profile.container.image),
        "digest": digest,
        **({"digest_missing": missing} if missing else {}),
        "sha256": record.get("sqsh", {}).get("sha256"),
        "manifest_digest": pushed.get("manifest_digest"),
        "git": record.get("git"),
        "built": record.get("built"),
    }
