"""Code, recipes and docs cite public sources: the team's private design notes are not shipped.

A value or comment that cites those notes points readers at a file they cannot open; cite the
paper, README, blog post or docs it came from, or say it is our choice or our measurement.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = ("design" + ".md").encode()  # built from parts, so this file does not match itself


def _project_files() -> list[Path]:
    """Tracked files plus new ones git does not ignore (caught before they are committed)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_no_file_cites_the_private_design_notes() -> None:
    files = _project_files()
    assert len(files) > 50 and ROOT / "README.md" in files  # the listing really covers the repo
    citing = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_bytes().splitlines(), 1)
        if PRIVATE in line.lower()
    ]
    assert not citing, (
        f"{len(citing)} line(s) cite the private design notes; cite the public source instead "
        f"(paper, README, blog post, docs) or say 'our choice'/'measured on ...': {citing[:20]}"
    )
