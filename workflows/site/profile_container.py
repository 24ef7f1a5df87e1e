"""A profile's `container:` block: the image each rank runs in, its mounts and registry login."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vitpod.workflows.site.schema import Strict

# Characters that would break an #SBATCH line or a Slurm filename pattern.
UNSAFE_PATH = re.compile(r'["\n\r%\\]')


class Mount(Strict):
    """One pyxis mount, `{src, dst, readonly}` or pyxis's own `SRC[:DST[:ro|rw]]`; paths start
    with '/' or '.' (relative to the repository, on shared storage):
    workflows/containers/container.py checks pyxis's rules and names the field."""

    src: str
    dst: str
    readonly: bool = False

    @model_validator(mode="before")
    @classmethod
    def _pyxis_form(cls, data: Any) -> Any:
        if not isinstance(data, str):
            return data
        src, *rest = data.split(":")
        if len(rest) > 2 or (len(rest) == 2 and rest[1] not in ("ro", "rw")):
            raise ValueError(f"{data!r}: write SRC:DST or SRC:DST:ro (vitpod passes ro/rw only)")
        return {"src": src, "dst": rest[0] if rest else src, "readonly": rest[1:] == ["ro"]}

    @field_validator("src", "dst")
    @classmethod
    def _safe(cls, value: str) -> str:
        if UNSAFE_PATH.search(value):
            raise ValueError(f"{value!r}: mount paths cannot contain quotes, '%', '\\' or newlines")
        return value


class Credentials(Strict):
    """How enroot logs in to the image's registry: the NAME of the variable holding the password
    (also listed under `secrets`); the user is the image's USER@ (pyxis/enroot syntax)."""

    password: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="a variable NAME")


class Container(Strict):
    """The enroot image each rank runs in (through pyxis); vitpod.workflows.containers.container
    checks it."""

    image: str = Field(
        description="squashfs path (/abs or ./rel) or a registry ref "
        "([USER@]REGISTRY#REPO@sha256:DIGEST, or :TAG)"
    )
    credentials: Credentials | None = Field(
        default=None, description="registry login for the image (password by variable NAME)"
    )
    start_once: bool = Field(
        default=False,
        description="start the container once per node per job (a named container that every "
        "srun step reuses) and record its cold/warm start in container_start.json",
    )
    mounts: list[Mount] = []
    workdir: str = "."
    mount_home: bool = False
    python: str = Field(default="python", description="interpreter in the container")
    name: str | None = Field(default=None, description="--container-name NAME[:FLAG]")
    stack: Literal["image", "venv"] = Field(
        default="image",
        description="what `make container` builds: image = the training stack in the image "
        "(NGC base); venv = a Debian base with the interpreter of `python`'s virtual "
        "environment, which is mounted at the same path (this machine's test image)",
    )
