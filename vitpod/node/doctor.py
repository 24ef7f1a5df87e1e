"""On each node: GPU health, InfiniBand links, free space, the image; exit 1 if bad (stdlib)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

try:
    from vitpod.node.probe import NOT_FOUND, infiniband_ports, tool
except ImportError:  # run by path on a node without vitpod installed: probe.py is beside it
    from probe import NOT_FOUND, infiniband_ports, tool  # type: ignore[import-not-found,no-redef]

PREFIX = "vitpod-doctor: "
CHUNK = 512  # characters of JSON a line
BAD = 1
ENROOT_PATHS = {  # enroot's defaults (github.com/NVIDIA/enroot doc/configuration.md)
    "ENROOT_RUNTIME_PATH": "${XDG_RUNTIME_DIR}/enroot",
    "ENROOT_CACHE_PATH": "${XDG_CACHE_HOME}/enroot",
    "ENROOT_DATA_PATH": "${XDG_DATA_HOME}/enroot",
}
ENROOT_CONF = Path(os.environ.get("ENROOT_SYSCONF_PATH", "/etc/enroot")) / "enroot.conf"
_XID = re.compile(r"NVRM: Xid.*")


def check(name: str, status: str, detail: str) -> dict[str, str]:
    return {"check": name, "status": status, "detail": detail}


def gpu_checks(expected: int) -> list[dict[str, str]]:
    """GPU count, uncorrectable ECC errors (nvidia-smi -q -d ECC) and Xid events (dmesg)."""
    listing = tool(["nvidia-smi", "-L"])
    if listing == NOT_FOUND:
        if expected:
            return [check("gpu", "bad", f"nvidia-smi not found; the profile expects {expected}")]
        return [check("gpu", "skipped", "no GPU tools (nvidia-smi not found)")]
    found = sum(line.startswith("GPU ") for line in listing.splitlines())
    out = [check("gpu count", "ok" if found >= expected else "bad",
                 f"{found} GPU(s), profile expects {expected}")]  # fmt: skip
    ecc = volatile_uncorrectable(tool(["nvidia-smi", "-q", "-d", "ECC"]))
    out.append(check("gpu ecc", "bad" if ecc else "ok", f"{ecc} volatile uncorrectable error(s)"))
    dmesg = tool(["dmesg"])
    if dmesg == NOT_FOUND or dmesg.startswith("failed"):
        out.append(check("gpu xid", "skipped", "dmesg not readable"))
    else:
        xids = _XID.findall(dmesg)
        out.append(check("gpu xid", "bad" if xids else "ok", xids[-1] if xids else "no Xid"))
    return out


def volatile_uncorrectable(text: str) -> int:
    """Sum of the 'Uncorrectable'/'Total' counts in the Volatile blocks of nvidia-smi -q -d ECC."""
    total, volatile = 0, False
    for line in text.splitlines():
        label = line.strip()
        if label.startswith(("Volatile", "Aggregate")):
            volatile = label.startswith("Volatile")
        match = re.search(r"(Uncorr\w*|Total)\s*:\s*(\d+)", label)
        if volatile and match and ("Uncorr" in label):
            total += int(match.group(2))
    return total


def ib_checks(hcas: list[str]) -> list[dict[str, str]]:
    """Each HCA:port the binding uses must be ACTIVE; skipped without InfiniBand or HCAs."""
    ports = {f"{p['device']}:{p['port']}": p for p in infiniband_ports()}
    if not ports:
        return [check("infiniband", "skipped", "no InfiniBand devices")]
    if not hcas:
        return [check("infiniband", "skipped", f"the profile binds no HCA ({len(ports)} ports)")]
    out = []
    for hca in hcas:
        port = ports.get(hca)
        state = port["state"] if port else NOT_FOUND
        ok = state.endswith("ACTIVE")
        out.append(check(f"infiniband {hca}", "ok" if ok else "bad", f"state {state}"))
    return out


def enroot_info() -> dict[str, str]:
    """The paths `enroot info` resolves (its config file, with the environment's overrides)."""
    out = {}
    for line in tool(["enroot", "info"]).splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in ENROOT_PATHS:
            out[key] = value
    return out


def enroot_conf() -> dict[str, str]:
    conf = {}
    if ENROOT_CONF.is_file():
        for line in ENROOT_CONF.read_text().splitlines():
            key, _, value = line.strip().partition(" ")
            if key in ENROOT_PATHS and value.strip():
                conf[key] = value.strip()
    return conf


def enroot_paths() -> dict[str, str]:
    """ENROOT_*_PATH: the environment's, else as `enroot info` resolves them, else enroot.conf's
    or enroot's defaults; variables left in them are expanded (${SLURMD_NODENAME}: per node)."""
    conf = enroot_info() or enroot_conf()
    # enroot's own rule: a variable in the environment overrides its configuration file
    conf.update({k: os.environ[k] for k in ENROOT_PATHS if os.environ.get(k)})
    home = os.path.expanduser("~")
    env = {"XDG_RUNTIME_DIR": f"/run/user/{os.getuid()}", "XDG_CACHE_HOME": f"{home}/.cache",
           "XDG_DATA_HOME": f"{home}/.local/share", **os.environ}  # fmt: skip
    out = {}
    for key, default in ENROOT_PATHS.items():
        raw = conf.get(key) or default
        out[key] = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), raw)
    return out


def free_bytes(path: str) -> tuple[str, int]:
    """Free bytes of the file system that holds `path` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return str(probe), shutil.disk_usage(probe).free


def disk_checks(paths: dict[str, str], min_free: float) -> list[dict[str, str]]:
    out = []
    for name, path in paths.items():
        where, free = free_bytes(path)
        status = "ok" if free >= min_free else "bad"
        out.append(check(f"disk {name}", status, f"{path} ({where}): {free / 2**30:.2f} GiB free, "
                         f"need {min_free / 2**30:.2f} GiB"))  # fmt: skip
    return out


def image_check(image: str) -> dict[str, str]:
    """A .sqsh must exist and `unsquashfs -s` read it; a registry ref is imported at start."""
    if not image:
        return check("image", "skipped", "the profile has no container")
    if "#" in image or not image.startswith(("/", ".")):
        return check("image", "skipped", f"{image}: a registry image; enroot imports it at start")
    if not Path(image).is_file():
        return check("image", "bad", f"{image}: no such file")
    read = tool(["unsquashfs", "-s", image])
    if read == NOT_FOUND:
        return check("image", "ok", f"{image} exists (unsquashfs not found: not read)")
    ok = not read.startswith("failed")
    return check("image", "ok" if ok else "bad", f"{image}: {read.strip().splitlines()[0][:160]}")


def run_checks(ns: argparse.Namespace) -> list[dict[str, str]]:
    out = gpu_checks(ns.gpus) + ib_checks([h for h in ns.hcas.split(",") if h])
    paths = {"run root": ns.run_root, "/tmp": "/tmp"}
    if shutil.which("enroot") or any(k in os.environ for k in ENROOT_PATHS) or ns.image:
        paths.update(enroot_paths())
    out += disk_checks(paths, ns.min_free_gb * 2**30)
    out.append(image_check(ns.image))
    return out


def record_lines(node: str, checks: list[dict]) -> list[str]:
    """The node's checks as JSON cut into short numbered lines: srun forwards a line over
    1 KiB in pieces, which interleave with the other nodes' output."""
    text = json.dumps(checks, sort_keys=True)
    chunks = [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    return [f"{PREFIX}{node} {i}/{len(chunks)} {c}" for i, c in enumerate(chunks)]


def read_records(lines: list[str]) -> dict[str, list[dict]]:
    """node -> checks, from record_lines' output of every node (in any interleaving)."""
    parts: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for line in lines:
        if line.startswith(PREFIX):
            node, where, chunk = (line[len(PREFIX) :].split(" ", 2) + [""])[:3]
            index, count = map(int, where.split("/"))
            parts.setdefault(node, {})[index] = chunk
            counts[node] = count
    return {
        node: json.loads("".join(got[i] for i in range(counts[node])))
        for node, got in parts.items()
        if len(got) == counts[node]
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vitpod.node.doctor", description=__doc__)
    p.add_argument("--gpus", type=int, default=0, help="GPUs the profile expects a node")
    p.add_argument("--hcas", default="", help="HCA:port list the binding uses")
    p.add_argument("--run-root", default="/tmp", help="where runs are written")
    p.add_argument("--image", default="", help="the profile's container image")
    p.add_argument("--min-free-gb", type=float, default=5.0, help="free space each path needs")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    checks = run_checks(ns)
    for c in checks:
        print(f"doctor: {node}: {c['status']}: {c['check']}: {c['detail']}", flush=True)
    for line in record_lines(node, checks):
        print(line, flush=True)
    return BAD if any(c["status"] == "bad" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
