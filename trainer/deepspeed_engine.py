"""DeepSpeed's engine (ZeRO 0-3) and the JSON config generated from our flags."""

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitpod.trainer.engine import NotPipelined, token_label_forward


def deepspeed_config(
    batch_size: int, accum_steps: int, world_size: int, lr: float, weight_decay: float,
    zero_stage: int, amp_dtype: str | None, clip_grad: float | None,
) -> dict[str, Any]:  # fmt: skip
    """A DeepSpeed JSON config generated from our flags (torch AdamW: no JIT-built Adam op)."""
    return {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": accum_steps,
        "train_batch_size": batch_size * accum_steps * world_size,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "weight_decay": weight_decay, "torch_adam": True},
        },
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": amp_dtype == "bf16"},
        "fp16": {"enabled": amp_dtype == "fp16"},
        "gradient_clipping": clip_grad or 0.0,
        "steps_per_print": 10**9,
    }


class DeepSpeedEngine(NotPipelined):
    """DeepSpeed's engine (ZeRO 0-3) behind the same calls; it scales, clips and accumulates."""

    name = "deepspeed"

    def __init__(self, model: nn.Module, param_groups: list[dict], config: dict[str, Any],
                 token_label: bool = False) -> None:  # fmt: skip
        import deepspeed

        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups, config=config, dist_init_required=False
        )
        self.model = self.engine.module
        self.token_label = token_label
        self.dtype = next(self.model.parameters()).dtype
        self.accum_steps = config["gradient_accumulation_steps"]

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # DeepSpeed knows the accumulation boundary itself

    def forward(self, images: torch.Tensor) -> Any:
        if self.token_label:  # ZeRO-3 would need the engine's own forward here
            return token_label_forward(self.model, images.to(self.dtype))
        return self.engine(images.to(self.dtype))

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def comm_seconds(self) -> float:
        return 0.0  # inside DeepSpeed's reducer; not separable here

    counts_eval = True

    def eval_forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.to(self.dtype))

    def wait_sharded(self) -> None:
        pass

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {}  # model and ZeRO partitions are in DeepSpeed's own sharded files

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def save_sharded(self, directory: Path) -> None:
        """Collective: every rank writes its ZeRO partition under directory/deepspeed/."""
        self.engine.save_checkpoint(str(directory), tag="deepspeed", save_latest=False)

    def load_sharded(self, directory: Path) -> None:
        self.engine.load_checkpoint(str(directory), tag="deepspeed", load_lr_scheduler_states=False)
