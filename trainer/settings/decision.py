"""The plan a rank starts from: `--plan RUN/plan.json`, whose `trainer` section is the rank's
configuration as it is, with the decision's precision and layout."""

from __future__ import annotations

from pathlib import Path

from vitpod.registry import runfiles
from vitpod.registry.decision import Decision, Precision, RecordError, read_decision
from vitpod.trainer.config import ConfigError, TrainConfig, fit_world
from vitpod.trainer.settings import timmargs, timmoptions


def read_plan(path: str) -> Decision:
    """plan.json of a training job; ConfigError names the file and the fix."""
    plan = Path(path)
    if plan.name != runfiles.PLAN:
        raise ConfigError(f"--plan {path}: give a run's {runfiles.PLAN} (RUN_DIR/{runfiles.PLAN})")
    try:
        decision = read_decision(plan.parent)
    except RecordError as exc:
        raise ConfigError(str(exc)) from None
    if decision.trainer is None:
        raise ConfigError(f"--plan {path}: its ranks run no trainer (stage {decision.stage})")
    return decision


def from_plan(path: str, world_size: int) -> tuple[TrainConfig, Decision]:
    """A planned rank's configuration: plan.json's trainer section validated as it is (nothing
    parsed or resolved again), the precision (dtype, loss scaling) and layout (tp, pp) the
    decision records, and the rules of the world size this job got (a node range's rank:
    --elastic's accumulation). ConfigError names the file, the key and the fix."""
    decision = read_plan(path)
    trainer = decision.trainer
    assert trainer is not None  # read_plan refuses a plan without one
    quiet = {k for k, o in timmoptions.UNMAPPED.items() if o.use == timmoptions.NO_EFFECT}
    if wrong := sorted(set(trainer.no_effect) - quiet):
        raise ConfigError(f"--plan {path}: trainer.no_effect: {wrong}: not timm options of no "
                          "effect here (edited by hand?); plan the run again")  # fmt: skip
    cfg = trainer.config(world_size)
    if decision.precision is not None:
        _precision(cfg, decision.precision, path)
    cfg.tp, cfg.pp = decision.layout.tp, decision.layout.pp
    try:
        fit_world(cfg, world_size)
    except ConfigError as exc:
        raise ConfigError(f"--plan {path} on {world_size} rank(s): {exc}") from None
    if cfg.engine != decision.engine.name:
        raise ConfigError(
            f"--plan {path}: its trainer settings run engine {cfg.engine!r} but its engine is "
            f"{decision.engine.name!r} (edited by hand?); plan the run again"
        )
    cfg.plan = path
    cfg.no_effect = timmargs.unmapped_values(dict(trainer.no_effect))[0]
    requested = {name: getattr(cfg, name) for name in trainer.values()}
    cfg.requested = timmargs.timm_names({**requested, **trainer.no_effect})
    cfg.requested.setdefault("lr_base_scale", "linear")
    return cfg, decision


def _precision(cfg: TrainConfig, precision: Precision, path: str) -> None:
    """The decision's autocast dtype; fp16 runs dynamic loss scaling (GradScaler, DeepSpeed's
    scaler) and nothing else does, so a record saying otherwise is refused."""
    scaling = "dynamic" if precision.dtype == "fp16" else "none"
    if precision.loss_scaling != scaling:
        raise ConfigError(
            f"--plan {path}: precision.loss_scaling {precision.loss_scaling!r} with dtype "
            f"{precision.dtype}: the ranks scale the loss for fp16 only ({scaling!r} here); "
            "plan the run again"
        )
    cfg.amp = precision.dtype != "fp32"
    cfg.apex_amp = cfg.apex_amp and cfg.amp
    if cfg.amp:
        cfg.amp_dtype = precision.dtype
