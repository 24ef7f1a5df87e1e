"""Cluster profiles: typed, validated YAML describing one cluster's partitions, nodes and fabric."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from vitpod.workflows.containers.container import check_container_static
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile_checkpoint import Checkpointing
from vitpod.workflows.site.profile_container import Container
from vitpod.workflows.site.profile_files import (  # noqa: F401 (where profiles are found)
    PROFILE_DIR,
    bundled_profiles,
    known_profiles,
    profile_path,
    user_profile_dir,
    user_profiles,
)
from vitpod.workflows.site.profile_hang import Hang
from vitpod.workflows.site.profile_storage import Storage
from vitpod.workflows.site.schema import Strict, describe
from vitpod.workflows.slurm.quantities import slurm_minutes


def _base_dir() -> Path:
    """Where relative profile paths start: the checkout holding this code, else (an installed
    package on a login node) the directory the command runs in."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "pyproject.toml").is_file() else Path.cwd()


REPO_ROOT = _base_dir()
STAGES = ("pretrain", "finetune")
DEFAULT_MODEL = "volo_d1"  # when neither MODEL nor the profile's default_model is given
DEFAULT_NODE_TYPE = "default"
# A profile with one kind of node may give that node's fields at the top level.
NODE_FIELDS = (
    "gpus_per_node",
    "tasks_per_node",
    "cpus_per_node",
    "mem",
    "gpu",
    "binding",
    "fabric",
)

_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# KEY, TOKEN, SECRET, PASS or CREDENTIAL anywhere; PAT only as a word part (GITHUB_PAT, not PATH).
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|(?<![A-Z])PAT(?![A-Z])", re.IGNORECASE)
_HCA = re.compile(r"^[A-Za-z0-9_]+:\d+$")
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
ROCE_ONLY_ENV = ("NCCL_IB_GID_INDEX", "NCCL_IB_ROCE_VERSION_NUM")
"""NCCL variables that only mean something on RoCE (the GID of RoCE v2, its version)."""


class Partition(Strict):
    """The Slurm partition a stage runs on: its limit, its kind of node and how many a job takes."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    time: str = Field(description="Slurm time limit: MM, HH:MM:SS or D-HH:MM:SS")
    node_type: str = Field(default=DEFAULT_NODE_TYPE, description="a key of node_types")
    nodes: int = Field(default=1, ge=1, description="nodes a job of this stage takes (NODES=)")
    max_nodes: int | None = Field(
        default=None, ge=1, description="nodes in the partition (default: nodes)"
    )
    nodes_max: int | None = Field(
        default=None, ge=1, description="`nodes: MIN-MAX`: the job starts on MIN to MAX nodes"
    )

    @property
    def node_limit(self) -> int:
        return self.max_nodes or self.nodes_max or self.nodes

    @model_validator(mode="before")
    @classmethod
    def _node_range(cls, data: Any) -> Any:
        """`nodes: 2-8` -> nodes 2, nodes_max 8: Slurm starts the job on what it can give."""
        if isinstance(data, dict) and isinstance(data.get("nodes"), str) and "-" in data["nodes"]:
            low, _, high = data["nodes"].partition("-")
            if not (low.strip().isdigit() and high.strip().isdigit()):
                raise ValueError(f"nodes={data['nodes']!r}: write a count or a range MIN-MAX")
            data = {**data, "nodes": int(low), "nodes_max": int(high)}
        return data

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not _SLURM_TIME.match(value):
            raise ValueError(f"{value!r} is not a Slurm time; write HH:MM:SS or D-HH:MM:SS")
        return value


class Gpu(Strict):
    """The accelerator model, and its memory for the memory planner."""

    model: str
    memory_bytes: int = Field(ge=0)


class Binding(Strict):
    """Where one local rank runs: its GPU's NUMA node, that node's CPUs, the nearest HCA."""

    local_rank: int = Field(ge=0)
    numa: int = Field(ge=0)
    cpus: str | None = None
    hca: str | None = None

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, value: str | None) -> str | None:
        if value is not None and not _CPU_LIST.match(value):
            raise ValueError(f"{value!r} is not a CPU list; write e.g. '48-63,176-191'")
        return value

    @field_validator("hca")
    @classmethod
    def _hca_port(cls, value: str | None) -> str | None:
        if value is not None and not _HCA.match(value):
            raise ValueError(f"{value!r} is not DEVICE:PORT; write e.g. 'mlx5_0:1'")
        return value


class NodeType(Strict):
    """One kind of node: its GPUs, CPUs and memory, the per-rank binding map and the fabric."""

    gpus_per_node: int = Field(ge=0)
    tasks_per_node: int | None = Field(default=None, ge=1, description="default: gpus_per_node")
    cpus_per_node: int = Field(ge=1)
    mem: str = Field(default="0", pattern=r"^\d+[KMGT]?$", description="--mem; 0 = all of it")
    gpu: Gpu | None = None
    binding: list[Binding] = []
    fabric: dict[str, Any]

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def cpus_per_task(self) -> int:
        return max(1, self.cpus_per_node // self.ranks_per_node)

    @field_validator("fabric")
    @classmethod
    def _fabric(cls, block: dict[str, Any]) -> dict[str, Any]:
        from vitpod.analysis.fabric import Fabric  # pure arithmetic, no torch

        Fabric.from_mapping(block)
        return block

    @model_validator(mode="after")
    def _consistent(self) -> NodeType:
        if self.binding:
            ranks = sorted(b.local_rank for b in self.binding)
            if ranks != list(range(self.ranks_per_node)):
                raise ValueError(
                    f"binding: local ranks {ranks} must be exactly 0..{self.ranks_per_node - 1} "
                    f"(one entry per task on a node)"
                )
        if self.fabric.get("gpus_per_node") not in (None, self.ranks_per_node):
            raise ValueError(
                f"fabric.gpus_per_node={self.fabric['gpus_per_node']} disagrees with the "
                f"node's {self.ranks_per_node} ranks per node"
            )
        return self

    @property
    def network(self) -> str:
        """`fabric.network`: infiniband (default), roce or ethernet."""
        from vitpod.analysis.fabric import network

        return network(self.fabric)

    def fabric_model(self) -> Any:
        """The `vitpod.analysis.fabric.Fabric` of this node type (the topology choice uses it)."""
        from vitpod.analysis.fabric import Fabric

        return Fabric.from_mapping(self.fabric)

    def binding_for(self, local_rank: int) -> Binding | None:
        return next((b for b in self.binding if b.local_rank == local_rank), None)


class Preemption(Strict):
    """Signal sent before the time limit (never USR1: NCCL uses it) and whether to requeue."""

    signal: Literal["USR2", "TERM"] = "USR2"
    grace_s: int = Field(default=120, ge=10, le=65535)
    requeue: bool = True
    max_requeues_without_progress: int = Field(
        default=3, ge=0, le=1000,
        description="requeues in a row whose start wrote no new complete checkpoint, then stop",
    )  # fmt: skip
    mtbi_hours: float = Field(
        default=24.0, gt=0,
        description="mean hours between a job's interruptions when sacct has no history of them",
    )  # fmt: skip


class Profile(Strict):
    """One cluster. Field names are the YAML keys; `load_profile` reads and validates them."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    scheduler: Literal["slurm", "local"]
    cluster: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_-]+$",
        description="Slurm's ClusterName (sacctmgr list cluster) when one slurmdbd serves several "
        "clusters: every command then names it (-M); absent: SLURM_CONF's cluster",
    )  # fmt: skip
    partitions: dict[Literal["pretrain", "finetune"], Partition]
    node_types: dict[str, NodeType]
    container: Container | None = None
    storage: Storage
    env: dict[str, str] = {}
    secrets: list[str] = Field(default=[], description="names of variables passed, never values")
    mpi: Literal["pmix", "pmi2", "none"] | None = Field(
        default=None,
        description="srun --mpi=; absent: no --mpi (torch.distributed rendezvous needs no MPI)",
    )
    account: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    qos: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    preemption: Preemption = Preemption()
    checkpoint: Checkpointing = Checkpointing()
    hang: Hang = Hang()
    exclusive: bool = True
    backend: Literal["nccl", "gloo"] = "nccl"
    default_model: str | None = Field(default=None, description="recipe used when MODEL is empty")
    python: str | None = Field(default=None, description="interpreter when no container")
    doctor: bool = Field(
        default=False, description="check every node (vitpod.node.doctor) before training"
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_flat_node(cls, data: Any) -> Any:
        """The one-node-type shorthand (node fields at the top level) -> node_types.default;
        a top-level `nodes` is the default of every partition that names none."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        flat = {k: data.pop(k) for k in NODE_FIELDS if k in data}
        if flat and "node_types" in data:
            raise ValueError(
                f"{sorted(flat)}: give node fields either at the top level (one kind of node) "
                f"or under node_types, not both; move them into node_types.<name>"
            )
        if flat:
            data["node_types"] = {DEFAULT_NODE_TYPE: flat}
        nodes = data.pop("nodes", None)
        parts = data.get("partitions")
        if nodes is not None and isinstance(parts, dict):
            data["partitions"] = {
                k: ({"nodes": nodes, **v} if isinstance(v, dict) else v) for k, v in parts.items()
            }
        return data

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
            if _SECRET_NAME.search(name):
                raise ValueError(
                    f"{name!r} looks like a secret: never put its value in a profile; list the "
                    f"variable's NAME under `secrets:` and export it in your shell"
                )
        return env

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r}: list variable NAMES (e.g. WANDB_API_KEY), not values")
        return names

    @model_validator(mode="after")
    def _consistent(self) -> Profile:
        for stage, part in self.partitions.items():
            if part.node_type not in self.node_types:
                raise ValueError(
                    f"partitions.{stage}.node_type={part.node_type!r} is not a key of node_types "
                    f"{sorted(self.node_types)}; name one of them"
                )
            if part.nodes_max is not None and part.nodes_max < part.nodes:
                raise ValueError(f"partitions.{stage}: nodes MIN-MAX needs MIN <= MAX")
            if max(part.nodes, part.nodes_max or 0) > part.node_limit:
                raise ValueError(
                    f"partitions.{stage}: nodes={part.nodes}-{part.nodes_max} exceeds "
                    f"max_nodes={part.max_nodes}"
                )
        if self.scheduler == "local" and self.container is not None:
            raise ValueError("container: a local profile runs without a container; remove it")
        self._grace_below_limits()
        self._roce_env_on_roce()
        return self

    def _roce_env_on_roce(self) -> None:
        """RoCE-only variables in `env` (every stage's) need every node type on RoCE; vitpod sets
        them itself there (workflows/planning/spec.py ROCE_ENV)."""
        for name in ROCE_ONLY_ENV:
            if name not in self.env:
                continue
            for key, node in self.node_types.items():
                if node.network != "roce":
                    raise ValueError(
                        f"env.{name} is a RoCE setting but node_types.{key}.fabric.network is "
                        f"{node.network!r}; remove it from env (vitpod sets it on RoCE fabrics) "
                        f"or, if the fabric is RoCE, set fabric.network: roce"
                    )

    def _grace_below_limits(self) -> None:
        """Slurm signals grace_s before the time limit: at or above it every start would be
        signalled before its first step, and requeued again and again (time 0: no limit)."""
        grace = self.preemption.grace_s
        for stage, part in self.partitions.items():
            limit_s = slurm_minutes(part.time) * 60
            if self.scheduler == "slurm" and 0 < limit_s <= grace:
                raise ValueError(
                    f"preemption.grace_s={grace} is not below partitions.{stage}.time="
                    f"{part.time!r} ({limit_s} s): Slurm would signal every start before its "
                    f"first step; set preemption.grace_s below {limit_s} (a checkpoint save "
                    f"plus a margin) or raise partitions.{stage}.time"
                )

    def partition(self, stage: str) -> Partition:
        part = self.partitions.get(stage)  # type: ignore[call-overload]
        if part is None:
            raise ConfigError(
                f"profile {self.name}: partitions.{stage} is missing; add "
                f"`{stage}: {{name: <partition>, time: HH:MM:SS}}` under partitions"
            )
        return part  # type: ignore[no-any-return]

    def node_type(self, stage: str) -> NodeType:
        """The kind of node the stage's partition has (its GPUs, binding and fabric)."""
        return self.node_types[self.partition(stage).node_type]

    def model_for(self, model: str = "", fallback: str = DEFAULT_MODEL) -> str:
        """The recipe a job uses: MODEL when given, else default_model, else `fallback`."""
        return model or self.default_model or fallback


def resolve_path(value: str) -> Path:
    """A profile path as an absolute path; relative ones are relative to the repository."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (REPO_ROOT / path).resolve()


def read_yaml(path: Path, what: str) -> dict[str, Any]:
    """A YAML mapping, or a ConfigError naming the file."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def load_profile(name_or_path: str) -> Profile:
    """Read and validate a profile; any problem raises ConfigError naming the field and the fix."""
    path = profile_path(name_or_path)
    try:
        profile = Profile.model_validate(read_yaml(path, "profile"))
    except ValidationError as exc:
        raise describe(exc, f"profile {path}") from None
    try:
        check_container_static(profile)
    except ConfigError as exc:
        raise ConfigError(f"profile {path}: field {exc}") from None
    return profile
