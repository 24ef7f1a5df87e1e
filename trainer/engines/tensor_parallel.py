"""Megatron-style tensor parallelism for timm ViT and VOLO blocks, one plain function per family.

Column-wise the first linear of each pair (qkv, fc1; VOLO's v and attn), row-wise the second
(proj, fc2): one all-reduce in the forward and one in the backward per pair (Shoeybi et al.,
"Megatron-LM", arXiv:1909.08053, section 3), with torch's DTensor ParallelStyles
(https://pytorch.org/docs/stable/distributed.tensor.parallel.html).

A column split of timm's fused qkv weight, laid out [q; k; v], would give rank 0 all of q and
half of k. The weight is therefore stored head-major, [h0: q k v; h1: q k v; ...], whatever
the tp degree, so a contiguous row shard holds whole heads. The layout does not depend on tp,
so sharded checkpoints load into any mesh; model/qkv_layout.py restores timm's order for export.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.layers.attention import Attention as VitAttention
from timm.models.volo import Attention as VoloAttention
from timm.models.volo import OutlookAttention
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from vitpod.trainer.config import ConfigError
from vitpod.trainer.model.qkv_layout import attentions, head_major


@torch.no_grad()
def use_head_major_qkv(model: nn.Module) -> None:
    """Re-order every fused qkv weight head-major and switch the attention to read it so."""
    for _, attn in attentions(model):
        if isinstance(attn, VitAttention) and (
            attn.gate is not None or not isinstance(attn.norm, nn.Identity)
        ):
            raise ValueError("--tp/--pp/--fsdp: gated or scale-normed ViT attention is not split")
        for p in attn.qkv.parameters():
            p.copy_(head_major(p, attn.num_heads))
        forward = _vit_attention if isinstance(attn, VitAttention) else _volo_attention
        attn.forward = types.MethodType(forward, attn)  # type: ignore[method-assign]


def _local_heads(qkv: torch.Tensor, head_dim: int) -> int:
    return qkv.shape[-1] // (3 * head_dim)


def _vit_attention(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
    """timm's Attention.forward on head-major qkv with this rank's heads only."""
    B, N, _ = x.shape
    qkv = self.qkv(x)
    heads = _local_heads(qkv, self.head_dim)
    q, k, v = qkv.reshape(B, N, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    x = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal,
        dropout_p=self.attn_drop.p if self.training else 0.0,
    )  # fmt: skip
    x = x.transpose(1, 2).reshape(B, N, heads * self.head_dim)
    return self.proj_drop(self.proj(x))


def _volo_attention(self, x: torch.Tensor) -> torch.Tensor:
    """timm's VOLO Attention.forward (B, H, W, C) on head-major qkv, this rank's heads only."""
    B, H, W, C = x.shape
    head_dim = C // self.num_heads
    qkv = self.qkv(x)
    heads = _local_heads(qkv, head_dim)
    q, k, v = qkv.reshape(B, H * W, heads, 3, head_dim).permute(3, 0, 2, 1, 4).unbind(0)
    x = F.scaled_dot_product_attention(
        q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0
    )
    x = x.transpose(1, 2).reshape(B, H, W, heads * head_dim)
    return self.proj_drop(self.proj(x))


def _outlook_attention(self, x: torch.Tensor) -> torch.Tensor:
    """timm's OutlookAttention.forward with v and attn split by heads (local channels)."""
    B, H, W, _ = x.shape
    k2 = self.kernel_size * self.kernel_size
    v = self.v(x).permute(0, 3, 1, 2)
    c_local = v.shape[1]
    h, w = math.ceil(H / self.stride), math.ceil(W / self.stride)
    attn = self.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    attn = self.attn(attn)
    heads = attn.shape[-1] // (k2 * k2)
    v = self.unfold(v).reshape(B, heads, c_local // heads, k2, h * w).permute(0, 1, 4, 3, 2)
    attn = attn.reshape(B, h * w, heads, k2, k2).permute(0, 2, 1, 3, 4)
    attn = self.attn_drop((attn * self.scale).softmax(dim=-1))
    x = (attn @ v).permute(0, 1, 4, 3, 2).reshape(B, c_local * k2, h * w)
    x = F.fold(x, output_size=(H, W), kernel_size=self.kernel_size, padding=self.padding,
               stride=self.stride)  # fmt: skip
    return self.proj_drop(self.proj(x.permute(0, 2, 3, 1)))


def _pair_plan(first: list[str], second: str) -> dict:
    plan: dict = {name: ColwiseParallel() for name in first}
    plan[second] = RowwiseParallel()
    return plan


def _check_divisible(what: str, value: int, tp: int) -> None:
    # Heads are the unit of a Megatron split: a rank computes whole heads.
    if value % tp:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        raise ConfigError(
            f"--tp {tp}: the model's {what} ({value}) do not split over {tp} ranks; pass --tp one"
            f" of {divisors} or a model whose {what} divide by {tp}"
        )


def parallelize_vit_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """ViT blocks: qkv and fc1 column-wise, proj and fc2 row-wise; norms stay replicated."""
    tp = tp_mesh.size()
    for block in _blocks(model, "Block"):
        _check_divisible("attention heads", block.attn.num_heads, tp)
        _check_divisible("MLP hidden size", block.mlp.fc1.out_features, tp)
        plan = {**_pair_plan(["attn.qkv"], "attn.proj"), **_pair_plan(["mlp.fc1"], "mlp.fc2")}
        parallelize_module(block, tp_mesh, plan)


def parallelize_volo_tp(model: Any, tp_mesh: DeviceMesh) -> None:
    """VOLO: outlookers (v and attn column-wise by head, proj row-wise), transformer blocks
    (qkv column-wise, proj row-wise) and every MLP; the class-attention blocks stay replicated."""
    tp = tp_mesh.size()
    block: Any
    for block in model.network.modules():
        attn = getattr(block, "attn", None)
        if isinstance(attn, OutlookAttention):
            _check_divisible("outlooker heads", attn.num_heads, tp)
            attn.forward = types.MethodType(_outlook_attention, attn)  # type: ignore[method-assign]
            plan = _pair_plan(["attn.v", "attn.attn"], "attn.proj")
        elif isinstance(attn, VoloAttention):
            _check_divisible("attention heads", attn.num_heads, tp)
            plan = _pair_plan(["attn.qkv"], "attn.proj")
        else:
            continue
        if isinstance(getattr(block, "mlp", None), Mlp):
            _check_divisible("MLP hidden size", block.mlp.fc1.out_features, tp)
            plan.update(_pair_plan(["mlp.fc1"], "mlp.fc2"))
        parallelize_module(block, tp_mesh, plan)


def _blocks(model: nn.Module, class_name: str) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__ == class_name]
