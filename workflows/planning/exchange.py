"""The gradient exchange, ring or parameter server, per job: the cost model's choice from the
fabric, or the flags' (--exchange). Not the hardware binding: that is workflows/site/binding.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vitpod.analysis.calibrate import Calibration, apply, load_for_profile
from vitpod.analysis.commcost import TRAINER_EXCHANGE, choose
from vitpod.analysis.fabric import Fabric
from vitpod.registry import models
from vitpod.registry.decision import Costs, Engine

# Gradients are fp32 in DDP buckets: 4 bytes a parameter.
GRAD_BYTES_PER_PARAM = 4
TRAINER_CHOICES = ("ring", "ps")


def grad_bytes(model: str, num_classes: int = 1000, img_size: int = 224) -> int:
    """Gradient bytes of one optimizer step for a model name (the registry's count; no torch)."""
    try:
        return models.param_count(model, img_size, num_classes) * GRAD_BYTES_PER_PARAM
    except ValueError as exc:
        raise ValueError(f"{exc} (the exchange cost model needs its parameter count)") from None


def as_fabric(fabric: Fabric | Mapping[str, Any] | Any) -> Fabric:
    """A Fabric from the profile's `fabric:` block (a mapping, a pydantic model, or a Fabric)."""
    if isinstance(fabric, Fabric):
        return fabric
    if hasattr(fabric, "model_dump"):
        fabric = fabric.model_dump(exclude_none=True)
    return Fabric.from_mapping(fabric)


def choose_engine(
    fabric: Fabric | Mapping[str, Any] | Any,
    model: str,
    nodes: int,
    *,
    gpus: int,
    exchange: str = "auto",
    ps_servers: int | None = None,
    num_classes: int = 1000,
    img_size: int = 224,
    calibration: Calibration | None = None,
) -> tuple[Engine, Costs]:
    """Ring or parameter server for `gpus` ranks on `nodes` nodes, priced by the cost model.

    `exchange` is the trainer's parsed --exchange: ring or ps is kept (priced as the cheapest
    algorithm it can run), auto takes the cheapest of all. With a `calibration` (from
    `make calibrate`) the fitted latencies and bandwidths replace the profile's, and each
    algorithm is priced per optimizer step as the trainer measures it (DDP buckets, per-call
    overhead, only what the calibrated backend runs); without one, the profile's numbers price
    one exchange.
    """
    fab = as_fabric(fabric)
    nbytes = grad_bytes(model, num_classes, img_size)
    priced_by, backend = "profile fabric", None
    if calibration is not None:
        fab = apply(fab, calibration)
        priced_by, backend = calibration.label, calibration.backend
    choice = choose(fab, nbytes, nodes, gpus=gpus, backend=backend)
    if exchange == "auto":
        algorithm, source, reason = choice.name, "cost model", choice.reason
    else:
        algos = {a: s for a, s in choice.costs.items() if TRAINER_EXCHANGE[a] == exchange}
        algorithm = min(algos, key=algos.__getitem__)
        source = "flags"
        reason = f"--exchange {exchange} given; the cost model would choose {choice.exchange}"
    name = TRAINER_EXCHANGE[algorithm]
    # The colocated parameter server the model prices has every rank serve a shard.
    servers = ps_servers or (gpus if algorithm == "ps_colocated" else 1)
    engine = Engine.model_validate(
        {"name": name, "ps_servers": servers if name == "ps" else None, "source": source,
         "reason": reason}
    )  # fmt: skip
    costs = Costs(
        algorithm=algorithm, predicted_comm_s=choice.costs[algorithm], grad_bytes=nbytes,
        per_algorithm_s=dict(choice.costs), priced_by=priced_by,
    )  # fmt: skip
    return engine, costs


def calibration_for(profile_file: str | Path, partition: str | None = None) -> Calibration | None:
    """The fit `make calibrate` stored beside this profile file, or None (also when it measured
    another partition than `partition`).

    A stored fit that cannot be read raises analysis.calibrate.CalibrationError (a ValueError)
    naming the file: a broken fit is not silently replaced by the profile's numbers."""
    return load_for_profile(profile_file, partition)
