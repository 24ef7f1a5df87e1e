"""DeepSpeed's engine (ZeRO 0-3) and the JSON config generated from our flags."""

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitpod.trainer.checkpointing import ds_universal as universal
from vitpod.trainer.checkpointing import safeload
from vitpod.trainer.checkpointing.checkpoint import ResumeError
from vitpod.trainer.engines.engine import NotPipelined, token_label_forward


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


SHM_COMM_OP = "deepspeed_shm_comm"


def skip_inference_shm_build() -> None:
    """On the CPU accelerator DeepSpeed's backend JIT-compiles its shared-memory all-reduce when
    it starts (deepspeed/comm/torch.py, build_shm_op), but only `inference_all_reduce` (AutoTP
    inference layers) uses it; training's collectives go through torch.distributed. That was two
    C++ files, 53 CPU-s on a 2-core Xeon (48 s on both cores) the first time a machine ran a ZeRO
    job. Marked incompatible in `deepspeed.ops.__compatible_ops__` (kept as one dict so that
    edits persist, says deepspeed/ops/__init__.py), build_shm_op returns None. Other
    accelerators have no such op (nor is DeepSpeed's probe of every op then run), so this
    changes nothing on GPUs."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is not None:
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


class DeepSpeedEngine(NotPipelined):
    """DeepSpeed's engine (ZeRO 0-3) behind the same calls; it scales, clips and accumulates."""

    name = "deepspeed"

    def __init__(self, model: nn.Module, param_groups: list[dict], config: dict[str, Any],
                 token_label: bool = False) -> None:  # fmt: skip
        import deepspeed

        skip_inference_shm_build()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups, config=config, dist_init_required=False
        )
        self.model = self.engine.module
        self.token_label = token_label
        self.dtype = next(self.model.parameters()).dtype
        self.accum_steps = config["gradient_accumulation_steps"]
        self._saved_buffers: dict[str, torch.Tensor] = {}

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        # The loop calls step() once per optimizer step, not after every micro-batch: DeepSpeed's
        # own micro-step count would put the boundary at the A-th step() call, A x A batches.
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

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
        # Parameters and ZeRO partitions are in DeepSpeed's own files; the buffers (BatchNorm
        # statistics) also here, because its universal checkpoint does not restore them.
        return {"buffers": dict(self.model.named_buffers())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._saved_buffers = state.get("buffers", {})

    def save_sharded(self, directory: Path) -> None:
        """Collective: every rank writes its ZeRO partition under directory/deepspeed/."""
        self.engine.save_checkpoint(str(directory), tag=universal.TAG, save_latest=False)

    def load_sharded(self, directory: Path) -> None:
        """The world size that wrote the partitions reads them (bit-exact); another reads the
        universal checkpoint rank 0 converts them to (ds_universal.py)."""
        partitions = universal.saved_partitions(directory / universal.TAG)
        if partitions in (0, self.engine.dp_world_size):  # ZeRO-0 state is not partitioned
            self._load(directory, universal.TAG)
            return
        try:
            converted = universal.ensure_universal(directory, self.engine.global_rank)
        except universal.NotConvertible as err:  # before any step: exit 2, like a refusal
            raise ResumeError(str(err)) from err
        self._load_universal(directory, converted)

    def _load_universal(self, directory: Path, converted: Path) -> None:
        # ZeRO-3's universal load gives every param group group 0's hyperparameters (weight
        # decay 0.05 -> 0): ours come from the flags, the LR from the schedule at each step.
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self._param_groups()]
        config = self.engine._config  # DeepSpeed reads the flag at load time
        config.load_universal_checkpoint = True
        try:
            self._load(directory, converted.name)
        finally:
            config.load_universal_checkpoint = False
        for group, hyper in zip(self._param_groups(), groups, strict=True):
            group.update({k: v for k, v in hyper.items() if k != "lr"})
        self._unshare_adam_steps()
        self._restore_buffers()

    def _unshare_adam_steps(self) -> None:
        # ZeRO-3's universal load hands every sub-group the same `step` tensor, which torch's
        # Adam increments in place: once per sub-group and step, a wrong bias correction.
        for state in self.engine.optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def _param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                if name in self._saved_buffers:
                    buffer.copy_(self._saved_buffers[name])

    def _load(self, directory: Path, tag: str) -> None:
        # DeepSpeed's readers pass weights_only=False: forced to True, a refusal names the file.
        with safeload.deepspeed_reads(directory / tag):
            self.engine.load_checkpoint(str(directory), tag=tag, load_lr_scheduler_states=False)
