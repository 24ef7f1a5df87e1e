"""The GPU-only paths, each run once with its figure: MFU levers, the trainer's own MFU and compile
cache, nvJPEG decode, fp16 loss scaling. Run by `benchmarks/gpu_check.sh` on a lent GPU.

`python benchmarks/gpu_check.py --out DIR [--sections kernel,levers,...] [--budget-s 420]`
writes DIR/gpu_check.json after every measurement, so a run cut short keeps what it measured;
a measurement that would start after the budget is recorded as skipped. `--rehearse` runs the
same code on the CPU with tiny models and batches (what can run there), to catch mistakes
before device time is spent.

Levers (one training step on device-resident batches, as `gpu.py`'s steps section): timm's
train.py loop (timm AdamW, foreach) against the trainer's pieces with one change at a time:
fused AdamW, channels-last, torch.compile, CUDA graphs (compile mode "reduce-overhead"),
float8 Linear layers (torchao), VOLO's unfold-free outlook attention (trainer/speed/outlook.py) and
its Triton kernels (trainer/speed/outlook_triton.py). `--sections kernel` runs only the Triton
kernel's part (under 3 minutes on an H100): its equality with timm's block, then volo_d1 steps
eager and compiled with it and with timm's (rows already measured in the run are not repeated).
MFU = FLOPs of the step counted by torch.utils.flop_counter / step time / peak (the datasheet's
dense bf16 peak and the matmul rate measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import gpu as base  # noqa: E402  (benchmarks/gpu.py: peaks, FLOP count, timing, timm's loop)
from gpu_check_outlook import outlook_section  # noqa: E402

# The step benchmark's batches, so figures compare with gpu_h100.json; --rehearse runs the tiny
# stand-ins on the CPU (fp32: bf16 autocast is emulated on CPUs without avx512_bf16).
MODELS = {"vit_base_patch16_224": 256, "volo_d1": 128}
REHEARSAL = {"vit_base_patch16_224": "vit_tiny_patch16_224", "volo_d1": "volo_tiny"}
LEVERS: dict[str, list[dict[str, Any]]] = {
    "vit_base_patch16_224": [
        {"name": "timm_loop"},
        {"name": "fused_adamw", "channels_last": False},
        {"name": "fused_adamw+channels_last"},
        {"name": "compile"},
        {"name": "compile+fp8", "fp8": True},
        {"name": "compile+cuda_graphs", "mode": "reduce-overhead", "late": True},
    ],
    "volo_d1": [
        {"name": "timm_loop"},
        {"name": "fused_adamw+channels_last"},
        {"name": "fused_outlook", "kernel": "fused"},
        {"name": "triton_outlook", "kernel": "triton"},
        {"name": "compile"},
        {"name": "compile+fused_outlook", "kernel": "fused"},
        {"name": "compile+triton_outlook", "kernel": "triton"},
        {
            "name": "compile+fused_outlook+cuda_graphs",
            "kernel": "fused",
            "mode": "reduce-overhead",
            "late": True,
        },
    ],
}
# --sections kernel: volo_d1's rows for the Triton kernel, most telling first (timm's compiled
# row last: a budget cut costs the figure the levers section also gives)
KERNEL_ROWS = ("fused_adamw+channels_last", "triton_outlook", "compile+triton_outlook", "compile")
SECTIONS = ("outlook", "kernel", "levers", "decode", "trainer")  # the default: all, this order


class Record:
    """The JSON written after every measurement (a cut-short run keeps what it measured)."""

    def __init__(self, out: Path, budget_s: float, head: dict[str, Any]):
        self.path, self.start, self.budget = out / "gpu_check.json", time.monotonic(), budget_s
        self.data: dict[str, Any] = head
        self.save()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def put(self, section: str, key: str, value: Any) -> None:
        self.data.setdefault(section, {})[key] = value
        self.save()
        print(f"{section} {key}: {json.dumps(value, default=str)[:400]}", flush=True)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def lever_step(name: str, img: int, batch: int, lever: dict[str, Any], device: torch.device):
    """The trainer's pieces with one lever set (bf16 on a GPU, fp32 on the CPU): the step."""
    from vitpod.trainer.model.models import create_model
    from vitpod.trainer.speed.fp8 import apply_fp8
    from vitpod.trainer.speed.outlook import apply_outlook_kernel
    from vitpod.trainer.speed.precision import make_precision, prepare_model

    amp = device.type == "cuda"
    precision = make_precision(device, amp, False, "bf16", lever.get("channels_last", True))
    model = create_model(name, img, 1000, 0.1)
    apply_outlook_kernel(model, lever.get("kernel", "timm"), device)
    model = prepare_model(model, precision, False)
    if lever.get("fp8"):
        apply_fp8(model, device)
    if lever["name"].startswith("compile"):
        model.compile(mode=lever.get("mode"))
    return base.trainer_step(model, precision, img, batch)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(
    step: Callable[[], None], device: torch.device, steps: int, warmup: int = 3
) -> dict[str, float]:
    start = time.perf_counter()
    step()  # first step: compile, autotune, CUDA graph capture
    sync(device)
    first = time.perf_counter() - start
    for _ in range(warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return {"first_step_s": first, "step_s": (time.perf_counter() - start) / steps}


def levers_section(
    rec: Record, device: torch.device, rehearse: bool, late: bool, only: tuple[str, ...] = ()
) -> None:
    """The levers in order; `late` ones (CUDA graphs) run after the decode and trainer sections,
    so a run that reaches its budget loses the least telling figures. `only`: volo_d1's levers
    of these names, in this order (the kernel section)."""
    peak, matmul = rec.data["datasheet_bf16_flops"], rec.data["measured_bf16_matmul_flops"]
    for name, batch in MODELS.items():
        levers = LEVERS[name]
        if only:
            if name != "volo_d1":
                continue
            levers = [next(lv for lv in levers if lv["name"] == row) for row in only]
        img, batch = (32, 2) if rehearse else (224, batch)
        if f"{name}/setup" in rec.data.get("levers", {}):  # counted once a run
            flops = rec.data["levers"][f"{name}/setup"]["flops"]
        elif device.type == "cuda":
            model = base.timm_step(name, img, batch)[1]
            flops = base.flops_per_step(
                model, torch.randn(batch, 3, img, img, device="cuda"),
                torch.randint(0, 1000, (batch,), device="cuda"),
            )  # fmt: skip
            del model
        else:
            flops = 0
        if f"{name}/setup" not in rec.data.get("levers", {}):
            rec.put("levers", f"{name}/setup", {"img_size": img, "batch": batch, "flops": flops})
        for lever in (lv for lv in levers if lv.get("late", False) == late):
            key = f"{name}/{lever['name']}"
            if key in rec.data["levers"]:  # the levers and kernel sections share rows
                continue
            if rec.left() < (90 if lever["name"].startswith("compile") else 20):
                rec.put("levers", key, {"skipped": "time budget"})
                continue
            if lever.get("fp8") and device.type != "cuda":
                rec.put("levers", key, {"skipped": "float8 needs a GPU of sm_89+"})
                continue
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                if lever["name"] == "timm_loop":
                    step = base.timm_step(name, img, batch)[0] if device.type == "cuda" else None
                else:
                    model_name = REHEARSAL[name] if rehearse else name
                    step = lever_step(model_name, img, batch, lever, device)
                if step is None:
                    rec.put("levers", key, {"skipped": "timm loop is CUDA-only in gpu.py"})
                    continue
                t = time_step(step, device, *((1, 0) if rehearse else (20, 3)))
            except Exception as err:  # one lever failing must not cost the others
                rec.put("levers", key, {"error": f"{type(err).__name__}: {err}"[:600]})
                continue
            row: dict[str, Any] = {**t, "images_per_s": batch / t["step_s"]}
            if flops:
                row["tflops"] = flops / t["step_s"] / 1e12
                row["mfu_datasheet"] = flops / t["step_s"] / peak if peak else None
                row["mfu_measured_matmul"] = flops / t["step_s"] / matmul
            if device.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            rec.put("levers", key, row)
            del step
            torch._dynamo.reset()


def trainer_run(out_dir: Path, args: list[str], log: Path) -> dict[str, Any]:
    """`python -m vitpod.trainer` as a job runs it; its metrics give MFU and the first step."""
    cmd = [sys.executable, "-m", "vitpod.trainer", "--output", str(out_dir), *args]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
    from vitpod.registry import runfiles

    rows = runfiles.read_metrics(out_dir, rank=0)
    if not rows:
        return {"rc": done.returncode, "error": (done.stdout + done.stderr)[-1500:]}
    starts = [r for r in rows if r.get("kind") == "timing" and r.get("event") == "start"]
    steps = [
        r for r in rows if r.get("kind") == "step" and r["wall_time"] > starts[-1]["wall_time"]
    ]
    summary = [r for r in rows if r.get("kind") == "summary"]
    return {
        "rc": done.returncode,
        "wall_s": time.perf_counter() - start,
        "first_step_s": steps[0]["time"]["step"] if steps else None,
        "start_to_first_step_s": steps[0]["wall_time"] - starts[-1]["wall_time"] if steps else None,
        "steps_this_start": len(steps),
        "summary": summary[-1] if summary else None,
        "tail": (done.stdout + done.stderr)[-1500:] if done.returncode else "",
    }


def trainer_section(rec: Record, out: Path, scratch: Path, rehearse: bool) -> None:
    """The real trainer twice on one run directory: a cold start that compiles, then a
    'requeue' (a second start on the same directory) that resumes and finds inductor's caches
    in RUN/compile-cache; summary.json's MFU is the trainer's own."""
    run = scratch / "trainer-run"
    model, batch, img = (
        ("vit_tiny_patch16_224", 4, 32) if rehearse else ("vit_base_patch16_224", 256, 224)
    )
    cold, warm = (4, 8) if rehearse else (12, 24)
    common = ["--dataset", "synthetic", "--model", model, "-b", str(batch), "--img-size", str(img),
              "--epochs", "10", "--warmup-epochs", "0", "--no-eval", "--workers", "6",
              "--log-interval", "5", "--compile", "on", "--checkpoint-every", str(cold),
              "--no-amp" if rehearse else "--amp"]  # fmt: skip
    for key, steps in (("cold", cold), ("warm_requeue", warm)):
        if rec.left() < 60:
            rec.put("trainer", key, {"skipped": "time budget"})
            return
        result = trainer_run(run, [*common, "--max-steps", str(steps)], out / f"trainer-{key}.log")
        rec.put("trainer", key, result)
    metrics = run / "metrics" / "rank0.jsonl"
    if metrics.is_file():  # brought back so the status view can be shown on it here
        (out / "trainer-rank0.jsonl").write_bytes(metrics.read_bytes())


def decode_section(rec: Record, scratch: Path, rehearse: bool) -> None:
    """images/s of the gpu loader (nvJPEG through torchvision) against the torch loader."""
    from loader import write_jpegs

    from vitpod.trainer.data import create_loader
    from vitpod.trainer.data.config import DataConfig

    root = write_jpegs(scratch / "jpegs", 32 if rehearse else 512)
    common = dict(data_dir=str(root), img_size=224, batch_size=32, auto_augment=None, reprob=0.0)
    kinds = {"gpu": dict(loader="gpu", workers=0), "torch": dict(loader="torch", workers=8)}
    if rehearse:
        kinds.pop("gpu")
    for kind, extra in kinds.items():
        loader = create_loader(DataConfig(**common, **extra), "train", 0, 1)
        best = 0.0
        for epoch in range(3):
            loader.set_epoch(epoch)
            start = time.perf_counter()
            count = sum(len(t) for _, t in loader)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            best = max(best, count / (time.perf_counter() - start))
        rec.put(
            "decode", kind, {"images_per_s": best, "images": count, "workers": extra["workers"]}
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--scratch", type=Path, default=Path("/tmp/vitpod-gpu-check"))
    p.add_argument("--rehearse", action="store_true", help="CPU, tiny sizes")
    ns = p.parse_args()
    sections = ns.sections.split(",")
    unknown = sorted(set(sections) - {*SECTIONS, "late"})
    if unknown:
        p.error(f"--sections {','.join(unknown)}: choose from {','.join(SECTIONS)},late")
    ns.out.mkdir(parents=True, exist_ok=True)
    ns.scratch.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not ns.rehearse
    device = torch.device("cuda" if cuda else "cpu")
    name, peak = base.device_peak() if cuda else ("cpu", None)
    head = {
        "device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "datasheet_bf16_flops": peak,
        "measured_bf16_matmul_flops": base.measured_matmul_peak() if cuda else None,
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "cpus": os.cpu_count(),
    }  # fmt: skip
    rec = Record(ns.out, ns.budget_s, head)
    if ns.rehearse:  # the Triton kernels on the CPU: interpreted (trainer/speed/outlook.py)
        os.environ["TRITON_INTERPRET"] = "1"
    for section in ("outlook", "kernel"):
        if section in sections:
            outlook_section(rec, device, ns.rehearse, section)
    if "levers" in sections:
        levers_section(rec, device, ns.rehearse, late=False)
    if "kernel" in sections:  # before the trainer and decode: the kernel's rows come first
        levers_section(rec, device, ns.rehearse, late=False, only=KERNEL_ROWS)
    if "decode" in sections:
        decode_section(rec, ns.scratch, ns.rehearse)
    if "trainer" in sections:
        trainer_section(rec, ns.out, ns.scratch, ns.rehearse)
    if "levers" in sections or "late" in sections:
        levers_section(rec, device, ns.rehearse, late=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
