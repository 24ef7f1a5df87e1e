"""What a GPU model can do natively, by name: its compute capability and so its bf16 support.

Torch-free: the planner on a login node reads it from a profile's `node_types.<t>.gpu.model`;
the trainer on the node checks the same rule against torch's own capability. The one place that
says which GPUs have bf16 tensor cores (compute capability 8.0, Ampere, and newer).
"""

from __future__ import annotations

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
