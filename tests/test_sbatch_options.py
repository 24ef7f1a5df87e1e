"""Per-submission sbatch options (TIME, ACCOUNT, QOS, RESERVATION, CONSTRAINT, EXCLUDE,
SBATCH_EXTRA; a pipeline's FT_...): taken by every command that submits, in the #SBATCH header,
plan.json and the manifest;
bad values refused naming the variable before anything is written; `sbatch --test-only` in the
preflight (a stand-in sbatch here: no Slurm is asked)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import make, make_pipeline_offline, recording_slurm
from vitpod.registry import runfiles
from vitpod.registry.decision import read_decision
from vitpod.workflows import cli
from vitpod.workflows.commands import chain_cli, doctor_cli
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.pipeline import labels
from vitpod.workflows.pipeline.chain import Chain
from vitpod.workflows.planning import slurmchecks
from vitpod.workflows.planning.plan import Request, plan_job
from vitpod.workflows.planning.sbatchopts import SbatchOptions
from vitpod.workflows.studies import calibrate, scaling
from vitpod.workflows.submit.resume import parser as resume_parser
from vitpod.workflows.submit.resume import plan_resume, resume_request
from vitpod.workflows.templating import sbatch_value

OPTIONS = ["--account=proj_a", "--qos=high", "--reservation=maint_1", "--constraint=a100&ib",
           "--exclude=node[3-4],node7",
           "--sbatch-extra=--mail-type=END --comment='nightly #3' --hold"]  # fmt: skip
HEADER = [
    "#SBATCH --account=proj_a", "#SBATCH --qos=high", "#SBATCH --reservation=maint_1",
    "#SBATCH --constraint=a100&ib", "#SBATCH --exclude=node[3-4],node7",
    "#SBATCH --mail-type=END", '#SBATCH "--comment=nightly #3"', "#SBATCH --hold",
]  # fmt: skip


def _render(tmp_path: Path, *options: str) -> int:
    argv = ["render", "--cluster", "localslurm", "--model", "volo_tiny",
            "--run-root", str(tmp_path / "runs"), *options]  # fmt: skip
    return cli.main(argv)


def _header(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def sbatch_words(line: str) -> list[str]:
    """An #SBATCH line's words as sbatch reads them (src/sbatch/opt.c _get_argument, Slurm
    17.11+): blanks split, ' and " quote, a backslash escapes, an unquoted # ends the line."""
    words, word, quote, escape, started = [], "", "", False, False
    for c in line.removeprefix("#SBATCH"):
        if escape:
            word, escape, started = word + c, False, True
        elif c == "\\":
            escape = True
        elif quote:
            quote, word = ("", word) if c == quote else (quote, word + c)
        elif c in "'\"":
            quote, started = c, True
        elif c == "#":
            break
        elif c.isspace():
            words, word, started = (words + [word], "", False) if started else (words, word, False)
        else:
            word, started = word + c, True
    assert not quote, f"unmatched {quote} in {line!r}"
    return words + [word] if started else words


def test_render_writes_each_option_into_the_header_plan_and_manifest(tmp_path):
    assert _render(tmp_path, *OPTIONS) == 0
    run = next((tmp_path / "runs").iterdir())
    header = _header((run / runfiles.SBATCH).read_text())
    assert [line for line in header if line in HEADER] == HEADER
    assert header.index(HEADER[-1]) < len(header)  # all inside the one #SBATCH block
    scheduling = read_decision(run).scheduling
    assert (scheduling.account, scheduling.qos, scheduling.reservation) == (
        "proj_a", "high", "maint_1")  # fmt: skip
    assert scheduling.constraint == "a100&ib" and scheduling.exclude == "node[3-4],node7"
    assert scheduling.extra == ["--mail-type=END", "--comment=nightly #3", "--hold"]
    assert scheduling.set_by["account"] == "ACCOUNT"
    assert scheduling.set_by["extra"] == "SBATCH_EXTRA"
    overrides = json.loads((run / runfiles.MANIFEST).read_text())["overrides"]
    assert overrides["sbatch"]["qos"] == "high"


def test_each_header_line_reads_back_as_one_sbatch_word(tmp_path):
    assert _render(tmp_path, '--sbatch-extra=--comment="it\'s a#b" --mail-user=me@x.org') == 0
    run = next((tmp_path / "runs").iterdir())
    words = [sbatch_words(line) for line in _header((run / runfiles.SBATCH).read_text())]
    assert ["--comment=it's a#b"] in words and ["--mail-user=me@x.org"] in words
    assert all(len(w) == 1 for w in words), words
    for value in ("/runs/a\\b", "/runs/it's", "/runs/#1"):  # paths: a backslash is escaped
        assert sbatch_words(f"#SBATCH --output={sbatch_value(value)}") == [f"--output={value}"]


def test_the_word_reader_sees_what_an_unquoted_hash_or_quote_does():
    """The reader above can fail: unquoted, a # cuts the value and a ' opens a quote."""
    assert sbatch_words("#SBATCH --comment=a#b") == ["--comment=a"]
    assert sbatch_words(f"#SBATCH {sbatch_value('--comment=a#b')}") == ["--comment=a#b"]
    with pytest.raises(AssertionError, match="unmatched"):
        sbatch_words("#SBATCH --output=/runs/it's/x")


REFUSED = [
    (["--account= "], "ACCOUNT=' ' is blank"),
    (["--qos=hi gh"], "QOS='hi gh' is not a Slurm QOS name"),
    (["--account=proj\n#SBATCH --uid=0"], "ACCOUNT='proj\\n#SBATCH --uid=0' contains a newline"),
    (["--exclude=n1;reboot"], "EXCLUDE='n1;reboot' is not a Slurm node list"),
    (["--exclude=node[01-"], "EXCLUDE='node[01-' is not a Slurm host list"),
    (["--exclude=node[05-03],gpu7"], "EXCLUDE='node[05-03],gpu7' is not a Slurm host list"),
    (["--exclude=node1,,node2"], "write e.g. EXCLUDE=node[03-05],gpu7"),
    (["--sbatch-extra=--nodelist=gpu[1-"], "SBATCH_EXTRA --nodelist='gpu[1-' is not a Slurm host"),
    (["--reservation=a b"], "RESERVATION='a b' is not a Slurm reservation name"),
    (["--constraint=a100 ib"], "CONSTRAINT='a100 ib' is not a Slurm node feature"),
    (["--time=2 hours"], "TIME='2 hours' is not a Slurm time"),
    (["--time=1:00:00\n#SBATCH --uid=0"], "TIME="),
    (["--sbatch-extra=--nodes=3"], "SBATCH_EXTRA: --nodes is not passed through; use NODES="),
    (
        ["--sbatch-extra=--output=x"],
        "--output is not passed through; vitpod sets it: vitpod writes Slurm's output",
    ),
    (["--sbatch-extra=--requeue"], "vitpod sets it: the profile's preemption.requeue"),
    (["--sbatch-extra=--signal=USR1@60"], "the profile's preemption: block"),
    (["--sbatch-extra=--ntasks-per-node=1"], "the profile's node_types fields"),
    (["--sbatch-extra=--account=x"], "use ACCOUNT="),
    (
        ["--sbatch-extra=--mail-typ=END"],
        "--mail-typ is not an sbatch option; did you mean --mail-type?",
    ),
    (["--sbatch-extra=-A proj"], "SBATCH_EXTRA: '-A' is not a long sbatch option"),
    (["--sbatch-extra=--comment"], "--comment needs a value"),
    (["--sbatch-extra=--hold=1"], "--hold takes no value"),
    (["--sbatch-extra=--comment='a"], 'SBATCH_EXTRA="--comment=\'a": No closing quotation'),
    (["--sbatch-extra=--comment=a\nb"], "SBATCH_EXTRA='--comment=a\\nb' contains a newline"),
    (["--sbatch-extra=--comment=a\\\\b"], "no double quote or backslash"),
    (["--sbatch-extra=--hold --hold"], "--hold is given twice"),
    (["--sbatch-extra=  "], "SBATCH_EXTRA='  ' is blank"),
]


@pytest.mark.parametrize(("options", "expected"), REFUSED)
def test_a_bad_option_is_one_error_naming_the_variable_and_nothing_is_written(
    tmp_path, capsys, options, expected
):
    assert _render(tmp_path, *options) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err, err
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_profile_without_slurm_refuses_options_it_would_ignore(tmp_path):
    with pytest.raises(ConfigError, match=r"ACCOUNT, SBATCH_EXTRA: profile local has no Slurm"):
        plan_job(Request(cluster="local", run_root=str(tmp_path),
                         slurm=SbatchOptions(account="a", extra="--hold")))  # fmt: skip


def test_a_pipeline_takes_every_stage_options_and_the_fine_tunes_win(tmp_path):
    chain = Chain("dgxpod", "volo_d1", offline=True, run_root=str(tmp_path / "runs"),
                  slurm={"account": "proj_a", "qos": "high", "extra": "--mail-type=END"},
                  finetune_slurm={"account": "proj_b", "extra": {"mail_type": "FAIL"}})  # fmt: skip
    written = chain.render()
    pre, fine = (_header(written[s].read_text()) for s in ("pretrain", "finetune"))
    assert "#SBATCH --account=proj_a" in pre and "#SBATCH --mail-type=END" in pre
    assert "#SBATCH --account=proj_b" in fine and "#SBATCH --qos=high" in fine
    assert "#SBATCH --mail-type=FAIL" in fine and "#SBATCH --mail-type=END" not in fine
    set_by = read_decision(written["finetune"].parent).scheduling.set_by
    assert set_by == {"account": "FT_ACCOUNT", "qos": "QOS", "extra": "FT_SBATCH_EXTRA"}


def test_a_pipeline_names_the_fine_tunes_variable_and_unknown_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"^FT_QOS=' ' is blank"):
        Chain("dgxpod", "volo_d1", offline=True, run_root=str(tmp_path),
              finetune_slurm={"qos": " "}).plan()  # fmt: skip
    with pytest.raises(ConfigError, match=r"\['acount'\]: unknown; valid keys: account, qos"):
        Chain("dgxpod", "volo_d1", offline=True, slurm={"acount": "x"})
    with pytest.raises(ConfigError, match="FT_SBATCH_EXTRA: --time is not passed through; "
                                          "use FT_TIME="):  # fmt: skip
        Chain("dgxpod", "volo_d1", offline=True, run_root=str(tmp_path),
              finetune_slurm={"extra": ["--time=1:00:00"]}).plan()  # fmt: skip


def test_make_pipeline_passes_the_ft_variables_to_the_fine_tune(tmp_path):
    out, _ = make_pipeline_offline(tmp_path, "CLUSTER=dgxpod", "MODEL=volo_d1", "OFFLINE=1",
                                   "ACCOUNT=proj_a", "FT_RESERVATION=maint_1",
                                   "SBATCH_EXTRA=--comment='two words'")  # fmt: skip
    assert out.returncode == 0, out.stderr
    scripts = {Path(line.split(": ", 1)[1]).parent.name: Path(line.split(": ", 1)[1])
               for line in out.stdout.splitlines() if line.endswith("job.sbatch")}  # fmt: skip
    pre, fine = (_header(scripts[s].read_text()) for s in ("pretrain", "finetune"))
    assert "#SBATCH --account=proj_a" in fine and '#SBATCH "--comment=two words"' in pre
    assert "#SBATCH --reservation=maint_1" in fine
    assert not any("--reservation" in line for line in pre)


def test_make_refuses_an_ft_variable_for_one_stage():
    out = make("render", "FT_QOS=high", timeout=60)
    assert out.returncode != 0 and "FT_QOS set the fine-tune of make pipeline" in out.stderr


SUBMITTING = {  # every command that submits a job: its parser
    "render/preflight/submit": lambda: cli.stage_parser("submit"),
    "pipeline": chain_cli.build_parser,
    "scaling": scaling.build_parser,
    "token-labels": labels.build_parser,
    "calibrate": calibrate.build_parser,
    "doctor": doctor_cli.build_parser,
    "resume": resume_parser,
}


@pytest.mark.parametrize("command", sorted(SUBMITTING))
def test_every_command_that_submits_takes_the_one_set_of_options(command):
    ns = SUBMITTING[command]().parse_args(["--run", "r"] if command == "resume" else [])
    names = ["time", "account", "qos", "reservation", "constraint", "exclude", "sbatch_extra"]
    assert all(getattr(ns, name) == "" for name in names), command
    if command == "pipeline":  # the fine-tune's own, FT_...
        assert all(getattr(ns, f"finetune_{name}") == "" for name in names)


def test_make_scaling_time_reaches_every_points_script(tmp_path):
    env, calls = recording_slurm(tmp_path)
    out = make("scaling", "CLUSTER=dgxpod", "MODEL=volo_d1", "GPUS=8 16", "TIME=00:20:00",
               "OFFLINE=1", "ACCOUNT=proj_a", runs=tmp_path / "runs", env=env,
               timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    study = next((tmp_path / "runs" / "studies").iterdir())
    for point in json.loads((study / runfiles.STUDY).read_text())["points"]:
        header = _header((study / point["run_dir"] / runfiles.SBATCH).read_text())
        assert "#SBATCH --time=00:20:00" in header and "#SBATCH --account=proj_a" in header
        decision = read_decision(study / point["run_dir"])
        assert decision.resources.time == "00:20:00", point["run_dir"]
    assert not calls.exists()  # OFFLINE: Slurm not asked


def test_time_reaches_the_label_array_and_the_calibration(tmp_path):
    teacher = tmp_path / "teacher.pt"
    teacher.write_bytes(b"weights")
    job = labels.prepare(
        "localslurm", "volo_tiny", teacher=str(teacher), time="00:07:00", run_root=str(tmp_path)
    )  # a bare weights file: not opened here
    assert "#SBATCH --time=00:07:00" in _header(job.script)
    ns = calibrate.build_parser().parse_args(["--cluster", "localslurm", "--time", "0:09:00",
                                              "--run-root", str(tmp_path)])  # fmt: skip
    plan, _ = calibrate.prepare(ns)
    assert "#SBATCH --time=0:09:00" in _header(plan.script)
    with pytest.raises(ConfigError, match="TIME='soon' is not a Slurm time"):
        calibrate.prepare(calibrate.build_parser().parse_args(["--cluster", "localslurm",
                                                               "--time", "soon"]))  # fmt: skip


def test_resume_keeps_the_runs_options_and_time_unless_given(tmp_path):
    assert _render(tmp_path, "--account=proj_a", "--sbatch-extra=--mail-type=END",
                   "--time=0:45:00") == 0  # fmt: skip
    run = next((tmp_path / "runs").iterdir())
    assert resume_request(run, "1").slurm.account == "proj_a"
    header = _header(plan_resume(run, "1").script)
    assert "#SBATCH --account=proj_a" in header and "#SBATCH --mail-type=END" in header
    assert "#SBATCH --time=0:45:00" in header  # the run's own TIME, not the partition's
    given = SbatchOptions(qos="high", names={"qos": "QOS"})
    header = _header(plan_resume(run, "1", given, "2:00:00").script)
    assert {"#SBATCH --time=2:00:00", "#SBATCH --qos=high", "#SBATCH --account=proj_a"} <= set(
        header
    )


def test_resume_excludes_the_nodes_that_hung_twice(tmp_path):
    """RUN/exclude-nodes (the watchdog's, docs/hangs.md) reaches the resumed job's --exclude,
    merged with EXCLUDE given or recorded; a node listed twice is excluded once."""
    assert _render(tmp_path, "--exclude=node9") == 0
    run = next((tmp_path / "runs").iterdir())
    assert "#SBATCH --exclude=node9" in _header(plan_resume(run, "1").script)
    (run / "exclude-nodes").write_text("node2\nnode2\n")
    assert "#SBATCH --exclude=node9,node2" in _header(plan_resume(run, "1").script)
    given = SbatchOptions(exclude="node2", names={"exclude": "EXCLUDE"})
    assert "#SBATCH --exclude=node2" in _header(plan_resume(run, "1", given).script)


def _stub_sbatch(tmp_path: Path, monkeypatch, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "sbatch"
    record = f'cat > "{tmp_path}/stdin"; echo "$*" > "{tmp_path}/argv"'
    stub.write_text(f"#!/bin/bash\n{record}\n{body}\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "stdin"


def test_preflight_asks_sbatch_test_only_about_the_rendered_script(tmp_path, monkeypatch):
    plan = plan_job(Request(cluster="localslurm", model="volo_tiny", run_root=str(tmp_path),
                            slurm=SbatchOptions(reservation="maint_1")))  # fmt: skip
    said = "sbatch: Job 7 to start at 2030-01-01T00:00:00 using 4 processors on nodes node1"
    stdin = _stub_sbatch(tmp_path, monkeypatch, f'echo "{said}" >&2')
    assert slurmchecks.check_test_only(plan.spec, plan.script) == [
        f"sbatch --test-only accepts the script ({said.removeprefix('sbatch: ')})"
    ]
    assert stdin.read_text() == plan.script and (tmp_path / "argv").read_text() == "--test-only\n"


def test_a_test_only_refusal_names_the_options_given(tmp_path, monkeypatch):
    plan = plan_job(Request(cluster="localslurm", model="volo_tiny", run_root=str(tmp_path),
                            slurm=SbatchOptions(reservation="maint_1")))  # fmt: skip
    _stub_sbatch(tmp_path, monkeypatch,
                 'echo "sbatch: error: Batch job submission failed: Requested reservation is '
                 'invalid" >&2; exit 1')  # fmt: skip
    with pytest.raises(ConfigError, match=r"^sbatch --test-only refuses the job script: sbatch: "
                       r"error: .*reservation is invalid; fix what it names \(RESERVATION="
                       r"maint_1 given here, or the profile\)$"):  # fmt: skip
        slurmchecks.check_test_only(plan.spec, plan.script)
