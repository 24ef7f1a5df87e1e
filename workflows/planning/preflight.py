"""Preflight: refuse a doomed job (layout, memory, partition, paths) before it queues."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitpod.analysis import layout, memory
from vitpod.registry import labellayout, labelset, models
from vitpod.registry.engines import MESH_ENGINES
from vitpod.workflows import slurm
from vitpod.workflows.containers import containerpreflight
from vitpod.workflows.containers.container import check_container_paths, host_path
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import sharedfs
from vitpod.workflows.planning import slurmchecks
from vitpod.workflows.planning.finetunesource import finetune_source_problem
from vitpod.workflows.planning.grace import check_grace
from vitpod.workflows.planning.slurmchecks import Planned
from vitpod.workflows.planning.spec import JobSpec
from vitpod.workflows.site.profile import NodeType, Profile, resolve_path
from vitpod.workflows.slurm.quantities import whole_number

if TYPE_CHECKING:
    from vitpod.trainer.config import TrainConfig

PUBLISHED_LABELS = "github.com/zihangJiang/TokenLabeling's ImageNet label maps"
"""Where the published token labels come from (docs/token-labels.md)."""
RESERVE_BYTES = 1.0 * memory.GIB
"""GPU memory the plan leaves free: CUDA context, cuDNN/cuBLAS workspaces, fragmentation."""
PLAN_MARGIN = 1.15
"""The plan's total is multiplied by this: on an H100 the measured peak of a bf16 AdamW step was
7-11% above the plan (benchmarks/results/gpu_h100.json: autocast's cached bf16 weight copies and
allocator rounding, which the plan does not count)."""


# --------------------------------------------------------------------------- static checks


def node_count(value: int | str | None, profile: Profile, stage: str, name: str = "NODES") -> int:
    """NODES (default: the stage partition's `nodes`), at most the nodes the partition has.
    `name`: the variable errors name (a pipeline's fine-tune: FT_NODES)."""
    part = profile.partition(stage)
    nodes = whole_number(value, name, part.nodes)
    if profile.scheduler == "local" and nodes != 1:
        raise ConfigError(f"{name}={nodes}: profile {profile.name} runs on this machine; use 1")
    if nodes > part.node_limit:
        raise ConfigError(
            f"{name}={nodes}: partition {part.name!r} ({stage}) has {part.node_limit} node(s) in "
            f"profile {profile.name}; use {name}={part.node_limit} or fewer"
        )
    return nodes


def memory_fit(
    cfg: TrainConfig, node: NodeType, world: int, stage: str, partition: str
) -> dict[str, Any]:
    """Predicted peak bytes per GPU for this micro-batch; ConfigError when it does not fit,
    naming the largest micro-batch that does."""
    if not node.gpus_per_node or node.gpu is None:
        return {"checked": False, "reason": f"partition {partition} has no GPU memory to fit"}
    if not models.known(cfg.model):
        return {"checked": False, "reason": f"{cfg.model} is not in the model registry"}
    mesh = cfg.dims
    settings: dict[str, Any] = {
        "model": cfg.model,
        "img_size": cfg.img_size,
        "precision": _precision(cfg),
        "amp_dtype": cfg.amp_dtype if cfg.use_amp else None,
        "zero": cfg.zero_stage if cfg.engine == "deepspeed" else 0,
        "gpus": world,
        "num_classes": cfg.num_classes or 1000,
        "token_label": cfg.token_label,
    }
    if cfg.engine in MESH_ENGINES:
        settings.update(mesh=mesh, fsdp=cfg.fsdp, micro_batches=cfg.accum_steps)
    need = memory.estimate(batch=cfg.batch_size, **settings).total * PLAN_MARGIN
    capacity = node.gpu.memory_bytes
    largest = memory.max_micro_batch((capacity - RESERVE_BYTES) / PLAN_MARGIN, 0, **settings)
    record = {
        "checked": True,
        "gpu": node.gpu.model,
        "capacity_bytes": capacity,
        "reserve_bytes": RESERVE_BYTES,
        "plan_margin": PLAN_MARGIN,
        "predicted_peak_bytes": need,
        "micro_batch": cfg.batch_size,
        "largest_micro_batch": largest,
        "settings": {k: (v.as_dict() if k == "mesh" else v) for k, v in settings.items()},
    }
    if need + RESERVE_BYTES <= capacity:
        return record
    gib = memory.GIB
    fix = (
        f"use -b {largest} (with --accum-steps to keep the global batch)"
        if largest
        else "not even the model states fit"
    )
    fix += _layout_hint(cfg, node, world, capacity)
    raise ConfigError(
        f"-b {cfg.batch_size}: the batch does not fit in GPU memory: {cfg.model} at "
        f"{cfg.img_size} px ({settings['precision']}) needs {need / gib:.1f} GiB per GPU for the "
        f"{stage} stage, but a {node.gpu.model} on partition {partition} has "
        f"{capacity / gib:.1f} GiB ({RESERVE_BYTES / gib:.0f} GiB kept free); {fix}"
    )


def check_layout(cfg: TrainConfig, node: NodeType, world: int) -> None:
    """dp x tp x pp must divide the job's ranks, and tensor parallelism stay inside a node."""
    try:
        layout.check_layout(world, node.ranks_per_node, cfg.tp, cfg.pp, cfg.model)
    except ValueError as exc:
        raise ConfigError(f"ARGS: {exc}") from None


def _layout_hint(cfg: TrainConfig, node: NodeType, world: int, capacity: float) -> str:
    """The cheapest dp x tp x pp (+FSDP) layout that fits, from the cost model and the plan."""
    if not models.known(cfg.model) or isinstance(models.arch_of(cfg.model), models.Volo):
        return ""
    try:
        best = layout.suggest_layouts(
            cfg.model, world, node.fabric_model(), (capacity - RESERVE_BYTES) / PLAN_MARGIN,
            cfg.global_batch_size, micro_batches=cfg.accum_steps, img_size=cfg.img_size,
            precision=_precision(cfg), reserve_bytes=0, num_classes=cfg.num_classes or 1000,
        )  # fmt: skip
    except ValueError:
        return ""
    return f"; or keep the batch with {' '.join(best.flags())} (the cheapest layout that fits)"


def _precision(cfg: TrainConfig) -> str:
    if cfg.engine == "deepspeed" and cfg.use_amp:
        return "half"  # DeepSpeed bf16/fp16: half weights and gradients, fp32 master copy
    return "amp" if cfg.use_amp else "fp32"


# --------------------------------------------------------------------------- cluster checks


RUN_ROOT_FREE_BYTES = int(float(os.environ.get("VITPOD_MIN_FREE_GIB", "1")) * memory.GIB)
"""Free space the run root must have (VITPOD_MIN_FREE_GIB, default 1 GiB): logs, checkpoints."""


def check(
    plan: Planned, render_hint: str | None = None, chained: bool = False,
    labels_pending: bool = False, offline: bool = False,
) -> list[str]:  # fmt: skip
    """Every check that needs the cluster or its file systems; ConfigError lists what fails.

    Returns the checks made, for the manifest and `make preflight`. Called before anything is
    written or submitted (make pretrain/finetune/pipeline/scaling, Chain.plan/submit).
    `chained`: the finetune source is the pipeline's own pretrain, which exists once it ends.
    `offline` (render/preflight only): skip what asks Slurm, and say so. Slurm is asked on the
    profile's cluster (-M) when it names one.
    """
    with slurm.on_cluster(plan.spec.profile.cluster or slurm.current_cluster()):
        return _check(plan, render_hint, chained, labels_pending, offline)


def _check(
    plan: Planned, render_hint: str | None, chained: bool, labels_pending: bool, offline: bool
) -> list[str]:
    spec = plan.spec
    check_ranks_per_gpu(plan)
    done: list[str] = []
    if spec.profile.scheduler == "slurm" and offline:
        done.append(
            "OFFLINE: Slurm not asked (partition, nodes, GPUs, memory, CPUs, account, "
            "sbatch --test-only)"
        )
        if spec.profile.mpi:
            done.append(f"mpi: --mpi={spec.profile.mpi} NOT CHECKED (offline: srun --mpi=list)")
    elif spec.profile.scheduler == "slurm":
        if shutil.which("sbatch") is None:
            hint = render_hint or f"make render CLUSTER={spec.profile.name} MODEL={spec.model}"
            raise ConfigError(
                "sbatch is not on PATH (this is not a Slurm login node). To only write the "
                f"script, run `{hint}` and submit it from a login node with `sbatch <script>`"
            )
        done += slurmchecks.check_partition(plan)
        done += slurmchecks.check_account(spec)
        done += slurmchecks.check_mpi(spec)
        done += slurmchecks.check_test_only(spec, plan.script)
    problems = path_problems(plan, chained, labels_pending)
    container_problems, container_done = containerpreflight.check(spec.profile)
    if problems or container_problems:
        raise ConfigError("; ".join(problems + container_problems))
    done.append("paths exist: data, code, token-label data, finetune source, image")
    done.append(check_run_root(Path(spec.run_dir).parent))
    done.append(shared_run_root(spec, offline))
    if spec.profile.scheduler == "slurm":
        done.append(shared_code_dir(spec, offline))
    done.append(check_grace(plan))
    return done + container_done


def check_ranks_per_gpu(plan: Planned) -> None:
    """More ranks than GPUs on a node: ranks would share a GPU, which NCCL refuses."""
    spec = plan.spec
    if spec.gpus_per_node and spec.tasks_per_node > spec.gpus_per_node:
        node_type = plan.profile.partition(spec.stage).node_type
        raise ConfigError(
            f"profile {spec.profile.name}: node_types.{node_type}.tasks_per_node="
            f"{spec.tasks_per_node} exceeds gpus_per_node={spec.gpus_per_node} (ranks would "
            f"share a GPU, which NCCL refuses); set tasks_per_node to {spec.gpus_per_node} or less"
        )


def shared_run_root(spec: JobSpec, offline: bool = False) -> str:
    """A multi-node job's run root must be on a shared file system type
    (workflows/jobs/sharedfs.py), unless it is at or below a path `make profile` tested
    (`storage.shared_paths`) or the profile says `storage.shared: true`; offline: NOT CHECKED."""
    nodes = max(spec.nodes, spec.nodes_max or 0)
    return sharedfs.check_run_root(
        Path(spec.run_dir).parent, nodes, shared=spec.profile.storage.shared,
        profile=spec.profile.name, offline=offline,
        shared_paths=spec.profile.storage.shared_paths,
    )  # fmt: skip


def shared_code_dir(spec: JobSpec, offline: bool = False) -> str:
    """The code checkout every rank runs from (and a container mounts): the run root's check."""
    nodes = max(spec.nodes, spec.nodes_max or 0)
    return sharedfs.check_code_dir(
        Path(spec.code_dir), nodes, shared=spec.profile.storage.shared,
        profile=spec.profile.name, offline=offline,
        shared_paths=spec.profile.storage.shared_paths,
    )  # fmt: skip


def check_run_root(root: Path, need: int = 0) -> str:
    """The run root (or its nearest existing parent) is writable and has `need` bytes free."""
    need = need or RUN_ROOT_FREE_BYTES
    base = root
    while not base.exists() and base != base.parent:
        base = base.parent
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(
            f"run root {root}: {base} is not writable by you; fix storage.runs (or --run-root)"
        )
    free = shutil.disk_usage(base).free
    gib = memory.GIB
    if free < need:
        raise ConfigError(
            f"run root {root}: {free / gib:.2f} GiB free, below {need / gib:.2f} GiB; free space "
            f"or point storage.runs (or --run-root) elsewhere (VITPOD_MIN_FREE_GIB sets the floor)"
        )
    return f"run root {root}: writable, {free / gib:.1f} GiB free"


def path_problems(plan: Planned, chained: bool = False, labels_pending: bool = False) -> list[str]:
    """Paths the ranks will read, checked from here (shared storage: same paths everywhere).
    `labels_pending`: a labeling job queued ahead of this one makes the token labels."""
    spec, cfg = plan.spec, plan.trainer or {}
    name = spec.profile.name
    out = []
    for field, path in (("storage.data", spec.data_dir), ("storage.code", spec.code_dir)):
        if path is not None and not Path(path).exists():
            out.append(
                f"profile {name}: {field} path {path!r} does not exist; create it on the shared "
                f"file system (or fix the profile) before submitting"
            )
    if not labels_pending:
        out += token_label_problems(plan)
    if spec.finetune_from and not (chained or spec.dependency):
        problem = finetune_source_problem(spec.finetune_from)
        if problem:
            out.append(problem)
    for flag in ("deepspeed_config", "resume"):
        value = cfg.get(flag)
        if value and value not in ("auto", "none") and not Path(value).exists():
            out.append(f"--{flag.replace('_', '-')} {value}: no such file; pass an existing path")
    out += image_problems(spec.profile)
    out += mount_problems(plan)
    return out


def token_label_problems(plan: Planned) -> list[str]:
    """Token labels the stage will read must exist, be complete, be for this data set (sample
    count and names checksum) and have the stage's grid (img_size/16); each problem ends with
    the command that makes the right ones."""
    cfg = plan.trainer or {}
    labels = cfg.get("token_label_data")
    if not (cfg.get("token_label") and labels):
        return []
    spec = plan.spec
    make = (
        f"make token-labels CLUSTER={spec.profile.name} MODEL={spec.model} STAGE={spec.stage} "
        f"TEACHER=<run dir, or timm name with TEACHER_CKPT=file>"
        + (f' ARGS="--label-dir {labels}"' if _custom_label_dir(plan, labels) else "")
    )
    path = Path(labels)
    if not path.exists():
        return [f"token-label data {labels!r} does not exist; make it with `{make}`, or pass "
                f"TokenLabeling's published labels ({PUBLISHED_LABELS}, as downloaded) with "
                'ARGS="--token-label-data DIR"']  # fmt: skip
    if path.is_file():
        return []  # a single file from generate_token_labels: the trainer checks it on open
    data_dir = cfg.get("data_dir")
    if labellayout.layout_of(path) == labelset.PUBLISHED:  # TokenLabeling's files: no manifest
        where = f"token-label data {labels!r}"
        return labellayout.published_problems(path, where=where, data_dir=data_dir)
    names = None
    if data_dir and Path(data_dir, "train").is_dir():
        names = labelset.folder_names(data_dir)
    found = labelset.problems(
        labelset.read_manifest(path), where=f"token-label data {labels!r}", names=names,
        data_dir=data_dir, img_size=int(cfg.get("img_size") or 0),
    )  # fmt: skip
    if found and labelset.read_manifest(path) is not None:  # never overwrite labels that exist
        make = make.split(" ARGS=")[0] + ' ARGS="--label-dir <new dir>"'
        return [f"{p}; make the right ones with `{make}` and pass --token-label-data <new dir>"
                for p in found]  # fmt: skip
    return [f"{p}; make the right ones with `{make}`" for p in found]


def _custom_label_dir(plan: Planned, labels: str) -> bool:
    """Whether ARGS chose the label directory (make token-labels must then be told it too)."""
    default = _recipe_label_dir(plan)
    return default is None or Path(labels) != default


def _recipe_label_dir(plan: Planned) -> Path | None:
    stage = plan.recipe.stage(plan.spec.stage)
    if not stage.token_label_data:
        return None
    return resolve_path(plan.profile.storage.data) / stage.token_label_data


def image_problems(profile: Profile) -> list[str]:
    """What pyxis would find wrong only on the node: the .sqsh and the mount sources."""
    try:
        check_container_paths(profile)
    except ConfigError as exc:
        return [str(exc)]
    return []


def mount_problems(plan: Planned) -> list[str]:
    """Data and token-label directories a container rank reads must lie under a mount's dst
    (or the run's own tree, which is mounted): outside, the rank finds nothing on the node."""
    container = plan.profile.container
    if container is None:
        return []
    cfg = plan.trainer or {}
    dsts = [Path(host_path(m.dst)) for m in container.mounts]
    reads = (("DATA_DIR", plan.spec.data_dir), ("--token-label-data", cfg.get("token_label_data")))
    out = []
    for what, value in reads:
        if not value:
            continue
        path = Path(host_path(str(value)))
        if not any(path == d or d in path.parents for d in dsts):
            out.append(
                f"{what} {value} is outside every container.mounts dst of profile "
                f"{plan.profile.name} (the rank would not see it on the node); add a mount "
                f"{{src: {path}, dst: {path}}} or move it under storage.data"
            )
    return out
