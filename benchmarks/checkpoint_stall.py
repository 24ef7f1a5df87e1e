"""Checkpoint stall: our async save (blocked only for the host copy) vs a synchronous torch.save.

The state is VOLO-D5 sized: the real volo_d5 weights (about 296M parameters) plus AdamW's two
moment tensors per parameter (about 3.5 GB). Both saves write the same state to the same local
disk in the same run; files are deleted afterwards. Results go to
benchmarks/results/checkpoint_stall.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "checkpoint_stall.json"


def volo_d5_state() -> dict:
    """volo_d5 weights plus AdamW exp_avg/exp_avg_sq for every parameter, as in a checkpoint."""
    from trainer.models import create_model, param_count

    model = create_model("volo_d5", 224, 1000, 0.0)
    params = dict(model.named_parameters())
    moments = {
        i: {"step": torch.tensor(10.0), "exp_avg": p.detach() * 1e-3, "exp_avg_sq": p.detach() ** 2}
        for i, p in enumerate(params.values())
    }
    return {
        "model": model.state_dict(),
        "optimizer": {"state": moments, "param_groups": [{"params": list(moments)}]},
        "step": 10,
        "params": param_count(model),
    }


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    return 0


def sync_save(state: dict, directory: Path) -> float:
    """What a training loop without async checkpointing pays: torch.save, then fsync."""
    start = time.perf_counter()
    path = directory / "sync.pt"
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def async_saves(state: dict, directory: Path, count: int) -> list[dict]:
    """Stall (time save() blocks) and background write time of `count` consecutive saves."""
    from trainer.checkpoint import Checkpointer

    ck = Checkpointer(directory / "async", rank=0, world_size=1, keep_last=1)
    start = time.perf_counter()
    ck.preallocate(state)  # what the trainer does before its loop starts
    out = [{"preallocate_s": time.perf_counter() - start}]
    for step in range(1, count + 1):
        start = time.perf_counter()
        ck.save(step, epoch=0, state=state)
        stall = time.perf_counter() - start
        ck.wait()
        out.append({"stall_s": stall, "save_to_durable_s": time.perf_counter() - start})
    ck.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="local disk folder (default: a temp dir)")
    parser.add_argument("--saves", type=int, default=4, help="consecutive async saves")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    state = volo_d5_state()
    directory = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))
    try:
        sync_s = sync_save(state, directory)
        saves = async_saves(state, directory, args.saves)
        sync_again_s = sync_save(state, directory)  # load drifts: bracket the async saves
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    sync_ref = min(sync_s, sync_again_s)
    prealloc, saves = saves[0], saves[1:]
    steady = min(s["stall_s"] for s in saves[1:]) if len(saves) > 1 else saves[0]["stall_s"]
    result = {
        "benchmark": "checkpoint stall, VOLO-D5 weights + AdamW moments",
        "params": state["params"], "state_bytes": nbytes(state), "device": "cpu",
        "sync_torch_save_fsync_s": [sync_s, sync_again_s], "async_saves": saves,
        "preallocate_before_loop_s": prealloc["preallocate_s"],
        "first_stall_s": saves[0]["stall_s"], "steady_stall_s": steady,
        "stall_ratio_first": saves[0]["stall_s"] / sync_ref,
        "stall_ratio_steady": steady / sync_ref, "goal_ratio": 0.05,
        "note": "stall = host copy into staging buffers allocated before the loop; ratios use "
        "the faster of the two synchronous saves. On GPU the copy is device-to-host into pinned "
        "memory.",
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
