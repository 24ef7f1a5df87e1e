"""timm's values as vitpod's (trainer/settings/timmoptions.py's converters): the names timm
gives data sets, AMP dtypes, optimizers and compile backends, its KEY=VALUE pairs, and the rules
a `-c` args.yaml needs (a key that reads another)."""

from __future__ import annotations

import ast
from typing import Any

from vitpod.trainer.config import ConfigError

SKIP = object()
"""A converter's answer for "this value sets nothing" (timm's None: the model's default)."""


DATASETS = {"": "folder", "folder": "folder", "imagefolder": "folder", "torch/folder": "folder",
            "torch/image_folder": "folder", "torch/imagefolder": "folder",
            "torch/cifar10": "cifar10", "torch/cifar100": "cifar100"}  # fmt: skip


_FOLDERS = ("give a folder of class folders (DATA/train/<class>/*.jpg, DATA/val/<class>/*.jpg; "
            "--dataset folder) or pack one (make shards; --dataset shards)")  # fmt: skip
_TORCH_OTHER = ("a torchvision data set read (or downloaded) by torchvision's own class; vitpod's "
                "torch/ names are torch/cifar10, torch/cifar100 and torch/folder: write its "
                f"images as JPEGs and {_FOLDERS}")  # fmt: skip
DATASET_FAMILIES = {
    "torch/imagenet": "torchvision's ImageNet (the ILSVRC2012 archives and devkit, unpacked by "
    "torchvision.datasets.ImageNet); vitpod reads the same images unpacked: extract them into "
    f"class folders and {_FOLDERS}",
    "torch/": _TORCH_OTHER,
    "hfds/": "a Hugging Face datasets data set (Arrow tables through the datasets library, "
    "fetched from the Hub when not cached; compute nodes have no network); vitpod reads no "
    f"Arrow tables: save its images on a login node and {_FOLDERS}",
    "hfids/": "a Hugging Face data set streamed from the Hub (an iterable dataset; compute nodes "
    "have no network, and vitpod's epochs are permutations of a counted set, for exact "
    f"resume): save its images on a login node and {_FOLDERS}",
    "tfds/": "a TensorFlow Datasets data set (an iterable dataset through tensorflow-datasets, "
    f"which vitpod's image does not have): export its images and {_FOLDERS}",
    "wds/": "WebDataset tars read as a stream (an iterable dataset, with no sample index); "
    "vitpod's --dataset shards reads tars of the same layout (<key>.jpg, <key>.cls) through the "
    "index make shards writes (exact epochs, mid-epoch resume): unpack them into class folders "
    "and run make shards (or use --dataset folder)",
}
"""timm's dataset names (timm.data.create_dataset's prefixes) of sources vitpod does not read:
why, and what to give instead."""


def dataset_name(value: Any) -> Any:
    """timm's `<type>/<name>` for the sources vitpod has and vitpod's own names; another of
    timm's families is refused with its reason, any other name as the folder timm reads."""
    name = str(value).lower()
    if name in DATASETS:
        return DATASETS[name]
    family = next((k for k in DATASET_FAMILIES if name == k or name.startswith(k)
                   and k.endswith("/")), None)  # fmt: skip
    if family is not None:
        raise ConfigError(f"--dataset {value}: in timm, {DATASET_FAMILIES[family]}")
    if value not in _own_names():
        raise ConfigError(f"--dataset {value}: in timm, a name of none of its families (torch/, "
                          "hfds/, hfids/, tfds/, wds/) reads DATA as a folder (or tar) of class "
                          "folders, the name unused; vitpod names its sources: give --dataset "
                          f"folder for that, or one of {', '.join(_own_names())}")  # fmt: skip
    return value


def _own_names() -> tuple[str, ...]:
    """--dataset's choices (TrainConfig's)."""
    from vitpod.trainer.config import TrainConfig

    choices: tuple[str, ...] = TrainConfig.__dataclass_fields__["dataset"].metadata["choices"]
    return choices


def amp_dtype_name(value: Any) -> Any:
    return {"float16": "fp16", "bfloat16": "bf16"}.get(value, value)


def opt_name(value: Any) -> Any:
    return {"fusedadamw": "adamw", "fusedlamb": "lamb"}.get(str(value).lower(), value)


def compile_backend(value: Any) -> Any:
    if value is None:
        return SKIP
    if value not in ("inductor", "on"):
        raise ConfigError(f"--torchcompile {value}: vitpod compiles with the inductor backend "
                          "only; pass --torchcompile (inductor) or drop it")  # fmt: skip
    return "on"


def kwarg_pair(text: str) -> tuple[str, Any]:
    """timm's ParseKwargs: KEY=VALUE, the value a Python literal where it parses as one."""
    key, eq, raw = text.partition("=")
    if not eq or not key:
        raise ConfigError(f"{text!r}: give KEY=VALUE (e.g. --model-kwargs qkv_bias=False)")
    try:
        return key, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key, raw


def none_is_skip(value: Any) -> Any:
    return SKIP if value is None else value


def empty_is_skip(value: Any) -> Any:
    return value or SKIP  # timm's '' is none


def aa_value(value: Any) -> Any:
    return "" if value is None else value  # timm's None is no RandAugment: vitpod's ''


def channels_last_value(value: Any) -> Any:
    return True if value else SKIP  # a memory layout, not a result: off -> vitpod's choice


def data_rule(value: Any, data: dict[str, Any]) -> Any:
    return SKIP if value is None or data.get("data_dir") else value  # timm: data_dir wins


def amp_dtype_rule(value: Any, data: dict[str, Any]) -> Any:
    return amp_dtype_name(value) if data.get("amp") else SKIP  # timm ignores it without --amp


def pretrained_path_rule(value: Any, data: dict[str, Any]) -> Any:
    return value if value else SKIP
