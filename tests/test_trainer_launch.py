"""Rank discovery from Slurm/torchrun variables (the local launcher is tests/helpers.py)."""

import pytest

from vitpod.trainer import dist as tdist


@pytest.mark.parametrize(
    "nodelist,host",
    [("gpu[07-09,12],login1", "gpu07"), ("node1", "node1"), ("dgx[001-040]", "dgx001"),
     ("a-b[3,5]", "a-b3")],
)  # fmt: skip
def test_first_host_of_slurm_nodelist(nodelist: str, host: str) -> None:
    assert tdist.first_host(nodelist) == host


def test_slurm_variables_give_ranks_and_a_job_derived_port() -> None:
    env = tdist.detect(
        {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16",
         "SLURM_JOB_NODELIST": "dgx[03-04]", "SLURM_JOB_ID": "12345"}
    )  # fmt: skip
    assert (env.rank, env.local_rank, env.world_size, env.master_addr) == (9, 1, 16, "dgx03")
    assert env.master_port == 10000 + 12345 % 20000 and env.source == "slurm"


def test_torchrun_variables_win_over_slurm() -> None:
    env = tdist.detect(
        {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "7",
         "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (3, 8, "h", 7)


def test_no_variables_is_a_single_process() -> None:
    env = tdist.detect({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")
