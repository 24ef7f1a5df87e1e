"""The names of a run directory's files, and the one reader of each, for every package that
writes or reads one.

The policy of every reader here: a file that exists but does not parse raises RunFileError (a
ValueError) naming the file, and for JSONL the line. A metrics file is read line by line, and
a line counts only once its newline is written: the last line without one is skipped (the job
may be writing it now; a killed job leaves it torn, and the trainer cuts it off before it
appends again), while a bad line that ends in a newline is an error naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
"""A run's record (registry.records.RunManifest): what was planned and submitted (profile,
recipe, resolved arguments, topology, job ids). Only the run's: before FINAL_RECORD and LABELS
existed, a final model and a label set kept their records under this name too
(registry/records.py reads those)."""
FINAL_RECORD = "model.json"
"""In final/: the final model's record (registry.records.FinalModel), written last."""
LABELS = "labels.json"
"""In a token-label set: its record (registry.records.LabelSet), written when the last shard
lands."""
PLAN = "plan.json"
"""The planner's typed decision record (vitpod.registry.decision.Decision)."""
SUMMARY = "summary.json"
"""The trainer's final figures (top-1, steps, images/s, mesh, ...)."""
PIPELINE = "pipeline.json"
"""A pipeline directory's record of its stages."""
STUDY = "study.json"
"""A scaling study's record of its points."""
REPORT = "report.json"
CONTAINER_START = "container_start.json"
"""Seconds from srun to the first command in the container, per node, cold and warm (sbatch jobs
of a profile with container.start_once; the goodput ledger reads it)."""
ENROOT_CONFIG = "enroot"
"""The job's ENROOT_CONFIG_PATH (registry credentials by variable name); removed at the end."""
LOGS = "logs"
METRICS = "metrics"
CHECKPOINTS = "checkpoints"
FINAL = "final"
FINAL_MODEL = "model.pt"
TIMM_WEIGHTS = "model.safetensors"
"""Beside FINAL_MODEL, the same tensors for timm's `local-dir:` source (HF_SAFE_WEIGHTS_NAME)."""
TIMM_CONFIG = "config.json"
"""Beside FINAL_MODEL: timm's architecture, model_args and pretrained_cfg (not the run's CONFIG)."""
TIMM_TORCH_WEIGHTS = "pytorch_model.bin"
"""The torch weights file of a folder timm's save_for_hf wrote (HF_WEIGHTS_NAME)."""
TENSORBOARD = "tb"
BIND = "bind.sh"
SBATCH = "job.sbatch"
LOCAL_SCRIPT = "job.sh"
SUBMITIT = "submitit"
RENDERED = "rendered.sha256"
"""sha256 of every file vitpod rendered into a run directory (`sha256sum -c` reads it): a file
changed since rendering is refused at submission."""
REQUEUE_PROGRESS = "requeue-progress"
"""One line `JOB NEWEST COUNT`, rewritten by the batch script's teardown at each requeue: the job,
the newest complete checkpoint step then (-1: none) and how many requeues of that job in a row
found no newer one (preemption.max_requeues_without_progress ends the requeues)."""

CONFIG = "config.json"
"""The trainer's resolved arguments."""
ARGS = "args.yaml"
"""The trainer's flags as parsed, before defaults are resolved (timm's name); `-c` reads it."""
REPORT_DIR = "report"
"""A scaling study's report folder: the plots, TABLE and REPORT_HTML."""
TABLE = "table.json"
REPORT_HTML = "report.html"


def final_model(run_dir: str | Path) -> Path:
    return Path(run_dir) / FINAL / FINAL_MODEL


def weights_candidates(path: str | Path) -> tuple[Path, ...]:
    """Where a finetune source keeps its weights, in the order taken: the path itself (a file),
    a run's final model, a final or checkpoint folder's model.pt, a timm local model folder."""
    p = Path(path)
    return (p, final_model(p), p / FINAL_MODEL, p / TIMM_WEIGHTS, p / TIMM_TORCH_WEIGHTS)


def metrics_file(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / METRICS / f"rank{rank}.jsonl"


def metrics_files(run_dir: str | Path) -> list[Path]:
    """Every rank's metrics file, in rank order (rank2 before rank10)."""

    def rank(path: Path) -> tuple[int, str]:
        number = path.stem.removeprefix("rank")
        return (int(number) if number.isdigit() else 1 << 30, path.name)

    return sorted((Path(run_dir) / METRICS).glob("rank*.jsonl"), key=rank)


class RunFileError(ValueError):
    """A run file that exists but cannot be read: the message names the file (and line)."""


@dataclass
class JsonlTail:
    """A metrics JSONL file read from where the last read stopped: only complete lines (see
    the module's policy); each record a JSON object with a "kind" (the trainer's contract)."""

    path: Path
    offset: int = 0
    lines: int = 0  # complete lines read so far

    def read(self) -> list[dict[str, Any]]:
        """The records appended since the last read; OSError when the file cannot be read."""
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        records = []
        for raw in data[:end].splitlines():
            self.lines += 1
            if raw.strip():
                records.append(self._record(raw))
        self.offset += end
        return records

    def _record(self, raw: bytes) -> dict[str, Any]:
        where = f"{self.path}:{self.lines}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
            raise RunFileError(f"{where}: not a JSON line ({reason}); the file was changed or "
                               "damaged after the trainer wrote it") from None  # fmt: skip
        if not isinstance(record, dict) or "kind" not in record:
            raise RunFileError(f'{where}: expected a JSON object with a "kind" field')
        return record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics JSONL file (the module's policy)."""
    return JsonlTail(Path(path)).read()


def read_metrics(run_dir: str | Path, rank: int | None = None) -> list[dict[str, Any]]:
    """The records of one rank's metrics file (none when it has none yet), or of every rank's
    in rank order."""
    if rank is not None:
        path = metrics_file(run_dir, rank)
        return read_jsonl(path) if path.is_file() else []
    return [record for path in metrics_files(run_dir) for record in read_jsonl(path)]


def drop_torn_tail(path: str | Path) -> None:
    """Cut a last line without its newline (a killed writer's) off a JSONL file, so that the
    next appended record starts a line of its own. Only the file's one writer may call it."""
    try:
        handle = open(path, "rb+")
    except FileNotFoundError:
        return
    with handle:
        size = handle.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:
            step = min(keep, 1 << 16)
            handle.seek(keep - step)
            chunk = handle.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = keep - step + newline + 1
                break
            keep -= step
        if keep != size:
            handle.truncate(keep)


def read_json(path: str | Path) -> Any:
    """A JSON run file (manifest, plan, summary, pipeline, study records); OSError when it
    cannot be read, RunFileError when it does not parse."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RunFileError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None


def read_record(path: str | Path) -> dict[str, Any]:
    """read_json of a file that holds one JSON object."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise RunFileError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """The trainer's summary.json; None when the run has not written one."""
    path = Path(run_dir) / SUMMARY
    return read_record(path) if path.is_file() else None


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's manifest.json (FileNotFoundError when there is none)."""
    return read_record(Path(run_dir) / MANIFEST)


STUDY_REPORT = "report"
"""A scaling study's report folder (report.html, table.json, plots)."""
STUDY_REPORT_HTML = "report.html"
CHECKPOINT_RANK0 = "rank0.json"
"""Inside each checkpoint folder: rank 0's own manifest (its file, checksum, step)."""
CHECKPOINT_COMMIT = "COMMIT.json"
"""Inside each checkpoint folder, written last by rank 0 once every rank's files are on disk:
every file with its sha256 and size, and the job and start that wrote them."""
CHECKPOINT_DISCARDED = "discarded"
"""Under checkpoints/: damaged step folders set aside at a resume; nothing automatic deletes
them."""
CHECKPOINT_NAME = re.compile(r"step_[0-9]{9}")
"""The only names under checkpoints/ that are checkpoints; anything else is the user's, left
alone."""


def is_checkpoint_name(name: str) -> bool:
    return CHECKPOINT_NAME.fullmatch(name) is not None
