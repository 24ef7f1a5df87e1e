"""Which (dp, tp, pp) layouts a job can use, their memory and communication, the cheapest fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vitpod.analysis.commcost import ring_bytes_per_gpu
from vitpod.analysis.fabric import Fabric
from vitpod.analysis.memory import GIB, MemoryEstimate, estimate
from vitpod.registry.models import Vit, arch_of, param_parts, stage_bounds
from vitpod.registry.paralleldims import ParallelDims


@dataclass(frozen=True, slots=True)
class LayoutComm:
    """Predicted communication of one optimizer step of a (dp, tp, pp) layout, per rank."""

    seconds: dict[str, float]
    """Time of each kind: dp (gradient all-reduce, or FSDP's gathers and reduce-scatter),
    tp (activation all-reduces), pp (activations and their gradients between stages)."""
    bytes: dict[str, float]
    """Bytes each rank sends for each kind."""
    bubble: float
    """Fraction of the step a pipeline stage idles: (pp - 1) / (micro_batches + pp - 1)."""

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def layout_comm(
    fabric: Fabric,
    dp: int,
    tp: int,
    pp: int,
    param_bytes_per_rank: float,
    activation_bytes_per_micro: float,
    blocks_per_stage: int,
    micro_batches: int = 1,
    fsdp: bool = False,
    reshard_after_forward: bool = True,
) -> LayoutComm:
    """Communication per step and rank of a layout (tp innermost, then pp, then dp).

    - dp: DDP all-reduces the rank's gradients, 2(dp-1)/dp x M (ring). FSDP (ZeRO-3) instead
      all-gathers weights for the forward and again for the backward (unless weights stay
      gathered) and reduce-scatters gradients: 3 x (dp-1)/dp x M, 1.5x DDP's (Rajbhandari et
      al., arXiv:1910.02054, section 7.2.2); 2 x with reshard_after_forward off.
    - tp: each block all-reduces its (micro-batch x tokens x dim) activation twice in the
      forward and twice in the backward (Shoeybi et al., arXiv:1909.08053, figure 4).
    - pp: each micro-batch's activation goes forward and its gradient back across a boundary.
    `param_bytes_per_rank` is the rank's gradient bytes before dp sharding (its stage and tp
    share); `activation_bytes_per_micro` one block output of a micro-batch on one rank.
    """
    if min(dp, tp, pp, micro_batches) < 1:
        raise ValueError(f"dp, tp, pp and micro_batches must be >= 1, got {dp, tp, pp}")
    if tp > fabric.gpus_per_node:
        raise ValueError(
            f"--tp {tp} exceeds the {fabric.gpus_per_node} GPUs of a node; tensor parallelism "
            f"all-reduces every block's activations, keep it within NVLink: --tp <= "
            f"{fabric.gpus_per_node}"
        )
    seconds: dict[str, float] = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    sent: dict[str, float] = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    # dp peers are tp x pp ranks apart: on one node only if the whole job is.
    inside = dp * tp * pp <= fabric.gpus_per_node
    dp_bw = fabric.intra_bw if inside else min(fabric.intra_bw, fabric.node_bw / max(1, tp * pp))
    dp_lat = fabric.intra_latency if inside else fabric.inter_latency
    if dp > 1:
        share = (dp - 1) / dp * param_bytes_per_rank
        passes = (3.0 if reshard_after_forward else 2.0) if fsdp else 2.0
        sent["dp"] = passes * share
        seconds["dp"] = sent["dp"] / dp_bw + passes * (dp - 1) * dp_lat
    if tp > 1:
        calls = 4 * blocks_per_stage * micro_batches
        sent["tp"] = calls * ring_bytes_per_gpu(activation_bytes_per_micro, tp)
        seconds["tp"] = sent["tp"] / fabric.intra_bw + calls * 2 * (tp - 1) * fabric.intra_latency
    if pp > 1:
        # Stages are tp ranks apart; across nodes once tp x pp exceeds a node.
        cross = tp * pp > fabric.gpus_per_node
        bw = (
            min(fabric.intra_bw, fabric.node_bw / fabric.gpus_per_node)
            if cross
            else fabric.intra_bw
        )
        lat = fabric.inter_latency if cross else fabric.intra_latency
        sent["pp"] = 2 * micro_batches * activation_bytes_per_micro
        seconds["pp"] = sent["pp"] / bw + 2 * micro_batches * lat
    bubble = (pp - 1) / (micro_batches + pp - 1)
    return LayoutComm(seconds=seconds, bytes=sent, bubble=bubble)


def _heads(model: str) -> list[int]:
    arch = arch_of(model)
    return [arch.num_heads] if isinstance(arch, Vit) else list(arch.num_heads)


def _blocks(model: str) -> int:
    return len(param_parts(model).blocks)


def check_layout(
    world: int, gpus_per_node: int, tp: int, pp: int, model: str | None = None
) -> ParallelDims:
    """The dims of this layout; ValueError naming the flag and the fix if the trainer cannot
    run it (the rules are ParallelDims'; the model's heads and blocks are checked here)."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus per node must be a whole number >= 1, got {gpus_per_node!r}")
    problem = ParallelDims(tp=tp, pp=pp).node_problem(gpus_per_node)
    if problem:
        raise ValueError(problem)
    dims = ParallelDims.of_world(world, tp, pp, unit="GPUs")
    if model is not None:
        _check_model(model, tp, pp)
    return dims


def _check_model(model: str, tp: int, pp: int) -> None:
    bad = [h for h in _heads(model) if h % tp]
    if bad:
        raise ValueError(
            f"--tp {tp}: {model} has {bad[0]} attention heads per block, which do not split over"
            f" {tp} ranks (a rank computes whole heads); use a --tp dividing {bad[0]}"
        )
    if pp > 1 and not model.startswith("vit_"):
        raise ValueError(
            f"--pp {pp}: pipeline stages are defined for vit_* models, not {model}; use --tp or"
            " --fsdp"
        )
    stage_bounds(_blocks(model), pp)  # --pp beyond the model's blocks: ValueError naming it


def candidate_layouts(world: int, gpus_per_node: int, model: str) -> list[ParallelDims]:
    """Every (dp, tp, pp) the trainer can run for `model` on `world` GPUs."""
    out = []
    for tp in range(1, gpus_per_node + 1):
        for pp in range(1, world // tp + 1):
            try:
                out.append(check_layout(world, gpus_per_node, tp, pp, model))
            except ValueError:
                continue
    return out


@dataclass(frozen=True, slots=True)
class LayoutCost:
    """One layout's memory on its most loaded rank and its predicted step overhead."""

    mesh: ParallelDims
    fsdp: bool
    memory: MemoryEstimate
    comm: LayoutComm
    overhead_s: float
    """Communication seconds plus the pipeline bubble's share of the compute time."""
    fits: bool
    settings: dict[str, Any] = field(default_factory=dict)

    def flags(self) -> list[str]:
        return self.mesh.flags(self.fsdp)

    def as_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh.as_dict(), "fsdp": self.fsdp, "fits": self.fits,
            "bytes_per_rank": self.memory.total, "comm_s": self.comm.seconds,
            "comm_bytes": self.comm.bytes, "bubble": self.comm.bubble,
            "overhead_s": self.overhead_s, "flags": self.flags(),
        }  # fmt: skip


def step_flops(model: str, img_size: int, batch: int, num_classes: int = 1000) -> float:
    """Training FLOPs of `batch` images: 6 x parameters x tokens for the matmuls (forward 2,
    backward 4; Kaplan et al., arXiv:2001.08361) plus attention's 12 x tokens^2 x dim a block."""
    arch = arch_of(model)
    params = param_parts(model, img_size, num_classes).total
    if isinstance(arch, Vit):
        tokens, dims = (img_size // arch.patch_size) ** 2 + 1, [arch.embed_dim] * arch.depth
    else:
        tokens = (img_size // arch.patch_size // 2) ** 2
        dims = [d for d, n in zip(arch.embed_dims, arch.layers, strict=True) for _ in range(n)]
    return batch * (6.0 * params * tokens + sum(12.0 * tokens * tokens * d for d in dims))


def layout_cost(
    model: str, mesh: ParallelDims, fabric: Fabric, gpu_mem_bytes: float, batch: int,
    img_size: int = 224, precision: str = "amp", fsdp: bool = False, micro_batches: int = 1,
    flops_per_s: float = 312e12, reserve_bytes: float = 1.0 * GIB, num_classes: int = 1000,
    schedule: str = "1f1b",
) -> LayoutCost:  # fmt: skip
    """Memory and predicted overhead of one layout; `batch` is the micro-batch per dp rank.

    flops_per_s: sustained GPU FLOP/s (default: A100 bf16 dense peak, an optimistic bound)
    turns the bubble fraction into seconds.
    """
    mem = estimate(model, img_size, batch, precision, mesh=mesh, fsdp=fsdp,
               micro_batches=micro_batches, schedule=schedule, num_classes=num_classes)  # fmt: skip
    arch = arch_of(model)
    dim = arch.embed_dim if isinstance(arch, Vit) else arch.embed_dims[-1]
    tokens = (img_size // arch.patch_size) ** 2 + 1 if isinstance(arch, Vit) else \
        (img_size // arch.patch_size // 2) ** 2  # fmt: skip
    act_bytes = batch * tokens * dim * (2 if precision != "fp32" else 4)
    blocks_per_stage = max(e - s for s, e in stage_bounds(_blocks(model), mesh.pp))
    grad_bytes = mem.settings["params_per_rank"] * (2 if precision == "half" else 4)
    comm = layout_comm(fabric, mesh.dp, mesh.tp, mesh.pp, grad_bytes, act_bytes, blocks_per_stage,
                       micro_batches, fsdp)  # fmt: skip
    compute_s = step_flops(model, img_size, batch * micro_batches, num_classes) / (
        flops_per_s * mesh.tp * mesh.pp
    )
    overhead = comm.total_s + comm.bubble / (1 - comm.bubble) * compute_s
    fits = mem.total <= gpu_mem_bytes - reserve_bytes
    return LayoutCost(mesh, fsdp, mem, comm, overhead, fits,
                      {"compute_s": compute_s, "batch": batch, "img_size": img_size})  # fmt: skip


def compare_layouts(
    model: str, world: int, fabric: Fabric, gpu_mem_bytes: float, global_batch: int,
    micro_batches: int = 1, **kwargs: Any,
) -> list[LayoutCost]:  # fmt: skip
    """Every runnable layout at the same global batch, with and without FSDP, cheapest first
    (those that fit before those that do not). A layout's micro-batch per dp rank is
    global_batch / (dp x micro_batches); layouts it does not divide are left out."""
    out = []
    for mesh in candidate_layouts(world, fabric.gpus_per_node, model):
        micro, rest = divmod(global_batch, mesh.dp * micro_batches)
        if rest or not micro:
            continue
        for fsdp in (False, True) if mesh.dp > 1 else (False,):
            out.append(layout_cost(model, mesh, fabric, gpu_mem_bytes, micro, fsdp=fsdp,
                                   micro_batches=micro_batches, **kwargs))  # fmt: skip
    return sorted(out, key=lambda c: (not c.fits, c.overhead_s))


def suggest_layouts(
    model: str, world: int, fabric: Fabric, gpu_mem_bytes: float, global_batch: int,
    micro_batches: int = 1, **kwargs: Any,
) -> LayoutCost:  # fmt: skip
    """The cheapest layout that fits `gpu_mem_bytes`; ValueError (with the best try) if none."""
    ranked = compare_layouts(model, world, fabric, gpu_mem_bytes, global_batch, micro_batches,
                             **kwargs)  # fmt: skip
    if not ranked or not ranked[0].fits:
        best = min(ranked, key=lambda c: c.memory.total) if ranked else None
        need = f"; the smallest, {best.flags()}, needs {best.memory.total / GIB:.1f} GiB" if best \
            else ""  # fmt: skip
        raise ValueError(
            f"{model} at global batch {global_batch} fits no layout of {world} GPUs with "
            f"{gpu_mem_bytes / GIB:.0f} GiB{need}: add --accum-steps, lower the batch or add GPUs"
        )
    return ranked[0]
