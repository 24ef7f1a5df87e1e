"""--compile: auto is on with CUDA only; the inductor caches live in the run dir and a requeue
(a second process) hits them, asserted by torch's own cache counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vitpod.trainer.speed.compile_cache import CACHE_DIR, cache_key, compile_enabled

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]

# One "rank" of a requeued job: a small MLP compiled and stepped once; prints torch's counters.
STEP = textwrap.dedent("""
    import json, sys, time, torch
    from torch._dynamo.utils import counters
    from vitpod.trainer.speed.compile_cache import use_run_cache
    use_run_cache(sys.argv[1], {"model": "mlp", "width": int(sys.argv[2])}, torch.device("cpu"))
    torch.manual_seed(0)
    width = int(sys.argv[2])
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 4))
    model.compile()
    start = time.perf_counter()
    model(torch.randn(8, 16)).sum().backward()
    print(json.dumps({"first_step_s": time.perf_counter() - start,
                      "inductor": dict(counters["inductor"]),
                      "aot": dict(counters["aot_autograd"])}))
""")


def _requeue(run_dir: Path, width: int = 32) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", STEP, str(run_dir), str(width)], env=env,
                          capture_output=True, text=True, timeout=900, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_auto_compiles_on_cuda_only_and_yaml_booleans_still_work():
    assert compile_enabled("auto", torch.device("cuda")) is True
    assert compile_enabled("auto", CPU) is False
    assert compile_enabled("on", CPU) is True
    assert compile_enabled("off", torch.device("cuda")) is False
    assert compile_enabled(True, CPU) is True and compile_enabled(False, CPU) is False
    with pytest.raises(ValueError, match="--compile always"):
        compile_enabled("always", CPU)


def test_the_cache_key_changes_with_the_model_flags_and_stays_put_otherwise():
    base = {"model": "volo_d1", "batch_size": 64, "amp_dtype": "bf16"}
    assert cache_key(base, CPU) == cache_key(dict(base), CPU)
    for change in ({"model": "volo_d2"}, {"batch_size": 32}, {"amp_dtype": "fp16"}):
        assert cache_key({**base, **change}, CPU) != cache_key(base, CPU)


def test_a_requeue_reuses_the_compiled_graphs_from_the_run_dir(tmp_path):
    cold = _requeue(tmp_path)
    assert cold["inductor"].get("fxgraph_cache_miss", 0) > 0
    assert cold["inductor"].get("fxgraph_cache_hit", 0) == 0
    entries = list((tmp_path / CACHE_DIR).glob("*/fxgraph/**/*"))
    assert entries, "the FX graph cache was not written under the run directory"
    warm = _requeue(tmp_path)
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == cold["inductor"]["fxgraph_cache_miss"]
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert warm["aot"].get("autograd_cache_hit", 0) > 0
    print(f"first step: cold {cold['first_step_s']:.1f} s, warm {warm['first_step_s']:.1f} s")


def test_the_flag_takes_auto_on_off_and_a_bare_compile_means_on():
    from vitpod.trainer.settings.flags import parse_args

    base = ["--dataset", "synthetic"]
    assert parse_args(base).compile == "auto"
    assert parse_args([*base, "--compile"]).compile == "on"
    assert parse_args([*base, "--compile", "off"]).compile == "off"
