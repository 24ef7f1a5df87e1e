"""Step time, peak memory and parameter bytes per rank of each (dp, tp, pp) layout vs DDP.

Every layout trains the same model on the same synthetic batches with torchrun, in the same
run, so each ratio is against a DDP run measured beside it. On a GPU machine it also reports
model FLOPs utilisation (MFU): vitpod.analysis.layout.step_flops / step time / the GPU's peak.
Results go to benchmarks/results/mesh_layouts_<cpu|gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU_LAYOUTS = {
    "ddp": [],
    "fsdp": ["--fsdp"],
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2"],
    "fsdp_tp2": ["--fsdp", "--tp", "2"],
}
# Dense bf16 peak of the GPUs we may be lent (vendor datasheets, without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def run_layout(name: str, flags: list[str], nproc: int, common: list[str], out: Path) -> dict:
    run = out / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    cmd = ["./distributed_train.sh", str(nproc), "", *common, "--output", str(run), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"failed": proc.stdout[-2000:] + proc.stderr[-2000:]}
    from vitpod.registry import runfiles

    summary = runfiles.read_record(run / runfiles.SUMMARY)
    steps, peaks = [], []
    for path in runfiles.metrics_files(run):
        rows = [r for r in runfiles.read_jsonl(path) if r["kind"] == "step"]
        steps += [r["time"]["step"] for r in rows if not r["warmup"]]
        peaks.append(max(r["peak_mem_bytes"] for r in rows))
    return {
        "flags": flags, "mesh": summary["mesh"],
        "param_bytes_per_rank": summary["param_bytes_per_rank"],
        "step_s_median": statistics.median(steps), "peak_mem_bytes_max": max(peaks),
        "images_per_s": summary["images_per_s"],
    }  # fmt: skip


def add_ratios(results: dict) -> None:
    base = results.get("ddp", {})
    for r in results.values():
        if "failed" in r or "failed" in base:
            continue
        for key in ("step_s_median", "peak_mem_bytes_max", "param_bytes_per_rank"):
            r[f"{key}_vs_ddp"] = r[key] / base[key]


def add_mfu(results: dict, model: str, img_size: int, batch: int) -> None:
    import torch

    from vitpod.analysis.layout import step_flops

    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    for r in results.values():
        if "failed" in r or peak is None:
            continue
        gpus = r["mesh"]["dp"] * r["mesh"]["tp"] * r["mesh"]["pp"]
        flops = step_flops(model, img_size, batch * r["mesh"]["dp"], num_classes=1000)
        r["mfu"] = flops / r["step_s_median"] / (peak * gpus)
    results["_gpu"] = {"name": name, "peak_bf16_flops": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("-b", "--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(CPU_LAYOUTS))
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    common = [
        "--dataset", "synthetic", "--model", args.model, "--img-size", str(args.img_size),
        "-b", str(args.batch), "--accum-steps", "2", "--workers", "0", "--loader", "torch",
        "--num-classes", "1000", "--max-steps", str(args.steps), "--no-eval",
        "--checkpoint-every", "0", "--warmup-steps-excluded", "3", "--lr", "1e-4",
        "--drop-path", "0", *(["--amp"] if args.amp else []),
    ]  # fmt: skip
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts.split(","):
            results[name] = run_layout(name, CPU_LAYOUTS[name], args.nproc, common, Path(tmp))
            print(name, json.dumps(results[name])[:300], flush=True)
    add_ratios(results)
    if gpu:
        add_mfu(results, args.model, args.img_size, args.batch * 2)
    out = ROOT / "benchmarks" / "results" / f"mesh_layouts_{'gpu' if gpu else 'cpu'}.json"
    out.write_text(json.dumps({
        "machine": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "results": results,
    }, indent=2))  # fmt: skip
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
