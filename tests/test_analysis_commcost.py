"""Communication cost model against hand-computed cases and the DGX A100 anchors."""

import dataclasses
import subprocess
import sys

import pytest

from vitpod.analysis import commcost
from vitpod.analysis.commcost import Choice, choose, costs
from vitpod.analysis.fabric import DGX_A100, Fabric

NO_LATENCY = dataclasses.replace(DGX_A100, intra_latency=0.0, inter_latency=0.0)


def test_ring_moves_2_n_minus_1_over_n_bytes_per_gpu():
    assert commcost.ring_bytes_per_gpu(1e9, 8) == pytest.approx(1.75e9)
    assert commcost.ring_bytes_per_gpu(1e9, 2) == pytest.approx(1e9)
    assert commcost.ring_bytes_per_gpu(1e9, 1) == 0.0


def test_dgx_a100_bus_bandwidth_anchors():
    # Bus bandwidth = ring bytes per GPU / time: ~230 GB/s in a node, ~192 GB/s across nodes.
    grad = 1e9
    one_node = costs(NO_LATENCY, grad, nodes=1)["ring"]
    assert one_node == pytest.approx(1.75e9 / 230e9)
    assert commcost.ring_bytes_per_gpu(grad, 8) / one_node == pytest.approx(230e9)
    two_nodes = costs(NO_LATENCY, grad, nodes=2)["ring"]
    assert commcost.ring_bytes_per_gpu(grad, 16) / two_nodes == pytest.approx(192e9)


def test_five_dgx_a100_hand_computed():
    # 40 GPUs, 100 MB, intra latency 2 us, IB latency 5 us, node rails 8 x 24 GB/s.
    table = costs(DGX_A100, 100e6, nodes=5)
    assert table["ring"] == pytest.approx(78 * 5e-6 + 1.95 * 100e6 / 192e9)  # 1.4056 ms
    assert table["tree"] == pytest.approx(2 * (3 * 2e-6 + 3 * 5e-6) + 2e8 / 192e9)  # 1.0837 ms
    intra = 14 * 2e-6 + 1.75e8 / 230e9
    inter = 8 * 5e-6 + 1.6e8 / 192e9
    assert table["hierarchical"] == pytest.approx(intra + inter)  # 1.6622 ms
    # Colocated PS: each node sends 2 x 8 x 32/40 x M off-node over its rails.
    assert table["ps_colocated"] == pytest.approx(78 * 5e-6 + 2 * 8 * 32 / 40 * 1e8 / 192e9)
    assert "ps_dedicated" not in table
    choice = choose(DGX_A100, 100e6, nodes=5)
    assert choice.name == "tree"
    assert choice.predicted_s == pytest.approx(table["tree"])
    assert choice.exchange == "ring"
    assert choice.costs == table


def test_ring_beats_tree_for_large_gradients_on_two_nodes():
    table = costs(DGX_A100, 1e9, nodes=2)
    assert table["ring"] == pytest.approx(30 * 5e-6 + 1.875e9 / 192e9)  # 9.9156 ms
    assert table["tree"] == pytest.approx(2 * (3 * 2e-6 + 1 * 5e-6) + 2e9 / 192e9)  # 10.4387 ms
    assert choose(DGX_A100, 1e9, nodes=2).name == "ring"


def test_tree_wins_latency_bound_small_messages():
    choice = choose(DGX_A100, 0, nodes=1)
    assert choice.name == "tree"
    assert choice.predicted_s == pytest.approx(2 * 3 * 2e-6)
    assert choice.costs["ring"] == pytest.approx(14 * 2e-6)


def test_dedicated_servers_follow_max_m_over_b_and_n_m_over_s_b():
    fabric = dataclasses.replace(DGX_A100, ps_servers=5, ps_bw=25e9)
    few = costs(fabric, 1e8, nodes=5)["ps_dedicated"]
    assert few == pytest.approx(2 * 5 * 5e-6 + 40 * 1e8 / (5 * 25e9))  # server-bound, 32 ms
    many = costs(fabric, 1e8, nodes=5, ps_servers=40)["ps_dedicated"]
    assert many == pytest.approx(2 * 40 * 5e-6 + 8 * 1e8 / 192e9)  # worker-bound, 4.17 ms


def test_dedicated_servers_win_when_plentiful_and_fast():
    fabric = Fabric(
        gpus_per_node=1,
        intra_bw=100e9,
        intra_latency=0.0,
        nic_bw=10e9,
        nics_per_node=1,
        inter_latency=0.0,
        ps_servers=8,
        ps_bw=10e9,
    )
    # 8 nodes x 1 GPU: ring 2 x 7/8 x M / B; PS on 8 servers M / B (BytePS's argument).
    choice = choose(fabric, 1e9, nodes=8)
    assert choice.costs["ring"] == pytest.approx(1.75e9 / 10e9)
    assert choice.name == "ps_dedicated"
    assert choice.predicted_s == pytest.approx(1e9 / 10e9)
    assert choice.exchange == "ps"
    assert "ps_dedicated" in choice.reason and "ms" in choice.reason and "\n" not in choice.reason


def test_single_gpu_costs_nothing_and_picks_ring():
    choice = choose(DGX_A100, 1e9, nodes=1, gpus=1)
    assert choice.name == "ring"
    assert choice.predicted_s == 0.0


def test_partial_nodes_use_only_nvlink():
    table = costs(NO_LATENCY, 1e9, nodes=1, gpus=4)
    assert table["ring"] == pytest.approx(1.5e9 / 230e9)


def test_profile_block_with_units():
    fabric = Fabric.from_mapping(
        {
            "gpus_per_node": 8,
            "intra_bw": "230 GB/s",
            "intra_latency": "2 us",
            "nic_bw": "200 Gb/s",
            "nics_per_node": 8,
            "inter_latency": 5e-6,
        }
    )
    assert fabric.intra_bw == pytest.approx(230e9)
    assert fabric.nic_bw == pytest.approx(25e9)
    assert fabric.intra_latency == pytest.approx(2e-6)
    assert fabric.node_bw == pytest.approx(200e9)


def test_profile_block_errors_name_the_field():
    good = {
        "gpus_per_node": 8,
        "intra_bw": 1e9,
        "intra_latency": 0,
        "nic_bw": 1e9,
        "nics_per_node": 1,
        "inter_latency": 0,
    }
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'nic_bandwidth'.*valid keys"):
        Fabric.from_mapping({**good, "nic_bandwidth": 1})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['nic_bw'\]"):
        Fabric.from_mapping({k: v for k, v in good.items() if k != "nic_bw"})
    with pytest.raises(ValueError, match="fabric.nic_bw: cannot read '10 furlongs'"):
        Fabric.from_mapping({**good, "nic_bw": "10 furlongs"})
    with pytest.raises(ValueError, match="fabric.gpus_per_node: expected a whole number"):
        Fabric.from_mapping({**good, "gpus_per_node": "eight"})
    with pytest.raises(ValueError, match="fabric.intra_bw must be > 0"):
        Fabric.from_mapping({**good, "intra_bw": 0})
    with pytest.raises(ValueError, match="fabric.ps_bw"):
        Fabric.from_mapping({**good, "ps_servers": 2})


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="does not divide evenly over nodes=2"):
        costs(DGX_A100, 1e6, nodes=2, gpus=3)
    with pytest.raises(ValueError, match="gpus_per_node=8"):
        costs(DGX_A100, 1e6, nodes=1, gpus=16)
    with pytest.raises(ValueError, match="nodes must be"):
        costs(DGX_A100, 1e6, nodes=0)
    with pytest.raises(ValueError, match="grad_bytes must be >= 0"):
        costs(DGX_A100, -1, nodes=1)


def test_choice_names_the_engine_that_runs_its_algorithm():
    choice = Choice(name="ps_colocated", predicted_s=1.0, reason="r", costs={"ps_colocated": 1.0})
    assert choice.exchange == "ps"
    assert Choice("tree", 1.0, "r").exchange == "ring"


def test_cost_model_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import vitpod.analysis.commcost; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
