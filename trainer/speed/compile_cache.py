"""--compile auto|on|off, and torch.compile's caches kept in the run directory across requeues."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

CACHE_DIR = "compile-cache"
SETTINGS = ("auto", "on", "off")


def compile_enabled(setting: str | bool, device: torch.device) -> bool:
    """auto: on with CUDA, off on a CPU (measured there: a compiled VOLO-D1 step was slower
    than eager and its first step took minutes, docs/trainer.md). YAML true/false map to on/off."""
    if isinstance(setting, bool):
        return setting
    if setting not in SETTINGS:
        raise ValueError(f"--compile {setting}: choose one of {', '.join(SETTINGS)}")
    return device.type == "cuda" if setting == "auto" else setting == "on"


def cache_key(decisions: dict[str, Any], device: torch.device) -> str:
    """16 hex digits over this run's compile-relevant decisions and the software and device."""
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
    }
    text = json.dumps({**decisions, **env}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def use_run_cache(run_dir: Path, decisions: dict[str, Any], device: torch.device) -> Path:
    """Point inductor's caches at RUN_DIR/compile-cache/<key>; call before the first compile.

    A requeued job starts on another node with an empty /tmp, where inductor keeps its caches by
    default: every restart would pay the whole compile again (68 s for a VOLO-D1 step on an H100,
    docs/benchmarks.md). Inductor's FX graph cache and AOTAutograd cache (the "Compile Time
    Caching in torch.compile" tutorial of the PyTorch docs) are pointed at
    RUN_DIR/compile-cache/<key>/, so a requeue loads the compiled kernels instead. Inductor keys
    its own entries by graph, inputs and torch version; the directory key adds what this run
    decided (model, shapes, precision, kernels, torch/CUDA, GPU) so that a changed flag starts a
    fresh directory instead of mixing entries, and an old one can simply be deleted.
    """
    path = Path(run_dir) / CACHE_DIR / cache_key(decisions, device)
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)  # read by inductor at each lookup
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True  # the defaults of torch 2.14, set in case a site
    functorch_config.enable_autograd_cache = True  # config or an env variable turned them off
    return path
