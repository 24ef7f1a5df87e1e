"""An sbatch script an admin accepts (issue 28 item 5), rendered offline: threads per rank split
the CPUs bound to them, no --mpi unless the profile asks (and then checked against
`srun --mpi=list`), --kill-on-bad-exit=0, the log location in Slurm's own output, RoCE settings
only on RoCE fabrics, each explained in a comment line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from vitpod.workflows import cli
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning import slurmchecks
from vitpod.workflows.site.profile import PROFILE_DIR, load_profile
from vitpod.workflows.site.rankthreads import cpu_count, rank_threads

CASE = re.compile(r"^  (\d+)\) numa=\d+ cpus=(\S+) hca=\S+ threads=(\d+) ;;$", re.M)


def _render(tmp_path: Path, capsys, *argv: str, cluster: str = "dgxpod") -> Path:
    argv = ("--cluster", cluster, "--model", "volo_d5", "--nodes", "2", "--offline", *argv)
    status = cli.main(["render", "--run-root", str(tmp_path / "runs"), *argv])
    out, err = capsys.readouterr()
    assert status == 0, err
    return Path(out.strip().splitlines()[-1])


def _copy(tmp_path: Path, change) -> str:
    data = yaml.safe_load((PROFILE_DIR / "dgxpod.yaml").read_text())
    change(data)
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _shellcheck(*paths: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    out = subprocess.run(["shellcheck", "-s", "bash", *map(str, paths)], capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]


def _ranks_srun(text: str) -> str:
    """The ranks' srun command (from `srun \\` to its bind.sh line)."""
    start = text.index("srun \\\n", text.index("VITPOD_PHASE=ranks\nset +e\n"))
    return text[start : text.index("vitpod_teardown\n", start)]


def test_dgxpod_threads_per_rank_split_the_numa_node_in_bind_sh(tmp_path, capsys):
    script = _render(tmp_path, capsys)
    bind, text = (script.parent / "bind.sh").read_text(), script.read_text()
    ranks = {int(r): (cpus, int(t)) for r, cpus, t in CASE.findall(bind)}
    assert sorted(ranks) == list(range(8))
    for _rank, (cpus, threads) in ranks.items():
        sharing = sum(1 for c, _ in ranks.values() if c == cpus)
        assert sharing == 2 and cpu_count(cpus) == 32
        assert threads == 32 // 2 - 4 == 12  # its half of the NUMA node, less 4 loader workers
    # Per NUMA node: both ranks' threads and loader workers fit its 32 hardware threads.
    for cpus in {c for c, _ in ranks.values()}:
        assert sum(t + 4 for c, t in ranks.values() if c == cpus) <= cpu_count(cpus)
    assert 'export OMP_NUM_THREADS="$threads"' in bind and "OMP_NUM_THREADS per rank" in bind
    assert "OMP_NUM_THREADS" not in text  # not one value for the whole job
    _shellcheck(script, script.parent / "bind.sh")


def test_loader_workers_from_args_change_the_threads(tmp_path, capsys):
    script = _render(tmp_path, capsys, "--args", "--workers 6")
    threads = {int(t) for _, _, t in CASE.findall((script.parent / "bind.sh").read_text())}
    assert threads == {32 // 2 - 6}  # the parsed --workers (plan.json's data.workers)
    assert json.loads((script.parent / "plan.json").read_text())["trainer"]["data"]["workers"] == 6
    script = _render(tmp_path, capsys, "--args", "-j 2 --workers=3")  # the last one wins
    threads = {int(t) for _, _, t in CASE.findall((script.parent / "bind.sh").read_text())}
    assert threads == {32 // 2 - 3}


def test_rank_threads_is_at_least_one_and_splits_shared_bindings():
    dgx2 = load_profile("dgxpod").node_types["dgx2"]  # 8 ranks on each 48-thread socket
    assert set(rank_threads(dgx2, 4).values()) == {48 // 8 - 4}
    assert set(rank_threads(dgx2, 16).values()) == {1}
    local = load_profile("localslurm").node_types["default"]  # one CPU per rank
    assert rank_threads(local, 0) == {0: 1, 1: 1}


def test_no_mpi_unless_the_profile_asks_and_kill_on_bad_exit(tmp_path, capsys):
    text = _render(tmp_path, capsys).read_text()
    srun = _ranks_srun(text)
    assert "--mpi=" not in text and "--kill-on-bad-exit=0" in srun
    assert "# No --mpi: the ranks meet by torch.distributed's env:// rendezvous" in text
    assert "# --kill-on-bad-exit=0: srun's TERM to the other ranks would look like" in text

    pmix = _copy(tmp_path, lambda d: d.update(mpi="pmix"))
    script = _render(tmp_path, capsys, cluster=pmix)
    assert "--mpi=pmix" in _ranks_srun(script.read_text())
    assert "# --mpi=pmix: the profile's `mpi:` asks for it" in script.read_text()
    _shellcheck(script, script.parent / "bind.sh")


def test_the_first_echo_of_the_batch_script_names_the_log_files(tmp_path, capsys):
    """What Slurm's own output file (#SBATCH --output) gets: one line naming the log files."""
    script = _render(tmp_path, capsys)
    text = script.read_text()
    assert '--output="$LOG_DIR/train-%j-restart${RESTART}-rank%t.log"' in text  # the rank logs
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "enroot"):  # Slurm answers nothing: the job ends early
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_NUM_NODES": "1", "HOME": str(tmp_path)}  # fmt: skip
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    logs = script.parent / "logs"
    assert out.stdout.splitlines() == [
        f"vitpod: rank logs in {logs}/train-77-restart0-rank<R>.log; this script's log: "
        f"{logs}/sbatch-77-restart0.log"
    ], out.stdout + out.stderr
    assert (logs / "sbatch-77-restart0.log").read_text().startswith("vitpod: job 77 restart 0")


def _roce(data: dict) -> None:
    for node in data["node_types"].values():
        node["fabric"]["network"] = "roce"


def test_roce_settings_only_on_a_roce_fabric(tmp_path, capsys):
    text = _render(tmp_path, capsys).read_text()
    assert "NCCL_IB_GID_INDEX" not in text.replace(
        "# fabric.network is infiniband: no RoCE-only settings (NCCL_IB_GID_INDEX", ""
    )
    assert "# fabric.network is infiniband: no RoCE-only settings" in text

    script = _render(tmp_path, capsys, cluster=_copy(tmp_path, _roce))
    text = script.read_text()
    assert "export NCCL_IB_GID_INDEX=3\n" in text and "# fabric.network is roce:" in text
    _shellcheck(script, script.parent / "bind.sh")


def test_a_roce_setting_in_env_on_infiniband_is_refused_naming_the_field(tmp_path):
    path = _copy(tmp_path, lambda d: d["env"].update(NCCL_IB_GID_INDEX="3"))
    roce_on_ib = (r"env\.NCCL_IB_GID_INDEX is a RoCE setting but node_types\.dgx\w+\.fabric\."
                  r"network is 'infiniband'; remove it from env")  # fmt: skip
    with pytest.raises(ConfigError, match=roce_on_ib):
        load_profile(path)

    def roce_with_gid(data: dict) -> None:
        _roce(data)
        data["env"]["NCCL_IB_GID_INDEX"] = "5"

    assert load_profile(_copy(tmp_path, roce_with_gid)).env["NCCL_IB_GID_INDEX"] == "5"
    with pytest.raises(ConfigError, match=r"fabric\.network: 'rocev2' is not one of"):
        load_profile(_copy(tmp_path, lambda d: d["node_types"]["dgx2"]["fabric"].update(
            network="rocev2")))  # fmt: skip


def _stub_srun(tmp_path: Path, monkeypatch, listing: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/sh\nprintf '%s\\n' '{listing}'\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_preflight_checks_the_profiles_mpi_against_srun_mpi_list(tmp_path, monkeypatch):
    spec = SimpleNamespace(profile=load_profile(_copy(tmp_path, lambda d: d.update(mpi="pmix"))))
    _stub_srun(tmp_path, monkeypatch, "MPI plugin types are...\n\tnone\n\tpmi2")
    with pytest.raises(ConfigError, match=r"mpi='pmix' is not an MPI plugin of this Slurm .*"
                       r"\['none', 'pmi2'\].*remove `mpi:`"):  # fmt: skip
        slurmchecks.check_mpi(spec)  # type: ignore[arg-type]
    _stub_srun(tmp_path, monkeypatch, "MPI plugin types are...\n\tnone\n\tpmix\n"
               "specific pmix plugin versions available: pmix_v4")  # fmt: skip
    assert slurmchecks.check_mpi(spec) == [  # type: ignore[arg-type]
        "mpi: --mpi=pmix is listed by srun --mpi=list"
    ]
    assert slurmchecks.mpi_types("srun: MPI types are...\nsrun: none\nsrun: pmi2") == {
        "none", "pmi2"}  # fmt: skip
