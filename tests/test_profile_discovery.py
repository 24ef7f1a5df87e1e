"""`make profile`: DGX A100/H100/DGX-2 topologies; live: validates, preflights, trains; --check."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, make, submitted
from vitpod.workflows.jobs import sharedfs
from vitpod.workflows.site import binding
from vitpod.workflows.site.discover import gres_gpu, node_info
from vitpod.workflows.site.profile import PROFILE_DIR, load_profile
from vitpod.workflows.site.profile_check import disagreements
from vitpod.workflows.site.profile_writer import Discovered, compute_hcas, node_type
from vitpod.workflows.slurm import oneliner

FIXTURES = Path(__file__).parent / "fixtures"
# `scontrol show node --oneliner` as this machine's local Slurm printed it (blanks inside OS=).
SCONTROL_NODE = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=8 CPUTot=8 CPULoad=3.38 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:2 NodeAddr=127.0.0.1 NodeHostName=vm "
    "Port=17001 Version=22.05.8 OS=Linux 6.18.44-fc-v782 #1 SMP PREEMPT_DYNAMIC @0  "
    "RealMemory=4000 AllocMem=0 FreeMem=15333 Sockets=8 Boards=1 State=IDLE ThreadsPerCore=1 "
    "TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=pretrain,finetune  "
    "BootTime=2026-11-23T22:28:45 CfgTRES=cpu=8,mem=4000M,billing=8 AllocTRES="
)
MACHINES = {  # fixture stem -> (GPU query line, storage HCAs, the bundled profile's node type)
    "dgx_a100": ("A100-SXM4-80GB, 81920", {"mlx5_4", "mlx5_5"}, ("dgxpod", "dgxa100")),
    "dgx_h100": ("H100 80GB HBM3, 81559", {"mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"},
                 ("h100pod", None)),
    "dgx2": ("Tesla V100-SXM3-32GB, 32510", {"mlx5_4", "mlx5_5"}, ("dgxpod", "dgx2")),
}  # fmt: skip


def fixture(name: str) -> str:
    text = (FIXTURES / name).read_text()
    assert text.startswith("# source: "), f"{name}: first line must name its source"
    return text


def facts(machine: str, down: tuple[str, ...] = ()) -> dict:
    gpu_line, _, _ = MACHINES[machine]
    gpu_topo = fixture(f"nvidia_smi_topo_{machine}.txt")
    gpus = len(binding.parse_topo(gpu_topo).gpus)
    nics = binding.parse_topo(gpu_topo).nics
    ports = [{"device": n, "port": "1", "state": "1: DOWN" if n in down else "4: ACTIVE",
              "rate": "200 Gb/sec (4X HDR)", "link_layer": "InfiniBand"} for n in nics]  # fmt: skip
    return {
        "gpus": "\n".join(f"{i}, NVIDIA {gpu_line}, 0000:{i:02x}:00.0" for i in range(gpus)),
        "topo": gpu_topo,
        "lscpu": fixture(f"lscpu_{machine}.txt"),
        "infiniband": ports,
    }


def bundled_binding(profile: str, node: str | None) -> list[dict]:
    data = yaml.safe_load((PROFILE_DIR / f"{profile}.yaml").read_text())
    return (data["node_types"][node] if node else data)["binding"]


def slurm_node(cpus: int):
    return node_info({"NodeName": "n1", "CPUTot": str(cpus), "Gres": "gpu:8", "State": "IDLE"})


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_derived_map_equals_the_bundled_profile(machine):
    _, storage, (profile, node) = MACHINES[machine]
    unknown: list[str] = []
    cpus = binding.parse_lscpu(fixture(f"lscpu_{machine}.txt")).cpus
    got = node_type([slurm_node(cpus)], facts(machine), storage, None, unknown)
    assert got["binding"] == bundled_binding(profile, node)
    assert got["gpus_per_node"] == len(got["binding"]) and got["cpus_per_node"] == cpus
    assert got["fabric"]["nics_per_node"] == len({b["hca"] for b in got["binding"]})
    assert unknown == []


def test_old_drivers_numa_comes_from_cpu_affinity_and_new_drivers_nic_legend_is_read():
    dgx2 = binding.parse_topo(fixture("nvidia_smi_topo_dgx2.txt"))
    assert dgx2.numa_affinity["GPU9"] is None and dgx2.cpu_affinity["GPU9"] == "24-47,72-95"
    h100 = binding.parse_topo(fixture("nvidia_smi_topo_dgx_h100.txt"))
    assert h100.nics[3] == "mlx5_3" and h100.distance["GPU1"]["mlx5_3"] == "PIX"
    assert binding.parse_lscpu(fixture("lscpu_dgx_a100.txt")).numa_cpus[3] == "48-63,176-191"


def test_a_down_link_and_a_storage_hca_are_never_bound():
    unknown: list[str] = []
    got = node_type([slurm_node(256)], facts("dgx_a100", down=("mlx5_0",)), {"mlx5_4", "mlx5_5"},
                    None, unknown)  # fmt: skip
    hcas = [b["hca"] for b in got["binding"]]
    assert hcas[:2] == ["mlx5_1:1", "mlx5_1:1"] and not {"mlx5_0:1", "mlx5_4:1"} & set(hcas)
    assert any("mlx5_0" in line and "no active" in line for line in unknown)


def test_roce_ports_are_the_fabric_when_no_port_is_infiniband():
    ports = [
        {
            "device": d,
            "port": "1",
            "state": "4: ACTIVE",
            "rate": "400 Gb/sec (4X NDR)",
            "link_layer": layer,
        }
        for d, layer in (("mlx5_0", "Ethernet"), ("mlx5_1", "Ethernet"))
    ]
    unknown: list[str] = []
    assert compute_hcas(ports, {"mlx5_1"}, unknown, "n1") == {"mlx5_0": 1} and unknown == []
    ports.append({**ports[0], "device": "mlx5_2", "link_layer": "InfiniBand"})
    assert compute_hcas(ports, set(), unknown, "n1") == {"mlx5_2": 1}
    assert unknown == ["n1: HCAs ['mlx5_0', 'mlx5_1'] have no active InfiniBand port; left out"]


def test_scontrol_records_keep_values_with_blanks():
    node = node_info(oneliner(SCONTROL_NODE)[0])
    assert (node.name, node.cpus, node.sockets, node.memory_mb) == ("node1", 8, 8, 4000)
    assert node.gpus == 2 and node.partitions == ("pretrain", "finetune") and node.usable
    assert gres_gpu("gpu:a100:8(S:0-1),shard:0") == ("a100", 8) and gres_gpu("(null)") == ("", 0)


def test_a_node_is_one_model_whichever_command_reported_it():
    """Discovery (scontrol show node) and the preflight (sinfo -N) share NodeInfo and its rule:
    sinfo's suffixes and scontrol's +flags that keep a job off a node."""
    from vitpod.workflows.site import discover
    from vitpod.workflows.slurm import partitions

    assert discover.NodeInfo is partitions.NodeInfo
    assert discover.PartitionInfo is partitions.PartitionInfo
    states = {
        "idle": True, "mixed-": True, "allocated": True, "planned": True, "idle*": False,
        "idle~": False, "drained": False, "down": False, "IDLE": True, "MIXED+PLANNED": True,
        "ALLOCATED+COMPLETING": True, "IDLE+DRAIN": False, "DOWN+NOT_RESPONDING": False,
        "IDLE+CLOUD+POWERED_DOWN": False, "IDLE+MAINT": False,
    }  # fmt: skip
    found = {s: partitions.NodeInfo("n1", s, 4000, 8, "gpu:a100:8").usable for s in states}
    assert found == states
    part = partitions.PartitionInfo.from_scontrol(
        {"PartitionName": "p", "TotalNodes": "2", "MaxNodes": "UNLIMITED", "MaxTime": "1-00:00:00"},
        (partitions.NodeInfo("n1", "IDLE", 4000, 8, "gpu:4"),
         partitions.NodeInfo("n2", "MIXED", 4000, 8, "gpu:a100:8(S:0-1)")),
    )  # fmt: skip
    assert (part.max_nodes, part.max_minutes, part.gpus_per_node) == (None, 1440, 4)


def test_a_topology_without_gpus_is_an_error():
    with pytest.raises(ValueError, match="GPU0"):
        binding.parse_topo("No devices were found\n")


def test_check_lists_each_disagreement_with_the_profile():
    profile = load_profile("dgxpod")
    found = Discovered()
    unknown: list[str] = []
    found.node_types["dgxa100"] = node_type(
        [slurm_node(256)], facts("dgx_a100"), {"mlx5_4", "mlx5_5"}, None, unknown
    )
    found.node_types["dgxa100"]["binding"][2]["hca"] = "mlx5_9:1"  # the node disagrees
    found.partitions["pretrain"] = {"name": "dgxa100", "node_type": "dgxa100", "max_nodes": 4}
    found.max_minutes["pretrain"] = 24 * 60
    assert disagreements(profile, found) == [
        "partitions.pretrain.max_nodes: profile 5, Slurm 4",
        "partitions.pretrain.time: profile 2-00:00:00, Slurm MaxTime 1440 min",
        "node_types.dgxa100.binding[2].hca: profile mlx5_2:1, node mlx5_9:1",
    ]


# --------------------------------------------------------------------------- live: local Slurm


@pytest.fixture
def discovered(local_slurm, tmp_path, monkeypatch) -> Path:
    """`make profile NAME=site` into the user's profile folder ($VITPOD_PROFILES), from a base
    whose storage does not say it is shared: discovery finds out itself."""
    mine = tmp_path / "profiles"
    monkeypatch.setenv("VITPOD_PROFILES", str(mine))
    base = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    base["storage"] = {"data": base["storage"]["data"]}  # no `shared: true`
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    done = make("profile", "NAME=site", "PARTITIONS=pretrain,finetune",
                f"ARGS=--base {tmp_path / 'base.yaml'} --tasks-per-node 2 "
                f"--run-root {tmp_path / 'site-runs'}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = mine / "site.yaml"
    assert done.stdout.strip().splitlines()[-1] == str(out)
    assert "make preflight CLUSTER=site" in done.stdout  # found by its name
    return out


@pytest.mark.slurm
def test_profile_is_written_from_the_nodes_and_says_what_it_could_not_tell(discovered):
    profile = load_profile(str(discovered))
    node = profile.node_type("pretrain")
    lscpu = binding.parse_lscpu(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    assert node.gpus_per_node == 0 and node.cpus_per_node == lscpu.cpus  # nvidia-smi: not found
    assert [b.cpus for b in node.binding] == [lscpu.numa_cpus[0]] * 2
    assert profile.partition("pretrain").max_nodes == 2 and profile.backend == "gloo"
    assert profile.partition("finetune").name == "finetune"
    assert profile.partition("finetune").node_type == profile.partition("pretrain").node_type
    text = discovered.read_text()
    assert "fabric: conservative PLACEHOLDERS" in text and "make calibrate" in text
    assert re.search(r"#   - .*nvidia-smi reports none", text)
    tmp_fs = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", "/tmp"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    probed = (rf"# cpu8 \(probed on node\d\): pyxis (loaded|not loaded|not found), "
              rf"enroot .*; file systems: (\S+ \w+, )*/tmp {tmp_fs}")  # fmt: skip
    assert re.search(probed, text), text


@pytest.mark.slurm
def test_discovery_records_the_run_root_and_code_dir_every_node_sees(discovered, tmp_path):
    """A file written on node1 in the run root and the checkout was read on node2 (both nodes
    are this host): the tested paths are written (storage.shared_paths, not a `shared: true` that
    would cover any path), said in the header, and the mount type's doubt is not; no marker is
    left behind."""
    profile = load_profile(str(discovered))
    assert profile.storage.shared is False
    assert profile.storage.shared_paths == [str(tmp_path / "site-runs"), str(REPO)]
    text = discovered.read_text()
    assert re.search(
        rf"# shared storage: {tmp_path / 'site-runs'} and \S+: a file written on "
        r"one node was read on the others of pretrain, finetune \(shared_paths\)",
        text,
    ), text
    assert f"{tmp_path / 'site-runs'} is on" not in text
    assert not list((tmp_path / "site-runs").glob(".vitpod-shared-*"))


@pytest.mark.slurm
def test_an_unknown_partition_is_refused_naming_the_known_ones(local_slurm, tmp_path):
    out = tmp_path / "x.yaml"
    done = make("profile", "NAME=x", "PARTITIONS=nosuch", f"ARGS=--out {out}")
    assert "PARTITIONS=nosuch: give one or two of ['finetune', 'pretrain']" in done.stderr
    assert not out.exists() and done.returncode != 0


@pytest.mark.slurm
def test_an_existing_profile_is_never_overwritten(discovered):
    before = discovered.read_text()
    again = make("profile", "NAME=site", f"ARGS=--out {discovered} --base localslurm")
    assert again.returncode != 0 and f"{discovered} exists; never overwritten" in again.stderr
    assert discovered.read_text() == before


@pytest.mark.slurm
def test_check_finds_an_entry_made_wrong_on_purpose(discovered, tmp_path):
    data = yaml.safe_load(discovered.read_text())
    data["node_types"]["cpu8"]["cpus_per_node"] = 64
    data["partitions"]["finetune"]["name"] = "nosuch"
    data["partitions"]["finetune"]["node_type"] = "cpu8"
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(data))
    done = make("profile", f"ARGS=--check {wrong}")
    assert done.returncode != 0, done.stderr  # make exits 2 when the command fails
    lscpu_cpus = load_profile(str(discovered)).node_type("pretrain").cpus_per_node
    assert f"node_types.cpu8.cpus_per_node: profile 64, node {lscpu_cpus}" in done.stdout
    assert "partitions.finetune.name: profile nosuch, Slurm has no such partition" in done.stdout
    assert "2 disagreement(s)" in done.stdout
    assert make("profile", f"ARGS=--check {discovered}").returncode == 0


@pytest.mark.slurm
@pytest.mark.slow
def test_discovered_profile_passes_the_preflight_and_pretrains(
    discovered, local_slurm, localslurm_data, tmp_path
):
    env: dict[str, str | None] = {"VITPOD_RUN_ROOT": None}  # the profile's own, tested runs
    cluster = "CLUSTER=site"  # $VITPOD_PROFILES/site.yaml, by its name
    pre = make("preflight", cluster, "MODEL=volo_tiny", env=env)
    assert pre.returncode == 0 and "preflight passed" in pre.stdout, pre.stderr
    assert f"ok: run root {tmp_path / 'site-runs'}: shared (at or below" in pre.stdout
    assert "which `make profile` tested" in pre.stdout
    if sharedfs.fs_type(tmp_path)[0] not in sharedfs.SHARED_TYPES:  # a path it did not test
        other = make("preflight", cluster, "MODEL=volo_tiny",
                     env={"VITPOD_RUN_ROOT": str(tmp_path / "runs")})  # fmt: skip
        assert other.returncode != 0 and f"run root {tmp_path / 'runs'}: on " in other.stderr
        assert "storage.shared_paths" in other.stderr and "do not hold it" in other.stderr
    args = "ARGS=--max-steps 2 --epochs 1 --workers 0 --loader torch"
    sub = make("pretrain", cluster, "MODEL=volo_tiny", args, env=env)
    job, run_dir = submitted(sub)
    assert local_slurm.wait(job, timeout=300) == "COMPLETED"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 2


def test_only_the_paths_every_node_saw_are_recorded_as_shared(monkeypatch, tmp_path):
    """The marker seen on every node in the run root but not in the code dir (node2 has its own
    copy): only the run root goes to storage.shared_paths, the code dir is named as not shared,
    and a base profile's `shared: true` does not survive the test."""
    from vitpod.workflows.commands import profile_cli
    from vitpod.workflows.site import discover

    nodes = [node_info({"NodeName": n, "CPUTot": "8", "State": "IDLE"}) for n in ("n1", "n2")]
    site = {"batch": discover.PartitionInfo("batch", 2, 2, "1:00:00", tuple(nodes), True)}
    runs, code = str(tmp_path / "runs"), str(tmp_path / "code")
    monkeypatch.setattr(discover, "unseen", lambda part, names, path: ["n2"] if path == code
                        else [])  # fmt: skip
    found = Discovered(partitions={"pretrain": {"name": "batch"}})
    profile_cli.shared_storage(site, found, [runs, code])
    assert found.shared_paths == [runs]
    assert any(f"{code} on n2 (written on n1)" in u for u in found.unknown)
    ns = profile_cli.parse(["--name", "x", "--data", "/d"])
    storage = profile_cli.profile_dict(ns, found, {"storage": {"data": "/d", "shared": True}})
    assert storage["storage"] == {"data": "/d", "shared_paths": [runs]}
