"""Stage recipes (pretrain/finetune per model): typed values with their sources -> trainer flags."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, model_validator

from vitpod.registry import models
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site.profile import read_yaml
from vitpod.workflows.site.schema import Strict, describe

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
Stage = Literal["pretrain", "finetune"]
TOKEN_LABEL_STRIDE = 16  # VOLO's token-label grid is one label per 16x16 pixels

# Recipe field -> trainer flag (contract 1). Booleans become bare flags when true.
_FLAGS = {
    "img_size": "--img-size",
    "batch_size": "-b",
    "lr": "--lr",
    "lr_base": "--lr-base",
    "lr_base_size": "--lr-base-size",
    "drop_path": "--drop-path",
    "crop_pct": "--crop-pct",
    "epochs": "--epochs",
    "warmup_epochs": "--warmup-epochs",
    "weight_decay": "--weight-decay",
    "num_classes": "--num-classes",
    "dataset": "--dataset",
    "token_label": "--token-label",
    "token_label_size": "--token-label-size",
    "ground_truth": "--ground-truth",
    "amp": "--apex-amp",
    "fsdp": "--fsdp",
    "tp": "--tp",
    "pp": "--pp",
    "checkpoint_every": "--checkpoint-every",
}


class StageRecipe(Strict):
    """One stage's hyper-parameters; `sources` names where each value comes from."""

    img_size: int = Field(gt=0)
    batch_size: int = Field(gt=0, description="per GPU (per rank)")
    lr: float | None = Field(default=None, gt=0, description="absolute LR; wins over lr_base")
    lr_base: float | None = Field(default=None, gt=0, description="LR at global batch lr_base_size")
    lr_base_size: int | None = Field(default=None, gt=0)
    drop_path: float = Field(ge=0, lt=1)
    crop_pct: float = Field(gt=0)
    epochs: int = Field(gt=0)
    warmup_epochs: int = Field(ge=0)
    weight_decay: float = Field(ge=0)
    dataset: Literal["folder", "cifar10", "cifar100", "digits", "synthetic"] = "folder"
    data: str | None = Field(
        default=None, description="dataset dir under the profile's storage.data"
    )
    num_classes: int | None = Field(
        default=None, gt=1, description="unset: the trainer counts the data set's classes"
    )
    token_label: bool = False
    token_label_size: int | None = None
    token_label_data: str | None = Field(default=None, description="relative to storage.data")
    ground_truth: bool = False
    amp: bool = True
    finetune: bool = Field(default=False, description="needs the pretrain stage's model")
    fsdp: bool = Field(default=False, description="FSDP2 full sharding (ZeRO-3)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks, within a node")
    pp: int = Field(default=1, ge=1, description="pipeline stages")
    checkpoint_every: Annotated[int, Field(ge=0)] | Literal["auto"] | None = Field(
        default=None, description="steps (0 = epoch ends) or auto; unset: the profile's"
    )
    sources: dict[str, str]

    @model_validator(mode="after")
    def _consistent(self) -> StageRecipe:
        if (self.lr is None) == (self.lr_base is None):
            raise ValueError("give exactly one of lr (absolute) or lr_base (scaled by batch)")
        if self.token_label:
            check_token_label_size(self.img_size, self.token_label_size, "token_label_size")
            if not self.token_label_data:
                raise ValueError("token_label: true needs token_label_data (a directory)")
        unsourced = sorted(k for k in self.model_fields_set - {"sources"} if k not in self.sources)
        if unsourced:
            raise ValueError(f"sources: no source given for {unsourced}; every value names one")
        extra = sorted(set(self.sources) - set(self.model_fields_set))
        if extra:
            raise ValueError(f"sources: {extra} name no value of this stage")
        return self

    def trainer_flags(self) -> list[str]:
        """The stage as `python -m vitpod.trainer` flags, in a stable order."""
        flags: list[str] = []
        for field, flag in _FLAGS.items():
            value = getattr(self, field)
            if field == "lr_base_size" and self.lr_base is None:
                continue
            if field in ("tp", "pp") and value == 1:
                continue
            if isinstance(value, bool):
                flags += [flag] if value else []
            elif value is not None and (field != "dataset" or value != "folder"):
                flags += [flag, _number(value)]
        return flags


class Recipe(Strict):
    """A model's stages."""

    model: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    stages: dict[Stage, StageRecipe]

    def stage(self, name: str) -> StageRecipe:
        if name not in self.stages:
            raise ConfigError(
                f"stage: recipe {self.model!r} has no stage {name!r}; stages: {list(self.stages)}"
            )
        return self.stages[name]  # type: ignore[index]


def check_token_label_size(img_size: int, size: int | None, field: str) -> None:
    """Token labels are one per 16x16 patch: size must be img_size/16 (14 at 224, 32 at 512)."""
    if img_size % TOKEN_LABEL_STRIDE:
        raise ValueError(f"img_size={img_size} must be a multiple of 16 for token labeling")
    want = img_size // TOKEN_LABEL_STRIDE
    if size is not None and size != want:  # unset: the trainer takes img_size/16
        raise ValueError(f"{field}={size} must be img_size/16 = {want} at img_size={img_size}")


def _number(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def bundled_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_name(model: str) -> str:
    """MODEL as a recipe name: a bundled recipe or a YAML path as given, timm's name of a
    registered model as its recipe (volo_d5_224 -> volo_d5, whose pretrain is at 224 px, as
    `vitpod-train --model volo_d5_224` takes it); others unchanged (load_recipe refuses them)."""
    if "/" in model or model.endswith((".yaml", ".yml")) or model in bundled_recipes():
        return model
    mapped = models.canonical(model)
    return mapped if mapped in bundled_recipes() else model


def load_recipe(model: str) -> Recipe:
    """The bundled recipe for `model` (or a YAML path, or timm's name of a registered model);
    ConfigError names the field and the fix (and the nearest recipe to an unknown name)."""
    model = recipe_name(model)
    looks_like_path = "/" in model or model.endswith((".yaml", ".yml"))
    path = Path(model) if looks_like_path else RECIPE_DIR / f"{model}.yaml"
    if not model or not path.is_file():
        timm_names = [n for n in map(_timm_name, bundled_recipes()) if n]
        near = difflib.get_close_matches(model, [*bundled_recipes(), *timm_names], n=1)
        hint = f"did you mean MODEL={models.canonical(near[0])}? " if near and model else ""
        raise ConfigError(
            f"MODEL={model!r}: no recipe; {hint}choose one of {bundled_recipes()} (or timm's "
            f"names of them: {timm_names}), or give a recipe YAML path"
        )
    try:
        return Recipe.model_validate(read_yaml(path, "recipe"))
    except ValidationError as exc:
        raise describe(exc, f"recipe {path}") from None


def _timm_name(recipe: str) -> str | None:
    """timm's name of a recipe's model when it differs (volo_d5 -> volo_d5_224)."""
    info = models.MODELS.get(recipe)
    return info.timm_name if info and info.timm_name and info.timm_name != recipe else None
