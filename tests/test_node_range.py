"""Profile node ranges (`nodes: MIN-MAX`): rendered as `#SBATCH --nodes=MIN-MAX`, the global
batch planned at MAX and pinned with --elastic, a range the batch cannot split refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vitpod.registry import runfiles
from vitpod.trainer.settings.flags import parse_args
from vitpod.workflows import cli
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR, load_profile


def _ranged_profile(tmp_path: Path, nodes: str) -> str:
    profile = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    profile["nodes"] = nodes
    path = tmp_path / "ranged.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)


def test_a_node_range_renders_and_pins_the_global_batch(tmp_path: Path) -> None:
    profile = _ranged_profile(tmp_path, "1-2")
    part = load_profile(profile).partition("pretrain")
    assert (part.nodes, part.nodes_max, part.node_limit) == (1, 2, 2)
    argv = ["render", "--cluster", profile, "--model", "volo_tiny", "--args=-b 8",
            "--run-root", str(tmp_path / "runs")]  # fmt: skip
    assert cli.main(argv) == 0
    run = next((tmp_path / "runs").iterdir())
    script = (run / runfiles.SBATCH).read_text()
    assert "#SBATCH --nodes=1-2" in script
    # The pinned batch is a setting of plan.json's trainer section, not tokens in the command
    optim = json.loads((run / runfiles.PLAN).read_text())["trainer"]["optim"]
    assert (optim["batch_size"], optim["global_batch"], optim["elastic"]) == (8, 32, True)
    command = json.loads((run / runfiles.MANIFEST).read_text())["resolved"]["command"]
    assert "--elastic" not in command and "--global-batch" not in command
    for world, accum in ((4, 1), (2, 2)):  # what the ranks take on 2 and on 1 node
        cfg = parse_args(["--plan", str(run / runfiles.PLAN)], world_size=world)
        assert (cfg.batch_size, cfg.accum_steps, cfg.global_batch_size) == (8, accum, 32)
    # NODES given: a fixed size, no range
    fixed = plan_job(Request(cluster=profile, model="volo_tiny", nodes=1, args="-b 8"))
    assert "#SBATCH --nodes=1\n" in fixed.script and fixed.trainer is not None
    assert (fixed.trainer["elastic"], fixed.trainer["global_batch"]) == (False, None)


def test_a_range_the_global_batch_cannot_split_names_the_counts_that_do(tmp_path: Path) -> None:
    profile = _ranged_profile(tmp_path, "1-3")  # planned at 3 x 2 ranks x 8 = 48: 4 ranks?
    with pytest.raises(ConfigError, match="does not split over 2 node.*counts that work: 1, 3"):
        plan_job(Request(cluster=profile, model="volo_tiny", args="-b 8"))


def test_a_reversed_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="MIN <= MAX"):
        load_profile(_ranged_profile(tmp_path, "2-1"))
