"""What a GPU model can do natively, by name: its compute capability and so its bf16 support.

Torch-free: the planner on a login node reads it from a profile's `node_types.<t>.gpu.model`;
the trainer on the node checks the same rule against torch's own capability. The one place that
says which GPUs have bf16 tensor cores (compute capability 8.0, Ampere, and newer).
"""

from __future__ import annotations

from dataclasses import dataclass

BF16_MIN_CAPABILITY = (8, 0)
"""bf16 tensor cores: Ampere (sm_80) and newer. V100 (7.0) and T4 (7.5) have fp16 ones only."""

# Matched by substring of the model name (a profile's gpu.model or torch.cuda.get_device_name),
# upper-cased, first match wins (A100 before A10). From NVIDIA's CUDA GPUs compute-capability table.
CAPABILITIES: tuple[tuple[str, tuple[int, int]], ...] = (
    ("B200", (10, 0)),
    ("GB200", (10, 0)),
    ("H200", (9, 0)),
    ("H100", (9, 0)),
    ("GH200", (9, 0)),
    ("L40", (8, 9)),
    ("L4", (8, 9)),
    ("A100", (8, 0)),
    ("A30", (8, 0)),
    ("A40", (8, 6)),
    ("A10", (8, 6)),
    ("V100", (7, 0)),
    ("T4", (7, 5)),
    ("P100", (6, 0)),
)


def capability_of(model: str) -> tuple[int, int] | None:
    """The compute capability of a GPU model name, or None when the table does not know it."""
    name = model.upper()
    for key, capability in CAPABILITIES:
        if key in name:
            return capability
    return None


def bf16_native(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has bf16 tensor cores."""
    return tuple(capability) >= BF16_MIN_CAPABILITY


def amp_dtype_for(capability: tuple[int, int]) -> str:
    """The autocast dtype for a GPU: bf16 where native, else fp16 (with dynamic loss scaling)."""
    return "bf16" if bf16_native(capability) else "fp16"


@dataclass(frozen=True)
class Peak:
    """Dense tensor-core peak of one GPU for the training dtype, and the datasheet it is from."""

    flops: float
    dtype: str
    source: str


# Matched by substring of torch.cuda.get_device_name(), first match wins (H100 NVL before H100).
# Dense (no 2:4 sparsity) figures: the datasheets print the sparse ones with an asterisk.
# The trainer's MFU (trainer/hardware.py) and the placement's step estimate use them.
PEAKS: tuple[tuple[str, Peak], ...] = (
    ("H200", Peak(989e12, "bf16", "NVIDIA H200 Tensor Core GPU datasheet (SXM, BF16 dense)")),
    ("H100 NVL", Peak(835e12, "bf16", "NVIDIA H100 Tensor Core GPU datasheet (NVL, BF16 dense)")),
    ("H100 PCIe", Peak(756e12, "bf16", "NVIDIA H100 Tensor Core GPU datasheet (PCIe, BF16 dense)")),
    ("H100", Peak(989e12, "bf16", "NVIDIA H100 Tensor Core GPU datasheet (SXM, BF16 dense)")),
    ("A100", Peak(312e12, "bf16", "NVIDIA A100 Tensor Core GPU datasheet (BF16 dense)")),
    ("L40S", Peak(362e12, "bf16", "NVIDIA L40S datasheet (BF16 dense)")),
    ("A10", Peak(125e12, "bf16", "NVIDIA A10 Tensor Core GPU datasheet (BF16 dense)")),
    ("V100", Peak(125e12, "fp16", "NVIDIA Tesla V100 datasheet (SXM2, FP16 tensor)")),
)


def _words(name: str) -> str:
    return " ".join(name.upper().replace("-", " ").replace("_", " ").split())


def kind(name: str) -> str:
    """One name for a GPU model however it is written (a profile's `A100-SXM4-80GB`, torch's
    `NVIDIA A100-SXM4-80GB`): its PEAKS key, else its CAPABILITIES key, else the name itself;
    'cpu' for a CPU (or no name)."""
    words = _words(name)
    if words in ("", "CPU"):
        return "cpu"
    for key, _ in PEAKS:
        if _words(key) in words:
            return key
    for key, _ in CAPABILITIES:
        if key in words:
            return key
    return words.removeprefix("NVIDIA ")


def peak_of(name: str) -> Peak | None:
    """The dense 16-bit peak of a GPU model (PEAKS, matched as `kind` matches), or None."""
    found = kind(name)
    return next((peak for key, peak in PEAKS if key == found), None)
