"""A wheel install beside the PyPI projects `trainer` and `workflows` keeps every name apart."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# Unrelated PyPI projects whose import names our top-level folders used to install under.
NAMESAKES = ("trainer", "workflows")

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Venv:
    root: Path
    elsewhere: Path  # a working directory outside the repository

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def site_packages(self) -> Path:
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        out = subprocess.run([self.python, "-c", code], capture_output=True, text=True, check=True)
        return Path(out.stdout.strip()).resolve()

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a program of this venv from outside the repository, without our PYTHONPATH
        (which would import vitpod from the checkout)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return subprocess.run(
            list(argv), capture_output=True, text=True, cwd=self.elsewhere, env=env, timeout=600
        )

    def json(self, code: str, *args: str) -> Any:
        """What `code` (json imported) prints as JSON, run by this venv's python."""
        done = self.run(self.python, "-c", "import json\n" + code, *args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def where(self, module: str, *, execute: bool = True) -> Path:
        """The file `import module` loads; execute=False finds it without running it."""
        code = (
            f"import {module}; print({module}.__file__)"
            if execute
            else f"import importlib.util; print(importlib.util.find_spec({module!r}).origin)"
        )
        done = self.run(self.python, "-c", code)
        assert done.returncode == 0, done.stderr
        return Path(done.stdout.strip()).resolve()


def login_node_requirements() -> list[str]:
    """pyproject's own dependency list: what a login node installs (no torch)."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """As test_planner's login-node install does it: a fresh venv, pip with constraints.txt;
    here the PyPI namesakes go in first and vitpod from the checkout, not editable."""
    base = tmp_path_factory.mktemp("install")
    made = Venv(base / "venv", base / "elsewhere")
    made.elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(made.root)], check=True)
    pip = [made.python, "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt")]
    for args in (
        ["--no-deps", *NAMESAKES],
        login_node_requirements(),
        ["--no-deps", str(source_copy(base / "src"))],
    ):
        done = made.run(*pip, *args)
        assert done.returncode == 0, f"pip install {' '.join(args)}:\n{done.stderr}"
    return made


def source_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked or not ignored), without build/ and
    *.egg-info: an in-tree build would leave those in the checkout, and a stale build/lib
    can carry modules that a restructuring removed into the next wheel."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout.split("\0")  # fmt: skip
    for rel in filter(None, listed):
        if (REPO / rel).is_file():  # a file deleted but not yet staged is still listed
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


@pytest.fixture
def shared_torch(venv: Venv):
    """Let the new venv see the test venv's torch for one test: a plain path line in a .pth
    (site does not process the .pth files inside that path, so its editable vitpod finder
    stays off). Removed afterwards, so the other tests see a login node without torch."""
    shared = Path(sysconfig.get_paths()["purelib"]).resolve()
    pth = venv.site_packages / "zz_shared_torch.pth"
    pth.write_text(f"{shared}\n")
    try:
        yield shared
    finally:
        pth.unlink()


def test_render_from_anywhere_writes_a_job_that_runs_our_trainer(venv, tmp_path):
    assert venv.run(venv.python, "-c", "import torch").returncode != 0, "a login node: no torch"
    runs = tmp_path / "runs"
    done = venv.run(
        str(venv.root / "bin" / "vitpod"), "render", "--cluster", "dgxpod",
        "--model", "volo_d5", "--run-root", str(runs),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    scripts = list(runs.glob("*/job.sbatch"))
    assert len(scripts) == 1, f"no job.sbatch under {runs}: {done.stdout}"
    assert "-m vitpod.trainer" in scripts[0].read_text()


def test_the_namesakes_keep_their_names(venv):
    site = venv.site_packages
    for name in NAMESAKES:  # found, not run: the PyPI `trainer` imports torch, not installed
        path = venv.where(name, execute=False)
        assert path.is_relative_to(site), f"import {name} -> {path}, not the PyPI project"
        assert not path.is_relative_to(REPO), f"import {name} -> our checkout: {path}"
        owner = venv.json(
            "import sys; from importlib.metadata import distribution\n"
            "d = distribution(sys.argv[1])\n"
            "print(json.dumps(sorted(str(d.locate_file(f).resolve()) for f in d.files)))",
            name,
        )
        assert str(path) in owner, f"{path} is not a file of the PyPI distribution {name!r}"
    for name in ("vitpod", "vitpod.workflows", "vitpod.trainer"):
        path = venv.where(name)
        assert path.is_relative_to(site / "vitpod"), f"import {name} -> {path}"


def test_the_wheel_installs_one_import_name(venv):
    """Everything the wheel puts on sys.path is under vitpod/ (console scripts go to bin/)."""
    top = venv.json(
        "from importlib.metadata import distribution\n"
        "print(json.dumps(sorted({f.parts[0] for f in distribution('vitpod').files})))"
    )
    assert [t for t in top if t not in ("..", "vitpod") and not t.endswith(".dist-info")] == []


def test_vitpod_train_help_prints_the_usage(venv, shared_torch):
    # The venv sees the shared torch, yet vitpod still comes from its own wheel.
    assert venv.where("vitpod").is_relative_to(venv.site_packages / "vitpod")
    assert venv.where("torch").is_relative_to(shared_torch)
    done = venv.run(str(venv.root / "bin" / "vitpod-train"), "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and "--exchange" in done.stdout, done.stdout


def test_vitpod_train_help_needs_no_torch(venv):
    """--help is argparse only; the launcher should not import torch before parsing."""
    done = venv.run(str(venv.root / "bin" / "vitpod-train"), "--help")
    assert done.returncode == 0, f"vitpod-train --help on a torch-less install:\n{done.stderr}"
    assert done.stdout.startswith("usage:"), done.stdout
