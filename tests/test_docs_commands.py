"""Every documented command as printed: each shell and Python block of README.md and docs/*.md is
extracted and run here, one test per block.

How a block runs (docs/testing.md#documented-commands):
- `make ...` lines run through make in the checkout, `vitpod ...` and `.venv/bin/vitpod ...` lines
  through `python -m vitpod.workflows`, Python blocks in a fresh interpreter.
- A profile of another site (scheduler slurm, name not starting with `local`: dgxpod, h100pod,
  superpod) gets OFFLINE=1 (render, preflight, place, pipeline) or DRY_RUN=1 OFFLINE=1 (pretrain,
  finetune, token-labels, scaling, calibrate): nothing is asked of a Slurm it is not on. Its
  file systems (/lustre/...) are mapped under the test's folder: a copy of the profile in
  $VITPOD_PROFILES (which CLUSTER=<name> finds before the bundled one) and the paths in the
  command point there, with the data set's folders and the image file made empty.
- Runs go to a run root of the test's own (VITPOD_RUN_ROOT). A placeholder (`runs/<run>`,
  `<study dir>`, `/lustre/.../run`, `TEACHER=...`) is a real run: one volo_tiny step on the
  local Slurm, made once.
- A block, or the lines of it starting with a prefix, that cannot run here is marked in the
  doc, before the block: `<!-- not run here: REASON -->`, `<!-- not run here `PREFIX`: REASON
  -->`, `<!-- not run here from `PREFIX`: REASON -->` (that line and the rest of the block); a
  cheap equivalent: `<!-- run here with VAR=V ... `PREFIX`: REASON -->` (added to those lines).
  A marker needs its reason; an unmarked line that cannot run fails with what to do.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, make, submitted, user_env
from vitpod.workflows.site.profile import PROFILE_DIR

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
MARKER = re.compile(
    r"^(?P<kind>not run here|run here with\s+(?P<words>[^`:]+?))"
    r"(?:\s+(?P<from>from\s+)?`(?P<scope>[^`]+)`)?\s*:\s*(?P<reason>\S.*)$",
    re.S,
)
NEVER = {"setup", "test", "lint", "slurm-up", "slurm-down", "container", "bench", "demo"}
"""Targets a test never runs, marked or not: they install, build, restart the shared Slurm,
are the suite itself or train for minutes."""
OFFLINE_TARGETS = {"render", "preflight", "place", "pipeline"}
DRY_TARGETS = {"pretrain", "finetune", "token-labels", "scaling", "calibrate"}
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.")
SITE_ROOTS = ("/lustre/",)
"""Where the bundled profiles of other sites keep data, images and runs: mapped under tmp."""
QUICK_RUN = ("--model vit_small_patch16_224 --img-size 32 --max-steps 1 --epochs 1 "
             "--warmup-epochs 0 --workers 0 --loader torch --no-eval "
             "--checkpoint-every 0")  # fmt: skip
"""One step of a 16-pixel-token ViT: its final/ is a timm folder (volo_tiny's cannot be,
trainer.md) and a token-label teacher (its feature map is img_size/16)."""


@dataclasses.dataclass(frozen=True)
class Marker:
    skip: bool
    words: tuple[str, ...]
    scope: str
    through_end: bool
    reason: str

    def covers(self, line: str, started: bool) -> bool:
        line = " ".join(line.split())  # as the marker's scope was read
        return not self.scope or line.startswith(self.scope) or (self.through_end and started)


@dataclasses.dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    text: str
    markers: tuple[Marker, ...]

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def markers_before(text: str) -> tuple[Marker, ...]:
    """The HTML comments right above a fence (only blank lines between them)."""
    found, tail = [], text.rstrip()
    while tail.endswith("-->") and "<!--" in tail:
        start = tail.rfind("<!--")
        body = " ".join(tail[start + 4 : -3].split())
        tail = tail[:start].rstrip()
        m = MARKER.match(body)
        if m is None:
            continue
        found.append(Marker(skip=m["kind"] == "not run here",
                            words=tuple(shlex.split(m["words"] or "")), scope=m["scope"] or "",
                            through_end=bool(m["from"]), reason=m["reason"].strip()))  # fmt: skip
    return tuple(found)


def is_commands(lang: str, text: str) -> bool:
    """Tagged shell or Python; an untagged block whose lines are make commands."""
    if lang in SHELL or lang == "python":
        return True
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lang == "" and bool(lines) and all(ln.startswith("make ") for ln in lines)


def doc_blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if is_commands(m[1], m[2]):
                line = text.count("\n", 0, m.start()) + 1
                out.append(Block(doc, line, m[1], m[2], markers_before(text[: m.start()])))
    return out


BLOCKS = doc_blocks()


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(the line as printed, its words) for each command of a shell block; `a && b` is two."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    out = []
    for line in joined.splitlines():
        one_word = re.sub(r"<[^>]*>", lambda m: m[0].replace(" ", "_"), line)  # <run or dir>
        lexer = shlex.shlex(one_word, posix=True, punctuation_chars=";&")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word in (";", "&&"):
                if words:
                    out.append((line.strip(), words))
                words = []
            else:
                words.append(word)
    return out


# --------------------------------------------------------------------------- the site


def is_remote(cluster: str) -> bool:
    """A profile of another site: its Slurm is not this machine's."""
    if "/" in cluster or cluster.endswith((".yaml", ".yml")):
        return False
    path = PROFILE_DIR / f"{cluster}.yaml"
    if not path.is_file():
        return False
    data = yaml.safe_load(path.read_text())
    return data["scheduler"] == "slurm" and not cluster.startswith("local")


def local_slurm_used(block: Block) -> bool:
    """Whether a command of the block runs on the local Slurm (the test then joins its group)."""
    if block.lang == "python" or all(m.skip and not m.scope for m in block.markers):
        return False
    for _, words in commands(block):
        if words[0] == "make":
            cluster = next((w.split("=", 1)[1] for w in words if w.startswith("CLUSTER=")), "")
            if cluster.startswith("local") and cluster != "local":
                return True
    return False


def site_path(tmp: Path, path: str) -> str:
    """/lustre/... of another site -> the same path under tmp (everything else as it is)."""
    return str(tmp / "site" / path.lstrip("/")) if path.startswith(SITE_ROOTS) else path


def map_text(tmp: Path, text: str) -> str:
    return re.sub(r"(?<![\w/])/lustre/[^\s'\"]*", lambda m: site_path(tmp, m[0]), text)


def site_profiles(tmp: Path) -> Path:
    """Copies of the other sites' profiles, their /lustre paths under tmp, and what the
    preflight reads there (the data set's train/val folders, empty; the image file)."""
    folder = tmp / "profiles"
    folder.mkdir()
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        if not is_remote(path.stem):
            continue
        data = yaml.safe_load(path.read_text())
        storage = data["storage"]
        for key in ("data", "runs", "code"):
            if key in storage:
                storage[key] = site_path(tmp, storage[key])
        for split in ("train", "val"):
            Path(storage["data"], split).mkdir(parents=True, exist_ok=True)
        container = data.get("container") or {}
        if container:
            container["image"] = site_path(tmp, container["image"])
            Path(container["image"]).parent.mkdir(parents=True, exist_ok=True)
            Path(container["image"]).touch()
            for mount in container.get("mounts", []):
                mount["src"], mount["dst"] = (site_path(tmp, mount[k]) for k in ("src", "dst"))
                if mount["src"].startswith("/"):
                    Path(mount["src"]).mkdir(parents=True, exist_ok=True)
        (folder / path.name).write_text(yaml.safe_dump(data, sort_keys=False))
    return folder


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> tuple[Path, dict[str, str]]:
    """The test's folder and the environment every command runs in. The other sites' data set is
    two digits images (one a class) with TokenLabeling's published labels where the recipes and
    docs/token-labels.md read them; their image a real (empty) squashfs."""
    from tests.test_published_token_labels import write_published

    tmp = tmp_path_factory.mktemp("docs")
    env = {"VITPOD_RUN_ROOT": str(tmp / "runs"), "VITPOD_PROFILES": str(site_profiles(tmp))}
    for data in (tmp / "site").rglob("imagenet"):
        for image in [next((digits_dir / "train" / c).iterdir()) for c in ("0", "1")]:
            (data / "train" / image.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(image, data / "train" / image.parent.name / image.name)
        for labels in (data / "token_label_data", tmp / "site/lustre/fsw/token_label_data"):
            write_published(data, labels, grid=(14, 14))
    empty = tmp / "empty"
    empty.mkdir()
    for image in (tmp / "site").rglob("*.sqsh"):
        image.unlink()
        subprocess.run(["mksquashfs", str(empty), str(image), "-quiet", "-no-progress"],
                       check=True, capture_output=True)  # fmt: skip
    return tmp, env


@pytest.fixture(scope="module")
def finished_run(site, local_slurm, localslurm_data) -> Path:
    """What `runs/<run>` stands for: a finished run (one volo_tiny step on one local node)."""
    _, env = site
    done = make("pretrain", "CLUSTER=localslurm", "MODEL=volo_tiny", "NODES=1",
                f"ARGS={QUICK_RUN}", env=env)  # fmt: skip
    job, run = submitted(done)
    state = local_slurm.wait(job, timeout=300)
    assert state == "COMPLETED", (state, [p.read_text()[-2000:] for p in run.glob("logs/*")])
    return run


# --------------------------------------------------------------------------- running a block


def fill(value: str, var: str, block: Block, run: Path | None, last: Path | None = None) -> str:
    """A placeholder value -> the finished run (`<that ...>`, `<rendered ...>`: the run or
    pipeline directory the line above printed); anything else as printed."""
    if not PLACEHOLDER.search(value):
        return value
    if value.startswith(("<that", "<rendered")):
        assert last is not None, f"{block.where}: {var}={value}: the line above printed no path"
        return str(last)
    assert run is not None and var in ("RUN", "STUDY", "FINETUNE_FROM", "TEACHER"), (
        f"{block.where}: {var}={value}: no stand-in for this placeholder here; mark the line "
        "<!-- not run here `make ...`: why -->"
    )
    return str(run)


def make_argv(line: str, words: list[str], block: Block, tmp: Path, run: Path | None,
              extra: list[str], last: Path | None) -> list[str]:  # fmt: skip
    target, *rest = words[1:]
    variables: dict[str, str] = {}
    assert target not in NEVER, (
        f"{block.where}: `{line}`: make {target} is not run by a test (it changes this machine "
        "or is the suite itself); mark it <!-- not run here `make ...`: why -->"
    )
    for word in [*rest, *extra]:
        if word.startswith("[") and word.endswith("]"):  # an optional variable: given here
            word = word[1:-1]
        name, eq, value = word.partition("=")
        assert eq and re.fullmatch(r"[A-Z_]+", name), (
            f"{block.where}: `{line}`: {word!r} is not VAR=VALUE; make the line runnable as "
            "printed or mark it <!-- not run here `make ...`: why -->"
        )
        variables[name] = map_text(tmp, fill(value, name, block, run, last))
    remote = any(is_remote(variables.get(k, "")) for k in ("CLUSTER", "FT_CLUSTER"))
    if remote:
        assert target in OFFLINE_TARGETS | DRY_TARGETS | {"status", "list", "cancel"}, (
            f"{block.where}: `{line}`: make {target} on another site's profile cannot run "
            "here; mark it <!-- not run here `make ...`: why -->"
        )
        if target in OFFLINE_TARGETS | DRY_TARGETS:
            variables.setdefault("OFFLINE", "1")
        if target in DRY_TARGETS:
            variables.setdefault("DRY_RUN", "1")
    return [target, *(f"{k}={v}" for k, v in variables.items())]


def printed_dir(stdout: str) -> Path | None:
    """The directory a command's last line ends with (a script's folder, or the folder)."""
    lines = stdout.strip().splitlines()
    path = Path(lines[-1].split()[-1]) if lines and lines[-1].split() else None
    if path is None or not path.is_absolute() or not path.exists():
        return None
    return path if path.is_dir() else path.parent


def cancel_jobs_under(root: Path) -> None:
    """scancel what a documented command queued (the job's script lies under `root`): the test
    checks the commands, not the training."""
    if shutil.which("squeue") is None:
        return
    said = subprocess.run(["squeue", "-h", "-o", "%i|%o"], capture_output=True, text=True)
    ids = [i for i, _, cmd in (ln.partition("|") for ln in said.stdout.splitlines())
           if cmd.startswith(str(root))]  # fmt: skip
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def run_shell(block: Block, site: tuple[Path, dict[str, str]], run: Path | None) -> int:
    tmp, env = site
    try:
        return _run_shell(block, tmp, env, run)
    finally:
        cancel_jobs_under(tmp)


def _run_shell(block: Block, tmp: Path, env: dict[str, str], run: Path | None) -> int:
    ran, started, last = 0, False, None
    for line, words in commands(block):
        covering = [m for m in block.markers if m.covers(line, started)]
        started = started or any(m.through_end for m in covering)
        if any(m.skip for m in covering):
            continue
        extra = [w for m in covering if not m.skip for w in m.words]
        if words[0] == "make":
            argv = make_argv(line, words, block, tmp, run, extra, last)
            done = make(*argv, env=env, timeout=240)
        elif words[0] in ("vitpod", ".venv/bin/vitpod"):
            argv = [map_text(tmp, fill(w, "", block, run, last)) for w in words[1:]]
            done = subprocess.run([sys.executable, "-m", "vitpod.workflows", *argv], cwd=REPO,
                                  env=user_env(env=env), capture_output=True, text=True,
                                  timeout=240)  # fmt: skip
        else:
            pytest.fail(f"{block.where}: `{line}` is neither make nor vitpod; make it one or "
                        "mark it <!-- not run here `...`: why -->")  # fmt: skip
        assert done.returncode == 0, (
            f"{block.where}: `{line}` ran as {argv} and exited {done.returncode}:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
        last = printed_dir(done.stdout) or last
        ran += 1
    return ran


def run_python(block: Block, site: tuple[Path, dict[str, str]], run: Path | None) -> int:
    tmp, env = site
    lines, started = [], False
    for line in block.text.splitlines():
        covering = [m for m in block.markers if m.covers(line, started)]
        started = started or any(m.through_end for m in covering)
        if not any(m.skip for m in covering):
            lines.append(line)
    source = "\n".join(lines)
    if run is not None:
        source = re.sub(r"(?:[\w./-]*/)?runs/<[^>]*>", str(run), source)
    done = subprocess.run([sys.executable, "-c", map_text(tmp, source)], cwd=REPO,
                          env=user_env(env=env), capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, f"{block.where}:\n{source}\n{done.stderr[-3000:]}"
    return 1


def needs_run(block: Block) -> bool:
    return bool(re.search(r"=\S*<(?!that)|/\.\.\./|=\.\.\.(\s|$)|runs/<", block.text))


def marked_whole(block: Block) -> bool:
    """The doc says the whole block is not run here (and why): it is no test case, not a skip,
    so that CI (tests/ci_skips.py fails skips) and a local run judge it alike."""
    return any(m.skip and not m.scope for m in block.markers)


def test_every_marker_says_why():
    for block in BLOCKS:
        for marker in block.markers:
            assert len(marker.reason) > 10, f"{block.where}: a marker must say why: {marker}"
    assert len([b for b in BLOCKS if not marked_whole(b)]) >= 10, "most blocks must run"


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.where, marks=[pytest.mark.slurm] if local_slurm_used(b) or needs_run(b)
                  else []) for b in BLOCKS if not marked_whole(b)],
)  # fmt: skip
def test_documented_block_runs_as_printed(block, site, request):
    run = request.getfixturevalue("finished_run") if needs_run(block) else None
    if local_slurm_used(block):
        request.getfixturevalue("local_slurm")
    if block.lang == "python":
        ran = run_python(block, site, run)
    else:
        ran = run_shell(block, site, run)
    assert ran, f"{block.where}: every line is marked; mark the block instead"


def test_every_block_is_found_and_markers_parse():
    """The extraction itself: the README's blocks are there, and a marker above a fence is read
    with its scope (a marker the pattern does not read would silently not apply)."""
    readme = [b for b in BLOCKS if b.doc.name == "README.md"]
    assert len(readme) >= 7 and any(b.lang == "python" for b in readme)
    text = "x\n<!-- not run here from `run.plan()`: it asks dgxpod's Slurm -->\n\n"
    (marker,) = markers_before(text)
    assert marker.skip and marker.through_end and marker.scope == "run.plan()"
    (mapped,) = markers_before("<!-- run here with DRY_RUN=1 `make scaling`: a study trains -->")
    assert not mapped.skip and mapped.words == ("DRY_RUN=1",) and mapped.scope == "make scaling"
    for doc in DOCS:
        for comment in re.findall(r"<!--(.*?)-->", doc.read_text(), re.S):
            if "run here" in comment:
                assert MARKER.match(" ".join(comment.split())), f"{doc}: unreadable: {comment}"


def test_make_help_lists_one_variable_per_line():
    """`make help`: each variable the Makefile accepts on a line of its own, with what it does."""
    out = make("help").stdout.splitlines()
    valid = re.search(r"^VALID_VARS := (.*)$", (REPO / "Makefile").read_text(), re.M)[1]
    slurm = re.search(r"^SLURM_VARS := (.*)$", (REPO / "Makefile").read_text(), re.M)[1]
    names = set(valid.replace("$(SLURM_VARS)", slurm).split())
    rows = [ln.strip() for ln in out if re.match(r"^  [A-Z_]+=", ln)]
    listed = [re.match(r"[A-Z_]+", r)[0] for r in rows]
    assert sorted(listed) == sorted(names)  # each once
    assert all(len(re.findall(r"(?<![\w-])[A-Z_]{3,}=", r.split("  ")[0])) == 1 for r in rows)


def test_readme_layout_lists_every_make_target():
    """The README's Layout names every target the Makefile declares (`make submit` was missing)."""
    makefile = (REPO / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY:(.*?)(?<!\\)$", makefile, re.M | re.S)[1].split()) - {"\\"}
    line = re.search(r"^Makefile +(.*)$", (REPO / "README.md").read_text(), re.M)[1]
    assert sorted(phony - {"help"} - set(line.split())) == []


def test_a_profile_in_the_user_folder_is_found_by_name(tmp_path):
    """CLUSTER=<name> finds a profile in $VITPOD_PROFILES before a bundled one of that name."""
    env = {"VITPOD_PROFILES": str(tmp_path / "p"), "VITPOD_RUN_ROOT": str(tmp_path / "runs")}
    (tmp_path / "p").mkdir()
    data = yaml.safe_load((PROFILE_DIR / "localslurm.yaml").read_text())
    (tmp_path / "p" / "mysite.yaml").write_text(yaml.safe_dump({**data, "name": "mysite"}))
    done = make("render", "CLUSTER=mysite", "MODEL=volo_tiny", env=env)
    assert done.returncode == 0, done.stderr
    manifest = Path(done.stdout.strip().splitlines()[-1]).parent / "manifest.json"
    assert json.loads(manifest.read_text())["profile"]["name"] == "mysite"
    gone = make("render", "CLUSTER=nosuch", env=env)
    assert gone.returncode == 2 and "mysite" in gone.stderr and str(tmp_path / "p") in gone.stderr
