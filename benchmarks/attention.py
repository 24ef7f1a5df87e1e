"""timm's two attention kernels (fused SDPA, explicit softmax(QK^T)V) on this machine, per dtype.

For each precision: one attention block's forward + backward at the model's token shape, and
a whole training step (AdamW, label smoothing, the trainer's channels_last), both kernels
interleaved round by round, the best of the rounds kept; and the floor of any implementation:
the step's FLOPs (torch's flop counter) over the rate of a 2048^3 matrix product. The
trainer's `--attn auto` rule (trainer/speed/attention.py) comes from these figures.
Writes benchmarks/results/attention_cpu.json.
Run: python benchmarks/attention.py [--model volo_d1] [--batch 8] [--img-size 224]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vitpod.registry import models  # noqa: E402
from vitpod.registry.io import write_json_atomic  # noqa: E402
from vitpod.trainer.speed.attention import KERNELS, attention_modules, set_kernel  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def autocast(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def block_input(model: nn.Module, block: nn.Module, img_size: int, batch: int) -> torch.Tensor:
    """A random input of the shape `block` sees in the model, at `batch` images."""
    seen: list[torch.Size] = []
    hook = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape))
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, img_size, img_size))
    hook.remove()
    model.train()
    return torch.randn((batch, *seen[0][1:]), requires_grad=True)


def time_block(block: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> float:
    start = time.perf_counter()
    with autocast(dtype):
        out = block(x)
    out.float().sum().backward()
    return time.perf_counter() - start


def time_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
              targets: torch.Tensor, dtype: torch.dtype | None) -> float:  # fmt: skip
    start = time.perf_counter()
    with autocast(dtype):
        loss = nn.functional.cross_entropy(model(images), targets, label_smoothing=0.1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def on_kernel(model: nn.Module, kernel: str, run: Callable[[], float]) -> Callable[[], float]:
    def timed() -> float:
        set_kernel(model, kernel)
        return run()

    return timed


def best_of(rounds: int, runs: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each callable once per round, interleaved; the first round warms up; best kept (ms)."""
    best = dict.fromkeys(runs, float("inf"))
    for round_ in range(rounds + 1):
        for name, run in runs.items():
            took = run()
            if round_:
                best[name] = min(best[name], took)
    return {name: round(1e3 * s, 1) for name, s in best.items()}


def step_flops(model: nn.Module, images: torch.Tensor) -> float:
    """FLOPs of one forward + backward (torch.utils.flop_counter: matmuls, convs, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(images).float().sum().backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def gemm_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matrix product: the most this CPU's GEMMs deliver."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="volo_d1")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention_cpu.json")
    a = parser.parse_args()
    torch.manual_seed(0)
    model = models.build(a.model, a.img_size, 10, 0.1).to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    block = attention_modules(model)[0]
    x = block_input(model, block, a.img_size, a.batch)
    images = torch.randn(a.batch, 3, a.img_size, a.img_size).contiguous(
        memory_format=torch.channels_last
    )
    targets = torch.randint(0, 10, (a.batch,))
    flops = step_flops(model, images)
    results: dict = {"step_gflop": round(flops / 1e9, 1)}
    for name, dtype in DTYPES.items():
        block_pass = partial(time_block, block, x, dtype)
        step = partial(time_step, model, optimizer, images, targets, dtype)
        blocks = {k: on_kernel(model, k, block_pass) for k in KERNELS}
        steps = {k: on_kernel(model, k, step) for k in KERNELS}
        results[name] = {
            "block_ms": best_of(a.rounds * 2, blocks),
            "step_ms": best_of(a.rounds, steps),
            "gemm_tflops": round(gemm_rate(dtype or torch.float32) / 1e12, 3),
        }
        # The step's FLOPs at the GEMM rate: no implementation of the step runs faster.
        results[name]["floor_ms"] = round(flops / (results[name]["gemm_tflops"] * 1e9), 1)
        print(name, results[name], flush=True)
    write(a, tuple(x.shape), results)


def write(a: argparse.Namespace, shape: tuple[int, ...], results: dict) -> None:
    data = {
        "benchmark": "timm attention kernels: fused SDPA vs explicit softmax(QK^T)V, CPU",
        "model": a.model, "batch": a.batch, "img_size": a.img_size, "block_input": list(shape),
        "rounds": a.rounds, "statistic": "best of the rounds, kernels interleaved",
        "results": results,
        "faster": {name: {part: min(results[name][part], key=results[name][part].get)
                          for part in ("block_ms", "step_ms")} for name in DTYPES},
        "machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out, data)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
