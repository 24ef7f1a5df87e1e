"""--fp8: torchao's float8 training for the Linear layers, refused where the GPU has no float8."""

from __future__ import annotations

import logging

import torch
from torch import nn

from vitpod.trainer.config import ConfigError
from vitpod.trainer.hardware import fp8_problem

log = logging.getLogger(__name__)


class Fp8Unsupported(ConfigError):
    """--fp8 on hardware without float8 matmuls; the message is one line naming the fix."""


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Linear layers whose dimensions torch._scaled_mm takes (multiples of 16); the heads
    stay in bf16: their class count rarely divides by 16 and they are a sliver of the FLOPs."""
    if not isinstance(module, nn.Linear) or fqn.startswith(("head", "aux_head")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, device: torch.device) -> int:
    """Swap the eligible Linear layers to Float8Linear (dynamic tensorwise scaling); returns
    how many were swapped. Raises Fp8Unsupported before anything is changed on a CPU or sm<89.

    The swap keeps the parameters (fp32 master weights) and their state_dict keys: checkpoints
    hold no float8 tensors, so a run resumes exactly with --fp8, and a bf16 run can load them.
    """
    problem = fp8_problem(device)
    if problem:
        raise Fp8Unsupported(problem)
    from torchao.float8 import convert_to_float8_training  # lazily: only --fp8 runs need it

    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=float8_filter)
    after = sum(type(m) is nn.Linear for m in model.modules())
    log.info("--fp8: %d of %d Linear layers run in float8", before - after, before)
    return before - after
