"""Layouts (dp x tp x pp): per-rank memory, communication, refusals and the cheapest fit."""

import pytest

from vitpod.analysis import layout, memory
from vitpod.analysis.fabric import DGX_A100
from vitpod.analysis.layout import layout_comm
from vitpod.registry import models
from vitpod.registry.paralleldims import ParallelDims

GIB = memory.GIB


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_param_parts_add_up_to_the_count(model: str) -> None:
    assert models.param_parts(model).total == models.param_count(model)


def test_tensor_parallel_shards_the_block_matrices_by_hand() -> None:
    d, h = 384, 1536  # vit_small: the tp-split part of a block is qkv, proj weight and the MLP
    a, b = models.param_parts("vit_small_patch16_224").blocks[0]
    assert a == (3 * d * d + 3 * d) + d * d + (d * h + h) + h * d
    assert b == 6 * d  # two LayerNorms, proj and fc2 biases
    full = models.param_count("vit_small_patch16_224", 32, 10)
    tp2 = memory.params_per_rank("vit_small_patch16_224", ParallelDims(dp=2, tp=2), 32, 10)
    assert 0.5 < tp2 / full < 0.52  # the trainer measured 43,851,304 B / 4 B at tp 2 (0.508)


def test_mesh_plan_shards_states_over_dp_and_stages_over_pp() -> None:
    model, p = "vit_base_patch16_224", models.param_count("vit_base_patch16_224")
    ddp = memory.estimate(model, batch=0, mesh=ParallelDims(dp=8))
    assert (ddp.weights, ddp.grads, ddp.optimizer, ddp.buffers) == (4 * p, 4 * p, 8 * p, 4 * p)
    fsdp = memory.estimate(model, batch=0, mesh=ParallelDims(dp=8), fsdp=True)
    assert fsdp.total == pytest.approx(16 * p / 8)
    one_f = memory.estimate(model, batch=8, mesh=ParallelDims(pp=4), micro_batches=8)
    gpipe = memory.estimate(
        model, batch=8, mesh=ParallelDims(pp=4), micro_batches=8, schedule="gpipe"
    )
    assert gpipe.activations == pytest.approx(2 * one_f.activations)  # 8 vs 4 in flight
    tp = memory.estimate(model, batch=8, mesh=ParallelDims(tp=4))
    assert tp.activations < 0.5 * memory.estimate(model, batch=8).activations


def test_fsdp_moves_one_and_a_half_times_ddp_and_tp_must_stay_in_a_node() -> None:
    kw = {"param_bytes_per_rank": 1e9, "activation_bytes_per_micro": 1e6, "blocks_per_stage": 12}
    ddp = layout_comm(DGX_A100, 8, 1, 1, **kw)
    fsdp = layout_comm(DGX_A100, 8, 1, 1, fsdp=True, **kw)
    assert fsdp.bytes["dp"] == pytest.approx(1.5 * ddp.bytes["dp"])
    pipe = layout_comm(DGX_A100, 1, 1, 4, micro_batches=12, **kw)
    assert pipe.bubble == pytest.approx(3 / 15)
    with pytest.raises(ValueError, match="--tp 16"):
        layout_comm(DGX_A100, 1, 16, 1, **kw)


@pytest.mark.parametrize(
    "args,match",
    [
        ((16, 8, 16, 1), "--tp 16 exceeds the 8 GPUs of a node"),
        ((16, 8, 3, 1), "--tp 3 does not divide the 8 GPUs"),
        ((16, 8, 2, 3), "--tp 2 x --pp 3 = 6 does not divide the 16 GPUs"),
    ],
)
def test_check_layout_names_the_flag_and_the_fix(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layout.check_layout(*args)


def test_check_layout_knows_the_model() -> None:
    with pytest.raises(ValueError, match="6 attention heads"):
        layout.check_layout(16, 8, 4, 1, "vit_small_patch16_224")
    with pytest.raises(ValueError, match="pipeline stages are defined for vit_"):
        layout.check_layout(16, 8, 1, 2, "volo_d1")
    layout.check_layout(16, 8, 2, 2, "vit_base_patch16_224")


def test_giant_vit_needs_fsdp_on_80_gib_and_the_suggestion_says_so() -> None:
    """ViT-g/14, global batch 4096 on 2 DGX A100 nodes, 2 accumulation steps: 128 images per
    GPU. DDP needs more than 80 GiB; FSDP is the cheapest layout that fits."""
    kw = {"global_batch": 4096, "micro_batches": 2}
    ranked = layout.compare_layouts("vit_giant_patch14_224", 16, DGX_A100, 80 * GIB, **kw)
    ddp = next(c for c in ranked if c.mesh == ParallelDims(dp=16) and not c.fsdp)
    assert not ddp.fits and ddp.memory.total > 80 * GIB
    best = layout.suggest_layouts("vit_giant_patch14_224", 16, DGX_A100, 80 * GIB, **kw)
    assert best.fits and best.fsdp and best.flags() == ["--tp", "1", "--pp", "1", "--fsdp"]
    with pytest.raises(ValueError, match="fits no layout of 1 GPUs"):
        layout.suggest_layouts("vit_giant_patch14_224", 1, DGX_A100, 80 * GIB, **kw)


BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'timm', 'numpy') or name.startswith(
                ('vitpod.workflows', 'vitpod.trainer')):
            raise ImportError('blocked on a login node: ' + name)
sys.meta_path.insert(0, Block())
from vitpod.analysis.layout import suggest_layouts, check_layout
from vitpod.analysis.fabric import DGX_A100
print(suggest_layouts('vit_huge_patch14_224', 8, DGX_A100, 80 * 2**30, 512).flags())
"""


def test_layout_planner_imports_neither_torch_nor_trainer_nor_workflows() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH], cwd=root, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--tp" in out.stdout
