"""Check the memory planner against a real training step's peak process memory on CPU (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from vitpod.analysis.memory import estimate
from vitpod.registry import models


def _rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset VmHWM (peak RSS) to the current RSS (Linux clear_refs, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def build_model(model: str, img_size: int, num_classes: int) -> Any:
    """The timm model the trainer builds for this name (the registry's builder)."""
    return models.build(model, img_size, num_classes)


def measure_here(model: str, img_size: int, batch: int, num_classes: int) -> dict[str, int]:
    """Peak RSS over one steady-state AdamW step (after a warmup step, gradients kept as DDP's
    buckets keep them). Call in a fresh process: it resets the process's peak counter."""
    import gc

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # Load libraries and kernels first (a step of the tiny VOLO), so that only the model's own
    # memory counts: imports and kernel initialisation are not in the estimate.
    _train_step(*_setup("volo_tiny", 32, 2, 10))
    images, targets, net, optimizer = None, None, None, None
    gc.collect()
    before_model = _rss_bytes()
    images, targets, net, optimizer = _setup(model, img_size, batch, num_classes)
    _train_step(images, targets, net, optimizer)
    gc.collect()
    before_step = _rss_bytes()
    _reset_peak()
    _train_step(images, targets, net, optimizer)
    peak = _rss_bytes("VmHWM")
    return {"before_model": before_model, "before_step": before_step, "peak": peak}


def _setup(model: str, img_size: int, batch: int, num_classes: int) -> tuple[Any, ...]:
    import torch

    images = torch.randn(batch, 3, img_size, img_size)
    targets = torch.randint(0, num_classes, (batch,))
    net = build_model(model, img_size, num_classes).train()
    return images, targets, net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)


def _train_step(images: Any, targets: Any, net: Any, optimizer: Any) -> None:
    """Forward, backward, AdamW; gradients stay allocated, as in DDP's buckets."""
    import torch

    loss = torch.nn.functional.cross_entropy(net(images), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def measure(model: str, img_size: int, batch: int, num_classes: int) -> dict[str, int]:
    """Run measure_here in a fresh interpreter with mmap for every large block, so freed
    memory goes back to the OS and RSS follows live tensors."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    code = (
        "import json, sys; from vitpod.analysis.memcheck import measure_here; "
        f"print(json.dumps(measure_here({model!r}, {img_size}, {batch}, {num_classes})))"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement of {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(model: str, img_size: int, batch: int, num_classes: int = 1000) -> dict[str, Any]:
    """Planned against measured bytes: the whole step (weights + gradients + AdamW +
    activations) and the activations alone; errors are (planned - measured) / measured."""
    predicted = estimate(model, img_size, batch, "fp32", num_classes=num_classes)
    got = measure(model, img_size, batch, num_classes)
    total = got["peak"] - got["before_model"]
    activations = got["peak"] - got["before_step"]
    return {
        "model": model,
        "img_size": img_size,
        "batch": batch,
        "planned_total": predicted.total,
        "measured_total": total,
        "total_error": (predicted.total - total) / total,
        "planned_activations": predicted.activations,
        "measured_activations": activations,
        "activation_error": (predicted.activations - activations) / activations,
    }


def saved_tensor_bytes(model: str, img_size: int, batch: int, num_classes: int = 1000) -> int:
    """Bytes autograd keeps for backward in one forward pass (distinct storages, parameters and
    the input batch excluded): the planner's activation term, counted exactly."""
    import torch

    torch.manual_seed(0)
    images = torch.randn(batch, 3, img_size, img_size)
    net = build_model(model, img_size, num_classes).train()
    skip = {p.untyped_storage().data_ptr() for p in net.parameters()}
    skip.add(images.untyped_storage().data_ptr())
    storages: dict[int, int] = {}

    def keep(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        net(images)
    return sum(storages.values())


def timm_param_count(model: str, img_size: int = 224, num_classes: int = 1000) -> int:
    """Trainable parameters counted by building the timm model on the meta device."""
    import torch

    with torch.device("meta"):
        net = build_model(model, img_size, num_classes)
    return sum(p.numel() for p in net.parameters() if p.requires_grad)
