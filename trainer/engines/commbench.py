"""`python -m vitpod.trainer.engines.commbench --out FILE`: time all-reduce, reduce and broadcast
over a size sweep on every rank of a job, per level (inside a node, across nodes, whole world, one
rank).

Runs on every rank under srun (ranks and the rendezvous come from trainer/dist.py, so the
backend is NCCL on GPUs and gloo on CPUs, exactly as for training). Rank 0 writes one JSON file
that `vitpod.analysis.calibrate.fit` turns into latency and bandwidth per level.

How an operation is timed is how the trainer's DDP comm hook times a gradient bucket
(trainer/engines/ddp_engine.py `ring_hook`): the clock starts before the asynchronous call and stops
in the callback of its future, so the per-call software cost (enqueue, worker-thread hand-off,
callback) is in both. Before each timed call the group meets at a barrier; the call of the rank that
leaves the barrier last has no peer to wait for, so each iteration's time is the minimum over the
group's ranks (the same per-step statistic `vitpod.workflows.planning.exchange` reads from the
trainer's metrics). Levels, after Thakur, Rabenseifner & Gropp (2005), "Optimization of collective
communication operations in MPICH", whose cost formulas analysis/commcost.py uses:

- ``self``: a group of one rank: the per-call overhead with no message at all (LogP's `o`);
- ``intra``: the ranks of the first node (within-node links);
- ``inter``: the first rank of every node (one NIC rail per node);
- ``world``: every rank (the layout training uses; a check of the fitted model).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from vitpod.registry import io
from vitpod.trainer import dist as tdist

FORMAT = "vitpod-commbench/1"
OPS = ("all_reduce", "reduce", "broadcast")
LEVELS = ("self", "intra", "inter", "world")
# 4 KiB .. 16 MiB in steps of 4x: small sizes pin the latency, large ones the bandwidth.
DEFAULT_SIZES = tuple(4096 * 4**i for i in range(7))
DEFAULT_ITERS = 10
DEFAULT_WARMUP = 2
# CPU work before each timed call on CPU-only nodes (see busy()): the order of a short CPU
# training step (volo_tiny on localslurm: ~30 ms of compute per step at 2 ranks).
CPU_BUSY_MS = 40.0


def parse_sizes(text: str) -> list[int]:
    """'4096,65536 1M 16MiB' -> bytes (k/K, M, G suffixes are powers of 1024), each a multiple
    of 4 (the buffers are float32)."""
    scale = {"": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2}
    scale |= {"MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}
    sizes = []
    for word in text.replace(",", " ").split():
        digits = word.rstrip("kKmMgGiIbB")
        unit = word[len(digits) :].upper()
        if not digits.isdigit() or unit not in scale:
            raise ValueError(f"--sizes: cannot read {word!r}; write bytes, e.g. 4096 or 4K or 16M")
        size = int(digits) * scale[unit]
        if size < 4 or size % 4:
            raise ValueError(f"--sizes: {word!r} is not a positive multiple of 4 bytes (float32)")
        sizes.append(size)
    if not sizes:
        raise ValueError("--sizes is empty; give sizes in bytes, e.g. --sizes '4K 64K 1M 16M'")
    return sorted(set(sizes))


def node_key() -> str:
    """Which node this rank is on: Slurm's node name (several slurmd may share one host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def timed_call(op: str, buf: torch.Tensor, root: int, group: Any) -> float:
    """Seconds from the asynchronous call to its future's callback, as the DDP hook measures."""
    start = time.perf_counter()
    work: dist.Work | None
    if op == "all_reduce":
        work = dist.all_reduce(buf, group=group, async_op=True)
    elif op == "reduce":
        work = dist.reduce(buf, dst=root, group=group, async_op=True)
    else:
        work = dist.broadcast(buf, src=root, group=group, async_op=True)
    ended: list[float] = []

    def done(fut: torch.futures.Future) -> torch.Tensor:
        ended.append(time.perf_counter())
        return buf

    cast(dist.Work, work).get_future().then(done).wait()
    return ended[0] - start


def busy(seconds: float, work: torch.Tensor) -> None:
    """Keep this rank's CPU busy for `seconds` of wall time, as a CPU training step does.

    On CPU-only nodes the ranks compute between exchanges, and the kernel's scheduler treats a
    process that has just used its share of a CPU differently on wake-up from one that mostly
    slept (Linux EEVDF: a task's lag carries over its sleep), so an exchange right after
    compute can be slower than one in an idle loop. 0 (the default) on GPU clusters."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(work, work)


def run_level(
    ranks: list[int], group: Any, sizes: list[int], iters: int, warmup: int, device: torch.device,
    busy_s: float = 0.0,
) -> dict[str, list[list[float]]] | None:  # fmt: skip
    """This rank's seconds per (op, size, iteration) within `group`; None when not a member."""
    if dist.get_rank() not in ranks:
        return None
    work = torch.rand(64, 64)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    )
    out: dict[str, list[list[float]]] = {}
    buffers = [torch.ones(size // 4, dtype=torch.float32, device=device) for size in sizes]
    for op in OPS:
        rows: list[list[float]] = [[] for _ in sizes]
        # Sizes interleaved within each round, so a load change on a shared machine shifts all
        # sizes alike instead of bending the size-time line the fit reads bandwidth from.
        for i in range(warmup + iters):
            for k, buf in enumerate(buffers):
                if len(ranks) > 1:
                    dist.barrier(group=group)
                # As in a training step, one rank finishes its compute last while the others
                # already wait inside the collective; that rank's time is the iteration's
                # minimum. The late rank rotates so that every rank's links are measured.
                late = ranks[(i * len(buffers) + k) % len(ranks)]
                if busy_s > 0 and dist.get_rank() == late:
                    busy(busy_s, work)
                sync()
                seconds = timed_call(op, buf, ranks[0], group)
                if i >= warmup:
                    rows[k].append(seconds)
        out[op] = rows
    return out


def level_ranks(nodes: list[str], local: list[int]) -> dict[str, list[int]]:
    """The ranks of each level from every rank's node and local index (first node, first rank)."""
    order = list(dict.fromkeys(nodes))
    return {
        "self": [0],
        "intra": [r for r, n in enumerate(nodes) if n == order[0]],
        "inter": [r for r, n in enumerate(nodes) if local[r] == min(local)],
        "world": list(range(len(nodes))),
    }


def bench(
    sizes: list[int], iters: int, warmup: int, levels: list[str], busy_s: float = 0.0
) -> dict[str, Any]:
    env = tdist.detect()
    device = tdist.init(env)
    world = dist.get_world_size()
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, (node_key(), env.local_rank, socket.gethostname()))
    nodes = [f[0] for f in facts]
    local = [f[1] for f in facts]
    groups_of = level_ranks(nodes, local)
    # new_group is collective over the whole world: every rank creates every group, in order.
    groups = {name: dist.new_group(groups_of[name]) for name in levels}
    mine = {
        name: run_level(groups_of[name], groups[name], sizes, iters, warmup, device, busy_s)
        for name in levels
    }
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    result: dict[str, Any] = {
        "format": FORMAT,
        "backend": dist.get_backend(),
        "device": device.type,
        "world_size": world,
        "nodes": len(set(nodes)),
        "ranks_per_node": world // max(1, len(set(nodes))),
        "node_names": list(dict.fromkeys(nodes)),
        "hosts": sorted({f[2] for f in facts}),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "sizes": sizes,
        "iters": iters,
        "warmup": warmup,
        "busy_s": busy_s,
        "timing": "min over the group's ranks per iteration (after a barrier), median over "
        "iterations; start before the async call, stop in its future's callback",
        "torch": torch.__version__,
        "levels": {},
    }
    for name in levels:
        members = groups_of[name]
        per_rank = [gathered[r][name] for r in members]
        result["levels"][name] = {
            "ranks": len(members),
            "nodes": len({nodes[r] for r in members}),
            "members": members,
            "median_s": {
                op: [
                    statistics.median(
                        min(per_rank[k][op][s][i] for k in range(len(members)))
                        for i in range(iters)
                    )
                    for s in range(len(sizes))
                ]
                for op in OPS
            },
        }
    tdist.teardown()
    return result if env.is_main else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vitpod.trainer.engines.commbench", description=__doc__
    )
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    p.add_argument("--sizes", default="", help="message sizes in bytes (default 4K..16M, x4)")
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS, help="timed calls per point")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed calls first")
    p.add_argument("--levels", default=",".join(LEVELS), help=f"subset of {LEVELS}")
    p.add_argument("--busy-ms", type=float, default=None,
                   help="CPU work before each timed call (CPU-only; see busy())")  # fmt: skip
    ns = p.parse_args(argv)
    try:
        sizes = parse_sizes(ns.sizes) if ns.sizes else list(DEFAULT_SIZES)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    levels = [name for name in ns.levels.split(",") if name]
    unknown = sorted(set(levels) - set(LEVELS))
    if unknown or ns.iters < 1 or ns.warmup < 0:
        print(
            f"error: --levels {unknown} unknown (valid: {LEVELS}) or --iters < 1 or --warmup < 0",
            file=sys.stderr,
        )
        return 2
    busy_ms = ns.busy_ms
    if busy_ms is None:  # GPU ranks compute on the GPU; CPU ranks on the CPUs that communicate
        busy_ms = 0.0 if torch.cuda.is_available() else CPU_BUSY_MS
    result = bench(sizes, ns.iters, ns.warmup, levels, busy_ms / 1e3)
    if result:
        out = Path(ns.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        io.write_text_atomic(out, json.dumps(result, indent=1) + "\n")
        print(f"commbench: wrote {ns.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
