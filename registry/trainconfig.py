"""The trainer's configuration schema (TrainConfig): every flag, its group, type and help.

Torch-free and in the registry: the planner resolves it into plan.json's `trainer` section,
the ranks build it back from there, and the readers of a run use the same fields.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from vitpod.registry.checkpoint_every import AUTO_BY_HAND, checkpoint_every_value
from vitpod.registry.engines import EngineName, claimed
from vitpod.registry.paralleldims import ParallelDims
from vitpod.registry.timmsettings import TimmSettings

SCHEDULES = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")
"""timm's schedules that are a function of the step count (its plateau steps on an epoch's
metric)."""
OUTLOOK_KERNELS = ("timm", "fused", "triton")  # --outlook-kernel (trainer/speed/outlook.py)


GROUPS = ("data", "model", "precision", "optim", "parallel", "run")


def ordered_fields() -> list[dataclasses.Field]:
    """TrainConfig's fields by GROUPS, in each vitpod's before timm's (TimmSettings, a base)."""
    timm = {f.name for f in dataclasses.fields(TimmSettings)}
    fields = dataclasses.fields(TrainConfig)
    order = {g: i for i, g in enumerate(GROUPS)}
    return sorted(fields, key=lambda f: (order.get(f.metadata.get("group", ""), len(GROUPS)),
                                         f.name in timm))  # fmt: skip


class ConfigError(ValueError):
    """A bad flag or config key; the message names the flag and the fix."""


def _arg(group: str, help: str, *flags: str, **kwargs: Any) -> dict[str, Any]:
    return {"group": group, "help": help, "flags": flags, **kwargs}


@dataclass(kw_only=True)
class TrainConfig(TimmSettings):
    """Everything one training run needs; field names are the YAML keys (timm's own settings:
    TimmSettings)."""

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
        default="auto", metadata=_arg("data", "loader", choices=("dali", "gpu", "torch", "auto"))
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
    drop_last: bool = field(
        default=False,
        metadata=_arg("data", "drop each epoch's partial last step, as timm's train loader does "
                      "(always with --pp or mixup/cutmix: they need full micro-batches)"),
    )  # fmt: skip
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
    initial_checkpoint: str | None = field(
        default=None, metadata=_arg("model", "weights of this exact model (timm's; strict load)")
    )
    grad_checkpointing: bool = field(
        default=False, metadata=_arg("model", "recompute blocks in backward (timm; not --pp)")
    )
    channels_last: bool | None = field(
        default=None, metadata=_arg("model", "NHWC (default: on; NCHW with --fsdp, --deepspeed)")
    )
    compile: str = field(
        default="auto",
        metadata=_arg("model", "torch.compile (auto: on with CUDA, off on CPU; bare flag = on); "
                      "caches in RUN_DIR/compile-cache", choices=("auto", "on", "off"),
                      nargs="?", const="on"),
    )  # fmt: skip
    outlook_kernel: str = field(
        default="timm",
        metadata=_arg("model", "VOLO outlook attention: timm's unfold/fold, the unfold-free "
                      "form or Triton kernels (CUDA)", choices=OUTLOOK_KERNELS),
    )  # fmt: skip
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
    fp8: bool = field(
        default=False,
        metadata=_arg("precision", "float8 Linear layers (torchao; GPUs of compute capability "
                      ">= 8.9)"),
    )  # fmt: skip
    amp_dtype: str = field(
        default="bf16", metadata=_arg("precision", "autocast dtype", choices=("bf16", "fp16"))
    )
    # Optimizer and schedule
    opt: str = field(
        default="adamw",
        metadata=_arg("optim", "optimizer: a name of timm.optim.list_optimizers() (adamw: torch's "
                      "fused AdamW, or apex's with apex on a GPU)"),
    )  # fmt: skip
    opt_eps: float | None = field(
        default=None, metadata=_arg("optim", "optimizer epsilon (the optimizer's default)")
    )
    opt_betas: tuple[float, ...] | None = field(
        default=None, metadata=_arg("optim", "optimizer betas (the optimizer's default)", nargs="+")
    )
    momentum: float = field(
        default=0.9, metadata=_arg("optim", "SGD-style momentum (optimizers that take one)")
    )
    layer_decay: float | None = field(
        default=None,
        metadata=_arg("optim", "layer-wise LR decay (timm's, by the model's group_matcher)"),
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
    min_lr: float = field(default=1e-5, metadata=_arg("optim", "LR floor of the schedule"))
    sched: str = field(
        default="cosine",
        metadata=_arg("optim", "LR schedule: " + ", ".join(SCHEDULES) + " (timm's, stepped per "
                      "optimizer update; per epoch with --no-sched-on-updates)"),
    )  # fmt: skip
    decay_epochs: float | None = field(
        default=None,
        metadata=_arg("optim", "step: epochs between LR decays (90); wsd/rsqrt: decay length "
                      "(fraction of the run if < 1; 0.2)"),
    )  # fmt: skip
    decay_milestones: tuple[int, ...] = field(
        default=(90, 180, 270), metadata=_arg("optim", "multistep: epochs of LR decay", nargs="+")
    )
    decay_rate: float = field(
        default=0.1, metadata=_arg("optim", "step/multistep: LR factor", "--decay-rate", "--dr")
    )
    smoothing: float = field(default=0.1, metadata=_arg("optim", "label smoothing"))
    # timm.data.Mixup: on when --mixup or --cutmix > 0 (SoftTargetCrossEntropy, --smoothing kept).
    mixup: float = field(default=0.0, metadata=_arg("optim", "mixup alpha (0 = off)"))
    cutmix: float = field(default=0.0, metadata=_arg("optim", "cutmix alpha (0 = off)"))
    mixup_prob: float = field(default=1.0, metadata=_arg("optim", "chance a batch is mixed"))
    mixup_switch_prob: float = field(
        default=0.5, metadata=_arg("optim", "chance of cutmix when both are on")
    )
    mixup_mode: str = field(
        default="batch", metadata=_arg("optim", "mix per", choices=("batch", "pair", "elem"))
    )
    model_ema: bool = field(
        default=False, metadata=_arg("optim", "keep an EMA of the weights (timm ModelEmaV3; DDP)")
    )
    model_ema_decay: float = field(default=0.9998, metadata=_arg("optim", "EMA decay"))
    clip_grad: float | None = field(
        default=None, metadata=_arg("optim", "clip gradients at this (off if unset)")
    )
    accum_steps: int = field(
        default=1,
        metadata=_arg("optim", "micro-batches per optimizer step", "--accum-steps",
                      "--grad-accum-steps"),
    )  # fmt: skip
    elastic: bool = field(
        default=False,
        metadata=_arg(
            "optim",
            "keep --global-batch on any world size: -b stays, --accum-steps = global/(dp x b)",
        ),
    )
    max_steps: int | None = field(
        default=None, metadata=_arg("optim", "stop after N optimizer steps")
    )
    # Parallelism
    exchange: str = field(
        default="auto",
        metadata=_arg(
            "parallel",
            "gradient exchange: ring all-reduce or parameter server (auto: "
            "the planner's cost model; --topology: its former name)",
            "--exchange",
            "--topology",
            choices=("ring", "ps", "auto"),
        ),  # fmt: skip
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
    checkpoint_every: int | str = field(
        default=500,
        metadata=_arg("run", "checkpoint every N steps (0 = epoch ends); auto: the planner's "
                      "interval sqrt(2 x save cost x mean time between interruptions)",
                      type=checkpoint_every_value),
    )  # fmt: skip
    keep_last: int = field(
        default=3,
        metadata=_arg("run", "checkpoints kept (plus milestones)", "--keep-last",
                      "--checkpoint-hist"),
    )  # fmt: skip
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
    log_sample_ids: bool = field(
        default=False,
        metadata=_arg("run", "each step record carries sample_digest (its global sample ids)"),
    )
    # Experiment tracking (timm train.py's --log-wandb); rank 0 only, see
    # trainer/telemetry/metrics.py.
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
    config: str | None = field(
        default=None,
        metadata=_arg("run", "YAML/JSON file of these keys (a run's args.yaml or config.json) "
                      "or timm train.py's args.yaml; the command line wins over it",
                      "-c", "--config"),
    )  # fmt: skip
    plan: str | None = field(
        default=None,
        metadata=_arg("run", "a run's plan.json: start from its resolved configuration (the "
                      "planner's ranks); flags and -c override what they name, but not the "
                      "engine or layout the plan decided"),
    )  # fmt: skip
    print_config: bool = field(
        default=False, metadata=_arg("run", "print resolved config and exit")
    )
    # Resolved at startup (not flags).
    world_size: int = field(default=1, metadata={"derived": True})
    requested: dict[str, Any] = field(
        default_factory=dict, repr=False, compare=False, metadata={"derived": True}
    )
    """The parsed flags before resolve(), every flag: the run's args.yaml (timm's name)."""
    no_effect: dict[str, str] = field(default_factory=dict, compare=False,
                                      metadata={"derived": True})  # fmt: skip
    """timm flags given that change nothing here: flag -> why (config.json records them)."""

    @property
    def use_amp(self) -> bool:
        return self.amp or self.apex_amp

    @property
    def mixup_active(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: world / (tp x pp) (each model replica spans tp x pp ranks)."""
        return max(1, self.world_size // max(1, self.tp * self.pp))

    @property
    def dims(self) -> ParallelDims:
        """The (dp, tp, pp) split of this world; a layout the checks refuse raises ValueError."""
        return ParallelDims.of_world(self.world_size, self.tp, self.pp)

    @property
    def engines_claimed(self) -> list[EngineName]:
        """Every engine the parallel settings ask for (registry/engines.py's one rule)."""
        return claimed(
            exchange=self.exchange, deepspeed=self.deepspeed, fsdp=self.fsdp, tp=self.tp, pp=self.pp
        )

    @property
    def engine(self) -> EngineName:
        """The engine these settings run: the first claimed. A planned run's --exchange is the
        planner's ring-or-ps choice; by hand, auto runs ring."""
        return next(iter(self.engines_claimed), "ring")

    @property
    def checkpoint_steps(self) -> int:
        """--checkpoint-every as steps (`auto` must have been resolved by the planner)."""
        if not isinstance(self.checkpoint_every, int):
            raise ConfigError(AUTO_BY_HAND)
        return self.checkpoint_every

    @property
    def train_epochs(self) -> int:
        """Epochs trained: --epochs, then --cooldown-epochs at --min-lr (timm's num_epochs)."""
        return self.epochs + self.cooldown_epochs

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.accum_steps * self.dp_size

    def record(self) -> dict[str, Any]:
        """The resolved values: config.json (flag groups in order, timm's settings last in each)."""
        values = dataclasses.asdict(self)
        del values["requested"]
        return {f.name: values[f.name] for f in ordered_fields() if f.name in values}

    def to_json(self) -> str:
        return json.dumps({**self.record(), "global_batch_size": self.global_batch_size}, indent=2)
