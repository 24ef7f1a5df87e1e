"""Nothing vitpod writes under a run directory is group- or world-writable, whatever the umask
(issue 44 item 5): under umask 002 the checkpoints/ folder, step folders and rank0.pt were
group-writable, so anyone in the group could plant what the next resume loads. The login side:
tests/test_cluster_safety.py (render under umask 0), tests/test_submission_slurm.py (a job
submitted under umask 002)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import QUICK, launch_logs, logs, start_ranks, wait_ranks

DIR_MODE, FILE_MODE = 0o750, 0o640


@contextmanager
def umask(value: int) -> Iterator[None]:
    before = os.umask(value)
    try:
        yield
    finally:
        os.umask(before)


def wider_than_private(run: Path) -> list[str]:
    """Everything under `run` whose mode allows more than 0750 (folders) / 0640 (files; the
    owner's execute bit of a script, 0750, is kept), with its mode."""
    found = []
    for path in [run, *run.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        allowed = DIR_MODE if path.is_dir() or mode & stat.S_IXUSR else FILE_MODE
        if mode & ~allowed:
            found.append(f"{path.relative_to(run)} {oct(mode)}")
    return found


def test_a_training_run_under_umask_002_writes_nothing_group_writable(
    tmp_path: Path, digits_dir: Path
) -> None:
    """A real trainer run (fresh interpreters that inherit the umask, as srun's ranks do) that
    saves sharded (DCP) checkpoints, its metrics, logs and final model."""
    run = tmp_path / "run"
    args = [str(digits_dir), *QUICK, "--max-steps", "2", "--checkpoint-every", "1", "--fsdp",
            "--dataset", "digits", "--output", str(run)]  # fmt: skip
    with umask(0o002):
        ranks = start_ranks(1, args, launch_logs(run), fresh=True)
    codes = wait_ranks(ranks, launch_logs(run), timeout=300)
    assert codes == [0], logs(launch_logs(run))
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_000000002"
    assert list((run / "checkpoints" / "step_000000002" / "dcp").glob("*.distcp"))
    assert wider_than_private(run) == []
