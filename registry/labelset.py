"""Token-label data sets on disk: shard names, the manifest and its checks (no torch, no numpy).

A token-label directory holds `labels.json` (registry.records.LabelSet; `manifest.json` in a
set made before that name, still read) and `shards/shard-<i>-of-<n>.pt`. Each shard is
the torch file `vitpod.trainer.data.token_label` reads (top-k teacher scores per token of a
contiguous slice of the sorted training-sample names). The record is written when the last
shard lands; it records what the labels are valid for: the teacher (and the sha256 of its
weights: labels of another teacher never serve), the labeling resolution, the
grid (one label per 16x16 pixels: 14 at 224, 32 at 512), k, and the data set (path, sample count
and a checksum of the sorted sample names). The login node checks a manifest against a data set
and a stage with `problems()` before anything is queued; the trainer makes the same check on
open.

One teacher per directory: the first labeling rank claims the directory for its teacher in
`teacher.json` (under an flock on `labels.lock`, so two ranks never claim at once), and a rank
of another teacher refuses it (exit 2) instead of redoing the other teacher's shards. Each rank
holds an flock on its shard's `.lock` while it labels, so a second job of the same teacher
waits and then skips the shard. Every shard records its teacher's sha256 and the trainer refuses
a shard whose digest is not the manifest's (checked on every load, in every worker).

Grid decision: labels are made per grid, at the stage's resolution (labels for 224 have grid 14,
for 512 grid 32), and a stage only takes labels of its own grid. The trainer still cuts each
random crop out of the score map with RoIAlign and resamples it to the grid, as VOLO's code does
(sail-sg/volo, "All Tokens Matter" arXiv:2104.10858), but stretching a 14x14 map to 32x32 would
invent detail the teacher never saw, so it is refused rather than done silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vitpod.registry import io, records, runfiles

FORMAT = "vitpod-token-labels/3"  # 3: every shard records its teacher's sha256
RECORD = runfiles.LABELS
SHARDS = "shards"
OWNER = "teacher.json"
"""The teacher a label directory belongs to (written once, by the first labeling rank)."""
DIR_LOCK = "labels.lock"
"""flock'ed while a rank reads or writes OWNER (not hidden: the directory keeps it)."""
STRIDE = 16  # one token label per 16x16 pixels (VOLO: --token-label-size = img_size/16)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # = vitpod.trainer.data.sources'


def folder_names(root: str | os.PathLike[str], split: str = "train") -> list[str]:
    """Sorted sample names of an ImageNet-layout folder, exactly the trainer's order and keys
    (`split/<class>/<file>`, classes sorted, hidden class folders skipped), without torch."""
    base = Path(root) / split
    if not base.is_dir():
        raise FileNotFoundError(f"{base} is not a folder: expected <root>/{split}/<class>/*.jpg")
    names: list[str] = []
    classes = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    for name in classes:
        files = sorted(
            p.name for p in (base / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES
        )
        names.extend(f"{split}/{name}/{f}" for f in files)
    return names


def names_digest(names: list[str]) -> str:
    """sha256 of the sorted names, one a line: two data sets match when these match."""
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def weights_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a teacher's weights file: labels belong to the teacher that made them."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def teacher_problem(manifest: dict[str, Any], where: str, teacher_sha256: str) -> str | None:
    """Labels made by another teacher (or by one whose digest was not recorded) never serve."""
    made = (manifest.get("teacher") or {}).get("weights_sha256")
    if made == teacher_sha256:
        return None
    return (
        f"{where}: labels made by teacher sha256 {str(made)[:12] if made else '(not recorded)'}"
        f" ({(manifest.get('teacher') or {}).get('teacher')}), not by the requested teacher "
        f"sha256 {teacher_sha256[:12]}"
    )


def grid_of(img_size: int) -> int:
    return img_size // STRIDE


def shard_path(out: str | os.PathLike[str], index: int, count: int) -> Path:
    return Path(out) / SHARDS / f"shard-{index:05d}-of-{count:05d}.pt"


def shard_bounds(samples: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of shard `index` of `count`: contiguous slices whose sizes differ by <= 1."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index} of {count}: index must be in [0, {count})")
    return samples * index // count, samples * (index + 1) // count


def read_manifest(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record (labels.json) of a token-label directory, or None when there is none (yet);
    a set made by the previous release has it as manifest.json."""
    return records.read(Path(out), RECORD)


def problems(
    manifest: dict[str, Any] | None,
    *,
    where: str,
    names: list[str] | None,
    data_dir: str | None,
    img_size: int,
    teacher_sha256: str | None = None,
) -> list[str]:
    """Why the labels in `where` cannot serve a stage at `img_size` on this data set ([] = ok).

    `names`: the data set's sorted sample names (None: the data set is not a folder we can list,
    so only the grid is checked). `teacher_sha256`: the teacher asked for (None: any teacher).
    """
    if manifest is None:
        return [f"{where} has no {RECORD}: the labeling job has not finished (or never ran)"]
    if manifest.get("format") != FORMAT:
        return [f"{where}: format {manifest.get('format')!r} is not {FORMAT!r}; regenerate it"]
    out = []
    if teacher_sha256 is not None:
        out += [p for p in (teacher_problem(manifest, where, teacher_sha256),) if p]
    want = grid_of(img_size)
    if manifest.get("layout") != PUBLISHED and manifest.get("grid") != want:  # published: any
        out.append(
            f"{where}: grid {manifest.get('grid')} (labeled at {manifest.get('img_size')} px) but "
            f"this stage trains at {img_size} px, grid {want} (img_size/16); make labels at "
            f"{img_size} px"
        )
    if names is not None:
        if manifest.get("samples") != len(names):
            out.append(
                f"{where}: labels for {manifest.get('samples')} samples of "
                f"{manifest.get('data_dir')}, but {data_dir} has {len(names)}; these labels are "
                f"for another data set (or an older copy of it)"
            )
        elif manifest.get("names_sha256") != names_digest(names):
            out.append(
                f"{where}: same count but other sample names than {data_dir} (names checksum "
                f"differs; labels made over {manifest.get('data_dir')}); regenerate them"
            )
    return out


class ClaimError(ValueError):
    """A label directory that belongs to another teacher; the message names both digests."""


@contextlib.contextmanager
def locked(path: str | os.PathLike[str], what: str = "") -> Iterator[None]:
    """An exclusive flock on `path` (created, never removed: unlinking a lock file lets the
    next locker take a fresh inode). Blocks; says once what it waits for. flock works across
    hosts on NFSv4 (emulated with byte-range locks) and on Lustre mounted with -o flock."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"label: waiting for the lock on {path} {what}".rstrip(), flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def read_owner(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(out) / OWNER
    try:
        owner = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ClaimError(
            f"{path}: unreadable ({exc}); remove {Path(out)} and label it again"
        ) from None
    return owner if isinstance(owner, dict) else None


def recorded_teacher(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Who the labels in `out` belong to: its claim, else its manifest's teacher, else the
    teacher of a finished shard (directories labeled before claims existed); None if unlabeled."""
    owner = read_owner(out)
    if owner is not None:
        return owner
    manifest = read_manifest(out)
    if manifest is not None:
        return dict(manifest.get("teacher") or {})
    for sidecar in sorted((Path(out) / SHARDS).glob("shard-*.json")):
        try:
            return dict(json.loads(sidecar.read_text()).get("teacher") or {})
        except (OSError, ValueError):
            continue
    return None


def claim_problem(out: str | os.PathLike[str], teacher_sha256: str) -> str | None:
    """Why a teacher with `teacher_sha256` may not write into `out` (None: it may)."""
    made = recorded_teacher(out)
    if made is None or made.get("weights_sha256") == teacher_sha256:
        return None
    who = made.get("teacher") or "?"
    job = f", job {made['job_id']}" if made.get("job_id") else ""
    return (
        f"token-label directory {out} belongs to teacher sha256 "
        f"{made.get('weights_sha256') or '(not recorded)'} ({who}{job}); this teacher is sha256 "
        f"{teacher_sha256}: its shards would replace the other teacher's. Label into another "
        f'directory (ARGS="--label-dir DIR", then train with --token-label-data DIR), or remove '
        f"{out} to relabel it"
    )


def claim(out: str | os.PathLike[str], teacher: dict[str, Any]) -> dict[str, Any]:
    """Claim `out` for `teacher` (its record, with weights_sha256), or raise ClaimError when it
    belongs to another teacher. The first claim writes OWNER; later ones of the same teacher
    read it. Held under the directory's flock, so two teachers never both pass."""
    digest = str(teacher["weights_sha256"])
    with locked(Path(out) / DIR_LOCK, "(claiming the directory for a teacher)"):
        problem = claim_problem(out, digest)
        if problem is not None:
            raise ClaimError(problem)
        owner = read_owner(out)
        if owner is None:
            owner = {
                **teacher,
                "job_id": os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID"),
                "host": socket.gethostname(), "claimed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }  # fmt: skip
            io.write_text_atomic(Path(out) / OWNER, json.dumps(owner, indent=2, sort_keys=True))
        return owner


def shard_teacher_problem(
    shard: str | os.PathLike[str], recorded: str | None, teacher_sha256: str | None
) -> str | None:
    """A shard whose recorded teacher digest is not the one the labels are read for."""
    if recorded is not None and recorded == teacher_sha256:
        return None
    return (
        f"{shard}: made by teacher sha256 {recorded or '(not recorded)'}, but the label "
        f"directory's manifest names teacher sha256 {teacher_sha256 or '(not recorded)'}: its "
        "shards come from different teachers; relabel into a new directory (make token-labels "
        'TEACHER=... ARGS="--label-dir DIR") and train with --token-label-data DIR'
    )


# ---------------------------------------------------------- TokenLabeling's published layout
PUBLISHED = "published"
"""TokenLabeling's layout (zihangJiang/TokenLabeling `generate_label.py`, read by sail-sg/volo's
training code): one torch file per training image, `<root>/<class dir>/<image stem>.pt`, holding
`torch.stack([top-k scores, top-k class indices]).half()` of shape [2, k, H, W] over the
teacher's final feature map (NFNet-F6 at 576 px: 18 x 18). The scores are the teacher's logits:
the reader scatters them into a zero map of every class, crops it (RoIAlign) and takes a softmax
over the classes, as VOLO's `get_label` does. No manifest is needed."""
