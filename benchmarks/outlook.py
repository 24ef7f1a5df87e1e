"""timm's OutlookAttention vs vitpod's fused form (--outlook-kernel), eager and compiled.

One outlook block forward + backward at VOLO-D1's stage-1 shape (28 x 28 tokens, 192 channels,
6 heads), fp32, both kernels in the same process: the first compiled step (compile time), then
`--steps` compiled and eager steps each. Writes benchmarks/results/outlook_cpu.json (or --out)
with the CPU's flags. Run: python benchmarks/outlook.py [--batch 4] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from timm.models.volo import OutlookAttention  # noqa: E402

from vitpod.registry.io import write_json_atomic  # noqa: E402
from vitpod.trainer.hardware import cpu_vector_flags  # noqa: E402
from vitpod.trainer.speed.outlook import use_fused_outlook  # noqa: E402


def _timed(step, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return sorted(out)


def measure(batch: int, steps: int) -> dict:
    torch.manual_seed(0)
    timm_block = OutlookAttention(192, 6)
    fused_block = copy.deepcopy(timm_block)
    use_fused_outlook(fused_block)
    x = torch.randn(batch, 28, 28, 192)
    result = {}
    for name, block in (("timm", timm_block), ("fused", fused_block)):
        compiled = torch.compile(block)
        first = _timed(lambda c=compiled: c(x).sum().backward(), 1)[0]
        result[name] = {
            "first_compiled_s": first,
            "compiled_s": _timed(lambda c=compiled: c(x).sum().backward(), steps),
            "eager_s": _timed(lambda b=block: b(x).sum().backward(), steps),
        }
        print(name, result[name], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/outlook_cpu.json"))
    args = parser.parse_args()
    record = {
        "shape": [args.batch, 28, 28, 192], "heads": 6, "dtype": "fp32",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        **cpu_vector_flags(),
        "results": measure(args.batch, args.steps),
    }  # fmt: skip
    write_json_atomic(Path(args.out), record)


if __name__ == "__main__":
    main()
