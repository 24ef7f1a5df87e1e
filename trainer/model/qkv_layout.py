"""The order of a fused qkv weight's rows: timm's [q; k; v], or head-major [h0: q k v; ...].

The mesh engine stores qkv head-major, whatever the tp degree, so that a contiguous row shard
holds whole heads (engines/tensor_parallel.py); a model saved so is turned back into timm's
order when it is exported or loaded into an unsplit model (models.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from timm.layers.attention import Attention as VitAttention
from timm.models.volo import Attention as VoloAttention
from torch import nn

QKV_SUFFIXES = (".qkv.weight", ".qkv.bias")


def head_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[q; k; v] rows (3, H, hd, ...) -> head-major rows (H, 3, hd, ...)."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def timm_major(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Head-major rows (H, 3, hd, ...) -> timm's [q; k; v] rows."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def attentions(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, module) of every ViT or VOLO attention with a fused qkv."""
    for name, module in model.named_modules():
        if isinstance(module, VitAttention | VoloAttention):
            yield name, module


def to_timm_layout(
    state: dict[str, torch.Tensor], heads: dict[str, int]
) -> dict[str, torch.Tensor]:
    """A full state dict in head-major qkv order -> timm's order (heads: attention name -> H)."""
    out = dict(state)
    for name, h in heads.items():
        for suffix in QKV_SUFFIXES:
            key = name + suffix
            if key in out:
                out[key] = timm_major(out[key], h)
    return out


def attention_heads(model: nn.Module) -> dict[str, int]:
    """Attention module name -> its (global) number of heads, for `to_timm_layout`."""
    return {name: attn.num_heads for name, attn in attentions(model)}
