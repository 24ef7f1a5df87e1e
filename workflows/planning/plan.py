"""The one planner: profile + recipe + stage + overrides -> a validated, rendered JobPlan."""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry import labellayout, runfiles
from vitpod.registry.decision import (
    Data,
    Decision,
    Engine,
    Resources,
    Scheduling,
    TrainerSettings,
)
from vitpod.registry.engines import DDP_ENGINES
from vitpod.registry.trainsections import overridden
from vitpod.trainer.config import ConfigError as TrainerConfigError
from vitpod.trainer.config import TrainConfig, resolved
from vitpod.trainer.settings.checks import problems
from vitpod.trainer.settings.flags import parse_given
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs.rundir import (
    check_path_safe,
    git_info,
    image_info,
    new_run_path,
    runs_root,
)
from vitpod.workflows.planning import ckptinterval, exchange, noderange, preflight, sbatchopts
from vitpod.workflows.planning.hangplan import decide as decide_hang
from vitpod.workflows.planning.precision import decide_precision
from vitpod.workflows.planning.recipe import Recipe, check_token_label_size, load_recipe
from vitpod.workflows.planning.spec import Entry, JobSpec, Launch, build_spec, launch_for
from vitpod.workflows.site.profile import Profile, load_profile, profile_path
from vitpod.workflows.slurm.quantities import slurm_minutes
from vitpod.workflows.templating import render


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a user asked for: make variables, CLI flags or Pipeline/Python arguments."""

    cluster: str = "local"
    model: str = ""
    stage: str = "pretrain"
    nodes: int | str | None = None
    nodes_name: str = "NODES"
    """How errors name the node count (a pipeline's fine-tune: FT_NODES)."""
    time: str = ""
    """Slurm time limit of this job (TIME=, a pipeline's FT_TIME=); empty: the partition's."""
    time_name: str = "TIME"
    slurm: sbatchopts.SbatchOptions = sbatchopts.SbatchOptions()
    """ACCOUNT, QOS, RESERVATION, CONSTRAINT, EXCLUDE, SBATCH_EXTRA (a pipeline's FT_...)."""
    args: str = ""
    """ARGS: trainer flags as one shell-quoted string (user input)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Trainer settings vitpod itself sets over ARGS, by TrainConfig field name (a sweep point's
    batch and step count, a resume's pinned batch); an unknown name is refused."""
    ranks: int | None = None
    """World size when a job uses part of a node (a sweep point); default: every rank."""
    finetune_from: str = ""
    finetune_pending: bool = False
    """The fine-tune source is made by a job queued first (a pipeline's pretrain)."""
    offline: bool = False
    """OFFLINE=1: a script for another machine; paths on its storage are not checked here."""
    dependency: str = ""
    run_root: str = ""
    run_dir: Path | None = None
    entry: Entry = "trainer"


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    """Everything decided about one job; rendering and submitting read it and nothing else."""

    request: Request
    profile: Profile
    recipe: Recipe
    spec: JobSpec
    launch: Launch
    decision: Decision | None
    """plan.json: engine, layout, costs, image, data (None: ranks run no trainer)."""
    memory: dict[str, Any]
    script_name: str
    script: str
    created: str = field(default_factory=lambda: _now())

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir)

    @property
    def trainer(self) -> dict[str, Any] | None:
        """plan.json's trainer settings by name, with the global batch (None: no trainer)."""
        if self.decision is None or self.decision.trainer is None:
            return None
        return {**self.decision.trainer.values(), "global_batch_size": self.decision.global_batch}

    @property
    def script_path(self) -> Path:
        return self.run_dir / self.script_name

    def manifest(self, job_ids: list[str] | None = None, **extra: Any) -> dict[str, Any]:
        """manifest.json: what was planned and (with job ids) submitted."""
        spec, req = self.spec, self.request
        return {
            "created": self.created,
            "stage": spec.stage,
            "model": spec.model,
            "script": self.script_name,
            "job_ids": list(job_ids or []),
            "profile": {
                "name": self.profile.name,
                "path": str(profile_path(req.cluster).resolve()),
                "values": self.profile.model_dump(),
            },
            "recipe": {
                "model": spec.model,
                "stage": spec.stage,
                "values": self.recipe.stage(spec.stage).model_dump(),
            },
            "overrides": {
                "nodes": req.nodes,
                "time": req.time,
                "args": req.args,
                "finetune_from": req.finetune_from,
                "sbatch": _jsonable(req.slurm.given()),
            },  # fmt: skip
            "resolved": {
                "run_dir": spec.run_dir,
                "partition": spec.partition,
                "node_type": self.profile.partition(spec.stage).node_type,
                "time": spec.time,
                "nodes": spec.nodes,
                "tasks_per_node": spec.tasks_per_node,
                "world_size": spec.world_size,
                "dependency": spec.dependency,
                "command": list(spec.command),
                "srun_args": list(self.launch.srun_args),
                "env": self.launch.env,
            },
            "decision": runfiles.PLAN if self.decision else None,
            "git": git_info(),
            "image": self.decision.image if self.decision else image_info(self.profile),
            **extra,
        }


def _jsonable(given: dict[str, Any]) -> dict[str, Any]:
    extra = given.get("extra")
    if extra is not None and not isinstance(extra, str):  # a mapping or words: as words
        given = {**given, "extra": list(sbatchopts.parse_extra(extra, "SBATCH_EXTRA"))}
    return given


def _scheduling(spec: JobSpec) -> Scheduling:
    """plan.json's sbatch options: the job's account/qos (the profile's or given), and the
    per-submission ones with the variable that set each."""
    return Scheduling(
        account=spec.account, qos=spec.qos, reservation=spec.reservation,
        constraint=spec.constraint, exclude=spec.exclude, extra=list(spec.sbatch_extra),
        set_by=spec.sbatch_set_by,
    )  # fmt: skip


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def plan_job(req: Request) -> JobPlan:
    """Validate everything that needs no cluster and render the job in memory.

    Raises ConfigError naming the field and the fix; nothing is written. The recipe's flags and
    ARGS are parsed once by the trainer's parser; the dtype, checkpoint interval, a node range's
    batch and the engine are set on that configuration, which plan.json's trainer section holds.
    """
    profile = load_profile(req.cluster)
    model = profile.model_for(req.model)
    recipe = load_recipe(model)
    recipe.stage(req.stage)
    partition = profile.partition(req.stage)
    node = profile.node_type(req.stage)
    run_dir = req.run_dir or new_run_path(runs_root(profile, req.run_root), recipe.model, req.stage)
    check_path_safe(run_dir, "run root", "choose another storage.runs / --run-root")
    nodes = preflight.node_count(req.nodes, profile, req.stage, name=req.nodes_name)
    time_limit = stage_time(req.time, profile, req.stage, req.time_name)
    sbatch = sbatchopts.check(req.slurm, profile.scheduler, profile.name)
    world = req.ranks or nodes * node.ranks_per_node
    ranged = req.entry == "trainer" and req.nodes in (None, "")
    nodes_max = partition.nodes_max if ranged else None  # a node range and no NODES
    spec = build_spec(
        profile, recipe, req.stage, run_dir=run_dir, nodes=nodes, args=req.args,
        finetune_from=req.finetune_from or None, dependency=req.dependency or None,
        entry=req.entry, nodes_max=nodes_max,
    )  # fmt: skip
    source_now = not (req.finetune_pending or req.offline or req.dependency)
    if spec.finetune_from and source_now:  # the preflight's own check, before anything is written
        problem = preflight.finetune_source_problem(req.finetune_from)
        if problem:
            raise ConfigError(
                f"{problem} (make render OFFLINE=1 writes a script for a machine that has it)"
            )
    cfg, decision, memory = None, None, {"checked": False, "reason": "the ranks run no trainer"}
    precision, checkpoint = None, None
    if req.entry == "trainer":
        # ARGS and the recipe parsed once; the planner's decisions are fields set on it
        parsed, given = _parse_trainer(spec.args, req.overrides)
        cfg = _resolved(parsed, world)
        precision, dtype = decide_precision(cfg, given, node, partition.node_type)
        checkpoint, every = ckptinterval.decide(
            profile, partition.name, cfg, given, run_dir,
            ask_slurm=profile.scheduler == "slurm" and not req.offline,
        )  # fmt: skip
        parsed = dataclasses.replace(parsed, amp_dtype=dtype, checkpoint_every=every)
        if nodes_max:
            # Slurm gives MIN..MAX nodes. The global batch is planned at MAX; on fewer nodes the
            # ranks take the accumulation that keeps it.
            top = _resolved(parsed, nodes_max * node.ranks_per_node)
            noderange.check_range(top, nodes, nodes_max, node.ranks_per_node)
            parsed = _overridden(parsed, noderange.pinned(top.batch_size, top.global_batch_size))
        cfg = _resolved(parsed, world)
        spec = dataclasses.replace(spec, workers=cfg.workers)
    tasks, gpus = noderange.part_of_nodes(req.ranks, nodes, node.ranks_per_node, node.gpus_per_node)
    spec = dataclasses.replace(spec, time=time_limit, tasks_per_node=tasks, gpus_per_node=gpus)
    spec = sbatchopts.apply(spec, sbatch)
    if cfg is not None:
        preflight.check_layout(cfg, node, world)
        memory = preflight.memory_fit(cfg, node, world, req.stage, partition.name)
        engine, costs = _decide_engine(
            profile, req.stage, cfg, nodes, world, _calibration(req, partition.name)
        )
        if engine.name in DDP_ENGINES:  # the ranks run the decided exchange, not auto
            cfg = dataclasses.replace(cfg, exchange=engine.name, ps_servers=engine.ps_servers)
        decision = Decision(
            created=_now(), stage=req.stage, model=recipe.model,
            resources=Resources(
                cluster=profile.name, partition=partition.name, node_type=partition.node_type,
                nodes=nodes, tasks_per_node=spec.tasks_per_node, world_size=world, time=spec.time,
            ),
            layout=cfg.dims,
            engine=engine, costs=costs, image=image_info(profile), memory=memory,
            precision=precision, scheduling=_scheduling(spec), checkpoint=checkpoint,
            hang=decide_hang(profile.hang, cfg, run_dir),
            trainer=TrainerSettings.of(cfg),
            data=Data(
                data_dir=spec.data_dir, token_label_data=cfg.token_label_data,
                finetune_from=spec.finetune_from,
                token_labels=(
                    labellayout.describe(cfg.token_label_data) if cfg.token_label else None
                ),
            ),
        )  # fmt: skip
    launch = launch_for(spec)
    template, script_name = (
        ("sbatch.sh.j2", runfiles.SBATCH)
        if profile.scheduler == "slurm"
        else ("local.sh.j2", runfiles.LOCAL_SCRIPT)
    )
    configuration = decision.trainer.lines() if decision and decision.trainer else []
    script = render(template, {"spec": spec, "launch": launch, "configuration": configuration})
    return JobPlan(
        request=req, profile=profile, recipe=recipe, spec=spec, launch=launch, decision=decision,
        memory=memory,
        script_name=script_name, script=script,
    )  # fmt: skip


def stage_time(value: str, profile: Profile, stage: str, name: str = "TIME") -> str:
    """TIME (default: the stage partition's `time`): a Slurm time above the preemption grace."""
    if not value:
        return profile.partition(stage).time
    try:
        minutes = slurm_minutes(value)
    except ConfigError:
        raise ConfigError(
            f"{name}={value!r} is not a Slurm time; write e.g. {name}=2:00:00 or {name}=1-00:00:00"
        ) from None
    grace = profile.preemption.grace_s
    if profile.scheduler == "slurm" and 0 < minutes * 60 <= grace:
        raise ConfigError(
            f"{name}={value}: not above profile {profile.name}'s preemption.grace_s={grace} "
            f"(Slurm would signal every start before its first step); give a longer {name}"
        )
    return value.strip()


def _parse_trainer(
    args: tuple[str, ...], overrides: dict[str, Any]
) -> tuple[TrainConfig, frozenset[str]]:
    """The recipe's flags and ARGS parsed once by the trainer's parser, vitpod's overrides set
    over them: the configuration before resolve, and the fields given."""
    try:
        parsed, given = parse_given(args)
    except TrainerConfigError as exc:
        raise ConfigError(f"ARGS/recipe: {exc}") from None
    try:  # the grid is img_size/16 (unset: the trainer takes it)
        if parsed.token_label:
            check_token_label_size(parsed.img_size, parsed.token_label_size, "--token-label-size")
    except ValueError as exc:
        raise ConfigError(f"ARGS/recipe: {exc}") from None
    return _overridden(parsed, overrides), given | set(overrides)


def _overridden(parsed: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    try:  # an unknown field or a value of the wrong type: ConfigError
        return overridden(parsed, overrides)
    except TrainerConfigError as exc:
        raise ConfigError(str(exc)) from None


def _resolved(parsed: TrainConfig, world: int) -> TrainConfig:
    """The configuration resolved for `world` ranks, and the trainer's consistency checks."""
    try:
        cfg = resolved(parsed, world)
    except TrainerConfigError as exc:
        raise ConfigError(f"ARGS/recipe: {exc}") from None
    found = problems(cfg, for_training=False)
    if found:
        raise ConfigError("ARGS/recipe: " + "; ".join(found))
    return cfg


def _calibration(req: Request, partition: str) -> Any:
    """The fit `make calibrate` stored beside the profile for this partition, or None."""
    try:
        return exchange.calibration_for(profile_path(req.cluster), partition)
    except ValueError as exc:
        fix = f"rerun `make calibrate CLUSTER={req.cluster}` or delete it"
        raise ConfigError(f"{exc}; {fix}") from None


def _decide_engine(
    profile: Profile, stage: str, cfg: TrainConfig, nodes: int, world: int, calibration: Any
) -> tuple[Engine, Any]:
    """The engine the flags name (DeepSpeed, FSDP, the mesh), or ring / parameter server from
    the cost model (a --exchange ring|ps in the flags is kept, and priced)."""
    named = cfg.engine if cfg.engines_claimed else None
    if named in ("deepspeed", "fsdp", "mesh"):
        zero = cfg.zero_stage if named == "deepspeed" else None
        record = {"name": named, "zero_stage": zero, "reason": "named by the flags"}
        return Engine.model_validate(record), None
    try:
        return exchange.choose_engine(
            profile.node_type(stage).fabric, cfg.model, nodes, gpus=world,
            exchange=cfg.exchange, ps_servers=cfg.ps_servers,
            # --num-classes not given: the job counts its data; an ImageNet head here
            num_classes=cfg.num_classes or 1000, img_size=cfg.img_size, calibration=calibration,
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
