"""A dgxpod pipeline rendered away from its cluster: per-stage resources, precision by GPU.

`make pipeline ... OFFLINE=1` and `Chain(..., offline=True)` ask Slurm nothing (stub Slurm
commands on PATH record any call), write every stage's script and plan.json, submit nothing;
each stage runs on its own partition with its own node count and time limit, and the GPU of
its node type decides the autocast dtype (A100: bf16; V100: fp16 with loss scaling).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import make_pipeline_offline, recording_slurm, vitpod
from vitpod.registry.decision import read_decision
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.pipeline.chain import Chain


def sbatch_lines(script: Path) -> dict[str, str]:
    out = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH --") and "=" in line:
            key, _, value = line[len("#SBATCH --") :].partition("=")
            out[key] = value
    return out


def test_make_pipeline_offline_writes_each_stage_on_its_partition_with_its_precision(tmp_path):
    result, calls = make_pipeline_offline(
        tmp_path, "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5", "OFFLINE=1"
    )
    assert result.returncode == 0, result.stderr
    assert not calls.exists(), calls.read_text()
    (pipeline,) = (tmp_path / "runs").iterdir()
    printed = result.stdout.splitlines()
    pre, fin = pipeline / "pretrain" / "job.sbatch", pipeline / "finetune" / "job.sbatch"
    assert f"pretrain: {pre}" in printed and f"finetune: {fin}" in printed
    # NODES=5 is the pretrain's; dgx2 has 2 nodes, so the finetune keeps its partition's 2.
    assert {k: sbatch_lines(pre)[k] for k in ("partition", "nodes", "time")} == {
        "partition": "dgxa100", "nodes": "5", "time": "2-00:00:00",
    }  # fmt: skip
    assert {k: sbatch_lines(fin)[k] for k in ("partition", "nodes", "time")} == {
        "partition": "dgx2", "nodes": "2", "time": "1-00:00:00",
    }  # fmt: skip
    assert any("finetune takes its 2" in line for line in printed)
    plans = {stage: read_decision(pipeline / stage) for stage in ("pretrain", "finetune")}
    assert (plans["pretrain"].resources.partition, plans["pretrain"].resources.nodes) == (
        "dgxa100", 5,
    )  # fmt: skip
    assert (plans["finetune"].resources.partition, plans["finetune"].resources.nodes) == ("dgx2", 2)
    pre_prec, fin_prec = plans["pretrain"].precision, plans["finetune"].precision
    assert pre_prec is not None and fin_prec is not None
    assert (pre_prec.dtype, pre_prec.loss_scaling, pre_prec.gpu) == (
        "bf16",
        "none",
        "A100-SXM4-80GB",
    )
    assert (fin_prec.dtype, fin_prec.loss_scaling, fin_prec.gpu) == (
        "fp16", "dynamic", "V100-SXM3-32GB",
    )  # fmt: skip
    assert "V100" in fin_prec.reason and "bf16" in fin_prec.reason
    # The chosen dtype is a setting of plan.json's trainer section (the recipe's --apex-amp
    # on), never a token added to the command.
    for stage, dtype in (("pretrain", "bf16"), ("finetune", "fp16")):
        precision = read_decision(pipeline / stage).trainer.precision
        assert precision["amp_dtype"] == dtype and precision["amp"] is True
        manifest = json.loads((pipeline / stage / "manifest.json").read_text())
        assert "--amp-dtype" not in manifest["resolved"]["command"]
    assert '"amp_dtype": "fp16"' in fin.read_text()  # the script prints what the ranks run
    # The memory planner planned the fine-tune in the chosen dtype.
    assert plans["finetune"].memory["settings"]["amp_dtype"] == "fp16"
    record = json.loads((pipeline / "pipeline.json").read_text())
    assert record["offline"] is True
    assert {s["job_ids"] == [] and s["state"] == "RENDERED" for s in record["stages"].values()} == {
        True
    }


def test_make_pipeline_ft_nodes_beyond_the_partition_is_refused_in_one_line(tmp_path):
    result, _ = make_pipeline_offline(
        tmp_path, "CLUSTER=dgxpod", "MODEL=volo_d5", "NODES=5", "FT_NODES=3", "OFFLINE=1"
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: FT_NODES=3: partition 'dgx2' (finetune) has 2 node(s) in profile dgxpod; "
        "use FT_NODES=2 or fewer"
    ]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_chain_offline_plan_gives_every_stage_script_without_slurm(tmp_path, monkeypatch):
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    runs = tmp_path / "runs"
    records = Chain(
        cluster="dgxpod", model="volo_d5", nodes=5, offline=True, run_root=str(runs)
    ).plan()
    assert not calls.exists()
    assert not runs.exists()  # plan() writes nothing
    pre, fin = records["pretrain"].plan, records["finetune"].plan
    assert "#SBATCH --partition=dgxa100" in pre.script and "#SBATCH --nodes=5" in pre.script
    assert "#SBATCH --partition=dgx2" in fin.script and "#SBATCH --nodes=2" in fin.script
    assert '"amp_dtype": "fp16"' in fin.script and '"amp_dtype": "bf16"' in pre.script
    assert fin.decision is not None and fin.decision.precision is not None
    assert fin.decision.precision.dtype == "fp16"
    # Per-stage arguments: the fine-tune's own node count and time limit.
    records = Chain(
        cluster="dgxpod", model="volo_d5", nodes=5, finetune_nodes=1, finetune_time="2:00:00",
        time="1-12:00:00", offline=True, run_root=str(runs),
    ).plan()  # fmt: skip
    fin_spec, pre_spec = records["finetune"].plan.spec, records["pretrain"].plan.spec
    assert (fin_spec.nodes, fin_spec.time, fin_spec.partition) == (1, "2:00:00", "dgx2")
    assert (pre_spec.nodes, pre_spec.time, pre_spec.partition) == (5, "1-12:00:00", "dgxa100")
    with pytest.raises(ConfigError, match=r"^FT_NODES=3: partition 'dgx2' \(finetune\) has 2"):
        Chain(cluster="dgxpod", nodes=5, finetune_nodes=3, offline=True).plan()
    with pytest.raises(ConfigError, match=r"^FT_TIME='two hours' is not a Slurm time"):
        Chain(cluster="dgxpod", finetune_time="two hours", offline=True).plan()
    with pytest.raises(ConfigError, match="renders only"):
        Chain(cluster="dgxpod", offline=True, run_root=str(runs)).submit()
    assert not runs.exists() and not calls.exists()


def test_chain_offline_render_writes_the_same_scripts_plan_returns(tmp_path, monkeypatch):
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    chain = Chain(cluster="dgxpod", nodes=5, offline=True, run_root=str(tmp_path / "runs"))
    written = chain.render()
    assert set(written) == {"pretrain", "finetune"}
    for stage, script in written.items():
        assert script.read_text() == chain.stages[stage].plan.script
        assert (
            read_decision(script.parent).resources.partition
            == chain.stages[stage].plan.spec.partition
        )
    assert not calls.exists()


def test_bf16_asked_for_on_the_v100_finetune_is_refused_naming_the_gpu_and_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        Chain(
            cluster="dgxpod", nodes=5, finetune_args="--amp-dtype bf16", offline=True,
            run_root=str(tmp_path / "runs"),
        ).render()  # fmt: skip
    message = str(err.value)
    assert "--amp-dtype bf16" in message and "V100-SXM3-32GB" in message
    assert "use --amp-dtype fp16" in message
    assert not (tmp_path / "runs").exists()
    # The same flag on the A100 pretrain alone is fine: bf16 is native there.
    records = Chain(
        cluster="dgxpod", nodes=5, stages=("pretrain",), args="--amp-dtype bf16", offline=True,
    ).plan()  # fmt: skip
    precision = records["pretrain"].plan.decision.precision  # type: ignore[union-attr]
    assert precision is not None and (precision.dtype, precision.source) == ("bf16", "flags")


def test_a_rendered_pipeline_is_submitted_only_as_rendered(tmp_path, monkeypatch):
    """Render, review, submit: a file changed since rendering is refused by name, by
    Chain.submit() after render(), Chain.from_dir(...).submit() and `vitpod submit DIR`, before
    Slurm is asked; an unchanged render goes on to the live preflight (here: stub Slurm refuses),
    never to "already submitted", which needs job ids."""
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    chain = Chain(cluster="dgxpod", nodes=5, offline=True, run_root=str(tmp_path / "runs"))
    written = chain.render()
    assert chain.directory is not None
    with pytest.raises(ConfigError, match=r"sbatch|Slurm|partition") as live:
        Chain.from_dir(chain.directory).submit()  # rendered, unchanged: the live preflight runs
    assert "changed since" not in str(live.value) and calls.exists()
    sums = (written["pretrain"].parent / "rendered.sha256").read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in sums) == ["bind.sh", "job.sbatch", "plan.json"]
    calls.unlink()
    script = written["finetune"]
    script.write_text(script.read_text().replace("--nodes=2", "--nodes=1"))
    for submit in (chain.submit, Chain.from_dir(chain.directory).submit):
        with pytest.raises(ConfigError, match=rf"{script} changed since it was rendered"):
            submit()
    assert not calls.exists()  # refused before Slurm was asked
    (written["pretrain"].parent / "plan.json").unlink()
    out = vitpod("submit", str(chain.directory), env=env)
    assert out.returncode == 2 and f"{script} changed since it was rendered" in out.stderr
    assert "plan.json was rendered but is gone" in out.stderr
    one = vitpod("submit", str(written["pretrain"].parent), env=env)
    assert one.returncode == 2 and "plan.json was rendered but is gone" in one.stderr
    assert not calls.exists()
    record = json.loads((chain.directory / "pipeline.json").read_text())
    assert all(not s["job_ids"] and s["state"] == "RENDERED" for s in record["stages"].values())


def test_a_manifest_pointing_at_an_unrendered_script_is_refused(tmp_path, monkeypatch):
    """manifest.json is not checksummed and its `script` is what sbatch gets: one edited to name
    another file in the run directory is refused, naming it, before Slurm is asked (it was
    submitted unreviewed; found verifying issue 43)."""
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    chain = Chain(cluster="dgxpod", nodes=5, offline=True, run_root=str(tmp_path / "runs"))
    run_dir = chain.render()["pretrain"].parent
    (run_dir / "other.sbatch").write_text("#!/bin/bash\necho not reviewed\n")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (run_dir / "manifest.json").write_text(json.dumps({**manifest, "script": "other.sbatch"}))
    refusal = f"{run_dir / 'manifest.json'} names script 'other.sbatch', which was not rendered"
    for dry in ((), ("--dry-run",)):
        out = vitpod("submit", str(run_dir), *dry, env=env)
        assert out.returncode == 2 and refusal in out.stderr, out.stderr
    with pytest.raises(ConfigError, match=refusal.replace(".", r"\.")):
        Chain.from_dir(chain.directory).submit()
    assert not calls.exists()


def test_vitpod_submit_of_a_submitted_pipeline_is_one_clear_error(tmp_path, monkeypatch):
    """`vitpod submit DIR` of a pipeline that has job ids: exit 2 and one line saying so and how
    to watch it, not Chain.submit's RuntimeError traceback (found verifying issue 43)."""
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    chain = Chain(cluster="dgxpod", nodes=5, offline=True, run_root=str(tmp_path / "runs"))
    chain.render()
    assert chain.directory is not None
    record = json.loads((chain.directory / "pipeline.json").read_text())
    for n, stage in enumerate(record["stages"].values()):
        stage.update(job_ids=[str(41 + n)], state="SUBMITTED")
    (chain.directory / "pipeline.json").write_text(json.dumps(record))
    out = vitpod("submit", str(chain.directory), env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    said = f"{chain.directory} was already submitted (job 41 42); watch it: make status"
    assert said in out.stderr
    assert not calls.exists()


def test_a_rendered_run_copied_elsewhere_is_refused_naming_where_it_was_rendered(
    tmp_path, monkeypatch
):
    """A rendered run directory copied to another folder still holds scripts that read and
    write the folder it was rendered in: `vitpod submit COPY` refuses, naming both, before Slurm
    is asked (it was submitted with a note only, to run in the original folder while the copy
    recorded the job; found verifying issue 43)."""
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    chain = Chain(cluster="dgxpod", nodes=5, offline=True, run_root=str(tmp_path / "runs"))
    rendered = chain.render()["pretrain"].parent
    copy = tmp_path / "copy" / rendered.name
    shutil.copytree(rendered, copy)
    out = vitpod("submit", str(copy), env=env)
    assert out.returncode == 2 and f"{copy} was rendered as {rendered}" in out.stderr, out.stderr
    assert not calls.exists()


def test_a_pipeline_whose_stage_already_has_a_job_id_is_refused(tmp_path, monkeypatch):
    """A stage directory whose manifest.json has a job id (a copy of the rendered pipeline
    directory names the same stage directories, and was submitted) is not submitted again by its
    pipeline: refused before Slurm is asked; it queued a second job writing the same run
    directory (found verifying issue 43)."""
    env, calls = recording_slurm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    chain = Chain(cluster="dgxpod", nodes=5, offline=True, run_root=str(tmp_path / "runs"))
    stage = chain.render()["finetune"].parent
    assert chain.directory is not None
    manifest = json.loads((stage / "manifest.json").read_text())
    (stage / "manifest.json").write_text(json.dumps({**manifest, "job_ids": ["7"]}))
    out = vitpod("submit", str(chain.directory), env=env)
    assert out.returncode == 2 and f"{stage} was already submitted (job 7)" in out.stderr
    assert not calls.exists()
