"""Job control without Slurm: `vitpod list`, `vitpod cancel`, `Chain.from_dir`, `--dry-run`,
`--version` and the top-level help.

Run, pipeline and study directories are written by the project's own writers where cheap
(`vitpod render`, `Chain(offline=True).render()` and its `_save`); squeue and scancel are stub
scripts on PATH that answer like Slurm's and record every call.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import vitpod
from vitpod.registry import runfiles
from vitpod.workflows import cli
from vitpod.workflows.jobs.rundir import write_json
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.site.profile import PROFILE_DIR
from vitpod.workflows.watching.jobctl import Study

REPO = Path(__file__).resolve().parents[1]

SQUEUE = """#!{python}
# Answers `squeue -h --states=all -j IDS -O JobArrayID:|,State:|,...` like Slurm's: one line per
# job; an array id (in ARRAYS) as its tasks. Unknown ids are left out. Every call is recorded.
import json, sys
args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if {fail}:
    sys.stderr.write("slurm_load_jobs error: Unable to contact slurm controller\\n")
    sys.exit(1)
states = json.load(open({states!r}))
arrays = {{"100": "100_[0-3]"}}
for job in args[args.index("-j") + 1].split(","):
    state = states.get(job) or states.get(job.split("_")[0])  # an array task: its array's
    if state is None:
        continue
    name = arrays.get(job) or job
    print(f"{{name}}|{{state}}|None|0|0:0|")
"""


def stub_slurm(tmp_path: Path, states: dict[str, str], fail: bool = False) -> dict[str, Path]:
    """squeue answering `states`; scancel, sacct, sbatch, sinfo recording their calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = {name: tmp_path / f"{name}.calls" for name in ("squeue", "scancel", "sacct", "other")}
    (tmp_path / "states.json").write_text(json.dumps(states))
    squeue = bin_dir / "squeue"
    squeue.write_text(SQUEUE.format(python=sys.executable, calls=str(calls["squeue"]),
                                    states=str(tmp_path / "states.json"), fail=fail))  # fmt: skip
    for name, exit_code in (("scancel", 0), ("sacct", 1), ("sbatch", 1), ("sinfo", 1)):
        record = calls.get(name, calls["other"])
        (bin_dir / name).write_text(f'#!/bin/sh\necho "$*" >> {record}\nexit {exit_code}\n')
    for path in bin_dir.iterdir():
        path.chmod(0o755)
    return {"bin": bin_dir, **calls}


def calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def use_stubs(monkeypatch, stubs: dict[str, Path], root: Path) -> None:
    monkeypatch.setenv("PATH", f"{stubs['bin']}:{os.environ['PATH']}")
    monkeypatch.setenv("VITPOD_RUN_ROOT", str(root))


def make_pipeline(root: Path, job_ids: dict[str, str], labels: str = "") -> Path:
    """A localslurm pipeline rendered by Chain and recorded as submitted (pipeline.json)."""
    chain = Chain(cluster="localslurm", model="volo_tiny", offline=True, run_root=str(root))
    chain.render()
    for stage, job_id in job_ids.items():
        chain.stages[stage].job_ids, chain.stages[stage].recorded = [job_id], "SUBMITTED"
    chain.offline = False
    chain._save()
    assert chain.directory is not None
    if labels:  # a labeling array queued before the pretrain (as Chain._record writes it)
        record = json.loads((chain.directory / runfiles.PIPELINE).read_text())
        record["labels"] = {
            "pretrain": {
                "run_dir": str(chain.directory / "labels-pretrain"),
                "label_dir": str(root / "labels"),
                "job_ids": [labels],
            }
        }
        write_json(chain.directory / runfiles.PIPELINE, record)
    return chain.directory


def make_run(root: Path, job_id: str, step: int, total: int, done: bool = False) -> Path:
    """`vitpod render` of one stage, then the manifest's job id and rank 0's metrics."""
    assert cli.main(["render", "--cluster", "localslurm", "--model", "volo_tiny",
                     "--run-root", str(root)]) == 0  # fmt: skip
    run = max((p for p in root.iterdir() if "-pretrain-" in p.name), key=os.path.getmtime)
    manifest = json.loads((run / runfiles.MANIFEST).read_text())
    write_json(run / runfiles.MANIFEST, {**manifest, "job_ids": [job_id]})
    metrics = runfiles.metrics_file(run, 0)
    metrics.parent.mkdir(exist_ok=True)
    lines = [
        {
            "kind": "step",
            "rank": 0,
            "step": s,
            "total_steps": total,
            "loss": 2.0,
            "images_per_s": 100.0,
            "wall_time": 1000.0 + s,
        }
        for s in range(10, step + 1, 10)
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))  # fmt: skip
    if done:
        write_json(run / runfiles.SUMMARY, {"steps": total, "top1": 50.0})
    return run


def make_study(root: Path, point_jobs: tuple[str, str], report: str) -> Path:
    """study.json with the keys workflows/studies/study.py's study_record writes (two points,
    each its own job)."""
    study = root / "studies" / "20260101T000000Z-volo_tiny-strong-abc123"
    study.mkdir(parents=True)
    points = [
        {
            "index": i,
            "gpus": g,
            "nodes": 1,
            "run_dir": f"p{i}-{g}gpu",
            "batch_size": 64 // g,
            "global_batch": 64,
            "engine": "ring",
            "job_id": point_jobs[i],
            "state": None,
        }
        for i, g in enumerate((1, 2))
    ]
    for point in points:
        (study / point["run_dir"]).mkdir()
    write_json(study / runfiles.STUDY, {
        "mode": "strong", "model": "volo_tiny", "cluster": "localslurm", "batch": 64, "accum": 1,
        "steps": 30, "warmup": 5, "args": "", "created": "2026-01-01T00:00:00+00:00",
        "node_hours": 1.0, "report_job_id": report, "points": points,
    })  # fmt: skip
    return study


def test_list_asks_squeue_once_for_every_job_of_every_run(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"101": "RUNNING", "102": "PENDING", "201": "RUNNING",
                                  "300": "RUNNING", "302": "PENDING",
                                  "301": "PENDING"})  # fmt: skip
    use_stubs(monkeypatch, stubs, root)
    pipeline = make_pipeline(root, {"pretrain": "101", "finetune": "102"})
    run = make_run(root, "201", step=50, total=200)
    finished = make_run(root, "202", step=200, total=200, done=True)
    study = make_study(root, ("300", "302"), "301")
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    listed = {Path(e["path"]): e for e in json.loads(capsys.readouterr().out)}
    (squeue_call,) = calls(stubs["squeue"])  # one squeue for the 4 directories
    asked = json.loads(squeue_call)
    assert set(asked[asked.index("-j") + 1].split(",")) == {
        "101", "102", "201", "202", "300", "302", "301",
    }  # fmt: skip
    assert listed.keys() == {pipeline, run, finished, study}
    assert (listed[pipeline]["state"], listed[pipeline]["job_ids"]) == ("RUNNING", ["101", "102"])
    assert (listed[run]["state"], listed[run]["progress"]) == ("RUNNING", "50/200")
    # 202 left squeue and sacct does not answer: its summary.json says how it ended
    assert (listed[finished]["state"], listed[finished]["progress"]) == ("COMPLETED", "200/200")
    assert listed[study]["state"] == "RUNNING"
    assert listed[study]["job_ids"] == ["300", "302", "301"]  # each point's job, then the report
    assert listed[study]["progress"] == "0/2 points"
    assert all(e["model"] == "volo_tiny" and e["cluster"] == "localslurm" for e in listed.values())


def test_list_filters_by_state_model_and_cluster(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"101": "PENDING", "102": "PENDING", "201": "RUNNING"})
    use_stubs(monkeypatch, stubs, root)
    pipeline = make_pipeline(root, {"pretrain": "101", "finetune": "102"})
    run = make_run(root, "201", step=10, total=100)
    capsys.readouterr()

    def listed(*flags: str) -> list[str]:
        assert cli.main(["list", *flags]) == 0
        return [line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]]

    assert listed("--state", "running") == [str(run)]
    assert listed("--state", "PENDING,RUNNING") == [str(pipeline), str(run)]
    assert listed("--model", "volo_tiny", "--cluster", "localslurm") == [str(pipeline), str(run)]
    assert listed("--model", "volo_d5") == [] and listed("--cluster", "dgxpod") == []


def test_list_without_slurm_reads_states_from_the_directories(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {}, fail=True)
    use_stubs(monkeypatch, stubs, root)
    done = make_run(root, "202", step=100, total=100, done=True)
    rendered = Chain(cluster="localslurm", model="volo_tiny", offline=True, run_root=str(root))
    rendered.render()
    submitted = make_pipeline(root, {"pretrain": "101", "finetune": "102"})
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    out = capsys.readouterr()
    states = {Path(e["path"]): e["state"] for e in json.loads(out.out)}
    assert states == {done: "COMPLETED", rendered.directory: "RENDERED", submitted: "UNKNOWN"}
    assert "squeue did not answer" in out.err


def test_cancel_pipeline_is_one_scancel_with_stages_and_labeling_array(
    tmp_path, monkeypatch, capsys
):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"100": "PENDING", "101": "PENDING", "102": "PENDING"})
    use_stubs(monkeypatch, stubs, root)
    pipeline = make_pipeline(root, {"pretrain": "101", "finetune": "102"}, labels="100")
    capsys.readouterr()
    assert cli.main(["cancel", str(pipeline)]) == 0
    assert [sorted(c.split()) for c in calls(stubs["scancel"])] == [["100", "101", "102"]]
    out = capsys.readouterr().out
    assert "100 (PENDING)" in out and "101 (PENDING)" in out and "102 (PENDING)" in out
    assert (pipeline / runfiles.PIPELINE).is_file() and (pipeline / "pretrain").is_dir()


def test_cancel_run_and_study_name_only_live_jobs(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"201": "RUNNING", "300": "RUNNING", "302": "PENDING",
                                  "301": "PENDING"})  # fmt: skip
    use_stubs(monkeypatch, stubs, root)
    run = make_run(root, "201", step=10, total=100)
    manifest = json.loads((run / runfiles.MANIFEST).read_text())  # an earlier start's job, ended
    write_json(run / "manifest.restart1.json", {**manifest, "job_ids": ["199"]})
    study = make_study(root, ("300", "302"), "301")
    assert cli.main(["cancel", str(run)]) == 0
    assert cli.main(["cancel", "--run", str(study)]) == 0
    assert calls(stubs["scancel"]) == ["201", "300 302 301"]
    assert Study.from_dir(study).job_ids == ["300", "302", "301"]
    assert "cancelled study" in capsys.readouterr().out


def test_cancel_refuses_a_directory_that_is_no_run(tmp_path, monkeypatch, capsys):
    stubs = stub_slurm(tmp_path, {})
    use_stubs(monkeypatch, stubs, tmp_path / "runs")
    assert cli.main(["cancel", str(tmp_path)]) == 2
    assert "not a run, pipeline or study directory" in capsys.readouterr().err
    assert calls(stubs["scancel"]) == []


def _fresh(code: str, stubs: dict[str, Path]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{stubs['bin']}:{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_chain_from_dir_in_a_fresh_interpreter_status_and_cancel(tmp_path):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"101": "RUNNING", "102": "PENDING"})
    offline = Chain(cluster="localslurm", model="volo_tiny", offline=True, run_root=str(root))
    offline.render()
    submitted = make_pipeline(root, {"pretrain": "101", "finetune": "102"})
    code = (
        "from vitpod.workflows.pipeline.chain import Chain\n"
        "c = Chain.from_dir(PATH)\n"
        "print(*[(s.name, s.state, s.job_ids) for s in c.status()], sep='\\n')\n"
        "print(sorted(c.report()['stages']))\n"
    )
    shown = _fresh(code.replace("PATH", repr(str(offline.directory))), stubs)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "('pretrain', 'RENDERED', [])", "('finetune', 'RENDERED', [])", "['finetune', 'pretrain']",
    ]  # fmt: skip
    assert calls(stubs["squeue"]) == []  # nothing submitted, nothing asked
    live = _fresh(code.replace("PATH", repr(str(submitted))) + "print(c.cancel())", stubs)
    assert live.returncode == 0, live.stderr
    assert live.stdout.splitlines()[:2] == ["('pretrain', 'RUNNING', ['101'])",
                                            "('finetune', 'PENDING', ['102'])"]  # fmt: skip
    assert live.stdout.splitlines()[-1] == "['101', '102']"
    assert calls(stubs["scancel"]) == ["101 102"]
    record = json.loads((submitted / runfiles.PIPELINE).read_text())
    assert record["stages"]["pretrain"]["partition"] and record["cluster"] == "localslurm"


def test_chain_from_dir_refuses_a_run_directory(tmp_path):
    with pytest.raises(Exception, match="no pipeline.json"):
        Chain.from_dir(tmp_path)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "--cluster", "localslurm", "--model", "volo_tiny", "--dry-run", "--offline"],
        ["pipeline", "--cluster", "localslurm", "--model", "volo_tiny", "--dry-run", "--offline"],
    ],
    ids=["submit", "pipeline"],
)
def test_dry_run_prints_the_scripts_and_writes_nothing(argv, tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    (root / "earlier").mkdir(parents=True)
    stubs = stub_slurm(tmp_path, {})
    use_stubs(monkeypatch, stubs, root)
    before = _tree(tmp_path)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert _tree(tmp_path) == before
    scripts = out.count("#!/bin/bash")
    assert scripts == (2 if argv[0] == "pipeline" else 1), out
    assert "#SBATCH --partition=" in out and "dry run" in out
    assert calls(stubs["squeue"]) == calls(stubs["other"]) == []  # Slurm not asked (--offline)


def test_version_is_the_package_version():
    try:
        expected = importlib.metadata.version("vitpod")
    except importlib.metadata.PackageNotFoundError:
        expected = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]
    done = vitpod("--version", timeout=60)
    assert (done.returncode, done.stdout) == (0, f"vitpod {expected}\n")


def test_help_lists_every_command_with_one_line(capsys):
    for argv in ([], ["--help"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: vitpod <command>")
        for name in cli.COMMANDS:
            (line,) = [x for x in out.splitlines() if x.split()[:1] == [name]]
            assert len(line.split(maxsplit=1)[1]) > 10, line  # a description, not a bare name
    assert set(cli.DESCRIPTIONS) == set(cli.COMMANDS)
    assert cli.main(["lsit"]) == 2
    assert "unknown command 'lsit'" in capsys.readouterr().err


def test_a_state_that_is_no_state_is_refused_listing_the_valid_ones(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    stubs = stub_slurm(tmp_path, {"201": "RUNNING"})
    use_stubs(monkeypatch, stubs, root)
    make_run(root, "201", step=1, total=2)
    capsys.readouterr()
    assert cli.main(["list", "--state", "RUNING"]) == 2
    err = capsys.readouterr().err
    assert "STATE=RUNING: RUNING is not a state; choose from" in err
    assert ",PENDING," in err and ",RUNNING," in err and err.count("\n") == 1
    assert not calls(stubs["squeue"])  # refused before Slurm is asked


def test_list_without_a_root_searches_every_profiles_runs_and_says_which(
    tmp_path, monkeypatch, capsys
):
    """No CLUSTER, no VITPOD_RUN_ROOT: the runs root of every known profile (here two of the
    user's, one whose root does not exist, besides the bundled ones) is searched, and said."""
    stubs = stub_slurm(tmp_path, {"201": "RUNNING"})
    use_stubs(monkeypatch, stubs, tmp_path / "unused")
    monkeypatch.delenv("VITPOD_RUN_ROOT")
    mine = tmp_path / "profiles"
    mine.mkdir()
    base = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    for name in ("site-a", "site-b"):
        storage = {**base["storage"], "runs": str(tmp_path / f"runs-{name}")}
        (mine / f"{name}.yaml").write_text(yaml.safe_dump({**base, "name": name,
                                                           "storage": storage}))  # fmt: skip
    monkeypatch.setenv("VITPOD_PROFILES", str(mine))
    run = make_run(tmp_path / "runs-site-a", "201", step=5, total=10)
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    out = capsys.readouterr()
    assert str(run) in {e["path"] for e in json.loads(out.out)}
    searched = out.err.splitlines()[0]
    assert searched.startswith("searched: ") and str(tmp_path / "runs-site-a") in searched
    assert f"{tmp_path / 'runs-site-b'} (site-b): no such directory here" in searched
