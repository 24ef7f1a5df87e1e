"""Memory estimate: per-GPU bytes of weights, gradients, AdamW states, activations (ViT, VOLO)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vitpod.analysis.activations import activation_bytes, stage_activation_bytes
from vitpod.registry.models import param_count, param_parts, stage_bounds
from vitpod.registry.paralleldims import ParallelDims

PRECISIONS = ("fp32", "amp", "half")
"""fp32: everything fp32. amp: torch.amp autocast (fp32 weights, half activations). half:
DeepSpeed fp16/bf16 (half weights and gradients, fp32 master copy in the optimizer)."""
AMP_DTYPES = (None, "bf16", "fp16")
"""The half dtype of amp/half (vitpod.registry.gpus chooses it from the GPU). Both take 2 bytes
per element; fp16's dynamic loss scaling adds one scale tensor and no per-parameter bytes."""
ZERO_STAGES = (0, 1, 2, 3)
GIB = 1024**3


def params_per_rank(
    model: str, mesh: ParallelDims, img_size: int = 224, num_classes: int = 1000, fsdp: bool = False
) -> float:
    """Parameters the most loaded rank holds: its pipeline stage (stage 0 or the last, whichever
    is larger), tp-sharded block parts / tp, and everything / dp under FSDP (ZeRO-3)."""
    parts = param_parts(model, img_size, num_classes)
    worst = 0.0
    for stage, (start, end) in enumerate(stage_bounds(len(parts.blocks), mesh.pp)):
        own = sum(a / mesh.tp + b for a, b in parts.blocks[start:end])
        own += parts.first * (stage == 0) + parts.last * (stage == mesh.pp - 1)
        worst = max(worst, own)
    return worst / (mesh.dp if fsdp else 1)


@dataclass(slots=True)
class MemoryEstimate:
    """Per-GPU bytes of one training configuration."""

    model: str
    params: int
    weights: float
    grads: float
    optimizer: float
    buffers: float
    activations: float
    activation_per_sample: float
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.buffers + self.activations

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def _check(precision: str, zero: int, gpus: int, batch: int, amp_dtype: str | None) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    if amp_dtype not in AMP_DTYPES:
        raise ValueError(f"amp_dtype must be one of {AMP_DTYPES}, got {amp_dtype!r}")
    if zero not in ZERO_STAGES:
        raise ValueError(f"--zero-stage must be one of {ZERO_STAGES}, got {zero!r}")
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if batch < 0:
        raise ValueError(f"--batch must be >= 0, got {batch}")


def estimate(
    model: str,
    img_size: int = 224,
    batch: int = 1,
    precision: str = "fp32",
    zero: int = 0,
    gpus: int = 1,
    checkpointing: bool = False,
    num_classes: int = 1000,
    token_label: bool = False,
    mesh: ParallelDims | None = None,
    fsdp: bool = False,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    amp_dtype: str | None = None,
) -> MemoryEstimate:
    """Per-GPU memory for micro-batch `batch` with AdamW under ZeRO stage `zero` on `gpus` GPUs.

    With `mesh` (dp x tp x pp; `gpus` is then ignored) the most loaded rank's share: its
    pipeline stage, tp-split block weights and activations, and with `fsdp` (ZeRO-3 over dp)
    weights, gradients and optimizer states / dp. `micro_batches` (the accumulation steps)
    sets how many micro-batches a pipeline stage holds at once.

    Bytes per parameter: weights 4 (half: 2), gradients 4 (half: 2), AdamW 8 for two fp32
    moments (half: 12, plus the fp32 master). ZeRO-1 shards optimizer states, ZeRO-2 also
    gradients, ZeRO-3 also weights. Plain DDP (stage 0, several GPUs) keeps gradient buckets as
    large as the gradients (gradient_as_bucket_view=False, the default).
    """
    _check(precision, zero, gpus, batch, amp_dtype)
    if mesh is not None:
        found = _mesh_estimate(
            model, img_size, batch, precision, zero, checkpointing, num_classes, token_label,
            mesh, fsdp, micro_batches, schedule,
        )  # fmt: skip
        found.settings["amp_dtype"] = amp_dtype
        return found
    params = param_count(model, img_size, num_classes)
    half = precision == "half"
    weights, grads, optim = params * (2 if half else 4), params * (2 if half else 4), params * 8
    optim += params * 4 if half else 0
    per_sample = activation_bytes(
        model, img_size, precision, checkpointing, num_classes, token_label
    )
    return MemoryEstimate(
        model=model,
        params=params,
        weights=weights / (gpus if zero >= 3 else 1),
        grads=grads / (gpus if zero >= 2 else 1),
        optimizer=optim / (gpus if zero >= 1 else 1),
        buffers=float(grads if zero == 0 and gpus > 1 else 0),
        activations=per_sample * batch,
        activation_per_sample=per_sample,
        settings={
            "img_size": img_size,
            "batch": batch,
            "precision": precision,
            "amp_dtype": amp_dtype,
            "zero": zero,
            "gpus": gpus,
            "checkpointing": checkpointing,
            "num_classes": num_classes,
            "token_label": token_label,
        },
    )


def _mesh_estimate(
    model: str, img_size: int, batch: int, precision: str, zero: int, checkpointing: bool,
    num_classes: int, token_label: bool, mesh: ParallelDims, fsdp: bool, micro_batches: int,
    schedule: str,
) -> MemoryEstimate:  # fmt: skip
    params = params_per_rank(model, mesh, img_size, num_classes)
    half = precision == "half"
    weights, grads, optim = params * (2 if half else 4), params * (2 if half else 4), params * 8
    optim += params * 4 if half else 0
    stage = 3 if fsdp else zero
    dp = mesh.dp
    per_sample = stage_activation_bytes(
        model, img_size, mesh, precision, checkpointing, num_classes, token_label, micro_batches,
        schedule,
    )  # fmt: skip
    return MemoryEstimate(
        model=model,
        params=param_count(model, img_size, num_classes),
        weights=weights / (dp if stage >= 3 else 1),
        grads=grads / (dp if stage >= 2 else 1),
        optimizer=optim / (dp if stage >= 1 else 1),
        buffers=float(grads if stage == 0 and dp > 1 else 0),  # the all-reduce's flat copy
        activations=per_sample * batch,
        activation_per_sample=per_sample,
        settings={
            "img_size": img_size, "batch": batch, "precision": precision, "zero": stage,
            "mesh": mesh.as_dict(), "fsdp": fsdp, "micro_batches": micro_batches,
            "schedule": schedule, "checkpointing": checkpointing, "num_classes": num_classes,
            "token_label": token_label, "params_per_rank": params,
        },
    )  # fmt: skip


def max_micro_batch(gpu_mem_bytes: float, reserve_bytes: float = 1.0 * GIB, **kwargs: Any) -> int:
    """Largest micro-batch whose estimate fits gpu_mem_bytes minus reserve_bytes (CUDA context,
    workspaces, fragmentation); 0 if not even the model states fit."""
    fixed = estimate(batch=0, **kwargs)
    room = gpu_mem_bytes - reserve_bytes - fixed.total
    return max(0, int(room // fixed.activation_per_sample)) if room > 0 else 0
