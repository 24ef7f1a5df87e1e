"""Alpha-beta cost model of gradient exchange: ring, tree, parameter servers (pure arithmetic)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

ALLREDUCE = "ring"
PARAMETER_SERVER = "ps"
# Each modelled algorithm and the trainer's --topology value that runs it (NCCL picks ring or
# tree itself once all-reduce is chosen; the trainer's parameter server is the DDP hook).
TRAINER_TOPOLOGY = {
    "ring": ALLREDUCE,
    "hierarchical": ALLREDUCE,
    "tree": ALLREDUCE,
    "ps_colocated": PARAMETER_SERVER,
    "ps_dedicated": PARAMETER_SERVER,
}

_UNITS = {
    "": 1.0,
    "B/s": 1.0,
    "kB/s": 1e3,
    "MB/s": 1e6,
    "GB/s": 1e9,
    "TB/s": 1e12,
    "Mb/s": 1e6 / 8,
    "Gb/s": 1e9 / 8,
    "Gbit/s": 1e9 / 8,
    "Gbps": 1e9 / 8,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "ns": 1e-9,
}
_QUANTITY = re.compile(r"^\s*([0-9.eE+-]+)\s*([A-Za-zµ/]*)\s*$")


def parse_quantity(value: Any, name: str) -> float:
    """A number, or a string such as '200 Gb/s', '25 GB/s', '2 us' -> bytes/s or seconds."""
    if isinstance(value, bool):
        raise ValueError(f"fabric.{name}: expected a number, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.match(str(value))
    scale = _UNITS.get(match.group(2)) if match else None
    number = _to_float(match.group(1)) if match else None
    if scale is None or number is None:
        raise ValueError(
            f"fabric.{name}: cannot read {value!r}; give bytes/s or seconds as a number, or a "
            f"number with a unit from {sorted(u for u in _UNITS if u)} (Gb/s bits, GB/s bytes)"
        )
    return number * scale


def _to_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(kw_only=True, frozen=True, slots=True)
class Fabric:
    """The interconnect of one cluster partition, in bytes/s and seconds."""

    gpus_per_node: int
    """GPUs (ranks) per node."""
    intra_bw: float
    """Per-GPU all-reduce bus bandwidth inside a node (NVLink/NVSwitch), bytes/s."""
    intra_latency: float
    """Latency of one message between GPUs of a node, seconds."""
    nic_bw: float
    """Usable bandwidth of one inter-node NIC (InfiniBand HCA), bytes/s, each direction."""
    nics_per_node: int
    """NICs per node; all-reduce rings use them as parallel rails."""
    inter_latency: float
    """Latency of one message between nodes, seconds."""
    ps_servers: int = 0
    """Dedicated CPU parameter-server machines available (0: none)."""
    ps_bw: float = 0.0
    """Network bandwidth of one dedicated parameter-server machine, bytes/s, each direction."""
    call_overhead: float = 0.0
    """Software seconds of one collective call apart from its messages (enqueue, hand-off to the
    backend's thread, completion callback): LogP's `o` (Culler et al. 1993). 0 unless measured
    (`make calibrate`); counted once per call by `step_costs`."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_node"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"fabric.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("intra_bw", "nic_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"fabric.{name} must be > 0 bytes/s, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency", "ps_bw", "call_overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"fabric.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.ps_servers < 0:
            raise ValueError(f"fabric.ps_servers must be >= 0, got {self.ps_servers!r}")
        if self.ps_servers > 0 and self.ps_bw <= 0:
            raise ValueError("fabric.ps_servers > 0 needs fabric.ps_bw (bytes/s) > 0")

    @property
    def node_bw(self) -> float:
        """Aggregate inter-node bandwidth of one node (all NIC rails), bytes/s."""
        return self.nic_bw * self.nics_per_node

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Fabric:
        """Build from a profile's `fabric:` block; unknown keys raise with the valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"fabric: unknown key(s) {unknown}; valid keys: {valid}")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"fabric: missing key(s) {missing}; valid keys: {valid}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name in ("gpus_per_node", "nics_per_node", "ps_servers"):
                values[name] = _as_count(value, name)
            else:
                values[name] = parse_quantity(value, name)
        return cls(**values)


def _as_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"fabric.{name}: expected a whole number, got {value!r}")
    return value


# DGX A100: ~230 GB/s NCCL all-reduce bus bandwidth in a node; 8 HDR HCAs (8 x 200 Gb/s) give
# ~192 GB/s across nodes (96% of the 200 GB/s line rate).
DGX_A100 = Fabric(
    gpus_per_node=8,
    intra_bw=230e9,
    intra_latency=2e-6,
    nic_bw=24e9,
    nics_per_node=8,
    inter_latency=5e-6,
)
# DGX-2: 16 V100 on NVSwitch (~130 GB/s bus bandwidth), 8 EDR HCAs (8 x 100 Gb/s).
DGX2 = Fabric(
    gpus_per_node=16,
    intra_bw=130e9,
    intra_latency=2e-6,
    nic_bw=12e9,
    nics_per_node=8,
    inter_latency=5e-6,
)


@dataclass(frozen=True, slots=True)
class Choice:
    """The cheapest algorithm, its predicted seconds per gradient exchange, and the others'."""

    name: str
    predicted_s: float
    reason: str
    costs: dict[str, float] = field(default_factory=dict)

    @property
    def topology(self) -> str:
        """The trainer's --topology value (ring|ps) that runs this algorithm."""
        return TRAINER_TOPOLOGY[self.name]

    def trainer_flags(self, ranks: int) -> list[str]:
        """Trainer flags that run this algorithm; the colocated parameter server modelled here
        has every rank serve a shard, so it needs --ps-servers equal to the ranks."""
        flags = ["--topology", self.topology]
        return flags + ["--ps-servers", str(ranks)] if self.name == "ps_colocated" else flags


@dataclass(frozen=True, slots=True)
class Layout:
    """How n ranks sit on nodes: `nodes` nodes with `per_node` ranks each."""

    nodes: int
    per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def layout(fabric: Fabric, nodes: int, gpus: int | None = None) -> Layout:
    """Ranks spread evenly over nodes; gpus defaults to every GPU of every node."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
    total = nodes * fabric.gpus_per_node if gpus is None else gpus
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    if total % nodes:
        raise ValueError(f"gpus={total} does not divide evenly over nodes={nodes}")
    per_node = total // nodes
    if per_node > fabric.gpus_per_node:
        raise ValueError(
            f"gpus={total} over nodes={nodes} is {per_node} per node, but the fabric has "
            f"gpus_per_node={fabric.gpus_per_node}; add nodes or lower gpus"
        )
    return Layout(nodes=nodes, per_node=per_node)


def ring_bytes_per_gpu(grad_bytes: float, ranks: int) -> float:
    """Bytes each GPU sends in a ring all-reduce: 2(n-1)/n x M."""
    return 2.0 * (ranks - 1) / ranks * grad_bytes


def _bus_bw(fabric: Fabric, lay: Layout) -> float:
    """Per-GPU bandwidth of the slowest ring hop: NVLink, or the node's rails across nodes."""
    return fabric.intra_bw if lay.nodes == 1 else min(fabric.intra_bw, fabric.node_bw)


def _hop_latency(fabric: Fabric, lay: Layout) -> float:
    return fabric.intra_latency if lay.nodes == 1 else fabric.inter_latency


def ring_s(fabric: Fabric, grad_bytes: float, lay: Layout) -> float:
    """Flat ring (NCCL Ring): 2(n-1) steps; 2(n-1)/n x M per GPU through the slowest hop.

    Across nodes each ring crosses a node boundary once, so with one ring per NIC rail the
    node's aggregate NIC bandwidth bounds the bus bandwidth (not NIC bandwidth / GPUs).
    """
    n = lay.ranks
    if n == 1:
        return 0.0
    return 2 * (n - 1) * _hop_latency(fabric, lay) + ring_bytes_per_gpu(grad_bytes, n) / _bus_bw(
        fabric, lay
    )


def hierarchical_s(fabric: Fabric, grad_bytes: float, lay: Layout) -> float:
    """2-D ring: reduce-scatter in each node, all-reduce of the 1/g shards across nodes
    over the rails, all-gather in each node (phases run one after another)."""
    g, nodes = lay.per_node, lay.nodes
    if lay.ranks == 1:
        return 0.0
    intra = 2 * (g - 1) * fabric.intra_latency + ring_bytes_per_gpu(grad_bytes, g) / fabric.intra_bw
    if nodes == 1:
        return intra
    # g shard-rings of M/g each share the node's rails: 2(N-1)/N x M leaves each node.
    inter = (
        2 * (nodes - 1) * fabric.inter_latency
        + ring_bytes_per_gpu(grad_bytes, nodes) / fabric.node_bw
    )
    return intra + inter


def tree_s(fabric: Fabric, grad_bytes: float, lay: Layout) -> float:
    """Pipelined (double binary) tree: reduce up and broadcast down, 2 log2(n) latencies,
    about 2 x M through the slowest hop."""
    n = lay.ranks
    if n == 1:
        return 0.0
    latency = 2 * (
        math.ceil(math.log2(lay.per_node)) * fabric.intra_latency
        + math.ceil(math.log2(lay.nodes)) * fabric.inter_latency
    )
    return latency + 2.0 * grad_bytes / _bus_bw(fabric, lay)


def ps_colocated_s(fabric: Fabric, grad_bytes: float, lay: Layout) -> float:
    """Every rank also serves M/n: it pushes (n-1)/n x M and replies (n-1)/n x M.

    Traffic to ranks on the same node uses NVLink; to other nodes it shares the node's rails,
    so a node sends 2 g (n-g)/n x M off-node. Each rank issues n-1 pushes and n-1 replies.
    """
    n, g = lay.ranks, lay.per_node
    if n == 1:
        return 0.0
    intra = 2.0 * (g - 1) / n * grad_bytes / fabric.intra_bw
    inter = 2.0 * g * (n - g) / n * grad_bytes / fabric.node_bw
    return 2 * (n - 1) * _hop_latency(fabric, lay) + max(intra, inter)


def ps_dedicated_s(fabric: Fabric, grad_bytes: float, lay: Layout, servers: int) -> float:
    """S dedicated CPU servers: max(M/B, nM/(S B_s)) with push and pull overlapped (full duplex).

    A worker's B is its share of the node's rails: a node pushes g x M over them. Each worker
    sends one shard to, and receives one from, each server.
    """
    if servers < 1:
        raise ValueError(f"ps_servers must be >= 1 for a dedicated parameter server, got {servers}")
    if fabric.ps_bw <= 0:
        raise ValueError("a dedicated parameter server needs fabric.ps_bw (bytes/s) > 0")
    workers = lay.per_node * grad_bytes / fabric.node_bw
    server = lay.ranks * grad_bytes / (servers * fabric.ps_bw)
    return 2 * servers * fabric.inter_latency + max(workers, server)


def costs(
    fabric: Fabric,
    grad_bytes: float,
    nodes: int,
    ps_servers: int | None = None,
    gpus: int | None = None,
) -> dict[str, float]:
    """Seconds per gradient exchange of each algorithm (dedicated PS only when servers exist)."""
    if isinstance(grad_bytes, bool) or not grad_bytes >= 0:
        raise ValueError(f"grad_bytes must be >= 0, got {grad_bytes!r}")
    lay = layout(fabric, nodes, gpus)
    result = {
        "ring": ring_s(fabric, grad_bytes, lay),
        "hierarchical": hierarchical_s(fabric, grad_bytes, lay),
        "tree": tree_s(fabric, grad_bytes, lay),
        "ps_colocated": ps_colocated_s(fabric, grad_bytes, lay),
    }
    servers = fabric.ps_servers if ps_servers is None else ps_servers
    if servers:
        result["ps_dedicated"] = ps_dedicated_s(fabric, grad_bytes, lay, servers)
    return result


def choose_topology(
    fabric: Fabric,
    grad_bytes: float,
    nodes: int,
    ps_servers: int | None = None,
    gpus: int | None = None,
) -> Choice:
    """The cheapest algorithm for exchanging grad_bytes of gradients among `gpus` ranks on
    `nodes` nodes (default: all GPUs of those nodes); ties go to the ring."""
    table = costs(fabric, grad_bytes, nodes, ps_servers, gpus)
    return _cheapest(table, grad_bytes, nodes, layout(fabric, nodes, gpus).ranks, "")


def _cheapest(
    table: dict[str, float], grad_bytes: float, nodes: int, ranks: int, how: str
) -> Choice:
    best = min(table, key=lambda name: (table[name], name != "ring"))
    runner_up = sorted((t, name) for name, t in table.items() if name != best)
    versus = f", next {runner_up[0][1]} {_fmt_s(runner_up[0][0])}" if runner_up else ""
    reason = (
        f"{best} predicted {_fmt_s(table[best])} per step for {_fmt_bytes(grad_bytes)} of "
        f"gradients over {ranks} GPUs on {nodes} node(s){how}{versus}"
    )
    return Choice(name=best, predicted_s=table[best], reason=reason, costs=table)


# PyTorch DDP's defaults (torch.nn.parallel.DistributedDataParallel docs: bucket_cap_mb=25; the
# first bucket is capped at torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB so that
# communication starts early in the backward pass).
DDP_BUCKET_CAP_BYTES = 25 * 1024**2
DDP_FIRST_BUCKET_BYTES = 1024**2
# What each backend's all-reduce can run: gloo's allreduce (ProcessGroupGloo) is gloo's ring;
# NCCL picks ring or tree itself (NCCL_ALGO), and a 2-D ring is what its ring does across nodes.
BACKEND_ALGORITHMS = {
    "gloo": ("ring", "ps_colocated", "ps_dedicated"),
    "nccl": tuple(TRAINER_TOPOLOGY),
}
# Collective calls per gradient bucket: one all-reduce, or the parameter-server hook's reduce
# to the bucket's server followed by its broadcast (trainer/parallel.py ps_hook).
CALLS_PER_BUCKET = {"ring": 1, "hierarchical": 1, "tree": 1, "ps_colocated": 2, "ps_dedicated": 2}


def ddp_buckets(
    grad_bytes: float,
    cap: float = DDP_BUCKET_CAP_BYTES,
    first_cap: float = DDP_FIRST_BUCKET_BYTES,
) -> list[float]:
    """Bucket sizes DDP exchanges per step (after its first-iteration rebuild): the first
    bucket up to `first_cap`, then `cap`-sized ones. Buckets hold whole tensors, so real
    boundaries differ slightly; the count, which sets the per-call latency, is what matters."""
    if grad_bytes <= 0:
        return []
    sizes = [min(grad_bytes, first_cap)]
    rest = grad_bytes - sizes[0]
    while rest > 0:
        sizes.append(min(rest, cap))
        rest -= sizes[-1]
    return sizes


def ps_hook_s(fabric: Fabric, bucket_bytes: float, lay: Layout) -> float:
    """The trainer's parameter-server hook on one bucket: reduce to the bucket's server rank,
    then broadcast from it (trainer/parallel.py ps_hook), each a binomial tree of
    ceil(log2 n) rounds that each move the whole bucket over a hop: Thakur, Rabenseifner &
    Gropp (2005), short-message reduce and broadcast, ceil(log2 p)(alpha + n beta).

    With a few buckets one server carries each whole bucket, which the sharded
    `ps_colocated_s` (every rank serving 1/n of every exchange) does not describe."""
    n = lay.ranks
    if n == 1:
        return 0.0
    rounds = math.ceil(math.log2(n))
    return 2 * rounds * (_hop_latency(fabric, lay) + bucket_bytes / _bus_bw(fabric, lay))


def step_costs(
    fabric: Fabric,
    grad_bytes: float,
    nodes: int,
    ps_servers: int | None = None,
    gpus: int | None = None,
    backend: str = "nccl",
    buckets: list[float] | None = None,
) -> dict[str, float]:
    """Communication seconds per optimizer step as the trainer measures them: its DDP comm
    hook times each gradient bucket from the hook call to the completion of the bucket's
    collective(s) and sums the buckets (trainer/parallel.py). So each bucket pays the
    algorithm's latency terms and `call_overhead` per call; buckets are taken not to queue
    behind one another (a backward pass slower than communication). The colocated parameter
    server is the trainer's hook (`ps_hook_s`: reduce + broadcast of each bucket). Only the
    algorithms the backend runs are priced (gloo: ring and the parameter servers)."""
    if backend not in BACKEND_ALGORITHMS:
        raise ValueError(f"backend {backend!r} is not one of {sorted(BACKEND_ALGORITHMS)}")
    sizes = ddp_buckets(grad_bytes) if buckets is None else buckets
    lay = layout(fabric, nodes, gpus)
    total: dict[str, float] = {}
    for size in sizes:
        per_bucket = costs(fabric, size, nodes, ps_servers, gpus)
        per_bucket["ps_colocated"] = ps_hook_s(fabric, size, lay)
        for name, seconds in per_bucket.items():
            if name in BACKEND_ALGORITHMS[backend]:
                calls = CALLS_PER_BUCKET[name] if lay.ranks > 1 else 1
                total[name] = total.get(name, 0.0) + seconds + calls * fabric.call_overhead
    if not total:  # no gradients: every algorithm costs nothing
        total = {
            n: 0.0
            for n in costs(fabric, 0.0, nodes, ps_servers, gpus)
            if n in BACKEND_ALGORITHMS[backend]
        }
    return total


def choose_step_topology(
    fabric: Fabric,
    grad_bytes: float,
    nodes: int,
    ps_servers: int | None = None,
    gpus: int | None = None,
    backend: str = "nccl",
) -> Choice:
    """Like `choose_topology`, priced per optimizer step as the trainer measures it
    (`step_costs`: DDP buckets, per-call overhead, the backend's own algorithms)."""
    table = step_costs(fabric, grad_bytes, nodes, ps_servers, gpus, backend)
    n_buckets = len(ddp_buckets(grad_bytes))
    how = f" in {n_buckets} DDP bucket(s), {backend}"
    return _cheapest(table, grad_bytes, nodes, layout(fabric, nodes, gpus).ranks, how)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.4g} MB"


# ---------------------------------------------------------------- model-parallel layouts


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
