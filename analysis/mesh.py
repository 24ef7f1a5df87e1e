"""The (dp, tp, pp) layout of a training job: a plain, torch-free value shared by the planners."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    """Ranks along each parallel dimension; the job has dp x tp x pp ranks.

    tp is innermost (a tensor-parallel group is consecutive ranks, so it stays in one node),
    then pp, then dp: the order trainer/mesh.py builds its DeviceMesh in.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a whole number >= 1, got {value!r}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    def flags(self, fsdp: bool = False) -> list[str]:
        """Trainer flags that run this layout (dp follows from the world size)."""
        out = ["--tp", str(self.tp), "--pp", str(self.pp)]
        return out + ["--fsdp"] * fsdp
