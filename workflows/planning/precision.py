"""The autocast dtype the ranks run, decided once from the node type's GPU (plan.json's
`precision`; the ranks take it from there)."""

from __future__ import annotations

from vitpod.registry import gpus
from vitpod.registry.decision import Precision
from vitpod.trainer.config import TrainConfig
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile import NodeType


def decide_precision(
    cfg: TrainConfig, given: frozenset[str], node: NodeType, node_type: str
) -> tuple[Precision, str]:
    """The autocast dtype from the node type's GPU (bf16 where native, fp16 with dynamic loss
    scaling before compute capability 8.0), and the --amp-dtype the ranks run. An --amp-dtype
    given (ARGS or recipe: in `given`) is kept, and refused where the GPU has no bf16;
    ConfigError names the GPU and the fix."""
    if not cfg.use_amp:
        return Precision(dtype="fp32", source="default", reason="no --amp: fp32"), cfg.amp_dtype
    explicit = cfg.amp_dtype if "amp_dtype" in given else None
    gpu = node.gpu.model if node.gpu is not None and node.gpus_per_node else None

    def kept(reason: str) -> tuple[Precision, str]:
        """The parsed dtype as it is (given in the flags, or no GPU to choose by)."""
        record = {
            "dtype": cfg.amp_dtype, "gpu": gpu, "reason": reason,
            "loss_scaling": "dynamic" if cfg.amp_dtype == "fp16" else "none",
            "source": "flags" if explicit else "default",
        }  # fmt: skip
        return Precision.model_validate(record), cfg.amp_dtype

    if gpu is None:
        return kept(f"node type {node_type} has no GPU: {cfg.amp_dtype} (the trainer's default)")
    capability = gpus.capability_of(gpu)
    if capability is None:
        if explicit:
            return kept(f"--amp-dtype {explicit} given; {gpu} is not in vitpod.registry.gpus")
        raise ConfigError(
            f"node_types.{node_type}.gpu.model={gpu!r}: its bf16 support is unknown (not in "
            'vitpod.registry.gpus.CAPABILITIES); pass ARGS="--amp-dtype bf16" (compute '
            'capability 8.0 or newer) or ARGS="--amp-dtype fp16"'
        )
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if not gpus.bf16_native(capability):
        if explicit == "bf16":
            raise ConfigError(
                f"--amp-dtype bf16: the {node_type} nodes' {gpu} ({cc}) has no bf16 tensor "
                f"cores; use --amp-dtype fp16 (dynamic loss scaling) or drop --amp-dtype"
            )
        why = f"{gpu} ({cc}) has no bf16 tensor cores: fp16 with dynamic loss scaling"
        record = Precision(dtype="fp16", loss_scaling="dynamic", gpu=gpu, reason=why)
        return record, "fp16"
    if explicit:
        return kept(f"--amp-dtype {explicit} given; {gpu} ({cc}) has bf16 natively")
    why = f"{gpu} ({cc}) has bf16 tensor cores: bf16, no loss scaling"
    return Precision(dtype="bf16", gpu=gpu, reason=why), "bf16"
