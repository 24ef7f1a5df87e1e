"""Model FLOPs utilisation: FLOPs of one training step counted by torch, over time and peak."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitpod.trainer.hardware import device_name, peak_flops

COUNT_BATCH = 2  # samples in the counted forward+backward: small, it runs once at start-up


def count_train_flops(model: nn.Module, img_size: int, device: torch.device,
                      batch: int = COUNT_BATCH) -> int:  # fmt: skip
    """FLOPs of forward + backward of `batch` images through `model` (grads are left zeroed)."""
    images = torch.randn(batch, 3, img_size, img_size, device=device)
    was_training = model.training
    model.train()
    with FlopCounterMode(display=False) as counter:
        out = model(images)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return int(counter.get_total_flops())


@dataclass(frozen=True)
class Mfu:
    """How a run's MFU is computed: FLOPs per sample and per rank's step, the device peak.

    MFU as defined in the PaLM paper (Chowdhery et al. 2022, appendix B): the model's FLOPs per
    step (forward and backward, no rematerialisation) divided by the step time and the hardware's
    peak FLOP/s. The count is torch.utils.flop_counter.FlopCounterMode's over one small batch,
    scaled per sample: a ViT/VOLO's FLOPs are linear in the batch.
    """

    flops_per_sample: int
    flops_per_step: int  # this rank's share of its optimizer step (batch x accum / (tp x pp))
    peak_flops: float | None
    peak_source: str
    reason: str  # why MFU is None ('' when it is computed)
    device: str = ""
    """What the steps ran on: torch's GPU name (`NVIDIA A100-SXM4-80GB`) or the device type
    (`cpu`); `make place` uses an earlier run's step time only on the same kind of device."""

    def of_step(self, step_seconds: float) -> float | None:
        """MFU of one data-parallel rank's step that took `step_seconds`."""
        if self.peak_flops is None or step_seconds <= 0:
            return None
        return self.flops_per_step / step_seconds / self.peak_flops

    def of_rate(self, images_per_s: float, devices: int) -> float | None:
        """MFU of a whole job: its images/s (each image counted once) on `devices` GPUs; holds
        for tensor and pipeline parallelism too, where one image's FLOPs span several GPUs."""
        if self.peak_flops is None or devices < 1:
            return None
        return self.flops_per_sample * images_per_s / (devices * self.peak_flops)

    def record(self) -> dict:
        """The start-up line of metrics/rank0.jsonl that the follow view reads."""
        return {"kind": "mfu", **asdict(self)}

    def summary(self, images_per_s: float, devices: int) -> dict:
        mfu = self.of_rate(images_per_s, devices)
        return {"mfu": mfu, "flops_per_step": self.flops_per_step,
                "peak_flops": self.peak_flops, "peak_source": self.peak_source,
                "mfu_reason": self.reason if mfu is None else ""}  # fmt: skip


def measure(model: nn.Module, img_size: int, device: torch.device, per_step_samples: int,
            peak_device: torch.device | None = None, replica_ranks: int = 1,
            dtype: str = "bf16") -> Mfu:  # fmt: skip
    """Count one sample's step FLOPs on `device` (the meta device counts without computing)
    and scale them to `per_step_samples`, shared by the `replica_ranks` (tp x pp) ranks of one
    model replica; the peak is that of `peak_device` (default `device`)."""
    per_sample = count_train_flops(model, img_size, device) // COUNT_BATCH
    ran_on = peak_device or device
    peak, reason = peak_flops(ran_on, dtype=dtype)
    return Mfu(
        flops_per_sample=per_sample,
        flops_per_step=per_sample * per_step_samples // replica_ranks,
        peak_flops=peak.flops if peak else None,
        peak_source=peak.source if peak else "",
        reason=reason,
        device=device_name(ran_on) if ran_on.type == "cuda" else ran_on.type,
    )


def measure_on_meta(name: str, img_size: int, num_classes: int, device: torch.device,
                    per_step_samples: int, replica_ranks: int = 1,
                    dtype: str = "bf16") -> Mfu:  # fmt: skip
    """MFU terms of model `name` counted on a meta-device copy: no memory, no compute, and the
    training model (compiled, sharded, float8) is left alone."""
    from vitpod.trainer.model.models import create_model

    with torch.device("meta"):
        model = create_model(name, img_size, num_classes, 0.0)
    meta = torch.device("meta")
    return measure(model, img_size, meta, per_step_samples, device, replica_ranks, dtype)
