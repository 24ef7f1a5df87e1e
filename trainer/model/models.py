"""Model factory (timm VOLO/ViT and a tiny test VOLO) and fine-tune loading across image sizes."""

from __future__ import annotations

import argparse
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import timm
import torch
from timm.layers import resample_abs_pos_embed, resample_abs_pos_embed_nhwc
from timm.models.volo import VOLO
from torch import nn

from vitpod.registry import models, records, runfiles
from vitpod.trainer.checkpointing import checkpoint_commit as commit
from vitpod.trainer.checkpointing.checkpoint import STEP_PREFIX
from vitpod.trainer.checkpointing.torchsave import sha256_of
from vitpod.trainer.config import TrainConfig
from vitpod.trainer.model.qkv_layout import attention_heads, to_timm_layout
from vitpod.trainer.settings.checks import known_model

log = logging.getLogger(__name__)

HEAD_PREFIXES = ("head.", "aux_head.")


class ModelLoadError(ValueError):
    """A fine-tune checkpoint that cannot be loaded into the model; the message says why."""


def create_model(
    name: str, img_size: int, num_classes: int, drop_path: float, drop: float = 0.0,
    model_kwargs: dict[str, Any] | None = None,
) -> nn.Module:  # fmt: skip
    """Build `name` (no pretrained weights: nothing is downloaded inside a job; --pretrained
    loads them from disk afterwards, see pretrained_file). drop and model_kwargs are timm's
    --drop (drop_rate) and --model-kwargs, passed to the constructor as timm's train.py does."""
    if not known_model(name):
        raise ModelLoadError(f"--model {name}: unknown; use volo_d1..volo_d5, volo_tiny or vit_*")
    kwargs = {"drop_rate": drop, **(model_kwargs or {})}
    # timm's train.py does not pass --img-size to the model: its users size a ViT with
    # --model-kwargs img_size=N (args.yaml too); vitpod builds at --img-size, so the two agree
    size = kwargs.pop("img_size", img_size)
    if size != img_size:
        raise ModelLoadError(f"--model-kwargs img_size={size} with --img-size {img_size}: vitpod "
                             "builds the model at --img-size; give both the same size or drop "
                             "img_size from --model-kwargs")  # fmt: skip
    try:
        if models.known(name):
            return models.build(name, img_size, num_classes, drop_path, **kwargs)  # type: ignore[no-any-return]
        return timm.create_model(
            name, pretrained=False, img_size=img_size, num_classes=num_classes,
            drop_path_rate=drop_path, **kwargs,
        )  # fmt: skip
    except TypeError as err:  # a --model-kwargs key the constructor does not take
        raise ModelLoadError(f"--model-kwargs {model_kwargs}: {err}; give arguments of "
                             f"{name}'s constructor") from None  # fmt: skip


def build_model(cfg: TrainConfig, classes: int, device: torch.device, world_size: int) -> nn.Module:
    """The run's model: built (--drop, --model-kwargs), its weights from --pretrained,
    --initial-checkpoint or --finetune, then --sync-bn and --grad-checkpointing applied."""
    model = create_model(cfg.model, cfg.img_size, classes, cfg.drop_path or 0.0, cfg.drop,
                         cfg.model_kwargs)  # fmt: skip
    if cfg.pretrained:  # timm's --pretrained: read from disk, a new head where classes differ
        load_finetune(model, pretrained_file(cfg.model, cfg.pretrained_path), cfg.model)
    if cfg.initial_checkpoint:
        load_initial_checkpoint(model, cfg.initial_checkpoint, cfg.model)
    if cfg.finetune:
        reset = load_finetune(model, cfg.finetune, cfg.model)
        log.info("fine-tuning from %s (re-initialised: %s)", cfg.finetune, reset or "none")
    if cfg.sync_bn:
        model = sync_batchnorm(model, device, world_size)
    if cfg.grad_checkpointing:
        set_grad_checkpointing(model, cfg.model)
    return model


def pretrained_file(name: str, path: str | None) -> str:
    """timm's --pretrained: --pretrained-path, else the model's weights in the local Hugging Face
    cache (timm's hf_hub_id); never the network (compute nodes have none)."""
    if path:
        return path
    from huggingface_hub import constants, try_to_load_from_cache
    from timm.models import get_pretrained_cfg

    timm_name = models.get(name).timm_name if models.known(name) else name
    cfg = get_pretrained_cfg(timm_name) if timm_name else None
    repo = getattr(cfg, "hf_hub_id", None)
    if not repo:
        raise ModelLoadError(f"--pretrained: timm has no pretrained weights for --model {name}; "
                             "pass --pretrained-path FILE")  # fmt: skip
    for filename in ("model.safetensors", "pytorch_model.bin"):
        found = try_to_load_from_cache(repo, filename, cache_dir=constants.HF_HUB_CACHE)
        if isinstance(found, str):
            return found
    raise ModelLoadError(
        f"--pretrained: {name}'s weights ({repo}) are not in the local Hugging Face cache "
        f"{constants.HF_HUB_CACHE} and compute nodes download nothing; fetch them on a login "
        f"node (`hf download {repo}`, with HF_HUB_CACHE pointing at shared storage) or pass "
        "--pretrained-path FILE"
    )


def sync_batchnorm(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """timm's --sync-bn: BatchNorm statistics over all ranks (torch's SyncBatchNorm, GPU only)."""
    if device.type != "cuda" and world_size > 1:
        raise ModelLoadError("--sync-bn: torch's SyncBatchNorm runs on GPUs only; drop it on CPU")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def resolve_finetune_file(path: str) -> Path:
    """A file, a run, final or checkpoint directory, or a timm local model folder -> the
    weights file (runfiles.weights_candidates)."""
    for candidate in runfiles.weights_candidates(path):
        if candidate.is_file():
            return candidate
    names = ", ".join(str(c.relative_to(path)) for c in runfiles.weights_candidates(path)[1:])
    raise ModelLoadError(f"--finetune {path}: no weights found (looked for the file, {names})")


def _sharded_dir(path: str) -> Path | None:
    """A sharded (DCP) checkpoint: a step directory, or a run's newest one if it has no final."""
    from vitpod.trainer.checkpointing import dcp

    p = Path(path)
    if dcp.is_sharded_checkpoint(p):
        return p
    if runfiles.final_model(p).is_file() or not (p / runfiles.CHECKPOINTS).is_dir():
        return None
    found = (p / runfiles.CHECKPOINTS).glob(f"{STEP_PREFIX}*")
    steps = sorted((s for s in found if runfiles.is_checkpoint_name(s.name)), reverse=True)
    return next(
        (s for s in steps if dcp.is_sharded_checkpoint(s) and commit.check(s) is None), None
    )


def read_weights(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """State dict and its manifest (empty if none) from a finetune path."""
    sharded = _sharded_dir(path)
    if sharded is not None:
        from vitpod.trainer.checkpointing import dcp

        # The mesh engine stores qkv head-major; load_finetune converts it with the model's heads.
        return dcp.read_model_state(sharded), {"qkv_layout": "head_major"}
    file = resolve_finetune_file(path)
    manifest_file = records.record_path(file.parent, runfiles.FINAL_RECORD)
    manifest = records.read(file.parent, runfiles.FINAL_RECORD) or {}
    expected = _recorded_sha256(manifest, file.name)
    if expected:
        found = sha256_of(file)
        if found != expected:
            raise ModelLoadError(
                f"--finetune {path}: {file} does not match the sha256 its {manifest_file.name} "
                f"records ({found[:12]} != {expected[:12]}): the file changed on disk "
                "after it was written; take the run's newest checkpoint or retrain"
            )
    return unwrap_state_dict(_load_file(file, path), path), manifest


def _recorded_sha256(manifest: dict, name: str) -> str | None:
    """The sha256 a final model's manifest records for its file `name` (model.pt, or one of
    the timm folder's); a manifest without a `file` vouches for whatever file is beside it."""
    if manifest.get("file", name) == name:
        return manifest.get("sha256")
    return ((manifest.get("timm") or {}).get("files") or {}).get(name, {}).get("sha256")


def _load_file(file: Path, path: str) -> Any:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(file, device="cpu")
    # timm's train.py saves its argparse Namespace beside the weights: allowed, nothing else.
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = f"a {found.group(1)}" if found else "objects"
        raise ModelLoadError(
            f"--finetune {path}: {file.name} holds {what}, which torch.load(weights_only=True) "
            "does not unpickle (it takes tensors, plain containers and argparse.Namespace); "
            "save only the state dict (torch.save(model.state_dict(), FILE)) and pass that file"
        ) from err


WRAPPERS = ("state_dict", "model", "state_dict_ema", "model_ema")
"""Keys a training script keeps the weights under, in the order taken (timm's train.py writes
`state_dict` and, with --model-ema, `state_dict_ema`; DeiT-style scripts write `model`)."""
PREFIXES = ("module.", "_orig_mod.")  # DDP/DataParallel, torch.compile


def unwrap_state_dict(loaded: Any, path: str) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, whatever script wrote it (a wrapper in a wrapper too,
    as {"model": {"state_dict": ...}}); a file whose weights are under no known wrapper gets
    its own message (not 'weights are not a <model>')."""
    for _ in range(len(WRAPPERS)):
        if not isinstance(loaded, dict):
            raise ModelLoadError(f"--finetune {path}: holds a {type(loaded).__name__}, not weights")
        if any(isinstance(v, torch.Tensor) for v in loaded.values()):
            break
        key = next((k for k in WRAPPERS if isinstance(loaded.get(k), dict)), None)
        if key is None:
            raise ModelLoadError(_no_wrapper(loaded, path))
        loaded = loaded[key]
    state = {}
    for name, value in loaded.items():
        for prefix in PREFIXES:
            name = name.removeprefix(prefix)
        state[name] = value
    return state


def _no_wrapper(loaded: dict, path: str) -> str:
    def has_tensors(value: Any) -> bool:
        return isinstance(value, dict) and any(isinstance(t, torch.Tensor) for t in value.values())

    holder = next((k for k, v in loaded.items() if has_tensors(v)), None)
    fix = (
        f"its tensors are under {holder!r}: save checkpoint[{holder!r}] on its own and pass that"
        if holder is not None
        else "pass a file that holds the model's weights"
    )
    return (
        f"--finetune {path}: a dict of {sorted(map(str, loaded))[:8]} with no tensors and none "
        f"of the keys weights are kept under ({', '.join(WRAPPERS)}); {fix}"
    )


def load_finetune(model: nn.Module, path: str, model_name: str) -> list[str]:
    """Load weights trained at another size/class count; returns the keys left at init."""
    state, manifest = read_weights(path)
    saved_name = manifest.get("model")
    if saved_name and saved_name != model_name:
        raise ModelLoadError(
            f"--finetune {path}: checkpoint is a {saved_name}, not --model {model_name}; "
            f"pass --model {saved_name} or another checkpoint"
        )
    own = model.state_dict()
    if manifest.get("qkv_layout") == "head_major":
        state = to_timm_layout(state, attention_heads(model))
    _check_architecture(own, state, path, model_name)
    state = _resample_pos_embed(model, own, state)
    skipped = [k for k in state if k.startswith(HEAD_PREFIXES) and state[k].shape != own[k].shape]
    for key in skipped:
        del state[key]
    model.load_state_dict(state, strict=False)
    return skipped


def _check_architecture(own: dict, state: dict, path: str, model_name: str) -> None:
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    bad_shapes = [
        k for k in own if k in state and own[k].shape != state[k].shape
        and k != "pos_embed" and not k.startswith(HEAD_PREFIXES)
    ]  # fmt: skip
    if missing and extra:
        _check_prefix(set(own), list(state), path, model_name)
    if missing or extra or bad_shapes:
        detail = (missing or extra or bad_shapes)[:3]
        raise ModelLoadError(
            f"--finetune {path}: weights are not a {model_name} ({len(missing)} missing, "
            f"{len(extra)} unexpected, {len(bad_shapes)} mismatched keys, e.g. {detail}); "
            "pass the --model it was trained with"
        )


def _check_prefix(own: set[str], keys: list[str], path: str, model_name: str) -> None:
    """Keys all under a prefix no PREFIXES strips (Lightning's `model.`, a `backbone.`) that,
    once dropped, name the model's parameters: say so, not 'N missing, N unexpected'."""
    prefix = ""
    while all(k.startswith(prefix) and "." in k[len(prefix) :] for k in keys):
        firsts = {k[len(prefix) :].split(".", 1)[0] for k in keys}
        if len(firsts) != 1:
            return
        prefix += f"{firsts.pop()}."
        found = own & {k.removeprefix(prefix) for k in keys}
        if len(found) * 2 >= len(own):
            raise ModelLoadError(
                f"--finetune {path}: every key starts with {prefix!r} (e.g. {keys[0]!r}), a "
                f"prefix vitpod strips only as {' or '.join(PREFIXES)}; without it "
                f"{len(found)} of the {len(own)} keys of a {model_name} match: save "
                f"{{k.removeprefix({prefix!r}): v for k, v in state.items()}} and pass that file"
            )


def _resample_pos_embed(model: nn.Module, own: dict, state: dict) -> dict:
    if "pos_embed" not in state or state["pos_embed"].shape == own["pos_embed"].shape:
        return state
    target = own["pos_embed"]
    if isinstance(model, VOLO):  # NHWC grid (1, H, W, C)
        new = resample_abs_pos_embed_nhwc(state["pos_embed"], list(target.shape[1:3]))
    else:
        patch_embed: Any = model.patch_embed
        grid = patch_embed.grid_size
        prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
        new = resample_abs_pos_embed(state["pos_embed"], list(grid), num_prefix_tokens=prefix)
    return {**state, "pos_embed": new}


def load_initial_checkpoint(model: nn.Module, path: str, model_name: str) -> None:
    """timm's --initial-checkpoint: the weights of this very model (no resampling, no new
    head), read by the --finetune reader (any wrapper, sha256 checked)."""
    state, manifest = read_weights(path)
    saved_name = manifest.get("model")
    if saved_name and saved_name != model_name:
        raise ModelLoadError(f"--initial-checkpoint {path}: a {saved_name}, not --model "
                             f"{model_name}; pass --model {saved_name}")  # fmt: skip
    if manifest.get("qkv_layout") == "head_major":
        state = to_timm_layout(state, attention_heads(model))
    own = model.state_dict()
    bad = sorted(set(own) ^ set(state)) or [k for k in own if own[k].shape != state[k].shape]
    if bad:
        raise ModelLoadError(
            f"--initial-checkpoint {path}: not the weights of this {model_name} (e.g. {bad[:3]});"
            " another image size or class count is --finetune's job"
        )
    model.load_state_dict(state)


def set_grad_checkpointing(model: nn.Module, model_name: str) -> None:
    """--grad-checkpointing: timm's per-block activation recomputation."""
    enable = getattr(model, "set_grad_checkpointing", None)
    if not callable(enable):
        raise ModelLoadError(f"--grad-checkpointing: --model {model_name} has no "
                             "set_grad_checkpointing; drop the flag")  # fmt: skip
    enable(True)


def model_manifest(name: str, img_size: int, num_classes: int) -> dict:
    return {"model": name, "img_size": img_size, "num_classes": num_classes, "format": "state_dict"}


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
