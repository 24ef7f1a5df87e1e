"""What this rank's hardware can do: native bf16 on the CPU, float8 on the GPU, peak FLOP/s."""

from __future__ import annotations

from pathlib import Path

import torch

from vitpod.registry.gpus import BF16_MIN_CAPABILITY, PEAKS, Peak, bf16_native

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have float8 tensor cores


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU feature flags of /proc/cpuinfo's first `flags` line (empty where unreadable)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_vector_flags() -> dict[str, list[str]]:
    """What benchmark results record of the CPU: its AVX/AMX/FMA flags and the bf16 ones."""
    flags = cpu_flags()
    return {
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
        "cpu_bf16": sorted(set(CPU_BF16_FLAGS) & flags),
    }


def cpu_has_bf16(flags: set[str] | None = None) -> bool:
    """AVX512-BF16 or AMX-BF16: without either, oneDNN emulates bf16 matmuls (slowly)."""
    return bool(set(CPU_BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def bf16_cpu_warning(device: torch.device, dtype: torch.dtype | None, flags: set[str]) -> str:
    """One line when bf16 autocast runs on a CPU that emulates it; '' otherwise."""
    if device.type != "cpu" or dtype is not torch.bfloat16 or cpu_has_bf16(flags):
        return ""
    return (
        "bf16 autocast on a CPU without avx512_bf16/amx_bf16 is emulated and many times slower "
        "than fp32 (timm train.py: ~9 min for 10 vit_small steps); drop --amp for fp32"
    )


def bf16_problem(device: torch.device, capability: tuple[int, int] | None = None) -> str:
    """Why bf16 autocast should not run on `device` ('' if it may): a GPU older than compute
    capability 8.0 (V100, T4) has no bf16 tensor cores (torch would emulate it, slowly)."""
    if device.type != "cuda":
        return ""
    major, minor = capability or torch.cuda.get_device_capability(device)
    if bf16_native((major, minor)):
        return ""
    need = ".".join(map(str, BF16_MIN_CAPABILITY))
    return (
        f"--amp-dtype bf16: this GPU ({device_name(device)}) has compute capability "
        f"{major}.{minor}, bf16 tensor cores need >= {need}; use --amp-dtype fp16 (dynamic loss "
        "scaling)"
    )


def device_name(device: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError):
        return "cuda"


def fp8_problem(device: torch.device, capability: tuple[int, int] | None = None) -> str:
    """Why --fp8 cannot run on `device` ('' if it can): float8 matmuls need sm_89 or newer."""
    if device.type != "cuda":
        return (
            "--fp8: float8 matmuls need an NVIDIA GPU of compute capability >= 8.9; this rank "
            f"runs on {device.type}; drop --fp8"
        )
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        return (
            f"--fp8: this GPU has compute capability {major}.{minor}, float8 needs >= 8.9 "
            "(Ada, Hopper or newer); drop --fp8"
        )
    return ""


def peak_flops(
    device: torch.device, name: str | None = None, dtype: str = "bf16"
) -> tuple[Peak | None, str]:
    """(peak, '') for a GPU in PEAKS, else (None, the reason MFU is not computed). `dtype` is
    the steps' compute dtype: the table holds 16-bit tensor-core peaks (bf16 and fp16 are the
    same figure on the GPUs listed), so an fp32 run has no MFU rather than one against them."""
    if device.type != "cuda":
        return None, f"no peak FLOP/s table entry for a {device.type} device"
    if dtype not in ("bf16", "fp16"):
        return None, f"{dtype} steps: the peak table holds 16-bit tensor-core peaks (use --amp)"
    name = name or torch.cuda.get_device_name(device)
    for key, peak in PEAKS:
        if key in name:
            return peak, ""
    return None, f"GPU '{name}' is not in vitpod.registry.gpus.PEAKS"
