"""Where profiles are found: the user's folder ($VITPOD_PROFILES, default
~/.config/vitpod/profiles, where `make profile` writes), then the bundled ones; or a YAML path."""

from __future__ import annotations

import os
from pathlib import Path

from vitpod.workflows.errors import ConfigError

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"
USER_PROFILES_ENV = "VITPOD_PROFILES"
DEFAULT_USER_PROFILES = "~/.config/vitpod/profiles"


def user_profile_dir() -> Path:
    """Where profiles a user makes live (`make profile`): $VITPOD_PROFILES, else
    ~/.config/vitpod/profiles (the package's own folder may be site-packages)."""
    return Path(os.environ.get(USER_PROFILES_ENV) or DEFAULT_USER_PROFILES).expanduser()


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def user_profiles() -> list[str]:
    folder = user_profile_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def known_profiles() -> list[str]:
    """Every name CLUSTER= takes: the user's profiles, then the bundled ones."""
    return sorted({*user_profiles(), *bundled_profiles()})


def profile_path(name_or_path: str) -> Path:
    """`dgxpod` -> the user's dgxpod.yaml ($VITPOD_PROFILES) if there is one, else the bundled
    file; `./my.yaml`, `/abs.yaml`, `x/y.yml` -> that file."""
    if not name_or_path:
        raise ConfigError(f"cluster: give a profile name {known_profiles()} or a YAML path")
    looks_like_path = "/" in name_or_path or name_or_path.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(name_or_path)
    else:
        mine = user_profile_dir() / f"{name_or_path}.yaml"
        path = mine if mine.is_file() else PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        if looks_like_path:
            raise ConfigError(f"cluster: profile file {name_or_path!r} does not exist")
        raise ConfigError(
            f"cluster: unknown profile {name_or_path!r}; bundled: {bundled_profiles()}, yours "
            f"({user_profile_dir()}, ${USER_PROFILES_ENV}): {user_profiles()}; or give a path "
            f"such as CLUSTER=./my.yaml"
        )
    return path
