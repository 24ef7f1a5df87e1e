"""MFU: the recorded FLOPs per step are torch's flop counter's, and MFU = FLOPs / time / peak."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitpod.registry import models
from vitpod.trainer.__main__ import main
from vitpod.trainer.exitcodes import OK
from vitpod.trainer.hardware import PEAKS, peak_flops
from vitpod.trainer.telemetry.mfu import Mfu, measure, measure_on_meta

CPU = torch.device("cpu")
H100_SXM = "NVIDIA H100 80GB HBM3"


def _tiny_volo() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("volo_tiny", 32, 10, 0.0)


def _counted(model: torch.nn.Module, batch: int) -> int:
    """FlopCounterMode over one forward + backward of `batch` images, written out here."""
    images = torch.randn(batch, 3, 32, 32)
    with FlopCounterMode(display=False) as counter:
        model(images).sum().backward()
    return int(counter.get_total_flops())


def test_recorded_flops_per_step_equal_the_flop_counter_for_the_same_model_and_batch():
    model = _tiny_volo()
    recorded = measure(model, 32, CPU, per_step_samples=6)
    assert recorded.flops_per_step == _counted(model, 6)
    assert recorded.flops_per_step == 6 * recorded.flops_per_sample


def test_tensor_or_pipeline_ranks_each_record_their_share_of_the_step():
    model = _tiny_volo()
    whole = measure(model, 32, CPU, per_step_samples=4)
    shared = measure(model, 32, CPU, per_step_samples=4, replica_ranks=2)
    assert shared.flops_per_step == whole.flops_per_step // 2
    assert shared.flops_per_sample == whole.flops_per_sample


def test_the_meta_device_count_matches_the_real_one():
    on_cpu = measure(_tiny_volo(), 32, CPU, per_step_samples=4).flops_per_step
    on_meta = measure_on_meta("volo_tiny", 32, 10, CPU, per_step_samples=4).flops_per_step
    assert abs(on_meta - on_cpu) / on_cpu < 0.01  # fused vs explicit class-attention paths


def test_mfu_is_flops_per_step_over_step_time_over_the_datasheet_peak():
    peak, reason = peak_flops(torch.device("cuda"), name=H100_SXM)
    assert peak is not None and reason == ""
    assert peak.flops == 989e12 and "datasheet" in peak.source
    mfu = Mfu(flops_per_sample=10**12, flops_per_step=64 * 10**12, peak_flops=peak.flops,
              peak_source=peak.source, reason="")  # fmt: skip
    step_s = 0.25
    assert mfu.of_step(step_s) == pytest.approx(64e12 / step_s / 989e12)
    # The job-wide form: 8 data-parallel GPUs at that step time give the same MFU.
    assert mfu.of_rate(8 * 64 / step_s, devices=8) == pytest.approx(mfu.of_step(step_s))
    assert mfu.summary(8 * 64 / step_s, 8)["mfu"] == pytest.approx(mfu.of_step(step_s))


def test_each_table_entry_names_a_datasheet_and_variants_are_told_apart():
    assert all("datasheet" in peak.source for _, peak in PEAKS)
    pcie, _ = peak_flops(torch.device("cuda"), name="NVIDIA H100 PCIe")
    sxm, _ = peak_flops(torch.device("cuda"), name=H100_SXM)
    assert pcie is not None and sxm is not None and pcie.flops < sxm.flops
    unknown, reason = peak_flops(torch.device("cuda"), name="Some Future GPU")
    assert unknown is None and "Some Future GPU" in reason


def test_an_fp32_run_has_no_mfu_against_the_16_bit_peak():
    """Measured on an H100 (docs/benchmarks.md): an fp32 run's MFU against the bf16 peak read
    5.3%, a figure of the wrong precision; fp16 runs share the 16-bit tensor-core peak."""
    fp32, reason = peak_flops(torch.device("cuda"), name=H100_SXM, dtype="fp32")
    assert fp32 is None and "fp32" in reason and "--amp" in reason
    fp16, _ = peak_flops(torch.device("cuda"), name=H100_SXM, dtype="fp16")
    assert fp16 is not None and fp16.flops == 989e12


def test_on_a_cpu_mfu_is_null_with_the_reason():
    mfu = measure(_tiny_volo(), 32, CPU, per_step_samples=2)
    summary = mfu.summary(images_per_s=100.0, devices=1)
    assert summary["mfu"] is None and "cpu" in summary["mfu_reason"]
    assert summary["flops_per_step"] > 0


def test_a_run_records_its_flops_and_mfu_in_summary_and_metrics(digits_dir, tmp_path):
    run = tmp_path / "run"
    quick = ["--model", "volo_tiny", "--img-size", "32", "-b", "8", "--workers", "0",
             "--loader", "torch", "--epochs", "1", "--warmup-epochs", "0", "--max-steps", "1",
             "--checkpoint-every", "0", "--no-eval", "--aa", "", "--reprob", "0"]  # fmt: skip
    assert main([str(digits_dir), *quick, "--output", str(run)]) == OK
    summary = json.loads((run / "summary.json").read_text())
    expected = measure_on_meta("volo_tiny", 32, 10, CPU, per_step_samples=8)
    assert summary["flops_per_step"] == expected.flops_per_step
    assert summary["mfu"] is None and summary["mfu_reason"]
    records = [json.loads(line) for line in (run / "metrics" / "rank0.jsonl").open()]
    startup = [r for r in records if r["kind"] == "mfu"]
    assert len(startup) == 1 and startup[0]["flops_per_step"] == expected.flops_per_step
    assert startup[0]["device"] == "cpu"  # what make place matches a candidate's device by
