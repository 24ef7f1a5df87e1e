"""A fine-tune source (FINETUNE_FROM) must hold a model the ranks can load, checked before the
job queues: a file, a run's final model, a checkpoint or a timm local model folder, neither empty
nor unreadable."""

from __future__ import annotations

import os
from pathlib import Path

from vitpod.registry import records, runfiles


def finetune_source_problem(path: str) -> str | None:
    """A finetune source must hold a model now: a file, a final model, a checkpoint or a timm
    local model folder."""
    source = Path(path)
    if not source.exists():
        return f"FINETUNE_FROM={path!r} does not exist; give a pretrain run directory or a file"
    weights = next((p for p in runfiles.weights_candidates(source) if p.is_file()), None)
    if weights is not None:
        return _unusable_weights(path, weights)
    ckpts = source / runfiles.CHECKPOINTS
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return None
    return (
        f"FINETUNE_FROM={path!r} has no model ({runfiles.FINAL}/{runfiles.FINAL_MODEL}, "
        f"{runfiles.CHECKPOINTS}/ or a timm folder's {runfiles.TIMM_WEIGHTS}); give a finished "
        "pretrain run directory, a timm local model folder or a checkpoint file"
    )


def _unusable_weights(source: str, weights: Path) -> str | None:
    """The weights file the fine-tune would load: empty (a copy cut short) or unreadable."""
    what = f"FINETUNE_FROM={source!r}: {weights}"
    if not os.access(weights, os.R_OK):
        return f"{what} is not readable by you; fix its permissions or give another source"
    size = weights.stat().st_size
    if size == 0:
        return (f"{what} is empty (0 bytes: a copy cut short?); copy the model again or give "
                "another run, timm folder or checkpoint file")  # fmt: skip
    # A final model's record (the trainer writes it last) records the file's size.
    path = records.record_path(weights.parent, runfiles.FINAL_RECORD)
    try:
        record = runfiles.read_record(path)
    except (OSError, ValueError):
        return None
    if record.get("file") == weights.name and record.get("bytes") not in (None, size):
        return (f"{what} is {size} bytes, its {path.name} says {record['bytes']} (a copy "
                "cut short?); copy the model again or give another run, timm folder or "
                "checkpoint file")  # fmt: skip
    return None
