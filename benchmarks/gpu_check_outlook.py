"""gpu_check's outlook sections: VOLO-D1's first outlook attention, timm's eager module against
the fused form compiled (`outlook`) and the Triton kernels eager and compiled (`kernel`): largest
output and gradient error relative to the largest timm value, and the block's forward + backward
time beside timm's (the kernel alone, without the rest of the step)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

# Section -> row -> (kernel, compiled, bf16 autocast where CUDA)
OUTLOOK_CHECKS = {
    "outlook": {"volo_d1_first_block": ("fused", True, True)},
    "kernel": {
        "volo_d1_first_block_triton": ("triton", False, True),
        "volo_d1_first_block_triton_fp32": ("triton", False, False),
        "volo_d1_first_block_triton_compiled": ("triton", True, True),
    },
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


class Block:
    """One outlook block on one input: its gradients, and its forward + backward time."""

    def __init__(self, x: torch.Tensor, bf16: bool):
        self.x, self.bf16 = x, bf16

    def step(self, module: torch.nn.Module) -> list[torch.Tensor]:
        xi = self.x.clone().requires_grad_()
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out = module(xi)
        out.float().square().mean().backward()
        params = [p.grad.float() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return [out.detach().float(), xi.grad.float(), *params]

    def ms(self, module: torch.nn.Module, reps: int) -> float:
        self.step(module)  # warm: Triton's and inductor's compilation
        self.sync()
        start = time.perf_counter()
        for _ in range(reps):
            self.step(module)
        self.sync()
        return (time.perf_counter() - start) / reps * 1e3

    def sync(self) -> None:
        if self.x.device.type == "cuda":
            torch.cuda.synchronize()


def outlook_section(rec: Any, device: torch.device, rehearse: bool, section: str) -> None:
    """The rows of OUTLOOK_CHECKS[section] into rec's `outlook` (gpu_check.Record)."""
    import timm

    from vitpod.trainer.speed.outlook import apply_outlook_kernel

    torch.manual_seed(0)
    net = timm.create_model("volo_d1_224", num_classes=10)
    ref = next(m for m in net.modules() if type(m).__name__ == "OutlookAttention").to(device)
    batch, side = (2, 8) if rehearse else (64, 28)  # D1's outlook stage: 28 x 28 tokens at 224 px
    x = torch.randn(batch, side, side, ref.v.in_features, device=device)
    reps = 1 if rehearse else 10
    wants: dict[bool, tuple[list[torch.Tensor], float]] = {}  # timm's, per dtype
    for key, (kernel, compiled, autocast) in OUTLOOK_CHECKS[section].items():
        block = Block(x, autocast and device.type == "cuda")
        if rec.left() < (60 if compiled else 10):
            rec.put("outlook", key, {"skipped": "time budget"})
            continue
        try:
            other = copy.deepcopy(ref)
            apply_outlook_kernel(other, kernel, device)
            other = torch.compile(other) if compiled else other
            if block.bf16 not in wants:
                wants[block.bf16] = (block.step(ref), block.ms(ref, reps))
            want, want_ms = wants[block.bf16]
            got = block.step(other)
            got_ms = block.ms(other, reps)
        except Exception as err:  # one check failing must not cost the timings
            rec.put("outlook", key, {"error": f"{type(err).__name__}: {err}"[:600]})
            continue
        row = {
            "shape": list(x.shape), "kernel": kernel, "compiled": compiled,
            "dtype": "bf16 autocast" if block.bf16 else "fp32",
            "output_rel_err": _rel(got[0], want[0]), "input_grad_rel_err": _rel(got[1], want[1]),
            "param_grad_rel_err": max(_rel(a, b) for a, b in zip(got[2:], want[2:], strict=True)),
            # bf16 keeps 8 bits of mantissa: 2**-8 per rounding, a few roundings; fp32: only
            # the order of the sums differs
            "tolerance": 2e-2 if block.bf16 else 1e-4,
            "fwd_bwd_ms": got_ms, "timm_eager_fwd_bwd_ms": want_ms,
        }  # fmt: skip
        row["within_tolerance"] = all(row[k] <= row["tolerance"] for k in row if k.endswith("_err"))
        rec.put("outlook", key, row)
