"""`make profile NAME=mysite` / `vitpod profile`: discover a site's profile; `--check` one."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vitpod.node.probe import NOT_FOUND
from vitpod.workflows.errors import ConfigError
from vitpod.workflows.site import discover
from vitpod.workflows.site.profile import (
    NODE_FIELDS,
    Profile,
    load_profile,
    read_yaml,
    resolve_path,
)
from vitpod.workflows.site.profile_check import disagreements
from vitpod.workflows.site.profile_files import (
    DEFAULT_USER_PROFILES,
    USER_PROFILES_ENV,
    bundled_profiles,
    profile_path,
    user_profile_dir,
)
from vitpod.workflows.site.profile_writer import (
    Discovered,
    node_type,
    partition_entry,
    type_name,
)
from vitpod.workflows.site.schema import describe

STAGES = ("pretrain", "finetune")
# findmnt FSTYPEs of file systems every node shares (storage paths on others are reported).
SHARED_FS = {"lustre", "nfs", "nfs4", "gpfs", "wekafs", "beegfs", "cifs", "ceph", "fuse.weka",
             "panfs", "virtiofs", "9p"}  # fmt: skip
# Keys discovery decides; a --base profile gives every other (storage, env, container, mpi ...).
DISCOVERED_KEYS = {"name", "description", "scheduler", "partitions", "node_types", "nodes",
                   "backend", *NODE_FIELDS}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vitpod.workflows profile", description=__doc__)
    p.add_argument("--name", default="", help="the new profile's name (NAME=)")
    p.add_argument("--partitions", default="", help="pretrain[,finetune] partitions (PARTITIONS=)")
    p.add_argument("--out", default="", help="file to write (default: NAME.yaml in "
                   f"${USER_PROFILES_ENV}, else {DEFAULT_USER_PROFILES})")  # fmt: skip
    p.add_argument("--base", default="", help="profile whose site settings (storage, env, "
                   "container, mpi, exclusive, preemption, python) the new one copies")  # fmt: skip
    p.add_argument("--python", default="", help="interpreter of the ranks (no container)")
    p.add_argument("--run-root", default="", help="storage.runs")
    p.add_argument("--data", default="", help="storage.data (shared path of the data sets)")
    p.add_argument("--storage-hca", default="", help="HCAs that serve storage, e.g. mlx5_4,mlx5_5")
    p.add_argument("--tasks-per-node", type=int, default=None, help="ranks a CPU-only node runs")
    p.add_argument("--check", default="", help="compare this profile with what the nodes report")
    p.add_argument("--args", default="", help="more of these flags, shell-quoted (make ARGS=)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.args:
        ns = parser.parse_args([*argv, *shlex.split(ns.args)])
    return ns


def words(text: str) -> list[str]:
    return [w for w in text.replace(",", " ").split() if w]


def stage_partitions(site: dict[str, discover.PartitionInfo], asked: list[str]) -> list[str]:
    """[pretrain partition, finetune partition]: PARTITIONS=, else Slurm's default partition."""
    chosen = asked or [p.name for p in site.values() if p.default][:1]
    if not chosen:
        raise ConfigError("PARTITIONS: Slurm has no default partition; name one or two")
    unknown = [p for p in chosen if p not in site]
    if unknown or len(chosen) > 2:
        raise ConfigError(f"PARTITIONS={','.join(asked)}: give one or two of {sorted(site)}")
    return [chosen[0], chosen[-1]]


def probe_paths(ns: argparse.Namespace, base: dict[str, Any]) -> list[str]:
    storage = base.get("storage") or {}
    paths = [ns.data or storage.get("data") or "data", ns.run_root or storage.get("runs") or "runs"]
    return [str(resolve_path(p)) for p in paths] + ["/tmp"]


def discover_site(
    ns: argparse.Namespace, partitions: list[str], base: dict[str, Any],
    site: dict[str, discover.PartitionInfo] | None = None,
) -> Discovered:  # fmt: skip
    """Slurm's facts, then one probe per node type of the chosen partitions."""
    site = site if site is not None else discover.site()
    found = Discovered()
    kinds: dict[tuple[object, ...], str] = {}
    storage = set(words(ns.storage_hca))
    python = ns.python or base.get("python") or sys.executable
    for stage, name in zip(STAGES, stage_partitions(site, partitions), strict=True):
        part = site[name]
        groups = discover.node_types(part)
        if not groups:
            raise ConfigError(f"PARTITIONS: partition {name} has no nodes")
        nodes = max(groups, key=len)
        if len(groups) > 1:
            found.unknown.append(f"partitions: {name} has {len(groups)} kinds of node; "
                                 f"profiled the most common ({nodes[0].name}'s)")  # fmt: skip
        if nodes[0].kind not in kinds:
            key = type_name(nodes, set(found.node_types))
            kinds[nodes[0].kind] = key
            found.facts[key] = probe_one(name, nodes, probe_paths(ns, base), python, found)
            found.node_types[key] = node_type(
                nodes, found.facts[key], storage, ns.tasks_per_node, found.unknown
            )
        found.partitions[stage] = partition_entry(part, kinds[nodes[0].kind], found.unknown)
        found.max_minutes[stage] = part.max_minutes
    shared_storage(site, found, probe_paths(ns, base)[1:2] + [code_dir(base)])
    return found


def code_dir(base: dict[str, Any]) -> str:
    return str(resolve_path((base.get("storage") or {}).get("code") or "."))


def shared_storage(site: dict[str, discover.PartitionInfo], found: Discovered,
                   paths: list[str]) -> None:  # fmt: skip
    """Whether every usable node of the chosen partitions sees the run root and the code dir as
    one file system: a file written there on one node, read on the others (per partition)."""
    names = dict.fromkeys(p["name"] for p in found.partitions.values())
    missed: dict[str, list[str]] = {p: [] for p in paths}
    tested = False
    for name in names:
        nodes = [n.name for n in site[name].nodes if n.usable]
        if len(nodes) < 2:
            continue
        tested = True
        for path in paths:
            missed[path] += [f"{path} on {n} (written on {nodes[0]})"
                             for n in discover.unseen(name, nodes, path)]  # fmt: skip
    if not tested:
        return
    found.shared_paths = [p for p in dict.fromkeys(paths) if not missed[p]]
    unseen = [m for p in dict.fromkeys(paths) for m in missed[p]]
    if unseen:
        found.unknown.append(f"storage: not shared: a file written there was not seen at "
                             f"{'; '.join(unseen)}; point storage.runs and storage.code at the "
                             "shared file system")  # fmt: skip
    if found.shared_paths:  # the marker says more than the type of the mount did
        ok = found.shared_paths
        found.unknown = [u for u in found.unknown if not any(f": {p} is on " in u for p in ok)]
        found.shared_note = (f"{' and '.join(ok)}: a file written on one node was read on "
                             f"the others of {', '.join(names)} (shared_paths)")  # fmt: skip


def probe_one(partition: str, nodes: list[discover.NodeInfo], paths: list[str], python: str,
              found: Discovered) -> dict[str, Any]:  # fmt: skip
    usable = [n for n in nodes if n.usable]
    if not usable:
        raise ConfigError(f"partition {partition}: no usable node to probe ({nodes[0].state})")
    facts = discover.run_probe(partition, usable[0], paths, python=python)
    node = usable[0].name
    if facts.get("pyxis") is not True or facts.get("enroot") == NOT_FOUND:
        found.unknown.append(f"{node}: pyxis {_pyxis(facts.get('pyxis'))}, enroot "
                             f"{facts.get('enroot')}: containers cannot run there")  # fmt: skip
    for path, fstype in dict(facts.get("fstype") or {}).items():
        if fstype not in SHARED_FS and path != "/tmp":
            found.unknown.append(f"{node}: {path} is on {fstype}, not a shared file system "
                                 "type; check every node sees the same files there")  # fmt: skip
    return facts


def profile_dict(ns: argparse.Namespace, found: Discovered, base: dict[str, Any]) -> dict[str, Any]:
    site_keys = {k: v for k, v in base.items() if k not in DISCOVERED_KEYS}
    storage = dict(site_keys.pop("storage", None) or {"data": "data"})
    if not (ns.data or base.get("storage")):
        found.unknown.append("storage.data: not known; wrote 'data' (pass --data or --base)")
    storage.update({k: v for k, v in (("data", ns.data), ("runs", ns.run_root)) if v})
    if found.shared_paths is not None:  # what the nodes showed, not what the base profile says
        storage.pop("shared", None)
        storage["shared_paths"] = found.shared_paths
    gpus = any(t["gpus_per_node"] for t in found.node_types.values())
    out: dict[str, Any] = {
        "name": ns.name,
        "description": f"discovered by vitpod profile on {dt.date.today().isoformat()}",
        "scheduler": "slurm",
        "partitions": found.partitions,
        "node_types": found.node_types,
        "storage": storage,
        "backend": "nccl" if gpus else "gloo",
        **site_keys,
    }
    if ns.python:
        out["python"] = ns.python
    return out


def header(found: Discovered, partitions: list[str]) -> str:
    lines = [
        f"# Discovered by `vitpod profile` at {dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%MZ}"
        f" from partition(s) {', '.join(dict.fromkeys(partitions))} (one probe job per node type).",
        "# fabric: conservative PLACEHOLDERS, not measurements: run `make calibrate CLUSTER=<this "
        "file>` next;",
        "# the topology choice then uses the measured fit (<name>.calibration.json beside it).",
    ]
    for key, facts in found.facts.items():
        fs = ", ".join(f"{p} {t}" for p, t in dict(facts.get("fstype") or {}).items())
        pyxis = _pyxis(facts.get("pyxis"))
        lines.append(f"# {key} (probed on {facts.get('node')}): pyxis {pyxis}, "
                     f"enroot {facts.get('enroot') or NOT_FOUND}; file systems: {fs}")  # fmt: skip
    if found.shared_note:
        lines.append(f"# shared storage: {found.shared_note}")
    lines += ["# Not determined (check these):"] if found.unknown else []
    unknown = dict.fromkeys(found.unknown)
    return "\n".join([*lines, *(f"#   - {u}" for u in unknown)]) + "\n"


def _pyxis(value: Any) -> str:
    return {True: "loaded", False: "not loaded"}.get(value, str(value))  # type: ignore[call-overload]


def write_new(path: Path, text: str) -> None:
    """Write `text` to a new file; refuse (naming it) when the path exists, nothing half-written."""
    if path.exists():
        raise ConfigError(f"--out: {path} exists; never overwritten: pick another NAME or --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.link(tmp, path)  # fails if the path appeared meanwhile
    except FileExistsError:
        raise ConfigError(f"--out: {path} exists; never overwritten") from None
    finally:
        os.unlink(tmp)


# A profile's name (Profile.name) and its file name: checked before anything asks the cluster.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def create(ns: argparse.Namespace) -> Path:
    if not ns.name:
        raise ConfigError("NAME: give the new profile's name, e.g. make profile NAME=mysite")
    if not _NAME.match(ns.name):
        raise ConfigError(
            f"NAME={ns.name!r}: a profile name is letters, digits, '_', '.' and '-' (no '/', "
            "not starting with '.'); pick one such as NAME=mysite (--out chooses the file)"
        )
    if not ns.out and ns.name in bundled_profiles():
        raise ConfigError(f"NAME={ns.name}: a bundled profile has that name (yours would hide "
                          "it); pick another NAME")  # fmt: skip
    out = Path(ns.out).expanduser() if ns.out else user_profile_dir() / f"{ns.name}.yaml"
    if out.exists():
        raise ConfigError(f"--out: {out} exists; never overwritten: pick another NAME or --out")
    base = read_yaml(profile_path(ns.base), "--base profile") if ns.base else {}
    asked = words(ns.partitions)
    found = discover_site(ns, asked, base)
    data = profile_dict(ns, found, base)
    try:
        Profile.model_validate(data)
    except ValidationError as exc:
        raise describe(exc, "discovered profile (nothing written)") from None
    names = [p["name"] for p in found.partitions.values()]
    write_new(
        out,
        header(found, names)
        + yaml.safe_dump(data, sort_keys=False, width=100, default_flow_style=None),
    )
    load_profile(str(out))  # the file as written reads back
    for line in dict.fromkeys(found.unknown):
        print(f"not determined: {line}")
    return out


def check(ns: argparse.Namespace) -> int:
    profile = load_profile(ns.check)
    site = discover.site()
    names = {s: p.name for s, p in profile.partitions.items()}
    lines = [f"partitions.{s}.name: profile {n}, Slurm has no such partition ({sorted(site)})"
             for s, n in names.items() if n not in site]  # fmt: skip
    asked = [n for s, n in sorted(names.items(), key=lambda i: STAGES.index(i[0])) if n in site]
    # ranks a CPU-only node runs is a choice, not a fact the nodes report
    ns.tasks_per_node = ns.tasks_per_node or profile.node_type(STAGES[0]).tasks_per_node
    if asked:
        found = discover_site(ns, asked, {"storage": profile.storage.model_dump()}, site)
        lines += disagreements(profile, found)
    for line in lines:
        print(line)
    print(f"{len(lines)} disagreement(s) between {ns.check} and the nodes")
    return 1 if lines else 0


def main(argv: list[str]) -> int:
    ns = parse(argv)
    if ns.check:
        return check(ns)
    path = create(ns)
    mine = path.resolve() == (user_profile_dir() / f"{ns.name}.yaml").resolve()
    cluster = ns.name if mine else path
    print(f"wrote {path}; next: make calibrate CLUSTER={cluster} and make preflight "
          f"CLUSTER={cluster}")  # fmt: skip
    print(path)
    return 0
