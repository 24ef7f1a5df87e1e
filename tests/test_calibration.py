"""Calibrated cost model: the fit recovers known latencies and bandwidths, plugs into Fabric,
prices DDP buckets per step, is stored beside the profile and named in exchange decisions."""

import dataclasses
import json

import pytest

from vitpod.analysis import calibrate, commcost
from vitpod.analysis.fabric import Fabric
from vitpod.workflows.planning import exchange

MiB = 1024**2
SIZES = [4096 * 4**i for i in range(7)]
# Round, distinct numbers so a mix-up of levels or fields shows.
OVERHEAD = 30e-6  # per-call overhead
A_INTRA, B_INTRA = 200e-6, 2e9
A_INTER, B_WORLD = 500e-6, 0.5e9
B_RAIL = 0.8e9
A_RAIL = 400e-6
PROFILE_FABRIC = Fabric(
    gpus_per_node=2, intra_bw=5e9, intra_latency=20e-6, nic_bw=1e9, nics_per_node=1,
    inter_latency=50e-6, ps_servers=0,
)  # fmt: skip


def ring(n: int, alpha: float, bw: float, size: float) -> float:
    return OVERHEAD + 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bw


def synthetic_bench(**changes) -> dict:
    """A commbench file whose times follow the ring formula exactly (4 ranks on 2 nodes)."""
    bench = {
        "format": "vitpod-commbench/1", "backend": "gloo", "device": "cpu", "world_size": 4,
        "nodes": 2, "ranks_per_node": 2, "job_id": "1234", "sizes": SIZES,
        "levels": {
            "self": {"ranks": 1, "nodes": 1, "median_s": {"all_reduce": [OVERHEAD] * len(SIZES)}},
            "intra": {"ranks": 2, "nodes": 1, "median_s": {
                "all_reduce": [ring(2, A_INTRA, B_INTRA, m) for m in SIZES],
                "reduce": [1e-4 + m * 1e-9 for m in SIZES],
                "broadcast": [2e-4 + m * 2e-9 for m in SIZES]}},
            "inter": {"ranks": 2, "nodes": 2, "median_s": {
                "all_reduce": [ring(2, A_RAIL, B_RAIL, m) for m in SIZES]}},
            "world": {"ranks": 4, "nodes": 2, "median_s": {
                "all_reduce": [ring(4, A_INTER, B_WORLD, m) for m in SIZES]}},
        },
    }  # fmt: skip
    bench.update(changes)
    return bench


def test_fit_recovers_latency_bandwidth_and_overhead_exactly():
    cal = calibrate.fit(synthetic_bench(), cluster="test", date="2026-01-02T03:04:05+00:00")
    assert cal.call_overhead == pytest.approx(OVERHEAD)
    assert cal.levels["intra"].latency_s == pytest.approx(A_INTRA, rel=1e-9)
    assert cal.levels["intra"].bw == pytest.approx(B_INTRA, rel=1e-9)
    assert cal.levels["inter"].latency_s == pytest.approx(A_RAIL, rel=1e-9)
    assert cal.levels["world"].bw == pytest.approx(B_WORLD, rel=1e-9)
    assert cal.levels["world"].max_rel_error < 1e-9
    # The world ring is slower than the node's links: the network bounds it, so it sets the
    # cross-node numbers the flat-ring formula uses.
    assert cal.fabric == pytest.approx(
        {"call_overhead": OVERHEAD, "intra_latency": A_INTRA, "intra_bw": B_INTRA,
         "inter_latency": A_INTER, "nic_bw": B_WORLD}, rel=1e-9,
    )  # fmt: skip
    assert cal.lines["reduce"]["intra"](1e6) == pytest.approx(1e-4 + 1e-3)
    assert cal.lines["broadcast"]["intra"].per_byte_s == pytest.approx(2e-9)
    assert cal.label == "calibration of 2026-01-02T03:04:05+00:00, job 1234"


def test_fitted_fabric_reproduces_the_measured_world_ring():
    cal = calibrate.fit(synthetic_bench())
    fab = calibrate.apply(PROFILE_FABRIC, cal)
    assert fab.ps_servers == 0 and fab.gpus_per_node == 2  # not measured: kept from the profile
    lay = commcost.layout(fab, nodes=2, gpus=4)
    for m in SIZES:
        predicted = commcost.ring_s(fab, m, lay) + fab.call_overhead
        assert predicted == pytest.approx(ring(4, A_INTER, B_WORLD, m), rel=1e-9)


def test_rail_bandwidth_used_when_the_node_links_bound_the_world_ring():
    slow_intra = synthetic_bench()
    slow_intra["levels"]["intra"]["median_s"]["all_reduce"] = [
        ring(2, A_INTRA, 0.2e9, m) for m in SIZES
    ]
    cal = calibrate.fit(slow_intra, nics_per_node=4)
    assert cal.fabric["intra_bw"] == pytest.approx(0.2e9)
    assert cal.fabric["nic_bw"] == pytest.approx(B_RAIL)  # one rank per node: one rail


def test_world_bandwidth_is_split_over_the_rails():
    cal = calibrate.fit(synthetic_bench(), nics_per_node=4)
    assert cal.fabric["nic_bw"] == pytest.approx(B_WORLD / 4)


def test_times_that_do_not_grow_with_size_are_refused_with_the_fix():
    flat = synthetic_bench()
    flat["levels"]["intra"]["median_s"]["all_reduce"] = [1e-3] * len(SIZES)
    with pytest.raises(calibrate.CalibrationError, match="--sizes"):
        calibrate.fit(flat)


def test_bench_file_of_another_kind_is_refused():
    with pytest.raises(calibrate.CalibrationError, match="vitpod.trainer.engines.commbench"):
        calibrate.fit({"format": "something-else"})
    one_rank = synthetic_bench()
    one_rank["levels"] = {"self": one_rank["levels"]["self"]}
    with pytest.raises(calibrate.CalibrationError, match="at least 2 ranks"):
        calibrate.fit(one_rank)


def test_ddp_buckets_follow_ddp_defaults():
    assert commcost.ddp_buckets(644_180) == [644_180]
    assert commcost.ddp_buckets(60 * MiB) == [1 * MiB, 25 * MiB, 25 * MiB, 9 * MiB]
    assert commcost.ddp_buckets(0) == []


def test_calibrated_costs_sum_buckets_with_their_latency_and_overhead():
    fab = calibrate.apply(PROFILE_FABRIC, calibrate.fit(synthetic_bench()))
    grad = 3 * MiB  # buckets of 1 MiB and 2 MiB
    table = commcost.costs(fab, grad, nodes=1, gpus=2, backend="gloo")
    expected = ring(2, A_INTRA, B_INTRA, 1 * MiB) + ring(2, A_INTRA, B_INTRA, 2 * MiB)
    assert table["ring"] == pytest.approx(expected, rel=1e-9)
    # The parameter-server hook: a reduce and a broadcast (binomial trees) per bucket.
    hook = sum(2 * 1 * (A_INTRA + m / B_INTRA) + 2 * OVERHEAD for m in (1 * MiB, 2 * MiB))
    assert table["ps_colocated"] == pytest.approx(hook, rel=1e-9)
    four = commcost.costs(fab, 1 * MiB, nodes=2, gpus=4, backend="gloo")
    assert four["ps_colocated"] == pytest.approx(4 * (A_INTER + MiB / B_WORLD) + 2 * OVERHEAD)
    # gloo's all-reduce is a ring: NCCL's tree and 2-D ring are not priced for it.
    assert set(table) == {"ring", "ps_colocated"}
    assert {"tree", "hierarchical"} <= set(commcost.costs(fab, grad, 1, gpus=2, backend="nccl"))
    # One rank still pays one hook call per bucket (DDP calls the hook at world size 1).
    alone = commcost.costs(fab, grad, 1, gpus=1, backend="gloo")
    assert alone["ring"] == pytest.approx(2 * OVERHEAD)
    with pytest.raises(ValueError, match="backend 'mpi'"):
        commcost.costs(fab, grad, 1, gpus=2, backend="mpi")


def test_save_load_roundtrip_beside_the_profile(tmp_path):
    profile = tmp_path / "my cluster.yaml"
    profile.write_text("name: x\n")
    path = calibrate.calibration_path(profile)
    assert path == tmp_path / "my cluster.calibration.json"
    cal = calibrate.fit(synthetic_bench(), cluster="x")
    calibrate.save(cal, path)
    back = calibrate.load_for_profile(profile)
    assert back is not None and back == cal
    assert json.loads(path.read_text())["bench"]["job_id"] == "1234"  # the raw points are kept
    assert calibrate.load_for_profile(tmp_path / "other.yaml") is None


def test_a_broken_fit_names_the_file_and_field(tmp_path):
    path = tmp_path / "p.calibration.json"
    data = calibrate.fit(synthetic_bench()).as_dict()
    data["fabric"]["intra_bandwidth"] = 1.0
    path.write_text(json.dumps(data))
    with pytest.raises(calibrate.CalibrationError, match=r"p\.calibration\.json.*intra_bandwidth"):
        calibrate.load(path)
    del data["levels"]
    path.write_text(json.dumps(data))
    with pytest.raises(calibrate.CalibrationError, match="'levels'"):
        calibrate.load(path)


def test_decide_uses_the_calibration_and_says_so():
    cal = calibrate.fit(synthetic_bench(), date="2026-01-02T03:04:05+00:00")
    tiny = {"num_classes": 10, "img_size": 32}  # the test VOLO on digits: one DDP bucket
    _, plain = exchange.choose_engine(PROFILE_FABRIC, "volo_tiny", nodes=2, gpus=4, **tiny)
    assert plain.priced_by == "profile fabric"
    engine, costs = exchange.choose_engine(
        PROFILE_FABRIC, "volo_tiny", nodes=2, gpus=4, calibration=cal, **tiny
    )
    assert costs.priced_by == "calibration of 2026-01-02T03:04:05+00:00, job 1234"
    assert costs.algorithm in ("ring", "ps_colocated")  # gloo: no NCCL tree
    one_bucket = exchange.grad_bytes("volo_tiny", 10, 32)
    assert one_bucket < MiB
    ring_s = costs.per_algorithm_s["ring"]
    assert ring_s == pytest.approx(ring(4, A_INTER, B_WORLD, one_bucket), rel=1e-9)
    _, forced = exchange.choose_engine(
        PROFILE_FABRIC, "volo_tiny", 2, gpus=4, exchange="ring", calibration=cal, **tiny
    )
    assert forced.predicted_comm_s == pytest.approx(ring_s)


def test_commbench_sizes_and_levels():
    commbench = pytest.importorskip("vitpod.trainer.engines.commbench")
    assert commbench.parse_sizes("4K, 1M 16MiB 4096") == [4096, MiB, 16 * MiB]
    with pytest.raises(ValueError, match="'3'"):
        commbench.parse_sizes("3")
    with pytest.raises(ValueError, match="'4X'"):
        commbench.parse_sizes("4X")
    levels = commbench.level_ranks(["n1", "n1", "n2", "n2"], [0, 1, 0, 1])
    assert levels == {"self": [0], "intra": [0, 1], "inter": [0, 2], "world": [0, 1, 2, 3]}


def test_fabric_call_overhead_is_validated():
    with pytest.raises(ValueError, match="call_overhead"):
        dataclasses.replace(PROFILE_FABRIC, call_overhead=-1.0)
    parsed = Fabric.from_mapping({**_mapping(PROFILE_FABRIC), "call_overhead": "50 us"})
    assert parsed.call_overhead == pytest.approx(50e-6)


def _mapping(fab: Fabric) -> dict:
    return {f.name: getattr(fab, f.name) for f in dataclasses.fields(fab)}


def test_calibrate_job_runs_commbench_on_every_rank_and_stores_beside_the_profile(tmp_path):
    from vitpod.workflows.errors import ConfigError
    from vitpod.workflows.studies import calibrate as wcal

    profile = tmp_path / "mine.yaml"
    profile.write_text(
        (exchange.Path(exchange.__file__).parents[1] / "profiles" / "localslurm.yaml").read_text()
    )
    ns = wcal.build_parser().parse_args(
        ["--cluster", str(profile), "--run-root", str(tmp_path), "--sizes", "4K 1M",
         "--args", "--busy-ms 0"]
    )  # fmt: skip
    plan, out = wcal.prepare(ns)
    spec = plan.spec
    assert out == tmp_path / "mine.calibration.json"
    assert spec.command[1:3] == ("-m", "vitpod.trainer.engines.commbench")
    assert spec.command[3:] == (
        "--out", f"{spec.run_dir}/commbench.json", "--sizes", "4K 1M", "--busy-ms", "0"
    )  # fmt: skip
    assert spec.nodes == 2 and spec.tasks_per_node == 2
    assert plan.decision is None  # no trainer: nothing to decide
    assert not exchange.Path(spec.run_dir).exists()  # nothing written before submission
    ns.cluster = "local"
    with pytest.raises(ConfigError, match="Slurm profile"):
        wcal.prepare(ns)


def test_calibration_side_of_the_login_node_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'numpy') or \\\n"
        "                name == 'vitpod.trainer.engines.commbench':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import vitpod.analysis.calibrate, vitpod.workflows.studies.calibrate\n"
        "import vitpod.workflows.planning.exchange\n"
    )
    # The benchmark (torch) is blocked too: workflows reaches it only as the job's command line.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
