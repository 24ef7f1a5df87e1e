"""The names of a run directory's files, for every package that writes or reads one."""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
"""What was planned and submitted: profile, recipe, resolved arguments, topology, job ids."""
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


STUDY_REPORT = "report"
"""A scaling study's report folder (report.html, table.json, plots)."""
STUDY_REPORT_HTML = "report.html"
CHECKPOINT_RANK0 = "rank0.json"
"""Inside each checkpoint folder: rank 0's own manifest (its file, checksum, step)."""
CHECKPOINT_COMMIT = "COMMIT.json"
"""Inside each checkpoint folder, written last by rank 0 once every rank's files are on disk:
every file with its sha256 and size, and the job and start that wrote them."""
