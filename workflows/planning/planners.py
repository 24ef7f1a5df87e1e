"""`vitpod memory|layouts`: the analysis planners, fed a profile's GPU memory and fabric."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vitpod.analysis.fabric import Fabric
from vitpod.analysis.layout import compare_layouts, suggest_layouts
from vitpod.analysis.memcheck import compare
from vitpod.analysis.memory import (
    GIB,
    PRECISIONS,
    ZERO_STAGES,
    estimate,
    max_micro_batch,
)
from vitpod.registry.models import MODELS
from vitpod.workflows.site.profile import load_profile


def profile_numbers(profile: str, stage: str = "pretrain") -> tuple[int, Fabric]:
    """(gpu.memory_bytes, Fabric) of the node type a profile's stage runs on (the planners in
    analysis/ take numbers, not profiles)."""
    node = load_profile(profile).node_type(stage)
    memory = node.gpu.memory_bytes if node.gpu else 0
    if not memory:
        raise ValueError(
            f"--profile {profile!r}: no gpu.memory_bytes for the {stage} stage's node type; "
            f"add `gpu: {{model: ..., memory_bytes: N}}` or pass --gpu-mem-gib"
        )
    return memory, node.fabric_model()


def add_memory_parser(sub: Any) -> None:
    parser = sub.add_parser("memory", help="per-GPU memory estimate of a model and configuration")
    parser.add_argument("--model", required=True, help=f"one of {sorted(MODELS)}")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=0)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--token-label", action="store_true")
    parser.add_argument("--gpu-mem-gib", type=float, default=None, help="also: largest batch")
    parser.add_argument("--profile", default=None, help="cluster profile: its GPU memory")
    parser.add_argument("--stage", default="pretrain", help="the profile's stage (its node type)")
    parser.add_argument("--reserve-gib", type=float, default=1.0)
    parser.add_argument("--measure", action="store_true", help="also measure peak RSS on CPU")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=memory_main)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "img_size": args.img_size,
        "precision": args.precision,
        "zero": args.zero_stage,
        "gpus": args.gpus,
        "checkpointing": args.checkpointing,
        "num_classes": args.num_classes,
        "token_label": args.token_label,
    }


def memory_main(args: argparse.Namespace) -> int:
    result = estimate(batch=args.batch, **_settings(args))
    out: dict[str, Any] = result.as_dict()
    if args.profile and not args.gpu_mem_gib:
        args.gpu_mem_gib = profile_numbers(args.profile, args.stage)[0] / GIB
    if args.gpu_mem_gib:
        out["max_micro_batch"] = max_micro_batch(
            args.gpu_mem_gib * GIB, args.reserve_gib * GIB, **_settings(args)
        )
    if args.measure:
        out["measured"] = compare(args.model, args.img_size, args.batch, args.num_classes)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for key in ("weights", "grads", "optimizer", "buffers", "activations", "total"):
        print(f"{key:12s} {out[key] / 2**20:12.1f} MiB")
    print(f"{'params':12s} {result.params:12,d}")
    if "max_micro_batch" in out:
        print(f"largest micro-batch in {args.gpu_mem_gib:g} GiB: {out['max_micro_batch']}")
    if "measured" in out:
        m = out["measured"]
        print(
            f"measured on CPU (fp32): total {m['measured_total'] / 2**20:.1f} MiB, error "
            f"{100 * m['total_error']:+.1f}%; activations {m['measured_activations'] / 2**20:.1f}"
            f" MiB, error {100 * m['activation_error']:+.1f}%"
        )
    return 0


def add_layout_parser(sub: Any) -> None:
    parser = sub.add_parser("layouts", help="memory and communication of every dp x tp x pp")
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpus", type=int, required=True, help="world size")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--accum-steps", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--precision", default="amp")
    parser.add_argument("--profile", default="dgxpod", help="cluster profile: fabric and GPU")
    parser.set_defaults(func=layouts_main)


def layouts_main(args: Any) -> int:
    memory, fabric = profile_numbers(args.profile)
    ranked = compare_layouts(args.model, args.gpus, fabric, memory, args.global_batch,
                             args.accum_steps, img_size=args.img_size,
                             precision=args.precision)  # fmt: skip
    print(f"{'layout':28s} {'GiB/rank':>9s} {'fits':>5s} {'comm ms':>8s} {'bubble':>7s}")
    for c in ranked:
        name = f"dp{c.mesh.dp} tp{c.mesh.tp} pp{c.mesh.pp}" + " fsdp" * c.fsdp
        print(f"{name:28s} {c.memory.total / GIB:9.1f} {str(c.fits):>5s} "
              f"{c.comm.total_s * 1e3:8.1f} {c.comm.bubble:7.2f}")  # fmt: skip
    best = suggest_layouts(args.model, args.gpus, fabric, memory, args.global_batch,
                           args.accum_steps, img_size=args.img_size,
                           precision=args.precision)  # fmt: skip
    print("cheapest that fits: " + " ".join(best.flags()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vitpod", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_memory_parser(sub)
    add_layout_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 2


def memory_cli(argv: list[str]) -> int:
    return main(["memory", *argv])


def layouts_cli(argv: list[str]) -> int:
    return main(["layouts", *argv])
