"""Token-labeling throughput per rank: images/s of `python -m vitpod.trainer.tokenlabels.label`'s
shard loop.

Each case labels one shard of digits JPEGs (written at the labeling size) with an untrained
teacher saved as a vitpod run directory: JPEG decode + resize on one core, the teacher's dense
forward, top-k, the atomic shard write. The figure is what one rank of `make token-labels`
does (the sidecar's images_per_s). On a GPU run it there too; results/labeling_gpu_h100.json
holds the teacher part alone, measured on a lent H100.

`python benchmarks/labeling.py [--out benchmarks/results/labeling_cpu.json]`
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [("volo_tiny", 32, 477), ("volo_d1", 224, 48)]  # (teacher, px, images in the shard)


def run_case(model: str, img_size: int, images: int, work: Path) -> dict:
    import torch

    from vitpod.trainer.checkpointing.checkpoint import save_final
    from vitpod.trainer.data.digits import write_digits_jpeg
    from vitpod.trainer.model.models import create_model, model_manifest
    from vitpod.trainer.tokenlabels import label

    data = write_digits_jpeg(work / f"digits{img_size}", size=img_size)
    teacher = work / f"teacher-{model}-{img_size}"
    if not (teacher / "final").is_dir():
        torch.manual_seed(0)
        weights = create_model(model, img_size, 10, 0.0).state_dict()
        save_final(teacher, weights, model_manifest(model, img_size, 10))
    shards = max(1, 1433 // images)
    ns = label.build_parser().parse_args([
        str(data), "--teacher", str(teacher), "--label-dir", str(work / f"tl-{model}"),
        "--img-size", str(img_size), "-b", "16",
    ])  # fmt: skip
    record = label.label_shard(ns, 0, shards)
    return {k: record[k] for k in ("images", "seconds", "images_per_s", "device", "grid")} | {
        "teacher": model, "img_size": img_size, "threads": torch.get_num_threads(),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/labeling_cpu.json"))
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_case(m, px, n, Path(tmp)) for m, px, n in CASES]
    out = {"benchmark": "token labeling images/s per rank", "cpu_count": os.cpu_count(),
           "load_avg_1min": os.getloadavg()[0], "results": results}  # fmt: skip
    Path(ns.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
