"""Gradient topology per run: the cost model's choice from the profile's fabric, or --topology."""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vitpod.analysis.calibrate import Calibration, apply, load_for_profile
from vitpod.analysis.commcost import TRAINER_TOPOLOGY, Choice, choose
from vitpod.analysis.fabric import Fabric
from vitpod.registry import models, runfiles

# Gradients are fp32 in DDP buckets: 4 bytes a parameter.
GRAD_BYTES_PER_PARAM = 4
TRAINER_CHOICES = ("ring", "ps")


@dataclass(frozen=True)
class TopologyDecision:
    """What goes into the run manifest and the log."""

    topology: str
    """The trainer's --topology value (ring|ps)."""
    algorithm: str
    """The modelled algorithm behind it (ring, hierarchical, tree, ps_colocated, ps_dedicated)."""
    predicted_s: float
    """Predicted communication seconds per optimizer step."""
    reason: str
    source: str
    """'cost model' or 'override (--topology in ARGS)'."""
    grad_bytes: int
    ranks: int
    costs: dict[str, float] = field(default_factory=dict)
    fabric_source: str = "profile fabric"
    """Which numbers priced it: 'profile fabric' or 'calibration of DATE, job ID'."""

    def log_line(self) -> str:
        return (
            f"topology: {self.topology} ({self.algorithm}, {self.source}), predicted "
            f"{self.predicted_s * 1e3:.3g} ms of communication per step ({self.fabric_source}): "
            f"{self.reason}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def grad_bytes(model: str, num_classes: int = 1000, img_size: int = 224) -> int:
    """Gradient bytes of one optimizer step for a model name (the registry's count; no torch)."""
    try:
        return models.param_count(model, img_size, num_classes) * GRAD_BYTES_PER_PARAM
    except ValueError as exc:
        raise ValueError(f"{exc} (the topology cost model needs its parameter count)") from None


def as_fabric(fabric: Fabric | Mapping[str, Any] | Any) -> Fabric:
    """A Fabric from the profile's `fabric:` block (a mapping, a pydantic model, or a Fabric)."""
    if isinstance(fabric, Fabric):
        return fabric
    if hasattr(fabric, "model_dump"):
        fabric = fabric.model_dump(exclude_none=True)
    return Fabric.from_mapping(fabric)


def topology_override(args: str | Sequence[str]) -> str | None:
    """The --topology value given in ARGS, or None (also None for 'auto')."""
    tokens = shlex.split(args) if isinstance(args, str) else list(args)
    value = None
    for i, tok in enumerate(tokens):
        if tok == "--topology":
            if i + 1 >= len(tokens):
                raise ValueError("ARGS: --topology needs a value: ring, ps or auto")
            value = tokens[i + 1]
        elif tok.startswith("--topology="):
            value = tok.split("=", 1)[1]
    if value is not None and value not in (*TRAINER_CHOICES, "auto"):
        raise ValueError(f"ARGS: --topology {value!r} is not one of ring, ps, auto")
    return None if value == "auto" else value


def decide(
    fabric: Fabric | Mapping[str, Any] | Any,
    model: str,
    nodes: int,
    gpus: int | None = None,
    args: str | Sequence[str] = (),
    ps_servers: int | None = None,
    num_classes: int = 1000,
    img_size: int = 224,
    calibration: Calibration | None = None,
) -> TopologyDecision:
    """Choose ring or parameter server for `gpus` ranks on `nodes` nodes; --topology wins.

    With a `calibration` (vitpod.analysis.calibrate, from `make calibrate`) the fitted latencies and
    bandwidths replace the profile's, and each algorithm is priced per optimizer step as the
    trainer measures it (`commcost.costs` with the backend: DDP buckets, per-call overhead,
    only what the calibrated backend runs); without one, the profile's numbers price one
    exchange.
    """
    fab = as_fabric(fabric)
    nbytes = grad_bytes(model, num_classes, img_size)
    source = "profile fabric"
    backend = None
    if calibration is not None:
        fab = apply(fab, calibration)
        source = calibration.label
        backend = calibration.backend
    choice = choose(fab, nbytes, nodes, ps_servers=ps_servers, gpus=gpus, backend=backend)
    ranks = gpus or nodes * fab.gpus_per_node
    forced = topology_override(args)
    if forced is None:
        return TopologyDecision(
            choice.topology, choice.name, choice.predicted_s, choice.reason, "cost model",
            nbytes, ranks, dict(choice.costs), source,
        )  # fmt: skip
    # The cheapest modelled algorithm the forced trainer topology can run.
    algos = {a: t for a, t in choice.costs.items() if TRAINER_TOPOLOGY[a] == forced}
    algorithm = min(algos, key=algos.__getitem__)
    reason = f"--topology {forced} given in ARGS; the cost model would choose {choice.topology}"
    return TopologyDecision(
        forced, algorithm, algos[algorithm], reason, "override (--topology in ARGS)",
        nbytes, ranks, dict(choice.costs), source,
    )  # fmt: skip


def calibration_for(profile_file: str | Path, partition: str | None = None) -> Calibration | None:
    """The fit `make calibrate` stored beside this profile file, or None (also when it measured
    another partition than `partition`).

    A stored fit that cannot be read raises analysis.calibrate.CalibrationError (a ValueError)
    naming the file: a broken fit is not silently replaced by the profile's numbers."""
    return load_for_profile(profile_file, partition)


def with_topology(args: Sequence[str], decision: TopologyDecision) -> list[str]:
    """Trainer arguments that run the decision (a --topology ring|ps in ARGS is kept).

    The flags are the cost model's own (`Choice.trainer_flags`: the colocated parameter server
    it prices has every rank serve, so --ps-servers = ranks, also when ARGS forced ps); a
    --ps-servers in ARGS wins.
    """
    tokens = list(args)
    choice = Choice(decision.algorithm, decision.predicted_s, decision.reason)
    flags = choice.trainer_flags(decision.ranks)
    if any(t == "--ps-servers" or t.startswith("--ps-servers=") for t in tokens):
        flags = flags[:2]  # --topology VALUE only
    if any(t == "--topology" or t.startswith("--topology=") for t in tokens):
        forced = topology_override(tokens)
        if forced is not None:
            # A forced ps priced as the colocated server still needs its --ps-servers.
            return [*tokens, *flags[2:]] if forced == decision.topology else tokens
        tokens = _drop_topology(tokens)
    return [*tokens, *flags]


def _drop_topology(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
        elif tok == "--topology":
            skip = True
        elif not tok.startswith("--topology="):
            out.append(tok)
    return out


def _comm_by_step(run_dir: Path) -> dict[int, list[float]]:
    """Each timed (non-warmup) step's communication seconds on every rank."""
    steps: dict[int, list[float]] = {}
    for path in sorted((Path(run_dir) / runfiles.METRICS).glob("rank*.jsonl")):
        for index, line in enumerate(path.read_text().splitlines()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "step" and not rec.get("warmup", False):
                step = int(rec.get("step", index))  # the trainer always writes it
                steps.setdefault(step, []).append(float(rec["time"]["comm"]))
    return steps


def measured_comm_s(run_dir: Path) -> float | None:
    """Median communication seconds per step the trainer measured (non-warmup steps, all ranks)."""
    values = [v for per_rank in _comm_by_step(run_dir).values() for v in per_rank]
    return statistics.median(values) if values else None


def measured_exchange_s(run_dir: Path) -> dict[str, float] | None:
    """The trainer's comm time split into the exchange itself and waiting for peers.

    A rank's comm clock starts when its gradient bucket is ready, so a rank that finishes its
    backward pass early also counts the wait for the slowest rank (load imbalance, not the
    network). The rank that arrives last waits for nobody: per step, the minimum over ranks is
    the exchange alone, which is what the cost model (and `make calibrate`'s benchmark, timed
    the same way) predicts. Returns the medians over steps of: `exchange_s` (min over ranks),
    `mean_s` (mean over ranks, what the scaling report shows) and `wait_s` (their difference).
    """
    steps = _comm_by_step(run_dir)
    if not steps:
        return None
    mins = [min(v) for v in steps.values()]
    means = [statistics.fmean(v) for v in steps.values()]
    return {
        "exchange_s": statistics.median(mins),
        "mean_s": statistics.median(means),
        "wait_s": statistics.median(m - x for m, x in zip(means, mins, strict=True)),
        "steps": float(len(steps)),
    }


def compare(decision: TopologyDecision, run_dir: Path) -> dict[str, float | None]:
    """Predicted vs measured communication per step, and measured / predicted."""
    measured = measured_comm_s(run_dir)
    ratio = measured / decision.predicted_s if measured and decision.predicted_s > 0 else None
    return {"predicted_s": decision.predicted_s, "measured_s": measured, "ratio": ratio}
