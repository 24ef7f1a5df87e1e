"""timm train.py's options, every one of them, in one table (OPTIONS): what each means here.

Each of timm's 172 options is exactly one of:
- accepted: it sets a TrainConfig field with timm's meaning (timm's flag is vitpod's flag or an
  alias of it; `why` says where vitpod differs);
- no effect: accepted and recorded in config.json's `no_effect` (the flag and why);
- refused: a value other than timm's default is refused with `why` (what it does in timm, why
  vitpod does not, what to use instead); at timm's default it asks for nothing and is accepted.
The same table builds the trainer's timm flags (flags.py), reads a timm args.yaml given to `-c`
and writes a run's args.yaml under timm's names (timmargs.py), and the table of
docs/trainer.md (scripts/timm_flags_table.py); tests/test_timm_options.py walks timm's own parser
(../shared/peers/timm_train.py) against it. Defaults are those of timm's train.py at
huggingface/pytorch-image-models aa4b5850 (2026-08).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vitpod.trainer.settings.timmvalues import (
    aa_value,
    amp_dtype_name,
    amp_dtype_rule,
    channels_last_value,
    compile_backend,
    data_rule,
    dataset_name,
    empty_is_skip,
    none_is_skip,
    opt_name,
    pretrained_path_rule,
)

ACCEPTED, NO_EFFECT, REFUSED = "accepted", "no effect", "refused"

Convert = Callable[[Any, dict[str, Any]], Any]


@dataclass(frozen=True)
class TimmOption:
    key: str  # timm's dest, the args.yaml key
    flags: tuple[str, ...]  # timm's option strings (none: the positional DATA)
    default: Any  # timm's default
    kind: type  # bool: a store_true flag; dict: key=value pairs (timm's ParseKwargs)
    nargs: int | str | None
    use: str  # ACCEPTED, NO_EFFECT or REFUSED
    field: str | None  # ACCEPTED: the TrainConfig field it sets
    why: str  # ACCEPTED: where vitpod differs ('' = nowhere); else why it does nothing/is refused
    value: Callable[[Any], Any] | None  # timm's value -> the field's (both -c and the command line)
    convert: Convert | None  # -c only: a rule that reads other keys of the file

    @property
    def flag(self) -> str:
        return next((f for f in self.flags if f.startswith("--")), self.flags[0] if self.flags
                    else self.key.upper())  # fmt: skip

    def refusal(self, value: Any) -> str:
        shown = _shown(value)
        return f"{self.flag}{' ' if shown else ''}{shown}: in timm, {self.why}"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "" if value else "false"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    if isinstance(value, dict):
        return " ".join(f"{k}={v!r}" for k, v in value.items())
    return str(value)


# ---------------------------------------------------------------- reasons shared by options
_DATASETS_HAVE = ("vitpod reads ImageFolder trees (DATA/train, DATA/val), CIFAR, digits, "
                  "synthetic and packed shards")  # fmt: skip
_SPLIT_NAMES = ("names timm's folder datasets resolve to the same folder (train, training; val, "
                "valid, validation, eval, evaluation) ask for nothing")  # fmt: skip
_NO_NET = "compute nodes have no network"
_SCHED = ("vitpod builds timm's schedule from --sched, warmup, --min-lr, --decay-* and "
          "--cooldown-epochs only")  # fmt: skip
_RES = (
    "timm's scheduled-resolution loader (per-batch image sizes); vitpod trains one "
    "--img-size per run: run the sizes as separate stages (pretrain, then fine-tune)"
)
_NAFLEX = ("timm's NaFlex loader (variable-resolution patch sequences for NaFlexViT); vitpod "
           "trains fixed-size images: use --img-size")  # fmt: skip
_KD = (
    "timm's knowledge distillation from a teacher model; vitpod's teacher signal is VOLO's "
    "token labeling: use --token-label with --token-label-data (make token-labels)"
)
_BN = "BatchNorm options of timm's EfficientNet-family builders; ViT and VOLO take none"
_SPLITS = ("AugMix-style augmentation splits (each image augmented into several batch parts); "
           "vitpod's loaders make one view per image: drop it")  # fmt: skip
_DIST = "vitpod's DDP settings are fixed (buffers broadcast from rank 0, as timm's default)"
_HINT = "a speed hint of timm's loader; "
_STREAM = "sizes an iterable (streaming) dataset; vitpod's sources count their samples: drop it"


def _o(key: str, default: Any, use: str, why: str = "", *, kind: type | None = None,
       nargs: int | str | None = None, flags: tuple[str, ...] | None = None,
       value: Callable[[Any], Any] | None = None, convert: Convert | None = None,
       ) -> TimmOption:  # fmt: skip
    """One row: `use` is NO_EFFECT, REFUSED or the TrainConfig field an accepted option sets.
    kind/nargs/flags default to what timm's default and key say (a list: nargs '+')."""
    if kind is None:
        kind = type(default) if default is not None else str
        if isinstance(default, list):
            kind, nargs = type(default[0]) if default else str, nargs or "+"
    if kind is bool or kind is dict:
        nargs = "*" if kind is dict else None
    field = None if use in (NO_EFFECT, REFUSED) else use
    return TimmOption(key, flags if flags is not None else ("--" + key.replace("_", "-"),),
                      default, kind, nargs, ACCEPTED if field else use, field, why, value,
                      convert)  # fmt: skip


R, N = REFUSED, NO_EFFECT
# fmt: off
OPTIONS: tuple[TimmOption, ...] = (
    # Dataset
    _o("data", None, "data_dir", "vitpod's DATA_DIR positional", flags=(), nargs="?",
       convert=data_rule),
    _o("data_dir", None, "data_dir", value=none_is_skip),
    _o("dataset", "", "dataset", "names vitpod has: '' and folder (ImageFolder), torch/cifar10, "
       "torch/cifar100; also vitpod's digits, synthetic, shards. timm's torch/imagenet, other "
       "torch/ names, hfds/, hfids/, tfds/ and wds/ are refused, each with its reason (any other "
       "name, a folder in timm: --dataset folder)",
       value=dataset_name),
    _o("train_split", "train", R, "selects a split of a torch/hfds/tfds/wds dataset; "
       f"{_DATASETS_HAVE}: put the training images in DATA/train ({_SPLIT_NAMES})"),
    _o("val_split", "validation", R, f"selects the validation split; {_DATASETS_HAVE}: put them "
       f"in DATA/val or DATA/validation, or pass --no-eval to skip validation ({_SPLIT_NAMES})"),
    _o("train_num_samples", None, R, _STREAM, kind=int),
    _o("val_num_samples", None, R, _STREAM, kind=int),
    _o("dataset_download", False, R, f"downloads torch/tfds datasets; {_NO_NET}: download on a "
       "login node into DATA first"),
    _o("class_map", "", R, "maps folder names to class indices from a file; vitpod numbers the "
       "class folders in sorted order: rename or link the folders"),
    _o("input_img_mode", None, R, "converts images to another PIL mode; vitpod trains RGB "
       "images"),
    _o("input_key", None, R, f"names the image field of an hfds/wds dataset; {_DATASETS_HAVE}"),
    _o("target_key", None, R, f"names the label field of an hfds/wds dataset; {_DATASETS_HAVE}"),
    _o("dataset_trust_remote_code", False, R, "runs a Hugging Face dataset's code; "
       f"{_DATASETS_HAVE}, no remote code"),
    # Model
    _o("model", "resnet50", "model", "vitpod trains VOLO and ViT models (timm names)"),
    _o("pretrained", False, "pretrained", "weights from the local timm/Hugging Face cache or "
       f"--pretrained-path, never downloaded ({_NO_NET})"),
    _o("pretrained_path", None, "pretrained_path", kind=str, convert=pretrained_path_rule),
    _o("initial_checkpoint", "", "initial_checkpoint", value=empty_is_skip),
    _o("resume", "", "resume", "vitpod resumes its own checkpoints (default auto: the run's "
       "newest)", value=empty_is_skip),
    _o("no_resume_opt", False, R, "resumes the model without the optimizer state; vitpod's "
       "checkpoints restore the whole state: start from the weights with --finetune or "
       "--initial-checkpoint instead"),
    _o("num_classes", None, "num_classes", kind=int),
    _o("gp", None, R, "overrides the global pooling of CNNs; ViT/VOLO pool with their class "
       "token: drop it"),
    _o("img_size", None, "img_size", kind=int, value=none_is_skip),
    _o("in_chans", None, R, "builds a model for other than 3 input channels; vitpod trains RGB "
       "images: drop it", kind=int),
    _o("input_size", None, "input_size", "square RGB only (3 N N): sets --img-size N", kind=int,
       nargs=3),
    _o("crop_pct", None, "crop_pct", kind=float),
    _o("mean", None, "mean", kind=float, nargs="+"),
    _o("std", None, "std", kind=float, nargs="+"),
    _o("interpolation", "", "interpolation", "bilinear or bicubic ('': the model's, bicubic)"),
    _o("batch_size", 128, "batch_size", flags=("-b", "--batch-size")),
    _o("validation_batch_size", None, "validation_batch_size", kind=int,
       flags=("-vb", "--validation-batch-size")),
    _o("channels_last", False, "channels_last", "not given: vitpod's choice (on, off with "
       "--fsdp/--deepspeed)", value=channels_last_value),
    _o("fuser", "", N, "selects TorchScript's JIT fuser; vitpod runs no TorchScript"),
    _o("grad_accum_steps", 1, "accum_steps"),
    _o("grad_checkpointing", False, "grad_checkpointing"),
    _o("fast_norm", False, R, "swaps in timm's experimental fused norm kernels; vitpod trains "
       "torch's LayerNorm (fused by torch.compile): drop it"),
    _o("model_kwargs", {}, "model_kwargs", kind=dict),
    _o("head_init_scale", None, R, "rescales the new classifier at init; vitpod keeps timm's "
       "initialisation: drop it", kind=float),
    _o("head_init_bias", None, R, "sets the classifier bias at init; vitpod keeps timm's "
       "initialisation: drop it", kind=float),
    _o("torchcompile_mode", None, R, "picks torch.compile's mode; vitpod compiles in the default "
       "mode (its compile cache is per run): drop it"),
    _o("torchscript", False, R, "scripts the model with TorchScript; use --torchcompile"),
    _o("torchcompile", None, "compile", "inductor only (vitpod's --compile on)", nargs="?",
       value=compile_backend),
    # Device
    _o("device", "cuda", R, "picks the device; vitpod uses the rank's GPU when it sees one, "
       "else the CPU: hide GPUs with CUDA_VISIBLE_DEVICES= to run on CPU"),
    _o("amp", False, "amp"),
    _o("amp_dtype", "float16", "amp_dtype", "float16/bfloat16 or vitpod's fp16/bf16",
       value=amp_dtype_name, convert=amp_dtype_rule),
    _o("model_dtype", None, R, "trains in a low-precision dtype without AMP; vitpod keeps fp32 "
       "weights: use --amp (--amp-dtype bf16)"),
    _o("no_ddp_bb", False, R, f"stops DDP broadcasting buffers; {_DIST}"),
    _o("synchronize_step", False, N, "a device sync after each step for timing; vitpod's step "
       "timer syncs at log steps itself"),
    _o("local_rank", 0, N, "set by the old torch.distributed.launch; vitpod reads LOCAL_RANK or "
       "SLURM_LOCALID", flags=("--local_rank",)),
    _o("device_modules", None, R, "imports out-of-tree device backends; vitpod runs on CUDA or "
       "CPU", nargs="+"),
    # Optimizer
    _o("opt", "sgd", "opt", "fused* names mean timm's plain ones", value=opt_name),
    _o("opt_eps", None, "opt_eps", kind=float),
    _o("opt_betas", None, "opt_betas", kind=float, nargs="+"),
    _o("momentum", 0.9, "momentum"),
    _o("weight_decay", 2e-05, "weight_decay"),
    _o("clip_grad", None, "clip_grad", kind=float),
    _o("clip_mode", "norm", "clip_mode", "norm, value or agc (value/agc: DDP)"),
    _o("layer_decay", None, "layer_decay", kind=float),
    _o("layer_decay_min_scale", 0, R, "clamps layer-decay scales; vitpod passes --layer-decay "
       "alone to timm's grouping: drop it", kind=float),
    _o("layer_decay_no_opt_scale", None, R, "freezes layers whose scale is below it; vitpod "
       "trains every layer: drop it", kind=float),
    _o("opt_kwargs", {}, "opt_kwargs", kind=dict),
    # Schedule
    _o("sched", "cosine", "sched"),
    _o("sched_on_updates", False, "sched_on_updates", "vitpod's default is true (per update); "
       "false steps once per epoch as timm does"),
    _o("lr", None, "lr", kind=float),
    _o("lr_base", 0.1, "lr_base"),
    _o("lr_base_size", 256, "lr_base_size"),
    _o("lr_base_scale", "", R, "sqrt-scales --lr-base with the batch; vitpod scales linearly "
       "(linear is accepted): give --lr"),
    _o("lr_noise", None, R, f"adds LR noise; {_SCHED}: drop it", kind=float, nargs="+"),
    _o("lr_noise_pct", 0.67, R, f"LR noise limit; {_SCHED}: drop it"),
    _o("lr_noise_std", 1.0, R, f"LR noise std; {_SCHED}: drop it"),
    _o("lr_cycle_mul", 1.0, R, f"restart-cycle length factor; {_SCHED}: drop it"),
    _o("lr_cycle_decay", 0.5, N, "LR factor between restart cycles: no effect with one cycle "
       "(--lr-cycle-limit 1, vitpod's only)"),
    _o("lr_cycle_limit", 1, R, f"restart cycles; {_SCHED}: drop it"),
    _o("lr_k_decay", 1.0, R, f"k-decay of cosine/poly; {_SCHED}: drop it"),
    _o("warmup_lr", 1e-05, "warmup_lr"),
    _o("min_lr", 0, "min_lr", kind=float),
    _o("epochs", 300, "epochs"),
    _o("epoch_repeats", 0.0, R, "repeats the dataset within an epoch; vitpod's epoch is one pass: "
       "raise --epochs instead"),
    _o("start_epoch", None, R, "restarts at a given epoch; vitpod resumes the epoch and step "
       "from its checkpoint (--resume)", kind=int),
    _o("decay_milestones", [90, 180, 270], "decay_milestones"),
    _o("decay_epochs", 90, "decay_epochs", kind=float),
    _o("warmup_epochs", 5, "warmup_epochs"),
    _o("warmup_prefix", False, R, "starts decay after the warmup; vitpod's warmup overlaps the "
       "decay as timm's default: drop it"),
    _o("cooldown_epochs", 0, "cooldown_epochs", "epochs at --min-lr after --epochs (trained "
       "too, as in timm)"),
    _o("patience_epochs", 10, N, "used by the plateau schedule only, which vitpod refuses "
       "(it steps on the eval metric)"),
    _o("decay_rate", 0.1, "decay_rate", flags=("--decay-rate", "--dr")),
    # Augmentation and regularization
    _o("no_aug", False, R, "turns every train augmentation off; vitpod's are off one by one: "
       "--aa '' --reprob 0 --hflip 0 --scale 1 1 --ratio 1 1 --color-jitter 0"),
    _o("train_crop_mode", None, R, "timm's other train crops; vitpod's is the random resized "
       "crop (--scale, --ratio)"),
    _o("scale", [0.08, 1.0], "scale"),
    _o("ratio", [0.75, 1.3333333333333333], "ratio"),
    _o("hflip", 0.5, "hflip"),
    _o("vflip", 0.0, R, "flips images vertically; vitpod's loaders flip horizontally only "
       "(--hflip)"),
    _o("color_jitter", 0.4, "color_jitter", "as timm: off while RandAugment (--aa) is on; "
       "torch loader"),
    _o("color_jitter_prob", None, R, "applies color jitter with a probability; vitpod applies "
       "it always (--color-jitter)", kind=float),
    _o("grayscale_prob", None, R, "random grayscale (3-augment recipes); not in vitpod's "
       "loaders: use --aa", kind=float),
    _o("gaussian_blur_prob", None, R, "random blur (3-augment recipes); not in vitpod's loaders: "
       "use --aa", kind=float),
    _o("aa", None, "aa", "'' or none: off", value=aa_value),
    _o("aug_repeats", 0, "aug_repeats", "timm's RepeatAugSampler, fractions too (1.5: "
       "ceil(1.5 N) copies an epoch), through vitpod's resumable sharding (exact on resume)",
       kind=float),
    _o("aug_splits", 0, R, _SPLITS),
    _o("jsd_loss", False, R, f"the Jensen-Shannon loss over {_SPLITS}"),
    _o("bce_loss", False, "bce_loss"),
    _o("bce_sum", False, "bce_sum"),
    _o("bce_target_thresh", None, "bce_target_thresh", kind=float),
    _o("bce_pos_weight", None, "bce_pos_weight", kind=float),
    _o("reprob", 0.0, "reprob"),
    _o("remode", "pixel", R, "random-erase fill mode; vitpod erases with per-pixel noise "
       "(timm's pixel) on the torch loader and the mean colour on DALI: drop it"),
    _o("recount", 1, R, "erases several boxes; vitpod erases one (--reprob): drop it"),
    _o("resplit", False, N, "excludes the clean augmentation split from erasing: no effect "
       "without --aug-splits, which vitpod refuses"),
    _o("mixup", 0.0, "mixup"),
    _o("cutmix", 0.0, "cutmix"),
    _o("cutmix_minmax", None, R, "CutMix box bounds instead of the alpha; use --cutmix ALPHA",
       kind=float, nargs="+"),
    _o("mixup_prob", 1.0, "mixup_prob"),
    _o("mixup_switch_prob", 0.5, "mixup_switch_prob"),
    _o("mixup_mode", "batch", "mixup_mode"),
    _o("mixup_off_epoch", 0, R, "turns mixup off after an epoch; vitpod mixes for the whole run: "
       "fine-tune the last epochs without --mixup/--cutmix as a second stage"),
    _o("smoothing", 0.1, "smoothing"),
    _o("train_interpolation", "random", "train_interpolation", "random, bilinear or bicubic "
       "(torch loader; DALI and gpu use --interpolation)"),
    _o("drop", 0.0, "drop"),
    _o("drop_connect", None, R, "the deprecated name of drop path; use --drop-path", kind=float),
    _o("drop_path", None, "drop_path", kind=float),
    _o("drop_block", None, R, "DropBlock of CNNs; ViT/VOLO have none: use --drop-path",
       kind=float),
    # Batch norm
    _o("bn_momentum", None, R, _BN, kind=float),
    _o("bn_eps", None, R, _BN, kind=float),
    _o("sync_bn", False, "sync_bn", "DDP on GPUs (VOLO's stem has BatchNorm; ViT none)"),
    _o("dist_bn", "reduce", N, "averages BatchNorm stats over ranks at epoch ends; vitpod's DDP "
       "broadcasts rank 0's every step, so ranks hold the same stats already"),
    _o("split_bn", False, R, f"BatchNorm per augmentation split: {_SPLITS}"),
    # EMA
    _o("model_ema", False, "model_ema"),
    _o("model_ema_force_cpu", False, R, "keeps the EMA on rank 0's CPU; vitpod keeps it beside "
       "the model on every rank: drop it"),
    _o("model_ema_decay", 0.9998, "model_ema_decay"),
    _o("model_ema_warmup", False, R, "warms the EMA decay up; vitpod's EMA uses --model-ema-decay "
       "from the first step: drop it"),
    # Misc
    _o("seed", 42, "seed"),
    _o("worker_seeding", "all", R, "how loader workers are seeded; vitpod seeds each step's "
       "augmentation from (seed, rank, step) so a resumed run draws the same: drop it"),
    _o("log_interval", 50, "log_interval"),
    _o("val_interval", 1, R, "validates every N epochs; vitpod validates every epoch: "
       "--no-eval skips it"),
    _o("recovery_interval", 0, R, "writes a recovery checkpoint every N batches; use "
       "--checkpoint-every N (optimizer steps)"),
    _o("checkpoint_hist", 10, "keep_last", "vitpod keeps the newest N (resume points), not the "
       "N best by --eval-metric"),
    _o("workers", 4, "workers", flags=("-j", "--workers")),
    _o("save_images", False, R, "writes input batches as images for debugging; not in vitpod: "
       "look at a batch with `python -m vitpod.trainer.data` instead"),
    _o("pin_mem", False, N, f"{_HINT}vitpod's torch loader pins host memory whenever CUDA is "
       "there"),
    _o("no_prefetcher", False, N, f"{_HINT}vitpod's loaders overlap host-to-device copies "
       "themselves"),
    _o("output", "", "output", "vitpod's run directory; with --experiment NAME, OUTPUT/NAME as "
       "in timm", value=empty_is_skip),
    _o("experiment", "", "experiment", "the run directory is OUTPUT/NAME (make pretrain names "
       "the run itself)"),
    _o("eval_metric", "top1", N, "picks timm's best checkpoint; vitpod keeps the newest and logs "
       "top1 and top5"),
    _o("tta", 0, N, "test-time augmentation factor of timm's validate(); vitpod validates "
       "center crops"),
    _o("use_multi_epochs_loader", False, N, f"{_HINT}vitpod's loader keeps its workers across "
       "epochs (persistent_workers)"),
    _o("log_wandb", False, "log_wandb"),
    _o("wandb_project", None, "wandb_project", kind=str),
    _o("wandb_tags", [], R, "tags the W&B run; set WANDB_TAGS=a,b in the job's environment",
       kind=str, nargs="+"),
    _o("wandb_resume_id", "", R, "resumes a W&B run by id; set WANDB_RUN_ID and "
       "WANDB_RESUME=allow in the job's environment"),
    _o("train_img_sizes", None, R, _RES, kind=int, nargs="+"),
    _o("train_batch_sizes", None, R, _RES, kind=int, nargs="+"),
    _o("train_size_probs", None, R, _RES, kind=float, nargs="+"),
    _o("train_size_schedule", "constant", R, _RES),
    _o("train_size_schedule_spread", 0.65, R, _RES),
    _o("train_size_random_mix", 0.1, R, _RES),
    _o("train_batches_per_epoch", None, R, "fixes the batches per epoch; vitpod's epoch is one "
       "pass over the data: stop early with --max-steps", kind=int,
       flags=("--train-batches-per-epoch", "--train-steps-per-epoch")),
    _o("variable_batch_loss_scale", "none", R, _RES),
    _o("naflex_loader", False, R, _NAFLEX),
    _o("naflex_train_seq_lens", [128, 256, 576, 784, 1024], R, _NAFLEX),
    _o("naflex_max_seq_len", 576, R, _NAFLEX),
    _o("naflex_patch_sizes", None, R, _NAFLEX, kind=int, nargs="+"),
    _o("naflex_patch_size_probs", None, R, _NAFLEX, kind=float, nargs="+"),
    _o("naflex_loss_scale", "linear", R, _NAFLEX),
    _o("naflex_patchify_channels_first", False, R, _NAFLEX),
    _o("kd_model_name", None, R, _KD),
    _o("kd_distill_type", "logit", R, _KD),
    _o("kd_loss_type", "kl", R, _KD),
    _o("distill_loss_weight", None, R, _KD, kind=float),
    _o("task_loss_weight", None, R, _KD, kind=float),
    _o("kd_temperature", 4.0, R, _KD),
    _o("kd_student_feature_dim", None, R, _KD, kind=int),
    _o("kd_teacher_feature_dim", None, R, _KD, kind=int),
    _o("kd_token_distill_type", "soft", R, _KD),
)
# fmt: on
TIMM: dict[str, TimmOption] = {o.key: o for o in OPTIONS}
UNMAPPED = {o.key: o for o in OPTIONS if o.field is None}  # no effect or refused
TIMM_KEY: dict[str, str] = {}
"""TrainConfig field -> the timm key written for it in args.yaml (the first row naming it,
the flag over the positional)."""
for _row in OPTIONS:
    if _row.field and _row.flags:
        TIMM_KEY.setdefault(_row.field, _row.key)
