"""Activation bytes a ViT or VOLO keeps for backward, per sample and per pipeline stage."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vitpod.registry.models import Vit, Volo, arch_of, stage_bounds
from vitpod.registry.paralleldims import ParallelDims


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
    model: str, img_size: int, mesh: ParallelDims, precision: str = "fp32",
    checkpointing: bool = False, num_classes: int = 1000, token_label: bool = False,
    micro_batches: int = 1, schedule: str = "1f1b",
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
