"""What the labeling ranks would refuse about a teacher, refused at planning instead: an unknown
timm name, and (vitpod's layout) a teacher whose final feature map is not img_size/16."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from vitpod.registry import labelset, models, runfiles

FIX_LAYOUT = (
    "label in TokenLabeling's layout (make token-labels ... ARGS=\"--layout published "
    '--label-dir DIR", then --token-label-data DIR: the trainer resamples any grid), or use a '
    "teacher with 16-pixel tokens (volo_d1_224 ... volo_d5_224, vit_*_patch16_*)"
)


def teacher_model(teacher: str, checkpoint: str) -> str | None:
    """The teacher's model name: TEACHER itself with TEACHER_CKPT (a timm name), a run
    directory's recorded model; None when only the file knows (a bare weights file)."""
    if checkpoint:
        return teacher
    config = Path(teacher).expanduser() / runfiles.CONFIG
    if config.is_file():
        model = json.loads(config.read_text()).get("model")
        return str(model) if model else None
    return None


def reduction(name: str) -> int | str | None:
    """Pixels per location of the teacher's final feature map; a str: why the name cannot label;
    None: unknown here (no timm on this machine: the ranks check it)."""
    if models.known(name):
        arch = models.arch_of(name)
        return arch.patch_size if isinstance(arch, models.Vit) else labelset.STRIDE
    try:
        import timm
        import torch
    except ImportError:
        return None
    if not timm.is_model(name):
        near = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.7)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        return f"not a timm model; {hint}name a timm classifier or a vitpod run directory"
    with torch.device("meta"):  # the shapes only: no memory, no weights
        built = timm.create_model(name, pretrained=False)
    info = getattr(built, "feature_info", None)
    return int(info[-1]["reduction"]) if info else None


def teacher_problem(teacher: str, checkpoint: str, layout: str, img_size: int) -> str | None:
    """The one-line refusal (field and fix) for a teacher the ranks would refuse, else None."""
    name = teacher_model(teacher, checkpoint)
    if name is None:
        return None
    found = reduction(name)
    if isinstance(found, str):
        return f"TEACHER={teacher!r}: {found}"
    if found is None or layout == labelset.PUBLISHED or found == labelset.STRIDE:
        return None
    return (
        f"TEACHER={teacher!r}: {name}'s final feature map is 1/{found} of the image "
        f"({img_size // found}x{img_size // found} at {img_size} px), but vitpod's layout needs "
        f"img_size/{labelset.STRIDE} ({img_size // labelset.STRIDE}x"
        f"{img_size // labelset.STRIDE}); {FIX_LAYOUT}"
    )
