"""Hardware gates: --fp8 refused without float8 (CPU, sm < 8.9), bf16 on a CPU without it."""

from __future__ import annotations

import pytest
import torch
from torchao.float8 import convert_to_float8_training

from vitpod.registry import models
from vitpod.trainer.__main__ import main
from vitpod.trainer.exitcodes import USAGE
from vitpod.trainer.hardware import bf16_cpu_warning, cpu_flags, cpu_has_bf16, fp8_problem
from vitpod.trainer.speed.fp8 import Fp8Unsupported, apply_fp8, float8_filter

CPU = torch.device("cpu")
CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\n"


def test_fp8_is_refused_on_a_cpu_in_one_line_before_the_model_changes():
    model = models.build("volo_tiny", 32, 10, 0.0)
    before = [type(m) for m in model.modules()]
    with pytest.raises(Fp8Unsupported, match="drop --fp8") as err:
        apply_fp8(model, CPU)
    assert "\n" not in str(err.value)
    assert [type(m) for m in model.modules()] == before


CAPABILITIES = [((7, 0), False), ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)]


@pytest.mark.parametrize(("capability", "ok"), CAPABILITIES)
def test_fp8_needs_compute_capability_8_9(capability, ok):
    problem = fp8_problem(torch.device("cuda", 0), capability=capability)
    assert (problem == "") is ok
    if not ok:
        assert f"{capability[0]}.{capability[1]}" in problem


def test_the_trainer_exits_with_a_usage_error_before_any_step(digits_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = [str(digits_dir), "--model", "volo_tiny", "--img-size", "32", "-b", "8",
            "--workers", "0", "--loader", "torch", "--max-steps", "1", "--aa", "", "--fp8",
            "--output", str(run)]  # fmt: skip
    assert main(args) == USAGE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--fp8" in errors[0]
    assert not (run / "metrics").exists() or not any(
        '"kind": "step"' in f.read_text() for f in (run / "metrics").glob("*.jsonl")
    )


def test_float8_layers_keep_the_checkpoint_keys_and_skip_the_heads():
    model = models.build("volo_tiny", 32, 10, 0.0)
    keys = model.state_dict().keys()
    convert_to_float8_training(model, module_filter_fn=float8_filter)
    swapped = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert swapped and not any(n.startswith(("head", "aux_head")) for n in swapped)
    assert model.state_dict().keys() == keys  # fp32 master weights: resume is unchanged


def test_cpu_flags_decide_the_bf16_warning():
    plain = cpu_flags(CPUINFO.format(extra=""))
    assert "avx512f" in plain and not cpu_has_bf16(plain)
    assert cpu_has_bf16(cpu_flags(CPUINFO.format(extra="avx512_bf16")))
    assert cpu_has_bf16(cpu_flags(CPUINFO.format(extra="amx_bf16")))
    warning = bf16_cpu_warning(CPU, torch.bfloat16, plain)
    assert "emulated" in warning and "--amp" in warning and "\n" not in warning
    assert bf16_cpu_warning(CPU, torch.bfloat16, {"avx512_bf16"}) == ""
    assert bf16_cpu_warning(CPU, None, plain) == ""
    assert bf16_cpu_warning(torch.device("cuda"), torch.bfloat16, plain) == ""
