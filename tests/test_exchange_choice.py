"""Engine choice against hand-computed alpha-beta cases, flags that name one, the cost table."""

import pytest

from vitpod.analysis.fabric import DGX_A100, Fabric
from vitpod.workflows.planning import exchange

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


def decide(fabric, model, nodes, exchange_flag="auto", ps_servers=None):
    fab = exchange.as_fabric(fabric)
    return exchange.choose_engine(
        fab, model, nodes, gpus=nodes * fab.gpus_per_node, exchange=exchange_flag,
        ps_servers=ps_servers,
    )  # fmt: skip


def test_two_nodes_choose_hierarchical_ring():
    engine, costs = decide(SIMPLE, "vit_small_patch16_224", nodes=2)
    # ring: 2*7/8 M / 10 GB/s; hierarchical: 2*3/4 M / 100 GB/s + 2*1/2 M / 10 GB/s;
    # tree: 2 M / 10 GB/s; colocated PS: node sends 2*4*4/8 M; dedicated: max(4M/10, 8M/(4*10)).
    table = costs.per_algorithm_s
    assert table["ring"] == pytest.approx(1.75 * VIT_S / 10e9)
    assert table["hierarchical"] == pytest.approx(1.5 * VIT_S / 100e9 + VIT_S / 10e9)
    assert table["tree"] == pytest.approx(2 * VIT_S / 10e9)
    assert table["ps_colocated"] == pytest.approx(4 * VIT_S / 10e9)
    assert table["ps_dedicated"] == pytest.approx(4 * VIT_S / 10e9)
    assert (engine.name, costs.algorithm, engine.source) == ("ring", "hierarchical", "cost model")
    assert costs.predicted_comm_s == pytest.approx(0.01014330544)
    assert costs.grad_bytes == VIT_S and costs.priced_by == "profile fabric"
    assert engine.ps_servers is None


def test_one_gpu_per_node_prefers_dedicated_servers():
    fab = Fabric(**{**_fields(SIMPLE), "gpus_per_node": 1})
    engine, costs = decide(fab, "vit_small_patch16_224", nodes=4)
    # ring 2*3/4 M/B = 1.5 M/B; dedicated PS max(M/B, 4M/(4B)) = M/B (BytePS's bound).
    assert costs.per_algorithm_s["ring"] == pytest.approx(1.5 * VIT_S / 10e9)
    assert costs.predicted_comm_s == pytest.approx(VIT_S / 10e9)
    assert (engine.name, costs.algorithm, engine.ps_servers) == ("ps", "ps_dedicated", 1)
    assert "ps_dedicated" in engine.reason


def test_dgx_a100_node_with_latency():
    engine, costs = decide(DGX_A100, "volo_d5", nodes=1)
    # 14 hops x 2 us + 2*7/8 x 1.18 GB / 230 GB/s
    assert costs.predicted_comm_s == pytest.approx(28e-6 + 1.75 * VOLO_D5 / 230e9)
    assert engine.name == "ring"


def test_exchange_flag_is_kept_and_priced():
    engine, costs = decide(SIMPLE, "vit_small_patch16_224", nodes=2, exchange_flag="ps")
    assert (engine.name, costs.algorithm) == ("ps", "ps_colocated")  # tie with dedicated: first
    assert costs.predicted_comm_s == pytest.approx(4 * VIT_S / 10e9)
    assert engine.source == "flags" and "would choose ring" in engine.reason
    # The colocated server the model prices has every rank serve; --ps-servers wins.
    assert engine.ps_servers == 8
    assert decide(SIMPLE, "vit_small_patch16_224", 2, "ps", ps_servers=2)[0].ps_servers == 2
    assert decide(SIMPLE, "vit_small_patch16_224", nodes=2)[0].source == "cost model"


def test_unknown_model():
    with pytest.raises(ValueError, match="not in the model registry"):
        exchange.grad_bytes("resnet50")


def test_fabric_from_profile_mapping():
    block = {
        "gpus_per_node": 4,
        "intra_bw": "100 GB/s",
        "intra_latency": 0,
        "nic_bw": "80 Gb/s",
        "nics_per_node": 1,
        "inter_latency": "0 us",
    }
    _, costs = decide(block, "vit_small_patch16_224", nodes=2)
    assert costs.per_algorithm_s["ring"] == pytest.approx(1.75 * VIT_S / 10e9)


def _fields(fab: Fabric) -> dict:
    return {k: getattr(fab, k) for k in fab.__slots__}
