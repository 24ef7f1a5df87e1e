"""--log-wandb for real, offline: 2 gloo ranks of the tiny VOLO on digits, W&B installed.

The offline run file is read back record by record, so the test checks what W&B would upload
(the same losses as metrics/rank0.jsonl, the resolved config), not only that a directory exists.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, logs, run_ranks

wandb = pytest.importorskip("wandb", reason="wandb is part of the [train] extra (make setup)")

ARGS = [
    "--model", "volo_tiny", "--num-classes", "10", "--img-size", "32", "-b", "16",
    "--workers", "0", "--loader", "torch", "--aa", "", "--reprob", "0", "--max-steps", "6",
    "--checkpoint-every", "0", "--log-interval", "1", "--warmup-steps-excluded", "1",
]  # fmt: skip


def wandb_records(path: Path) -> list[dict]:
    """Records of an offline `.wandb` file as {type: message}. The file is W&B's header (7 bytes)
    followed by the LevelDB log format: 32 KiB blocks of records, each with a 7-byte header
    (crc32c, length, type) and a FULL or FIRST/MIDDLE/LAST chunk of one protobuf `Record`.
    https://github.com/google/leveldb/blob/main/doc/log_format.md"""
    from google.protobuf.json_format import MessageToDict
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            kind_name = record.WhichOneof("record_type")
            out.append({kind_name: MessageToDict(getattr(record, kind_name))})
    return out


def history(records: list[dict]) -> dict[int, dict[str, object]]:
    rows: dict[int, dict[str, object]] = {}
    for rec in records:
        if "history" in rec:
            items = {
                "/".join(i.get("nestedKey") or [i["key"]]): json.loads(i["valueJson"])
                for i in rec["history"]["item"]
            }
            rows.setdefault(int(items["_step"]), {}).update(items)
    return rows


@pytest.mark.slow
def test_log_wandb_offline_writes_the_metrics_into_the_run_dir(digits_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_PROJECT", "from-the-profile")  # what a profile's env: would set
    run = tmp_path / "run"
    args = [str(digits_dir), *ARGS, "--output", str(run), "--log-wandb", "--wandb-name", "tiny"]
    codes = run_ranks(2, args, tmp_path / "logs", timeout=600)  # generous: a shared machine
    assert codes == [0, 0], logs(tmp_path / "logs")

    # One W&B run (rank 0 only), inside the run directory.
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, sorted(p.name for p in (run / "wandb").iterdir())
    records = wandb_records(files[0])
    start = next(r["run"] for r in records if "run" in r)
    assert start["project"] == "from-the-profile" and start["displayName"] == "tiny"
    assert start["runId"] == (run / "wandb-run-id").read_text().strip()
    config = {u["key"]: json.loads(u["valueJson"]) for u in start["config"]["update"]}
    assert config["model"] == "volo_tiny" and config["max_steps"] == 6
    assert config["world_size"] == 2 and config["log_wandb"] is True

    # The same numbers as rank 0's JSONL, step by step.
    lines = [json.loads(x) for x in (run / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in lines if r["kind"] == "step"}
    rows = history(records)
    assert sorted(steps) == list(range(1, 7)) and set(steps) <= set(rows)
    for step, rec in steps.items():
        assert rows[step]["train/loss"] == pytest.approx(rec["loss"])
        assert rows[step]["train/lr"] == pytest.approx(rec["lr"])
        assert rows[step]["time/comm"] == pytest.approx(rec["time"]["comm"])
    evals = [r for r in lines if r["kind"] == "eval"]
    assert evals and rows[evals[-1]["step"]]["eval/top1"] == pytest.approx(evals[-1]["top1"])
    summary = json.loads((run / "summary.json").read_text())
    summary_updates = {
        u.get("key") or "/".join(u["nestedKey"]): json.loads(u["valueJson"])
        for r in records
        if "summary" in r
        for u in r["summary"].get("update", [])
    }
    assert summary_updates["images_per_s"] == pytest.approx(summary["images_per_s"])


def test_a_run_without_log_wandb_never_imports_wandb(tmp_path):
    """timm imports wandb when it is installed; the trainer keeps it out unless asked."""
    code = (
        "import sys\n"
        "from vitpod.trainer.__main__ import main\n"
        "assert main(sys.argv[1:]) == 0\n"
        "print('wandb loaded:', sys.modules.get('wandb') is not None)\n"
        "import wandb\n"  # and an in-process caller can import it afterwards
    )
    argv = ["--dataset", "synthetic", "--model", "volo_tiny", "--img-size", "32", "-b", "4",
            "--max-steps", "1", "--checkpoint-every", "0", "--no-eval",
            "--output", str(tmp_path / "run")]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wandb loaded: False" in out.stdout


def test_log_wandb_without_wandb_is_one_clear_error(tmp_path):
    """With wandb unimportable, the trainer refuses before any rank trains (exit 2)."""
    code = (
        "import sys; sys.modules['wandb'] = None\n"  # makes `import wandb` fail, as if absent
        "from vitpod.trainer.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["--dataset", "synthetic", "--model", "volo_tiny", "--img-size", "32",
            "--output", str(tmp_path / "run"), "--log-wandb"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--log-wandb: the wandb package is not installed" in out.stderr
    assert not (tmp_path / "run" / "wandb").exists()


def test_metrics_logger_raises_the_same_error_when_import_fails(tmp_path, monkeypatch):
    import torch

    from vitpod.trainer.config import ConfigError
    from vitpod.trainer.telemetry.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="--log-wandb: the wandb package is not installed"):
        MetricsLogger(tmp_path, 0, 1, 10, 1, torch.device("cpu"), config={"log_wandb": True})
    # Other ranks never touch W&B, even when asked.
    MetricsLogger(tmp_path, 1, 2, 10, 1, torch.device("cpu"), config={"log_wandb": True}).close()


def test_online_without_an_api_key_is_one_clear_error(tmp_path):
    """Online W&B with no key (none exported, no ~/.netrc): exit 2 naming WANDB_API_KEY and the
    offline alternative, instead of a prompt or a hang inside a batch job."""
    env = {**os.environ, "WANDB_MODE": "online", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_API_KEY", None)
    argv = ["--dataset", "synthetic", "--model", "volo_tiny", "--img-size", "32", "--workers",
            "0", "--output", str(tmp_path / "run"), "--log-wandb"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "vitpod.trainer", *argv], cwd=REPO, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--log-wandb: W&B did not start" in out.stderr
    assert "WANDB_API_KEY" in out.stderr and "WANDB_MODE=offline" in out.stderr
