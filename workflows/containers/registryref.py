"""Registry images: parse pyxis/enroot references and check one on the registry before submitting.

enroot (src/docker.sh, doc/cmd/import.md) reads `docker://[USER@][REGISTRY#]IMAGE[:TAG|@DIGEST]`
and also `[USER@]REGISTRY/IMAGE[@DIGEST]` when the first part has a '.' or ':'; pyxis passes
its `--container-image` to enroot as `docker://<value>`. enroot looks up a password only for
the USER in the reference: its credentials file (netrc) line is `machine HOST login USER
password $VAR`, HOST without the port, and a password starting with '$' is read from the
environment when enroot imports, so vitpod's file holds the variable's NAME, never its value.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from vitpod.workflows.errors import ConfigError

DOCKER_HUB = "registry-1.docker.io"
MANIFEST_TYPES = ", ".join(
    (
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
    )
)
CHECK_TIMEOUT_S = 10
_REF = re.compile(
    r"^(?:(?P<registry>[^#/@]+)#)?"
    r"(?P<repo>[a-z0-9/._-]+)(?::(?P<tag>[A-Za-z0-9._-]+))?(?:@(?P<digest>[^@]+))?$"
)
_USER = re.compile(r"^[A-Za-z0-9_.~+$-]+$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class RegistryRef:
    """One image on a registry: where, which repository, and a tag or a digest."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None
    user: str | None

    @property
    def host(self) -> str:
        """The registry without its port: what enroot and curl match in the credentials file."""
        return self.registry.rsplit(":", 1)[0]

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    def manifest_url(self) -> str:
        return f"https://{self.registry}/v2/{self.repository}/manifests/{self.reference}"


def parse(image: str) -> RegistryRef | None:
    """The reference pyxis would pull, or None for a squashfs file ('/' or '.'); ConfigError
    (naming container.image) for what enroot could not parse."""
    if image.startswith(("/", ".")):
        return None
    value = image.removeprefix("docker://")
    user = None
    head, at, rest = value.partition("@")
    if at and not rest.startswith("sha256:") and not set("/#") & set(head):
        user, value = head, rest
    first, slash, path = value.partition("/")
    if "#" not in value and slash and ("." in first or ":" in first):
        value = f"{first}#{path}"  # docker's form REGISTRY/IMAGE, first part a host
    m = _REF.match(value)
    if not m:
        raise ConfigError(
            f"container.image: {image!r} is not an image reference enroot reads; write "
            "[USER@]REGISTRY#REPOSITORY@sha256:<64 hex> (or :TAG)"
        )
    digest = m["digest"]
    if digest is not None and not _DIGEST.match(digest):
        raise ConfigError(
            f"container.image: {image!r}: the digest {digest!r} is not sha256:<64 hex digits>; "
            "copy it from the line `make container PUSH=1` prints"
        )
    registry, repo = m["registry"], m["repo"]
    if registry is None:
        registry = DOCKER_HUB
        repo = repo if "/" in repo else f"library/{repo}"
    if user is not None and not _USER.match(user):
        raise ConfigError(f"container.image: {image!r}: {user!r} is not a registry user name")
    return RegistryRef(registry, repo, m["tag"], digest, user)


def check_manifest(ref: RegistryRef, password_env: str) -> str:
    """An authenticated HEAD of the image's manifest with the password from $password_env;
    returns the manifest digest. One ConfigError line naming the problem and the fix for an
    unset variable, a wrong password, a missing tag or digest, a refused TLS certificate or an
    unreachable registry. The password is never printed."""
    where = f"{ref.registry}/{ref.repository}@{ref.reference}"
    password = os.environ.get(password_env, "")
    if not ref.user:
        raise ConfigError(
            f"container.image: {where}: name the registry user in the image "
            f"(USER@{ref.registry}#{ref.repository}...): enroot reads a password only for it"
        )
    if not password:
        raise ConfigError(
            f"container.credentials.password: ${password_env} is not set; export it (for the "
            "local registry: source .slurm/registry.env) before submitting"
        )
    token = base64.b64encode(f"{ref.user}:{password}".encode()).decode()
    request = urllib.request.Request(
        ref.manifest_url(),
        method="HEAD",
        headers={"Authorization": f"Basic {token}", "Accept": MANIFEST_TYPES},
    )
    opener = urllib.request.build_opener(
        urllib.request.HTTPSHandler(context=ssl.create_default_context()), _SameOriginAuth()
    )
    try:
        with opener.open(request, timeout=CHECK_TIMEOUT_S) as response:
            return str(response.headers.get("Docker-Content-Digest") or ref.digest or "")
    except urllib.error.HTTPError as exc:
        raise ConfigError(_http_problem(exc.code, ref, where, password_env)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLError):
            raise ConfigError(
                f"container.image: {where}: the registry's TLS certificate is not trusted "
                f"({reason}); install its CA in the system store (make slurm-up does for the "
                "local registry)"
            ) from None
        raise ConfigError(
            f"container.image: registry {ref.registry} is unreachable ({reason}); start it "
            "(make slurm-up for the local one) or fix the registry in the profile"
        ) from None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"https": 443, "http": 80}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or default


class _SameOriginAuth(urllib.request.HTTPRedirectHandler):
    """Follow a registry's redirect, but send the credentials only to the origin they were
    given for: urllib copies every header to the new URL, so another host (or port), or the
    same host over plain http, would receive the Basic-auth password."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            if _origin(new.full_url) != _origin(req.full_url):
                new.remove_header("Authorization")
            if req.get_method() == "HEAD":
                new.method = "HEAD"
        return new


def _http_problem(code: int, ref: RegistryRef, where: str, password_env: str) -> str:
    if code == 401:
        return (
            f"container.credentials: the registry {ref.registry} refused user {ref.user!r} "
            f"with the password in ${password_env} (HTTP 401); fix ${password_env} (for the "
            "local registry: source .slurm/registry.env)"
        )
    if code == 404:
        return (
            f"container.image: {where} does not exist on the registry (HTTP 404); push it with "
            "`make container PUSH=1 CLUSTER=<profile>` or copy the digest it printed"
        )
    return f"container.image: {where}: the registry answered HTTP {code}"


def credentials_line(ref: RegistryRef, password_env: str) -> str:
    """enroot's credentials line for `ref`: the password is `$NAME`, read when enroot imports."""
    return f"machine {ref.host} login {ref.user} password ${password_env}"


def push_record(path: str) -> dict[str, object] | None:
    """What `make container PUSH=1` recorded about a push (None when it did not)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
