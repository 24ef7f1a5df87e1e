"""Topology choice against hand-computed alpha-beta cases, overrides, and the parameter table."""

import json

import pytest

from vitpod.analysis.fabric import DGX_A100, Fabric
from vitpod.workflows import topology

VIT_S = 22_050_664 * 4  # gradient bytes of vit_small_patch16_224
VOLO_D5 = 295_455_584 * 4

# Round numbers so every cost below is checked by hand: 4 GPUs a node, NVLink 100 GB/s,
# one 10 GB/s NIC, no latency, four dedicated 10 GB/s servers.
SIMPLE = Fabric(
    gpus_per_node=4,
    intra_bw=100e9,
    intra_latency=0.0,
    nic_bw=10e9,
    nics_per_node=1,
    inter_latency=0.0,
    ps_servers=4,
    ps_bw=10e9,
)


def test_two_nodes_choose_hierarchical_ring():
    d = topology.decide(SIMPLE, "vit_small_patch16_224", nodes=2)
    # ring: 2*7/8 M / 10 GB/s; hierarchical: 2*3/4 M / 100 GB/s + 2*1/2 M / 10 GB/s;
    # tree: 2 M / 10 GB/s; colocated PS: node sends 2*4*4/8 M; dedicated: max(4M/10, 8M/(4*10)).
    assert d.costs["ring"] == pytest.approx(1.75 * VIT_S / 10e9)
    assert d.costs["hierarchical"] == pytest.approx(1.5 * VIT_S / 100e9 + VIT_S / 10e9)
    assert d.costs["tree"] == pytest.approx(2 * VIT_S / 10e9)
    assert d.costs["ps_colocated"] == pytest.approx(4 * VIT_S / 10e9)
    assert d.costs["ps_dedicated"] == pytest.approx(4 * VIT_S / 10e9)
    assert (d.topology, d.algorithm, d.source) == ("ring", "hierarchical", "cost model")
    assert d.predicted_s == pytest.approx(0.01014330544)
    assert d.ranks == 8 and d.grad_bytes == VIT_S


def test_one_gpu_per_node_prefers_dedicated_servers():
    fab = Fabric(**{**_fields(SIMPLE), "gpus_per_node": 1})
    d = topology.decide(fab, "vit_small_patch16_224", nodes=4)
    # ring 2*3/4 M/B = 1.5 M/B; dedicated PS max(M/B, 4M/(4B)) = M/B (BytePS's bound).
    assert d.costs["ring"] == pytest.approx(1.5 * VIT_S / 10e9)
    assert d.predicted_s == pytest.approx(VIT_S / 10e9)
    assert (d.topology, d.algorithm) == ("ps", "ps_dedicated")
    assert "ps_dedicated" in d.reason


def test_dgx_a100_node_with_latency():
    d = topology.decide(DGX_A100, "volo_d5", nodes=1)
    # 14 hops x 2 us + 2*7/8 x 1.18 GB / 230 GB/s
    assert d.predicted_s == pytest.approx(28e-6 + 1.75 * VOLO_D5 / 230e9)
    assert d.topology == "ring"


def test_override_from_args_wins_but_keeps_prediction():
    d = topology.decide(SIMPLE, "vit_small_patch16_224", nodes=2, args="--epochs 3 --topology ps")
    assert (d.topology, d.algorithm) == ("ps", "ps_colocated")  # tie with dedicated: first
    assert d.predicted_s == pytest.approx(4 * VIT_S / 10e9)
    assert d.source.startswith("override") and "would choose ring" in d.reason
    auto = topology.decide(SIMPLE, "vit_small_patch16_224", nodes=2, args=["--topology=auto"])
    assert auto.source == "cost model"


def test_bad_override_and_unknown_model():
    with pytest.raises(ValueError, match="--topology 'star'"):
        topology.decide(SIMPLE, "volo_d1", nodes=1, args="--topology star")
    with pytest.raises(ValueError, match="--topology needs a value"):
        topology.topology_override("--topology")
    with pytest.raises(ValueError, match="not in the model registry"):
        topology.grad_bytes("resnet50")


def test_with_topology_appends_or_keeps():
    d = topology.decide(SIMPLE, "volo_d1", nodes=1)
    assert topology.with_topology(["--epochs", "3"], d) == ["--epochs", "3", "--topology", "ring"]
    assert topology.with_topology(["--topology", "ps"], d) == ["--topology", "ps"]
    assert topology.with_topology(["--topology=auto", "-b", "4"], d) == [
        "-b",
        "4",
        "--topology",
        "ring",
    ]


def test_with_topology_runs_a_colocated_server_on_every_rank():
    d = topology.TopologyDecision("ps", "ps_colocated", 1e-3, "cheapest", "cost model", 4, 8)
    assert topology.with_topology(["-b", "4"], d) == [
        "-b", "4", "--topology", "ps", "--ps-servers", "8",
    ]  # fmt: skip
    assert topology.with_topology(["--ps-servers=2"], d) == ["--ps-servers=2", "--topology", "ps"]
    dedicated = topology.TopologyDecision(
        "ps", "ps_dedicated", 1e-3, "cheapest", "cost model", 4, 8
    )
    assert topology.with_topology([], dedicated) == ["--topology", "ps"]


def test_fabric_from_profile_mapping():
    block = {
        "gpus_per_node": 4,
        "intra_bw": "100 GB/s",
        "intra_latency": 0,
        "nic_bw": "80 Gb/s",
        "nics_per_node": 1,
        "inter_latency": "0 us",
    }
    d = topology.decide(block, "vit_small_patch16_224", nodes=2)
    assert d.costs["ring"] == pytest.approx(1.75 * VIT_S / 10e9)


def test_compare_with_measured(tmp_path):
    d = topology.decide(SIMPLE, "vit_small_patch16_224", nodes=2)
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    lines = [{"kind": "step", "warmup": True, "time": {"comm": 9.0}}] + [
        {"kind": "step", "warmup": False, "time": {"comm": c}} for c in (0.01, 0.02, 0.03)
    ]
    (metrics / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = topology.compare(d, tmp_path)
    assert got["measured_s"] == pytest.approx(0.02)
    assert got["ratio"] == pytest.approx(0.02 / d.predicted_s)


def _fields(fab: Fabric) -> dict:
    return {k: getattr(fab, k) for k in fab.__slots__}
