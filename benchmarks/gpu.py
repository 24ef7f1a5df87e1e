"""GPU figures on a lent GPU: memory plan vs measured peak, bf16 step rate and MFU, timm train.py.

Run on a CUDA machine (never in CI): `python benchmarks/gpu.py --out DIR [--peer timm_train.py]`.
Sections (each JSON under DIR, copied into benchmarks/results/ by hand with the device named):
- memory: the memory planner's per-GPU total against torch.cuda.max_memory_allocated over a
  steady-state AdamW step (bf16 autocast), small models and batches.
- steps: images/s of one training step on GPU-resident batches (no loader) for the trainer's
  pieces (its model factory, fused AdamW, torch.amp bf16, channels_last, optionally
  torch.compile) against timm train.py's inner loop (timm's AdamW, autocast, eager); MFU =
  model FLOPs per second (counted with torch.utils.flop_counter) / the GPU's dense bf16 peak.
- e2e: timm's real train.py beside `python -m vitpod.trainer`, same JPEG folder, same augmentation,
  same model, batch and workers; steady-state images/s from each one's own per-step log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (H100 SXM5 989.4 TFLOP/s, H200 the same
# silicon); MFU is also given against the matmul rate measured on the card in the same run.
DATASHEET_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def device_peak() -> tuple[str, float | None]:
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in DATASHEET_BF16.items() if k in name), None)
    return name, peak


def measured_matmul_peak(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)


# --------------------------------------------------------------------------- memory


def measured_peak(model_name: str, img: int, batch: int) -> int:
    """Peak bytes allocated over a steady-state AdamW step (bf16 autocast), beyond the batch."""
    from vitpod.trainer.model.models import create_model

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = create_model(model_name, img, 1000, 0.1).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    images = torch.randn(batch, 3, img, img, device="cuda")
    targets = torch.randint(0, 1000, (batch,), device="cuda")
    for _ in range(2):  # the second step's peak: optimizer states exist by then
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as in DDP's buckets
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - images.nbytes - targets.nbytes


def memory_section(cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    from vitpod.analysis.memory import estimate

    out = []
    for model_name, img, batch in cases:
        measured = measured_peak(model_name, img, batch)
        planned = estimate(model_name, img, batch, "amp", num_classes=1000).total
        error = (planned - measured) / measured
        out.append(
            {
                "model": model_name, "img_size": img, "batch": batch, "precision": "bf16 autocast",
                "planned_bytes": planned, "measured_peak_bytes": measured, "error": error,
            }
        )  # fmt: skip
        print(f"memory {model_name} b{batch}: planned {planned / 2**30:.2f} GiB, measured "
              f"{measured / 2**30:.2f} GiB ({100 * error:+.1f}%)", flush=True)  # fmt: skip
    return out


# --------------------------------------------------------------------------- step rate


def flops_per_step(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.autocast("cuda", dtype=torch.bfloat16):
        torch.nn.functional.cross_entropy(model(images), targets).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def timed(step: Any, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def timm_step(name: str, img: int, batch: int) -> tuple[Any, torch.nn.Module]:
    """timm train.py's loop: timm's AdamW (create_optimizer_v2), autocast, loss.item() a step."""
    import timm
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2

    from vitpod.registry import models

    info = models.get(name)
    model = timm.create_model(info.timm_name or name, img_size=img, num_classes=1000).cuda()
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.05)
    loss_fn = LabelSmoothingCrossEntropy(0.1).cuda()
    images = torch.randn(batch, 3, img, img, device="cuda")
    targets = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()

    return step, model


def vitpod_step(name: str, img: int, batch: int, compile_model: bool) -> tuple[Any, Any]:
    """The trainer's pieces: model factory, make_precision (bf16, channels_last on GPU), fused
    AdamW with its parameter groups, and no host sync per step (it logs every N steps)."""
    from vitpod.trainer.model.models import create_model
    from vitpod.trainer.speed.precision import make_precision, prepare_model

    device = torch.device("cuda")
    precision = make_precision(device, True, False, "bf16", None)
    model = prepare_model(create_model(name, img, 1000, 0.1), precision, compile_model)
    return trainer_step(model, precision, img, batch), model


def trainer_step(model: torch.nn.Module, precision: Any, img: int, batch: int) -> Any:
    """One step as the trainer takes it: autocast forward, backward, its AdamW, no host sync."""
    from vitpod.trainer.model.optim import create_optimizer

    opt, _ = create_optimizer(model, "adamw", 1e-4, 0.05, precision.device)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    images = precision.prepare_input(torch.randn(batch, 3, img, img))
    targets = torch.randint(0, 1000, (batch,), device=precision.device)

    def step() -> None:
        with precision.autocast():
            loss = loss_fn(model(images), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def steps_section(cases: list[tuple[str, int, int]], peak: float | None, matmul: float) -> list:
    out = []
    for name, img, batch in cases:
        row: dict[str, Any] = {"model": name, "img_size": img, "batch": batch}
        step, model = timm_step(name, img, batch)
        flops = flops_per_step(
            model, torch.randn(batch, 3, img, img, device="cuda"),
            torch.randint(0, 1000, (batch,), device="cuda"),
        )  # fmt: skip
        row["flops_per_step"] = flops
        del step, model
        for key in ("timm_loop", "vitpod", "vitpod_compiled"):
            torch.cuda.empty_cache()
            start = time.perf_counter()
            if key == "timm_loop":
                run = timm_step(name, img, batch)[0]
            else:
                run = vitpod_step(name, img, batch, key == "vitpod_compiled")[0]
            run()  # first step: compile / autotune, timed as the warm-up cost
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            seconds = timed(run, warmup=5, steps=30)
            rate = batch / seconds
            row[key] = {
                "images_per_s": rate,
                "step_s": seconds,
                "first_step_s": first,
                "tflops": flops / seconds / 1e12,
                "mfu_datasheet": flops / seconds / peak if peak else None,
                "mfu_measured_matmul": flops / seconds / matmul,
            }
            tflops = flops / seconds / 1e12
            print(f"steps {name} b{batch} {key}: {rate:.0f} img/s, {tflops:.0f} TFLOP/s, "
                  f"first step {first:.1f} s", flush=True)  # fmt: skip
            del run
        base = row["timm_loop"]["images_per_s"]
        for key in ("vitpod", "vitpod_compiled"):
            row[key]["ratio_vs_timm_loop"] = row[key]["images_per_s"] / base
        out.append(row)
    return out


# --------------------------------------------------------------------------- end to end


def make_folder(root: Path, n_train: int, n_val: int, classes: int = 10) -> Path:
    """A JPEG ImageFolder of smooth random images at 256 px (written once per run)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", n_train), ("val", n_val)):
        for i in range(count):
            d = root / split / f"c{i % classes}"
            d.mkdir(parents=True, exist_ok=True)
            small = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
            img = Image.fromarray(small).resize((256, 256), Image.BILINEAR)
            img.save(d / f"{i}.jpg", quality=90)
    return root


def e2e_section(
    peer: Path, data: Path, scratch: Path, out: Path, name: str, batch: int, workers: int
) -> dict:
    common_aug = ["--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--smoothing", "0.1",
                  "--drop-path", "0.1", "--weight-decay", "0.05"]  # fmt: skip
    timm_name = name if name.startswith("vit") else f"{name}_224"
    timm_cmd = [
        sys.executable, str(peer), "--data-dir", str(data), "--model", timm_name, "-b", str(batch),
        "--epochs", "2", "--img-size", "224", "--workers", str(workers), "--num-classes", "10",
        "--opt", "adamw", "--lr", "1e-4", "--amp", "--amp-dtype", "bfloat16",
        "--log-interval", "1", "--output", str(scratch / f"timm-{name}"), "--color-jitter", "0",
        "--warmup-epochs", "0", *common_aug,
    ]  # fmt: skip
    ours_cmd = [
        sys.executable, "-m", "vitpod.trainer", str(data), "--model", name, "-b", str(batch),
        "--epochs", "2", "--img-size", "224", "--workers", str(workers), "--num-classes", "10",
        "--lr", "1e-4", "--amp", "--loader", "torch", "--log-interval", "1",
        "--output", str(scratch / f"vitpod-{name}"), "--warmup-epochs", "0", "--no-eval",
        *common_aug,
    ]  # fmt: skip
    result: dict[str, Any] = {"model": name, "batch": batch, "workers": workers}
    for key, cmd in (("timm_train_py", timm_cmd), ("vitpod", ours_cmd)):
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400)
        wall = time.perf_counter() - start
        (out / f"{name}-{key}.log").write_text(done.stdout + done.stderr)
        rates = (
            timm_rates(done.stdout + done.stderr)
            if key == "timm_train_py"
            else vitpod_rates(scratch / f"vitpod-{name}")
        )
        steady = rates[len(rates) // 2 :]
        result[key] = {
            "rc": done.returncode, "wall_s": wall,
            "images_per_s": sorted(steady)[len(steady) // 2] if steady else None,
            "samples": len(rates),
        }  # fmt: skip
        print(f"e2e {name} {key}: rc {done.returncode}, {result[key]['images_per_s']} img/s "
              f"(median of the second half of {len(rates)} logged steps), wall {wall:.0f} s",
              flush=True)  # fmt: skip
        if done.returncode:
            print((done.stdout + done.stderr)[-3000:], flush=True)
    a, b = result["vitpod"]["images_per_s"], result["timm_train_py"]["images_per_s"]
    result["ratio_vitpod_vs_timm"] = a / b if a and b else None
    return result


def timm_rates(log: str) -> list[float]:
    """timm train.py's per-interval lines: 'Time: 0.123s, 1040.5/s'."""
    return [float(m) for m in re.findall(r"Time:\s*[0-9.]+s,\s*([0-9.]+)/s", log)]


def vitpod_rates(run_dir: Path) -> list[float]:
    from vitpod.registry import runfiles

    rows = runfiles.read_metrics(run_dir, rank=0)
    return [
        float(r["images_per_s"]) for r in rows if r.get("kind") == "step" and "images_per_s" in r
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--sections", default="memory,steps,e2e")
    p.add_argument("--peer", default=str(ROOT.parent / "shared" / "peers" / "timm_train.py"))
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--scratch", default="/tmp/vitpod-gpu", help="images, runs, checkpoints")
    ns = p.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    name, peak = device_peak()
    matmul = measured_matmul_peak()
    record: dict[str, Any] = {
        "device": name, "torch": torch.__version__, "datasheet_bf16_flops": peak,
        "measured_bf16_matmul_flops": matmul, "cpus": os.cpu_count(),
    }  # fmt: skip
    print(f"{name}: bf16 matmul {matmul / 1e12:.0f} TFLOP/s (datasheet {peak})", flush=True)
    sections = ns.sections.split(",")
    if "memory" in sections:
        record["memory"] = memory_section(
            [("vit_small_patch16_224", 224, 64), ("vit_base_patch16_224", 224, 64),
             ("volo_d1", 224, 32), ("volo_d1", 224, 64)]
        )  # fmt: skip
    if "steps" in sections:
        record["steps"] = steps_section(
            [("vit_base_patch16_224", 224, 256), ("volo_d1", 224, 128)], peak, matmul
        )
    if "e2e" in sections:
        scratch = Path(ns.scratch)
        data = make_folder(scratch / "jpegs", 6144, 64)
        record["e2e"] = [
            e2e_section(Path(ns.peer), data, scratch, out, m, 128, ns.workers)
            for m in ("vit_base_patch16_224", "volo_d1")
        ]
    (out / "gpu.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "e2e"}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
