"""The run's decision record, `plan.json`: written once by the planner, read by everyone else.

The planner decides the engine, the layout and their predicted cost once; the trainer (inside
the container), status, follow, the reports and the analysis load this typed record instead of
re-deriving the decision from argv. Torch-free: login nodes and ranks both import it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from vitpod.registry import io, runfiles
from vitpod.registry.engines import DDP_ENGINES, ENGINES, EngineName
from vitpod.registry.paralleldims import ParallelDims
from vitpod.registry.trainsections import TrainerSettings

__all__ = ["DDP_ENGINES", "ENGINES", "EngineName", "TrainerSettings"]

VERSION = 2
"""2: the trainer's resolved configuration (`trainer`) is in the record, and ranks start from it."""
REPLAN = (
    "plan the run again with this vitpod (make render/pretrain/finetune), or use the vitpod "
    "that wrote it"
)


class RecordError(ValueError):
    """plan.json is missing, unreadable or of another version; the message names the file."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Record):
    cluster: str
    partition: str
    node_type: str
    nodes: int
    tasks_per_node: int
    world_size: int
    time: str | None = None


class Scheduling(_Record):
    """The job's sbatch options beyond its resources: the account and QOS (the profile's, or
    given for this submission), and RESERVATION, CONSTRAINT, EXCLUDE and SBATCH_EXTRA."""

    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    extra: list[str] = []
    """More #SBATCH options as --name[=value] words (SBATCH_EXTRA)."""
    set_by: dict[str, str] = {}
    """The make variable that gave each per-submission option (account: ACCOUNT, or FT_ACCOUNT
    in a pipeline's fine-tune); an option absent here is the profile's, or not set."""


class Engine(_Record):
    """Who moves the gradients, with the engine's own parameters."""

    name: EngineName
    ps_servers: int | None = None
    """Parameter-server ranks (ps only)."""
    zero_stage: int | None = None
    """ZeRO stage (deepspeed only)."""
    source: Literal["cost model", "flags"] = "flags"
    """'cost model' when the planner chose between ring and ps; 'flags' when ARGS or the
    recipe named the engine (--exchange, --deepspeed, --fsdp/--tp/--pp; registry/engines.py)."""
    reason: str = ""


class Costs(_Record):
    """The cost model's prediction, and which numbers priced it."""

    algorithm: str
    """The modelled algorithm the engine runs (ring, hierarchical, tree, ps_colocated, ...)."""
    predicted_comm_s: float
    """Predicted communication seconds per optimizer step."""
    grad_bytes: int
    per_algorithm_s: dict[str, float]
    priced_by: str
    """'profile fabric', or the calibration it used ('calibration of DATE, job ID')."""


class Precision(_Record):
    """The autocast dtype the ranks run, decided once from the node type's GPU, and why."""

    dtype: Literal["fp32", "bf16", "fp16"]
    """fp32: no autocast (no --amp); else torch.amp's autocast dtype (--amp-dtype)."""
    loss_scaling: Literal["none", "dynamic"] = "none"
    """'dynamic': fp16's loss scaling (GradScaler, DeepSpeed's fp16 scaler): a step whose
    gradients hold inf/NaN is skipped and the scale halved."""
    gpu: str | None = None
    """The node type's GPU model (None: a CPU node type)."""
    source: Literal["gpu", "flags", "default"] = "gpu"
    """'gpu': chosen from the GPU; 'flags': --amp-dtype in ARGS or the recipe; 'default': no
    GPU to choose by (the trainer's default), or no autocast."""
    reason: str = ""

    def line(self) -> str:
        """One line: the autocast dtype, its loss scaling and why."""
        scaling = ", dynamic loss scaling" if self.loss_scaling == "dynamic" else ""
        return f"precision: {self.dtype}{scaling} ({self.source}): {self.reason}"


class CheckpointInterval(_Record):
    """--checkpoint-every auto resolved: Young's (1974) and Daly's (2006) interval
    sqrt(2 x C x M) between checkpoints, its inputs and where each came from."""

    save_cost_s: float
    """C: seconds one save blocks training."""
    save_cost_source: str
    mtbi_hours: float
    """M: mean time between the job's interruptions."""
    mtbi_source: str
    interruptions: int | None = None
    """Interruptions in the partition's sacct history (None: not asked)."""
    job_hours: float | None = None
    step_time_s: float | None = None
    """Seconds per optimizer step (None: unknown, the job checkpoints at epoch ends)."""
    step_time_source: str
    interval_s: float
    steps: int
    """The --checkpoint-every the ranks run (0: epoch ends)."""
    reason: str = ""

    def line(self) -> str:
        every = f"every {self.steps} steps" if self.steps else "at epoch ends"
        return (f"checkpoint {every}: sqrt(2 x {self.save_cost_s:.3g} s x {self.mtbi_hours:.3g} h)"
                f" = {self.interval_s:.0f} s; {self.reason}")  # fmt: skip

    def expected_lost_s(self, restarts: int) -> float:
        """Work an interruption without warning loses on average: half the interval the ranks
        run (Young 1974); a preemption with its signal saves first and loses about none."""
        run_s = self.steps * self.step_time_s if self.steps and self.step_time_s else None
        return restarts * (run_s or self.interval_s) / 2

    def against(self, lost_s: float, restarts: int) -> str:
        """The goodput ledger's lost work against what the interval lets one expect."""
        return (
            f"checkpoint interval: expected lost <= {self.expected_lost_s(restarts):.1f} s "
            f"({restarts} restart(s) x half an interval, none warned), lost {lost_s:.1f} s"
        )


class HangTimeouts(_Record):
    """The ranks' progress timeouts (docs/hangs.md): per section (startup, step, checkpoint,
    eval) 2 x its measured seconds + the floor, at most the profile's ceiling; the ranks start
    from these and replace `measured_s` with their own run's times as they go."""

    floor_s: float
    measured_s: dict[str, float | None]
    """Seconds each section took in this run or the last run of the same plan (None: none)."""
    sources: dict[str, str]
    ceilings_s: dict[str, float]
    timeouts_s: dict[str, float]
    max_restarts: int
    """In-job restarts of the ranks after a hang, then the job requeues."""
    straggler_ratio: float
    straggler_steps: int
    straggler_min_s: float = 0.05
    """A straggler's own step time is also this many seconds above the median."""


class PlacedCandidate(_Record):
    """One placement candidate: where and on how many nodes, and what was predicted for it."""

    partition: str
    node_type: str
    nodes: int
    world_size: int
    start: str
    """Slurm's estimate (`sbatch --test-only`), ISO 8601 with the UTC offset."""
    step_time_s: float | None
    step_time_source: str
    steps: int | None
    run_s: float
    """Start-up + steps x step time + checkpoint saves (the time limit where unknown)."""
    run_source: str
    finish: str
    device_hours: float
    device_kind: str
    """GPU, or CPU on CPU profiles (what Slurm allocates there)."""
    within_deadline: bool | None = None
    """None: no DEADLINE given."""


class Placement(_Record):
    """`--place` (make place): every candidate, the rule that chose one, and its prediction."""

    rule: str
    """'earliest finish', or 'fewest GPU-hours by DEADLINE' (CPU-hours on CPU profiles)."""
    deadline: str | None = None
    candidates: list[PlacedCandidate]
    chosen: int
    """Index of the chosen candidate in `candidates`."""
    starts_known: bool = True
    """False offline (OFFLINE=1): Slurm was not asked, every start is the placement's own time and
    the candidates are ranked by the step model alone."""
    note: str = ""
    """How the step times were found ('estimated from FLOPs (no earlier run on A100)', ...) and
    the earlier runs left out because they ran on another device (the table's caption)."""

    @property
    def prediction(self) -> PlacedCandidate:
        return self.candidates[self.chosen]

    def compared(self, start: float | None, end: float | None) -> dict[str, Any]:
        """report.json's placement: predicted and actual start, run seconds and finish (Unix
        times from the accounting; None: not yet), and the finish's error in seconds."""
        chosen = self.prediction
        finish = dt.datetime.fromisoformat(chosen.finish).timestamp()
        return {
            "nodes": chosen.nodes, "partition": chosen.partition,
            "predicted_start": dt.datetime.fromisoformat(chosen.start).timestamp(),
            "start": start, "predicted_run_s": chosen.run_s,
            "run_s": end - start if start is not None and end is not None else None,
            "predicted_finish": finish, "finish": end,
            "finish_error_s": end - finish if end is not None else None,
        }  # fmt: skip

    def against(self, start: float | None, end: float | None) -> str:
        """The prediction against Slurm's accounting (Unix times; None: not started or not
        ended yet): start, run time and finish, and the finish's error."""
        chosen = self.prediction
        want = {k: dt.datetime.fromisoformat(v).timestamp()
                for k, v in (("start", chosen.start), ("finish", chosen.finish))}  # fmt: skip
        line = f"placement ({chosen.nodes} node(s) on {chosen.partition}): start predicted " \
            f"{_clock(want['start'])}"  # fmt: skip
        if start is None:
            return f"{line}, not started yet"
        line += f", actual {_clock(start)} ({start - want['start']:+.0f} s)"
        if end is None:
            return f"{line}; run predicted {chosen.run_s:.0f} s, still running"
        error = end - want["finish"]
        return (f"{line}; run predicted {chosen.run_s:.0f} s, actual {end - start:.0f} s; finish "
                f"predicted {_clock(want['finish'])}, actual {_clock(end)} (error {error:+.0f} s, "
                f"{100 * error / max(chosen.run_s, 1.0):+.0f}% of the predicted run)")  # fmt: skip


def _clock(when: float) -> str:
    return dt.datetime.fromtimestamp(when).astimezone().strftime("%Y-%m-%d %H:%M:%S")


class Data(_Record):
    data_dir: str | None = None
    token_label_data: str | None = None
    finetune_from: str | None = None
    token_labels: dict[str, Any] | None = None
    """The token-label data read, when it exists at planning time: layout ('published':
    TokenLabeling's per-image [2, k, H, W] files; or vitpod's store), grid [H, W] and k; the
    trainer resamples the grid to img_size/16 (labellayout.describe)."""


class Decision(_Record):
    """plan.json: what the planner decided for one job."""

    version: int = VERSION
    created: str
    stage: str
    model: str
    resources: Resources
    layout: ParallelDims
    """How the world is split: data-parallel x tensor-parallel x pipeline stages."""
    engine: Engine
    costs: Costs | None = None
    """None where no cost model priced the engine (DeepSpeed, the mesh engine, no trainer)."""
    image: dict[str, Any] | None = None
    data: Data = Data()
    memory: dict[str, Any] = {}
    precision: Precision | None = None
    """None in records written before the planner chose the dtype."""
    scheduling: Scheduling = Scheduling()
    checkpoint: CheckpointInterval | None = None
    """--checkpoint-every auto resolved (None: the flags or the profile gave a number)."""
    hang: HangTimeouts | None = None
    """The ranks' watchdog timeouts (None: the profile turns it off, or no trainer)."""
    placement: Placement | None = None
    """--place: the candidates and the prediction (None: not placed)."""
    trainer: TrainerSettings | None = None
    """The trainer's resolved configuration, what every rank starts from (None: the ranks run
    no trainer: token labels, calibration)."""

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step: dp x -b x accumulation (None: no trainer)."""
        if self.trainer is None:
            return None
        optim = self.trainer.optim
        return self.layout.dp * optim["batch_size"] * optim["accum_steps"]

    def log_line(self) -> str:
        """One line for the job log: the engine, why, and its predicted cost."""
        eng = self.engine
        extra = f", {eng.ps_servers} server(s)" if eng.name == "ps" else ""
        line = f"engine: {eng.name}{extra} ({eng.source})"
        if self.costs is not None:
            line += (
                f", {self.costs.algorithm} predicted {self.costs.predicted_comm_s * 1e3:.3g} ms "
                f"of communication per step ({self.costs.priced_by})"
            )
        return f"{line}: {eng.reason}" if eng.reason else line


def engine_fields(decision: Decision | None) -> dict[str, Any]:
    """The engine and its predicted cost, as the reports show them (None: not recorded)."""
    costs = decision.costs if decision else None
    return {
        "engine": decision.engine.name if decision else None,
        "predicted_comm_s": costs.predicted_comm_s if costs else None,
    }


def plan_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / runfiles.PLAN


def write_decision(run_dir: str | Path, decision: Decision) -> Path:
    path = plan_file(run_dir)
    # Private like the manifest beside it: the record names paths and the image.
    io.write_text_atomic(path, decision.model_dump_json(indent=2) + "\n", mode=0o640)
    return path


def read_decision(run_dir: str | Path) -> Decision:
    """The run's plan.json; RecordError names the file and what is wrong with it."""
    path = plan_file(run_dir)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecordError(f"{path}: cannot read the decision record ({exc.strerror})") from None
    try:
        version = json.loads(text).get("version")
    except (ValueError, AttributeError):
        raise RecordError(f"{path}: not a JSON object; {REPLAN}") from None
    if version != VERSION:
        raise RecordError(f"{path}: version {version}; this vitpod reads {VERSION}: {REPLAN}")
    try:
        decision = Decision.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise RecordError(f"{path}: {where}: {err['msg']}") from None
    return decision


def find_decision(run_dir: str | Path) -> Decision | None:
    """The record when the run has one (runs started by hand have none); a broken one raises."""
    return read_decision(run_dir) if plan_file(run_dir).exists() else None
