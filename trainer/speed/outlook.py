"""--outlook-kernel fused|triton: VOLO's outlook attention without timm's unfold/fold."""

from __future__ import annotations

import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from timm.models.volo import OutlookAttention
from torch import nn

from vitpod.trainer.config import OUTLOOK_KERNELS as KERNELS
from vitpod.trainer.config import ConfigError


def _offsets(kernel: int) -> list[tuple[int, int]]:
    return [(ki, kj) for ki in range(kernel) for kj in range(kernel)]


def _window(tensor: torch.Tensor, ki: int, kj: int, h: int, w: int, stride: int) -> torch.Tensor:
    """Slice [B, Hp, Wp, C] at the window offset (ki, kj) of every output position."""
    rows = slice(ki, ki + stride * (h - 1) + 1, stride)
    return tensor[:, rows, kj : kj + stride * (w - 1) + 1 : stride]


class FusedOutlookAttention(OutlookAttention):
    """timm's OutlookAttention with the unfold-free forward (the backward is autograd's).

    Outlook attention (VOLO, arXiv:2106.13112, section 3.1) gathers each KxK window of values,
    mixes it with attention weights generated from the window's centre, and folds the windows
    back, summing the overlaps. timm writes this as nn.Unfold -> matmul -> F.fold, which inductor
    lowers to im2col/col2im copies. Here the K*K window offsets are strided slices of the padded
    values (gather) and strided slice-adds into a padded buffer (fold), with one einsum between:
    elementwise work and one batched contraction that inductor can fuse. Same parameters and
    state_dict keys: `use_fused_outlook` swaps the class of timm's modules in place.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        k, s, p, heads = self.kernel_size, self.stride, self.padding, self.num_heads
        h, w = math.ceil(H / s), math.ceil(W / s)
        v = F.pad(self.v(x), (0, 0, p, p, p, p))  # B, H+2p, W+2p, C (zeros, like unfold's)
        windows = torch.stack([_window(v, ki, kj, h, w, s) for ki, kj in _offsets(k)], dim=3)
        windows = windows.reshape(B, h, w, k * k, heads, C // heads)
        attn = self.pool(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        attn = self.attn(attn).reshape(B, h, w, heads, k * k, k * k) * self.scale
        attn = self.attn_drop(attn.softmax(dim=-1))
        out = torch.einsum("bijnkl,bijlnd->bijknd", attn, windows).reshape(B, h, w, k * k, C)
        folded = x.new_zeros(B, H + 2 * p + s, W + 2 * p + s, C)  # + s: room for the last slice
        for index, (ki, kj) in enumerate(_offsets(k)):
            rows = slice(ki, ki + s * (h - 1) + 1, s)
            cols = slice(kj, kj + s * (w - 1) + 1, s)
            folded[:, rows, cols] = folded[:, rows, cols] + out[:, :, :, index]
        return self.proj_drop(self.proj(folded[:, p : p + H, p : p + W]))


class TritonUnavailable(ConfigError):
    """--outlook-kernel triton where its kernels cannot run; one line naming the fix."""


def _swap(model: nn.Module, cls: type[OutlookAttention]) -> int:
    swapped = 0
    for module in model.modules():
        if type(module) is OutlookAttention:
            module.__class__ = cls
            swapped += 1
    return swapped


def use_fused_outlook(model: nn.Module) -> int:
    """Swap every timm OutlookAttention of `model` to the fused forward; returns how many."""
    return _swap(model, FusedOutlookAttention)


def triton_problem(device: torch.device) -> str:
    """Why --outlook-kernel triton cannot run on `device` ('' when it can). CPU tensors run
    only under Triton's interpreter (TRITON_INTERPRET=1: tests, gpu_check --rehearse)."""
    fix = "use --outlook-kernel fused or timm"
    if importlib.util.find_spec("triton") is None:
        return (
            "--outlook-kernel triton: the triton package is not installed in this environment "
            f"(torch's Linux wheels bring it; pip install triton); or {fix}"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return ""
    if device.type != "cuda":
        return f"--outlook-kernel triton: needs a CUDA GPU and this rank runs on {device}; {fix}"
    return ""


def use_triton_outlook(model: nn.Module, device: torch.device) -> int:
    """Swap every timm OutlookAttention to the Triton kernels; TritonUnavailable first where
    they cannot run on `device`. Returns how many were swapped."""
    problem = triton_problem(device)
    if problem:
        raise TritonUnavailable(problem)
    from vitpod.trainer.speed.outlook_triton import TritonOutlookAttention  # imports triton

    return _swap(model, TritonOutlookAttention)


def apply_outlook_kernel(model: nn.Module, kernel: str, device: torch.device) -> int:
    """The --outlook-kernel choice: 'timm' leaves the model as built."""
    if kernel not in KERNELS:
        raise ValueError(f"--outlook-kernel {kernel}: choose one of {', '.join(KERNELS)}")
    if kernel == "triton":
        return use_triton_outlook(model, device)
    return use_fused_outlook(model) if kernel == "fused" else 0
