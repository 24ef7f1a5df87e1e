"""DeepSpeed universal checkpoints: ZeRO partitions of one world size resharded for another."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
from pathlib import Path

# DeepSpeed's recipe (https://www.deepspeed.ai/tutorials/universal-checkpointing/): save a
# regular ZeRO checkpoint, convert it with `deepspeed.checkpoint.ds_to_universal` (a folder per
# parameter with its full fp32 value and Adam moments), load it with the config's
# `"checkpoint": {"load_universal": true}` on any data-parallel size.
TAG = "deepspeed"  # DeepSpeedEngine.save_sharded's folder in a step directory
UNIVERSAL = "universal"  # the converted sibling: <step>/universal/


class NotConvertible(RuntimeError):
    """DeepSpeed's ds_to_universal failed on this checkpoint (said on every rank)."""


# The storage failed, not the checkpoint: an I/O error on every rank (the job fails as an I/O
# failure and can be retried once the storage is fixed), never "cannot convert" (a refusal).
STORAGE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ESTALE, errno.EREMOTEIO}
)


def saved_stage(ds_dir: Path) -> str:
    """The ZeRO stage a DeepSpeed checkpoint folder holds, told by its file names."""
    if any(ds_dir.glob("*zero_pp_rank_*_model_states.pt")):
        return "3"  # ZeRO-3 partitions the parameters: a model-states file per rank
    if any(ds_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        return "1/2"
    return "0"


def saved_partitions(ds_dir: Path) -> int:
    """How many data-parallel ranks wrote the ZeRO optimizer partitions (0: not partitioned)."""
    return len(list(ds_dir.glob("*zero_pp_rank_*_optim_states.pt")))


def refusal(step_dir: Path, saved: int, now: int) -> str | None:
    """Why a DeepSpeed checkpoint of `saved` ranks cannot be resharded for `now`, or None."""
    if (step_dir / TAG).is_dir():
        return None
    return (
        f"checkpoint {step_dir} holds no {TAG}/ folder (not written by --deepspeed, or torn): "
        f"resume it on {saved} ranks with the engine that wrote it, this job has {now}"
    )


def ensure_universal(step_dir: Path, rank: int) -> Path:
    """Collective: rank 0 converts <step>/deepspeed/ into <step>/universal/ once (atomically:
    a temporary folder renamed when complete); every rank returns it or raises rank 0's error:
    NotConvertible when DeepSpeed cannot convert the checkpoint, OSError (same errno) when the
    storage failed (full, quota, I/O error, read-only)."""
    import torch.distributed as dist

    target = step_dir / UNIVERSAL
    error: list[str | int | None] = [None, None]  # the message, the storage errno
    if rank == 0 and not target.is_dir():
        try:
            convert(step_dir / TAG, target)
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                error[0] = _not_convertible(step_dir, exc)
            else:
                error[:] = [f"converting {step_dir / TAG} to {target}: {exc}", exc.errno]
        except Exception as exc:  # every rank must leave the collective below
            error[0] = _not_convertible(step_dir, exc)
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    message, storage_errno = error
    if isinstance(storage_errno, int):
        raise OSError(storage_errno, f"{os.strerror(storage_errno)}: {message}")
    if message:
        raise NotConvertible(str(message))
    return target


def _not_convertible(step_dir: Path, exc: BaseException) -> str:
    stage = saved_stage(step_dir / TAG)
    return (
        f"DeepSpeed's ds_to_universal cannot convert the ZeRO-{stage} checkpoint "
        f"{step_dir / TAG} ({type(exc).__name__}: {exc}); ZeRO-1, 2 and 3 in fp32 "
        f"convert here: resume it on {saved_partitions(step_dir / TAG)} ranks"
    )


def convert(ds_dir: Path, target: Path) -> None:
    """DeepSpeed's ds_to_universal (its `main`) into a temporary folder, renamed to `target`."""
    from deepspeed.checkpoint import ds_to_universal

    scratch = target.with_name(target.name + ".tmp")
    shutil.rmtree(scratch, ignore_errors=True)  # left by a conversion that was killed
    args = argparse.Namespace(
        # Inside `scratch`: the `latest_universal` file it writes beside its output goes too.
        input_folder=str(ds_dir), output_folder=str(scratch / target.name),
        # One worker: no process pool forked from a trainer holding a process group.
        num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
        # Our engine records no Megatron-style universal_checkpoint_info: DeepSpeed adds it.
        inject_missing_state=True,
    )  # fmt: skip
    from vitpod.trainer.checkpointing import safeload

    try:
        with safeload.deepspeed_reads(ds_dir):  # its reads pass weights_only=False
            ds_to_universal.main(args)
        (scratch / target.name).rename(target)
    finally:  # a failed conversion (a full disk) must not leave its partial copy behind
        shutil.rmtree(scratch, ignore_errors=True)
