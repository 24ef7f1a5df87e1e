"""Runs on the shared storage (issue 28 item 3): the GPU profiles put run directories on their
shared file system, no storage key is dead, and preflight refuses a multi-node job whose run root
is not on a shared file system type, naming the type and the override (storage.shared: true)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from vitpod.workflows import cli
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.jobs import sharedfs
from vitpod.workflows.planning import preflight
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.site.profile import PROFILE_DIR, load_profile

GPU_PROFILES = ("dgxpod", "superpod", "h100pod")


def _local_type(path: Path) -> str:
    kind, _ = sharedfs.fs_type(path)
    if kind in sharedfs.SHARED_TYPES:
        pytest.skip(f"{path} is on {kind}, a shared file system here")
    return kind


def _copy(tmp_path: Path, name: str, **storage: object) -> str:
    data = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    data["storage"] = {k: v for k, v in {**data["storage"], **storage}.items() if v is not None}
    path = tmp_path / f"{name}-copy.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _spec(profile: str, nodes: int, runs: Path):
    return plan_job(Request(cluster=profile, model="volo_d5", nodes=str(nodes),
                            run_root=str(runs))).spec  # fmt: skip


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_gpu_profiles_keep_runs_on_their_shared_file_system(name):
    storage = load_profile(name).storage
    assert storage.runs == "/lustre/fsw/vitpod/runs" and not storage.shared
    assert storage.data.startswith("/lustre/")


def test_an_old_profile_with_storage_checkpoints_is_refused_naming_the_fix(tmp_path):
    path = _copy(tmp_path, "dgxpod", checkpoints="/lustre/fsw/vitpod/checkpoints")
    with pytest.raises(ConfigError, match=r"storage\.checkpoints is no longer used: each run "
                       r"directory \(storage\.runs/<run>\) holds its own checkpoints/.*remove "
                       r"storage\.checkpoints"):  # fmt: skip
        load_profile(path)


def test_two_nodes_on_a_local_run_root_are_refused_naming_the_type(tmp_path):
    runs = tmp_path / "runs"  # does not exist yet: its nearest parent's mount counts
    kind = _local_type(tmp_path)
    spec = _spec(_copy(tmp_path, "dgxpod"), 2, runs)
    with pytest.raises(ConfigError) as err:
        preflight.shared_run_root(spec)
    message = str(err.value)
    assert f"run root {runs}: on {kind} (mount " in message
    assert "not a shared file system type (nfs, lustre, gpfs, beegfs, wekafs" in message
    assert "set `storage: {shared: true}` in profile dgxpod" in message
    assert not runs.exists()


def test_the_override_and_one_node_pass_and_offline_is_not_checked(tmp_path):
    runs = tmp_path / "runs"
    _local_type(tmp_path)
    shared = _spec(_copy(tmp_path, "dgxpod", shared=True), 2, runs)
    assert "shared (storage.shared: true in profile dgxpod: declared for every path" in (
        preflight.shared_run_root(shared)
    )  # fmt: skip
    one = _spec(_copy(tmp_path, "dgxpod"), 1, runs)
    assert preflight.shared_run_root(one) == f"run root {runs}: 1 node, need not be shared"
    two = _spec(_copy(tmp_path, "dgxpod"), 2, runs)
    assert "shared file system NOT CHECKED (offline" in preflight.shared_run_root(two, True)


def test_local_test_profiles_declare_their_one_host_shared():
    for name in ("localslurm", "localpyxis", "localregistry"):
        assert load_profile(name).storage.shared, name


def test_mountinfo_names_the_mount_holding_a_path():
    info = "\n".join([
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
        "40 27 0:50 / /lustre rw - lustre 10.0.0.1@o2ib:/fsw rw",
        "41 27 0:51 / /mnt/my\\040disk rw - xfs /dev/sdb rw",
        "42 40 0:52 / /lustre/fsw/scratch rw - tmpfs tmpfs rw",
    ])  # fmt: skip
    assert sharedfs.mount_of(Path("/lustre/fsw/vitpod/runs"), info) == ("/lustre", "lustre")
    scratch = ("/lustre/fsw/scratch", "tmpfs")  # a mount inside a mount: the inner one
    assert sharedfs.mount_of(Path("/lustre/fsw/scratch/x"), info) == scratch
    assert sharedfs.mount_of(Path("/mnt/my disk/runs"), info) == ("/mnt/my disk", "xfs")
    assert sharedfs.mount_of(Path("/lustrex"), info) == ("/", "ext4")


def test_preflight_command_refuses_then_accepts_with_the_override(tmp_path, capsys):
    """`python -m vitpod.workflows preflight` on the local Slurm (a localslurm copy whose
    storage does not say shared): exit 2 and one line; with storage.shared: true it passes."""
    if shutil.which("sbatch") is None:
        pytest.skip("needs the local Slurm (sbatch on PATH)")
    kind = _local_type(tmp_path)
    argv = ["preflight", "--model", "volo_tiny", "--nodes", "2", "--run-root",
            str(tmp_path / "runs")]  # fmt: skip
    assert cli.main([*argv, "--cluster", _copy(tmp_path, "localslurm", shared=None)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"on {kind} (mount " in err and "shared: true" in err
    assert cli.main([*argv, "--cluster", _copy(tmp_path, "localslurm")]) == 0
    out = capsys.readouterr().out
    assert "ok: run root" in out and "shared (storage.shared: true" in out
    assert "ok: mpi: --mpi=pmi2 is listed by srun --mpi=list" in out
    assert not (tmp_path / "runs").exists()


def test_the_code_dir_a_multi_node_job_runs_from_is_checked_like_the_run_root(tmp_path):
    """The checkout every rank runs from (srun --chdir; a container profile mounts it too):
    on a local file system a 2-node job is refused naming the type; 1 node, the override and
    offline pass as for the run root."""
    code = tmp_path / "code"
    code.mkdir()
    kind = _local_type(code)
    spec = _spec(_copy(tmp_path, "localslurm", code=str(code), shared=None), 2, tmp_path / "runs")
    with pytest.raises(ConfigError) as err:
        preflight.shared_code_dir(spec)
    assert f"code dir {code}: on {kind} (mount " in str(err.value)
    assert "run from it (srun --chdir, the container's mount)" in str(err.value)
    assert "point storage.code at it" in str(err.value)
    one = _spec(_copy(tmp_path, "localslurm", code=str(code), shared=None), 1, tmp_path / "runs")
    assert preflight.shared_code_dir(one) == f"code dir {code}: 1 node, need not be shared"
    shared = _spec(_copy(tmp_path, "localslurm", code=str(code)), 2, tmp_path / "runs")
    assert "shared (storage.shared: true" in preflight.shared_code_dir(shared)
    assert "NOT CHECKED (offline" in preflight.shared_code_dir(spec, offline=True)


def test_a_path_make_profile_tested_covers_itself_and_below_and_nothing_else(tmp_path):
    """Issue 45 (verification): `storage.shared: true` from `make profile` passed any run root
    (VITPOD_RUN_ROOT=/tmp/x on ext4). A discovered profile now records the paths it tested
    (storage.shared_paths): a run root at or below one passes, saying so; another path, even a
    sibling with the same prefix, gets the file system type check and is refused naming them."""
    tested = tmp_path / "site-runs"
    kind = _local_type(tmp_path)
    profile = _copy(tmp_path, "dgxpod", shared_paths=[str(tested)])
    for runs in (tested, tested / "deeper" / "runs"):
        line = preflight.shared_run_root(_spec(profile, 2, runs))
        assert line == (f"run root {runs}: shared (at or below {tested}, which `make profile` "
                        "tested: a file written on one node was read on the others; "
                        "storage.shared_paths in profile dgxpod)")  # fmt: skip
    for runs in (tmp_path / "x", tmp_path / "site-runs2"):
        with pytest.raises(ConfigError) as err:
            preflight.shared_run_root(_spec(profile, 2, runs))
        message = str(err.value)
        assert f"run root {runs}: on {kind} (mount " in message
        assert f"storage.shared_paths, {tested}, which `make profile` tested, do not hold it" in (
            message
        )  # fmt: skip
        assert "run `make profile` with this path (--run-root" in message


def test_shared_paths_must_be_absolute(tmp_path):
    with pytest.raises(ConfigError, match=r"'runs': shared_paths are absolute paths"):
        load_profile(_copy(tmp_path, "dgxpod", shared_paths=["runs"]))
