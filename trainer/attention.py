"""Choose timm's attention kernel, fused SDPA or explicit softmax(QK^T)V, by timing both here."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from trainer.precision import Precision

log = logging.getLogger(__name__)
KERNELS = ("fused", "math")
ROUNDS = 3  # timed forward+backward passes of each kernel; the fastest counts
PROBE_BATCH = 4  # both kernels batch over (images x heads): their ratio barely moves with it


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """timm attention blocks: each reads its own `fused_attn` attribute in forward()."""
    return [m for m in model.modules() if isinstance(getattr(m, "fused_attn", None), bool)]


def set_kernel(model: nn.Module, kernel: str) -> None:
    for module in attention_modules(model):
        _use_fused(module, kernel == "fused")


def _use_fused(module: nn.Module, fused: bool) -> None:
    module.fused_attn = fused  # type: ignore[assignment]  # a plain bool read by forward()


def choose_kernel(
    model: nn.Module, requested: str, precision: Precision, batch: int, img_size: int
) -> str:
    """`requested` (auto, fused, math) -> the kernel every rank uses, already set on `model`.

    auto: fused on GPUs (flash / memory-efficient SDPA). On CPUs both are timed on the model's
    first attention block at the training batch and dtype: PyTorch's CPU flash-attention backward
    is several times its forward, so for a few hundred tokens under bf16 autocast the explicit
    form was 1.3x faster for a whole VOLO-D1 step on the 2-core EPYC we measured, while in fp32
    the fused kernel was faster. Rank 0 decides and broadcasts: replicas run one kernel.
    """
    kernel = requested
    if requested == "auto" and precision.device.type == "cuda":
        kernel = "fused"
    elif requested == "auto":
        kernel = _faster_on_cpu(model, precision, batch, img_size)
    if dist.is_available() and dist.is_initialized():
        chosen = [kernel]
        dist.broadcast_object_list(chosen, src=0)
        kernel = chosen[0]
    set_kernel(model, kernel)
    return kernel


def _faster_on_cpu(model: nn.Module, precision: Precision, batch: int, img_size: int) -> str:
    modules = attention_modules(model)
    shape = _input_shape(model, modules[0], precision, img_size) if modules else None
    if shape is None:
        return "fused"
    block = modules[0]
    generator = torch.Generator().manual_seed(0)  # the global RNG stays as the seed left it
    x = torch.randn((min(batch, PROBE_BATCH), *shape[1:]), generator=generator).to(precision.device)
    x.requires_grad_(True)
    seconds = {kernel: float("inf") for kernel in KERNELS}
    for rep in range(ROUNDS + 1):  # interleaved, so a burst of other load hits both kernels
        for kernel in KERNELS:
            took = _time_block(block, x, kernel, precision)
            if rep:  # the first round warms up each kernel
                seconds[kernel] = min(seconds[kernel], took)
    block.zero_grad(set_to_none=True)
    best = min(seconds, key=seconds.__getitem__)
    log.info("attention kernel: %s (fwd+bwd of one block: %s)", best,
             ", ".join(f"{k} {1e3 * s:.1f} ms" for k, s in seconds.items()))  # fmt: skip
    return best


def _input_shape(
    model: nn.Module, block: nn.Module, precision: Precision, img_size: int
) -> torch.Size | None:
    """The block's input shape, seen in one batch-1 forward."""
    seen: list[torch.Size] = []
    hook = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), precision.autocast():
            model(torch.zeros(1, 3, img_size, img_size, device=precision.device))
    finally:
        hook.remove()
        model.train(was_training)
    return seen[0] if seen else None


def _time_block(block: nn.Module, x: torch.Tensor, kernel: str, precision: Precision) -> float:
    _use_fused(block, kernel == "fused")
    start = time.perf_counter()
    with precision.autocast():
        out = block(x)
    out.float().sum().backward()
    return time.perf_counter() - start
