"""The JSON records of a run's folders, one schema per file name (runfiles.py names the files):
a run's `manifest.json`, the final model's `model.json` and a token-label set's `labels.json`.

Folders written before these names existed keep the same record as `manifest.json`, which is
also the name of a run's own record (another schema); `record_path` reads the old name only when
the new one is absent, since final models and label sets on shared storage outlive a release.
Unknown keys are kept (a final model's record also holds the last evaluation's figures), so a
record written by a newer vitpod still reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from vitpod.registry import io, runfiles


class _FolderRecord(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class RunManifest(_FolderRecord):
    """A run directory's manifest.json: what was planned and submitted (plan.py's JobPlan.manifest,
    then the job ids of its submission)."""

    created: str | None = None
    stage: str | None = None
    model: str | None = None
    script: str | None = None
    job_ids: list[str | int] = []
    profile: dict[str, Any] | None = None
    recipe: dict[str, Any] | None = None
    overrides: dict[str, Any] | None = None
    resolved: dict[str, Any] | None = None
    request: dict[str, Any] | None = None  # what `vitpod submit RUN_DIR` plans again
    decision: str | None = None


class FinalModel(_FolderRecord):
    """final/model.json: what the weights beside it are, written last by the trainer (its
    presence means the folder is complete)."""

    model: str | None = None  # the trainer always writes these three; a hand-made folder may not
    img_size: int | None = None
    num_classes: int | None = None
    format: str = "state_dict"
    file: str | None = None  # the weights file (model.pt), its sha256 and size
    sha256: str | None = None
    bytes: int | None = None
    step: int | None = None
    epoch: int | None = None
    timm: dict[str, Any] | None = None  # timm_folder.py: the timm files and their sha256
    ema: dict[str, Any] | None = None


class LabelSet(_FolderRecord):
    """labels.json of a token-label set: what its shards are valid for, written when the last
    shard lands (registry/labelset.py checks it against a stage and a data set)."""

    format: str | None = None
    num_shards: int | None = None
    img_size: int | None = None
    grid: int | None = None
    topk: int | None = None
    samples: int | None = None
    names_sha256: str | None = None
    data_dir: str | None = None
    teacher: dict[str, Any] | None = None
    layout: str | None = None
    split: str | None = None
    throughput: list[dict[str, Any]] | None = None


SCHEMAS: dict[str, type[_FolderRecord]] = {
    runfiles.MANIFEST: RunManifest,
    runfiles.FINAL_RECORD: FinalModel,
    runfiles.LABELS: LabelSet,
}


def record_path(folder: str | Path, name: str) -> Path:
    """The record `name` of a folder; a folder of the previous release has it as manifest.json
    (read only when `name` is absent)."""
    new, old = Path(folder) / name, Path(folder) / runfiles.MANIFEST
    return old if not new.is_file() and old.is_file() else new


def read(folder: str | Path, name: str) -> dict[str, Any] | None:
    """The folder's record `name` (either file name), checked against its schema; None when
    there is none. RunFileError names the file when it does not parse or fit the schema."""
    path = record_path(folder, name)
    if not path.is_file():
        return None
    data = runfiles.read_record(path)
    check(data, name, path)
    return data


def check(data: dict[str, Any], name: str, where: str | Path) -> None:
    """RunFileError naming `where` and the field when `data` does not fit the schema of `name`."""
    try:
        SCHEMAS[name].model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(map(str, first["loc"])) or "(record)"
        raise runfiles.RunFileError(f"{where}: {field}: {first['msg']}") from None


def write(folder: str | Path, name: str, data: dict[str, Any]) -> Path:
    """Check `data` against its schema and write it atomically as `name` in `folder`."""
    path = Path(folder) / name
    check(data, name, path)
    io.write_json_atomic(path, data)
    return path
