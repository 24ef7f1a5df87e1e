"""Which of timm's attention kernels runs: fused SDPA or the explicit softmax(QK^T)V."""

from __future__ import annotations

import torch
from torch import nn

KERNELS = ("fused", "math")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """timm attention blocks: each reads its own `fused_attn` attribute in forward()."""
    return [m for m in model.modules() if isinstance(getattr(m, "fused_attn", None), bool)]


def set_kernel(model: nn.Module, kernel: str) -> None:
    for module in attention_modules(model):
        module.fused_attn = kernel == "fused"  # type: ignore[assignment]  # a plain bool


def auto_kernel(device: torch.device, autocast_dtype: torch.dtype | None) -> str:
    """fused on GPUs (flash / memory-efficient SDPA) and for fp32 on CPUs; the explicit form
    under bf16/fp16 autocast on CPUs, where PyTorch's flash-attention backward takes several
    times its forward. Measured on the 2-core EPYC (benchmarks/attention.py, VOLO-D1, batch 8,
    224 px): bf16 block forward + backward 26 ms explicit vs 41 ms fused, training step 1.52 s
    vs 1.80 s; fp32 steps 2.67 s fused vs 2.90 s explicit. A rule, not a timing taken per run:
    the same flags give the same kernel, so two runs (or a run and its resumption) compute the
    same numbers."""
    if device.type == "cpu" and autocast_dtype is not None:
        return "math"
    return "fused"


def choose_kernel(
    model: nn.Module, requested: str, device: torch.device, autocast_dtype: torch.dtype | None
) -> str:
    """`requested` (auto, fused, math) -> the kernel, set on every attention block of `model`."""
    kernel = auto_kernel(device, autocast_dtype) if requested == "auto" else requested
    set_kernel(model, kernel)
    return kernel
