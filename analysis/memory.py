"""Memory planner: per-GPU bytes of weights, gradients, AdamW states, activations (ViT, VOLO)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from registry.models import MODELS, Vit, Volo, param_count
from registry.models import arch_of as registry_arch

PRECISIONS = ("fp32", "amp", "half")
"""fp32: everything fp32. amp: torch.amp autocast (fp32 weights, half activations). half:
DeepSpeed fp16/bf16 (half weights and gradients, fp32 master copy in the optimizer)."""
ZERO_STAGES = (0, 1, 2, 3)
GIB = 1024**3


ARCHS: dict[str, Volo | Vit] = {name: info.arch for name, info in MODELS.items()}


def arch_of(model: str) -> Volo | Vit:
    """The architecture of a model name (volo_d1 or volo_d1_224 both work)."""
    try:
        return registry_arch(model)
    except ValueError:
        raise ValueError(
            f"--model {model!r} is unknown to the memory planner; known: {sorted(ARCHS)}"
        ) from None


def timm_param_count(model: str, img_size: int = 224, num_classes: int = 1000) -> int:
    """Trainable parameters counted by building the timm model on the meta device."""
    import torch

    from analysis.memcheck import build_model

    with torch.device("meta"):
        net = build_model(model, img_size, num_classes)
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


# ---------------------------------------------------------------- activations


@dataclass(frozen=True, slots=True)
class Saved:
    """Elements one sample keeps for backward in one block: norm inputs (fp32 under autocast)
    and everything else (in the activation dtype)."""

    norm: float
    other: float

    def bytes(self, precision: str) -> float:
        half = 2 if precision in ("amp", "half") else 4
        return self.norm * (2 if precision == "half" else 4) + self.other * half


def _transformer(tokens: int, d: int, heads: int, ratio: float) -> Saved:
    # LN1 and LN2 inputs; qkv input, qkv output (q, k, v), attention output (= proj input),
    # fc1 input, GELU input and output (= fc2 input); log-sum-exp per head and token.
    hidden = int(d * ratio)
    return Saved(norm=2 * tokens * d, other=tokens * (6 * d + 2 * hidden + heads))


def _outlooker(h: int, w: int, d: int, heads: int, ratio: float, a: Volo) -> Saved:
    # Outlook attention at stride pooling_scale: the unfolded values (k^2 per output
    # position), pooled input, softmax of the k^2 x k^2 weights, the folded result (proj input).
    pooled = math.ceil(h / a.pooling_scale) * math.ceil(w / a.pooling_scale)
    k2, tokens, hidden = a.kernel**2, h * w, int(d * ratio)
    attention = k2 * pooled * d + pooled * d + heads * k2 * k2 * pooled + tokens * d
    return Saved(norm=2 * tokens * d, other=tokens * d + attention + tokens * (d + 2 * hidden))


def _volo_activations(a: Volo, img_size: int, num_classes: int, token_label: bool) -> tuple:
    """(blocks, extra): per-block Saved and the saved elements outside blocks, per sample."""
    stem_side = img_size // 2
    stem = 3 * 2 * a.stem_hidden_dim * stem_side * stem_side  # conv out + BN/ReLU out, 3 layers
    side = img_size // a.patch_size
    blocks, extra = [], float(stem)
    for i, n_blocks in enumerate(a.layers):
        d, m = a.embed_dims[i], a.num_heads[i]
        for _ in range(n_blocks):
            if a.outlook[i]:
                blocks.append(_outlooker(side, side, d, m, a.mlp_ratio, a))
            else:
                blocks.append(_transformer(side * side, d, m, a.mlp_ratio))
        if a.downsamples[i] and i + 1 < len(a.layers):
            extra += side * side * d  # the downsampling conv's input
            side //= 2
    tokens, dim = side * side + 1, a.embed_dims[-1]
    extra += a.post_layers * 4 * tokens * dim + 2 * tokens * dim  # class blocks, final norm
    if token_label:
        extra += 2 * (tokens - 1) * num_classes  # dense logits and their log-softmax
    return blocks, extra


def _vit_activations(a: Vit, img_size: int) -> tuple:
    tokens = (img_size // a.patch_size) ** 2 + 1
    blocks = [_transformer(tokens, a.embed_dim, a.num_heads, a.mlp_ratio)] * a.depth
    return blocks, 2.0 * tokens * a.embed_dim  # final norm input and output


def activation_bytes(
    model: str,
    img_size: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    num_classes: int = 1000,
    token_label: bool = False,
) -> float:
    """Bytes kept for backward per sample. With checkpointing each block keeps only its input,
    and one block's activations are rebuilt at a time during backward."""
    arch = arch_of(model)
    if isinstance(arch, Volo):
        blocks, extra = _volo_activations(arch, img_size, num_classes, token_label)
    else:
        blocks, extra = _vit_activations(arch, img_size)
    half = 2 if precision in ("amp", "half") else 4
    extra_bytes = extra * (4 if precision == "fp32" else half)
    if not checkpointing:
        return extra_bytes + sum(b.bytes(precision) for b in blocks)
    inputs = sum(b.norm / 2 for b in blocks) * (2 if precision == "half" else 4)
    return extra_bytes + inputs + max(b.bytes(precision) for b in blocks)


# ---------------------------------------------------------------- the plan


@dataclass(slots=True)
class Plan:
    """Per-GPU bytes of one training configuration."""

    model: str
    params: int
    weights: float
    grads: float
    optimizer: float
    buffers: float
    activations: float
    activation_per_sample: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def _check(precision: str, zero: int, gpus: int, batch: int) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    if zero not in ZERO_STAGES:
        raise ValueError(f"--zero-stage must be one of {ZERO_STAGES}, got {zero!r}")
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if batch < 0:
        raise ValueError(f"--batch must be >= 0, got {batch}")


def plan(
    model: str,
    img_size: int = 224,
    batch: int = 1,
    precision: str = "fp32",
    zero: int = 0,
    gpus: int = 1,
    checkpointing: bool = False,
    num_classes: int = 1000,
    token_label: bool = False,
) -> Plan:
    """Per-GPU memory for micro-batch `batch` with AdamW under ZeRO stage `zero` on `gpus` GPUs.

    Bytes per parameter: weights 4 (half: 2), gradients 4 (half: 2), AdamW 8 for two fp32
    moments (half: 12, plus the fp32 master). ZeRO-1 shards optimizer states, ZeRO-2 also
    gradients, ZeRO-3 also weights. Plain DDP (stage 0, several GPUs) keeps gradient buckets as
    large as the gradients (gradient_as_bucket_view=False, the default).
    """
    _check(precision, zero, gpus, batch)
    params = param_count(model, img_size, num_classes)
    half = precision == "half"
    weights, grads, optim = params * (2 if half else 4), params * (2 if half else 4), params * 8
    optim += params * 4 if half else 0
    per_sample = activation_bytes(
        model, img_size, precision, checkpointing, num_classes, token_label
    )
    return Plan(
        model=model,
        params=params,
        weights=weights / (gpus if zero >= 3 else 1),
        grads=grads / (gpus if zero >= 2 else 1),
        optimizer=optim / (gpus if zero >= 1 else 1),
        buffers=float(grads if zero == 0 and gpus > 1 else 0),
        activations=per_sample * batch,
        activation_per_sample=per_sample,
        settings={
            "img_size": img_size,
            "batch": batch,
            "precision": precision,
            "zero": zero,
            "gpus": gpus,
            "checkpointing": checkpointing,
            "num_classes": num_classes,
            "token_label": token_label,
        },
    )


def max_micro_batch(gpu_mem_bytes: float, reserve_bytes: float = 1.0 * GIB, **kwargs: Any) -> int:
    """Largest micro-batch whose plan fits gpu_mem_bytes minus reserve_bytes (CUDA context,
    workspaces, fragmentation); 0 if not even the model states fit."""
    fixed = plan(batch=0, **kwargs)
    room = gpu_mem_bytes - reserve_bytes - fixed.total
    return max(0, int(room // fixed.activation_per_sample)) if room > 0 else 0


def profile_gpu_memory(profile: str, stage: str = "pretrain") -> int:
    """gpu.memory_bytes of the node type a profile's stage runs on (a bundled name such as
    dgxpod, or a YAML path). Reads the YAML itself: analysis does not import workflows."""
    import yaml

    path = Path(profile)
    if not path.suffix:
        path = Path(__file__).resolve().parent.parent / "workflows" / "profiles" / f"{profile}.yaml"
    if not path.is_file():
        raise ValueError(f"--profile {profile!r}: no such profile YAML ({path})")
    data = yaml.safe_load(path.read_text()) or {}
    node = data
    if "node_types" in data:
        kind = ((data.get("partitions") or {}).get(stage) or {}).get("node_type", "default")
        node = (data.get("node_types") or {}).get(kind) or {}
    memory = (node.get("gpu") or {}).get("memory_bytes")
    if not memory:
        raise ValueError(
            f"--profile {profile!r}: no gpu.memory_bytes for the {stage} stage's node type in "
            f"{path}; add `gpu: {{model: ..., memory_bytes: N}}` or pass --gpu-mem-gib"
        )
    return int(memory)


# ---------------------------------------------------------------- command line


def add_memory_parser(sub: Any) -> None:
    parser = sub.add_parser("memory", help="per-GPU memory plan of a model and configuration")
    parser.add_argument("--model", required=True, help=f"one of {sorted(ARCHS)}")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=0)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--token-label", action="store_true")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="also: largest batch")
    parser.add_argument("--profile", default=None, help="cluster profile: its GPU memory")
    parser.add_argument("--stage", default="pretrain", help="the profile's stage (its node type)")
    parser.add_argument("--reserve-gib", type=float, default=1.0)
    parser.add_argument("--measure", action="store_true", help="also measure peak RSS on CPU")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=memory_main)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "img_size": args.img_size,
        "precision": args.precision,
        "zero": args.zero_stage,
        "gpus": args.gpus,
        "checkpointing": args.checkpointing,
        "num_classes": args.num_classes,
        "token_label": args.token_label,
    }


def memory_main(args: argparse.Namespace) -> int:
    result = plan(batch=args.batch, **_settings(args))
    out: dict[str, Any] = result.as_dict()
    if args.profile and not args.gpu_mem_gib:
        args.gpu_mem_gib = profile_gpu_memory(args.profile, args.stage) / GIB
    if args.gpu_mem_gib:
        out["max_micro_batch"] = max_micro_batch(
            args.gpu_mem_gib * GIB, args.reserve_gib * GIB, **_settings(args)
        )
    if args.measure:
        from analysis.memcheck import compare

        out["measured"] = compare(args.model, args.img_size, args.batch, args.num_classes)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for key in ("weights", "grads", "optimizer", "buffers", "activations", "total"):
        print(f"{key:12s} {out[key] / 2**20:12.1f} MiB")
    print(f"{'params':12s} {result.params:12,d}")
    if "max_micro_batch" in out:
        print(f"largest micro-batch in {args.gpu_mem_gib:g} GiB: {out['max_micro_batch']}")
    if "measured" in out:
        m = out["measured"]
        print(
            f"measured on CPU (fp32): total {m['measured_total'] / 2**20:.1f} MiB, error "
            f"{100 * m['total_error']:+.1f}%; activations {m['measured_activations'] / 2**20:.1f}"
            f" MiB, error {100 * m['activation_error']:+.1f}%"
        )
    return 0
