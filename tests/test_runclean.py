"""`vitpod clean` (workflows/watching/runclean.py) and `vitpod completion`, without Slurm: squeue is
the stub of tests/test_jobctl.py, the runs are written by the project's own writers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitpod.registry import runfiles
from vitpod.workflows import cli, completion
from vitpod.workflows.jobs.rundir import write_json
from vitpod.workflows.watching import runclean

from .test_jobctl import calls, make_pipeline, make_run, make_study, stub_slurm, use_stubs


def clean(capsys, *flags: str) -> tuple[int, dict[Path, dict], str]:
    code = cli.main(["clean", "--json", *flags])
    out = capsys.readouterr()
    listed = {Path(v["path"]): v for v in json.loads(out.out or "[]")}
    return code, listed, out.err


def test_dry_run_by_default_then_yes_deletes_only_ended_runs(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"201": "RUNNING", "101": "PENDING", "203": "FAILED"})
    use_stubs(monkeypatch, stubs, root)
    running = make_run(root, "201", step=10, total=100)
    failed = make_run(root, "203", step=10, total=100)
    gone = make_run(root, "202", step=100, total=100)  # left squeue, no summary: GONE
    queued = make_pipeline(root, {"pretrain": "101", "finetune": "102"})
    capsys.readouterr()
    code, listed, err = clean(capsys, "--older-than", "0s")
    assert code == 0 and "would delete 2 of 4" in err and "--yes" in err
    assert {p for p, v in listed.items() if v["delete"]} == {failed, gone}
    assert "RUNNING" in listed[running]["reason"] and "vitpod cancel" in listed[running]["reason"]
    assert listed[queued]["state"] == "PENDING" and not listed[queued]["delete"]
    assert all(v["size_bytes"] > 0 for v in listed.values())
    assert all(p.is_dir() for p in (running, failed, gone, queued))  # a dry run deletes nothing

    code, listed, err = clean(capsys, "--state", "failed", "--yes")
    assert code == 0 and set(listed) == {failed} and "deleted 1" in err
    assert not failed.exists() and all(p.is_dir() for p in (running, gone, queued))
    assert calls(stubs["scancel"]) == []


def test_finals_and_the_runs_a_kept_run_reads_from_are_kept(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"301": "RUNNING"})
    use_stubs(monkeypatch, stubs, root)
    source = make_run(root, "300", step=100, total=100, done=True)
    (source / runfiles.FINAL).mkdir()
    (runfiles.final_model(source)).write_bytes(b"weights")
    finished = make_run(root, "302", step=100, total=100, done=True)
    (finished / runfiles.FINAL).mkdir()
    (runfiles.final_model(finished)).write_bytes(b"weights")
    finetune = make_run(root, "301", step=5, total=100)  # queued or running: reads the source
    manifest = runfiles.read_manifest(finetune)
    overrides = {**manifest.get("overrides", {}), "finetune_from": str(source / runfiles.FINAL)}
    write_json(finetune / runfiles.MANIFEST, {**manifest, "overrides": overrides})
    capsys.readouterr()
    code, listed, _ = clean(capsys, "--state", "COMPLETED")
    assert "final model" in listed[finished]["reason"] and not listed[finished]["delete"]
    code, listed, _ = clean(capsys, "--state", "COMPLETED", "--include-finals", "--yes")
    assert listed[source]["reason"] == f"{finetune} (kept) reads from it"
    assert not finished.exists() and source.is_dir() and finetune.is_dir()


def test_nothing_is_deleted_when_squeue_does_not_answer(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {}, fail=True)
    use_stubs(monkeypatch, stubs, root)
    run = make_run(root, "401", step=10, total=100)
    capsys.readouterr()
    code, listed, err = clean(capsys, "--older-than", "0s", "--yes")
    assert code == 0 and "squeue did not answer" in err
    assert listed[run]["state"] == "UNKNOWN" and "may still run" in listed[run]["reason"]
    assert run.is_dir()


def test_age_filter_and_bad_input(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    use_stubs(monkeypatch, stub_slurm(tmp_path, {}), root)
    run = make_run(root, "501", step=10, total=100)
    verdicts, _ = runclean.plan(root, older_than="7d")
    assert verdicts == []
    verdicts, _ = runclean.plan(root, older_than="7d", now=time.time() + 8 * 86400)
    assert [(v.entry.path, v.delete) for v in verdicts] == [(run, True)]
    capsys.readouterr()
    for flags, message in (
        ((), "name what to delete: --older-than 7d and/or --state"),
        (("--older-than", "7x"), "--older-than '7x': write a number and a unit"),
        (("--state", "running"), "--state RUNNING: clean deletes only ended runs"),
    ):
        assert cli.main(["clean", *flags]) == 2
        assert message in capsys.readouterr().err
    assert run.is_dir()


@pytest.mark.parametrize(
    ("words", "offered"),
    [
        (["vitpod", "cl"], {"clean"}),
        (["vitpod", "clean", "--o"], {"--older-than"}),
        (["vitpod", "status", "--f"], {"--follow"}),
    ],  # fmt: skip
)
def test_completion_script_completes_commands_and_their_options(tmp_path, words, offered):
    script = tmp_path / "vitpod.bash"
    script.write_text(completion.script(cli.COMMANDS, cli._load))
    line = " ".join(words)
    probe = (f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _vitpod; "
             'printf "%s\\n" "${COMPREPLY[@]}"')  # fmt: skip
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True)
    assert set(done.stdout.split()) == offered


def test_list_shows_a_damaged_metrics_file_on_its_row_and_lists_the_rest(
    tmp_path, monkeypatch, capsys
):
    root = tmp_path / "runs"
    use_stubs(monkeypatch, stub_slurm(tmp_path, {"601": "RUNNING", "602": "RUNNING"}), root)
    damaged = make_run(root, "601", step=20, total=100)
    fine = make_run(root, "602", step=30, total=100)
    with open(runfiles.metrics_file(damaged, 0), "a") as f:
        f.write("not json\n")
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    listed = {Path(e["path"]): e for e in json.loads(capsys.readouterr().out)}
    assert listed[fine]["progress"] == "30/100"
    assert listed[damaged]["state"] == "RUNNING"
    assert "metrics/rank0.jsonl:3: not a JSON line" in listed[damaged]["note"]


def test_clean_deletes_only_what_vitpod_made_under_the_root(tmp_path, monkeypatch, capsys):
    """A directory holding someone's manifest.json, and a study reached through a symlinked
    studies/ (pointing outside the run root), are listed and kept; --yes deletes neither."""
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    use_stubs(monkeypatch, stub_slurm(tmp_path, {}), root)
    ours = make_run(root, "701", step=10, total=100)
    theirs = root / "20260101T000000Z-export-abc123"
    theirs.mkdir()
    (theirs / runfiles.MANIFEST).write_text(json.dumps({"files": ["a.jpg"], "created": "x"}))
    study = make_study(outside, "702", "703")  # a real study, but outside the run root
    (root / "studies").symlink_to(outside / "studies")
    capsys.readouterr()
    code, listed, err = clean(capsys, "--older-than", "0s", "--yes")
    assert code == 0 and "deleted 1" in err, err
    assert not ours.exists() and theirs.is_dir() and study.is_dir()
    assert "manifest.json is not a record vitpod wrote" in listed[theirs]["reason"]
    assert "through a symbolic link" in listed[root / "studies" / study.name]["reason"]


def test_a_run_whose_local_process_lives_or_that_holds_set_aside_checkpoints_is_kept(
    tmp_path, monkeypatch, capsys
):
    """A local run has no Slurm job to ask: its directory showed GONE while its ranks ran. A
    process whose arguments name the run (as a rank's `--plan RUN/plan.json`) keeps it."""
    root = tmp_path / "runs"
    use_stubs(monkeypatch, stub_slurm(tmp_path, {}), root)
    local = make_run(root, "801", step=10, total=100)
    aside = make_run(root, "802", step=10, total=100)
    (aside / runfiles.CHECKPOINTS / runfiles.CHECKPOINT_DISCARDED / "step_000000010").mkdir(
        parents=True
    )
    (
        aside / runfiles.CHECKPOINTS / runfiles.CHECKPOINT_DISCARDED / "step_000000010" / "rank0.pt"
    ).write_bytes(b"x")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                             "--plan", str(local / runfiles.PLAN)])  # fmt: skip
    try:
        capsys.readouterr()
        code, listed, _ = clean(capsys, "--older-than", "0s", "--yes")
        assert listed[local]["state"] == "GONE" and local.is_dir()
        assert f"a process on this host uses it: pid {rank.pid}" in listed[local]["reason"]
        assert "--include-discarded deletes them" in listed[aside]["reason"] and aside.is_dir()
    finally:
        rank.kill()
        rank.wait()
    code, listed, err = clean(capsys, "--older-than", "0s", "--include-discarded", "--yes")
    assert "deleted 2" in err and not local.exists() and not aside.exists()
