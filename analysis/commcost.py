"""Alpha-beta cost model of gradient exchange: ring, tree, parameter servers (pure arithmetic)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vitpod.analysis.fabric import Fabric

ALLREDUCE = "ring"
PARAMETER_SERVER = "ps"
# Each modelled algorithm and the trainer's --exchange value that runs it (NCCL picks ring or
# tree itself once all-reduce is chosen; the trainer's parameter server is the DDP hook).
TRAINER_EXCHANGE = {
    "ring": ALLREDUCE,
    "hierarchical": ALLREDUCE,
    "tree": ALLREDUCE,
    "ps_colocated": PARAMETER_SERVER,
    "ps_dedicated": PARAMETER_SERVER,
}


@dataclass(frozen=True, slots=True)
class Choice:
    """The cheapest algorithm, its predicted seconds per gradient exchange, and the others'."""

    name: str
    predicted_s: float
    reason: str
    costs: dict[str, float] = field(default_factory=dict)

    @property
    def exchange(self) -> str:
        """The trainer's --exchange value (ring|ps) that runs this algorithm."""
        return TRAINER_EXCHANGE[self.name]


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


def _exchange_costs(
    fabric: Fabric, grad_bytes: float, lay: Layout, servers: int
) -> dict[str, float]:
    """Seconds of one exchange of grad_bytes for each algorithm (dedicated PS with servers)."""
    result = {
        "ring": ring_s(fabric, grad_bytes, lay),
        "hierarchical": hierarchical_s(fabric, grad_bytes, lay),
        "tree": tree_s(fabric, grad_bytes, lay),
        "ps_colocated": ps_colocated_s(fabric, grad_bytes, lay),
    }
    if servers:
        result["ps_dedicated"] = ps_dedicated_s(fabric, grad_bytes, lay, servers)
    return result


# PyTorch DDP's defaults (torch.nn.parallel.DistributedDataParallel docs: bucket_cap_mb=25; the
# first bucket is capped at torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB so that
# communication starts early in the backward pass).
DDP_BUCKET_CAP_BYTES = 25 * 1024**2
DDP_FIRST_BUCKET_BYTES = 1024**2
# What each backend's all-reduce can run: gloo's allreduce (ProcessGroupGloo) is gloo's ring;
# NCCL picks ring or tree itself (NCCL_ALGO), and a 2-D ring is what its ring does across nodes.
BACKEND_ALGORITHMS = {
    "gloo": ("ring", "ps_colocated", "ps_dedicated"),
    "nccl": tuple(TRAINER_EXCHANGE),
}
# Collective calls per gradient bucket: one all-reduce, or the parameter-server hook's reduce
# to the bucket's server followed by its broadcast (trainer/engines/ddp_engine.py ps_hook).
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
    then broadcast from it (trainer/engines/ddp_engine.py ps_hook), each a binomial tree of
    ceil(log2 n) rounds that each move the whole bucket over a hop: Thakur, Rabenseifner &
    Gropp (2005), short-message reduce and broadcast, ceil(log2 p)(alpha + n beta).

    With a few buckets one server carries each whole bucket, which the sharded
    `ps_colocated_s` (every rank serving 1/n of every exchange) does not describe."""
    n = lay.ranks
    if n == 1:
        return 0.0
    rounds = math.ceil(math.log2(n))
    return 2 * rounds * (_hop_latency(fabric, lay) + bucket_bytes / _bus_bw(fabric, lay))


def costs(
    fabric: Fabric,
    grad_bytes: float,
    nodes: int,
    ps_servers: int | None = None,
    gpus: int | None = None,
    backend: str | None = None,
    buckets: list[float] | None = None,
) -> dict[str, float]:
    """Seconds of each algorithm: the one price every caller uses.

    Without a `backend` (no calibration): one exchange of grad_bytes with the profile's
    numbers (dedicated PS only when servers exist). With a calibrated `backend`: per
    optimizer step as the trainer measures it. Its DDP comm hook times each gradient bucket
    from the hook call to the completion of the bucket's collective(s) and sums the buckets
    (trainer/engines/ddp_engine.py), so each bucket pays the algorithm's latency terms and
    `call_overhead` per call; buckets are taken not to queue behind one another (a backward
    pass slower than communication). The colocated parameter server is then the trainer's
    hook (`ps_hook_s`: reduce + broadcast of each bucket), and only the algorithms the
    backend runs are priced (gloo: ring and the parameter servers)."""
    if isinstance(grad_bytes, bool) or not grad_bytes >= 0:
        raise ValueError(f"grad_bytes must be >= 0, got {grad_bytes!r}")
    lay = layout(fabric, nodes, gpus)
    servers = fabric.ps_servers if ps_servers is None else ps_servers
    if backend is None:
        return _exchange_costs(fabric, grad_bytes, lay, servers)
    if backend not in BACKEND_ALGORITHMS:
        raise ValueError(f"backend {backend!r} is not one of {sorted(BACKEND_ALGORITHMS)}")
    runs = BACKEND_ALGORITHMS[backend]
    total = {n: 0.0 for n in _exchange_costs(fabric, 0.0, lay, servers) if n in runs}
    for size in ddp_buckets(grad_bytes) if buckets is None else buckets:
        per_bucket = _exchange_costs(fabric, size, lay, servers)
        per_bucket["ps_colocated"] = ps_hook_s(fabric, size, lay)
        for name in total:
            calls = CALLS_PER_BUCKET[name] if lay.ranks > 1 else 1
            total[name] = total[name] + per_bucket[name] + calls * fabric.call_overhead
    return total


def choose(
    fabric: Fabric,
    grad_bytes: float,
    nodes: int,
    ps_servers: int | None = None,
    gpus: int | None = None,
    backend: str | None = None,
) -> Choice:
    """The cheapest algorithm by `costs` for grad_bytes of gradients among `gpus` ranks on
    `nodes` nodes (default: all GPUs of those nodes); ties go to the ring."""
    table = costs(fabric, grad_bytes, nodes, ps_servers, gpus, backend)
    how = f" in {len(ddp_buckets(grad_bytes))} DDP bucket(s), {backend}" if backend else ""
    best = min(table, key=lambda name: (table[name], name != "ring"))
    runner_up = sorted((t, name) for name, t in table.items() if name != best)
    versus = f", next {runner_up[0][1]} {_fmt_s(runner_up[0][0])}" if runner_up else ""
    ranks = layout(fabric, nodes, gpus).ranks
    reason = (
        f"{best} predicted {_fmt_s(table[best])} per step for {_fmt_bytes(grad_bytes)} of "
        f"gradients over {ranks} GPUs on {nodes} node(s){how}{versus}"
    )
    return Choice(name=best, predicted_s=table[best], reason=reason, costs=table)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.4g} MB"
