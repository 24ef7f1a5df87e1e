"""Checkpoint files read without running code from them: DCP and DeepSpeed directories.

torch.distributed.checkpoint's FileSystemReader unpickles `.metadata` with plain `pickle.load`
and its DefaultLoadPlanner reads non-tensor values with `torch.load(weights_only=False)`;
DeepSpeed's checkpoint engine and its universal-checkpoint readers also pass
weights_only=False. Here `.metadata` goes through an unpickler that resolves DCP's own metadata
classes only, the values through `torch.load(weights_only=True)`, and every DeepSpeed read
under torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD (which overrides a caller's weights_only=False:
https://pytorch.org/docs/stable/notes/serialization.html#environment-variables). A refused
file raises UnsafeCheckpoint naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from vitpod.registry import safepickle

FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpoint(safepickle.UnsafePickle):
    """A checkpoint file holds something other than tensors and plain values (names the file)."""


def _dcp_names(module: str, name: str) -> Any:
    """DCP's metadata dataclasses and enums, its storage record, torch.Size, dtypes, layouts,
    and the PosixPath it records as the checkpoint id: nothing that acts when called."""
    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        ok = inspect.isclass(found) and (
            dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
        )
        return found if ok and found.__module__ == module else None
    if (module, name) == (filesystem.__name__, "_StorageInfo"):
        return filesystem._StorageInfo
    if module == "torch":
        found = getattr(torch, name, None)
        return found if name == "Size" or isinstance(found, torch.dtype) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):
        return getattr(pathlib, name)
    return None


class Reader(dcp.FileSystemReader):
    """FileSystemReader whose `.metadata` is read by the restricted unpickler, and whose shard
    reads name the file that failed weights_only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (f"__{rank}.metadata" if rank is not None else ".metadata")
        try:
            metadata = safepickle.load(path, _dcp_names, "a DCP checkpoint's .metadata")
        except safepickle.UnsafePickle as err:
            raise UnsafeCheckpoint(str(err)) from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        storage = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage.load_id = self.load_id  # as FileSystemReader.read_metadata does
        metadata.storage_meta = storage
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative, items in per_file.items():
            with named(Path(self.path) / relative):
                super().read_data(dataclasses.replace(plan, items=items), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


class Planner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are read with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        with _forced():
            super().load_bytes(read_item, value)


@contextlib.contextmanager
def _forced() -> Iterator[None]:
    """torch.load is weights_only inside, whatever its caller passes."""
    before = os.environ.get(FORCE)
    os.environ[FORCE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FORCE, None)
        else:
            os.environ[FORCE] = before


@contextlib.contextmanager
def named(path: Path) -> Iterator[None]:
    """An UnpicklingError from weights_only inside becomes UnsafeCheckpoint naming `path`."""
    try:
        with safepickle.naming(path):
            yield
    except UnsafeCheckpoint:
        raise
    except safepickle.UnsafePickle as err:
        raise UnsafeCheckpoint(f"{err}: take another checkpoint or a new run directory") from None


@contextlib.contextmanager
def weights_only(directory: Path) -> Iterator[None]:
    """Every torch.load inside (DeepSpeed's) is weights_only; a refusal names the file that
    holds more (found by reading the directory's .pt files again, on the failure path only)."""
    try:
        with _forced():
            yield
    except UnsafeCheckpoint:
        raise
    except pickle.UnpicklingError as err:
        where = _offending_file(directory) or directory
        raise UnsafeCheckpoint(
            f"{safepickle.refusal(where, err)}: take another checkpoint or a new run directory"
        ) from None


def _offending_file(directory: Path) -> Path | None:
    with _forced():
        for file in sorted(directory.rglob("*.pt")):
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError:
                return file
            except Exception:  # noqa: BLE001  # another failure is not the one looked for
                continue
    return None


def load_dcp(state: dict[str, Any], directory: Path, **kwargs: Any) -> None:
    """dcp.load through the restricted reader and planner."""
    try:
        dcp.load(state, storage_reader=Reader(str(directory)), planner=Planner(), **kwargs)
    except CheckpointException as err:  # DCP wraps each rank's error: ours is the cause
        for failure, _ in err.failures.values():
            if isinstance(failure, UnsafeCheckpoint):
                raise UnsafeCheckpoint(str(failure)) from None
        raise


def deepspeed_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed 0.19's ZeRO 0-3 files hold (its loss scaler's state,
    the ZeRO stage enum, a parameter's fragment address): plain records, nothing that acts."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    scalers = [loss_scaler.LossScaler, loss_scaler.DynamicLossScaler]
    extra = [getattr(loss_scaler, n) for n in ("LossScaleConfig", "LossScaleProfile")]
    return [*scalers, *[c for c in extra if inspect.isclass(c)], ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def deepspeed_reads(directory: Path) -> Iterator[None]:
    """DeepSpeed's loads of `directory` weights_only, with its own record classes allowed."""
    with weights_only(directory), torch.serialization.safe_globals(deepspeed_globals()):
        yield
