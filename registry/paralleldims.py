"""One parallel-dims type: how a job's ranks split into data, tensor and pipeline groups, and
every rule such a split obeys (after torchtitan's ParallelDims). Torch-free: the planner, the
cost and memory models, plan.json and the trainer's DeviceMesh all use it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelDims:
    """Ranks along each parallel dimension; the job has dp x tp x pp ranks.

    tp is innermost (a tensor-parallel group is consecutive ranks, so with ranks placed node by
    node it stays inside one node's NVLink domain), then pp, then dp: the order
    trainer/engines/mesh.py builds its DeviceMesh in.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a whole number >= 1, got {value!r}")

    @classmethod
    def of_world(cls, world: int, tp: int = 1, pp: int = 1, unit: str = "rank(s)") -> ParallelDims:
        """The dims of `world` ranks with this tp and pp (dp = world / (tp x pp)); ValueError
        names the flags and the fix when tp x pp does not divide the world (of `unit`)."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world size must be a whole number >= 1, got {world!r}")
        cls(tp=tp, pp=pp)  # each flag on its own first
        if world % (tp * pp):
            raise ValueError(
                f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world} {unit}; the "
                f"data-parallel size is world / (tp x pp): pick tp x pp dividing {world}"
            )
        return cls(dp=world // (tp * pp), tp=tp, pp=pp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def node_problem(self, gpus_per_node: int) -> str | None:
        """Why a tensor-parallel group would leave a node of `gpus_per_node` GPUs, or None."""
        if self.tp > gpus_per_node:
            return (
                f"--tp {self.tp} exceeds the {gpus_per_node} GPUs of a node: tensor parallelism "
                f"all-reduces every block's activations and must stay inside a node; use --tp <= "
                f"{gpus_per_node} and add --pp or --fsdp for the rest"
            )
        if gpus_per_node % self.tp:
            return (
                f"--tp {self.tp} does not divide the {gpus_per_node} GPUs of a node, so a tp group"
                f" would straddle two nodes; use a divisor of {gpus_per_node}"
            )
        return None

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    def flags(self, fsdp: bool = False) -> list[str]:
        """Trainer flags that run these dims (dp follows from the world size)."""
        return ["--tp", str(self.tp), "--pp", str(self.pp)] + ["--fsdp"] * fsdp
