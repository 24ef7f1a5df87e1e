"""`python -m vitpod.trainer.tokenlabels.label DATA_DIR --teacher T --label-dir OUT`: label one
shard per rank.

One rank of a labeling job array: shard = array task x world size + rank, of
(array tasks x world size) shards, each a contiguous slice of the sorted training-sample names.
A rank runs the teacher over its slice (the whole image resized to --img-size, as the token
labeling paper scores every patch once: "All Tokens Matter", arXiv:2104.10858) and writes the
per-token top-k scores (float16) and class indices in the format `vitpod.trainer.data.token_label`
reads, under a temporary name then renamed, with a sidecar JSON written last. A requeued or
resubmitted job finds the sidecar and skips the shard. The directory belongs to one teacher
(labelset.claim: another teacher's rank exits 2 before touching a shard) and a rank holds its
shard's lock while it labels it (a second job of the same teacher waits, then skips).
Whichever rank finds every shard done writes labels.json (same content from any rank; atomic
rename), which is what the login node checks before a training job may use the labels.

`--layout published` writes TokenLabeling's layout instead of shards: one file per image,
`<label dir>/<class>/<image stem>.pt` = `torch.stack([top-k logits, indices]).half()` of shape
[2, k, H, W] at the teacher's own grid (any timm classifier: its classifier at every location of
the final feature map), readable by VOLO's training code as well as by vitpod's.

Exit status: 0 done (or skipped), 2 bad configuration, 75 preempted (requeue me).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from vitpod.registry import io, labellayout, labelset, runfiles
from vitpod.registry import records as folder_records
from vitpod.trainer.exitcodes import OK, REQUEUE, USAGE


class LabelError(ValueError):
    """A labeling job that cannot run as asked; the message names the flag and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vitpod.trainer.tokenlabels.label", description=__doc__
    )
    p.add_argument("data_dir", help="ImageNet-layout folder; its train/ split is labeled")
    p.add_argument("--teacher", required=True, help="vitpod run dir, weights file, or timm name")
    p.add_argument("--teacher-checkpoint", default="", help="weights for a timm-name teacher")
    p.add_argument("--teacher-model", default="", help="model name of a weights-file teacher")
    p.add_argument("--teacher-sha256", default="", help="weights digest (make token-labels)")
    p.add_argument("--label-dir", required=True, help="token-label directory (shared storage)")
    p.add_argument("--img-size", type=int, default=224, help="labeling resolution (grid = /16)")
    p.add_argument("--topk", type=int, default=5, help="classes kept per token (VOLO: 5)")
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument(
        "--layout", default="vitpod", choices=("vitpod", labelset.PUBLISHED),
        help="vitpod: shards of grid img_size/16 (a 16-px-token teacher); published: "
        "TokenLabeling's <class>/<image stem>.pt of [2, k, H, W] logits, any teacher's grid",
    )  # fmt: skip
    p.add_argument("--dataset", default="folder", choices=("folder", "digits"))
    p.add_argument("--shard", type=int, default=None, help="default: from Slurm array and rank")
    p.add_argument("--num-shards", type=int, default=None)
    return p


def shard_of_this_rank(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """(shard, shards) from SLURM_ARRAY_TASK_ID/COUNT and the rank (bind.sh sets RANK)."""
    env = dict(os.environ if environ is None else environ)
    task = int(env.get("SLURM_ARRAY_TASK_ID", "0"))
    tasks = int(env.get("SLURM_ARRAY_TASK_COUNT", "1"))
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    return task * world + rank, tasks * world


def teacher_record(ns: argparse.Namespace) -> dict[str, Any]:
    """What identifies the teacher in the manifest: its name and its weights file (path, size,
    modification time; hashing a multi-GB checkpoint on every rank would cost minutes)."""
    from vitpod.trainer.model.models import resolve_finetune_file

    weights = ns.teacher_checkpoint or ns.teacher
    if not weights or not (Path(weights).exists()):
        raise LabelError(f"--teacher {ns.teacher}: no weights (give a run dir or a file)")
    file = resolve_finetune_file(weights)
    stat = file.stat()
    return {
        "teacher": ns.teacher,
        "model": _teacher_name(ns, file),
        "weights": str(file.resolve()),
        "weights_bytes": stat.st_size,
        "weights_mtime": int(stat.st_mtime),
        # The login node hashes once and passes it; computed here only when run by hand.
        "weights_sha256": ns.teacher_sha256 or labelset.weights_digest(file),
    }


def _teacher_name(ns: argparse.Namespace, file: Path) -> str:
    if ns.teacher_checkpoint:
        return ns.teacher  # a timm model name
    manifest = folder_records.record_path(file.parent, runfiles.FINAL_RECORD)
    name = runfiles.read_record(manifest).get("model") if manifest.is_file() else None
    name = name or ns.teacher_model
    if not name:
        raise LabelError(
            f"--teacher {ns.teacher}: {file} has no {runfiles.FINAL_RECORD} naming its model; "
            "pass --teacher-model NAME"
        )
    return str(name)


def load_teacher(record: dict[str, Any], img_size: int, num_classes: int) -> Any:
    """The teacher at the labeling resolution (its pos-embed resampled like a fine-tune)."""
    from vitpod.trainer.model.models import load_finetune
    from vitpod.trainer.tokenlabels.token_teacher import build_teacher

    model = build_teacher(record["model"], img_size, num_classes)
    skipped = load_finetune(model, record["weights"], record["model"])
    if skipped:
        raise LabelError(
            f"teacher {record['teacher']}: its head does not predict the data set's "
            f"{num_classes} classes ({skipped[0]}); use a teacher trained on these classes"
        )
    return model.eval()


def label_shard(ns: argparse.Namespace, shard: int, shards: int) -> dict[str, Any]:
    """Label this rank's slice; returns the sidecar record (written only after the shard)."""
    from vitpod.trainer.data.sources import folder_split

    data_dir = Path(ns.data_dir)
    split = folder_split(data_dir, "train")
    names = [split.relpath(i) for i in range(len(split))]
    digest = labelset.names_digest(names)
    teacher = teacher_record(ns)
    meta = {
        "shard": shard, "num_shards": shards, "img_size": ns.img_size, "topk": ns.topk,
        "grid": labelset.grid_of(ns.img_size), "names_sha256": digest, "samples": len(names),
        "data_dir": str(data_dir.resolve()), "num_classes": len(split.classes),
        "classes_sha256": hashlib.sha256("\n".join(split.classes).encode()).hexdigest(),
        "teacher": teacher,
    }  # fmt: skip
    if ns.layout == labelset.PUBLISHED:
        _check_published(names, len(split.classes))
        meta.update(layout=labelset.PUBLISHED, grid=None)  # the teacher's grid, whatever it is
    out = labelset.shard_path(ns.label_dir, shard, shards)
    labelset.claim(ns.label_dir, teacher)  # ClaimError: another teacher's directory
    with labelset.locked(out.with_suffix(".lock"), f"(shard {shard} is being labeled elsewhere)"):
        return _label_locked(ns, split, names, meta, out)


def _check_published(names: list[str], num_classes: int) -> None:
    """The published layout names a label by class folder and image stem, indices in float16."""
    if num_classes > labellayout.PUBLISHED_MAX_CLASSES:
        raise LabelError(
            f"--layout published: {num_classes} classes, but its class indices are float16 "
            f"(exact up to {labellayout.PUBLISHED_MAX_CLASSES}); use --layout vitpod"
        )
    seen: dict[str, str] = {}
    for name in names:
        file = labellayout.label_file("", name).as_posix()
        if file in seen:
            raise LabelError(
                f"--layout published: {seen[file]} and {name} share the label file {file} (one "
                "file per image stem); rename one, or use --layout vitpod"
            )
        seen[file] = name


def _write_published(label_dir: str, names: list[str], logits: Any, topk: int) -> None:
    """One file per image, as TokenLabeling's generate_label.py writes it: the top-k logits and
    their class indices, torch.stack([...]).half() of shape [2, k, H, W]."""
    import torch

    from vitpod.trainer.checkpointing.torchsave import atomic_torch_save

    top = logits.float().topk(min(topk, logits.shape[1]), dim=1)
    for i, name in enumerate(names):
        maps = torch.stack([top.values[i].half().cpu(), top.indices[i].half().cpu()])
        atomic_torch_save(maps, labellayout.label_file(label_dir, name))


def _label_locked(
    ns: argparse.Namespace, split: Any, names: list[str], meta: dict[str, Any], out: Path
) -> dict[str, Any]:
    """label_shard's work, under the shard's lock."""
    import torch

    from vitpod.trainer.checkpointing.torchsave import atomic_torch_save
    from vitpod.trainer.data.config import DataConfig
    from vitpod.trainer.data.token_label import FORMAT
    from vitpod.trainer.data.transforms import eval_transform
    from vitpod.trainer.tokenlabels.token_forward import dense_logits
    from vitpod.trainer.tokenlabels.token_teacher import image_batches

    shard, shards, teacher = meta["shard"], meta["num_shards"], meta["teacher"]
    data_dir = Path(ns.data_dir)
    sidecar = out.with_suffix(".json")
    published = meta.get("layout") == labelset.PUBLISHED
    if sidecar.is_file() and (published or out.is_file()):
        done = json.loads(sidecar.read_text())
        if {k: done.get(k) for k in meta} == meta:
            print(f"label: shard {shard}/{shards} already done ({out}); skipped", flush=True)
            return done
        print(f"label: shard {shard}/{shards} was made with other settings; redoing", flush=True)
    start, stop = labelset.shard_bounds(len(names), shard, shards)
    sub = type(split)(
        split.name, split.classes, split.labels[start:stop],
        files=(split.files or [])[start:stop], root=split.root,
    )  # fmt: skip
    cuda = torch.cuda.is_available()
    # One GPU per rank, picked by the local rank as the trainer does (bind.sh sets LOCAL_RANK).
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else None
    model = load_teacher(teacher, ns.img_size, len(split.classes))
    if device is not None:
        model = model.to(device)
    cfg = DataConfig(data_dir=str(data_dir), img_size=ns.img_size, crop_pct=1.0)
    transform = eval_transform(cfg)
    values, indices = [], []
    began = time.perf_counter()
    done, teacher_grid = start, None
    with torch.no_grad():
        for images in image_batches(sub, transform, ns.batch_size):
            if device is not None:
                images = images.to(device, non_blocking=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=device is not None):
                logits = dense_logits(model, images)
            if published:
                _write_published(ns.label_dir, names[done : done + len(images)], logits, ns.topk)
                done, teacher_grid = done + len(images), list(logits.shape[2:])
                continue
            probs = logits.float().softmax(dim=1)
            top = probs.topk(min(ns.topk, probs.shape[1]), dim=1)
            values.append(top.values.half().cpu())
            indices.append(top.indices.to(torch.int16 if probs.shape[1] < 2**15 else torch.int32))
    seconds = time.perf_counter() - began
    if published:
        return _done(meta, sidecar, stop - start, seconds, device, teacher_grid=teacher_grid)
    grid = meta["grid"]  # an empty shard (more shards than images) still gets a file
    empty = (0, ns.topk, grid, grid)
    stacked_v = torch.cat(values) if values else torch.zeros(empty, dtype=torch.float16)
    stacked_i = torch.cat(indices).cpu() if indices else torch.zeros(empty, dtype=torch.int16)
    if stacked_v.shape[-1] != grid:
        raise LabelError(
            f"teacher {teacher['model']} gives a {stacked_v.shape[-1]}x"
            f"{stacked_v.shape[-1]} token grid at {ns.img_size} px, not {meta['grid']} "
            "(img_size/16): pass --layout published (any grid: the trainer resamples it with "
            "RoIAlign, as VOLO does), or use a teacher with 16x16 tokens (VOLO, ViT/16)"
        )
    atomic_torch_save(
        {
            "format": FORMAT, "num_classes": len(split.classes), "classes": split.classes,
            "img_size": ns.img_size, "index": {names[start + i]: i for i in range(stop - start)},
            "values": stacked_v, "indices": stacked_i,
            "teacher_sha256": teacher["weights_sha256"],  # checked by every reader
        },
        out,
    )  # fmt: skip
    return _done(meta, sidecar, stop - start, seconds, device)


def _done(
    meta: dict[str, Any], sidecar: Path, images: int, seconds: float, device: Any, **extra: Any
) -> dict[str, Any]:
    """Write the shard's sidecar (last: its presence means the shard is done) and report."""
    record = {
        **meta,
        **extra,
        "images": images,
        "seconds": round(seconds, 3),
        "images_per_s": round(images / seconds, 2) if seconds > 0 else None,
        "device": str(device or "cpu"),
        "host": os.uname().nodename,
    }
    io.write_text_atomic(sidecar, json.dumps(record, indent=2, sort_keys=True))
    print(
        f"label: shard {meta['shard']}/{meta['num_shards']}: {images} images in {seconds:.1f} s "
        f"({record['images_per_s']} images/s on {record['device']}) -> {sidecar.with_suffix('')}"
        + (f" ({meta['layout']} layout, teacher grid {extra.get('teacher_grid')})"
           if meta.get("layout") else ""),
        flush=True,
    )  # fmt: skip
    return record


def write_manifest_if_complete(output: str, meta: dict[str, Any]) -> dict[str, Any] | None:
    """When every shard's sidecar is there with this run's settings, write labels.json."""
    keys = ("num_shards", "img_size", "topk", "grid", "names_sha256", "samples", "teacher",
            "layout")  # fmt: skip
    records = []
    for number in range(meta["num_shards"]):
        sidecar = labelset.shard_path(output, number, meta["num_shards"]).with_suffix(".json")
        if not sidecar.is_file():
            return None
        record = json.loads(sidecar.read_text())
        if any(record.get(k) != meta.get(k) for k in keys):
            return None
        records.append(record)
    manifest = {
        "format": labelset.FORMAT,
        **{k: meta[k] for k in (*keys, "data_dir", "num_classes", "classes_sha256") if k in meta},
        **(
            {
                "teacher_grid": next(
                    (r["teacher_grid"] for r in records if r.get("teacher_grid")), None
                )
            }
            if meta.get("layout")
            else {}
        ),  # fmt: skip
        "split": "train",
        "throughput": [
            {k: r.get(k) for k in ("shard", "images", "seconds", "images_per_s", "device")}
            for r in records
        ],
    }
    folder_records.write(output, labelset.RECORD, dict(sorted(manifest.items())))
    return manifest


def _requeue_on_preemption() -> None:
    """SIGUSR2/SIGTERM (Slurm preemption): stop now and ask for a requeue. Nothing to save: a
    shard in progress is a temporary file (removed on the way out), finished ones are kept."""

    def stop(signum: int, _frame: Any) -> None:
        print(f"label: signal {signum}: stopping; the requeued job skips finished shards")
        sys.exit(REQUEUE)

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    _requeue_on_preemption()
    if ns.img_size % labelset.STRIDE:
        print(f"error: --img-size {ns.img_size} must be a multiple of 16", file=sys.stderr)
        return USAGE
    if ns.dataset == "digits":
        from vitpod.trainer.data.digits import write_digits_jpeg

        write_digits_jpeg(ns.data_dir, size=32)
    shard, shards = shard_of_this_rank()
    if ns.shard is not None or ns.num_shards is not None:
        shard, shards = ns.shard or 0, ns.num_shards or 1
    try:
        record = label_shard(ns, shard, shards)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    if write_manifest_if_complete(ns.label_dir, record) is not None:
        print(f"label: all {shards} shards done; record {Path(ns.label_dir) / labelset.RECORD}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
