"""Trainer configuration: grouped timm/VOLO-style flags and YAML -> one typed dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitpod.registry import models, runfiles


class ConfigError(ValueError):
    """A bad flag or config key; the message names the flag and the fix."""


def _arg(group: str, help: str, *flags: str, **kwargs: Any) -> dict[str, Any]:
    return {"group": group, "help": help, "flags": flags, **kwargs}


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs; field names are the YAML keys."""

    # Data
    data_dir: str | None = field(default=None, metadata=_arg("data", "dataset root"))
    dataset: str = field(
        default="folder",
        metadata=_arg(
            "data",
            "data source",
            choices=("folder", "cifar10", "cifar100", "digits", "synthetic", "shards"),
        ),
    )
    loader: str = field(
        default="auto", metadata=_arg("data", "loader", choices=("dali", "torch", "auto"))
    )
    workers: int = field(
        default=4, metadata=_arg("data", "loader workers per rank", "-j", "--workers")
    )
    img_size: int = field(default=224, metadata=_arg("data", "input image size (pixels)"))
    crop_pct: float | None = field(
        default=None, metadata=_arg("data", "eval crop ratio (model default)")
    )
    num_classes: int | None = field(
        default=None,
        metadata=_arg("data", "number of classes (default: counted from the data set; given: "
                      "must match it)"),
    )  # fmt: skip
    aa: str | None = field(
        default="rand-m9-mstd0.5-inc1", metadata=_arg("data", "RandAugment policy ('' = off)")
    )
    scale: tuple[float, float] = field(
        default=(0.08, 1.0), metadata=_arg("data", "random-resized-crop area range", nargs=2)
    )
    reprob: float = field(default=0.25, metadata=_arg("data", "random-erase (CutOut) probability"))
    hflip: float = field(default=0.5, metadata=_arg("data", "horizontal flip probability"))
    corrupt: str = field(
        default="skip", metadata=_arg("data", "corrupt images", choices=("skip", "fail"))
    )
    token_label: bool = field(default=False, metadata=_arg("data", "token labeling with MixToken"))
    token_label_size: int | None = field(
        default=None, metadata=_arg("data", "token-label grid size (must be img_size/16)")
    )
    token_label_data: str | None = field(
        default=None, metadata=_arg("data", "token-label directory")
    )
    ground_truth: bool = field(
        default=False, metadata=_arg("data", "add the ground-truth class loss")
    )
    # Model
    model: str = field(default="volo_d1", metadata=_arg("model", "volo_d1..d5, volo_tiny, vit_*"))
    drop_path: float | None = field(
        default=None, metadata=_arg("model", "stochastic depth (model default)")
    )
    finetune: str | None = field(
        default=None, metadata=_arg("model", "checkpoint file/dir or run dir")
    )
    channels_last: bool | None = field(
        default=None, metadata=_arg("model", "NHWC (default: on; NCHW with --fsdp, --deepspeed)")
    )
    compile: bool = field(default=False, metadata=_arg("model", "torch.compile the model"))
    attn: str = field(
        default="auto",
        metadata=_arg(
            "model", "attention kernel (auto: explicit under autocast on CPU, else fused)",
            choices=("auto", "fused", "math"),
        ),
    )  # fmt: skip
    # Precision
    amp: bool = field(default=False, metadata=_arg("precision", "torch.amp autocast"))
    apex_amp: bool = field(default=False, metadata=_arg("precision", "accepted; means torch.amp"))
    amp_dtype: str = field(
        default="bf16", metadata=_arg("precision", "autocast dtype", choices=("bf16", "fp16"))
    )
    # Optimizer and schedule
    opt: str = field(
        default="adamw", metadata=_arg("optim", "optimizer", choices=("adamw", "lamb"))
    )
    batch_size: int = field(
        default=64, metadata=_arg("optim", "batch per rank", "-b", "--batch-size")
    )
    global_batch: int | None = field(
        default=None, metadata=_arg("optim", "global batch; sets -b = global/(ranks*accum)")
    )
    lr: float | None = field(
        default=None, metadata=_arg("optim", "absolute LR (wins over --lr-base)")
    )
    lr_base: float | None = field(
        default=None, metadata=_arg("optim", "LR at --lr-base-size (model default)")
    )
    lr_base_size: int = field(default=1024, metadata=_arg("optim", "global batch of --lr-base"))
    weight_decay: float = field(default=0.05, metadata=_arg("optim", "AdamW weight decay"))
    epochs: int = field(default=300, metadata=_arg("optim", "training epochs"))
    warmup_epochs: int = field(default=20, metadata=_arg("optim", "linear warmup epochs"))
    warmup_lr: float = field(default=1e-6, metadata=_arg("optim", "LR at the start of warmup"))
    min_lr: float = field(default=1e-5, metadata=_arg("optim", "cosine floor"))
    smoothing: float = field(default=0.1, metadata=_arg("optim", "label smoothing"))
    clip_grad: float | None = field(
        default=None, metadata=_arg("optim", "clip grad norm (off if unset)")
    )
    accum_steps: int = field(default=1, metadata=_arg("optim", "micro-batches per optimizer step"))
    max_steps: int | None = field(
        default=None, metadata=_arg("optim", "stop after N optimizer steps")
    )
    # Parallelism
    topology: str = field(
        default="auto", metadata=_arg("parallel", "gradient path", choices=("ring", "ps", "auto"))
    )
    ps_servers: int | None = field(
        default=None,
        metadata=_arg("parallel", "parameter-server ranks (default: plan.json's, else 1)"),
    )
    deepspeed: bool = field(default=False, metadata=_arg("parallel", "train with DeepSpeed"))
    deepspeed_config: str | None = field(default=None, metadata=_arg("parallel", "DeepSpeed JSON"))
    zero_stage: int = field(
        default=1, metadata=_arg("parallel", "ZeRO stage 0-3 (generated config)")
    )
    fsdp: bool = field(
        default=False, metadata=_arg("parallel", "FSDP2 full sharding (ZeRO-3) over the dp ranks")
    )
    reshard_after_forward: bool = field(
        default=True,
        metadata=_arg("parallel", "FSDP2: free gathered weights after forward (ZeRO-3)"),
    )
    tp: int = field(default=1, metadata=_arg("parallel", "tensor-parallel ranks (within a node)"))
    pp: int = field(default=1, metadata=_arg("parallel", "pipeline stages"))
    pp_schedule: str = field(
        default="1f1b", metadata=_arg("parallel", "pipeline schedule", choices=("1f1b", "gpipe"))
    )
    # Run
    output: str = field(default="runs/train", metadata=_arg("run", "run directory"))
    resume: str = field(default="auto", metadata=_arg("run", "auto | none | checkpoint path"))
    checkpoint_every: int = field(
        default=500, metadata=_arg("run", "checkpoint every N steps (0 = epoch ends)")
    )
    keep_last: int = field(default=3, metadata=_arg("run", "checkpoints kept (plus milestones)"))
    milestone_every: int = field(
        default=50,
        metadata=_arg(
            "run",
            "also keep the checkpoints at the end of epochs N, 2N, ... "
            "(epochs counted from 1; 0 = none)",
        ),
    )
    eval: bool = field(default=True, metadata=_arg("run", "evaluate on the val split"))
    log_interval: int = field(default=50, metadata=_arg("run", "metrics line every N steps"))
    # Experiment tracking (timm train.py's --log-wandb); rank 0 only, see trainer/metrics.py.
    log_wandb: bool = field(
        default=False,
        metadata=_arg("run", "also log metrics and config to Weights & Biases (rank 0)"),
    )
    wandb_project: str | None = field(
        default=None, metadata=_arg("run", "W&B project (default: $WANDB_PROJECT, else vitpod)")
    )
    wandb_entity: str | None = field(
        default=None, metadata=_arg("run", "W&B entity (default: $WANDB_ENTITY)")
    )
    wandb_name: str | None = field(
        default=None,
        metadata=_arg("run", "W&B run name (default: $WANDB_NAME, else the run directory name)"),
    )
    warmup_steps_excluded: int = field(
        default=5, metadata=_arg("run", "steps left out of throughput")
    )
    seed: int = field(default=42, metadata=_arg("run", "random seed"))
    config: str | None = field(default=None, metadata=_arg("run", "YAML file of these keys"))
    print_config: bool = field(
        default=False, metadata=_arg("run", "print resolved config and exit")
    )
    # Resolved at startup (not flags).
    world_size: int = field(default=1, metadata={"derived": True})

    @property
    def use_amp(self) -> bool:
        return self.amp or self.apex_amp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: world / (tp x pp) (each model replica spans tp x pp ranks)."""
        return max(1, self.world_size // max(1, self.tp * self.pp))

    @property
    def uses_mesh(self) -> bool:
        """FSDP2, tensor or pipeline parallelism: the DeviceMesh engine, not DDP/DeepSpeed."""
        return self.fsdp or self.tp > 1 or self.pp > 1

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.accum_steps * self.dp_size

    def to_json(self) -> str:
        return json.dumps(
            {**dataclasses.asdict(self), "global_batch_size": self.global_batch_size}, indent=2
        )


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if not f.metadata.get("derived")]


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("tuple[float", float)):
        if text.startswith(name):
            return kind
    return str


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one message naming the flag) instead of exiting, so a
    login node's planner refuses a bad flag before anything is written or submitted."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise ConfigError(f"{message}; see `python -m vitpod.trainer --help` for the valid flags")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m vitpod.trainer",
        description="Train a timm VOLO/ViT model on every rank.",
        allow_abbrev=False,  # a misspelt flag is an error, never silently another flag
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _cli_fields():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        if f.name == "data_dir":
            group.add_argument("data_dir", nargs="?", default=None, help=meta["help"])
            continue
        flags = meta["flags"] or (flag_name(f),)
        kind = _field_type(f)
        if kind is bool:
            action = argparse.BooleanOptionalAction
            group.add_argument(
                *flags, dest=f.name, action=action, default=f.default, help=meta["help"]
            )
        else:
            group.add_argument(
                *flags, dest=f.name, type=kind, default=f.default, choices=meta.get("choices"),
                nargs=meta.get("nargs"), help=meta["help"],
            )  # fmt: skip
    return parser


def _yaml_defaults(path: str) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file; pass a YAML file of trainer keys")
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values")
    valid = {f.name for f in _cli_fields()} - {"config", "print_config"}
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {unknown}; valid keys: {sorted(valid)}")
    return data


def parse_args(argv: list[str] | None = None, world_size: int = 1) -> TrainConfig:
    """Parse flags (YAML first, flags win), fill model defaults; raises ConfigError on bad input."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**_yaml_defaults(pre.config))
    ns = parser.parse_args(argv)
    cfg = TrainConfig(**vars(ns), world_size=world_size)
    return resolve(cfg)


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill recipe defaults, the per-rank batch from --global-batch, and the LR."""
    defaults = model_defaults(cfg.model)
    for name in ("drop_path", "crop_pct", "lr_base"):
        if getattr(cfg, name) is None:
            setattr(cfg, name, defaults[name])
    if cfg.token_label and cfg.token_label_size is None:
        cfg.token_label_size = cfg.img_size // 16
    if cfg.global_batch is not None:
        ranks = cfg.dp_size * cfg.accum_steps
        if cfg.global_batch % ranks:
            raise ConfigError(
                f"--global-batch {cfg.global_batch} does not divide over {cfg.dp_size} dp rank(s)"
                f" x --accum-steps {cfg.accum_steps}; pick a multiple of {ranks}"
            )
        cfg.batch_size = cfg.global_batch // ranks
    if cfg.lr is None:
        cfg.lr = (cfg.lr_base or defaults["lr_base"]) * cfg.global_batch_size / cfg.lr_base_size
    if cfg.apex_amp:
        cfg.amp = True
    return cfg


def model_defaults(model: str) -> dict[str, float]:
    """drop_path, crop_pct and lr_base of a registered model; timm's train.py defaults else."""
    if models.known(model):
        info = models.get(model)
        return {"drop_path": info.drop_path, "crop_pct": info.crop_pct, "lr_base": info.lr_base}
    return {"drop_path": 0.1, "crop_pct": 0.875, "lr_base": 1e-3}


def known_model(name: str) -> bool:
    """In the registry, or a timm ViT name (checked against timm where timm is installed: a
    login node without timm accepts the name and the job's own check refuses a wrong one)."""
    if models.known(name):
        return True
    if not name.startswith("vit_"):
        return False
    try:
        import timm
    except ImportError:
        return True
    return name in timm.list_models("vit_*")


def problems(cfg: TrainConfig, for_training: bool = True) -> list[str]:
    """Every inconsistency in cfg, each naming its flag and the fix (empty list = valid)."""
    out: list[str] = []
    if not known_model(cfg.model):
        out.append(
            f"--model {cfg.model}: unknown; use volo_d1..volo_d5, volo_tiny or a timm vit_* name"
        )
    if cfg.img_size <= 0 or cfg.img_size % 16:
        out.append(f"--img-size {cfg.img_size}: must be a positive multiple of 16")
    if cfg.token_label:
        expected = cfg.img_size // 16
        if cfg.token_label_size != expected:
            out.append(
                f"--token-label-size {cfg.token_label_size} does not match --img-size"
                f" {cfg.img_size} / 16 = {expected}; pass --token-label-size {expected} or omit it"
            )
        if not cfg.model.startswith("volo"):
            out.append(f"--token-label needs a VOLO model, not --model {cfg.model}")
    for name in (
        "batch_size",
        "accum_steps",
        "epochs",
        "num_classes",
        "lr_base_size",
        "ps_servers",
    ):
        value = getattr(cfg, name)
        if value is not None and value < 1:  # num_classes None: counted from the data later
            out.append(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.lr is not None and cfg.lr <= 0:
        out.append(f"--lr {cfg.lr}: must be positive")
    if cfg.warmup_epochs < 0 or cfg.warmup_epochs >= cfg.epochs and cfg.warmup_epochs > 0:
        out.append(f"--warmup-epochs {cfg.warmup_epochs}: must be in [0, --epochs {cfg.epochs})")
    if cfg.topology == "ps" and (cfg.ps_servers or 1) > cfg.world_size:
        out.append(
            f"--ps-servers {cfg.ps_servers} exceeds the {cfg.world_size} rank(s); use at most that"
        )
    if cfg.deepspeed and cfg.topology == "ps":
        out.append("--deepspeed and --topology ps both choose the gradient path; drop one")
    if not 0 <= cfg.zero_stage <= 3:
        out.append(f"--zero-stage {cfg.zero_stage}: must be 0, 1, 2 or 3")
    out += _mesh_problems(cfg)
    if cfg.resume not in ("auto", "none") and for_training and not os.path.exists(cfg.resume):
        out.append(f"--resume {cfg.resume}: no such checkpoint; use auto, none or an existing path")
    if for_training:
        out += _path_problems(cfg)
    if cfg.log_wandb and for_training and importlib.util.find_spec("wandb") is None:
        out.append(
            "--log-wandb: the wandb package is not installed in this environment; install it "
            "(pip install wandb, part of vitpod's [train] extra) or drop --log-wandb"
        )
    if cfg.finetune:
        out += _finetune_problems(cfg)
    return out


def _mesh_problems(cfg: TrainConfig) -> list[str]:
    """A layout the mesh cannot hold, named by its flag (the GPUs-per-node check is the planner's:
    vitpod.analysis.layout.check_layout; here only what one job's world size decides)."""
    out: list[str] = []
    for name in ("tp", "pp"):
        if getattr(cfg, name) < 1:
            out.append(f"--{name} {getattr(cfg, name)}: must be at least 1")
    if out:
        return out
    if cfg.world_size % (cfg.tp * cfg.pp):
        out.append(
            f"--tp {cfg.tp} x --pp {cfg.pp} = {cfg.tp * cfg.pp} does not divide the"
            f" {cfg.world_size} rank(s); pick tp x pp dividing the world size"
        )
    if cfg.uses_mesh and cfg.deepspeed:
        out.append("--deepspeed and --fsdp/--tp/--pp both shard the model; drop one")
    if cfg.uses_mesh and cfg.topology == "ps":
        out.append("--topology ps applies to DDP only; drop it with --fsdp/--tp/--pp")
    if (cfg.tp > 1 or cfg.pp > 1) and not cfg.model.startswith(("vit_", "volo")):
        out.append(f"--tp/--pp: no parallel plan for --model {cfg.model}; use a vit_* or volo_*")
    if cfg.pp > 1 and not cfg.model.startswith("vit_"):
        out.append(f"--pp {cfg.pp}: pipeline stages are defined for vit_* models; use --tp/--fsdp")
    if cfg.pp > 1 and cfg.accum_steps < cfg.pp and (cfg.batch_size * cfg.accum_steps) % cfg.pp:
        out.append(
            f"--pp {cfg.pp} with --accum-steps {cfg.accum_steps}: the step's batch"
            f" ({cfg.batch_size} x {cfg.accum_steps}) is split into {cfg.pp} micro-batches and must"
            f" divide by it; pass -b a multiple of {cfg.pp} or --accum-steps {cfg.pp}"
        )
    if cfg.pp > 1 and cfg.token_label:
        out.append("--token-label with --pp: the token-label loss is not staged; drop one")
    return out


def _finetune_problems(cfg: TrainConfig) -> list[str]:
    """A saved model's manifest names its architecture: refuse another before any rank starts."""
    path = Path(cfg.finetune or "")
    for manifest in (path / runfiles.FINAL / runfiles.MANIFEST, path.parent / runfiles.MANIFEST,
                     path / runfiles.MANIFEST):  # fmt: skip
        if manifest.is_file():
            saved = json.loads(manifest.read_text()).get("model")
            if saved and saved != cfg.model:
                return [f"--finetune {cfg.finetune}: checkpoint is a {saved}, not --model "
                        f"{cfg.model}; pass --model {saved} or another checkpoint"]  # fmt: skip
            return []
    return []


def _path_problems(cfg: TrainConfig) -> list[str]:
    out: list[str] = []
    needs_dir = cfg.dataset in ("folder", "shards")
    if needs_dir and not cfg.data_dir:
        out.append("DATA_DIR missing: pass the dataset root as the first argument")
    elif needs_dir and not os.path.isdir(str(cfg.data_dir)):
        out.append(f"DATA_DIR {cfg.data_dir}: no such directory; pass the dataset root")
    checks = (
        ("token_label_data", cfg.token_label and cfg.dataset == "folder"),
        ("finetune", cfg.finetune is not None),
        ("deepspeed_config", cfg.deepspeed_config is not None),
    )
    for name, needed in checks:
        value = getattr(cfg, name)
        if needed and (not value or not os.path.exists(value)):
            out.append(f"--{name.replace('_', '-')} {value}: no such path; pass an existing one")
    return out
