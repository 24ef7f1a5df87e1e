"""Training throughput and startup: vitpod beside timm's real train.py, in the same run.

Both programs train the same model on the same JPEG folders with the same settings (batch,
ranks, AdamW, precision, RandAugment, CutOut, label smoothing, drop path, bicubic crops,
color jitter off: timm turns it off itself when RandAugment is on, and so do we) and are timed
end to end as processes. Each is run twice per round, once on a folder of S_short steps and
once on a folder of S_long steps (the short folder's files are the first of the long one's);
the steady-state seconds per step are (T_long - T_short) / (S_long - S_short) and the fixed cost
(startup, first-step warm-up, checkpoint and exit) is T_short - S_short x that. This is the
comparison timm's peers README asks for: start-up code differs, so compare the slope.

The machine may be shared: the programs are interleaved, the order reversed every other round,
every round is kept in the JSON, and the ratio is computed from the median slope of each side.
Run: python benchmarks/throughput.py [--peer ../shared/peers/timm_train.py] [--model volo_d1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vitpod.registry import runfiles  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "throughput.json"
# ../shared/peers/timm_train.py from a checkout; a git worktree sits one level deeper.
DEFAULT_PEER = next(
    (p / "shared" / "peers" / "timm_train.py" for p in ROOT.parents
     if (p / "shared" / "peers" / "timm_train.py").is_file()),
    ROOT.parent / "shared" / "peers" / "timm_train.py",
)  # fmt: skip
GOAL = 1.3
RANDAUG = "rand-m9-mstd0.5-inc1"  # the VOLO recipe's policy (timm's notation)
TIMM_AMP = {"bf16": ["--amp", "--amp-dtype", "bfloat16"], "fp32": []}
OURS_AMP = {"bf16": ["--amp", "--amp-dtype", "bf16"], "fp32": ["--no-amp"]}


def make_folders(root: Path, batch: int, ranks: int, steps: tuple[int, int]) -> dict[int, Path]:
    """One ImageNet-layout folder per step count; the shorter one's files are the longer's first."""
    from loader import write_jpegs

    needed = batch * ranks * max(steps)
    pool = write_jpegs(root / f"pool{needed}", needed)  # write_jpegs reuses a complete folder
    files = sorted((pool / "train").glob("*/*.jpg"), key=lambda p: p.name)
    out = {}
    for count in steps:
        folder = root / f"steps{count}x{batch}x{ranks}-of{needed}"
        if not (folder / ".complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            for split, chosen in (("train", files[: batch * ranks * count]), ("val", files[:4])):
                for path in chosen:
                    target = folder / split / path.parent.name / path.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(path, target)
            (folder / ".complete").write_text("")
        out[count] = folder
    return out


def launcher(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={ranks}"]  # fmt: skip


def timm_command(peer: Path, data: Path, out: Path, a: argparse.Namespace, ranks: int,
                 precision: str, timm_model: str) -> list[str]:  # fmt: skip
    return [
        *launcher(ranks), str(peer), str(data), "--model", timm_model, "-b", str(a.batch),
        "--img-size", str(a.img_size), "--epochs", "1", "--warmup-epochs", "0",
        "--workers", str(a.workers), "--device", "cpu", "--num-classes", "2",
        "--opt", "adamw", "--weight-decay", "0.05", "--lr", "1e-4", "--aa", RANDAUG,
        "--reprob", "0.25", "--remode", "pixel", "--smoothing", "0.1",
        "--drop-path", str(a.drop_path), "--train-interpolation", "bicubic",
        "--train-split", "train", "--val-split", "", "--eval-metric", "loss",
        "--log-interval", "1", "--output", str(out), "--experiment", "run",
        *TIMM_AMP[precision],
        # timm's train.py gives --img-size to the data only; the model gets it as a kwarg
        "--model-kwargs", f"img_size={a.img_size}",
    ]  # fmt: skip


def ours_command(data: Path, out: Path, a: argparse.Namespace, ranks: int, precision: str,
                 extra: list[str]) -> list[str]:  # fmt: skip
    return [
        *launcher(ranks), "-m", "vitpod.trainer", str(data), "--model", a.model, "-b", str(a.batch),
        "--img-size", str(a.img_size), "--epochs", "1", "--warmup-epochs", "0",
        "--workers", str(a.workers), "--num-classes", "2", "--opt", "adamw",
        "--weight-decay", "0.05", "--lr", "1e-4", "--aa", RANDAUG, "--reprob", "0.25",
        "--smoothing", "0.1", "--drop-path", str(a.drop_path), "--no-eval", "--resume", "none",
        "--checkpoint-every", "0", "--log-interval", str(a.log_interval),
        "--output", str(out), *OURS_AMP[precision], *extra,
    ]  # fmt: skip


def timed(command: list[str], log: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with log.open("w") as fh:
        fh.write(shlex.join(command) + "\n")
        fh.flush()
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        lines = log.read_text().splitlines()  # a rank's own error, not torchrun's summary
        errors = [ln for ln in lines if "Error:" in ln and "ChildFailedError" not in ln]
        raise RuntimeError(f"exit {done.returncode}: {errors[-1] if errors else ''} (see {log})")
    return seconds


def check_steps(name: str, out: Path, count: int) -> None:
    """Both programs really trained `count` steps (a folder too small would time nothing)."""
    if name == "vitpod":
        done = (runfiles.read_summary(out) or {}).get("steps", -1)
    else:  # timm logs "Train: 0 [ idx/updates_per_epoch" on its last batch
        log = (out / "log.txt").read_text()
        done = count if f"[{count - 1:>4d}/{count} " in log else -1
    if done != count:
        raise RuntimeError(f"{name} trained {done} steps, expected {count}; see {out}")


def own_step_times(name: str, out: Path) -> list[float]:
    """Each step's seconds as the program logged it (vitpod: metrics/rank0.jsonl; timm: the
    'Time:' of its log lines, every step with --log-interval 1). A second, load-robust view:
    the wall-time slope mixes in whatever the machine's other users did between two runs."""
    if name == "vitpod":
        return [r["time"]["step"] for r in runfiles.read_metrics(out, 0) if r["kind"] == "step"]
    return [float(m) for m in re.findall(r"Time: ([0-9.]+)s", (out / "log.txt").read_text())]


def fit(short: float, long: float, steps: tuple[int, int]) -> dict[str, float]:
    per_step = (long - short) / (steps[1] - steps[0])
    return {"t_short_s": short, "t_long_s": long, "s_per_step": per_step,
            "fixed_s": short - steps[0] * per_step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, default=DEFAULT_PEER, help="timm's train.py")
    parser.add_argument("--model", default="volo_d1", help="vitpod name (timm name derived)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--drop-path", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=1, help="loader workers, both programs")
    parser.add_argument("--steps", type=int, nargs=2, default=(2, 8), metavar=("SHORT", "LONG"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1])
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp32"], choices=list(TIMM_AMP))
    parser.add_argument("--ours-args", default="", help="extra trainer flags, e.g. '--compile'")
    parser.add_argument(
        "--log-interval",
        type=int,
        default=50,
        help="vitpod metrics lines (timm logs every step for its step times)",
    )
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "vitpod-tp")
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    from vitpod.registry import models

    if not a.peer.is_file():
        parser.error(f"--peer {a.peer}: no such file (timm's train.py)")
    timm_model = models.get(a.model).timm_name if models.known(a.model) else a.model
    steps = (a.steps[0], a.steps[1])
    extra = shlex.split(a.ours_args)
    logs = Path(tempfile.mkdtemp(prefix="vitpod-tp-logs-"))
    configs = []
    for ranks in a.ranks:
        folders = make_folders(a.data, a.batch, ranks, steps)
        for precision in a.precision:
            try:
                rounds = measure(a, ranks, precision, folders, logs, steps, extra, timm_model)
            except RuntimeError as err:  # e.g. timm's train.py cannot run DDP on CPU
                print(f"ranks {ranks} {precision}: not measured: {err}", flush=True)
                configs.append({"summary": {"ranks": ranks, "precision": precision,
                                            "not_measured": str(err)}})  # fmt: skip
                write(a, timm_model, extra, steps, configs)
                continue
            configs.append(summarize(ranks, precision, rounds, a.batch))
            print(json.dumps(configs[-1]["summary"]), flush=True)
            write(a, timm_model, extra, steps, configs)  # after each: a cut run keeps its part


def measure(
    a: argparse.Namespace, ranks: int, precision: str, folders: dict[int, Path], logs: Path,
    steps: tuple[int, int], extra: list[str], timm_model: str,
) -> dict:  # fmt: skip
    """Both programs, interleaved over the rounds; raises RuntimeError if one of them fails."""
    rounds: dict[str, list[dict[str, float]]] = {"timm": [], "vitpod": []}
    for round_ in range(a.rounds):
        order = ["timm", "vitpod"] if round_ % 2 == 0 else ["vitpod", "timm"]
        for name in order:
            seconds, own = [], []
            for count in steps:
                out = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=logs))
                if name == "timm":
                    cmd = timm_command(a.peer, folders[count], out, a, ranks, precision,
                                       timm_model)  # fmt: skip
                else:
                    cmd = ours_command(folders[count], out, a, ranks, precision, extra)
                seconds.append(timed(cmd, out / "log.txt"))
                check_steps(name, out, count)
                own.append(own_step_times(name, out))
                shutil.rmtree(out / "run", ignore_errors=True)  # timm's checkpoints
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
            rounds[name].append({**fit(seconds[0], seconds[1], steps),
                                 "load_1min": os.getloadavg()[0],
                                 "logged_step_s": own})  # fmt: skip
            print(f"ranks {ranks} {precision} round {round_} {name}: "
                  f"{rounds[name][-1]}", flush=True)  # fmt: skip
    return rounds


def summarize(ranks: int, precision: str, rounds: dict, batch: int) -> dict:
    slope = {name: statistics.median(r["s_per_step"] for r in rs) for name, rs in rounds.items()}
    fixed = {name: statistics.median(r["fixed_s"] for r in rs) for name, rs in rounds.items()}
    images = batch * ranks
    # Logged steps after each run's first (the warm-up step), pooled over runs and rounds.
    logged = {name: statistics.median(s for r in rs for run in r["logged_step_s"] for s in run[1:])
              for name, rs in rounds.items()}  # fmt: skip
    summary = {
        "ranks": ranks, "precision": precision,
        "timm_images_per_s": images / slope["timm"],
        "vitpod_images_per_s": images / slope["vitpod"],
        "ratio_vs_timm": slope["timm"] / slope["vitpod"],
        "timm_fixed_s": fixed["timm"], "vitpod_fixed_s": fixed["vitpod"],
        "meets_goal": slope["timm"] / slope["vitpod"] >= GOAL,
        "logged_median_step_s": logged,
        "ratio_vs_timm_logged_steps": logged["timm"] / logged["vitpod"],
    }  # fmt: skip
    return {"summary": summary, "rounds": rounds}


def write(a: argparse.Namespace, timm_model: str, extra: list[str], steps: tuple[int, int],
          configs: list[dict]) -> None:  # fmt: skip
    import platform

    import torch

    from vitpod.registry.io import write_json_atomic
    from vitpod.trainer.hardware import cpu_vector_flags

    result = {
        "benchmark": "training throughput vs timm's train.py (the real script), end to end",
        "peer": str(a.peer), "model": a.model, "timm_model": timm_model, "batch_per_rank": a.batch,
        "img_size": a.img_size, "workers": a.workers, "steps": list(steps), "rounds": a.rounds,
        "ours_extra_flags": extra, "goal_ratio": GOAL,
        "method": "steady-state s/step = (T_long - T_short) / (S_long - S_short), process wall "
        "times; fixed_s = T_short - S_short x s/step (startup + warm-up + checkpoint + exit); "
        "median over rounds; programs interleaved, order reversed every other round",
        "equal_settings": "same JPEG folders, model, batch, ranks, AdamW wd 0.05 lr 1e-4, "
        f"precision, RandAugment {RANDAUG}, random erasing 0.25 pixel mode, label smoothing 0.1, "
        "drop path, bicubic train interpolation, no color jitter (off with RandAugment in both), "
        "no eval, loader workers",
        "configs": configs,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "device": "cpu", **cpu_vector_flags(),
                    "note": "shared 2-core machine: other engineers' jobs ran beside this one"},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out, result)
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
