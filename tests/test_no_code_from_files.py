"""No code runs from a file: each load path of a file vitpod did not write in this process is
given a planted pickle whose unpickling would create a file. The file is not created, and the
error names the planted file. Each case also shows the plant is live (plain pickle runs it)."""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures_data import data_config
from tests.helpers import REPO, free_port
from vitpod.registry import labellayout
from vitpod.trainer.checkpointing import safeload
from vitpod.trainer.data.sources import DataSourceError, load_split
from vitpod.trainer.model.models import read_weights


class Plant:
    """Unpickled by anything that resolves any global, it creates `target`."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.target),))


NAMED = r"names (pathlib\.Path\.touch|__builtin__\.getattr)"  # the plant at protocol 4+ or 2


def _live(data: bytes, target: Path) -> None:
    """The plant does run under plain pickle (so the tests below can fail)."""
    pickle.loads(data)
    assert target.exists()
    target.unlink()


def _dcp_checkpoint(directory: Path, extra: object = None) -> None:
    import torch.distributed.checkpoint as dcp

    state: dict = {"model.w": torch.arange(6.0).reshape(2, 3)}
    if extra is not None:
        state["model.extra"] = extra
    dcp.save(state, checkpoint_id=str(directory / "dcp"), no_dist=True)


def test_dcp_metadata_planted_runs_nothing_through_finetune(tmp_path: Path) -> None:
    step, target = tmp_path / "step_000000004", tmp_path / "ran"
    _dcp_checkpoint(step)
    assert read_weights(str(step))[0]["w"].sum() == 15  # the honest checkpoint loads
    planted = pickle.dumps(Plant(target))
    _live(planted, target)
    (step / "dcp" / ".metadata").write_bytes(planted)
    with pytest.raises(safeload.UnsafeCheckpoint, match=r"dcp/\.metadata: " + NAMED):
        read_weights(str(step))  # --finetune DIR
    assert not target.exists()


def test_a_planted_finetune_source_is_bad_input_naming_the_file(
    digits_dir: Path, tmp_path: Path, capsys
) -> None:
    """vitpod-train --finetune DIR whose dcp/.metadata is planted: exit 2 with one error line
    naming the file (it ended in a traceback and exit 1), nothing run."""
    from vitpod.trainer.__main__ import main
    from vitpod.trainer.exitcodes import USAGE

    step, target = tmp_path / "step_000000004", tmp_path / "ran"
    _dcp_checkpoint(step)
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(Plant(target)))
    args = [str(digits_dir), "--model", "volo_tiny", "--img-size", "32", "--num-classes", "10",
            "--workers", "0", "--max-steps", "1", "--finetune", str(step),
            "--output", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == USAGE
    assert f"error: {step}/dcp/.metadata: names " in capsys.readouterr().err
    assert not target.exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_dcp_value_planted_in_a_shard_runs_nothing(tmp_path: Path) -> None:
    """A non-tensor value is stored as torch.save bytes; DCP's planner loads it with
    weights_only=False: here weights_only, and the error names the shard file."""
    step, target = tmp_path / "step_000000004", tmp_path / "ran"
    _dcp_checkpoint(step, extra=Plant(target))
    assert not target.exists()
    with pytest.raises(safeload.UnsafeCheckpoint, match=r"dcp/__0_0\.distcp: holds more than"):
        safeload.load_dcp({"model.extra": None}, step / "dcp", no_dist=True)
    assert not target.exists()


def test_cifar_batch_planted_runs_nothing(tmp_path: Path) -> None:
    folder, target = tmp_path / "cifar-10-batches-py", tmp_path / "ran"
    folder.mkdir()
    names = {b"label_names": [f"c{i}".encode() for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(names, protocol=2))
    batch = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]}
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4"):
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps(batch, protocol=5))
    planted = pickle.dumps({b"data": Plant(target), b"labels": [0]}, protocol=2)
    _live(planted, target)
    (folder / "data_batch_5").write_bytes(planted)
    cfg = data_config(tmp_path, dataset="cifar10")
    assert len(load_split(cfg, "val")) == 4  # numpy arrays at protocols 2 and 5 still load
    with pytest.raises(DataSourceError, match=r"data_batch_5: " + NAMED):
        load_split(cfg, "train")
    assert not target.exists()


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_token_label_shape_probe_planted_runs_nothing(tmp_path: Path, layout: str) -> None:
    """The login side's shape probe (render, preflight) on third-party label files."""
    file, target = tmp_path / "n01" / "img1.pt", tmp_path / "ran"
    file.parent.mkdir()
    honest = tmp_path / "honest.pt"
    torch.save(torch.zeros(2, 5, 14, 14, dtype=torch.float16), honest,
               _use_new_zipfile_serialization=layout == "zip")  # fmt: skip
    assert labellayout.tensor_file_shape(honest) == ((2, 5, 14, 14), "Half")
    if layout == "zip":
        torch.save(Plant(target), file)
        with zipfile.ZipFile(file) as archive:
            _live(archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl"))),
                  target)  # fmt: skip
    else:  # torch < 1.6 files: the plant is the first pickle (where the magic number goes)
        file.write_bytes(pickle.dumps(Plant(target), protocol=2) + honest.read_bytes())
        _live(file.read_bytes(), target)
    with pytest.raises(ValueError, match=rf"{file}: {NAMED}"):
        labellayout.tensor_file_shape(file)
    problems = labellayout.published_problems(tmp_path, where="--token-label-data", data_dir=None)
    assert any(str(file) in p for p in problems), problems
    assert not target.exists()


DEEPSPEED_RANK = """
import os, sys, json
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
from vitpod.trainer.checkpointing import ds_universal, safeload
from vitpod.trainer.engines.deepspeed_engine import DeepSpeedEngine, deepspeed_config
step, planted = Path(sys.argv[1]), sys.argv[2]
def engine():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    cfg = deepspeed_config(2, 1, 1, 1e-3, 0.05, 1, None, 1.0)
    return DeepSpeedEngine(m, [{"params": list(m.parameters())}], cfg)
e = engine()
e.backward(e.forward(torch.randn(2, 3)).sum()); e.step()
e.save_sharded(step)
engine().load_sharded(step)  # the honest checkpoint loads
files = sorted((step / "deepspeed").glob(planted))
files[0].write_bytes(Path(os.environ["PLANT"]).read_bytes())
errors = {}
try:
    engine().load_sharded(step)
except safeload.UnsafeCheckpoint as err:
    errors["load"] = str(err)
try:
    ds_universal.convert(step / "deepspeed", step / "universal")
except safeload.UnsafeCheckpoint as err:
    errors["convert"] = str(err)
print("ERRORS " + json.dumps(errors))
"""


@pytest.mark.parametrize("planted", ["mp_rank_00_model_states.pt", "*_optim_states.pt"])
def test_deepspeed_checkpoint_planted_runs_nothing(tmp_path: Path, planted: str) -> None:
    """DeepSpeed's checkpoint engine and its ds_to_universal converter pass weights_only=False."""
    target, plant = tmp_path / "ran", tmp_path / "plant.pt"
    torch.save({"module": Plant(target)}, plant)
    rank = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env = {**os.environ, **rank, "PLANT": str(plant), "MASTER_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_RANK, str(tmp_path / "step_000000002"), planted],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.split("ERRORS ", 1)[1].splitlines()[0])
    name = "mp_rank_00_model_states.pt" if planted.startswith("mp") else "optim_states.pt"
    assert name in errors["load"] and "holds more than tensors" in errors["load"], errors
    assert name in errors["convert"] and "holds more than tensors" in errors["convert"], errors
    assert not target.exists()


def test_restricted_unpickler_resolves_nothing_by_default() -> None:
    """safepickle's own contract: a table without the name refuses it, naming the path."""
    from vitpod.registry import safepickle

    data = pickle.dumps(io.BytesIO(b"x"))
    with pytest.raises(safepickle.UnsafePickle, match=r"^some/file: names _io.BytesIO"):
        safepickle.loads(data, safepickle.names({}), "a test file", "some/file")


def test_a_planted_rank0_checkpoint_runs_nothing(tmp_path: Path) -> None:
    """The DDP engine's checkpoint files are weights_only; the refusal names the file."""
    from vitpod.registry.safepickle import UnsafePickle
    from vitpod.trainer.checkpointing.checkpoint import Checkpointer

    step, target = tmp_path / "checkpoints" / "step_000000004", tmp_path / "ran"
    step.mkdir(parents=True)
    torch.save({"model": Plant(target)}, step / "rank0.pt")
    ckpt = Checkpointer(tmp_path / "checkpoints", 0, 1, use_async=False, launch="test")
    with pytest.raises(UnsafePickle, match=r"step_000000004/rank0\.pt: holds more than tensors"):
        ckpt.load(step)
    assert not target.exists()


@pytest.mark.parametrize("layout", ["file", "shards", "published"])
def test_a_planted_token_label_file_runs_nothing_in_the_trainer(tmp_path: Path, layout: str):
    """The trainer's reads of token labels: vitpod's store (one file or shards) and
    TokenLabeling's published per-image files."""
    from vitpod.registry import labelset
    from vitpod.registry.safepickle import UnsafePickle
    from vitpod.trainer.data import published_labels
    from vitpod.trainer.data.label_maps import TokenLabelError
    from vitpod.trainer.data.token_label import TokenLabelStore

    target = tmp_path / "ran"
    if layout == "published":
        file = tmp_path / "n01" / "img1.pt"
        file.parent.mkdir()
        torch.save(Plant(target), file)
        with pytest.raises(TokenLabelError, match=rf"{file}: unreadable"):
            published_labels._load(file, 10)
    elif layout == "file":
        file = tmp_path / "labels.pt"
        torch.save({"maps": Plant(target)}, file)
        with pytest.raises(UnsafePickle, match=rf"{file}: holds more than tensors"):
            assert TokenLabelStore(file, 10, 2).data is None
    else:
        store = tmp_path / "labels"
        file = labelset.shard_path(store, 0, 1)
        file.parent.mkdir(parents=True)
        torch.save({"maps": Plant(target)}, file)
        (store / labelset.RECORD).write_text(json.dumps({"num_shards": 1, "teacher": {}}))
        with pytest.raises(UnsafePickle, match=rf"{file}: holds more than tensors"):
            assert TokenLabelStore(store, 10, 2).data is None
    assert not target.exists()
