"""Inconsistent or impossible TrainConfig settings, each named by its flag with the fix."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from vitpod.registry import labellayout, labelset, models, records, runfiles
from vitpod.registry.checkpoint_every import AUTO, AUTO_BY_HAND
from vitpod.registry.engines import DDP_ENGINES, MESH_ENGINES
from vitpod.registry.paralleldims import ParallelDims
from vitpod.trainer.config import SCHEDULES, TrainConfig


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
    if cfg.exchange == "ps" and (cfg.ps_servers or 1) > cfg.world_size:
        out.append(
            f"--ps-servers {cfg.ps_servers} exceeds the {cfg.world_size} rank(s); use at most that"
        )
    if cfg.deepspeed and cfg.exchange == "ps":
        out.append("--deepspeed and --exchange ps both choose the gradient path; drop one")
    if cfg.outlook_kernel != "timm" and not cfg.model.startswith("volo"):
        out.append(
            f"--outlook-kernel {cfg.outlook_kernel}: --model {cfg.model} has no outlook attention;"
            " drop it"
        )
    if cfg.outlook_kernel != "timm" and cfg.tp > 1:  # tensor_parallel swaps in its own forward
        out.append(
            f"--outlook-kernel {cfg.outlook_kernel} with --tp {cfg.tp}: tensor parallelism runs"
            " its own per-head outlook attention; drop --outlook-kernel or --tp"
        )
    if not 0 <= cfg.zero_stage <= 3:
        out.append(f"--zero-stage {cfg.zero_stage}: must be 0, 1, 2 or 3")
    out += _mesh_problems(cfg)
    if cfg.resume not in ("auto", "none") and for_training and not os.path.exists(cfg.resume):
        out.append(f"--resume {cfg.resume}: no such checkpoint; use auto, none or an existing path")
    if for_training:
        out += _path_problems(cfg)
        out += [AUTO_BY_HAND] if cfg.checkpoint_every == AUTO else []
    if cfg.log_wandb and for_training and importlib.util.find_spec("wandb") is None:
        out.append(
            "--log-wandb: the wandb package is not installed in this environment; install it "
            "(pip install wandb, part of vitpod's [train] extra) or drop --log-wandb"
        )
    if cfg.finetune:
        out += _finetune_problems(cfg)
    return out + _timm_flag_problems(cfg) + _loader_problems(cfg)


def _loader_problems(cfg: TrainConfig) -> list[str]:
    """What an explicit --loader cannot read or apply, refused when the job is rendered; what
    only the node knows (a CUDA device, DALI installed) the ranks check when they start."""
    out: list[str] = []
    if cfg.loader in ("dali", "gpu") and cfg.dataset in ("cifar10", "cifar100", "synthetic"):
        out.append(f"--loader {cfg.loader}: --dataset {cfg.dataset} is arrays, not encoded "
                   "images (JPEG/PNG); use --loader torch or auto")  # fmt: skip
    if cfg.loader == "gpu" and cfg.aa:
        out.append(f"--loader gpu with --aa {cfg.aa}: the gpu loader has no RandAugment; pass "
                   "--aa '' or use --loader dali or torch")  # fmt: skip
    if cfg.loader == "dali" and cfg.aa and cfg.aa.split("-")[0] != "rand":
        out.append(f"--loader dali with --aa {cfg.aa}: DALI runs RandAugment ('rand-m<M>-n<N>"
                   "...') only; use --loader torch")  # fmt: skip
    folder = cfg.dataset in ("folder", "digits")  # digits: JPEGs in a folder it writes
    labels = cfg.token_label_data if cfg.token_label and not folder else None
    if labels and labellayout.layout_of(labels) == labelset.PUBLISHED:
        out.append(f"--token-label-data {labels}: TokenLabeling's published labels are one "
                   f"file per image of a folder, and --dataset {cfg.dataset} is not one; train "
                   "on the image folder (--dataset folder) or label this data set (make "
                   "token-labels)")  # fmt: skip
    return out


def valid_optimizers() -> list[str]:
    """Every name --opt takes: timm's (a `lookahead_` prefix wraps any of them in Lookahead)."""
    from timm.optim import list_optimizers

    return [str(name) for name in list_optimizers()]


SECOND_ORDER = ("adahessian",)
"""timm's optimizers whose step needs backward(create_graph=True): no engine here runs one."""


def opt_problem(opt: str, valid: list[str]) -> str | None:
    name = opt.lower().removeprefix("lookahead_")
    if name in SECOND_ORDER:
        return (f"--opt {opt}: a second-order optimizer (its step needs backward(create_graph="
                "True)), which vitpod's engines do not run; pick another --opt")  # fmt: skip
    if name in valid:
        return None
    return f"--opt {opt}: not an optimizer of timm; use one of {', '.join(valid)}"


def _opt_problem(opt: str) -> str | None:
    """--opt against timm's optimizers. The default, timm's adamw, needs no look: importing
    timm and torch costs some 10 s of CPU, which every planner command would pay."""
    if opt == TrainConfig.opt:
        return None
    try:
        valid = valid_optimizers()
    except ImportError:  # a login node without torch/timm: the job's own check names it
        return None
    return opt_problem(opt, valid)


def _timm_flag_problems(cfg: TrainConfig) -> list[str]:
    """timm's optimizer, schedule and regularisation flags an engine or model cannot honour."""
    out = [problem] if (problem := _opt_problem(cfg.opt)) else []
    if cfg.sched not in SCHEDULES:
        why = (
            (
                ": timm's plateau lowers the LR when the eval metric stops improving; vitpod's "
                "schedules are a function of the optimizer-step count (stepped per update, or "
                "per epoch with --no-sched-on-updates), so a resumed run recomputes its LR, "
                "and the trainer passes them no metric"
            )
            if cfg.sched == "plateau"
            else ""
        )
        out.append(f"--sched {cfg.sched}{why}; use one of {', '.join(SCHEDULES)}")  # fmt: skip
    if cfg.deepspeed and not cfg.deepspeed_config and cfg.opt != "adamw":
        out.append(f"--opt {cfg.opt} with --deepspeed: the generated DeepSpeed config runs AdamW;"
                   " pass --opt adamw or a --deepspeed-config naming your optimizer")  # fmt: skip
    if cfg.layer_decay is not None and cfg.engine not in DDP_ENGINES:
        out.append("--layer-decay: DDP (ring/ps) only (DeepSpeed and the mesh engine build their "
                   "own parameter groups); drop it or --deepspeed/--fsdp/--tp/--pp")  # fmt: skip
    if cfg.grad_checkpointing and cfg.pp > 1:
        out.append("--grad-checkpointing with --pp: pipeline stages run their blocks themselves,"
                   " unrecomputed; drop one")  # fmt: skip
    if cfg.mixup_active and cfg.token_label:
        out.append("--mixup/--cutmix with --token-label: token labeling mixes with its own "
                   "MixToken (VOLO's recipe: no mixup/cutmix); drop one")  # fmt: skip
    if cfg.mixup_active and cfg.batch_size % 2:
        out.append(f"--mixup/--cutmix: -b {cfg.batch_size} is odd (timm's Mixup pairs the batch "
                   "with its flip); pass an even -b")  # fmt: skip
    if cfg.model_ema and cfg.engine not in DDP_ENGINES:
        out.append("--model-ema: DDP (ring/ps) only (DeepSpeed and the mesh engine shard the "
                   "weights it averages); drop it or --deepspeed/--fsdp/--tp/--pp")  # fmt: skip
    if cfg.channels_last and (cfg.fsdp or cfg.engine == "deepspeed"):
        out.append("--channels-last with --fsdp/--deepspeed: they shard or broadcast contiguous "
                   "(NCHW) weights only; drop --channels-last")  # fmt: skip
    if cfg.initial_checkpoint and cfg.finetune:
        out.append("--initial-checkpoint and --finetune both load the weights; drop one")
    return out + _timm_setting_problems(cfg)


def _timm_setting_problems(cfg: TrainConfig) -> list[str]:
    """timm train.py's settings (trainer/settings/timmargs.py) where this run cannot honour them."""
    out = []
    if cfg.pretrained_path and not cfg.pretrained:
        out.append("--pretrained-path without --pretrained: timm reads the file only with "
                   "--pretrained; add --pretrained (or use --finetune PATH)")  # fmt: skip
    if cfg.pretrained and (cfg.finetune or cfg.initial_checkpoint):
        out.append("--pretrained with --finetune/--initial-checkpoint: each loads the weights; "
                   "drop one")  # fmt: skip
    if cfg.sync_bn and cfg.engine not in DDP_ENGINES:
        out.append("--sync-bn: DDP (ring/ps) only (DeepSpeed and the mesh engine wrap the model "
                   "themselves); drop it or --deepspeed/--fsdp/--tp/--pp")  # fmt: skip
    if cfg.clip_mode != "norm" and cfg.clip_grad and cfg.engine not in DDP_ENGINES:
        out.append(f"--clip-mode {cfg.clip_mode}: DDP (ring/ps) only (DeepSpeed and the mesh "
                   "engine clip the global norm); use --clip-mode norm there")  # fmt: skip
    if cfg.bce_loss and cfg.token_label:
        out.append("--bce-loss with --token-label: token labeling has its own loss; drop one")
    if cfg.aug_repeats < 0:
        out.append(f"--aug-repeats {cfg.aug_repeats:g}: copies of each image an epoch, 0 (off) or "
                   "more; e.g. 3")  # fmt: skip
    if cfg.aug_repeats and cfg.elastic:
        out.append("--aug-repeats with --elastic: the repeated order deals each image's copies "
                   "to the ranks, so another world size reads another order; drop one")  # fmt: skip
    if cfg.aug_repeats and cfg.token_label:
        out.append("--aug-repeats with --token-label: token-label maps are read per image once "
                   "an epoch by their loader; drop one")  # fmt: skip
    for name in ("mean", "std"):
        value = getattr(cfg, name)
        if value is not None and len(value) not in (1, 3):
            out.append(f"--{name} {' '.join(map(str, value))}: give one value or three (RGB)")
    if cfg.train_interpolation not in ("", cfg.interpolation or "bicubic") and cfg.loader in (
        "dali",
        "gpu",
    ):
        out.append(f"--train-interpolation {cfg.train_interpolation} with --loader {cfg.loader}: "
                   "that loader resizes with --interpolation; use --loader torch or set "
                   "--interpolation")  # fmt: skip
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
    try:
        ParallelDims.of_world(cfg.world_size, cfg.tp, cfg.pp)
    except ValueError as exc:
        out.append(str(exc))
    claims = set(cfg.engines_claimed)
    meshed = bool(claims & set(MESH_ENGINES))
    if meshed and "deepspeed" in claims:
        out.append("--deepspeed and --fsdp/--tp/--pp both shard the model; drop one")
    if meshed and "ps" in claims:
        out.append("--exchange ps applies to DDP only; drop it with --fsdp/--tp/--pp")
    if meshed and cfg.use_amp and cfg.amp_dtype == "fp16":
        out.append(
            "--amp-dtype fp16 with --fsdp/--tp/--pp: the mesh engine has no loss scaling (fp16 "
            "needs it); use --deepspeed or DDP (ring/ps) on GPUs without bf16, or bf16 GPUs"
        )
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
    """A saved model's record names its architecture: refuse another before any rank starts
    (a run's final/model.json, the one beside a weights file or in a final folder; a run
    directory's own manifest.json)."""
    path = Path(cfg.finetune or "")
    for manifest in (records.record_path(path / runfiles.FINAL, runfiles.FINAL_RECORD),
                     records.record_path(path.parent, runfiles.FINAL_RECORD),
                     records.record_path(path, runfiles.FINAL_RECORD)):  # fmt: skip
        if manifest.is_file():
            saved = runfiles.read_record(manifest).get("model")
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
        ("initial_checkpoint", cfg.initial_checkpoint is not None),
        ("deepspeed_config", cfg.deepspeed_config is not None),
    )
    for name, needed in checks:
        value = getattr(cfg, name)
        if needed and (not value or not os.path.exists(value)):
            out.append(f"--{name.replace('_', '-')} {value}: no such path; pass an existing one")
    return out
