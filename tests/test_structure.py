"""The package's shape: no import cycles, arrows one way, small modules, one argv parser."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Source folder -> the import name it has (pyproject's [tool.setuptools.package-dir]).
FOLDERS = {
    "vitpod": "vitpod",
    "workflows": "vitpod.workflows",
    "trainer": "vitpod.trainer",
    "analysis": "vitpod.analysis",
    "registry": "vitpod.registry",
    "templates": "vitpod.templates",
}

# Each area and the areas it must never import (by any import: top-level, lazy, TYPE_CHECKING).
FORBIDDEN = {
    "vitpod.trainer": ("vitpod.workflows", "vitpod.analysis"),
    "vitpod.analysis": ("vitpod.workflows", "vitpod.trainer"),
    "vitpod.registry": ("vitpod.workflows", "vitpod.trainer", "vitpod.analysis"),
    "vitpod.templates": ("vitpod",),
    "vitpod.node": ("vitpod.workflows", "vitpod.analysis"),
}

SIDES = ("vitpod.trainer", "vitpod.workflows")
"""Each side's subpackages (and top-level modules) layer one way: no import cycle among them."""
LOGIN_SIDE = ("vitpod.workflows", "vitpod.analysis", "vitpod.registry", "vitpod.templates")
# The workflows layers, bottom first (docs/workflows.md#layout): each imports only earlier ones.
WORKFLOWS_LAYERS = ("containers", "slurm", "site", "jobs", "watching", "planning", "submit",
                    "pipeline", "studies", "commands")  # fmt: skip
HEAVY = ("torch", "timm", "deepspeed", "nvidia.dali")
"""Node-side libraries: a login node may lack them, and torch alone takes seconds to import."""

MAX_LINES = 400
# The planner resolves the engine and layout into plan.json; every other module reads the plan.
PLANNER = ("workflows/planning/plan.py", "trainer/settings/flags.py")
"""The planner, and the trainer's parser that layers argv over a plan (and refuses an override)."""


def _layout_flags() -> set[str]:
    """The engine and layout flags: the parallel group's, and the batch split over the ranks."""
    from vitpod.registry.trainconfig import TrainConfig
    from vitpod.registry.trainsections import groups

    names = [n for n, g in groups().items() if g == "parallel"]
    names += ["global_batch", "elastic", "accum_steps"]
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    return {"--" + n.replace("_", "-") for n in names} | {
        flag for n in names for flag in fields[n].metadata["flags"] if flag.startswith("--")
    }


LAYOUT_FLAGS = _layout_flags()
# Calls that look a flag up in an argv: argv.index("--tp"), t.startswith("--tp="), ...
ARGV_READERS = {"index", "count", "startswith", "endswith", "remove", "last_value", "_flag_value"}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path  # absolute
    is_package: bool

    @property
    def rel(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    @property
    def package(self) -> str:
        """The package that `from . import x` is relative to."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # "file.py:LINE", what a message points at
    how: str  # "import" or "dynamic" (importlib.import_module / "module:attr" table)
    loads: bool = True  # runs when `source` is imported (not in a function, not TYPE_CHECKING)


def discover() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for folder, prefix in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if "__pycache__" in parts:
                continue
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            modules[name] = Module(name, path, is_package)
    return modules


MODULES = discover()


def _within(name: str, area: str) -> bool:
    return name == area or name.startswith(area + ".")


def _owner(name: str) -> str | None:
    """The longest known module `name` belongs to (`vitpod.x.y.Attr` -> `vitpod.x.y`)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _resolve_from(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: Module, node: ast.AST) -> list[tuple[str, str]]:
    """(imported module, how) for one AST node; non-vitpod names are dropped by the caller."""
    if isinstance(node, ast.Import):
        return [(alias.name, "import") for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _resolve_from(module, node)
        out = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            # `from pkg import mod` imports the submodule; `from pkg import Name` the package.
            out.append((sub if sub in MODULES else base, "import"))
        return out
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        arg = node.args[0] if node.args else None
        if name == "import_module" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [(arg.value, "dynamic")]
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # A lazy dispatch table entry, "vitpod.workflows.watching.status:main", is an import too.
        m = re.fullmatch(r"(vitpod(?:\.\w+)*):\w+", node.value)
        return [(m.group(1), "dynamic")] if m else []
    return []


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
    return name == "TYPE_CHECKING"


def walk_loads(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node, and whether it runs when the module is imported: not in a function's body
    (a call runs it; its decorators and defaults do run) and not under `if TYPE_CHECKING:`."""
    stack: list[tuple[ast.AST, bool]] = [(tree, True)]
    while stack:
        node, loads = stack.pop()
        yield node, loads
        later: list[ast.AST] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            later = list(node.body)
        elif isinstance(node, ast.Lambda):
            later = [node.body]
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            later = list(node.body)
        deferred = {id(n) for n in later}
        stack += [(c, loads and id(c) not in deferred) for c in ast.iter_child_nodes(node)]


def import_edges() -> tuple[list[Edge], list[Edge]]:
    """(imports between vitpod modules, imports of a HEAVY library): every import, top-level,
    in functions and under TYPE_CHECKING, each marked with whether it runs on import."""
    edges, heavy = [], []
    for module in MODULES.values():
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        for node, loads in walk_loads(tree):
            for target, how in _targets(module, node):
                where = f"{module.rel}:{node.lineno}"  # type: ignore[attr-defined]
                if any(_within(target, lib) for lib in HEAVY):
                    heavy.append(Edge(module.name, target, where, how, loads))
                if not _within(target, "vitpod"):
                    continue
                owner = _owner(target)
                if owner is None or owner == module.name:
                    continue
                edges.append(Edge(module.name, owner, where, how, loads))
    return edges, heavy


EDGES, HEAVY_EDGES = import_edges()


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's SCCs with more than one module (a module importing itself is skipped above)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _shortest_path(
    graph: dict[str, set[str]], start: str, goals: set[str], allowed: set[str]
) -> list[str]:
    """start ... the nearest of `goals` (through `allowed` only); [] when none is reached."""
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    reached = start if start in goals else None
    while frontier and reached is None:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & allowed):
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
                    reached = w if reached is None and w in goals else reached
        frontier = nxt
    path: list[str] = []
    node = reached
    while node is not None:
        path.append(node)
        node = previous[node]
    return path[::-1]


def cycles_in(graph: dict[str, set[str]], component: list[str]) -> list[list[str]]:
    """One shortest cycle through each import inside the component, without repeats."""
    members = set(component)
    seen: set[tuple[str, ...]] = set()
    out = []
    for u in component:
        for v in sorted(graph[u] & members):
            cycle = [u, *_shortest_path(graph, v, {u}, members)[:-1]]
            first = cycle.index(min(cycle))
            key = tuple(cycle[first:] + cycle[:first])
            if key not in seen:
                seen.add(key)
                out.append(list(key))
    return out


def _module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for edge in EDGES:
        graph[edge.source].add(edge.target)
    return graph


def _where(source: str, target: str) -> str:
    found = {_label(e) for e in EDGES if (e.source, e.target) == (source, target)}
    return ", ".join(sorted(found))


def _label(edge: Edge) -> str:
    return edge.where + (" (dynamic)" if edge.how == "dynamic" else "")


def test_the_graph_sees_the_package():
    """The walk finds every area, and the import forms it must understand resolve."""
    for area in FOLDERS.values():
        assert area in MODULES, f"{area} not found under {REPO}"
    assert "vitpod.trainer.data" in MODULES and MODULES["vitpod.trainer.data"].is_package
    own = [e for e in EDGES if e.source == "vitpod.trainer.data"]
    assert any(e.target.startswith("vitpod.trainer.data.") for e in own), (
        "a package __init__ importing its own submodules is an edge too"
    )


def test_resolution_of_relative_and_from_imports():
    pkg = Module("vitpod.trainer.data", REPO / "trainer/data/__init__.py", True)
    mod = Module("vitpod.trainer.data.loader", REPO / "trainer/data/loader.py", False)

    def resolve(module: Module, code: str) -> list[str]:
        node = ast.parse(code).body[0]
        return [_owner(t) or t for t, _ in _targets(module, node)]

    assert resolve(mod, "from . import sources") == ["vitpod.trainer.data.sources"]
    assert resolve(mod, "from .sources import Split") == ["vitpod.trainer.data.sources"]
    assert resolve(mod, "from .. import config") == ["vitpod.trainer.config"]
    assert resolve(pkg, "from . import loader") == ["vitpod.trainer.data.loader"]
    assert resolve(pkg, "from .config import DataConfig") == ["vitpod.trainer.data.config"]
    assert resolve(mod, "from vitpod.trainer import dist") == ["vitpod.trainer.dist"]
    assert resolve(mod, "from vitpod.trainer.data import Loader") == ["vitpod.trainer.data"]
    assert resolve(mod, "import vitpod.registry.io") == ["vitpod.registry.io"]


def test_no_import_cycles():
    graph = _module_graph()
    report = []
    for component in strongly_connected(graph):
        report.append(f"cycle group of {len(component)} modules: {', '.join(component)}")
        for cycle in cycles_in(graph, component):
            steps = [
                f"{a} -> {b} [{_where(a, b)}]"
                for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)
            ]
            report.append("  " + " -> ".join([*cycle, cycle[0]]))
            report.extend("      " + step for step in steps)
    assert not report, "import cycles among vitpod modules:\n" + "\n".join(report)


def subpackage(name: str, side: str) -> str:
    """The subpackage or top-level module of `side` that module `name` is in."""
    first = name.removeprefix(side + ".").split(".")[0] if name != side else ""
    return f"{side}.{first}" if first else side


def subpackage_graph(side: str) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[Edge]]]:
    """The side's subpackages, each with those it imports (every import counts), and the module
    imports behind each arrow."""
    graph: dict[str, set[str]] = {subpackage(n, side): set() for n in MODULES if _within(n, side)}
    behind: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for e in EDGES:
        if _within(e.source, side) and _within(e.target, side):
            a, b = subpackage(e.source, side), subpackage(e.target, side)
            if a != b:
                graph[a].add(b)
                behind[a, b].append(e)
    return graph, behind


@pytest.mark.parametrize("side", SIDES)
def test_no_import_cycle_among_subpackages(side):
    """The subpackages layer one way, counting lazy, TYPE_CHECKING and import_module imports: a
    cycle lists every arrow inside its group and the module imports behind each."""
    graph, behind = subpackage_graph(side)
    report = []
    for group in strongly_connected(graph):
        report.append(f"cycle group of {len(group)}: {', '.join(group)}")
        for a in group:
            for b in sorted(graph[a] & set(group)):
                edges = sorted({f"{e.source} -> {e.target} [{_label(e)}]" for e in behind[a, b]})
                shown = ", ".join(edges[:4])
                more = f" and {len(edges) - 4} more" if len(edges) > 4 else ""
                report.append(f"  {a} -> {b}: {shown}{more}")
    assert not report, f"import cycles among {side}'s subpackages:\n" + "\n".join(report)


def load_graph() -> dict[str, set[str]]:
    """What importing each module runs: its imports outside functions and TYPE_CHECKING, and
    its parent packages (importing a.b.c runs a/b/__init__.py first)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for e in EDGES:
        if e.loads:
            graph[e.source].add(e.target)
    for name in MODULES:
        if (parent := name.rpartition(".")[0]) in MODULES:
            graph[name].add(parent)
    return graph


def heavy_loads(area: str) -> list[str]:
    """Each module of `area` whose import loads a HEAVY library, through any vitpod module
    (the trainer's too): the chain of imports and the line that imports the library."""
    graph = load_graph()
    loaders: dict[str, list[Edge]] = defaultdict(list)
    for e in HEAVY_EDGES:
        if e.loads:
            loaders[e.source].append(e)
    found = []
    for name in sorted(n for n in MODULES if _within(n, area)):
        if path := _shortest_path(graph, name, set(loaders), set(MODULES)):
            first = loaders[path[-1]][0]
            found.append(f"{' -> '.join(path)} -> {first.target} [{_label(first)}]")
    return found


def test_workflows_subpackages_import_only_the_layers_below():
    graph, behind = subpackage_graph("vitpod.workflows")
    names = {f"vitpod.workflows.{layer}": i for i, layer in enumerate(WORKFLOWS_LAYERS)}
    packages = {n for n in graph if MODULES[n].is_package and n != "vitpod.workflows"}
    assert packages <= set(names), f"not in WORKFLOWS_LAYERS: {sorted(packages - set(names))}"
    upward = sorted(
        f"{a} -> {b}: {e.source} -> {e.target} [{_label(e)}]"
        for a in names
        for b in graph.get(a, ())
        if b in names and names[b] > names[a]
        for e in behind[a, b][:1]
    )
    assert not upward, "imports up the layers (docs/workflows.md#layout):\n" + "\n".join(upward)


@pytest.mark.parametrize("area", (*LOGIN_SIDE, "vitpod.node"))
def test_login_side_modules_load_no_torch(area):
    """Importing a login-side module loads no torch, timm, DeepSpeed or DALI (a function that
    needs one imports it in its body, where it runs on a node)."""
    found = heavy_loads(area)
    assert not found, f"importing these {area} modules loads {'/'.join(HEAVY)}:\n" + "\n".join(
        found
    )


def test_the_graph_tells_what_an_import_runs():
    """Function bodies and TYPE_CHECKING blocks do not run on import; module-level try/if and
    class bodies do; a parent package's __init__ runs before its module."""
    source = (
        "import a\n"
        "try:\n    import b\nexcept ImportError:\n    b = None\n"
        "if TYPE_CHECKING:\n    import c\nelse:\n    import d\n"
        "def f():\n    import g\n"
        "class K:\n    import h\n    def m(self):\n        import i\n"
    )
    loads = {
        alias.name: runs
        for node, runs in walk_loads(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert loads == {"a": True, "b": True, "c": False, "d": True, "g": False, "h": True,
                     "i": False}  # fmt: skip
    assert subpackage("vitpod.trainer.data.loader", "vitpod.trainer") == "vitpod.trainer.data"
    assert subpackage("vitpod.trainer.train", "vitpod.trainer") == "vitpod.trainer.train"
    # The trainer's data package loads torch (its loader module): so does importing any module
    # in it, as a login-side module would, whatever the module itself imports.
    assert "vitpod.trainer.data" in load_graph()["vitpod.trainer.data.digits"]
    chains = heavy_loads("vitpod.trainer.data.digits")
    assert chains and chains[0].startswith("vitpod.trainer.data.digits -> vitpod.trainer.data ->")


@pytest.mark.parametrize("area", sorted(FORBIDDEN))
def test_imports_point_the_allowed_way(area):
    wrong = sorted(
        f"{e.source} -> {e.target} [{e.where}{' dynamic' if e.how == 'dynamic' else ''}]"
        for e in EDGES
        if _within(e.source, area)
        and not _within(e.target, area)
        and any(_within(e.target, banned) for banned in FORBIDDEN[area])
    )
    assert not wrong, f"{area} must not import {', '.join(FORBIDDEN[area])}:\n" + "\n".join(wrong)


def test_no_module_is_over_the_line_limit():
    long = sorted(
        (n, m.rel)
        for m in MODULES.values()
        if (n := len(m.path.read_text().splitlines())) > MAX_LINES
    )
    listing = "\n".join(f"{rel}: {n} lines" for n, rel in reversed(long))
    assert not long, f"modules over {MAX_LINES} lines:\n{listing}"


def _is_flag(node: ast.AST) -> bool:
    if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
        return False
    return node.value.partition("=")[0] in LAYOUT_FLAGS


def argv_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, flag) of each engine or layout flag looked up in an argv: compared with a token
    (== / in), or passed to a lookup call (index, startswith, last_value, ...). Composing a
    command and naming a flag in a message are not reads."""
    found = []
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ARGV_READERS:
                operands = list(node.args)
        found += [(n.lineno, n.value) for n in operands if _is_flag(n)]  # type: ignore[attr-defined]
    return sorted(found)


def test_only_the_planner_reads_engine_and_layout_flags_from_argv():
    """Everyone else reads the plan (plan.json's engine, layout and trainer settings)."""
    found = []
    for module in MODULES.values():
        if module.rel in PLANNER:
            continue
        for line, flag in argv_reads(ast.parse(module.path.read_text())):
            found.append(f"{module.rel}:{line}: {flag!r}")
    assert not found, f"engine/layout flags read from argv outside {PLANNER}:\n" + "\n".join(found)


def test_the_flag_search_sees_reads_and_not_commands_or_messages():
    assert {"--tp", "--exchange", "--topology", "--global-batch", "--deepspeed", "--elastic"} <= (
        LAYOUT_FLAGS
    )
    source = (
        "def f(argv, t, v):\n"
        '    """argv.index("--tp") in a docstring is prose."""\n'
        '    g = argv[argv.index("--global-batch") + 1]\n'
        '    ok = t == "--exchange" or t.startswith("--ps-servers=") or "--fsdp" in argv\n'
        '    cmd = ["--tp", str(v), "--elastic"]\n'
        '    return g, ok, cmd, f"--pp {v}: too many stages", last_value(argv, "--deepspeed")\n'
    )
    assert argv_reads(ast.parse(source)) == [
        (3, "--global-batch"),
        (4, "--exchange"),
        (4, "--fsdp"),
        (4, "--ps-servers="),
        (6, "--deepspeed"),
    ]


def test_every_module_opens_with_a_one_line_summary():
    missing = []
    for module in MODULES.values():
        body = ast.parse(module.path.read_text()).body
        first = body[0] if body else None
        text = (
            first.value.value
            if isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
            else None
        )
        if text is None:
            missing.append(f"{module.rel}: no module docstring")
        elif not text.splitlines() or not text.splitlines()[0].strip():
            missing.append(f"{module.rel}: the docstring's first line is empty")
    assert not missing, "modules without a one-line docstring:\n" + "\n".join(missing)


def test_every_source_package_is_packaged():
    """A folder split out of a module must reach the wheel: pyproject lists every package."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packaged = set(config["packages"])
    on_disk = {m.name for m in MODULES.values() if m.is_package}
    assert on_disk - packaged == set(), "packages missing from pyproject [tool.setuptools]"
    mapped = {name: REPO / folder for name, folder in config["package-dir"].items()}
    for folder, prefix in FOLDERS.items():
        if prefix != "vitpod":
            assert mapped.get(prefix) == REPO / folder, f"package-dir does not map {prefix}"


JOB_IDS = {"job_id", "job_ids"}
JOB_FACTS = {"state", "restarts", "run_dir", "step", "total", "exit_code"}
VIEWS = ("run_status", "Target", "list_entries", "Chain")
"""make status, the follow view, vitpod list and the Chain: each defined where it is."""


def _fields(node: ast.ClassDef) -> set[str]:
    return {t.target.id for t in node.body
            if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}  # fmt: skip


def test_a_jobs_state_is_one_type_that_status_follow_list_and_the_chain_use():
    """No second class holds a job's ids with its state, restarts, run directory or progress
    (there were four: StageStatus, follow's Row, jobctl's Part, the chain's StageRecord). JobInfo
    is one poll's answer about one job id, which JobState takes in."""
    holders, uses = [], {}
    for module in MODULES.values():
        if not module.name.startswith("vitpod.workflows"):
            continue
        tree = ast.parse(module.path.read_text())
        nodes = list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.ClassDef) and node.name != "JobInfo":
                fields = _fields(node)
                if fields & JOB_IDS and fields & JOB_FACTS:
                    holders.append(f"{module.rel}:{node.lineno} {node.name} {sorted(fields)}")
        named = {n.id for n in nodes if isinstance(n, ast.Name)}
        for node in nodes:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in VIEWS:
                uses[f"{module.rel} {node.name}"] = "JobState" in named
    assert [h.split()[1] for h in holders] == ["JobState"], "\n".join(holders)
    assert {u.split()[1] for u in uses} >= set(VIEWS) and all(uses.values()), uses
