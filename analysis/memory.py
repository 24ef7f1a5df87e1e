"""Memory planner: per-GPU bytes of weights, gradients, AdamW states, activations (ViT, VOLO)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vitpod.analysis.mesh import Mesh
from vitpod.registry.models import MODELS, Vit, Volo, linear_params, param_count, volo_params
from vitpod.registry.models import arch_of as registry_arch

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


@dataclass(frozen=True, slots=True)
class ParamParts:
    """Parameters by where they live under model parallelism: per block, the part a Megatron
    split shards over tp (column-parallel weights and biases, row-parallel weights) and the part
    every tp rank keeps (norms, row-parallel biases); embeddings on the first pipeline stage;
    final norm and heads (VOLO: also its class-attention blocks) on the last."""

    blocks: tuple[tuple[int, int], ...]
    first: int
    last: int

    @property
    def total(self) -> int:
        return self.first + self.last + sum(a + b for a, b in self.blocks)


def _pair(d: int, hidden: int) -> int:
    """Sharded part of a column-parallel (d -> hidden, biased) + row-parallel (hidden -> d) pair."""
    return d * hidden + hidden + hidden * d


def _vit_parts(a: Vit, img_size: int, num_classes: int) -> ParamParts:
    d, tokens = a.embed_dim, (img_size // a.patch_size) ** 2 + 1
    sharded = 3 * d * d + 3 * d + d * d + _pair(d, int(d * a.mlp_ratio))  # qkv, proj, MLP
    block = (sharded, 4 * d + 2 * d)  # norms; proj and fc2 biases
    first = 3 * a.patch_size**2 * d + d + d + tokens * d
    return ParamParts((block,) * a.depth, first, 2 * d + linear_params(d, num_classes))


def _volo_parts(a: Volo, img_size: int, num_classes: int) -> ParamParts:
    total = volo_params(a, img_size, num_classes)
    h, e0, k4 = a.stem_hidden_dim, a.embed_dims[0], a.kernel**4
    first = 3 * h * 49 + 2 * 9 * h * h + 3 * 2 * h + h * e0 * (a.patch_size // 2) ** 2 + e0
    grid = img_size // a.patch_size // a.pooling_scale
    first += grid * grid * a.embed_dims[-1]
    blocks: list[tuple[int, int]] = []
    for i, n_blocks in enumerate(a.layers):
        d, m = a.embed_dims[i], a.num_heads[i]
        hidden = int(d * a.mlp_ratio)
        attn = d * d + linear_params(d, k4 * m) + d * d if a.outlook[i] else 3 * d * d + d * d
        blocks += [(attn + _pair(d, hidden), 6 * d)] * n_blocks
        if a.downsamples[i] and i + 1 < len(a.layers):  # replicated, after the stage's blocks
            sharded, kept = blocks[-1]
            blocks[-1] = (sharded, kept + 4 * d * a.embed_dims[i + 1] + a.embed_dims[i + 1])
    in_blocks = sum(x + y for x, y in blocks)
    return ParamParts(tuple(blocks), first, total - first - in_blocks)


def param_parts(model: str, img_size: int = 224, num_classes: int = 1000) -> ParamParts:
    """The parameter count split as tensor and pipeline parallelism split it."""
    arch = arch_of(model)
    if isinstance(arch, Volo):
        return _volo_parts(arch, img_size, num_classes)
    return _vit_parts(arch, img_size, num_classes)


def params_per_rank(
    model: str, mesh: Mesh, img_size: int = 224, num_classes: int = 1000, fsdp: bool = False
) -> float:
    """Parameters the most loaded rank holds: its pipeline stage (stage 0 or the last, whichever
    is larger), tp-sharded block parts / tp, and everything / dp under FSDP (ZeRO-3)."""
    parts = param_parts(model, img_size, num_classes)
    worst = 0.0
    for stage, (start, end) in enumerate(stage_bounds(len(parts.blocks), mesh.pp)):
        own = sum(a / mesh.tp + b for a, b in parts.blocks[start:end])
        own += parts.first * (stage == 0) + parts.last * (stage == mesh.pp - 1)
        worst = max(worst, own)
    return worst / (mesh.dp if fsdp else 1)


def stage_bounds(blocks: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) blocks of each pipeline stage, split as trainer/pipeline_parallel.py does."""
    if stages > blocks:
        raise ValueError(f"--pp {stages}: the model has only {blocks} blocks; use at most that")
    cuts = [round(i * blocks / stages) for i in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def timm_param_count(model: str, img_size: int = 224, num_classes: int = 1000) -> int:
    """Trainable parameters counted by building the timm model on the meta device."""
    import torch

    from vitpod.analysis.memcheck import build_model

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


def _saved_blocks(model: str, img_size: int, num_classes: int, token_label: bool) -> tuple:
    arch = arch_of(model)
    if isinstance(arch, Volo):
        return _volo_activations(arch, img_size, num_classes, token_label)
    return _vit_activations(arch, img_size)


def _tp_split(block: Saved, tp: int) -> Saved:
    """Under tensor parallelism the norm inputs and the two column-parallel inputs (as many
    elements as the norm inputs) stay whole on each rank; the rest splits over tp."""
    return Saved(norm=block.norm, other=block.norm + (block.other - block.norm) / tp)


def _blocks_bytes(blocks: list, extra: float, precision: str, checkpointing: bool) -> float:
    half = 2 if precision in ("amp", "half") else 4
    extra_bytes = extra * (4 if precision == "fp32" else half)
    if not blocks:
        return extra_bytes
    if not checkpointing:
        return extra_bytes + sum(b.bytes(precision) for b in blocks)
    inputs = sum(b.norm / 2 for b in blocks) * (2 if precision == "half" else 4)
    return extra_bytes + inputs + max(b.bytes(precision) for b in blocks)


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
    blocks, extra = _saved_blocks(model, img_size, num_classes, token_label)
    return _blocks_bytes(blocks, extra, precision, checkpointing)


def stage_activation_bytes(
    model: str, img_size: int, mesh: Mesh, precision: str = "fp32", checkpointing: bool = False,
    num_classes: int = 1000, token_label: bool = False, micro_batches: int = 1,
    schedule: str = "1f1b",
) -> float:  # fmt: skip
    """Bytes per sample of one micro-batch that the most loaded rank keeps, times the
    micro-batches it holds at once: 1F1B keeps at most pp - stage in flight (stage 0 the
    most), GPipe all of them (Narayanan et al., arXiv:2104.04473, section 2.2). The stem and
    head activations are charged to every stage (an upper bound)."""
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"--pp-schedule must be 1f1b or gpipe, got {schedule!r}")
    blocks, extra = _saved_blocks(model, img_size, num_classes, token_label)
    blocks = [_tp_split(b, mesh.tp) for b in blocks]
    worst = 0.0
    for stage, (start, end) in enumerate(stage_bounds(len(blocks), mesh.pp)):
        in_flight = 1 if mesh.pp == 1 else micro_batches
        if schedule == "1f1b":
            in_flight = min(in_flight, mesh.pp - stage)
        per = _blocks_bytes(blocks[start:end], extra, precision, checkpointing)
        worst = max(worst, per * in_flight)
    return worst


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
    mesh: Mesh | None = None,
    fsdp: bool = False,
    micro_batches: int = 1,
    schedule: str = "1f1b",
) -> Plan:
    """Per-GPU memory for micro-batch `batch` with AdamW under ZeRO stage `zero` on `gpus` GPUs.

    With `mesh` (dp x tp x pp; `gpus` is then ignored) the most loaded rank's share: its
    pipeline stage, tp-split block weights and activations, and with `fsdp` (ZeRO-3 over dp)
    weights, gradients and optimizer states / dp. `micro_batches` (the accumulation steps)
    sets how many micro-batches a pipeline stage holds at once.

    Bytes per parameter: weights 4 (half: 2), gradients 4 (half: 2), AdamW 8 for two fp32
    moments (half: 12, plus the fp32 master). ZeRO-1 shards optimizer states, ZeRO-2 also
    gradients, ZeRO-3 also weights. Plain DDP (stage 0, several GPUs) keeps gradient buckets as
    large as the gradients (gradient_as_bucket_view=False, the default).
    """
    _check(precision, zero, gpus, batch)
    if mesh is not None:
        return _mesh_plan(model, img_size, batch, precision, zero, checkpointing, num_classes,
                          token_label, mesh, fsdp, micro_batches, schedule)  # fmt: skip
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


def _mesh_plan(
    model: str, img_size: int, batch: int, precision: str, zero: int, checkpointing: bool,
    num_classes: int, token_label: bool, mesh: Mesh, fsdp: bool, micro_batches: int,
    schedule: str,
) -> Plan:  # fmt: skip
    params = params_per_rank(model, mesh, img_size, num_classes)
    half = precision == "half"
    weights, grads, optim = params * (2 if half else 4), params * (2 if half else 4), params * 8
    optim += params * 4 if half else 0
    stage = 3 if fsdp else zero
    dp = mesh.dp
    per_sample = stage_activation_bytes(
        model, img_size, mesh, precision, checkpointing, num_classes, token_label, micro_batches,
        schedule,
    )  # fmt: skip
    return Plan(
        model=model,
        params=param_count(model, img_size, num_classes),
        weights=weights / (dp if stage >= 3 else 1),
        grads=grads / (dp if stage >= 2 else 1),
        optimizer=optim / (dp if stage >= 1 else 1),
        buffers=float(grads if stage == 0 and dp > 1 else 0),  # the all-reduce's flat copy
        activations=per_sample * batch,
        activation_per_sample=per_sample,
        settings={
            "img_size": img_size, "batch": batch, "precision": precision, "zero": stage,
            "mesh": mesh.as_dict(), "fsdp": fsdp, "micro_batches": micro_batches,
            "schedule": schedule, "checkpointing": checkpointing, "num_classes": num_classes,
            "token_label": token_label, "params_per_rank": params,
        },
    )  # fmt: skip


def max_micro_batch(gpu_mem_bytes: float, reserve_bytes: float = 1.0 * GIB, **kwargs: Any) -> int:
    """Largest micro-batch whose plan fits gpu_mem_bytes minus reserve_bytes (CUDA context,
    workspaces, fragmentation); 0 if not even the model states fit."""
    fixed = plan(batch=0, **kwargs)
    room = gpu_mem_bytes - reserve_bytes - fixed.total
    return max(0, int(room // fixed.activation_per_sample)) if room > 0 else 0


def _profile_path(profile: str) -> Path:
    path = Path(profile)
    if not path.suffix:
        path = Path(__file__).resolve().parent.parent / "workflows" / "profiles" / f"{profile}.yaml"
    if not path.is_file():
        raise ValueError(f"--profile {profile!r}: no such profile YAML ({path})")
    return path


def profile_node(data: dict[str, Any], stage: str) -> dict[str, Any]:
    """The node fields of a profile's stage: its partition's node type, or the top level of a
    profile with one kind of node."""
    if "node_types" not in data:
        return data
    kind = ((data.get("partitions") or {}).get(stage) or {}).get("node_type", "default")
    return (data.get("node_types") or {}).get(kind) or {}


def profile_gpu_memory(profile: str, stage: str = "pretrain") -> int:
    """gpu.memory_bytes of the node type a profile's stage runs on (a bundled name such as
    dgxpod, or a YAML path). Reads the YAML itself: analysis does not import workflows."""
    import yaml

    path = _profile_path(profile)
    node = profile_node(yaml.safe_load(path.read_text()) or {}, stage)
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
        from vitpod.analysis.memcheck import compare

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
