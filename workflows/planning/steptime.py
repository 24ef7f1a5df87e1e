"""The step-time model of placement (workflows/planning/placement.py) and a scaling study's point
sizes (workflows/studies/pointsize.py): seconds per optimizer step of a plan, from earlier runs
on the same kind of device, else from the model's FLOPs over the GPU's peak x an assumed MFU; and
the steps the job will run. docs/workflows.md#placement."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any

from vitpod.analysis.layout import step_flops
from vitpod.analysis.scaling import scaled_step_s
from vitpod.registry import gpus, models
from vitpod.registry.labelset import IMAGE_SUFFIXES
from vitpod.workflows.planning import runmeasure
from vitpod.workflows.planning.plan import JobPlan


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Seconds per optimizer step and where they came from (None: no run to go by); `note`:
    what the table says of it (the estimate's basis, the earlier runs left out)."""

    seconds: float | None
    source: str
    note: str = ""


ASSUMED_MFU = {
    "Volo": (0.064, "volo_d1 b128 bf16 eager training steps on an H100, docs/benchmarks.md"),
    "Vit": (0.258, "the trainer's vit_base_patch16_224 b256 bf16 compiled on an H100, "
            "docs/benchmarks.md"),
}  # fmt: skip
"""Model FLOPs utilisation assumed where no earlier run on the candidate's GPU measured a step:
vitpod's own measured MFU of the architecture (MFU as in the PaLM paper, appendix B)."""


def step_model(plan: JobPlan) -> StepModel:
    """Seconds per optimizer step of this plan, from earlier runs measured on the candidate's
    kind of device only (a CPU run says nothing of an A100; runs on another device are left out,
    said in `note`). An earlier run of the same model, image size and per-rank batch: its median
    step, the compute part (step - comm) per micro-batch times this plan's micro-batches per
    step, plus the communication the cost model predicts for this node count
    (analysis/commcost.py, calibrated where `make calibrate` ran). Else the FLOPs of a step
    (analysis/layout.step_flops) over the FLOP/s the newest earlier run of any known model
    sustained per rank on that device. Else, on a GPU of known peak: those FLOPs over the peak x
    ASSUMED_MFU, plus the same predicted communication."""
    cfg = plan.trainer or {}
    comm = plan.decision.costs.predicted_comm_s if plan.decision and plan.decision.costs else 0.0
    world, micro = plan.spec.world_size, int(cfg["accum_steps"])
    gpu = candidate_device(plan)
    on_gpu, elsewhere = _by_device(runmeasure.configs(plan.run_dir), gpu)
    left_out = (f"; left out: {len(elsewhere)} earlier run(s) measured on another device "
                f"({', '.join(sorted(set(elsewhere.values())))})" if elsewhere else "")  # fmt: skip
    same = [run for run, c in on_gpu if all(c.get(k) == cfg[k]
            for k in ("model", "img_size", "batch_size"))]  # fmt: skip
    found = runmeasure.step_time(same)
    if found is not None:
        ran = _config(found.run)
        note = f"measured on {gpu}{left_out}"
        if found.world_size == world and ran.get("accum_steps") == micro:
            return StepModel(found.seconds, found.source("step time"), note)
        seconds = scaled_step_s(
            found.seconds, found.comm_s, int(ran.get("accum_steps") or 1), micro, comm
        )
        why = (f"{found.source('step')} on {found.world_size} rank(s), compute scaled to "
               f"{micro} micro-batch(es) a step + predicted comm {comm * 1e3:.3g} ms")  # fmt: skip
        return StepModel(seconds, why, note)
    if not models.known(cfg["model"]):
        return StepModel(None, f"{cfg['model']} is not in the model registry (no FLOP count)",
                         f"no earlier run on {gpu}{left_out}")  # fmt: skip
    mine = step_flops(cfg["model"], cfg["img_size"], cfg["batch_size"] * micro)
    for run, ran in on_gpu:
        if not (_whole(ran, "img_size", "batch_size", "accum_steps")
                and models.known(str(ran.get("model", "")))):  # fmt: skip
            continue
        other = runmeasure.step_time([run])
        if other is None:
            continue
        flops = step_flops(ran["model"], ran["img_size"], ran["batch_size"] * ran["accum_steps"])
        rate = flops / max(other.seconds - other.comm_s, 1e-9)
        why = (f"{mine:.3g} FLOPs a rank's step at {rate:.3g} FLOP/s ({ran['model']} measured in "
               f"{run}) + predicted comm {comm * 1e3:.3g} ms")  # fmt: skip
        return StepModel(mine / rate + comm, why, f"scaled by FLOPs from {ran['model']} on "
                         f"{gpu}{left_out}")  # fmt: skip
    peak = gpus.peak_of(gpu)
    note = f"estimated from FLOPs (no earlier run on {gpu}){left_out}"
    if peak is None:
        why = "" if gpu == "cpu" else f", and {gpu} has no peak FLOP/s in vitpod.registry.gpus"
        return StepModel(None, f"no earlier run on {gpu} measured a step{why}",
                         f"no earlier run on {gpu}{left_out}")  # fmt: skip
    mfu, mfu_source = ASSUMED_MFU[type(models.arch_of(cfg["model"])).__name__]
    why = (f"{mine:.3g} FLOPs a rank's step / ({peak.flops:.3g} FLOP/s peak ({peak.source}) "
           f"x assumed MFU {mfu:.3g} ({mfu_source}))"
           f" + predicted comm {comm * 1e3:.3g} ms")  # fmt: skip
    return StepModel(mine / (peak.flops * mfu) + comm, why, note)


def candidate_device(plan: JobPlan) -> str:
    """The kind of device the candidate's ranks run on: its node type's GPU (gpus.kind), or
    'cpu'."""
    node = plan.profile.node_type(plan.spec.stage)
    if node.gpus_per_node and node.gpu is not None:
        return gpus.kind(node.gpu.model)
    return "cpu"


def _by_device(
    runs: list[tuple[Path, dict[str, Any]]], device: str
) -> tuple[list[tuple[Path, dict[str, Any]]], dict[Path, str]]:
    """The runs measured on `device`, and the others with what they ran on ('unrecorded':
    the run names no device)."""
    mine, others = [], {}
    for run, config in runs:
        ran = runmeasure.device(run)
        if ran and gpus.kind(ran) == device:
            mine.append((run, config))
        elif ran:
            others[run] = gpus.kind(ran)
        elif runmeasure.step_time([run]) is not None:  # stepped, before runs named a device
            others[run] = "unrecorded"
    return mine, others


def _config(run: str) -> dict[str, Any]:
    return next((c for r, c in runmeasure.configs(Path(run)) if str(r) == run), {})


def _whole(config: dict[str, Any], *keys: str) -> bool:
    """config.json has a positive whole number under every key (a damaged one measures nothing)."""
    return all(isinstance(config.get(k), int) and config[k] > 0 for k in keys)


def planned_steps(plan: JobPlan) -> tuple[int | None, str]:
    """Optimizer steps the job will run: --max-steps, else its epochs x the steps per epoch an
    earlier run over the same data had at its global batch (scaled to this one's)."""
    cfg = plan.trainer or {}
    if cfg.get("max_steps"):
        return int(cfg["max_steps"]), "--max-steps"
    for run, ran in runmeasure.configs(plan.run_dir):
        if ran.get("data_dir") != cfg.get("data_dir") or ran.get("max_steps"):
            continue
        if not _whole(ran, "epochs", "batch_size", "accum_steps"):
            continue
        found = runmeasure.step_time([run])
        if found is None or not found.total_steps or not found.world_size:
            continue
        replicas = found.world_size // max(1, int(ran.get("tp") or 1) * int(ran.get("pp") or 1))
        batch = ran["batch_size"] * ran["accum_steps"] * replicas
        per_epoch = found.total_steps / ran["epochs"] * batch / cfg["global_batch_size"]
        return round(per_epoch * cfg["epochs"]), f"{cfg['epochs']} epoch(s) of the data {run} read"
    images = train_images(cfg)
    if images:
        per_epoch = math.ceil(images / cfg["global_batch_size"])
        return per_epoch * int(cfg["epochs"]), (
            f"{cfg['epochs']} epoch(s) of the {images} images in {cfg['data_dir']}/train at a "
            f"global batch of {cfg['global_batch_size']}"
        )  # fmt: skip
    return None, "steps unknown (no --max-steps, no earlier run over the data, no images found)"


def train_images(cfg: dict[str, Any]) -> int:
    """The images of an image-folder data set's train split (DATA/train/<class>/<image>), as the
    trainer's folder source counts them; 0 for another kind of data set or none there."""
    if cfg.get("dataset") not in ("", "folder", None) or not cfg.get("data_dir"):
        return 0
    return _count_images(str(Path(cfg["data_dir"]) / "train"), _mtime(cfg["data_dir"]))


def _mtime(data_dir: str) -> float:
    try:
        return (Path(data_dir) / "train").stat().st_mtime
    except OSError:
        return 0.0


@functools.lru_cache(maxsize=8)
def _count_images(train: str, mtime: float) -> int:
    """Counted once per placement (every candidate asks; ImageNet's train split is 1.28 M files
    on a shared file system); `mtime` keys a folder that changed."""
    try:
        with os.scandir(train) as classes:
            folders = [c.path for c in classes if c.is_dir()]
        count = 0
        for folder in folders:
            with os.scandir(folder) as files:
                count += sum(Path(f.name).suffix.lower() in IMAGE_SUFFIXES for f in files)
    except OSError:
        return 0
    return count
