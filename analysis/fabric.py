"""A cluster partition's interconnect (`Fabric`), read from a profile's `fabric:` block."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from vitpod.registry.io import check_keys

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
    (`make calibrate`); counted once per call by `commcost.costs`."""

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
        check_keys(data, [*valid, "network"], "fabric")
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"fabric: missing key(s) {missing}; valid keys: {valid}")
        network(
            data
        )  # what the launch sets (workflows/planning/spec.py); the prices do not depend on it
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name == "network":
                continue
            if name in ("gpus_per_node", "nics_per_node", "ps_servers"):
                values[name] = _as_count(value, name)
            else:
                values[name] = parse_quantity(value, name)
        return cls(**values)


NETWORKS = ("infiniband", "roce", "ethernet")
"""`fabric.network`: transport; only `roce` gets RoCE settings (NCCL_IB_GID_INDEX)."""


def network(data: Mapping[str, Any]) -> str:
    """A fabric block's `network` (default infiniband); ValueError naming the valid ones."""
    value = data.get("network", "infiniband")
    if value not in NETWORKS:
        raise ValueError(
            f"fabric.network: {value!r} is not one of {list(NETWORKS)}; write infiniband, or "
            "roce for RDMA over Converged Ethernet (ethernet: TCP sockets, no RDMA)"
        )
    return str(value)


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
