"""`make pretrain CLUSTER=local`: the rendered torchrun script trains here, 2 ranks on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import make

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_make_pretrain_local_trains_volo_tiny(tmp_path, digits_dir):
    profile = tmp_path / "local.yaml"
    text = (REPO / "workflows" / "profiles" / "local.yaml").read_text()
    profile.write_text(text.replace("  data: data\n", f"  data: {digits_dir.parent}\n"))
    args = "ARGS=--max-steps 2 --epochs 1 --workers 0 --loader torch"
    out = make("pretrain", f"CLUSTER={profile}", "MODEL=volo_tiny", args, runs=tmp_path / "runs")
    assert out.returncode == 0, out.stderr[-3000:]
    script = Path(out.stdout.strip().splitlines()[-1])
    assert script.name == "job.sh"
    run_dir = script.parent
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert json.loads((run_dir / "manifest.json").read_text())["local_exit_status"] == 0
    assert (run_dir / "final" / "model.pt").is_file()
    logs = list((run_dir / "logs").glob("local-*.log"))
    assert len(logs) == 1 and "summary" in logs[0].read_text()
