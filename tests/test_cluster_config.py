"""Cluster profiles and stage recipes: bundled files validate; bad ones fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vitpod.analysis.fabric import Fabric
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.planning.recipe import RECIPE_DIR, bundled_recipes, load_recipe
from vitpod.workflows.site.profile import PROFILE_DIR, bundled_profiles, load_profile

MODELS = ["volo_d1", "volo_d2", "volo_d3", "volo_d4", "volo_d5"]


def user_profile(tmp_path: Path, base: str = "localslurm", **changes: object) -> Path:
    """A copy of a bundled profile with top-level keys changed (None deletes the key)."""
    data = yaml.safe_load((PROFILE_DIR / f"{base}.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def user_recipe(tmp_path: Path, model: str, stage: str, **changes: object) -> Path:
    data = yaml.safe_load((RECIPE_DIR / f"{model}.yaml").read_text())
    data["stages"][stage].update(changes)
    path = tmp_path / f"{model}-custom.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_bundled_profiles_validate_and_map_onto_fabric():
    assert set(bundled_profiles()) >= {"dgxpod", "superpod", "h100pod", "local", "localslurm"}
    for name in bundled_profiles():
        profile = load_profile(name)
        for stage in profile.partitions:
            node = profile.node_type(stage)
            fabric = node.fabric_model()
            assert isinstance(fabric, Fabric) and fabric.gpus_per_node == node.ranks_per_node


def test_dgxpod_matches_dgx_a100_topology():
    p = load_profile("dgxpod")
    a100 = p.node_type("pretrain")
    assert (a100.gpus_per_node, p.partition("pretrain").nodes, a100.cpus_per_task) == (8, 5, 32)
    assert a100.gpu is not None and a100.gpu.memory_bytes == 80 * 2**30
    numa = [a100.binding_for(r).numa for r in range(8)]  # type: ignore[union-attr]
    hca = [a100.binding_for(r).hca for r in range(8)]  # type: ignore[union-attr]
    assert numa == [3, 3, 1, 1, 7, 7, 5, 5]
    assert hca == [f"mlx5_{i}:1" for i in (0, 1, 2, 3, 6, 7, 8, 9)]
    assert p.container is not None and p.container.mount_home is False
    assert p.preemption.signal == "USR2" and a100.fabric_model().nics_per_node == 8
    # The reference recipe fine-tunes on DGX-2 nodes: another partition, node type and map.
    dgx2 = p.node_type("finetune")
    assert p.partition("finetune").name == "dgx2" != p.partition("pretrain").name
    assert dgx2.gpus_per_node == 16 and dgx2.gpu is not None
    assert dgx2.gpu.memory_bytes == 32 * 2**30 and dgx2.fabric_model().gpus_per_node == 16
    assert [dgx2.binding_for(r).numa for r in (0, 7, 8, 15)] == [0, 0, 1, 1]  # type: ignore[union-attr]
    assert load_profile("superpod").node_type("finetune").gpus_per_node == 16


def test_profile_by_path(tmp_path):
    path = user_profile(tmp_path, name="mine", nodes=3)
    assert load_profile(str(path)).partition("finetune").nodes == 3
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match=r"unknown profile 'dgxpdo'.*dgxpod"):
        load_profile("dgxpdo")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"gpus": 8},
            r"field \(top level\): unknown key\(s\) 'gpus' \(did you mean 'gpus_per_node'\?\);"
            r" valid keys: \['name'",
        ),
        ({"exclusve": True}, r"'exclusve' \(did you mean 'exclusive'\?\)"),
        (
            {"partitions": {"pretrain": {"name": "p", "time": "1:00:00", "qos": "x"}}},
            r"field partitions\.pretrain: unknown key\(s\) 'qos'",
        ),
        (
            {"partitions": {"pretrain": {"name": "p", "time": "an hour"}}},
            r"partitions\.pretrain\.time: 'an hour' is not a Slurm time",
        ),
        ({"mpi": "openmpi"}, r"field mpi: Input should be 'pmix', 'pmi2' or 'none'"),
        ({"env": {"HF_TOKEN": "hf_abc"}}, r"field env: 'HF_TOKEN' looks like a secret.*secrets:"),
        ({"secrets": ["WANDB_API_KEY=abc"]}, r"field secrets: .*list variable NAMES"),
        (
            {"fabric": {"gpus_per_node": 2}},
            r"field node_types.default.fabric: fabric: missing key\(s\)",
        ),
        (
            {"binding": [{"local_rank": 0, "numa": 0, "hca": "mlx5_0"}]},
            r"binding\.0\.hca: 'mlx5_0' is not DEVICE:PORT",
        ),
        (
            {"binding": [{"local_rank": 0, "numa": 0}]},
            r"binding: local ranks \[0\] must be exactly 0\.\.1",
        ),
        ({"nodes": 0}, r"field partitions.\w+.nodes: Input should be greater than or equal to 1"),
        ({"account": 'proj" --x'}, r"field account: String should match pattern"),
        ({"storage": None}, r"field storage: required field is missing"),
    ],
)
def test_bad_profile_names_the_field(tmp_path, changes, expected):
    with pytest.raises(ConfigError, match=expected):
        load_profile(str(user_profile(tmp_path, **changes)))


def test_container_mistakes_are_caught(tmp_path):
    dgx = yaml.safe_load((PROFILE_DIR / "dgxpod.yaml").read_text())
    relative = {**dgx["container"], "image": "images/vitpod.sqsh"}
    with pytest.raises(ConfigError, match=r"container\.image: .*starting with '/' or '\./'"):
        load_profile(str(user_profile(tmp_path, "dgxpod", container=relative)))
    unmounted = {**dgx["container"], "mounts": [{"src": ".", "dst": "."}]}
    with pytest.raises(
        ConfigError, match=r"storage\.data='/lustre/fsw/datasets/imagenet' is not under"
    ):
        load_profile(str(user_profile(tmp_path, "dgxpod", container=unmounted)))
    with pytest.raises(ConfigError, match=r"a local profile runs without a container"):
        load_profile(str(user_profile(tmp_path, "local", container=dgx["container"])))


def test_recipes_cover_models_and_every_value_has_a_source():
    assert set(bundled_recipes()) >= {
        *MODELS,
        "vit_small_patch16_224",
        "vit_base_patch16_224",
        "volo_tiny",
    }
    for model in bundled_recipes():
        recipe = load_recipe(model)
        for stage in ("pretrain", "finetune"):
            values = recipe.stage(stage)
            assert set(values.sources) == values.model_fields_set - {"sources"}
            assert all(len(s) > 10 for s in values.sources.values())


def test_volo_recipes_follow_the_design_table():
    drop = [load_recipe(m).stage("pretrain").drop_path for m in MODELS]
    crop = [load_recipe(m).stage("pretrain").crop_pct for m in MODELS]
    lr_base = [load_recipe(m).stage("pretrain").lr_base for m in MODELS]
    assert drop == [0.1, 0.2, 0.5, 0.5, 0.75]
    assert crop == [0.96, 0.96, 0.96, 1.15, 1.15]
    assert lr_base == [1.6e-3, 1e-3, 1e-3, 1e-3, 1e-3]
    assert "disagrees" in load_recipe("volo_d5").stage("pretrain").sources["lr_base"]
    ft = load_recipe("volo_d5").stage("finetune")
    flags = ft.trainer_flags()
    for pair in (
        ["--img-size", "512"],
        ["-b", "4"],
        ["--lr", "2.3e-05"],
        ["--drop-path", "0.5"],
        ["--epochs", "30"],
        ["--weight-decay", "1e-08"],
        ["--warmup-epochs", "5"],
        ["--token-label-size", "32"],
    ):
        i = flags.index(pair[0])
        assert flags[i : i + 2] == pair
    assert {"--ground-truth", "--token-label", "--apex-amp"} <= set(flags) and ft.finetune
    tiny = load_recipe("volo_tiny")
    assert (tiny.stage("pretrain").img_size, tiny.stage("finetune").img_size) == (32, 64)
    assert tiny.stage("pretrain").dataset == "digits"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"token_label_size": 24}, r"token_label_size=24 must be img_size/16 = 32 at img_size=512"),
        ({"lr_base": 1e-3}, r"give exactly one of lr \(absolute\) or lr_base"),
        ({"batch": 4}, r"unknown key\(s\) 'batch' \(did you mean 'batch_size'\?\)"),
        ({"img_size": 500}, r"img_size=500 must be a multiple of 16"),
    ],
)
def test_bad_recipe_names_the_field(tmp_path, changes, expected):
    path = user_recipe(tmp_path, "volo_d5", "finetune", **changes)
    with pytest.raises(ConfigError, match=rf"recipe .*field stages\.finetune: .*{expected}"):
        load_recipe(str(path))


def test_unsourced_value_is_rejected(tmp_path):
    path = user_recipe(tmp_path, "volo_d1", "pretrain", num_classes=100)
    with pytest.raises(ConfigError, match=r"no source given for \['num_classes'\]"):
        load_recipe(str(path))
    with pytest.raises(
        ConfigError, match=r"MODEL='volo_d9': no recipe; did you mean .* choose one of"
    ):
        load_recipe("volo_d9")
