"""The model registry: timm name, architecture, parameter count and defaults (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Volo:
    """timm VOLO hyper-parameters (timm.models.volo.VOLO arguments)."""

    layers: tuple[int, ...]
    embed_dims: tuple[int, ...]
    num_heads: tuple[int, ...]
    mlp_ratio: float = 3.0
    stem_hidden_dim: int = 64
    patch_size: int = 8
    downsamples: tuple[bool, ...] = (True, False, False, False)
    outlook: tuple[bool, ...] = (True, False, False, False)
    post_layers: int = 2
    kernel: int = 3
    pooling_scale: int = 2


@dataclass(frozen=True, kw_only=True)
class Vit:
    """timm VisionTransformer hyper-parameters (class token, learned pos-embed, qkv bias)."""

    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float = 4.0


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """One model: how timm builds it, its shape, and the trainer's defaults for it."""

    name: str
    timm_name: str | None
    """timm.create_model name; None: built from `arch` directly (the tiny test VOLO)."""
    arch: Volo | Vit
    recipe: str
    """Bundled stage recipe, workflows/recipes/<recipe>.yaml."""
    drop_path: float
    crop_pct: float
    lr_base: float
    """LR at a global batch of 1024 (LR = lr_base x batch / 1024)."""


# VOLO D1..D5: architecture from timm.models.volo (volo_d*_224); stochastic depth and crop ratio
# from the VOLO paper's model table (Yuan et al., arXiv:2106.13112); LRbase from sail-sg/volo's
# published training commands (d1 1.6e-3, d2..d5 1e-3 at batch 1024), which win over the paper
# table's LRbase row because that row disagrees with the paper's own text.
_VOLO = {
    "volo_d1": (Volo(layers=(4, 4, 8, 2), embed_dims=(192, 384, 384, 384),
                     num_heads=(6, 12, 12, 12)), 0.1, 0.96, 1.6e-3),
    "volo_d2": (Volo(layers=(6, 4, 10, 4), embed_dims=(256, 512, 512, 512),
                     num_heads=(8, 16, 16, 16)), 0.2, 0.96, 1e-3),
    "volo_d3": (Volo(layers=(8, 8, 16, 4), embed_dims=(256, 512, 512, 512),
                     num_heads=(8, 16, 16, 16)), 0.5, 0.96, 1e-3),
    "volo_d4": (Volo(layers=(8, 8, 16, 4), embed_dims=(384, 768, 768, 768),
                     num_heads=(12, 16, 16, 16)), 0.5, 1.15, 1e-3),
    "volo_d5": (Volo(layers=(12, 12, 20, 4), embed_dims=(384, 768, 768, 768),
                     num_heads=(12, 16, 16, 16), mlp_ratio=4.0, stem_hidden_dim=128),
                0.75, 1.15, 1e-3),
}  # fmt: skip
# ViT shapes: Dosovitskiy et al., arXiv:2010.11929 (Table 1) as timm builds them; defaults are
# timm train.py's (drop path 0.1, crop 0.875) with DeiT's LR 5e-4 x batch/512 (arXiv:2012.12877).
_VIT = {
    "vit_small_patch16_224": Vit(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch16_224": Vit(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # ViT-L/16 and ViT-H/14: arXiv:2010.11929, table 1; ViT-g/14: Zhai et al., "Scaling Vision
    # Transformers", arXiv:2106.04560 (timm's vit_giant_patch14_224).
    "vit_large_patch16_224": Vit(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
    "vit_huge_patch14_224": Vit(patch_size=14, embed_dim=1280, depth=32, num_heads=16),
    "vit_giant_patch14_224": Vit(
        patch_size=14, embed_dim=1408, depth=40, num_heads=16, mlp_ratio=48 / 11
    ),
}

MODELS: dict[str, ModelInfo] = {
    **{
        name: ModelInfo(name=name, timm_name=f"{name}_224", arch=arch, recipe=name,
                        drop_path=dp, crop_pct=crop, lr_base=lr)
        for name, (arch, dp, crop, lr) in _VOLO.items()
    },
    **{
        name: ModelInfo(name=name, timm_name=name, arch=arch, recipe=name, drop_path=0.1,
                        crop_pct=0.875, lr_base=1e-3)
        for name, arch in _VIT.items()
    },
    # A 4-block, 4-head ViT for tests (splits over tp 2/4 and pp 2/4): our own choice.
    "vit_micro": ModelInfo(
        name="vit_micro", timm_name=None,
        arch=Vit(patch_size=8, embed_dim=64, depth=4, num_heads=4),
        recipe="vit_micro", drop_path=0.1, crop_pct=0.875, lr_base=1e-3,
    ),
    # A VOLO small enough for CPU tests (a batch of 8 trains in ~10 ms): our own choice.
    "volo_tiny": ModelInfo(
        name="volo_tiny", timm_name=None,
        arch=Volo(layers=(1, 1), embed_dims=(32, 64), num_heads=(1, 2), stem_hidden_dim=16),
        recipe="volo_tiny", drop_path=0.1, crop_pct=0.96, lr_base=1.6e-3,
    ),
}  # fmt: skip


def canonical(name: str) -> str:
    """volo_d5_224 -> volo_d5 (timm's name of a registered model); other names unchanged."""
    for info in MODELS.values():
        if name == info.timm_name:
            return info.name
    return name


def known(name: str) -> bool:
    return canonical(name) in MODELS


def get(name: str) -> ModelInfo:
    """The registry entry of a model, or a ValueError listing the known names."""
    info = MODELS.get(canonical(name))
    if info is None:
        raise ValueError(f"--model {name!r} is not in the model registry; known: {sorted(MODELS)}")
    return info


def arch_of(name: str) -> Volo | Vit:
    return get(name).arch


def build(name: str, img_size: int, num_classes: int, drop_path: float = 0.0, **kwargs: Any) -> Any:
    """The timm model of a registered name, no pretrained weights (timm is imported here only,
    so the registry stays importable on a login node without torch); kwargs: more arguments of
    its constructor (timm's --drop as drop_rate, --model-kwargs)."""
    import timm
    from timm.models.vision_transformer import VisionTransformer
    from timm.models.volo import VOLO

    info = get(name)
    if info.timm_name is not None:
        return timm.create_model(
            info.timm_name, pretrained=False, img_size=img_size, num_classes=num_classes,
            drop_path_rate=drop_path, **kwargs,
        )  # fmt: skip
    a = info.arch
    if isinstance(a, Vit):
        return VisionTransformer(
            img_size=img_size, patch_size=a.patch_size, embed_dim=a.embed_dim, depth=a.depth,
            num_heads=a.num_heads, mlp_ratio=a.mlp_ratio, num_classes=num_classes,
            drop_path_rate=drop_path, **kwargs,
        )  # fmt: skip
    return VOLO(
        img_size=img_size, layers=list(a.layers), embed_dims=list(a.embed_dims),
        num_heads=list(a.num_heads), patch_size=a.patch_size, stem_hidden_dim=a.stem_hidden_dim,
        mlp_ratio=a.mlp_ratio, num_classes=num_classes, drop_path_rate=drop_path, **kwargs,
    )  # fmt: skip


VIT_TIMM_BASE = "vit_base_patch16_224"
"""The timm entry point our own ViTs are written as: its factory lets model_args override its
shape (dict(model_args, **kwargs)), and its other arguments are VisionTransformer's defaults."""
NOT_IN_TIMM = (
    "timm cannot rebuild a VOLO of another shape: each of its VOLO entry points (volo_d1_224 ...)"
    " passes layers, embed_dims and num_heads itself, so a config.json whose model_args gives"
    " them is a duplicate keyword (TypeError); model.pt is the only weights file"
)


def timm_architecture(name: str) -> tuple[str, dict[str, Any]] | None:
    """The timm entry point and shape arguments that `timm.create_model(arch, img_size=...,
    num_classes=..., **args)` rebuilds `name` with; None for a model timm cannot (NOT_IN_TIMM)."""
    if not known(name):
        return name, {}  # a timm name the trainer builds with timm.create_model
    info = get(name)
    if info.timm_name is not None:
        return info.timm_name, {}
    a = info.arch
    if isinstance(a, Vit):
        return VIT_TIMM_BASE, {"patch_size": a.patch_size, "embed_dim": a.embed_dim,
                               "depth": a.depth, "num_heads": a.num_heads,
                               "mlp_ratio": a.mlp_ratio}  # fmt: skip
    return None


# ---------------------------------------------------------------- parameter counts


def linear_params(n_in: int, n_out: int, bias: bool = True) -> int:
    """Parameters of an nn.Linear(n_in, n_out)."""
    return n_in * n_out + (n_out if bias else 0)


def _mlp(dim: int, ratio: float) -> int:
    hidden = int(dim * ratio)
    return linear_params(dim, hidden) + linear_params(hidden, dim)


def volo_params(a: Volo, img_size: int, num_classes: int) -> int:
    """Parameters of timm's VOLO with architecture `a` (tested against the built model)."""
    h, e0, k4 = a.stem_hidden_dim, a.embed_dims[0], a.kernel**4
    stem = 3 * h * 49 + 2 * 9 * h * h + 3 * 2 * h  # 7x7, two 3x3 convs (no bias), 3 BatchNorms
    total = stem + h * e0 * (a.patch_size // 2) ** 2 + e0  # patch projection
    grid = img_size // a.patch_size // a.pooling_scale
    dim = a.embed_dims[-1]
    total += grid * grid * dim  # pos_embed
    for i, n_blocks in enumerate(a.layers):
        d, m = a.embed_dims[i], a.num_heads[i]
        if a.outlook[i]:
            # v (no bias), attention, proj
            attn = d * d + linear_params(d, k4 * m) + linear_params(d, d)
        else:
            attn = 3 * d * d + linear_params(d, d)  # qkv (no bias), proj
        total += n_blocks * (4 * d + attn + _mlp(d, a.mlp_ratio))
        if a.downsamples[i] and i + 1 < len(a.layers):
            total += 4 * d * a.embed_dims[i + 1] + a.embed_dims[i + 1]
    class_block = 4 * dim + 3 * dim * dim + linear_params(dim, dim) + _mlp(dim, a.mlp_ratio)
    total += a.post_layers * class_block + dim  # class-attention blocks, cls token
    return total + 2 * dim + 2 * linear_params(dim, num_classes)  # final norm, aux head, head


def vit_params(a: Vit, img_size: int, num_classes: int) -> int:
    d, tokens = a.embed_dim, (img_size // a.patch_size) ** 2 + 1
    total = 3 * a.patch_size**2 * d + d + d + tokens * d  # patch conv, cls token, pos_embed
    block = 4 * d + linear_params(d, 3 * d) + linear_params(d, d) + _mlp(d, a.mlp_ratio)
    return total + a.depth * block + 2 * d + linear_params(d, num_classes)


def param_count(name: str, img_size: int = 224, num_classes: int = 1000) -> int:
    """Trainable parameters from the architecture arithmetic (equals timm's count, tested)."""
    arch = arch_of(name)
    if isinstance(arch, Volo):
        return volo_params(arch, img_size, num_classes)
    return vit_params(arch, img_size, num_classes)


# ---------------------------------------------------------------- model-parallel splits


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


def param_parts(name: str, img_size: int = 224, num_classes: int = 1000) -> ParamParts:
    """The parameter count split as tensor and pipeline parallelism split it."""
    arch = arch_of(name)
    if isinstance(arch, Volo):
        return _volo_parts(arch, img_size, num_classes)
    return _vit_parts(arch, img_size, num_classes)


def stage_bounds(blocks: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) blocks of each pipeline stage (trainer/engines/pipeline_parallel.py splits by
    it)."""
    if stages > blocks:
        raise ValueError(f"--pp {stages}: the model has only {blocks} blocks; use at most that")
    cuts = [round(i * blocks / stages) for i in range(stages + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))
