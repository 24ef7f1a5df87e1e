"""Registry credentials never leave their host: `check_manifest` against real HTTPS/HTTP servers
on this machine that redirect (issue 30: urllib forwarded the Basic-auth header to any host)."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vitpod.workflows.containers import registryref

DIGEST = "sha256:" + "ab" * 32


class _Registry(http.server.BaseHTTPRequestHandler):
    """Answers HEAD/GET: a redirect to `server.target` when set, else 200 with a digest; records
    (method, path, Authorization) of every request it gets."""

    def _answer(self) -> None:
        server = self.server
        server.seen.append((self.command, self.path, self.headers.get("Authorization")))  # type: ignore[attr-defined]
        target = server.target  # type: ignore[attr-defined]
        if target and not self.path.endswith("/here"):
            self.send_response(307)
            self.send_header("Location", target)
        else:
            self.send_response(200)
            self.send_header("Docker-Content-Digest", DIGEST)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = _answer
    do_GET = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost."""
    tmp_path = tmp_path_factory.mktemp("tls")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def servers(certificate, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Two HTTPS servers (the certificate trusted via SSL_CERT_FILE) and one plain HTTP server,
    each on its own port of this machine."""
    cert, key = certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.setenv("VITPOD_TEST_REGISTRY_PW", "s3cret")
    made = {}
    for name, tls in (("registry", True), ("other", True), ("plain", False)):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
        server.seen, server.target = [], None  # type: ignore[attr-defined]
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        made[name] = server
    yield made
    for server in made.values():
        server.shutdown()
        server.server_close()


def _check(servers: dict[str, Any], target: str | None) -> str:
    registry = servers["registry"]
    registry.target = target  # type: ignore[attr-defined]
    port = registry.server_address[1]  # type: ignore[attr-defined]
    ref = registryref.parse(f"vitpod@127.0.0.1:{port}#vitpod/local:latest")
    assert ref is not None
    return registryref.check_manifest(ref, "VITPOD_TEST_REGISTRY_PW")


def _auth(server: object) -> list[str | None]:
    return [auth for _, _, auth in server.seen]  # type: ignore[attr-defined]


def test_no_redirect_sends_the_credentials_to_the_registry(servers):
    assert _check(servers, None) == DIGEST
    (auth,) = _auth(servers["registry"])
    assert auth is not None and auth.startswith("Basic ")


def test_redirect_on_the_same_origin_keeps_the_credentials_and_the_head(servers):
    port = servers["registry"].server_address[1]
    assert _check(servers, f"https://127.0.0.1:{port}/v2/vitpod/local/manifests/here") == DIGEST
    seen = servers["registry"].seen
    assert len(seen) == 2 and all(auth for _, _, auth in seen)
    assert [method for method, _, _ in seen] == ["HEAD", "HEAD"]


@pytest.mark.parametrize(
    ("where", "host"),
    [("other", "localhost"), ("other", "127.0.0.1"), ("plain", "127.0.0.1")],
    ids=["another-host", "another-port", "plain-http"],
)
def test_redirect_to_another_origin_never_carries_the_credentials(servers, where, host):
    target = servers[where]
    scheme = "http" if where == "plain" else "https"
    url = f"{scheme}://{host}:{target.server_address[1]}/v2/vitpod/local/manifests/here"
    assert _check(servers, url) == DIGEST  # the redirect is still followed
    assert _auth(servers["registry"])[0] is not None  # the registry itself got them
    assert _auth(target) == [None]
