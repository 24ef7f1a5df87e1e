"""`python -m vitpod.node.imagecheck RUN_DIR`: refuse to start in another image than
planned.

bind.sh runs this in every rank's container before the rank's command. plan.json records the
digest `make container` baked into the image the job was planned with (image.digest, the same
`/etc/vitpod-image.json` every rank logs as `container: <digest>`). Rebuilding the image while a
job waits in the queue replaces the .sqsh (or the registry tag) under it: the job would train in
an image nobody checked, so it stops here with exit 2 and one line naming both digests and the fix.

Exit status: 0 same image (or nothing recorded to compare), 2 another image.
No torch, no pydantic: plain json, so it costs the rank a few milliseconds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from vitpod.registry import runfiles
from vitpod.trainer.exitcodes import USAGE

PROVENANCE = "/etc/vitpod-image.json"
"""= vitpod.workflows.containers.container.PROVENANCE (not imported: that module pulls in the
registry)."""
PROVENANCE_ENV = "VITPOD_IMAGE_PROVENANCE"
"""Where the running image's record is read (default PROVENANCE, inside the container)."""


def planned_image(run_dir: Path) -> dict[str, Any] | None:
    """plan.json's image block, or None when the run has no plan or ran no container."""
    try:
        # the raw record, not registry.decision's model: the container's python3 runs this,
        # which may lack pydantic
        plan = runfiles.read_record(run_dir / runfiles.PLAN)
    except FileNotFoundError:
        return None
    image = plan.get("image")
    return image if isinstance(image, dict) else None


def running_digest(provenance: str) -> str | None:
    """The digest baked into the image this process runs in (None: the image has no record)."""
    try:
        record = json.loads(Path(provenance).read_text())
    except (OSError, ValueError):
        return None
    digest = record.get("digest") if isinstance(record, dict) else None
    return str(digest) if digest else None


def problem(run_dir: Path, provenance: str = PROVENANCE) -> str | None:
    """The one-line refusal when the running image is not the planned one, else None."""
    image = planned_image(run_dir) or {}
    planned = image.get("digest")
    if not planned:
        return None  # nothing recorded (no container, or a digest unknown when planned)
    now = running_digest(provenance)
    if now == planned:
        return None
    found = f"digest {now}" if now else f"no digest (no readable {provenance})"
    return (
        f"vitpod: error: image {image.get('image')} now has {found}, but "
        f"{run_dir / runfiles.PLAN} recorded image.digest {planned}: the image was rebuilt or "
        f"replaced after this job was planned; continue the run on the new image with "
        f"`make resume RUN={run_dir}` (or re-render with `make render`/`make pretrain`), or put "
        "back the planned image (`make container` with its inputs)"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m vitpod.node.imagecheck RUN_DIR", file=sys.stderr)
        return USAGE
    provenance = os.environ.get(PROVENANCE_ENV) or PROVENANCE
    found = problem(Path(args[0]), provenance)
    if found is not None:
        print(found, file=sys.stderr, flush=True)
        return USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
